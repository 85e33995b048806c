// torchformer's CPU kernels (loaded by fast/native.py).
//
// 1. Few-row products y = x W^T over a weight packed in panels of 16 output rows (fast/panels.py).
//
// Panel p holds rows 16p..16p+15 of W (zero-padded past N) as (K, 16): for each input index k,
// the 16 weights of those outputs are contiguous. One panel is then one sequential stream, and
// its kernel needs no horizontal sums: per k, one 16-wide load of weights and, for each of the
// (up to 8) input rows, one FMA with x[m, k] broadcast into that row's 16 outputs. Two panels
// run together (16 accumulators) so independent FMAs hide their latency. Rows beyond 8 are
// taken 8 at a time over the same panels, K in blocks whose two panels stay in L1 (64 KB of
// weights per block pair would not), partial sums kept in the output.
// The weights stream from DRAM (a model's are far beyond L3), and the hardware prefetcher alone
// left the FMAs waiting (~15 GB/s at 8 rows, against ~20 streaming): it stops at each 4 KB page
// and has to detect every new panel's stream anew. So the kernel prefetches each panel's stream
// PREFETCH_STEPS lines ahead into L2, and in a pair's last steps the next pair's first lines.
// Sums are fp32 in k order per output: a reassociation of x W^T only.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include "team.h"
#include "wide.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t K_BLOCK = 256;  // 2 panels x 256 x 16 x 4 bytes = 32 KB: fits L1 with x
// 64 lines = 4 KB ahead per panel stream (8 KB for the pair): enough in flight to cover DRAM
// latency at ~20 GB/s. Measured at 8 rows, one thread, a 92 MB pass: none 5.7 ms, 32 lines ahead
// 5.1, 64-256 all 4.2-4.4. Into L2 (T1; T2 is the same here): T0, into L1, gained nothing.
constexpr int64_t PREFETCH_STEPS = 64;

template <int M, int NP>
inline void fma_step(w16f (&acc)[NP][M], const float* x, int64_t ldx, const float* p, int64_t K, int64_t k) {
  w16f w[NP];
  for (int j = 0; j < NP; ++j) w[j] = w16_loadu_ps(p + j * K * LANES + k * LANES);
  for (int m = 0; m < M; ++m) {
    const w16f xb = w16_set1_ps(x[m * ldx + k]);
    for (int j = 0; j < NP; ++j) acc[j][m] = w16_fmadd_ps(w[j], xb, acc[j][m]);
  }
}

