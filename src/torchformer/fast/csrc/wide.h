// Sixteen 32-bit lanes, the kernels' one vector width, on either instruction set the build targets
// (fast/native.py picks the flags from the CPU):
//
// - AVX-512: a vector is one zmm register and every `w16_*` name below is the `_mm512_*` intrinsic
//   of the same suffix (a macro, so the AVX-512 build compiles exactly the intrinsics it names).
// - AVX2 (+FMA, F16C): a vector is two ymm registers, lanes 0-7 and 8-15, and each `w16_*` runs its
//   256-bit instruction on both halves. The kernels' layouts keep every operation inside a 32-bit
//   lane (a panel line holds 16 outputs x 4 bytes; byte products sum within their lane), so the
//   split is exact; only the horizontal sums (reduce_add_ps) associate in another order.
//
// Why not at::vec: the integer dot products (maddubs / madd / dpbusd) and the masked tails have no
// at::vec form, and the panels' 16-output layout is fixed by fast/formats.py for both widths.
// Only the operations the kernels use are here.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)

using w16f = __m512;
using w16i = __m512i;
using w16mask = __mmask16;
using w16mask32 = __mmask32;

#define w16_setzero_ps _mm512_setzero_ps
#define w16_setzero_si512 _mm512_setzero_si512
#define w16_set1_ps _mm512_set1_ps
#define w16_set1_epi32 _mm512_set1_epi32
#define w16_set1_epi16 _mm512_set1_epi16
#define w16_set1_epi8 _mm512_set1_epi8
#define w16_loadu_ps _mm512_loadu_ps
#define w16_storeu_ps _mm512_storeu_ps
#define w16_loadu_si512 _mm512_loadu_si512
#define w16_maskz_loadu_ps _mm512_maskz_loadu_ps
#define w16_mask_storeu_ps _mm512_mask_storeu_ps
#define w16_maskz_loadu_epi16 _mm512_maskz_loadu_epi16
#define w16_add_ps _mm512_add_ps
#define w16_mul_ps _mm512_mul_ps
#define w16_max_ps _mm512_max_ps
#define w16_abs_ps _mm512_abs_ps
#define w16_fmadd_ps _mm512_fmadd_ps
#define w16_fnmadd_ps _mm512_fnmadd_ps
#define w16_reduce_add_ps _mm512_reduce_add_ps
#define w16_reduce_max_ps _mm512_reduce_max_ps
#define w16_reduce_add_epi32 _mm512_reduce_add_epi32
#define w16_add_epi32 _mm512_add_epi32
#define w16_sub_epi32 _mm512_sub_epi32
#define w16_mullo_epi32 _mm512_mullo_epi32
#define w16_add_epi16 _mm512_add_epi16
#define w16_and_si512 _mm512_and_si512
#define w16_xor_si512 _mm512_xor_si512
#define w16_abs_epi8 _mm512_abs_epi8
#define w16_maddubs_epi16 _mm512_maddubs_epi16
#define w16_madd_epi16 _mm512_madd_epi16
#define w16_srli_epi16 _mm512_srli_epi16
#define w16_slli_epi16 _mm512_slli_epi16
#define w16_slli_epi32 _mm512_slli_epi32
#define w16_cvtepi32_ps _mm512_cvtepi32_ps
#define w16_cvtps_epi32 _mm512_cvtps_epi32
#define w16_cvtsepi32_epi8 _mm512_cvtsepi32_epi8
#define w16_cvtph_ps _mm512_cvtph_ps
#define w16_cvtepi8_epi32 _mm512_cvtepi8_epi32
#define w16_castsi512_ps _mm512_castsi512_ps
#define w16_load_ps _mm512_load_ps
#define w16_mask_max_ps _mm512_mask_max_ps
#define w16_mask_add_ps _mm512_mask_add_ps

// w negated in the bytes where x is negative (int8's dot products without VNNI: |x| times the sign
// moved onto the weight).
inline __m512i w16_sign_of_x_epi8(__m512i w, __m512i x) {
  return _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
}
#define w16_dpbusd_epi32 _mm512_dpbusd_epi32
// w16_dpbusd_epi32 as an asm statement whose accumulator is its output register (int8's VNNI dot
// products, quantized_kernels.inc). Through the intrinsic, GCC 12 treated the accumulator as a
// fresh result: over four interleaved panels of two rows it kept six of the eight int8 sums on the
// stack, a load and a store around each `vpdpbusd` (two to eight rows at 0.44-0.76x the speed of
// panels in order; with this 1.0-1.6x, 2 threads, in-cache matrices of the 1B shape). int4's two
// `vpdpbusd` a line keep the intrinsic: with this, its four- and eight-row passes ran at ~0.8x.
inline __m512i w16_dpbusd_acc(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
  return acc;
}
// low | (high & mask), one `vpternlogd`.
inline __m512i w16_or_and(__m512i low, __m512i high, __m512i mask) {
  return _mm512_ternarylogic_epi32(low, high, mask, 0xF8);
}

