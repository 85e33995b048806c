// Interleaved int8 / int4 panels (quantized.cpp's layout) back to bf16, transposed: W^T (K, n) for a
// block of panels, so that a prefill on a CPU with bf16 matrix units (AMX) multiplies x by it in
// oneDNN's bf16 product (fast/quant_panels.py `bf16_product`), block by block, never the whole
// model. Why: the integer kernels run a 512-token prefill at ~26% of the VNNI peak, and AMX-BF16
// takes the same product ~3x faster than they do (RESULTS.md, the 1B table on the Intel Xeon).
//
// In W^T a panel's 16 outputs lie side by side for each input, so each 64-byte line (16 outputs x 4
// bytes) is regrouped once (`vpermb`: byte i of every output into 128-bit lane i), and each lane
// becomes one row's 16 values: widened, (u - offset) * scale in one FMA, rounded to bf16
// (`vcvtneps2bf16`), one 32-byte store. Needs AVX512-VBMI and AVX512-BF16 (`dequant_ready`).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t LINE = 64;
constexpr int64_t MAX_WAYS = 4;  // the most panels an interleaved group holds (quantized.cpp's WAYS, `panel_ways`)

bool ready() {
#if defined(__AVX512F__)
  static const bool ok = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// bits 4: a line holds inputs k..k+7, byte i of an output's 4 holding input i (low nibble) and i + 4
// (high); bits 8: inputs k..k+3, byte i input i. Stored u = q + 8 / q + 128. S: the scales' type.
#pragma GCC push_options
#pragma GCC target("avx512vbmi,avx512bf16")
template <int BITS, class S>
void group_t(const uint8_t* p, int64_t w, int64_t K, int64_t G, uint16_t* out, int64_t ldo) {
  constexpr int64_t KL = BITS == 4 ? 8 : 4;
  alignas(64) static const uint8_t order[64] = {
#define O(i) 0 + i, 4 + i, 8 + i, 12 + i, 16 + i, 20 + i, 24 + i, 28 + i, 32 + i, 36 + i, 40 + i, 44 + i, 48 + i, \
             52 + i, 56 + i, 60 + i
      O(0), O(1), O(2), O(3)
#undef O
  };
  const __m512i idx = _mm512_load_si512(order);
  const int64_t units = G / KL * w * LINE, sbytes = LANES * static_cast<int64_t>(sizeof(S));
  const int64_t group = units + w * sbytes;
  for (int64_t kg = 0; kg < K / G; ++kg) {
    const uint8_t* blk = p + kg * group;
    __m512 s[MAX_WAYS], off[MAX_WAYS];
    for (int64_t j = 0; j < w; ++j) {
      const S* sp = reinterpret_cast<const S*>(blk + units + j * sbytes);
      if constexpr (sizeof(S) == 2)
        s[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      else
        s[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(sp));
      off[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(BITS == 4 ? -8.f : -128.f));
    }
    // unit by unit, the group's w panels side by side: each row of W^T gets w * 32 contiguous bytes
    for (int64_t u = 0; u < G / KL; ++u) {
      const int64_t k0 = kg * G + u * KL;
      for (int64_t j = 0; j < w; ++j) {
        const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(blk + (u * w + j) * LINE));
        const __m512i nib = _mm512_set1_epi8(0x0F);
        const __m512i lo = BITS == 4 ? _mm512_and_si512(v, nib) : v;
        // lane I of `part` (input I's 16 bytes) -> row k of W^T, 16 bf16 values at column j * 16
        auto row = [&]<int I>(__m512i part, int64_t k) {
          const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(part, I));
          const __m256bh r = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s[j], off[j]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * ldo + j * LANES), reinterpret_cast<const __m256i&>(r));
        };
        row.template operator()<0>(lo, k0);
        row.template operator()<1>(lo, k0 + 1);
        row.template operator()<2>(lo, k0 + 2);
        row.template operator()<3>(lo, k0 + 3);
        if constexpr (BITS == 4) {
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          row.template operator()<0>(hi, k0 + 4);
          row.template operator()<1>(hi, k0 + 5);
          row.template operator()<2>(hi, k0 + 6);
          row.template operator()<3>(hi, k0 + 7);
        }
      }
    }
  }
}
#pragma GCC pop_options
#endif

