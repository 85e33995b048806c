// Products y = x W^T over weights stored in their compact formats, with fp32 activations and fp32
// sums: int8 (one scale per output row) and int4 (two values per byte, one scale per group of G
// inputs) packed in panels of 16 output rows (fast/formats.py), and bf16 in its own layout (below).
//
// The panel layout is kernels.cpp's: panel p holds outputs 16p..16p+15 and, for each input index k,
// their 16 weights side by side, so one panel is one sequential stream and each input value is one
// broadcast FMA into 16 outputs (no horizontal sums). What differs is the load: the 16 weights of
// one k are widened to fp32 in registers as they are read (int8: sign extension then conversion;
// int4: two k's per byte, each nibble looked up in a table of the 16 values, the group's scales
// applied to the group's sums). No fp32 copy of a weight is ever written: decoding reads the
// compact bytes only, which is the whole point of storing them (a one-row product is bound by them).
// The activations are not quantized: int8 and int4 products equal x times the dequantized weight
// (q * s) up to the order of fp32 sums, the same numerics as the reference modules in nn/quant.py.
//
// Streams and blocking as in kernels.cpp: up to 8 rows take all of K in one pass with the
// accumulators in registers (two panels at a time below 5 rows, to hide FMA latency); more rows go
// 8 at a time over K blocks of ~16 KB of weights per panel, which the later row groups re-read
// from L1/L2. Each panel stream is prefetched 4 KB ahead into L2 (the hardware prefetcher stops at
// every 4 KB page), and a pair's last lines prefetch the next pair's first ones.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t LINE = 64;           // bytes per cache line
constexpr int64_t AHEAD = 4096;        // prefetch distance in bytes per panel stream
constexpr int64_t BLOCK_BYTES = 16384; // K block per panel when rows > 8

