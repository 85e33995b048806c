// A whole batch-1 decode step of a Llama-shaped decoder in one parallel region (fast/native_step.py
// says which models are Llama-shaped and hands their tensors over once): the token's embedding row,
// per layer RMSNorm -> the joint q/k/v product -> RoPE (rotate-half) -> the cache write -> attention
// over the live prefix -> o -> residual -> RMSNorm -> the joint gate/up product -> silu(g) * u ->
// down -> residual, then the final norm, the head and the logits.
//
// Why: at the toy shape a compiled batch-1 step of int4 panels took ~0.5 ms, of which its 25
// products, called back to back, took 0.30 (perf and a dispatcher loop, the Intel Xeon of
// fast-paths.md): a parallel region per product and per attention, each product's allocations and
// rounding of x, the graph's glue kernels and the dispatcher between them. Here the threads of one
// region (team.h) run every step of the forward: the products and the attention share their work
// through the kernels' own chunking (guided.h), each ending at the team's barrier; everything
// between them (norms, residuals) is a few thousand values, computed by every thread alike on its
// own copy (no barrier, no second reader), so one region and 4 barriers a layer replace ~8 regions,
// ~9 allocations and ~10 calls through the dispatcher. Where the shapes allow (whole panel groups),
// two parts go by even shares instead, each thread's share on its own: the q/k/v rows of the KV heads
// a thread attends over, with RoPE and that attention (no barrier before it, no value from the other
// core), and the gate/up rows of a share of the MLP's width with their SiLU product (half the
// SiLUs a thread computes). Measured at the toy shape (int4, 2 threads, a bf16 step over a warm
// cache, processes alternated): 307-309 -> 298-301 us a token for the MLP's shares.
//
// Numerics: the model's own rounding points, in its dtype (bf16 here): every value the eager forward
// holds in bf16 is rounded to bf16 at the same place (the norms' outputs and their weights' products,
// each projection's outputs, q and k after RoPE, the attention's output, silu(g) and its product with
// u, both residual sums, the logits); the arithmetic between them is fp32 as torch's, the sums in
// another order. The products are the kernels' own (bf16_row, panel_row), bit for bit.
//
// Legend: D hidden, H query heads, KH key/value heads, E head size, F the MLP's width, V vocabulary,
// S the cache's slots.

#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include "py_iter.h"
#include "team.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

void panel_row(int64_t bits, const uint8_t* panels, const void* scale, bool half, int64_t N, int64_t K, int64_t G,
               int64_t ways, const float* x, float* out, uint8_t* work);
int64_t panel_row_work(int64_t K);
void bf16_row(const uint16_t* x, const uint16_t* w, int64_t N, int64_t K, float* out);
bool has_bf16_units();
void attend_row(const float* q, int64_t H, const uint16_t* k, const uint16_t* v, int64_t K, int64_t E, int64_t ks1,
                int64_t ks2, int64_t vs1, int64_t vs2, const uint16_t* knew, const uint16_t* vnew, int64_t n, float scale,
                float* out);