inline void prefetch_l2(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// PF: prefetch PREFETCH_STEPS steps (lines) ahead in each panel's stream; past the panels' end,
// the same offset in the next group's panels (next, null where none follows), so a group starts
// warm. Prefetch is a hint: an address past the weights cannot fault.
template <int M, int NP, bool PF>
inline void panels(const float* x, int64_t ldx, const float* p, int64_t K, int64_t k0, int64_t k1, float* out,
                   int64_t ldo, int64_t n0, int64_t nvalid_last, bool accumulate, const float* next) {
  w16f acc[NP][M];
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = w16_setzero_ps();
  if (!PF) {
    for (int64_t k = k0; k < k1; ++k) fma_step<M, NP>(acc, x, ldx, p, K, k);
  } else {
    constexpr int64_t D = PREFETCH_STEPS;
    const int64_t ks = std::min(std::max(K - D, k0), k1);  // from here the lines ahead are the next group's
    for (int64_t k = k0; k < ks; ++k) {
      for (int j = 0; j < NP; ++j) prefetch_l2(p + j * K * LANES + (k + D) * LANES);
      fma_step<M, NP>(acc, x, ldx, p, K, k);
    }
    for (int64_t k = ks; k < k1; ++k) {
      if (next)
        for (int j = 0; j < 2; ++j) prefetch_l2(next + j * K * LANES + (k + D - K) * LANES);
      fma_step<M, NP>(acc, x, ldx, p, K, k);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t valid = j == NP - 1 ? nvalid_last : LANES;
    const w16mask mask = valid == LANES ? (w16mask)0xFFFF : (w16mask)((1u << valid) - 1);
    for (int m = 0; m < M; ++m) {
      float* dst = out + m * ldo + n0 + j * LANES;
      w16f v = acc[j][m];
      if (accumulate) v = w16_add_ps(v, w16_maskz_loadu_ps(mask, dst));
      w16_mask_storeu_ps(dst, mask, v);
    }
  }
}

template <int M, bool PF>
void rows(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t k0, int64_t k1, float* out, int64_t N,
          int64_t pb, int64_t pe, bool accumulate, const float* next) {
  int64_t p = pb;
  for (; p + 2 <= pe; p += 2) {
    const int64_t last = std::min<int64_t>(LANES, N - (p + 1) * LANES);
    panels<M, 2, PF>(x, ldx, wp + p * K * LANES, K, k0, k1, out, N, p * LANES, last, accumulate, next);
  }
  if (p < pe) {
    const int64_t last = std::min<int64_t>(LANES, N - p * LANES);
    panels<M, 1, PF>(x, ldx, wp + p * K * LANES, K, k0, k1, out, N, p * LANES, last, accumulate, next);
  }
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                        int64_t, bool, const float*);
template <bool PF>
constexpr RowsFn ROWS[9] = {nullptr,       rows<1, PF>, rows<2, PF>, rows<3, PF>, rows<4, PF>,
                            rows<5, PF>, rows<6, PF>, rows<7, PF>, rows<8, PF>};

}  // namespace

// x (R, K) contiguous fp32, panels (ceil(N / 16), K, 16) contiguous fp32 -> (R, N).
torch::Tensor panel_mm(const torch::Tensor& x, const torch::Tensor& wp, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "panel_mm: x must be (R, K) fp32");
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.size(2) == LANES && wp.size(1) == x.size(1),
              "panel_mm: panels must be (P, K, 16) with x's K");
  const int64_t R = x.size(0), K = x.size(1), P = wp.size(0);
  TORCH_CHECK(P * LANES >= N && (P - 1) * LANES < N, "panel_mm: N does not match the panels");
  auto out = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Few rows: all of K in one pass, accumulators in registers. More: K blocks so the panels
  // re-read for each group of 8 rows come from L1.
  const int64_t kb = R <= 8 ? K : K_BLOCK;
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t b, int64_t e) {
    const int64_t end = std::min<int64_t>(P, e * 2);
    for (int64_t pb = b * 2; pb < end; pb += 2) {  // one pair of panels at a time
      const int64_t pe = std::min<int64_t>(end, pb + 2);
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = std::min<int64_t>(K, k0 + kb);
        for (int64_t m0 = 0; m0 < R; m0 += 8) {
          const int64_t mr = std::min<int64_t>(8, R - m0);
          // Only the first group of rows meets the block in DRAM; the others re-read it from cache.
          const RowsFn fn = m0 == 0 ? ROWS<true>[mr] : ROWS<false>[mr];
          fn(xp + m0 * K, K, w, K, k0, k1, o + m0 * N, N, pb, pe, k0 > 0, pe < P ? w + pe * K * LANES : nullptr);
        }
      }
    }
  });
  return out;
}

// One decode query per row over the first n cached keys (nn/backends.py, prefix_sdpa):
// q (B, H, 1, E) fp32, k (B, K, S, E) and v (B, K, S, Ev) fp32 or bf16 (a bf16 model's cache, widened
// in registers as it is read: half the bytes of an fp32 copy) strided views with unit stride on the last
// dim, term an additive (B, 1|H, 1, S) fp32 mask/bias (any strides) or undefined -> (B, H, 1, Ev).
// Per (row, KV head) task: the G = H / K query heads of the group read each key and value once
// (GQA shares them); scores q.k * scale + term, an exact softmax (max-subtracted, fp32), then the
// weighted sum of values. Same math as SDPA; sums in another order.
//
// In a server the cache is cold: between two calls on a layer the weights of a whole layer stream
// through, so every key and value comes from DRAM, in 2 short streams per task (n keys of K, n of
// V; 19 KB each at n = 75, E = 64) that the hardware prefetcher meets anew and drops at each 4 KB
// page. Waiting on them was most of the time (~300 us a layer against ~120 that the bytes need at
// ~20 GB/s), so the kernel walks the same streams AHEAD_LINES ahead with software prefetches
// (Ahead), across the K/V and task boundaries. For E == Ev <= 128 (every model here) the task is
// templated on the head size so q and the output accumulator live in registers and 16 keys'
// dots are summed together (reduce16) rather than one horizontal sum per key; other shapes take
// the generic loop.
bool has_bf16_units();  // bf16.cpp

