// Products y = x W^T over int8 and int4 weights with integer dot products, as llama.cpp runs its
// Q8_0 / Q4_0 files: each row of x is quantized to int8 on the fly, per block of B inputs (B = 32,
// or the largest power of two dividing both the weight's group and 32), and the weights meet it in
// 32-bit integer sums, one scale multiply per block instead of one FMA per weight.
//
// Why: a decode step reads every weight once, and widening each int8 / int4 weight to fp32 in
// registers (what these products did before) costs 3-4 instructions per 16 weights, so int4 read
// ~5.5 GB/s on one core here, bound by instructions rather than memory. An integer dot product does
// 64 multiply-adds in one instruction (AVX512-VNNI `vpdpbusd`; two, `vpmaddubsw` + `vpmaddwd`, on a
// CPU without VNNI). The VNNI variant is picked once per process from the CPU (`vnni()`). On an
// AVX2 CPU (the build of wide.h) each 16-lane step is two 256-bit ones, with `vpsignb` for int8's
// sign move; there is no VNNI copy.
//
// Layout (fast/formats.py writes it): panels of 16 output rows, as kernels.cpp's, each one
// sequential stream; in a panel, each 64-byte line holds the 16 outputs' weights for a few
// consecutive inputs, 4 bytes per output (one 32-bit lane of a register):
//   int8: inputs k..k+3, one byte each, q + 128;
//   int4: inputs k..k+7, byte i holding input k+i (low nibble) and k+4+i (high nibble), each q + 8;
//   5- / 6-bit (GGUF's Q5_0 / Q6_K values, int8 modules whose values fit): units of 32 / 16 inputs
//   of u = q + 16 / q + 32, int4's nibble lines and a line of their high bits (5), or three lines
//   of 6-bit bytes whose top two bits hold a fourth register (6)
//   (quantized_kernels.inc, Low): 5 / 6 bits a weight instead of int8's 8, unpacked in registers.
// Interleaved (`ways` = WAYS, the AVX-512 build's int8 and int4 panels with one-level scales:
// fast/quant_panels.py `interleave`): each group of WAYS panels (the last one's w = what is left)
// is one stream of w * (stream + K / G * 16 * (scale bytes + minimum bytes)) bytes, weight group by
// weight group (G inputs): its G / KL units line by line (unit u of panel j at (u * w + j) * 64),
// then the w panels' 16 scales each, then (Int4Min) their 16 fp32 minimums. One row of x then reads
// a thread's groups as one stream, where panels one after another read as four (and four of
// scales): the hardware prefetcher follows one stream and lost the others (one thread, the 1B
// shape's int4 panels: 74-80% of the plain read against 93-108% interleaved; in this kernel,
// benchmarks/panel_rates.py: one row of int4 1.28x at one thread, 1.08-1.58x at two). The scales
// lie inside the stream, not in a second one beside it, for the same reason: the 1B shape's int4
// group-64 projections at one row, 2 threads, an Intel Xeon (AVX-512 with VNNI and AMX, 2 cores)
// with its plain read at 28 GB/s (2026-12-06, each kind's 16 matrices in turn, best of 8, four
// rounds): gate/up 80-82% -> 87-89% of the plain read, down 65-68% -> 74-75%, the head 84-91% ->
// 96-101% (with GROUP_AHEAD). In a scratch build over the old layout, the scales not read at all
// gave 80-82% of the bytes counted with them, read from the line just loaded 75-76%; prefetching the
// scales' own stream (0.25-1 KB ahead, or a group's scales at once) none above the 64-68% without.
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
// Two-level scales (GGUF's K-quants, fast/two_level.py): a group's scale is a small integer
// sub-scale times an f16 super-scale shared by the SG inputs of a super-block (Q6_K: int8 sc per 16
// inputs under an f16 d per 256; Q4_K: 6-bit sc and m per 32 under f16 d and dmin), the file's own
// form: Q6_K reads 1 + 1/16 + 2/256 bytes a weight instead of 1 + 4/16, Q4_K 0.5 + 2/32 + 4/256
// instead of 0.5 + 8/32. They run as llama.cpp runs its K-quant files (its Q8_K activations): x is
// rounded per super-block instead of per block of B, each group's 16-bit pair sums are multiplied
// by the group's sub-scale in the `vpmaddwd` that widens them to 32 bits anyway, and a super-block
// converts to fp32 once (quantized_kernels.inc, panel_super), where a per-group scale costs a
// conversion and two FMAs per group and row. Chosen at build time by the scale type (TwoLevel), no
// branch per element.
//
// Numerics: the weights are exactly the reference module's q and scales; the activations are
// rounded to 8 bits per block of B inputs (per super-block with two-level scales; scale max|x| /
// 127), the one approximation, as in llama.cpp. Integer sums are exact; each block's (super-block's)
// sum is scaled in fp32.
//
// Streams and blocking: up to 8 rows of x take all of K, more go over K blocks of ~16 KB per panel,
// which the later rows re-read from L1/L2 (k_block). Interleaved panels go a group at a time in
// passes of two rows (quantized_kernels.inc, run_ways). Otherwise MROWS rows a pass (8, or 4 in the
// AVX2 build) with their sums in registers; one row of int8 / int4 panels (the AVX2 build's) reads
// TASK_PANELS panel streams at once, unprefetched; every other pass one panel after another,
// prefetched (AHEAD).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "guided.h"
#include "wide.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t LINE = 64;
// Prefetch distance of a panel stream, into L2: 8 KB, which kept the most lines in flight for one
// stream (a thread reading one panel after another; 1B shape's matrices, 2 threads, AVX512-VNNI
// EPYC: against 1, 4, 12 and 16 KB, and L1 or L3 hints). Those passes need it: without it, 2 to 8
// rows read 0.67-1.01x (benchmarks/panel_rates.py against this tree, 4 alternating rounds, medians
// per panel type and row count, 2026-12-06; 0.82x or less at 8 rows) and one row of the K-quants'
// single-stream passes 0.91x (Q6_K) and 1.07x (Q4_K). The one-row pass over TASK_PANELS streams
// takes none (rows_for).
constexpr int64_t AHEAD = 8192;
// Prefetch distances of an interleaved group's stream read in one pass (one or two rows of x): each
// line GROUP_AHEAD_L2 bytes ahead into L2 and GROUP_AHEAD into L1, as csrc/bf16.cpp's one-row product
// does on Intel. Passes of more rows prefetch the next block instead (run_ways). Measured, L1 only:
// 1B-sized int4 group-64 matrices, 1 row, 2 threads, the Intel Xeon of the layout comment at a 28
// GB/s plain read, 2026-12-06: 0.5 KB 64-67% of the plain read, none 65-68%, 1 KB 69-71%, 2 KB
// 72-73%, 1 KB into L2 65-68%. Then both (the 1B model's 113 projections in model order, one row,
// their bytes over the time against the plain read just before, two fresh processes a tree
// alternated three times, medians, 2026-12-07): int8 80% with 2 KB into L1 only, 92% with 4 KB
// into L2 and 0.5 KB into L1 (8 KB and 1 KB: 83%); int4 g64 72% either way (68% at 8 KB / 1 KB).
constexpr int64_t GROUP_AHEAD_L2 = 4096;
constexpr int64_t GROUP_AHEAD = 512;
constexpr int64_t BLOCK_BYTES = 16384;
// Rows of x per pass over a panel. A row's 16 int32 sums are one register in the AVX-512 build
// (8 rows: 8 of 32) but two in the AVX2 build, where 8 rows' sums alone fill all 16 and every dot
// product went through the stack; there 4 rows a pass, the next 4 re-reading the K block from L1/L2.
// TASK_PANELS: panels a thread takes at a time; one row of x goes over all of them in flight
// (independent sums, one stream each) when each unit is one line (int8, int4 with one-level scales:
// `rows_for`). Four in the AVX-512 build (1B shape's int4 matrices, one row, 2 threads,
// AVX512-VNNI EPYC, two interleaved runs: 24.0 -> 27.8 and 21.9 -> 25.3 GB/s, int8 29.5 -> 31.4,
// bit-equal); two in the AVX2 build, whose 16 registers hold two panels' sums, group and total sums
// (of two registers each) and no more. Every other pass reads one panel at a time, a thread's panels
// one sequential stream: over the same models' panels against the passes with two or four panels in
// flight (benchmarks/panel_rates.py, two runs of 4 alternating processes, medians), Q4_K 1.02-1.22x
// at one row and 1.15-1.28x at two, Q6_K 1.14-1.16x and 1.18-1.22x, int4 at two rows 1.07-1.14x
// (1.14x in one process, 30 alternations); one row of int4 / int8 one panel at a time 0.97x / 0.94x.
// WAYS: panels interleaved a group where the format is interleaved (the layout comment; 1: never).
#if defined(__AVX512F__)
constexpr int MROWS = 8;
constexpr int64_t TASK_PANELS = 4;
constexpr int64_t WAYS = 4;
#else
constexpr int MROWS = 4;
constexpr int64_t TASK_PANELS = 2;
constexpr int64_t WAYS = 1;
#endif