namespace {

using Vec = at::vec::Vectorized<float>;

// x rounded to bf16 (to nearest, ties to even), as an fp32: plain integer steps, which the compiler
// vectorizes in the loops below (c10::BFloat16's conversion is a call per value). A NaN whose payload
// lies in the low 16 bits only would round to an infinity here; none arises in a finite forward.
inline float bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}
inline uint16_t bf16_bits(float rounded) {  // the top half of an already rounded value
  uint32_t u;
  std::memcpy(&u, &rounded, 4);
  return static_cast<uint16_t>(u >> 16);
}
inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// One projection: a bf16 weight (N, K) (bits 16), or int8 / int4 panels (bits 8 / 4) with their scale
// tensor, group and ways; an fp32 bias of N or none. The tensors are held; the calls take their
// pointers, read once here (a tensor's header is a cache miss each token once the weights streamed).
struct Proj {
  int64_t bits, N, K, G, ways;
  torch::Tensor w, scale, bias;
  const void* wp = nullptr;
  const void* sp = nullptr;
  const float* bp = nullptr;
  bool half = false;
  int64_t rows_apart = 0;  // bytes from one 16 rows to the next: a bf16 weight's 16 rows, or one panel
  void point() {
    wp = w.data_ptr(), sp = scale.data_ptr();  // interleaved panels: an empty scale (they hold their scales)
    bp = bias.numel() ? bias.data_ptr<float>() : nullptr, half = scale.scalar_type() == at::kHalf;
    rows_apart = bits == 16 ? 16 * K * 2 : w.numel() / ((N + 15) / 16);
  }
  // Whether rows [n0, n0 + n) can be multiplied on their own: whole panel groups (bf16: any rows).
  bool splits_at(int64_t n0, int64_t n) const {
    const int64_t unit = bits == 16 ? 1 : 16 * ways;
    return n0 % unit == 0 && (n % unit == 0 || n0 + n == N);
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;  // (D) bf16
  const uint16_t *attn_w, *mlp_w;
  float attn_eps, mlp_eps;
  Proj qkv, o, gate_up, down;
};

// One layer's cache, as attend_row takes it.
struct Slots {
  uint16_t *k, *v;
  int64_t ks1, ks2, vs1, vs2;
};

// One thread's own buffers: the hidden state and what it derives from it alike on every thread.
struct Own {
  std::vector<float> h, x, y, q;  // (D), (max K), (q/k/v outputs), (H * E)
  std::vector<uint16_t> xb;       // (max K): x as bf16 for bf16_row
  std::vector<uint16_t> kb, vb;   // (KH * E): this position's keys (rotated) and values in bf16
  std::vector<uint8_t> work;      // panel_row's rounded x, 64-aligned
  uint8_t* aligned = nullptr;
};

class DecoderStep {
 public:
  // tensors: embed (V, D) bf16, final norm (D), then per projection (w, scale, bias), per layer
  // (attn_norm, mlp_norm, qkv, o, gate_up, down), and the head last; an empty tensor stands for none.
  // ints: D, H, KH, E, F, V, L, then (bits, N, K, G, ways) per projection in the same order.
  // floats: the attention's scale, the final norm's eps, then (attn eps, mlp eps) per layer.
  DecoderStep(std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
    TORCH_CHECK(ints.size() >= 7 && floats.size() >= 2, "DecoderStep: too few arguments");
    D = ints[0], H = ints[1], KH = ints[2], E = ints[3], F = ints[4], V = ints[5];
    const int64_t L = ints[6];
    TORCH_CHECK(ints.size() == static_cast<size_t>(7 + 5 * (4 * L + 1)) && floats.size() == static_cast<size_t>(2 + 2 * L) &&
                    tensors.size() == static_cast<size_t>(2 + 3 * (4 * L + 1) + 2 * L),
                "DecoderStep: the argument lists do not match ", L, " layers");
    TORCH_CHECK(E <= 128 && H % KH == 0 && E % 2 == 0, "DecoderStep: heads of at most 128 features, H a multiple of KH");
    scale = static_cast<float>(floats[0]), final_eps = static_cast<float>(floats[1]);
    size_t t = 0, i = 7;
    embed = tensors[t++], final_norm = tensors[t++];
    auto proj = [&]() {
      Proj p{ints[i], ints[i + 1], ints[i + 2], ints[i + 3], ints[i + 4], tensors[t], tensors[t + 1], tensors[t + 2]};
      i += 5, t += 3;
      TORCH_CHECK(p.bits == 16 ? (p.w.scalar_type() == at::kBFloat16 && p.w.size(0) == p.N && p.w.size(1) == p.K)
                               : (p.bits == 8 || p.bits == 4) && p.w.scalar_type() == at::kByte,
                  "DecoderStep: a projection must be a bf16 (N, K) weight or int8 / int4 panels");
      TORCH_CHECK(p.bits != 16 || has_bf16_units(), "DecoderStep: bf16 weights need AVX512-BF16");
      // panels one after another would go to at::parallel_for, which a team cannot share
      TORCH_CHECK(p.bits == 16 || p.ways > 1, "DecoderStep: panels must be interleaved (ways > 1)");
      // the bytes the kernels will read: a bf16 (N, K) weight, or P panels of K inputs at bits each for
      // 16 outputs, each weight group's 16 scales inside them (quantized.cpp's layout comment)
      const int64_t P = (p.N + 15) / 16, scale_bytes = p.scale.element_size();
      TORCH_CHECK(p.w.is_contiguous() && (p.bits == 16 || (p.G > 0 && p.K % p.G == 0 &&
                  p.w.numel() == P * (p.K * 16 * p.bits / 8 + p.K / p.G * 16 * scale_bytes))),
                  "DecoderStep: a projection's weight does not hold (", p.N, ", ", p.K, ") at ", p.bits, " bits");
      TORCH_CHECK(p.bias.numel() == 0 || (p.bias.scalar_type() == at::kFloat && p.bias.numel() == p.N),
                  "DecoderStep: a bias must be fp32 of N");
      widest = std::max(widest, p.K);
      p.point();
      return p;
    };
    for (int64_t l = 0; l < L; ++l) {
      Layer layer;
      layer.attn_norm = tensors[t++], layer.mlp_norm = tensors[t++];
      layer.attn_w = reinterpret_cast<const uint16_t*>(layer.attn_norm.data_ptr());
      layer.mlp_w = reinterpret_cast<const uint16_t*>(layer.mlp_norm.data_ptr());
      layer.attn_eps = static_cast<float>(floats[2 + 2 * l]), layer.mlp_eps = static_cast<float>(floats[3 + 2 * l]);
      layer.qkv = proj(), layer.o = proj(), layer.gate_up = proj(), layer.down = proj();
      TORCH_CHECK(layer.qkv.N == (H + 2 * KH) * E && layer.qkv.K == D && layer.o.N == D && layer.o.K == H * E &&
                      layer.gate_up.N == 2 * F && layer.gate_up.K == D && layer.down.N == D && layer.down.K == F,
                  "DecoderStep: layer ", l, "'s projections do not match its shape");
      layers.push_back(std::move(layer));
    }
    head = proj();
    TORCH_CHECK(head.N == V && head.K == D, "DecoderStep: the head must be (V, D)");
    auto vector_of = [&](const torch::Tensor& w) {
      return w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == D;
    };
    TORCH_CHECK(embed.scalar_type() == at::kBFloat16 && embed.is_contiguous() && embed.dim() == 2 &&
                    embed.size(0) == V && embed.size(1) == D && vector_of(final_norm),
                "DecoderStep: the token table must be contiguous bf16 (V, D) and the final norm's weight bf16 (D)");
    for (const Layer& layer : layers)
      TORCH_CHECK(vector_of(layer.attn_norm) && vector_of(layer.mlp_norm), "DecoderStep: a norm's weight must be bf16 (D)");
    // Each KV head's q, k and v rows whole panel groups: each thread multiplies its heads' rows
    // and attends over them with no barrier between (forward).
    by_heads = true;
    for (const Layer& layer : layers)
      by_heads = by_heads && layer.qkv.splits_at(0, H / KH * E) && layer.qkv.splits_at(H * E, E);
    // The gate and up rows of any whole number of panel groups: each thread its share (forward).
    mlp_unit = layers.empty() || layers[0].gate_up.bits == 16 ? 16 : 16 * layers[0].gate_up.ways;
    by_halves = F % mlp_unit == 0;
    for (const Layer& layer : layers)
      by_halves = by_halves && layer.gate_up.splits_at(0, mlp_unit) && layer.gate_up.splits_at(F, mlp_unit);
    team = std::make_unique<Team>(5 * L + 1);
    qkv.resize((H + 2 * KH) * E), attn.resize(H * E), o.resize(D), gu.resize(2 * F), act.resize(F), down.resize(D), logits.resize(V), last.resize(V);
  }