namespace {

// 128 lines = 8 KB ahead, into L2 (T1). Measured cold at B=8, H=K=8, n=75 (us per layer, best of
// 10): none 243, 64 lines 156, 128 155, 256 144 (medians all ~165); T0 (into L1) at 128: 201.
// Hot (the cache already in L2/L3) it costs 0-2 us.
constexpr int64_t AHEAD_LINES = 128;

inline void prefetch_line(uintptr_t a) { _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T1); }

// Walks, AHEAD_LINES ahead of the reads, the streams one thread's tasks read, in their order: per
// task the n keys of K, then its n values of V, then the next task's. A stream whose keys are
// contiguous (stride == length, as in the static cache) is one range of lines; otherwise each key
// is one. The reads advance it by the bytes they consume, so it stays the same distance ahead.
template <class T>
struct Ahead {
  const T *kp, *vp;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, K, n, E, Ev, task, end;
  int which = 0;  // 0: the task's K, 1: its V
  const T* base = nullptr;
  int64_t stride = 0, len = 0, key = 0;
  bool whole = false;
  uintptr_t pos = 0, stop = 0, next = 0;  // the range being walked; the first line not yet prefetched

  void open() {
    const int64_t b = task / K, kh = task % K;
    if (which == 0) base = kp + b * ks0 + kh * ks1, stride = ks2, len = E;
    else base = vp + b * vs0 + kh * vs1, stride = vs2, len = Ev;
    whole = stride == len, key = 0, next = 0;  // a new stream may lie below the last: forget its lines
    range();
  }
  void range() {
    pos = reinterpret_cast<uintptr_t>(base + key * stride);
    stop = pos + (whole ? n : 1) * len * static_cast<int64_t>(sizeof(T));
  }
  void forward() {
    if (!whole && ++key < n) return range();
    if (which == 0) which = 1;
    else which = 0, ++task;
    if (task < end) open();
  }
  inline void advance(int64_t bytes) {
    while (bytes > 0 && task < end) {
      const uintptr_t upto = std::min<uintptr_t>(stop, pos + bytes);
      // lines already prefetched (keys sharing a line) are skipped
      for (uintptr_t l = std::max(next, pos & ~uintptr_t(63)); l < upto; l += 64) prefetch_line(l);
      next = ((upto - 1) | 63) + 1;
      bytes -= upto - pos;
      pos = upto;
      if (pos == stop) forward();
    }
  }
};

inline w16mask first_lanes(int64_t c) { return c >= 16 ? (w16mask)0xFFFF : (w16mask)((1u << c) - 1); }

// 16 keys' or values' elements as fp32: loaded (fp32) or widened (bf16: the top half of an fp32).
inline w16f widen(const float* p, w16mask m) { return w16_maskz_loadu_ps(m, p); }
inline w16f widen(const uint16_t* p, w16mask m) { return w16_widen_bf16(p, m); }

// exp(x - m) per lane, at::vec's exp (one vector on AVX-512, two on AVX2).
inline w16f exp_minus(w16f x, float m) {
  using Vec = at::vec::Vectorized<float>;
#if defined(__AVX512F__)
  return (Vec(x) - Vec(m)).exp();
#else
  return {(Vec(x.lo) - Vec(m)).exp(), (Vec(x.hi) - Vec(m)).exp()};
#endif
}

// The sum of an at::vec vector's lanes.
inline float lane_sum(at::vec::Vectorized<float> v) {
#if defined(__AVX512F__)
  return w16_reduce_add_ps(v);
#else
  return w16_sum8(v);
#endif
}

