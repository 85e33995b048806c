#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "guided.h"
#include "wide.h"

#include <algorithm>

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
// that the later groups re-read from L2. The AVX2 build takes 3+ rows of x in tiles of 3 weight
// rows x 3 rows of x instead (tiled_rows, below: its 16 registers make dot_rows load-bound there).
namespace {

// Prefetch distance in bytes per stream. 4 KB was measured on the AVX-512 Xeon; on the AVX2 EPYC
// (16 matrices of the 1B shape, one row of x, 2 threads, one process, variants interleaved, best of
// 12, two orders) 1 KB read 12.0-12.3 ms against 14.2-14.8 at 4 KB (2 KB 13.5, none 13.2-13.7), and
// no slower at 8 rows.
#if defined(__AVX512F__)
constexpr int64_t AHEAD = 4096;
#else
constexpr int64_t AHEAD = 1024;
#endif
constexpr int64_t BLOCK_BYTES = 16384; // weight rows per block when rows > 8: ~16 KB

inline void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

constexpr int64_t PAIR = 32;  // bf16 weights per 64-byte load

// x (R, K) fp32 -> (R, Kp), Kp = K rounded up to 32: each 32-chunk as its 16 even-indexed values,
// then its 16 odd-indexed ones, zero-padded past K.
void split_pairs(const float* x, int64_t R, int64_t K, float* xs, int64_t Kp) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    float* out = xs + r * Kp;
    std::fill(out, out + Kp, 0.f);
    for (int64_t c = 0; c < K; c += PAIR) {
      const int64_t n = std::min<int64_t>(PAIR, K - c);
      for (int64_t j = 0; j < n; ++j) out[c + (j & 1) * 16 + j / 2] = xr[c + j];
    }
  }
}

// x rows per pass over a weight row, and whether each row keeps two accumulators (even and odd
// weights: two FMA chains) or one. AVX-512 has 32 registers: 8 rows x 2 accumulators. AVX2 has 16
// (of 8 lanes; a w16 vector is two): 8 rows x 2 x 2 halves would spill every FMA's accumulator to
// the stack, so AVX2 takes 4 rows a pass (one accumulator each: 8 registers and 8 FMA chains), the
// next 4 re-reading the weight row from L1, and 1-2 rows keep the two (4-8 chains).
#if defined(__AVX512F__)
constexpr int PASS = 8;
template <int MB>
constexpr bool SPLIT = true;
#else
constexpr int PASS = 4;
template <int MB>
constexpr bool SPLIT = MB <= 2;
#endif

// Rows [0, MB) of the split x (MB <= PASS) against the weight row wr: out[m * ldo].
template <int MB, bool PF>
inline void row_dot(const float* xs, int64_t Kp, int64_t K, const uint16_t* wr, float* out, int64_t ldo) {
  const w16i high = w16_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t full = K / PAIR * PAIR;
  const w16mask32 tail = static_cast<w16mask32>((1ull << (K - full)) - 1);
  w16f even[MB], odd[MB];
  for (int m = 0; m < MB; ++m) even[m] = odd[m] = w16_setzero_ps();
  auto step = [&](w16i v, int64_t k) {
    const w16f we = w16_castsi512_ps(w16_slli_epi32(v, 16));
    const w16f wo = w16_castsi512_ps(w16_and_si512(v, high));
    for (int m = 0; m < MB; ++m) {
      even[m] = w16_fmadd_ps(we, w16_loadu_ps(xs + m * Kp + k), even[m]);
      if constexpr (SPLIT<MB>)
        odd[m] = w16_fmadd_ps(wo, w16_loadu_ps(xs + m * Kp + k + 16), odd[m]);
      else
        even[m] = w16_fmadd_ps(wo, w16_loadu_ps(xs + m * Kp + k + 16), even[m]);
    }
  };
  int64_t k = 0;
  for (; k < full; k += PAIR) {
    if constexpr (PF) prefetch_l2(reinterpret_cast<const uint8_t*>(wr + k) + AHEAD);
    step(w16_loadu_si512(wr + k), k);
  }
  if (k < K) step(w16_maskz_loadu_epi16(tail, wr + k), k);
  for (int m = 0; m < MB; ++m)
    out[m * ldo] = w16_reduce_add_ps(SPLIT<MB> ? w16_add_ps(even[m], odd[m]) : even[m]);
}