  // The cache this step writes and reads: per layer k, v (1, KH, S, E) in the model's dtype, and the
  // RoPE table cos, sin (S, E / 2) fp32 of positions 0..S-1.
  void set_cache(std::vector<torch::Tensor> kv, torch::Tensor cos_table, torch::Tensor sin_table) {
    TORCH_CHECK(kv.size() == 2 * layers.size(), "DecoderStep: one k and one v per layer");
    for (auto& c : kv)
      TORCH_CHECK(c.dim() == 4 && c.size(0) == 1 && c.size(1) == KH && c.size(3) == E && c.stride(3) == 1 &&
                      c.scalar_type() == at::kBFloat16,
                  "DecoderStep: a cache must be bf16 (1, KH, S, E) with unit stride on E");
    TORCH_CHECK(cos_table.scalar_type() == at::kFloat && cos_table.is_contiguous() && cos_table.size(1) == E / 2 &&
                    sin_table.sizes() == cos_table.sizes() && sin_table.is_contiguous(),
                "DecoderStep: the RoPE tables must be contiguous fp32 (S, E / 2)");
    caches = std::move(kv), cos = std::move(cos_table), sin = std::move(sin_table);
    slots.clear();
    for (size_t l = 0; l < layers.size(); ++l) {
      const torch::Tensor &k = caches[2 * l], &v = caches[2 * l + 1];
      slots.push_back({reinterpret_cast<uint16_t*>(k.data_ptr()), reinterpret_cast<uint16_t*>(v.data_ptr()),
                       k.stride(1), k.stride(2), v.stride(1), v.stride(2)});
    }
  }