template <class T>
struct Args {
  const float* qp;
  const T *kp, *vp;
  const float* tp;
  float* op;
  int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2, tb, th, ts, H, K, G, E, Ev, n;
  float sc;
  // One row's new key and value per KV head (K, E) each, written at slot n - 1 by the task that
  // reads that head, before it reads (attend_row; null elsewhere): no barrier between write and read.
  const T *knew = nullptr, *vnew = nullptr;
  // q's values are bf16 values held in fp32 (the native step rounds them): the scores may take
  // `vdpbf16ps` over q and bf16 keys (attend's DP), the same products summed in another order.
  bool bf16_q = false;
};

// attend's scores on the bf16 units (`vdpbf16ps`, AVX512-BF16): the whole function takes the target
// so its DP copies can use them; its other copies use none of its instructions.
#if defined(__AVX512F__)
#define BF16_UNITS __attribute__((target("avx512bf16")))
#else
#define BF16_UNITS
#endif

// One (row, KV head) task, E == Ev, NV = ceil(E / 16) vectors (the last masked when E % 16):
// q and the output accumulators in registers. scores: G rows of npad floats; mxbuf: G x 16.
// DP (bf16 keys, bf16 q: Args.bf16_q, E a multiple of 32): each key's dot product 32 pairs at a time
// on the bf16 units instead of widened keys and FMAs (~7 ns a key and head at the toy shape's
// E = 64 on one thread, the attention's compute then ~1/10 of a native int4 step).
template <int NV, class T, bool DP = false>
BF16_UNITS void attend(const Args<T>& a, int64_t task, float* scores, float* mxbuf, int64_t npad, Ahead<T>& ahead) {
  const int64_t b = task / a.K, kh = task % a.K, n = a.n, G = a.G;
  const T* kb = a.kp + b * a.ks0 + kh * a.ks1;
  const T* vb = a.vp + b * a.vs0 + kh * a.vs1;
  constexpr int64_t ES = sizeof(T);
  const w16mask em = first_lanes(a.E - (NV - 1) * 16);
  auto load = [em](const float* p, int e) { return e == NV - 1 ? w16_maskz_loadu_ps(em, p + 16 * e) : w16_loadu_ps(p + 16 * e); };
  auto load_kv = [em](const T* p, int e) { return widen(p + 16 * e, e == NV - 1 ? em : (w16mask)0xFFFF); };
  for (int64_t g = 0; g < G; ++g) w16_storeu_ps(mxbuf + 16 * g, w16_set1_ps(-std::numeric_limits<float>::infinity()));
  // Scores, 16 keys at a time, each block for all G heads while its keys are in L1.
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t c = std::min<int64_t>(16, n - j0);
    const w16mask cm = first_lanes(c);
    ahead.advance(c * a.E * ES);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kh * G + g;
      const float* qh = a.qp + b * a.qs0 + h * a.qs1;
      w16f d[16];  // 16 independent chains: no FMA waits on the one before
#if defined(__AVX512F__)
      if constexpr (DP) {
        static_assert(NV % 2 == 0 && std::is_same_v<T, uint16_t>, "attend: DP takes bf16 keys of 32 x E");
        __m512bh qb[NV / 2];  // q as bf16 pairs, exactly (its values are bf16's)
        for (int c = 0; c < NV / 2; ++c) qb[c] = _mm512_cvtne2ps_pbh(load(qh, 2 * c + 1), load(qh, 2 * c));
        for (int s = 0; s < 16; ++s) {
          const T* kj = kb + std::min<int64_t>(j0 + s, n - 1) * a.ks2;  // past n: key n-1 again (masked off)
          __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], (__m512bh)_mm512_loadu_si512(kj));
          for (int c = 1; c < NV / 2; ++c) t = _mm512_dpbf16_ps(t, qb[c], (__m512bh)_mm512_loadu_si512(kj + 32 * c));
          d[s] = t;
        }
      } else