inline void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// Each format: STEP k's per load of BYTES bytes of one panel; GROUPED: sums per group of `group`
// inputs, scaled by the group's 16 scales when the group ends (int4); otherwise a row scale or
// none at the store.
struct Int8 {
  static constexpr int64_t STEP = 1, BYTES = 16;
  static constexpr bool GROUPED = false;
  const float* scale;  // (P * 16,) one per output row, applied at the store
  int64_t group, groups;
  static inline void load(const uint8_t* p, __m512* w) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// Byte n of step j of a panel: low nibble = input 2j of output n, high nibble = input 2j + 1,
// each q + 8 for q in [-8, 7]. One permute looks the value q up from a 16-float table (it reads
// only an index's low 4 bits, so the low nibble needs no mask); the group's scales multiply the
// group's sums once, when the group ends, not every weight.
struct Int4 {
  static constexpr int64_t STEP = 2, BYTES = 16;
  static constexpr bool GROUPED = true;
  const float* scale;  // (P, K / group, 16)
  int64_t group, groups;  // inputs per scale; K / group scale rows per panel
  inline __m512 scales(int64_t panel_index, int64_t k) const {
    return _mm512_loadu_ps(scale + (panel_index * groups + k / group) * LANES);
  }
  static inline void load(const uint8_t* p, __m512* w) {
    const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_permutexvar_ps(bytes, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
  }
};

// M rows x NP panels over inputs [k0, k1) (whole lines; whole groups for a grouped format).
template <class F, int M, int NP, bool PF>
inline void panels(const F& f, const float* x, int64_t ldx, const uint8_t* p, int64_t panel_index, int64_t K,
                   int64_t k0, int64_t k1, float* out, int64_t ldo, int64_t n0, int64_t nvalid_last,
                   bool accumulate, const uint8_t* next) {
  constexpr int64_t STEPS_PER_LINE = LINE / F::BYTES;
  constexpr int64_t K_PER_LINE = STEPS_PER_LINE * F::STEP;
  const int64_t stream = K / F::STEP * F::BYTES;  // bytes per panel
  __m512 acc[NP][M], part[NP][M];  // part: the current group's sums (grouped formats)
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const int64_t g = F::GROUPED ? f.group : k1 - k0;
  for (int64_t kg = k0; kg < k1; kg += g) {
    __m512(&sums)[NP][M] = F::GROUPED ? part : acc;
    if (F::GROUPED)
      for (int j = 0; j < NP; ++j)
        for (int m = 0; m < M; ++m) part[j][m] = _mm512_setzero_ps();
    const int64_t kend = std::min(k1, kg + g);
    for (int64_t k = kg; k < kend; k += K_PER_LINE) {
      const int64_t off = k / F::STEP * F::BYTES;  // this line's offset in each panel stream
      if (PF) {
        if (off + AHEAD < stream) {
          for (int j = 0; j < NP; ++j) prefetch_l2(p + j * stream + off + AHEAD);
        } else if (next) {
          for (int j = 0; j < 2; ++j) prefetch_l2(next + j * stream + off + AHEAD - stream);
        }
      }
      for (int64_t t = 0; t < STEPS_PER_LINE; ++t) {
        __m512 w[NP][F::STEP];
        for (int j = 0; j < NP; ++j) F::load(p + j * stream + off + t * F::BYTES, w[j]);
        const int64_t kk = k + t * F::STEP;
        for (int64_t i = 0; i < F::STEP; ++i)
          for (int m = 0; m < M; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + kk + i]);
            for (int j = 0; j < NP; ++j) sums[j][m] = _mm512_fmadd_ps(w[j][i], xb, sums[j][m]);
          }
      }
    }
    if constexpr (F::GROUPED) {
      for (int j = 0; j < NP; ++j) {
        const __m512 sc = f.scales(panel_index + j, kg);
        for (int m = 0; m < M; ++m) acc[j][m] = _mm512_fmadd_ps(part[j][m], sc, acc[j][m]);
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t valid = j == NP - 1 ? nvalid_last : LANES;
    const __mmask16 mask = valid == LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    constexpr bool row_scale = std::is_same<F, Int8>::value;
    const __m512 sc = row_scale ? _mm512_loadu_ps(f.scale + (panel_index + j) * LANES) : _mm512_set1_ps(1.f);
    for (int m = 0; m < M; ++m) {
      float* dst = out + m * ldo + n0 + j * LANES;
      __m512 v = row_scale ? _mm512_mul_ps(acc[j][m], sc) : acc[j][m];
      if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
      _mm512_mask_storeu_ps(dst, mask, v);
    }
  }
}

template <class F, int M, bool PF>
void rows(const F& f, const float* x, int64_t ldx, const uint8_t* wp, int64_t K, int64_t k0, int64_t k1, float* out,
          int64_t N, int64_t pb, int64_t pe, bool accumulate, const uint8_t* next) {
  const int64_t stream = K / F::STEP * F::BYTES;
  constexpr int NP = M <= 4 ? 2 : 1;  // two panels in flight while few rows leave registers free
  int64_t p = pb;
  for (; p + NP <= pe; p += NP) {
    const int64_t last = std::min<int64_t>(LANES, N - (p + NP - 1) * LANES);
    const uint8_t* after = p + NP < pe ? wp + (p + NP) * stream : next;
    panels<F, M, NP, PF>(f, x, ldx, wp + p * stream, p, K, k0, k1, out, N, p * LANES, last, accumulate, after);
  }
  if (p < pe) {
    const int64_t last = std::min<int64_t>(LANES, N - p * LANES);
    panels<F, M, 1, PF>(f, x, ldx, wp + p * stream, p, K, k0, k1, out, N, p * LANES, last, accumulate, next);
  }
}

template <class F, bool PF>
using RowsFn = void (*)(const F&, const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t,
                        int64_t, int64_t, bool, const uint8_t*);

template <class F, bool PF>
RowsFn<F, PF> rows_for(int64_t m) {
  switch (m) {
    case 1: return rows<F, 1, PF>;
    case 2: return rows<F, 2, PF>;
    case 3: return rows<F, 3, PF>;
    case 4: return rows<F, 4, PF>;
    case 5: return rows<F, 5, PF>;
    case 6: return rows<F, 6, PF>;
    case 7: return rows<F, 7, PF>;
    default: return rows<F, 8, PF>;
  }
}

// x (R, K) fp32 contiguous; wp: P panels of K / STEP * BYTES bytes each -> (R, N) fp32.
template <class F>
torch::Tensor product(const F& f, const torch::Tensor& x, const torch::Tensor& wp, int64_t N, int64_t K) {
  const int64_t R = x.size(0);
  const int64_t stream = K / F::STEP * F::BYTES;
  const int64_t P = (N + LANES - 1) / LANES;
  TORCH_CHECK(wp.numel() == P * stream, "formats: the packed weight does not match N and K");
  auto out = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = static_cast<const uint8_t*>(wp.data_ptr());
  float* o = out.data_ptr<float>();
  // K blocks (rows > 8) hold whole lines and whole groups.
  int64_t kb = K;
  if (R > 8) {
    const int64_t unit = std::max<int64_t>(F::GROUPED ? f.group : 1, LINE / F::BYTES * F::STEP);
    kb = std::max<int64_t>(unit, BLOCK_BYTES / F::BYTES * F::STEP / unit * unit);
  }
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t b, int64_t e) {
    const int64_t end = std::min<int64_t>(P, e * 2);
    for (int64_t pb = b * 2; pb < end; pb += 2) {
      const int64_t pe = std::min<int64_t>(end, pb + 2);
      const uint8_t* next = pe < P ? w + pe * stream : nullptr;
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = std::min<int64_t>(K, k0 + kb);
        for (int64_t m0 = 0; m0 < R; m0 += 8) {
          const int64_t mr = std::min<int64_t>(8, R - m0);
          if (m0 == 0)  // only the first row group meets the block in DRAM
            rows_for<F, true>(mr)(f, xp + m0 * K, K, w, K, k0, k1, o + m0 * N, N, pb, pe, k0 > 0, next);
          else
            rows_for<F, false>(mr)(f, xp + m0 * K, K, w, K, k0, k1, o + m0 * N, N, pb, pe, k0 > 0, nullptr);
        }
      }
    }
  });
  return out;
}