  // The logits (1, V) of `token` at `pos` (bf16 values, held in fp32), the token's key and value
  // written at slot pos: a normal tensor, not an inference one (the caller hands it on as it is).
  torch::Tensor run(int64_t token, int64_t pos) {
    c10::InferenceMode normal(false);
    auto out = torch::empty({1, V}, torch::kFloat);
    step(token, pos, out.data_ptr<float>());
    return out;
  }

  // One step, its logits into po (V): their argmax (the first index of the maximum, as torch's).
  int64_t step(int64_t token, int64_t pos, float* po) {
    check(token, pos);
    const int T = std::max(1, at::get_num_threads());
    if (static_cast<int>(own.size()) < T) own.resize(T), tops.resize(T);
    // The team is the region's threads as OpenMP gives them (fewer than asked where it must).
#pragma omp parallel num_threads(T)
    {
#pragma omp single
      team->reset(omp_get_num_threads());  // the single's barrier: reset before any member starts
      Member m{team.get(), omp_get_thread_num()};
      member = &m;
      forward(own[m.id], token, pos);
      choose(m, po);
      member = nullptr;
    }
    return tops[0][0];
  }

  int64_t vocabulary() const { return V; }

  // Logits of the step that ran last (greedy decoding keeps them here instead of a tensor a token).
  float* scratch() { return last.data(); }

 private:
  int64_t D, H, KH, E, F, V, widest = 0;
  bool by_heads = false, by_halves = false;
  int64_t mlp_unit = 16;
  float scale, final_eps;
  torch::Tensor embed, final_norm, cos, sin;
  std::vector<Layer> layers;
  Proj head;
  std::vector<torch::Tensor> caches;
  std::vector<Slots> slots;
  std::unique_ptr<Team> team;
  std::vector<Own> own;
  std::vector<float> qkv, attn, o, gu, act, down, logits, last;  // the products' outputs, shared by the team
  std::vector<std::array<int64_t, 8>> tops;  // each member's argmax over its share (a line each)