inline void prefetch_l2(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// Whether to run the VNNI copies: the CPU has AVX512-VNNI and TORCHFORMER_VNNI is not 0 (the
// tests run the other copies on a VNNI machine through it).
bool vnni() {
  static const bool has = [] {
    const char* env = std::getenv("TORCHFORMER_VNNI");
#if defined(__AVX512F__)
    return __builtin_cpu_supports("avx512vnni") && !(env && std::string(env) == "0");
#else
    (void)env;  // the AVX2 build has no VNNI copy
    return false;
#endif
  }();
  return has;
}

// x rows quantized per block of B inputs.
struct Acts {
  const int8_t* q;      // (R, K)
  const float* scale;   // (R, K / B): max|x| / 127 of the block (0 for an all-zero block)
  const int32_t* bias;  // (R, K / B): what the block's integer sum overcounts (int4: 8 * sum q)
  const float* sum;     // (R, K / B): s * sum q, the rounded block's sum (formats with a minimum only)
  const int16_t* gsum;  // (R, K / B, GP): each weight group's sum of q, GP = the groups a block rounded up
                        // to even, the pad 0 (two-level scales only: B is their super-block)
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
      w16f m = w16_setzero_ps();
      for (; k < B; k += 16) m = w16_max_ps(m, w16_abs_ps(w16_loadu_ps(xb + k)));
      amax = w16_reduce_max_ps(m);
    } else {
      for (; k < B; ++k) amax = std::max(amax, std::fabs(xb[k]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    scale[b] = amax / 127.f;
    int32_t sum = 0;
    if (B % 16 == 0) {
      w16i s = w16_setzero_si512();
      for (k = 0; k < B; k += 16) {
        const w16i v = w16_cvtps_epi32(w16_mul_ps(w16_loadu_ps(xb + k), w16_set1_ps(inv)));
        s = w16_add_epi32(s, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * B + k), w16_cvtsepi32_epi8(v));
      }
      sum = w16_reduce_add_epi32(s);
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

// One row's sums of q (K) per group of G inputs, GP slots per block of B (the pad 0): |sum| <= G * 127.
void group_sums(const int8_t* q, int64_t K, int64_t B, int64_t G, int64_t GP, int16_t* out) {
  for (int64_t b = 0; b < K / B; ++b) {
    for (int64_t g = 0; g < GP; ++g) {
      int32_t sum = 0;
      if (g < B / G)
        for (int64_t k = b * B + g * G; k < b * B + (g + 1) * G; ++k) sum += q[k];
      out[b * GP + g] = static_cast<int16_t>(sum);
    }
  }
}

// The scale type of two-level scales (module comment): int8 sub-scales under f16 super-scales.
struct TwoLevel {};

struct Weights {
  const uint8_t* panels;  // P panels of K / KL lines
  const void* scale;      // (P, K / G, 16) fp32, f16, or int8 sub-scales (TwoLevel): the kernels' S
  const void* minimum;    // (P, K / G, 16) fp32 or int8 (TwoLevel): what a group subtracts per unit of x (MIN)
  const uint16_t* super_scale;  // (P, K / SG, 16) f16 (TwoLevel only)
  const uint16_t* super_min;    // (P, K / SG, 16) f16 (TwoLevel and MIN only)
  int64_t K, G, SG;             // G: inputs per weight scale (K for one scale per row); SG per super-scale
};

namespace plain {
#include "quantized_kernels.inc"
}  // namespace plain

#if defined(__AVX512F__)
// The same kernels with VNNI's `vpdpbusd` (module comment); run only where the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace with_vnni {
#include "quantized_kernels.inc"
}  // namespace with_vnni
#pragma GCC pop_options
#else
namespace with_vnni = plain;  // the AVX2 build has no VNNI copy: vnni() is false there
#endif

// The activation block: 32 inputs, or the largest power of two dividing both the group and 32.
int64_t act_block(int64_t K, int64_t G) { return std::gcd<int64_t>(std::gcd<int64_t>(32, G), K); }

// Checks a two-level part: (P, K / per, 16) of dtype.
void check_part(const torch::Tensor& t, at::ScalarType dtype, int64_t P, int64_t K, int64_t per, const char* name,
                const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == P * (K / per) * LANES, name, ": ",
              what, " must be ", c10::toString(dtype), " (P, K / ", per, ", 16)");
}

template <class F, class FV, class S>
void dispatch(const Weights& wt, const Acts& a, int64_t R, int64_t N, float* o, int64_t ways) {
  if constexpr (WAYS > 1 && F::UNIT == LINE && !std::is_same_v<S, TwoLevel>) {
    if (ways > 1) {
#if defined(__AVX512F__)
      if (vnni()) return with_vnni::run_ways<FV, true, S>(wt, a, R, N, o);
#endif
      return plain::run_ways<F, false, S>(wt, a, R, N, o);
    }
  }
#if defined(__AVX512F__)
  if (vnni()) return with_vnni::run<FV, true, S>(wt, a, R, N, o);
#endif
  plain::run<F, false, S>(wt, a, R, N, o);
}

// minimum: defined for F::MIN only; super_scale (f16 (P, K / SG, 16)) with int8 scale (and, for
// F::MIN, super_min with an int8 minimum): two-level scales over SG = super_group inputs.
template <class F, class FV>  // the format's plain and VNNI copies
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale,
                      const torch::Tensor& minimum, int64_t N, int64_t G, const std::optional<torch::Tensor>& sup,
                      const std::optional<torch::Tensor>& sup_min, int64_t SG, int64_t ways, const char* name) {
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, name,
              ": x must be (R, K) contiguous fp32");
  TORCH_CHECK(K % F::KL == 0 && G % F::KL == 0 && K % G == 0, name, ": K and the group must be multiples of ",
              F::KL, ", the group dividing K");
  const int64_t P = (N + LANES - 1) / LANES;
  const bool two = sup.has_value();
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(ways == 1 || (ways == WAYS && WAYS > 1 && F::UNIT == LINE && !two), name, ": ways must be 1",
              WAYS > 1 ? " or " + std::to_string(WAYS) + " (one-level scales, int8 / int4 panels)" : std::string(),
              " here, got ", ways);
  // Interleaved, each weight group's scales (and minimums) lie in the panels' stream after its units
  // (the layout comment): `scale` (`minimum`) is then an empty tensor that gives their dtype.
  const bool inside = ways > 1;
  const int64_t parts = inside ? (K / G) * LANES * (scale.element_size() + (F::MIN ? 4 : 0)) : 0;
  TORCH_CHECK(wp.is_contiguous() && wp.numel() * wp.element_size() == P * ((K / F::KL) * F::UNIT + parts), name,
              ": the panels do not match N and K", inside ? " (interleaved: with their scales)" : "");
  if (two) {
    TORCH_CHECK(SG > 0 && SG % G == 0 && K % SG == 0, name, ": super_group must be a multiple of the group dividing K");
    // int16 group sums of x and int32 super-block sums (quantized_kernels.inc, panel_super)
    TORCH_CHECK(G <= 256 && SG <= 4096, name, ": two-level scales take groups of at most 256 inputs and ",
                "super-blocks of at most 4096, got ", G, " and ", SG);
    check_part(scale, at::kChar, P, K, G, name, "scale (two-level sub-scales)");
    check_part(*sup, at::kHalf, P, K, SG, name, "super_scale");
    TORCH_CHECK(!F::MIN || sup_min.has_value(), name, ": two-level scales need super_min too");
    if constexpr (F::MIN) {
      check_part(minimum, at::kChar, P, K, G, name, "minimum (two-level sub-minimums)");
      check_part(*sup_min, at::kHalf, P, K, SG, name, "super_min");
    }
  } else {
    TORCH_CHECK(!sup_min.has_value(), name, ": super_min needs super_scale");
    TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && scale.is_contiguous() &&
                    scale.numel() == (inside ? 0 : P * (K / G) * LANES),
                name, inside ? ": interleaved, scale must be an empty fp32 or f16 tensor (its scales lie in the panels)"
                             : ": scale must be fp32 or f16 (P, K / group, 16)");
    TORCH_CHECK(!(half && F::MIN), name, ": scale must be fp32");
    if constexpr (F::MIN) {
      if (inside) {
        TORCH_CHECK(minimum.scalar_type() == at::kFloat && minimum.numel() == 0, name,
                    ": interleaved, minimum must be an empty fp32 tensor (its minimums lie in the panels)");
      } else {
        check_part(minimum, at::kFloat, P, K, G, name, "minimum");
      }
    }
  }
  // x's blocks: the super-block where scales are two-level (panel_super), else act_block
  const int64_t B = two ? SG : act_block(K, G), GP = two ? (SG / G + 1) / 2 * 2 : 0;
  // The rounded x in one workspace (one allocation, not five: at one row of a small matrix each
  // costs about what the product does): per row, its scales, biases and sums (4 bytes each per
  // block), then the group sums (2 bytes), then q (1 byte), each part at a multiple of 64 bytes
  // from the start, which torch's CPU allocator aligns to 64.
  const int64_t blocks = R * (K / B), nsums = F::MIN && !two ? blocks : 0;
  auto align = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t at_bias = align(blocks * 4), at_sums = at_bias + align(blocks * 4),
                at_gsum = at_sums + align(nsums * 4), at_q = at_gsum + align(blocks * GP * 2);
  auto work = torch::empty({at_q + R * K}, x.options().dtype(at::kByte));
  uint8_t* base = work.data_ptr<uint8_t>();
  float* xs = reinterpret_cast<float*>(base);
  int32_t* bias = reinterpret_cast<int32_t*>(base + at_bias);
  float* sp = nsums ? reinterpret_cast<float*>(base + at_sums) : nullptr;
  int16_t* gsum = reinterpret_cast<int16_t*>(base + at_gsum);
  int8_t* q = reinterpret_cast<int8_t*>(base + at_q);
  const float* xp = x.data_ptr<float>();
  const int32_t offset = F::offset(vnni());
  for (int64_t r = 0; r < R; ++r)
    quantize_row(xp + r * K, K, B, offset, q + r * K, xs + r * (K / B), bias + r * (K / B),
                 sp ? sp + r * (K / B) : nullptr);
  if (two)
    for (int64_t r = 0; r < R; ++r) group_sums(q + r * K, K, B, G, GP, gsum + r * (K / B * GP));
  auto out = torch::empty({R, N}, x.options());
  auto f16 = [](const std::optional<torch::Tensor>& t) {
    return t.has_value() ? reinterpret_cast<const uint16_t*>(t->data_ptr()) : nullptr;
  };
  const Weights wt{static_cast<const uint8_t*>(wp.data_ptr()), scale.data_ptr(),
                   F::MIN ? minimum.data_ptr() : nullptr, f16(sup), f16(sup_min), K, G, two ? SG : K};
  const Acts a{q, xs, bias, sp, gsum, K, B};
  float* o = out.data_ptr<float>();
  if (two)
    dispatch<F, FV, TwoLevel>(wt, a, R, N, o, 1);
  else if constexpr (F::MIN)  // fp32 scales only (checked above): one copy fewer to compile
    dispatch<F, FV, float>(wt, a, R, N, o, ways);
  else if (half)
    dispatch<F, FV, uint16_t>(wt, a, R, N, o, ways);
  else
    dispatch<F, FV, float>(wt, a, R, N, o, ways);
  return out;
}

