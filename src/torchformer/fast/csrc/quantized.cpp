// Products y = x W^T over int8 and int4 weights with integer dot products, as llama.cpp runs its
// Q8_0 / Q4_0 files: each row of x is quantized to int8 on the fly, per block of B inputs (B = 32,
// or the largest power of two dividing both the weight's group and 32), and the weights meet it in
// 32-bit integer sums, one scale multiply per block instead of one FMA per weight.
//
// Why: a decode step reads every weight once, and widening each int8 / int4 weight to fp32 in
// registers (what these products did before) costs 3-4 instructions per 16 weights, so int4 read
// ~5.5 GB/s on one core here, bound by instructions rather than memory. An integer dot product does
// 64 multiply-adds in one instruction (AVX512-VNNI `vpdpbusd`; two, `vpmaddubsw` + `vpmaddwd`, on a
// CPU without VNNI). The VNNI variant is picked once per process from the CPU (`vnni()`).
//
// Layout (fast/formats.py writes it): panels of 16 output rows, as kernels.cpp's, each one
// sequential stream; in a panel, each 64-byte line holds the 16 outputs' weights for a few
// consecutive inputs, 4 bytes per output (one 32-bit lane of a register):
//   int8: inputs k..k+3, one byte each, q + 128;
//   int4: inputs k..k+7, byte i holding input k+i (low nibble) and k+4+i (high nibble), each q + 8.
// `vpdpbusd` multiplies unsigned by signed bytes, so the weights are stored unsigned (q + 8, q +
// 128) and x signed: a block's sum is sum((q + c) x) = sum(q x) + c sum(x), corrected once per
// block with the block's sum of x. Without VNNI, `vpmaddubsw`'s 16-bit pair sums would overflow
// for (q + 128) x (2 * 255 * 127 > 32767), so int8 flips back to signed q and takes |x| with the
// sign moved onto the weight (negated where x < 0): exact, 2 * 127 * 127 < 32767.
//
// Asymmetric int4 (llama.cpp's Q4_K: w = s * u - m per group, u in [0, 15] the nibble as stored):
// sum_k x_k w_k = s * sum(x_q u) - m * sum(x_q) per group, so `int4_min_mm` takes the nibbles
// without the offset and subtracts, once per group and row, the group's minimum times the rounded
// x's sum, which the quantization of x computes anyway. A format flag (Int4Min::MIN) compiles that
// in; the symmetric kernels are unchanged.
//
// Scales come as fp32 or as f16, which fast/formats.py keeps where f16 holds every scale exactly
// (GGUF's Q8_0 / Q4_0 / Q5_0 block scales are f16): int8 group 32 then reads 1 + 2/32 bytes a
// weight instead of 1 + 4/32, int4 group 32 0.5 + 2/32 instead of 0.5 + 4/32; one widening
// instruction per 16 scales.
//
// Numerics: the weights are exactly the reference module's q and scales; the activations are
// rounded to 8 bits per block of B inputs (scale max|x| / 127), the one approximation, as in
// llama.cpp. Integer sums are exact; each block's sum is scaled in fp32.
//
// Streams and blocking as in kernels.cpp: up to 8 rows of x take all of K in one pass
// with their sums in registers; more rows go 8 at a time over K blocks of ~16 KB per panel, which
// the later row groups re-read from L1/L2; each panel stream is prefetched 4 KB ahead.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t LINE = 64;
constexpr int64_t AHEAD = 4096;
constexpr int64_t BLOCK_BYTES = 16384;

inline void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// Whether to run the VNNI copies: the CPU has AVX512-VNNI and TORCHFORMER_VNNI is not 0 (the
// tests run the other copies on a VNNI machine through it).
bool vnni() {
  static const bool has = [] {
    const char* env = std::getenv("TORCHFORMER_VNNI");
    return __builtin_cpu_supports("avx512vnni") && !(env && std::string(env) == "0");
  }();
  return has;
}

// x rows quantized per block of B inputs.
struct Acts {
  const int8_t* q;      // (R, K)
  const float* scale;   // (R, K / B): max|x| / 127 of the block (0 for an all-zero block)
  const int32_t* bias;  // (R, K / B): what the block's integer sum overcounts (int4: 8 * sum q)
  const float* sum;     // (R, K / B): s * sum q, the rounded block's sum (formats with a minimum only)
  int64_t K, B;
};

// One row r: q = round(x / s) with s = max|x| / 127 per block; offset * sum(q) per block, and
// s * sum(q) where `sum` is given.
void quantize_row(const float* x, int64_t K, int64_t B, int32_t offset, int8_t* q, float* scale, int32_t* bias,
                  float* xsum) {
  for (int64_t b = 0; b < K / B; ++b) {
    const float* xb = x + b * B;
    float amax = 0.f;
    int64_t k = 0;
    if (B % 16 == 0) {
      __m512 m = _mm512_setzero_ps();
      for (; k < B; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + k)));
      amax = _mm512_reduce_max_ps(m);
    } else {
      for (; k < B; ++k) amax = std::max(amax, std::fabs(xb[k]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    scale[b] = amax / 127.f;
    int32_t sum = 0;
    if (B % 16 == 0) {
      __m512i s = _mm512_setzero_si512();
      for (k = 0; k < B; k += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k), _mm512_set1_ps(inv)));
        s = _mm512_add_epi32(s, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * B + k), _mm512_cvtsepi32_epi8(v));
      }
      sum = _mm512_reduce_add_epi32(s);
    } else {
      for (k = 0; k < B; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        q[b * B + k] = static_cast<int8_t>(v);
        sum += v;
      }
    }
    bias[b] = offset * sum;
    if (xsum) xsum[b] = scale[b] * static_cast<float>(sum);
  }
}