  void check(int64_t token, int64_t pos) const {
    TORCH_CHECK(!caches.empty(), "DecoderStep: set_cache first");
    TORCH_CHECK(token >= 0 && token < V, "DecoderStep: token ", token, " is outside the vocabulary of ", V);
    TORCH_CHECK(pos >= 0 && pos < caches[0].size(2) && pos < cos.size(0), "DecoderStep: position ", pos,
                " is outside the cache of ", caches[0].size(2), " slots");
  }

  // The head's values (bias, bf16) into po and their argmax, each member over its share of the
  // vocabulary, then member 0 picks among the shares' (in order: the first index of the maximum).
  // One thread alone took ~9 us a token at the toy shape (8,192 values, half of them from the other
  // core's cache, then a second pass for the maximum).
  void choose(const Member& m, float* po) {
    const int T = team->threads;
    const auto [b, e] = share(V, m.id, T);
    values(head, logits.data(), b, e - b, po + b);
    tops[m.id][0] = b < e ? b + first_max(po + b, e - b) : -1;  // -1: an empty share (V < T)
    team->wait();
    if (m.id != 0) return;
    int64_t best = -1;
    for (int t = 0; t < T; ++t) {
      const int64_t i = tops[t][0];
      if (i >= 0 && (best < 0 || (!std::isnan(po[best]) && (std::isnan(po[i]) || po[i] > po[best])))) best = i;
    }
    tops[0][0] = best;
  }

  // The first index of the maximum of x[0, n) (n > 0), or of its first NaN (torch's argmax takes
  // the first NaN; at::vec's maximum carries one, a scalar std::max would drop it).
  static int64_t first_max(const float* x, int64_t n) {
    Vec top(x[0]);
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) top = at::vec::maximum(top, Vec::loadu(x + i));
    float lanes[Vec::size()], mx = x[0];
    top.store(lanes);
    bool nan = std::isnan(mx);
    for (float v : lanes) nan |= std::isnan(v), mx = std::max(mx, v);
    for (; i < n; ++i) nan |= std::isnan(x[i]), mx = std::max(mx, x[i]);
    int64_t best = 0;
    if (nan) {
      while (!std::isnan(x[best])) ++best;
    } else {
      while (x[best] != mx) ++best;
    }
    return best;
  }

