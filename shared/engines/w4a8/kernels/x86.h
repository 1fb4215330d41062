// Helpers shared by the x86 paths (AVX2 and up): each is `static inline` with the AVX2 target,
// so it inlines into any path whose target includes AVX2.

#ifndef SPECDEC_W4A8_X86_H
#define SPECDEC_W4A8_X86_H

#include <immintrin.h>

#include "blocks.h"

#define W4A8_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace w4a8 {

W4A8_AVX2 static inline float hsum8(__m256 v) {  // lanes_sum's tree
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

W4A8_AVX2 static inline int32_t hsum8_epi32(__m256i v) {  // exact: any order
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

// q4k_scales in registers: the 8 scales then the 8 mins, as 16 bytes (reads 16 bytes from
// `packed`: the 12 packed ones and 4 of the block's nibbles, which are ignored).
W4A8_AVX2 static inline __m128i q4k_scales_x86(const uint8_t* packed) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i p = _mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 1, 2, 0));  // a0 a2 a1 a2
  const __m128i q = _mm_shuffle_epi32(raw, _MM_SHUFFLE(1, 1, 0, 0));  // a0 a0 a1 a1
  const __m128i six = _mm_set1_epi32(0x3f3f3f3f);
  const __m128i high = _mm_or_si128(  // lanes 1 and 3: four low bits, then two high ones
      _mm_and_si128(_mm_srlv_epi32(p, _mm_set_epi32(4, 0, 0, 0)), _mm_set1_epi32(0x0f0f0f0f)),
      _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(q, 6), _mm_set1_epi32(0x03030303)), 4));
  return _mm_blend_epi32(_mm_and_si128(p, six), high, 0b1010);
}

// exp_fixed on 8 lanes: the same operations in the same order.
W4A8_AVX2 static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)));
  __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(EXP_P0), r), _mm256_set1_ps(EXP_P1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P5));
  __m256 y = _mm256_mul_ps(p, _mm256_mul_ps(r, r));
  y = _mm256_add_ps(y, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

W4A8_AVX2 static inline void silu_mul_x86(const float* gate, const float* up, int64_t count,
                                          float* out) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= count; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(up + i)));
  }
  for (; i < count; ++i) out[i] = gate[i] / (1.0f + exp_fixed(-gate[i])) * up[i];
}

W4A8_AVX2 static inline void exp_inplace_x86(float* x, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < count; ++i) x[i] = exp_fixed(x[i]);
}

// attend (blocks.h) on 8 lanes, every x86 path's (the lane order is the portable one's): each
// key and value converted once for all the group's heads, each head's sums as the portable
// path adds them.
W4A8_AVX2 static inline void attend_x86(const float* q, int group, const uint16_t* keys,
                                        const uint16_t* values, int64_t length, int d,
                                        float* scores, float* out) {
  constexpr int MAX_D = 512;
  alignas(32) float row[MAX_D];
  for (int64_t t = 0; t < length; ++t) {
    for (int i = 0; i < d; i += 8)
      _mm256_store_ps(row + i, _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + t * d + i))));
    for (int h = 0; h < group; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + h * d + i),
                                               _mm256_load_ps(row + i)));
      scores[h * length + t] = hsum8(acc);
    }
  }
  float totals[64];
  for (int h = 0; h < group; ++h) {
    float* sh = scores + h * length;
    float top = -INFINITY;
    for (int64_t t = 0; t < length; ++t) top = top > sh[t] ? top : sh[t];
    for (int64_t t = 0; t < length; ++t) sh[t] = sh[t] - top;
    exp_inplace_x86(sh, length);
    float total = 0.0f;
    for (int64_t t = 0; t < length; ++t) total += sh[t];
    totals[h] = total;
    for (int i = 0; i < d; ++i) out[h * d + i] = 0.0f;
  }
  for (int64_t t = 0; t < length; ++t) {
    for (int i = 0; i < d; i += 8)
      _mm256_store_ps(row + i, _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + t * d + i))));
    for (int h = 0; h < group; ++h) {
      const __m256 p = _mm256_set1_ps(scores[h * length + t]);
      float* o = out + h * d;
      for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i),
                                              _mm256_mul_ps(p, _mm256_load_ps(row + i))));
    }
  }
  for (int h = 0; h < group; ++h) {
    const float inv = 1.0f / totals[h];
    for (int i = 0; i < d; ++i) out[h * d + i] *= inv;
  }
}

// quantize_row (portable.cpp) in 8 lanes: the max is exact in any order, the rest elementwise,
// so every path gives the same bytes (rounding half to even, as nearbyint does by default).
W4A8_AVX2 static inline void quantize_row_x86(const float* x, int64_t k, ActBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* v = x + b * QK;
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < QK; i += 8)
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float amax = _mm_cvtss_f32(m);
    ActBlock& blk = out[b];
    std::memset(&blk, 0, sizeof(ActBlock));
    if (amax == 0.0f) continue;
    const __m256 inv = _mm256_set1_ps(127.0f / amax);
    blk.d = amax / 127.0f;
    __m256i first_half = _mm256_setzero_si256();
    for (int i = 0; i < QK; i += 32) {
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i lo = _mm256_packs_epi32(q[0], q[1]);  // lanes interleaved by 128-bit halves
      const __m256i hi = _mm256_packs_epi32(q[2], q[3]);
      __m256i bytes = _mm256_packs_epi16(lo, hi);
      bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      bytes = _mm256_max_epi8(bytes, _mm256_set1_epi8(-127));
      bytes = _mm256_min_epi8(bytes, _mm256_set1_epi8(127));
      if (i % 64 == 0) {
        first_half = bytes;  // stored with the second: A[0:16] B[0:16] A[16:32] B[16:32]
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.q + i - 32),
                           _mm256_permute2x128_si256(first_half, bytes, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk.q + i),
                           _mm256_permute2x128_si256(first_half, bytes, 0x31));
      }
      // the sums of each 16: widen to 16 bits, add pairs, then the pairs' sums
      const __m256i wide0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
      const __m256i wide1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
      const __m256i ones = _mm256_set1_epi16(1);
      const __m256i s0 = _mm256_madd_epi16(wide0, ones), s1 = _mm256_madd_epi16(wide1, ones);
      // hadd twice: lane 0 / 4 = the low / high half of s0, lane 1 / 5 the same of s1
      const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_setzero_si256());
      alignas(32) int32_t t[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t), s);
      blk.sums[i / 16] = static_cast<int16_t>(t[0] + t[4]);
      blk.sums[i / 16 + 1] = static_cast<int16_t>(t[1] + t[5]);
    }
  }
}

}  // namespace w4a8

#endif