struct Weights {
  const uint8_t* panels;  // P panels of K / KL lines
  const void* scale;      // (P, K / G, 16) fp32, or f16 (the kernels' S)
  const float* minimum;   // (P, K / G, 16): what a group subtracts per unit of x (formats with MIN only)
  int64_t K, G;           // G: inputs per weight scale (K for one scale per row)
};

namespace plain {
#include "quantized_kernels.inc"
}  // namespace plain

// The same kernels with VNNI's `vpdpbusd` (module comment); run only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace with_vnni {
#include "quantized_kernels.inc"
}  // namespace with_vnni
#pragma GCC pop_options

// The activation block: 32 inputs, or the largest power of two dividing both the group and 32.
int64_t act_block(int64_t K, int64_t G) { return std::gcd<int64_t>(std::gcd<int64_t>(32, G), K); }

template <class F, class FV>  // the format's plain and VNNI copies; minimum: defined for F::MIN only
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale,
                      const torch::Tensor& minimum, int64_t N, int64_t G, const char* name) {
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, name,
              ": x must be (R, K) contiguous fp32");
  TORCH_CHECK(K % F::KL == 0 && G % F::KL == 0 && K % G == 0, name, ": K and the group must be multiples of ",
              F::KL, ", the group dividing K");
  const int64_t P = (N + LANES - 1) / LANES;
  TORCH_CHECK(wp.is_contiguous() && wp.numel() * wp.element_size() == P * (K / F::KL) * LINE, name,
              ": the panels do not match N and K");
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && scale.is_contiguous() &&
                  scale.numel() == P * (K / G) * LANES,
              name, ": scale must be fp32 or f16 (P, K / group, 16)");
  TORCH_CHECK(!(half && F::MIN), name, ": scale must be fp32");
  TORCH_CHECK(!F::MIN || (minimum.scalar_type() == at::kFloat && minimum.is_contiguous() &&
                          minimum.numel() == P * (K / G) * LANES),
              name, ": minimum must be fp32 (P, K / group, 16)");
  const int64_t B = act_block(K, G);
  auto q = torch::empty({R, K}, x.options().dtype(at::kChar));
  auto xs = torch::empty({R, K / B}, x.options());
  auto bias = torch::empty({R, K / B}, x.options().dtype(at::kInt));
  const torch::Tensor sums = torch::empty({F::MIN ? R : 0, K / B}, x.options());
  float* sp = F::MIN ? sums.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const int32_t offset = F::offset(vnni());
  for (int64_t r = 0; r < R; ++r)
    quantize_row(xp + r * K, K, B, offset, q.data_ptr<int8_t>() + r * K, xs.data_ptr<float>() + r * (K / B),
                 bias.data_ptr<int32_t>() + r * (K / B), sp ? sp + r * (K / B) : nullptr);
  auto out = torch::empty({R, N}, x.options());
  const Weights wt{static_cast<const uint8_t*>(wp.data_ptr()), scale.data_ptr(),
                   F::MIN ? minimum.data_ptr<float>() : nullptr, K, G};
  const Acts a{q.data_ptr<int8_t>(), xs.data_ptr<float>(), bias.data_ptr<int32_t>(), sp, K, B};
  float* o = out.data_ptr<float>();
  if constexpr (F::MIN) {  // fp32 scales only (checked above): one copy fewer to compile
    if (vnni())
      with_vnni::run<FV, true, float>(wt, a, R, N, o);
    else
      plain::run<F, false, float>(wt, a, R, N, o);
  } else if (half) {
    if (vnni())
      with_vnni::run<FV, true, uint16_t>(wt, a, R, N, o);
    else
      plain::run<F, false, uint16_t>(wt, a, R, N, o);
  } else {
    if (vnni())
      with_vnni::run<FV, true, float>(wt, a, R, N, o);
    else
      plain::run<F, false, float>(wt, a, R, N, o);
  }
  return out;
}

}  // namespace

// x (R, K) fp32; panels (P, K / 4, 16, 4) uint8 (q + 128); scale (P, K / group, 16) fp32 or f16 -> (R, N) fp32.
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int8_mm: panels must be uint8 (q + 128)");
  return product<plain::Int8, with_vnni::Int8>(x, wp, scale, torch::Tensor(), N, group, "int8_mm");
}

// x (R, K) fp32; panels (P, K / 8, 16, 4) uint8 (two inputs per byte); scale (P, K / group, 16) fp32 or f16.
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int4_mm: panels must be uint8");
  return product<plain::Int4, with_vnni::Int4>(x, wp, scale, torch::Tensor(), N, group, "int4_mm");
}

// As int4_mm over nibbles u (no offset: w = scale * u - minimum per group); minimum (P, K / group, 16).
torch::Tensor int4_min_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale,
                          const torch::Tensor& minimum, int64_t N, int64_t group) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int4_min_mm: panels must be uint8");
  return product<plain::Int4Min, with_vnni::Int4Min>(x, wp, scale, minimum, N, group, "int4_min_mm");
}

bool has_vnni() { return vnni(); }

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("int8_mm(Tensor x, Tensor panels, Tensor scale, int n, int group) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor panels, Tensor scale, int n, int group) -> Tensor");
  m.def("int4_min_mm(Tensor x, Tensor panels, Tensor scale, Tensor minimum, int n, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm", &int4_mm);
  m.impl("int4_min_mm", &int4_min_mm);
}
