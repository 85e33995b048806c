// torchformer's CPU kernels (loaded by nn/native.py).
//
// 1. Few-row products y = x W^T over a weight packed in panels of 16 output rows (nn/packed.py).
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
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

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

// One decode query per row over the first n cached keys (nn/backends.py, prefix_sdpa):
// q (B, H, 1, E), k (B, K, S, E) and v (B, K, S, Ev) strided views with unit stride on the last
// dim, term an additive (B, 1|H, 1, S) fp32 mask/bias (any strides) or undefined -> (B, H, 1, Ev).
// Per (row, KV head) task: the G = H / K query heads of the group read each key and value once
// (GQA shares them); scores q.k * scale + term, an exact softmax (max-subtracted, fp32), then the
// weighted sum of values. Same math as SDPA; sums in another order.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& term, int64_t n, double scale) {
  using Vec = at::vec::Vectorized<float>;
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: fp32 only");
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
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
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
          float d = _mm512_reduce_add_ps(dot);
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
        total = _mm512_reduce_add_ps(vsum);
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

// The packed copies, by weight storage: nn/packed.py registers a weight's panels while it packs,
// and the op torchformer::panel_linear(x, weight) finds them here without a trip through Python
// (~20 us per product saved). A copy is used only while the weight's storage is alive and its
// version unchanged (an in-place update makes it stale); otherwise the plain product runs.
namespace {
struct Copy {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version;  // -1: an inference tensor, which has no version counter
  std::vector<int64_t> shape;
  torch::Tensor panels;
};
std::mutex copies_lock;
std::unordered_map<const void*, Copy> copies;

int64_t version_of(const torch::Tensor& w) { return w.is_inference() ? -1 : static_cast<int64_t>(w._version()); }
}  // namespace

void register_panels(const torch::Tensor& weight, const torch::Tensor& panels) {
  std::lock_guard<std::mutex> guard(copies_lock);
  copies.insert_or_assign(weight.data_ptr(), Copy{weight.storage().getWeakStorageImpl(), version_of(weight),
                                                  weight.sizes().vec(), panels});
}

void unregister_panels(const torch::Tensor& weight) {
  std::lock_guard<std::mutex> guard(copies_lock);
  copies.erase(weight.data_ptr());
}

// The weight's current panels, or an undefined tensor.
torch::Tensor current_panels(const torch::Tensor& weight) {
  std::lock_guard<std::mutex> guard(copies_lock);
  auto it = copies.find(weight.data_ptr());
  if (it == copies.end() || it->second.storage.expired()) return {};
  auto alive = it->second.storage.lock();
  const bool same = alive.get() == weight.storage().unsafeGetStorageImpl() &&
                    it->second.version == version_of(weight) && it->second.shape == weight.sizes().vec();
  return same ? it->second.panels : torch::Tensor();
}

bool has_panels(const torch::Tensor& weight) { return current_panels(weight).defined(); }

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  const torch::Tensor panels = current_panels(weight);
  if (!panels.defined()) return at::mm(x, weight.t());
  return panel_mm(x.contiguous(), panels, weight.size(0));
}

TORCH_LIBRARY_FRAGMENT(torchformer, m) { m.def("panel_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(torchformer, CPU, m) { m.impl("panel_linear", &panel_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_panels", &register_panels, "use these panels for this weight while it is unchanged");
  m.def("unregister_panels", &unregister_panels, "forget the weight's panels");
  m.def("has_panels", &has_panels, "whether the weight has current panels");
  m.def("panel_mm", &panel_mm, "few-row x W^T over 16-row weight panels");
  m.def("decode_attention", &decode_attention, "one query per row over the first n cached keys");
}