// One row of panel_row: x rounded into `work` as `product` rounds it, then the format's pass.
template <class F, class FV>
void one_row(const uint8_t* panels, const void* scale, bool half, int64_t N, int64_t K, int64_t G, int64_t ways,
             const float* x, float* o, uint8_t* work) {
  const int64_t B = act_block(K, G), at_q = 2 * ((K / B * 4 + 63) / 64 * 64);
  float* xs = reinterpret_cast<float*>(work);
  int32_t* bias = reinterpret_cast<int32_t*>(work + at_q / 2);
  int8_t* q = reinterpret_cast<int8_t*>(work + at_q);
  quantize_row(x, K, B, F::offset(vnni()), q, xs, bias, nullptr);
  const Weights wt{panels, scale, nullptr, nullptr, nullptr, K, G, K};
  const Acts a{q, xs, bias, nullptr, nullptr, K, B};
  if (half)
    dispatch<F, FV, uint16_t>(wt, a, 1, N, o, ways);
  else
    dispatch<F, FV, float>(wt, a, 1, N, o, ways);
}

}  // namespace

// The bytes of `work` panel_row takes for K inputs: the row's block scales and biases, then q.
int64_t panel_row_work(int64_t K) { return 2 * ((K * 4 + 63) / 64 * 64) + K; }