#endif
      {
        w16f qv[NV];
        for (int e = 0; e < NV; ++e) qv[e] = load(qh, e);
        for (int s = 0; s < 16; ++s) {
          const T* kj = kb + std::min<int64_t>(j0 + s, n - 1) * a.ks2;  // past n: key n-1 again (masked off)
          w16f t = w16_mul_ps(qv[0], load_kv(kj, 0));
          for (int e = 1; e < NV; ++e) t = w16_fmadd_ps(qv[e], load_kv(kj, e), t);
          d[s] = t;
        }
      }
      w16f sv = w16_mul_ps(w16_reduce16(d), w16_set1_ps(a.sc));
      if (a.tp) {
        const float* tr = a.tp + b * a.tb + h * a.th + j0 * a.ts;
        if (a.ts == 1) {
          sv = w16_add_ps(sv, w16_maskz_loadu_ps(cm, tr));
        } else {
          alignas(64) float tmp[16] = {};
          for (int64_t s = 0; s < c; ++s) tmp[s] = tr[s * a.ts];
          sv = w16_add_ps(sv, w16_load_ps(tmp));
        }
      }
      w16_mask_storeu_ps(scores + g * npad + j0, cm, sv);
      const w16f mx = w16_loadu_ps(mxbuf + 16 * g);
      w16_storeu_ps(mxbuf + 16 * g, w16_mask_max_ps(mx, cm, mx, sv));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    float* s = scores + g * npad;
    // exp(s - max) in place, 16 at a time; the sum for normalising.
    const float mx = w16_reduce_max_ps(w16_loadu_ps(mxbuf + 16 * g));
    w16f vsum = w16_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const w16mask cm = first_lanes(n - j);
      const w16f p = exp_minus(w16_maskz_loadu_ps(cm, s + j), mx);
      w16_mask_storeu_ps(s + j, cm, p);
      vsum = w16_mask_add_ps(vsum, cm, vsum, p);
    }
    const float total = w16_reduce_add_ps(vsum);
    // out = sum_j p_j v_j / total, in registers; two accumulator sets so that consecutive keys'
    // FMAs do not wait on each other (one set is a chain of 4-cycle FMAs per key at E = 64). The
    // first head's pass meets V in DRAM; the others find it in cache.
    w16f acc0[NV], acc1[NV];
    for (int e = 0; e < NV; ++e) acc0[e] = acc1[e] = w16_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      if (g == 0) ahead.advance(2 * a.Ev * ES);
      const T* v0 = vb + j * a.vs2;
      const T* v1 = v0 + a.vs2;
      const w16f p0 = w16_set1_ps(s[j]), p1 = w16_set1_ps(s[j + 1]);
      for (int e = 0; e < NV; ++e) {
        acc0[e] = w16_fmadd_ps(p0, load_kv(v0, e), acc0[e]);
        acc1[e] = w16_fmadd_ps(p1, load_kv(v1, e), acc1[e]);
      }
    }
    if (j < n) {
      if (g == 0) ahead.advance(a.Ev * ES);
      const T* v0 = vb + j * a.vs2;
      const w16f p0 = w16_set1_ps(s[j]);
      for (int e = 0; e < NV; ++e) acc0[e] = w16_fmadd_ps(p0, load_kv(v0, e), acc0[e]);
    }
    float* oh = a.op + (b * a.H + h) * a.Ev;
    const w16f inv = w16_set1_ps(1.f / total);
    for (int e = 0; e < NV; ++e) {
      const w16f r = w16_mul_ps(w16_add_ps(acc0[e], acc1[e]), inv);
      if (e == NV - 1) w16_mask_storeu_ps(oh + 16 * e, em, r);
      else w16_storeu_ps(oh + 16 * e, r);
    }
  }
}

template <class T>
using AttendFn = void (*)(const Args<T>&, int64_t, float*, float*, int64_t, Ahead<T>&);
template <class T>
constexpr AttendFn<T> ATTEND[9] = {nullptr, attend<1, T>, attend<2, T>, attend<3, T>, attend<4, T>,
                                  attend<5, T>, attend<6, T>, attend<7, T>, attend<8, T>};
#if defined(__AVX512F__)
constexpr AttendFn<uint16_t> ATTEND_DP[9] = {nullptr, nullptr, attend<2, uint16_t, true>, nullptr,
                                            attend<4, uint16_t, true>, nullptr, attend<6, uint16_t, true>,
                                            nullptr, attend<8, uint16_t, true>};
#endif

// The copy of attend for these arguments: on the bf16 units where they apply (DP).
template <class T>
AttendFn<T> attend_fn(const Args<T>& args) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (args.bf16_q && args.E % 32 == 0 && args.E == args.Ev && has_bf16_units()) return ATTEND_DP[args.E / 16];
#endif
  return ATTEND<T>[(args.E + 15) / 16];
}