  // x = RMSNorm(h) as nn/norms.py's RMSNorm in bf16: (h * rsqrt(mean(h^2) + eps)) rounded, times w, rounded.
  void norm(const float* h, const uint16_t* wp, float eps, float* x) const {
    Vec acc(0.f);
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) {
      const Vec v = Vec::loadu(h + d);
      acc = at::vec::fmadd(v, v, acc);
    }
    float lanes[Vec::size()], ss = 0.f;
    acc.store(lanes);
    for (float v : lanes) ss += v;
    for (; d < D; ++d) ss += h[d] * h[d];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (d = 0; d < D; ++d) x[d] = bf16(bf16(h[d] * r) * widen(wp[d]));
  }

  // out[n0, n0 + n) = x W[n0, n0 + n)^T (rows from a panel group's start: splits_at), shared by
  // the team where this thread is in one (the kernels' chunks, the team's barrier at the end).
  void multiply(Own& me, const Proj& p, const float* x, int64_t n0, int64_t n, float* out) const {
    const uint8_t* w = static_cast<const uint8_t*>(p.wp) + n0 / 16 * p.rows_apart;
    if (p.bits == 16) {
      for (int64_t k = 0; k < p.K; ++k) me.xb[k] = bf16_bits(x[k]);  // x is rounded already
      bf16_row(me.xb.data(), reinterpret_cast<const uint16_t*>(w) + n0 % 16 * p.K, n, p.K, out + n0);
    } else {
      panel_row(p.bits, w, p.sp, p.half, n, p.K, p.G, p.ways, x, out + n0, me.aligned);
    }
  }
  // out = x W^T, the team's barrier at its end.
  void project(Own& me, const Proj& p, const float* x, float* out) const { multiply(me, p, x, 0, p.N, out); }
  // dst[f] = silu(g_f) * u_f for f in [f0, f1) as the model rounds them (silu(g), then the product),
  // from y: g at [0, F), u at [F, 2F), in the model's dtype.
  void gated(const float* y, int64_t f0, int64_t f1, float* dst) const {
    int64_t f = f0;
    for (; f + Vec::size() <= f1; f += Vec::size()) {
      const Vec g = Vec::loadu(y + f);
      (g / (Vec(1.f) + g.neg().exp())).store(dst + f);
    }
    for (; f < f1; ++f) dst[f] = y[f] / (1.f + std::exp(-y[f]));
    for (f = f0; f < f1; ++f) dst[f] = bf16(bf16(dst[f]) * y[F + f]);
  }

  // Where member t's share of the MLP's width starts (t = the team's size: its end): whole panel
  // groups of the joint gate/up product (mlp_unit), as even as they allow.
  int64_t mlp_split(int t) const {
    const int T = team->threads;
    return t >= T ? F : F * t / T / mlp_unit * mlp_unit;
  }

  // out[n0, n0 + n) = x W[n0, n0 + n)^T on this thread alone (whole panel groups: splits_at).
  void project_rows(Own& me, const Proj& p, const float* x, int64_t n0, int64_t n, float* out) const {
    Member* in_team = member;
    member = nullptr;  // the kernels run their chunks here: inside the region, not shared
    multiply(me, p, x, n0, n, out);
    member = in_team;
  }

  // dst[0, n) = a product's outputs n0.. in the model's dtype, with its bias (nn: the projection's
  // output tensor).
  void values(const Proj& p, const float* out, int64_t n0, int64_t n, float* dst) const {
    if (p.bp) {
      const float* b = p.bp + n0;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16(out[n0 + i] + b[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16(out[n0 + i]);
    }
  }
  // h = h + the product's outputs (values), rounded: a residual sum.
  void add(const Proj& p, const float* out, Own& me) const {
    values(p, out, 0, D, me.y.data());
    for (int64_t d = 0; d < D; ++d) me.h[d] = bf16(me.h[d] + me.y[d]);
  }

  void forward(Own& me, int64_t token, int64_t pos) {
    if (me.h.empty()) {
      me.h.resize(D), me.x.resize(widest), me.y.resize(std::max<int64_t>((H + 2 * KH) * E, 2 * F)), me.q.resize(H * E);
      me.xb.resize(widest), me.kb.resize(KH * E), me.vb.resize(KH * E);
      me.work.resize(panel_row_work(widest) + 64);
      me.aligned = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(me.work.data()) + 63) / 64 * 64);
    }
    const auto* row = reinterpret_cast<const uint16_t*>(embed.data_ptr()) + token * D;
    for (int64_t d = 0; d < D; ++d) me.h[d] = widen(row[d]);
    const int64_t half = E / 2;
    const float* c = cos.data_ptr<float>() + pos * half;
    const float* s = sin.data_ptr<float>() + pos * half;
    // rotate-half RoPE (nn/positions.py rotate_half) of one head's E values, rounded after
    auto rotate = [&](const float* x, float* dst) {
      for (int64_t j = 0; j < half; ++j) {
        dst[j] = bf16(x[j] * c[j] - x[half + j] * s[j]);
        dst[half + j] = bf16(x[half + j] * c[j] + x[j] * s[j]);
      }
    };
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& L = layers[l];
      norm(me.h.data(), L.attn_w, L.attn_eps, me.x.data());
      float* y = me.y.data();  // q, k, v as the model holds them
      int64_t k0 = 0, k1 = KH;  // the KV heads whose q, k, v this thread needs: all, or its own
      const int T = team->threads;
      if (by_heads && KH % T == 0) {
        // The attention's tasks split the KV heads evenly (team.h team_static): this thread's heads'
        // q, k and v rows, multiplied here, are all its tasks read, so no barrier comes between, and
        // no value crosses to the other core's cache (where the heads split unevenly, one thread
        // would multiply more rows: the team shares them all instead).
        std::tie(k0, k1) = share(KH, member->id, T);
        const int64_t G = H / KH, rows[3][2] = {{k0 * G * E, (k1 - k0) * G * E}, {(H + k0) * E, (k1 - k0) * E},
                                               {(H + KH + k0) * E, (k1 - k0) * E}};
        for (const auto& r : rows)
          if (r[1] > 0) {
            project_rows(me, L.qkv, me.x.data(), r[0], r[1], qkv.data());
            values(L.qkv, qkv.data(), r[0], r[1], y + r[0]);
          }
        for (int64_t h = k0 * G; h < k1 * G; ++h) rotate(y + h * E, me.q.data() + h * E);
      } else {
        project(me, L.qkv, me.x.data(), qkv.data());
        values(L.qkv, qkv.data(), 0, (H + 2 * KH) * E, y);
        for (int64_t h = 0; h < H; ++h) rotate(y + h * E, me.q.data() + h * E);
      }
      // this position's keys (rotated) and values, written into the cache by the attention's task
      // of each head, before it reads them
      for (int64_t kh = k0; kh < k1; ++kh) {
        float kr[128];
        rotate(y + (H + kh) * E, kr);
        const float* v = y + (H + KH + kh) * E;
        for (int64_t e = 0; e < E; ++e) me.kb[kh * E + e] = bf16_bits(kr[e]), me.vb[kh * E + e] = bf16_bits(v[e]);
      }
      const Slots& c = slots[l];
      attend_row(me.q.data(), H, c.k, c.v, KH, E, c.ks1, c.ks2, c.vs1, c.vs2, me.kb.data(), me.vb.data(), pos + 1,
                 scale, attn.data());
      for (int64_t n = 0; n < H * E; ++n) me.x[n] = bf16(attn[n]);
      project(me, L.o, me.x.data(), o.data());
      add(L.o, o.data(), me);
      norm(me.h.data(), L.mlp_w, L.mlp_eps, me.x.data());
      if (by_halves) {
        // Each thread multiplies the gate and up rows of its share of the MLP's width, computes
        // their product there and writes it for all (act); the down product reads it after the
        // barrier. Against every thread computing SiLU over all of it from the other's outputs.
        const int64_t f0 = mlp_split(member->id), f1 = mlp_split(member->id + 1);
        if (f1 > f0) {
          for (const int64_t r : {f0, F + f0}) {
            project_rows(me, L.gate_up, me.x.data(), r, f1 - f0, gu.data());
            values(L.gate_up, gu.data(), r, f1 - f0, y + r);
          }
          gated(y, f0, f1, act.data());
        }
        team->wait();
        project(me, L.down, act.data(), down.data());
      } else {
        project(me, L.gate_up, me.x.data(), gu.data());
        values(L.gate_up, gu.data(), 0, 2 * F, y);
        gated(y, 0, F, me.x.data());
        project(me, L.down, me.x.data(), down.data());
      }
      add(L.down, down.data(), me);
    }
    norm(me.h.data(), reinterpret_cast<const uint16_t*>(final_norm.data_ptr()), final_eps, me.x.data());
    project(me, head, me.x.data(), logits.data());
  }
};