void check_x(const torch::Tensor& x, int64_t K, int64_t multiple, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K,
              name, ": x must be (R, K) contiguous fp32 with the weight's K");
  TORCH_CHECK(K % multiple == 0, name, ": K must be a multiple of ", multiple);
}

}  // namespace

// x (R, K) fp32; panels (P, K, 16) int8; scale (P * 16,) fp32 -> (R, N) fp32.
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N) {
  const int64_t K = x.size(1);
  check_x(x, K, 4, "int8_mm");
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.is_contiguous(), "int8_mm: panels must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == (N + 15) / 16 * 16,
              "int8_mm: scale must be fp32 with one value per padded output row");
  return product(Int8{scale.data_ptr<float>(), 0, 0}, x, wp, N, K);
}

// x (R, K) fp32; panels (P, K / 2, 16) uint8 (two inputs per byte); scale (P, K / G, 16) fp32.
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group) {
  const int64_t K = x.size(1);
  check_x(x, K, 8, "int4_mm");
  TORCH_CHECK(group % 8 == 0 && K % group == 0, "int4_mm: the group must be a multiple of 8 dividing K");
  TORCH_CHECK(wp.scalar_type() == at::kByte && wp.is_contiguous(), "int4_mm: panels must be contiguous uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == (N + 15) / 16 * (K / group) * 16,
              "int4_mm: scale must be fp32 (P, K / group, 16)");
  return product(Int4{scale.data_ptr<float>(), group, K / group}, x, wp, N, K);
}