// One row x (K fp32) through int8 (bits 8) or int4 (bits 4) panels with one-level scales, fp32 or
// f16 (`half`) (interleaved where ways > 1: the scales lie in the panels) -> out (N fp32), bit for
// bit int8_mm's / int4_mm's row; work: a 64-aligned panel_row_work(K) bytes of the caller's
// (csrc/step.cpp: one per thread; in a team the threads share the panels). Raw pointers: the step
// calls it ~25 times a token at the toy shape, each tensor's header a cache miss once the weights
// have streamed through.
void panel_row(int64_t bits, const uint8_t* panels, const void* scale, bool half, int64_t N, int64_t K, int64_t G,
               int64_t ways, const float* x, float* out, uint8_t* work) {
  if (bits == 8)
    return one_row<plain::Int8, with_vnni::Int8>(panels, scale, half, N, K, G, ways, x, out, work);
  one_row<plain::Int4, with_vnni::Int4>(panels, scale, half, N, K, G, ways, x, out, work);
}

// x (R, K) fp32; panels (P, K / 4, 16, 4) uint8 (q + 128); scale (P, K / group, 16) fp32 or f16, or int8
// sub-scales under super_scale (P, K / super_group, 16) f16 -> (R, N) fp32. ways: WAYS where the panels
// and one-level scales are interleaved (the layout comment), else 1.
torch::Tensor int8_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group, const std::optional<torch::Tensor>& super_scale, int64_t super_group,
                      int64_t ways) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int8_mm: panels must be uint8 (q + 128)");
  return product<plain::Int8, with_vnni::Int8>(x, wp, scale, torch::Tensor(), N, group, super_scale, std::nullopt,
                                               super_group, ways, "int8_mm");
}