template <int BITS, class S>
void run(const uint8_t* panels, int64_t stream, int64_t P, int64_t K, int64_t G, int64_t ways, int64_t p0,
         int64_t p1, uint16_t* out, int64_t ldo) {
#if defined(__AVX512F__)
  at::parallel_for(p0 / ways, (p1 + ways - 1) / ways, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const int64_t w = std::min<int64_t>(ways, P - g * ways);
      group_t<BITS, S>(panels + g * ways * stream, w, K, G, out + (g * ways - p0) * LANES, ldo);
    }
  });
#endif
}

}  // namespace

// panels: interleaved int8 (bits 8) or int4 (bits 4) panels with their one-level scales inside, of an
// n x k weight, group `group`; scale: the empty tensor that gives the scales' dtype (fp32 or f16).
// Writes W^T of panels [p0, p1) (whole groups of `ways`, the panels' interleaving) into the first
// 16 (p1 - p0) columns of `out` (k, m) bf16: a buffer the caller reuses block after block (a fresh
// one a block cost its page faults: the 1B down's W^T 19.5 ms against 5.8 in reused memory).
void dequant_t(torch::Tensor& out, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n, int64_t k,
               int64_t group, int64_t bits, int64_t ways, int64_t p0, int64_t p1) {
  TORCH_CHECK(ready(), "dequant_t: needs AVX512-VBMI and AVX512-BF16");
  TORCH_CHECK(bits == 4 || bits == 8, "dequant_t: bits must be 4 or 8, got ", bits);
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scale.scalar_type() == at::kFloat, "dequant_t: scale must be fp32 or f16");
  const int64_t KL = bits == 4 ? 8 : 4, P = (n + LANES - 1) / LANES;
  TORCH_CHECK(group % KL == 0 && k % group == 0, "dequant_t: the group must be a multiple of ", KL, " dividing k");
  const int64_t stream = k / KL * LINE + k / group * LANES * scale.element_size();
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && panels.numel() == P * stream,
              "dequant_t: the panels do not match n, k and the group (interleaved, with their scales)");
  TORCH_CHECK(1 < ways && ways <= MAX_WAYS, "dequant_t: ways must be 2 to ", MAX_WAYS, " (interleaved panels), got ",
              ways);
  TORCH_CHECK(0 <= p0 && p0 < p1 && p1 <= P && p0 % ways == 0 && (p1 % ways == 0 || p1 == P),
              "dequant_t: panels [p0, p1) must lie in [0, ", P, ") in whole groups of ", ways, ", got [", p0, ", ",
              p1, ")");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == k &&
                  out.size(1) >= (p1 - p0) * LANES,
              "dequant_t: out must be a contiguous bf16 (k, m) tensor, m >= ", (p1 - p0) * LANES);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* p = panels.data_ptr<uint8_t>();
  const int64_t ldo = out.size(1);
  const auto go = [&](auto f) { f(p, stream, P, k, group, ways, p0, p1, o, ldo); };  // each panel's bytes: `stream`
  if (bits == 4)
    half ? go(run<4, uint16_t>) : go(run<4, float>);
  else
    half ? go(run<8, uint16_t>) : go(run<8, float>);
}

bool dequant_ready() { return ready(); }

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("dequant_ready() -> bool", &dequant_ready);
  m.def("dequant_t(Tensor(a!) out, Tensor panels, Tensor scale, int n, int k, int group, int bits, int ways, "
        "int p0, int p1) -> ()");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) { m.impl("dequant_t", &dequant_t); }