// A greedy decode over a step from the token `last` at `pos`: each next() runs the step on the last
// token and gives the one it chose, a (1,) int64 tensor (with its logits (1, V) where Scores), up to
// n of them, none after a token in `stop`. The whole loop between two tokens is this call, through
// a plain CPython iterator (py_iter.h) (fast/native_step.py: a Python generator and torch ops
// between two steps cost ~20 us a token at the toy shape, where the step's weight stream had
// evicted everything they touch). For the same reason the tokens' tensors (and their Python
// objects) are made up to POOL at a time, each a view of one block: one made after a step took ~6
// us there, everything it touches cold; and the iterator keeps a reference to each token it gave
// until its next refill (or its end), so that a token the caller drops is freed there, with the
// others of its block, not between two steps: a tensor's deallocation after a step, cold, took ~5
// us of the ~16 between two steps of a bare loop (toy int4, rdtsc, 6 alternated rounds, 2026-12-07:
// 16.6 -> 11.2 us; with a consumer's tolist() and appends 30.7 -> 25.9).
template <bool Scores>
class Greedy {
 public:
  static constexpr int64_t POOL = 64;
  Greedy(DecoderStep& step, int64_t last, int64_t pos, int64_t n, std::vector<int64_t> stop)
      : step_(step), last_(last), pos_(pos), left_(n), stop_(std::move(stop)) {
    if constexpr (!Scores) refill();  // before the first token: made between two steps it took ~100 us
  }