// x (R, K) fp32; panels (P, K / 8, 16, 4) uint8 (two inputs per byte); scale as int8_mm's.
torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group, const std::optional<torch::Tensor>& super_scale, int64_t super_group,
                      int64_t ways) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int4_mm: panels must be uint8");
  return product<plain::Int4, with_vnni::Int4>(x, wp, scale, torch::Tensor(), N, group, super_scale, std::nullopt,
                                               super_group, ways, "int4_mm");
}

// As int4_mm over nibbles u (no offset: w = scale * u - minimum per group); minimum (P, K / group, 16)
// fp32, or int8 sub-minimums under super_min f16 (with two-level scales).
torch::Tensor int4_min_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale,
                          const torch::Tensor& minimum, int64_t N, int64_t group,
                          const std::optional<torch::Tensor>& super_scale, const std::optional<torch::Tensor>& super_min,
                          int64_t super_group, int64_t ways) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "int4_min_mm: panels must be uint8");
  return product<plain::Int4Min, with_vnni::Int4Min>(x, wp, scale, minimum, N, group, super_scale, super_min,
                                                     super_group, ways, "int4_min_mm");
}

// x (R, K) fp32; panels (P, K / KL, REGS / 2 + 1, 16, 4) uint8 of `bits` = 5 (KL 32) or 6 (KL 16)
// bit values u = q + 2^(bits - 1) (quantized_kernels.inc, Low); scale as int8_mm's.
torch::Tensor intn_mm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scale, int64_t N,
                      int64_t group, int64_t bits, const std::optional<torch::Tensor>& super_scale,
                      int64_t super_group) {
  TORCH_CHECK(wp.scalar_type() == at::kByte, "intn_mm: panels must be uint8");
  TORCH_CHECK(bits == 5 || bits == 6, "intn_mm: bits must be 5 or 6, got ", bits);
  if (bits == 5)
    return product<plain::Int5, with_vnni::Int5>(x, wp, scale, torch::Tensor(), N, group, super_scale, std::nullopt,
                                                 super_group, 1, "intn_mm");
  return product<plain::Int6, with_vnni::Int6>(x, wp, scale, torch::Tensor(), N, group, super_scale, std::nullopt,
                                               super_group, 1, "intn_mm");
}

bool has_vnni() { return vnni(); }
// The ways the interleaved int8 / int4 panels of this build take (1: never interleaved).
int64_t panel_ways() { return WAYS; }

TORCH_LIBRARY_FRAGMENT(torchformer, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("panel_ways() -> int", &panel_ways);
  m.def("int8_mm(Tensor x, Tensor panels, Tensor scale, int n, int group, Tensor? super_scale=None, "
        "int super_group=0, int ways=1) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor panels, Tensor scale, int n, int group, Tensor? super_scale=None, "
        "int super_group=0, int ways=1) -> Tensor");
  m.def("intn_mm(Tensor x, Tensor panels, Tensor scale, int n, int group, int bits, Tensor? super_scale=None, "
        "int super_group=0) -> Tensor");
  m.def("int4_min_mm(Tensor x, Tensor panels, Tensor scale, Tensor minimum, int n, int group, "
        "Tensor? super_scale=None, Tensor? super_min=None, int super_group=0, int ways=1) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchformer, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm", &int4_mm);
  m.impl("intn_mm", &intn_mm);
  m.impl("int4_min_mm", &int4_min_mm);
}