// The register-resident path for keys and values of element type T (fp32, or bf16 as uint16_t).
template <class T>
void attend_all(const Args<T>& args, int64_t B) {
  const AttendFn<T> fn = attend_fn(args);
  const int64_t npad = (args.n + 15) / 16 * 16;
  auto tasks = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(args.G * npad), mxbuf(args.G * 16);
    Ahead<T> ahead{args.kp, args.vp, args.ks0, args.ks1, args.ks2, args.vs0, args.vs1, args.vs2,
                   args.K, args.n, args.E, args.Ev, begin, end};
    ahead.open();
    ahead.advance(AHEAD_LINES * 64);
    for (int64_t task = begin; task < end; ++task) {
      if (args.knew) {  // one row (B = 1): task = its KV head
        std::copy_n(args.knew + task * args.E, args.E, const_cast<T*>(args.kp) + task * args.ks1 + (args.n - 1) * args.ks2);
        std::copy_n(args.vnew + task * args.Ev, args.Ev, const_cast<T*>(args.vp) + task * args.vs1 + (args.n - 1) * args.vs2);
      }
      fn(args, task, scores.data(), mxbuf.data(), npad, ahead);
    }
  };
  if (!team_static(B * args.K, tasks)) at::parallel_for(0, B * args.K, 1, tasks);
}
}  // namespace

// One decode query of H heads (H, E) fp32 over one row's bf16 cache k, v (K heads of E <= 128, strides
// ks1 / vs1 between heads and ks2 / vs2 between slots), after writing that row's new key and value (K, E)
// bf16 each at slot n - 1 -> out (H, E) fp32: decode_attention's register path without its tensors
// (step.cpp; in a team the heads are shared, each head's write done by the thread that reads it).
void attend_row(const float* q, int64_t H, const uint16_t* k, const uint16_t* v, int64_t K, int64_t E, int64_t ks1,
                int64_t ks2, int64_t vs1, int64_t vs2, const uint16_t* knew, const uint16_t* vnew, int64_t n, float scale,
                float* out) {
  Args<uint16_t> args{q, k, v, nullptr, out, H * E, E, 0, ks1, ks2, 0, vs1, vs2, 0, 0, 0, H, K, H / K, E, E, n, scale};
  args.knew = knew, args.vnew = vnew, args.bf16_q = true;
  attend_all<uint16_t>(args, 1);
}

