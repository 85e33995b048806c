// Few-row products y = x W^T over a weight packed in panels of 16 output rows (nn/packed.py).
//
// Panel p holds rows 16p..16p+15 of W (zero-padded past N) as (K, 16): for each input index k,
// the 16 weights of those outputs are contiguous. One panel is then one sequential stream, and
// its kernel needs no horizontal sums: per k, one 16-wide load of weights and, for each of the
// (up to 8) input rows, one FMA with x[m, k] broadcast into that row's 16 outputs. Two panels
// run together (16 accumulators) so independent FMAs hide their latency. Rows beyond 8 are
// taken 8 at a time over the same panels, K in blocks whose two panels stay in L1 (64 KB of
// weights per block pair would not), partial sums kept in the output.
// Sums are fp32 in k order per output: a reassociation of x W^T only.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t K_BLOCK = 256;  // 2 panels x 256 x 16 x 4 bytes = 32 KB: fits L1 with x

template <int M, int NP>
inline void panels(const float* x, int64_t ldx, const float* p, int64_t K, int64_t k0, int64_t k1, float* out,
                   int64_t ldo, int64_t n0, int64_t nvalid_last, bool accumulate) {
  __m512 acc[NP][M];
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_ps(p + j * K * LANES + k * LANES);
    for (int m = 0; m < M; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NP; ++j) acc[j][m] = _mm512_fmadd_ps(w[j], xb, acc[j][m]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t valid = j == NP - 1 ? nvalid_last : LANES;
    const __mmask16 mask = valid == LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int m = 0; m < M; ++m) {
      float* dst = out + m * ldo + n0 + j * LANES;
      __m512 v = acc[j][m];
      if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
      _mm512_mask_storeu_ps(dst, mask, v);
    }
  }
}

template <int M>
void rows(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t k0, int64_t k1, float* out, int64_t N,
          int64_t pb, int64_t pe, bool accumulate) {
  int64_t p = pb;
  for (; p + 2 <= pe; p += 2) {
    const int64_t last = std::min<int64_t>(LANES, N - (p + 1) * LANES);
    panels<M, 2>(x, ldx, wp + p * K * LANES, K, k0, k1, out, N, p * LANES, last, accumulate);
  }
  if (p < pe) {
    const int64_t last = std::min<int64_t>(LANES, N - p * LANES);
    panels<M, 1>(x, ldx, wp + p * K * LANES, K, k0, k1, out, N, p * LANES, last, accumulate);
  }
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t,
                        int64_t, bool);
constexpr RowsFn ROWS[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

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
          ROWS[mr](xp + m0 * K, K, w, K, k0, k1, o + m0 * N, N, pb, pe, k0 > 0);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("panel_mm", &panel_mm, "few-row x W^T over 16-row weight panels"); }