// Rows [0, MB) of the split x against weight rows [n0, n1), one weight row at a time: PASS rows,
// then the rest over the same row from L1.
template <int MB>
void dot_rows(const float* xs, int64_t Kp, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out,
              int64_t ldo) {
  constexpr int FIRST = MB < PASS ? MB : PASS;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    row_dot<FIRST, true>(xs, Kp, K, wr, out + n, ldo);
    if constexpr (MB > PASS) row_dot<MB - PASS, false>(xs + PASS * Kp, Kp, K, wr, out + PASS * ldo + n, ldo);
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


#if !defined(__AVX512F__)
// ---- AVX2, 3+ rows of x: tiles of 3 weight rows x 3 rows of x ----
// One weight row against several rows of x (dot_rows) loads one x vector per FMA (an FMA's other
// operand), so at 8 rows the product ran at ~1/3 of the FMA units' peak (one thread, 16 matrices
// of the 1B shape: 16-17 GFMA/s against 49 for FMAs from registers). A tile keeps 3 x 3
// accumulators of 8 lanes: each x vector is loaded once for 3 weight rows and each converted weight
// vector meets 3 rows of x, 12 loads for 18 FMAs (measured, same 16 matrices, best of 3: 8 rows
// 47 ms against 72, 16 rows 85 against 138; 3 x 3 measured as fast as 5 x 2 and ahead of 4 x 2,
// 2 x 4 and 3 x 4, which spills). Three weight rows are three streams K apart, which the hardware
// prefetcher follows worse than one: prefetched 4 KB ahead each (1 KB: 18-20 GFMA/s at 8 rows,
// 4 KB 22-26). Rows of x beyond the first 3 re-read the tile's weight rows from L1 / L2.
constexpr int TM = 3, TN = 3;  // weight rows x rows of x
constexpr int64_t TILE_AHEAD = 4096;

// Weight rows w[i * K], i < RM, against split x rows xs[j * Kp], j < RN: out[j * ldo + i].
template <int RM, int RN, bool PF>
void tile(const float* xs, int64_t Kp, int64_t K, const uint16_t* w, float* out, int64_t ldo) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[RM][RN];
#pragma GCC unroll 8
  for (int i = 0; i < RM; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  // 16 weights of each row at k: the even ones (shifted) against the split x's 8 even values of
  // this half of the 32-chunk, then the odd ones (masked) against its 8 odd values.
  auto step = [&](const uint16_t* const* rows, int64_t k) {
    const int64_t even = k / PAIR * PAIR + (k & 16) / 2;
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      __m256 xv[RN];
#pragma GCC unroll 8
      for (int j = 0; j < RN; ++j) xv[j] = _mm256_loadu_ps(xs + j * Kp + even + 16 * q);
#pragma GCC unroll 8
      for (int i = 0; i < RM; ++i) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i]));
        const __m256 wv = _mm256_castsi256_ps(q ? _mm256_and_si256(raw, high) : _mm256_slli_epi32(raw, 16));
#pragma GCC unroll 8
        for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  };
  const uint16_t* rows[RM];
  const int64_t full = K / 16 * 16;
  int64_t k = 0;
#pragma GCC unroll 1
  for (; k < full; k += 16) {
#pragma GCC unroll 8
    for (int i = 0; i < RM; ++i) {
      rows[i] = w + i * K + k;
      if constexpr (PF)
        if ((k & 31) == 0) prefetch_l2(reinterpret_cast<const uint8_t*>(rows[i]) + TILE_AHEAD);
    }
    step(rows, k);
  }
  if (k < K) {  // K's last partial 16: zero-padded copies (the split x is zero past K)
    alignas(32) uint16_t pad[RM][16] = {};
    for (int i = 0; i < RM; ++i) {
      std::copy(w + i * K + k, w + (i + 1) * K, pad[i]);
      rows[i] = pad[i];
    }
    step(rows, k);
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) out[j * ldo + i] = w16_sum8(acc[i][j]);  // wide.h's 8-lane sum
}

// Rows [0, RN) of the split x against weight rows [n0, n1): TM at a time, then the rest singly.
template <int RN, bool PF>
void tile_rows(const float* xs, int64_t Kp, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out,
               int64_t ldo) {
  int64_t n = n0;
  for (; n + TM <= n1; n += TM) tile<TM, RN, PF>(xs, Kp, K, w + n * K, out + n, ldo);
  for (; n < n1; ++n) tile<1, RN, PF>(xs, Kp, K, w + n * K, out + n, ldo);
}