static torch::Tensor decode_fp32(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const c10::optional<torch::Tensor>& term, int64_t n, double scale) {
  using Vec = at::vec::Vectorized<float>;
  const bool bf16 = k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && (bf16 || (k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat)),
              "decode_attention: q fp32 or bf16, k and v both fp32 or both bf16");
  TORCH_CHECK(!(term.has_value() && term->defined()) || term->scalar_type() == at::kFloat, "decode_attention: term must be fp32");
  TORCH_CHECK(q.size(2) == 1 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: one query per row, unit stride on the head dim");
  const int64_t B = q.size(0), H = q.size(1), E = q.size(3), K = k.size(1), Ev = v.size(3);
  TORCH_CHECK(H % K == 0 && n >= 1 && n <= k.size(2), "decode_attention: bad heads or length");
  const int64_t G = H / K;
  auto out = torch::empty({B, H, 1, Ev}, q.options());
  const bool has_term = term.has_value() && term->defined();
  const float* tp = has_term ? term->data_ptr<float>() : nullptr;
  const int64_t tb = has_term ? term->stride(0) : 0, th = has_term && term->size(1) > 1 ? term->stride(1) : 0;
  const int64_t ts = has_term ? term->stride(3) : 0;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool registers = E == Ev && E <= 16 * 8;
  TORCH_CHECK(registers || !bf16, "decode_attention: bf16 keys and values need E == Ev <= 128");
  if (bf16) {
    const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
    const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
    attend_all<uint16_t>({qp, kp, vp, tp, op, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), tb, th, ts, H, K, G, E, Ev, n, sc}, B);
    return out;
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (registers) {
    attend_all<float>({qp, kp, vp, tp, op, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), tb, th, ts, H, K, G, E, Ev, n, sc}, B);
    return out;
  }
  // Other head sizes: one key at a time, the accumulator in memory.
  at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * n), acc(Ev);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / K, kh = task % K;
      const float* kb = kp + b * k.stride(0) + kh * k.stride(1);
      const float* vb = vp + b * v.stride(0) + kh * v.stride(1);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        const float* qh = qp + b * q.stride(0) + h * q.stride(1);
        float* s = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kb + j * k.stride(2);
          Vec dot(0.f);
          int64_t e = 0;
          for (; e + Vec::size() <= E; e += Vec::size()) dot = at::vec::fmadd(Vec::loadu(qh + e), Vec::loadu(kj + e), dot);
          float d = lane_sum(dot);
          for (; e < E; ++e) d += qh[e] * kj[e];
          d *= sc;
          if (tp) d += tp[b * tb + h * th + j * ts];
          s[j] = d;
          mx = std::max(mx, d);
        }
        // exp(s - max) in place, 16 at a time; the sum for normalising.
        float total = 0.f;
        int64_t j = 0;
        const Vec vmx(mx);
        Vec vsum(0.f);
        for (; j + Vec::size() <= n; j += Vec::size()) {
          Vec p = (Vec::loadu(s + j) - vmx).exp();
          p.store(s + j);
          vsum = vsum + p;
        }
        total = lane_sum(vsum);
        for (; j < n; ++j) {
          s[j] = std::exp(s[j] - mx);
          total += s[j];
        }
        // out = sum_j p_j v_j / total
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t jj = 0; jj < n; ++jj) {
          const float* vj = vb + jj * v.stride(2);
          const Vec pj(s[jj]);
          int64_t e = 0;
          for (; e + Vec::size() <= Ev; e += Vec::size()) at::vec::fmadd(pj, Vec::loadu(vj + e), Vec::loadu(acc.data() + e)).store(acc.data() + e);
          for (; e < Ev; ++e) acc[e] += s[jj] * vj[e];
        }
        float* oh = op + (b * H + h) * Ev;
        const float inv = 1.f / total;
        for (int64_t e = 0; e < Ev; ++e) oh[e] = acc[e] * inv;
      }
    }
  });
  return out;
}

// x @ weight^T over the panels fast/panels.py made of ``weight`` when it still has the version it had
// then (-1: an inference tensor, which cannot change), the plain product otherwise: an in-place
// update after packing (an optimizer step, load_state_dict's copy_) is never multiplied stale.
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& panels,
                           int64_t version) {
  const int64_t now = weight.is_inference() ? -1 : static_cast<int64_t>(weight._version());
  if (now != version) return at::mm(x, weight.t());
  return panel_mm(x.contiguous(), panels, weight.size(0));
}

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("panel_linear(Tensor x, Tensor weight, Tensor panels, int version) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) { m.impl("panel_linear", &panel_linear); }

namespace {
// t (B, A, 1, S) bf16, any strides: its first n of S widened into a contiguous fp32 (B, A, 1, n) by a
// plain loop (an at::to of the 1B model's (1, 1, 1, 257) mask took ~15 us a layer, dispatch and a
// strided copy, against the ~30 us the attention itself takes).
torch::Tensor widened(const torch::Tensor& t, int64_t n) {
  const int64_t B = t.size(0), A = t.size(1);
  auto out = torch::empty({B, A, 1, n}, t.options().dtype(at::kFloat));
  const auto* src = t.data_ptr<at::BFloat16>();
  float* dst = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a)
      for (int64_t j = 0; j < n; ++j)
        *dst++ = static_cast<float>(src[b * t.stride(0) + a * t.stride(1) + j * t.stride(3)]);
  return out;
}
}  // namespace