// 16 vectors -> the vector of their 16 horizontal sums, in order: a transpose-and-add tree (15
// adds and 31 shuffles for 16 keys, where 16 separate horizontal sums take ~4x the work).
inline __m512 w16_reduce16(const __m512* a) {
  __m512 r[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // r[i] = [a[2i]'s two 256-bit halves added | a[2i+1]'s]
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // u[i]: 128-bit quarter t holds 4 partial sums of a[4i + t]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // w[i]: quarter t holds 2 partials of a[8i + t], then 2 of a[8i + 4 + t]
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4t + i: the sum of a[4i + t]; put it in lane 4i + t
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}
// 16 pairs of int8 -> 16 lanes, lane i holding a[i] and b[i] widened to two int16 (`vpmaddwd`'s
// multiplier: a two-level group's sub-scales, a[i] == b[i], or two groups' side by side).
inline __m512i w16_pairs_epi8(__m128i a, __m128i b) {
  return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}
// 16 bf16 (the top halves of fp32s) widened to fp32, zero where the mask's bit is clear.
inline __m512 w16_widen_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

struct w16f {
  __m256 lo, hi;
};
struct w16i {
  __m256i lo, hi;
};
using w16mask = uint16_t;
using w16mask32 = uint32_t;

inline w16f w16_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline w16i w16_setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline w16f w16_set1_ps(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline w16i w16_set1_epi32(int a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
inline w16i w16_set1_epi16(short a) { return {_mm256_set1_epi16(a), _mm256_set1_epi16(a)}; }
inline w16i w16_set1_epi8(char a) { return {_mm256_set1_epi8(a), _mm256_set1_epi8(a)}; }

inline w16f w16_loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void w16_storeu_ps(float* p, w16f a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline w16i w16_loadu_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}

// Lane i of each half all ones where bit i (lo) or 8 + i (hi) of m is set: maskload / maskstore's form.
inline __m256i w16_lanes(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), bit), bit);
}
inline w16f w16_maskz_loadu_ps(w16mask m, const float* p) {  // masked lanes are not read (cannot fault)
  if (m == 0xFFFF) return w16_loadu_ps(p);
  return {_mm256_maskload_ps(p, w16_lanes(m)), _mm256_maskload_ps(p + 8, w16_lanes(m >> 8))};
}
inline w16f w16_load_ps(const float* p) { return w16_loadu_ps(p); }
inline void w16_mask_storeu_ps(float* p, w16mask m, w16f a) {
  _mm256_maskstore_ps(p, w16_lanes(m), a.lo);
  _mm256_maskstore_ps(p + 8, w16_lanes(m >> 8), a.hi);
}
// N 16-bit elements at p into out, zero where the mask's bit is clear (tails: rare, so elementwise;
// masked elements are not read).
template <int N>
inline void w16_masked_u16(const void* p, uint32_t m, uint16_t* out) {
  const uint16_t* s = static_cast<const uint16_t*>(p);
  for (int i = 0; i < N; ++i) out[i] = (m >> i & 1u) ? s[i] : 0;
}
inline w16i w16_maskz_loadu_epi16(w16mask32 m, const void* p) {  // 32 elements
  alignas(32) uint16_t v[32];
  w16_masked_u16<32>(p, m, v);
  return w16_loadu_si512(v);
}