// bf16 weights in their own (N, K) layout: no packed copy, so a bf16 model keeps one copy of its
// weights and its Parameters (training, state dict) are untouched. The weight is read one row at a
// time, front to back: the rows of an (N, K) matrix are contiguous, so a thread's share is ONE
// sequential stream, which the hardware prefetcher follows at full speed. Tiles of several weight
// rows (8 streams K apart) read at about half that on one core (measured on the toy shape's 43
// matrices, one thread, best of 3: 8-row tiles 5.6-7.9 ms, one row at a time 4.1-4.6 ms).
// Each 64-byte load holds 32 bf16 weights; a bf16 is the top half of an fp32, so the even ones
// are the word shifted left by 16 and the odd ones the word with its low half cleared: two ALU
// ops and two FMAs per 32 weights, against x split the same way (split_pairs). Up to 8 rows of x
// meet each weight row while it is in L1; more rows go 8 at a time over blocks of weight rows
// that the later groups re-read from L2.
namespace {

constexpr int64_t PAIR = 32;  // bf16 weights per 64-byte load

// x (R, K) fp32 -> (R, Kp), Kp = K rounded up to 32: each 32-chunk as its 16 even-indexed values,
// then its 16 odd-indexed ones, zero-padded past K.
void split_pairs(const float* x, int64_t R, int64_t K, float* xs, int64_t Kp) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    float* out = xs + r * Kp;
    for (int64_t k = 0; k < Kp; ++k) {
      const int64_t c = k / PAIR * PAIR, j = k - c;  // chunk start, index within it
      const int64_t src = c + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
      out[k] = src < K ? xr[src] : 0.f;
    }
  }
}

// Rows [0, MB) of the split x against weight rows [n0, n1), one weight row at a time.
template <int MB>
void dot_rows(const float* xs, int64_t Kp, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out,
              int64_t ldo) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t full = K / PAIR * PAIR;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 even[MB], odd[MB];
    for (int m = 0; m < MB; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    auto step = [&](__m512i v, int64_t k) {
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int m = 0; m < MB; ++m) {
        even[m] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xs + m * Kp + k), even[m]);
        odd[m] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xs + m * Kp + k + 16), odd[m]);
      }
    };
    int64_t k = 0;
    for (; k < full; k += PAIR) {
      prefetch_l2(reinterpret_cast<const uint8_t*>(wr + k) + AHEAD);
      step(_mm512_loadu_si512(wr + k), k);
    }
    if (k < K) step(_mm512_maskz_loadu_epi16(tail, wr + k), k);
    for (int m = 0; m < MB; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
  }
}

using DotFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);

DotFn dot_for(int64_t mb) {
  switch (mb) {
    case 1: return dot_rows<1>;
    case 2: return dot_rows<2>;
    case 3: return dot_rows<3>;
    case 4: return dot_rows<4>;
    case 5: return dot_rows<5>;
    case 6: return dot_rows<6>;
    case 7: return dot_rows<7>;
    default: return dot_rows<8>;
  }
}

}  // namespace

// x (R, K) fp32 contiguous, w (N, K) bf16 contiguous -> (R, N) fp32.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "bf16_linear: x must be (R, K) fp32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1),
              "bf16_linear: w must be (N, K) contiguous bf16 with x's K");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t Kp = (K + PAIR - 1) / PAIR * PAIR;
  auto out = torch::empty({R, N}, x.options());
  auto split = torch::empty({R, Kp}, x.options());
  split_pairs(x.data_ptr<float>(), R, K, split.data_ptr<float>(), Kp);
  const float* xs = split.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* o = out.data_ptr<float>();
  // Weight rows per block: ~16 KB, re-read from L2 by each later group of 8 rows of x.
  const int64_t block = R > 8 ? std::max<int64_t>(1, BLOCK_BYTES / (2 * K)) : N;
  // Each thread one contiguous range of weight rows (one stream); at least 16 rows per task.
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += block) {
      const int64_t n1 = std::min(e, n0 + block);
      for (int64_t m = 0; m < R; m += 8) {
        const int64_t mb = std::min<int64_t>(R - m, 8);
        dot_for(mb)(xs + m * Kp, Kp, K, wp, n0, n1, o + m * N, N);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor panels, Tensor scale, int n) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor panels, Tensor scale, int n, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm", &int4_mm);
}