// The op's entry (fast/attention.py): a bf16 query or term (a bf16 model's) is widened here by plain
// loops (widened) and the result comes back in the query's dtype, so neither the Python kernel
// around it nor a compiled step's host code pays a dispatched conversion for them.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& term, int64_t n, double scale) {
  const bool has_term = term.has_value() && term->defined();
  c10::optional<torch::Tensor> term32;
  if (has_term) {
    const bool bf16 = term->scalar_type() == at::kBFloat16 && term->dim() == 4 && term->size(2) == 1;
    term32 = term->scalar_type() == at::kFloat ? *term : bf16 ? widened(*term, n) : term->to(at::kFloat);
  }
  if (q.scalar_type() == at::kFloat) return decode_fp32(q, k, v, term32, n, scale);
  if (q.scalar_type() != at::kBFloat16 || q.size(2) != 1)
    return decode_fp32(q.to(at::kFloat), k, v, term32, n, scale).to(q.scalar_type());
  auto out = decode_fp32(widened(q, q.size(3)), k, v, term32, n, scale);  // q (B, H, 1, E)
  auto narrow = torch::empty(out.sizes(), out.options().dtype(at::kBFloat16));  // out is contiguous
  const float* src = out.data_ptr<float>();
  auto* dst = narrow.data_ptr<at::BFloat16>();
  for (int64_t i = 0, total = out.numel(); i < total; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
  return narrow;
}

// torchformer::prefix_sdpa's CPU kernel (nn/backends.py) in C++: fast/attention.py's Python one
// made it, the decode kernel where it applies, else SDPA over the live prefix. Registered in its
// place by register_prefix_sdpa once the kernels load (fast/attention.py ``native``), so that a
// compiled step, whose C++ host code calls the op through the dispatcher, never comes back into
// Python for it (~7 us a call at the toy shape, six a step).
namespace {
bool decodes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
             const c10::optional<torch::Tensor>& term) {  // as fast/attention.py's ``decodes``
  auto cache_dtype = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  const bool has_term = term.has_value() && term->defined();
  const bool cache = k.scalar_type() == v.scalar_type() && cache_dtype(k.scalar_type());
  const bool floats = cache_dtype(q.scalar_type()) && (!has_term || cache_dtype(term->scalar_type()));
  const bool unit = q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1;
  const bool shape = k.scalar_type() == at::kFloat || (q.size(-1) == v.size(-1) && v.size(-1) <= 128);
  return q.dim() == 4 && q.size(2) == 1 && cache && floats && unit && shape;
}

torch::Tensor prefix_sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const c10::optional<torch::Tensor>& term, const torch::Tensor& live, double scale) {
  // the live length, read in place where it is a CPU int64 (an item() is a dispatch, ~3 us a layer)
  const bool plain = live.scalar_type() == at::kLong && live.numel() == 1;
  const int64_t n = plain ? *live.data_ptr<int64_t>() : live.item<int64_t>();
  if (decodes(q, k, v, term)) return decode_attention(q, k, v, term, n, scale);
  // nn/backends.py sdpa_prefix: SDPA over the first n slots, the term cut to them
  c10::optional<torch::Tensor> cut;
  if (term.has_value() && term->defined()) cut = term->narrow(-1, 0, n);
  return at::scaled_dot_product_attention(q, k.narrow(2, 0, n), v.narrow(2, 0, n), cut, 0.0, false, scale,
                                          q.size(1) != k.size(1));
}
}  // namespace

// on: register the kernel above for the op on the CPU (once); off: drop that registration again.
void register_prefix_sdpa(bool on) {
  static torch::Library* library = nullptr;  // its registrations last until it is deleted
  if (on && !library) {
    library = new torch::Library(torch::Library::IMPL, "torchformer", c10::DispatchKey::CPU, __FILE__, __LINE__);
    library->impl("prefix_sdpa", TORCH_FN(prefix_sdpa));
  } else if (!on && library) {
    delete library;
    library = nullptr;
  }
}

// The two kernels run without the GIL: a server's event loop thread goes on while the engine
// thread computes (both only read their tensor arguments, which the caller keeps alive).
void bind_step(pybind11::module& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("panel_mm", &panel_mm, "few-row x W^T over 16-row weight panels", nogil());
  m.def("decode_attention", &decode_attention, "one query per row over the first n cached keys", nogil());
  m.def("register_prefix_sdpa", &register_prefix_sdpa, "torchformer::prefix_sdpa's CPU kernel in C++: on or off");
  bind_step(m);
}