#define W16_BINARY(name, op, T) \
  inline T name(T a, T b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
W16_BINARY(w16_add_ps, _mm256_add_ps, w16f)
W16_BINARY(w16_mul_ps, _mm256_mul_ps, w16f)
W16_BINARY(w16_max_ps, _mm256_max_ps, w16f)
W16_BINARY(w16_add_epi32, _mm256_add_epi32, w16i)
W16_BINARY(w16_sub_epi32, _mm256_sub_epi32, w16i)
W16_BINARY(w16_mullo_epi32, _mm256_mullo_epi32, w16i)
W16_BINARY(w16_add_epi16, _mm256_add_epi16, w16i)
W16_BINARY(w16_and_si512, _mm256_and_si256, w16i)
W16_BINARY(w16_xor_si512, _mm256_xor_si256, w16i)
W16_BINARY(w16_maddubs_epi16, _mm256_maddubs_epi16, w16i)
W16_BINARY(w16_madd_epi16, _mm256_madd_epi16, w16i)
W16_BINARY(w16_sign_of_x_epi8, _mm256_sign_epi8, w16i)  // also 0 where x is 0, whose |x| is 0: same dot
#undef W16_BINARY
// Declared only: the kernels' VNNI branches (`if constexpr`) are never instantiated in this build.
w16i w16_dpbusd_epi32(w16i acc, w16i u, w16i s);
w16i w16_dpbusd_acc(w16i acc, w16i u, w16i s);

// a op b where the mask's bit is set, src elsewhere.
inline w16f w16_blend(w16f src, w16mask m, w16f v) {
  return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(w16_lanes(m))),
          _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(w16_lanes(m >> 8)))};
}
inline w16f w16_mask_max_ps(w16f src, w16mask m, w16f a, w16f b) { return w16_blend(src, m, w16_max_ps(a, b)); }
inline w16f w16_mask_add_ps(w16f src, w16mask m, w16f a, w16f b) { return w16_blend(src, m, w16_add_ps(a, b)); }

inline w16f w16_abs_ps(w16f a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline w16i w16_abs_epi8(w16i a) { return {_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)}; }
inline w16f w16_fmadd_ps(w16f a, w16f b, w16f c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline w16f w16_fnmadd_ps(w16f a, w16f b, w16f c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline w16i w16_or_and(w16i low, w16i high, w16i mask) {
  return {_mm256_or_si256(low.lo, _mm256_and_si256(high.lo, mask.lo)),
          _mm256_or_si256(low.hi, _mm256_and_si256(high.hi, mask.hi))};
}
inline w16i w16_srli_epi16(w16i a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
inline w16i w16_slli_epi16(w16i a, int n) { return {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
inline w16i w16_slli_epi32(w16i a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }

inline float w16_sum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float w16_reduce_add_ps(w16f a) { return w16_sum8(_mm256_add_ps(a.lo, a.hi)); }
inline float w16_reduce_max_ps(w16f a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline int w16_reduce_add_epi32(w16i a) {
  const __m256i m = _mm256_add_epi32(a.lo, a.hi);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline w16f w16_cvtepi32_ps(w16i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline w16i w16_cvtps_epi32(w16f a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline w16f w16_castsi512_ps(w16i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
// 16 int32 -> 16 int8 with signed saturation, in lane order (packs saturate 32 -> 16 -> 8: the same).
inline __m128i w16_cvtsepi32_epi8(w16i a) {
  const __m128i lo = _mm_packs_epi32(_mm256_castsi256_si128(a.lo), _mm256_extracti128_si256(a.lo, 1));
  const __m128i hi = _mm_packs_epi32(_mm256_castsi256_si128(a.hi), _mm256_extracti128_si256(a.hi, 1));
  return _mm_packs_epi16(lo, hi);
}
inline w16f w16_cvtph_ps(__m256i h) {  // 16 f16 -> fp32
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline w16i w16_cvtepi8_epi32(__m128i b) {  // 16 int8 -> int32
  return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
}
inline w16i w16_pairs_epi8(__m128i a, __m128i b) {  // as the AVX-512 build's
  return {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b))};
}

// 8 vectors -> the vector of their 8 horizontal sums, in order (two hadd levels, then the halves).
inline __m256 w16_reduce8(const __m256* h) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// 16 vectors -> the vector of their 16 horizontal sums, in order.
inline w16f w16_reduce16(const w16f* a) {
  __m256 h[16];
  for (int i = 0; i < 16; ++i) h[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  return {w16_reduce8(h), w16_reduce8(h + 8)};
}
// 16 bf16 (the top halves of fp32s) widened to fp32, zero where the mask's bit is clear.
inline w16f w16_widen_bf16(const uint16_t* p, w16mask m) {
  __m256i v;
  if (m == 0xFFFF) {
    v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    alignas(32) uint16_t b[16];
    w16_masked_u16<16>(p, m, b);
    v = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
  }
  const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16);
  const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16);
  return {_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
}

#else
#error "torchformer's CPU kernels need AVX-512 or AVX2 with FMA and F16C (fast/native.py picks the flags)"
#endif