  PyObject* next() {  // called with the GIL, which the step releases; null: no more tokens
    if (left_ <= 0 || std::find(stop_.begin(), stop_.end(), last_) != stop_.end()) return nullptr;
    if constexpr (Scores) {
      torch::Tensor tok, logits;
      {
        pybind11::gil_scoped_release nogil;
        c10::InferenceMode normal(false);  // normal tensors: the caller hands them on as they are
        logits = torch::empty({1, step_.vocabulary()}, torch::kFloat);
        last_ = step_.step(last_, pos_, logits.data_ptr<float>());
        tok = torch::empty({1}, torch::kLong);
        tok.data_ptr<int64_t>()[0] = last_;
      }
      ++pos_, --left_;
      return pybind11::cast(std::make_tuple(tok, logits)).release().ptr();
    } else {
      if (given_ == static_cast<int64_t>(pool_.size())) refill();  // past POOL tokens
      {
        pybind11::gil_scoped_release nogil;
        last_ = step_.step(last_, pos_, step_.scratch());
      }
      ++pos_, --left_;
      values_[given_] = last_;
      PyObject* tok = pool_[given_++].ptr();
      Py_INCREF(tok);  // the caller's reference; ours stays in pool_ until the next refill
      return tok;
    }
  }

 private:
  // The next tokens' tensors, (1,) views of one (k,) block (values_ its data), in order; the block
  // before let go of (those of its tokens the caller dropped are freed here).
  void refill() {
    pool_.clear(), given_ = 0;
    const int64_t k = std::min(left_, POOL);
    c10::InferenceMode normal(false);
    auto block = torch::empty({k}, torch::kLong);
    values_ = block.data_ptr<int64_t>();  // the views keep the block
    for (int64_t i = 0; i < k; ++i) pool_.push_back(pybind11::cast(block.narrow(0, i, 1)));
  }

  DecoderStep& step_;
  int64_t last_, pos_, left_;
  std::vector<int64_t> stop_;
  std::vector<pybind11::object> pool_;  // this block's tokens, the first given_ of them given
  int64_t given_ = 0;
  int64_t* values_ = nullptr;
};

// step.<method>(last, pos, n, stop): a Greedy<Scores> iterator (type `name`), which keeps its step.
template <bool Scores>
void bind_greedy(pybind11::class_<DecoderStep>& step, const char* name, const char* method) {
  PyTypeObject* type = PyIterator<Greedy<Scores>>::type(name);
  step.def(method, [type](pybind11::object self, int64_t last, int64_t pos, int64_t n, std::vector<int64_t> stop) {
    auto it = std::make_unique<Greedy<Scores>>(self.cast<DecoderStep&>(), last, pos, n, std::move(stop));
    return PyIterator<Greedy<Scores>>::wrap(type, std::move(it), self);
  });
}

}  // namespace

void bind_step(pybind11::module& m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<DecoderStep> step(m, "DecoderStep");
  step.def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("set_cache", &DecoderStep::set_cache)
      .def("run", &DecoderStep::run, nogil());
  bind_greedy<false>(step, "torchformer_kernels.Greedy", "greedy");
  bind_greedy<true>(step, "torchformer_kernels.GreedyScores", "greedy_scores");
}