// All R rows of x against weight rows [n0, n1): per TM weight rows, the first TN rows of x stream
// them (prefetched), the later groups re-read them from cache.
void tiled_rows(const float* xs, int64_t R, int64_t Kp, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                float* o, int64_t ldo) {
  using Fn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);
  static constexpr Fn first[] = {tile_rows<1, true>, tile_rows<2, true>, tile_rows<3, true>};
  static constexpr Fn later[] = {tile_rows<1, false>, tile_rows<2, false>, tile_rows<3, false>};
  for (int64_t n = n0; n < n1; n += TM) {
    const int64_t e = std::min(n1, n + TM);
    for (int64_t m = 0; m < R; m += TN) {
      const int64_t rn = std::min<int64_t>(R - m, TN);
      (m == 0 ? first : later)[rn - 1](xs + m * Kp, Kp, K, w, n, e, o + m * ldo, ldo);
    }
  }
}
constexpr int64_t TILE_FROM = 3;  // rows of x from which the tiles take the product
#endif  // AVX-512 (32 registers): dot_rows keeps 8 rows x 2 accumulators in registers; tiles not measured


// ---- AVX512-BF16: bf16 rows of x against the bf16 weight, `vdpbf16ps` ----
// A bf16 model's activations are bf16 already, and `vdpbf16ps` multiplies 32 bf16 pairs of the
// weight line and x's (in their natural order, no split) into 16 fp32 sums in one instruction: a
// 64-byte weight line costs one x load and one instruction per row of x instead of two x loads, two
// ALU ops and two FMAs, and the core's out-of-order window reaches twice as far ahead in the stream.
// Measured (the 1B shape's 113 matrices, one row, 2 threads, weights in anonymous memory, eight
// interleaved rounds with a plain streaming read of the same bytes, an AVX512-BF16 EPYC): fp32 x
// and dot_rows 32.2 GB/s, this 34.0 (the streaming read 35.9); two accumulators per row beat one
// (33.5), four (32.7) and eight (31.5); a prefetch 4 KB ahead beat 2 KB, 8 KB and none. For one or
// two rows of x, one prefetch a step (two 64-byte lines: the L2's adjacent-line prefetcher brings
// the pair's other line) instead of one a line: measured (the same EPYC with the host at ~57 GB/s,
// 2 threads, weights in one huge-page arena, variants interleaved with the plain read, best /
// median of 6-10 rounds) over the toy shape's 43 matrices, one row: 55.5 / 50.5 GB/s against 44.3
// / 41.0 (no prefetch 53.8 / 48.7, the plain read 56.5); two rows 103 / 98 against 88 / 83 (GB/s
// times rows); 28 matrices of the 1B shape, one row: 56.2 / 55.1 against 56.2 / 47.7 (the read
// 57.4). From three rows, where each line costs R instructions, one a line stays ahead: three
// rows 129 / 124 against 126 / 105, four 162 / 161 against 159 / 134, eight 275 / 273 against 160
// / 156. Products
// are summed in fp32 from bf16 x: x is rounded to bf16 once, as oneDNN's bf16 product (the route
// from fast/bf16.py DOT_ROWS rows) and the model's own bf16 activations are. Compiled in the AVX-512
// build for CPUs that have it, picked by fast/bf16.py (DOT_UNITS); elsewhere the op refuses.
#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace units {
constexpr int UN = 2;  // 64-byte weight lines a step: two accumulators per row of x
// Where a CPU's prefetchers want them (measured, 1-2 rows of x): NEAR, one L2 prefetch AHEAD and
// one L1 prefetch L1_AHEAD a line; else one L2 prefetch a step (UN lines), the EPYC's best (above).
// On an Intel Xeon with AMX (Sapphire Rapids class, 2 threads, the 1B shape's 64 layer matrices of
// one row and its head, weights in huge pages, 3-4 interleaved rounds beside a plain read of
// 28.6-29.8 GB/s, scratch kernels): one L2 prefetch a step 24.0-24.5 GB/s (head 23.9-24.8); one a
// line 26.5-26.9 (2 KB ahead 28.0-28.6); one a line and an L1 prefetch 1 KB ahead 29.6-30.7 (head
// 29.3-32.2), 512 B ahead 30.3-32.2 (31.3-33.3), 2 KB 29.8-31.1; the L1 prefetch a line with the
// L2 one a step 27.2-29.1; no prefetch 20.2-21.5. AMD keeps the pair (per line lost 20% there).
constexpr int64_t L1_AHEAD = 512;
inline void prefetch_l1(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
// Lines between L2 prefetches: one a step (UN lines) for 1-2 rows of x, one a line from 3 (above).
template <int R, bool NEAR>
constexpr int PREFETCH_EVERY = R <= 2 && !NEAR ? UN : 1;

// Rows [0, R) of x (R, K) bf16 against weight rows [n0, n1): out[r * ldo + n].
template <int R, bool NEAR>
void dot_rows(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t full = K / (UN * PAIR) * (UN * PAIR);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 acc[R][UN];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < UN; ++u) acc[r][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < full; k += UN * PAIR) {
      for (int u = 0; u < UN; ++u) {
        const uint8_t* line = reinterpret_cast<const uint8_t*>(wr + k + u * PAIR);
        if (u % PREFETCH_EVERY<R, NEAR> == 0) prefetch_l2(line + AHEAD);
        if constexpr (NEAR && R <= 2) prefetch_l1(line + L1_AHEAD);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + u * PAIR);
        for (int r = 0; r < R; ++r)
          acc[r][u] = _mm512_dpbf16_ps(acc[r][u], wv, (__m512bh)_mm512_loadu_si512(x + r * K + k + u * PAIR));
      }
    }
    for (; k < K; k += PAIR) {  // the last < 64 inputs: zeros past K in both operands
      const __mmask32 m = K - k >= PAIR ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, wr + k);
      for (int r = 0; r < R; ++r)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k));
    }
    for (int r = 0; r < R; ++r) out[r * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
}

using Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);
// Rows of x a pass (16 accumulators); more rows go 8 at a time. One pass of 8 rows beat two of 4
// over the same 16 KB weight blocks (1B shape's matrices, 8 rows: 112 ms against 137), and one
// weight row at a time beat tiles of 2 or 3 (more streams, slower at every row count).
constexpr int MAX_ROWS = 8;
template <bool NEAR>
constexpr Fn by_rows[] = {dot_rows<1, NEAR>, dot_rows<2, NEAR>, dot_rows<3, NEAR>, dot_rows<4, NEAR>,
                          dot_rows<5, NEAR>, dot_rows<6, NEAR>, dot_rows<7, NEAR>, dot_rows<8, NEAR>};
// The table for this CPU: NEAR prefetches everywhere but on AMD's (read once).
const Fn* rows_table() {
  static const bool near = !__builtin_cpu_is("amd");
  return near ? by_rows<true> : by_rows<false>;
}
}  // namespace units
#pragma GCC pop_options
#endif

// body(b, e) over chunks of contiguous weight rows [b, e) of N (each one stream), 16 rows at least,
// taken as threads come free (guided.h).
template <class F>
void row_chunks(int64_t N, const F& body) {
  guided_for((N + 15) / 16, [&](int64_t b16, int64_t e16) { body(b16 * 16, std::min(N, e16 * 16)); });
}

// Whether this CPU has `vdpbf16ps` and this build the kernel for it.
bool has_units() {
#if defined(__AVX512F__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
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
  row_chunks(N, [&](int64_t b, int64_t e) {
#if !defined(__AVX512F__)
    if (R >= TILE_FROM) return tiled_rows(xs, R, Kp, K, wp, b, e, o, N);
#endif
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

// x (R, K) bf16 contiguous, w (N, K) bf16 contiguous -> (R, N) fp32, on the CPU's bf16 units.
torch::Tensor bf16_dot(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(has_units(), "bf16_dot: needs AVX512-BF16 (vdpbf16ps), which this CPU or build lacks; use bf16_linear");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "bf16_dot: x must be (R, K) bf16");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1),
              "bf16_dot: w must be (N, K) contiguous bf16 with x's K");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({R, N}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* o = out.data_ptr<float>();
  // Chunks of contiguous weight rows (row_chunks), as bf16_linear's.
  // More than MAX_ROWS rows: blocks of ~16 KB of weight rows, re-read from L2 by the later groups.
  const int64_t block = R > units::MAX_ROWS ? std::max<int64_t>(1, BLOCK_BYTES / (2 * std::max<int64_t>(1, K))) : N;
  const units::Fn* table = units::rows_table();
  row_chunks(N, [&](int64_t b, int64_t e) {
    for (int64_t n0 = b; n0 < e; n0 += block) {
      const int64_t n1 = std::min(e, n0 + block);
      for (int64_t m = 0; m < R; m += units::MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(R - m, units::MAX_ROWS);
        table[rows - 1](xp + m * K, K, wp, n0, n1, o + m * N, N);
      }
    }
  });
#endif
  return out;
}

// One row x (K bf16) times w (N, K) bf16 -> out (N fp32) on the bf16 units: bf16_dot's row without
// its tensors (csrc/step.cpp; in a team the threads share the weight's rows). Needs has_bf16_units().
void bf16_row(const uint16_t* x, const uint16_t* w, int64_t N, int64_t K, float* out) {
#if defined(__AVX512F__)
  const units::Fn one = units::rows_table()[0];
  row_chunks(N, [&](int64_t b, int64_t e) { one(x, K, w, b, e, out, N); });
#else
  (void)x, (void)w, (void)N, (void)K, (void)out;
#endif
}

bool has_bf16_units() { return has_units(); }

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_dot(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_dot", &bf16_dot);
}
