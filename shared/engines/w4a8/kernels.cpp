// Batch-invariant W4A8 kernels on a GGUF file's own Q4_K / Q6_K weights (the w4a8 engine).
//
// Every output element is computed by one thread, by one fixed sequence of instructions that
// does not depend on how many rows the call holds, which rows sit beside it, or how the work is
// split across threads:
//   * activations are quantized per row, in blocks of 256, to int8 with one float scale a block
//     (and int16 sums of each 16 values, for the weights' offsets);
//   * inside a block the products are summed as integers (exact in any order);
//   * across blocks they are summed in float, block after block, in 8 lanes added in one fixed
//     order at the end;
//   * tiles of rows share each weight block's unpacking; a row's arithmetic is the same in a
//     tile of 1 and of 4 (the tile only repeats it), and threads split the output columns, never
//     a dot product.
// The norms, the SiLU gate, rotary embeddings and attention are here too, each row computed
// alone by scalar or fixed-width code, so no row's rounding depends on the batch either.
//
// Built once per machine by shared/engines/w4a8/build.py (g++ -O3 -ffp-contract=off: no fused
// multiply-add the source does not write); the AVX2 path is picked at run time where the CPU
// has it, the portable one elsewhere. Results are bit-equal within one path, not across paths.

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 256;  // values a block

// GGUF's type ids
constexpr int GGML_F32 = 0;
constexpr int GGML_F16 = 1;
constexpr int GGML_Q4_K = 12;
constexpr int GGML_Q6_K = 14;

constexpr int64_t Q4K_BYTES = 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
constexpr int64_t Q6K_BYTES = 210;  // 128 low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d

// One activation block: d * q[at(e)] ~ x[e]; sums[j] = the sum of values 16 j .. 16 j + 15.
// Each 64 values, two 32-value halves A and B, are kept as A[0:16] B[0:16] A[16:32] B[16:32]:
// one register then holds 16 values of each of two Q4_K sub-blocks, so the products of two
// registers add as 16-bit sums before their one multiply by the two sub-blocks' scales
// (`madd`): one multiply fewer a 64 values than with the values in order.
struct ActBlock {
  float d;
  int8_t q[QK];
  int16_t sums[16];
};

// Where value e (0..255) of a block is kept in ActBlock::q.
inline int at(int e) {
  const int half = (e % 64) / 32, l = e % 32;
  return 64 * (e / 64) + 32 * (l / 16) + 16 * half + l % 16;
}

// The 8-lane accumulator value e's product lands in, on both paths: 0-3 for the first half of
// its 64, 4-7 for the second, as the AVX2 registers lay them.
inline int lane(int e) { return 4 * ((e % 64) / 32) + (e % 16) / 4; }

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(sign | half);
}

// The 8 six-bit scales and 8 six-bit mins of a Q4_K block, from its 12 packed bytes.
void q4k_scales(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  uint32_t a[3];
  std::memcpy(a, packed, 12);
  const uint32_t six = 0x3f3f3f3f, low4 = 0x0f0f0f0f, two = 0x03030303;
  const uint32_t words[4] = {
      a[0] & six,                                     // scales 0..3
      (a[2] & low4) | (((a[0] >> 6) & two) << 4),     // scales 4..7
      a[1] & six,                                     // mins 0..3
      ((a[2] >> 4) & low4) | (((a[1] >> 6) & two) << 4)};  // mins 4..7
  std::memcpy(scales, words, 8);
  std::memcpy(mins, words + 2, 8);
}

// ---- activations ------------------------------------------------------------------------

void quantize_row(const float* x, int64_t k, ActBlock* out) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* v = x + b * QK;
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
    ActBlock& blk = out[b];
    if (amax == 0.0f) {
      std::memset(&blk, 0, sizeof(ActBlock));
      continue;
    }
    const float inv = 127.0f / amax;
    blk.d = amax / 127.0f;
    int sums[16] = {0};
    for (int i = 0; i < QK; ++i) {
      const int q = std::min(127, std::max(-127, static_cast<int>(std::nearbyint(v[i] * inv))));
      blk.q[at(i)] = static_cast<int8_t>(q);
      sums[i / 16] += q;
    }
    for (int j = 0; j < 16; ++j) blk.sums[j] = static_cast<int16_t>(sums[j]);
  }
}

// ---- weights, portable path -----------------------------------------------------------------
// The same sums as the AVX2 path's (integers a block, then float across blocks), in 8 lanes.

// Lanes as the AVX2 path holds them: value l of a 32-value group in lane l / 4.
float lanes_sum(const float* lanes) {  // hsum8's order
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
         ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

float q4k_dot_portable(const uint8_t* w, const ActBlock* a, int64_t nb) {
  float lanes[8] = {0};
  for (int64_t b = 0; b < nb; ++b, w += Q4K_BYTES) {
    uint16_t dh, mh;
    std::memcpy(&dh, w, 2);
    std::memcpy(&mh, w + 2, 2);
    uint8_t sc[8], mn[8];
    q4k_scales(w + 4, sc, mn);
    const uint8_t* qs = w + 16;
    int32_t sumi[8] = {0}, msum[8];
    for (int j = 0; j < 8; ++j) {
      const uint8_t* bytes = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int q = (bytes[l] >> shift) & 0xf;
        sumi[lane(32 * j + l)] += sc[j] * q * a[b].q[at(32 * j + l)];
      }
      msum[j] = mn[j] * (a[b].sums[2 * j] + a[b].sums[2 * j + 1]);
    }
    const float dd = half_to_float(dh) * a[b].d;
    const float dm = half_to_float(mh) * a[b].d;
    for (int i = 0; i < 8; ++i) {
      lanes[i] = std::fma(dd, static_cast<float>(sumi[i]), lanes[i]);
      lanes[i] = std::fma(-dm, static_cast<float>(msum[i]), lanes[i]);
    }
  }
  return lanes_sum(lanes);
}

int q6k_value(const uint8_t* w, int i) {  // the 6-bit value of element i, 0..63
  const int half = i / 128, l = i % 128, t = l / 32, e = l % 32;
  const uint8_t* ql = w + 64 * half;
  const uint8_t* qh = w + 128 + 32 * half;
  const int low = (t % 2 == 0 ? ql[e] : ql[e + 32]);
  const int nib = t < 2 ? (low & 0xf) : (low >> 4);
  return nib | (((qh[e] >> (2 * t)) & 3) << 4);
}

float q6k_dot_portable(const uint8_t* w, const ActBlock* a, int64_t nb) {
  float lanes[8] = {0};
  for (int64_t b = 0; b < nb; ++b, w += Q6K_BYTES) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    uint16_t dh;
    std::memcpy(&dh, w + 208, 2);
    int32_t sumi[8];
    for (int m = 0; m < 8; ++m)
      sumi[m] = -32 * (a[b].sums[2 * m] * sc[2 * m] + a[b].sums[2 * m + 1] * sc[2 * m + 1]);
    for (int i = 0; i < QK; ++i) sumi[lane(i)] += sc[i / 16] * q6k_value(w, i) * a[b].q[at(i)];
    const float dd = half_to_float(dh) * a[b].d;
    for (int i = 0; i < 8; ++i) lanes[i] = std::fma(dd, static_cast<float>(sumi[i]), lanes[i]);
  }
  return lanes_sum(lanes);
}

// ---- weights, AVX2 path -----------------------------------------------------------------------

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 inline float hsum8(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7)), as lanes_sum
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// q4k_scales in registers: the 8 scales then the 8 mins, as 16 bytes (reads 16 bytes from
// `packed`: the 12 packed ones and 4 of the block's nibbles, which are ignored).
AVX2 inline __m128i q4k_scales_avx2(const uint8_t* packed) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i p = _mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 1, 2, 0));  // a0 a2 a1 a2
  const __m128i q = _mm_shuffle_epi32(raw, _MM_SHUFFLE(1, 1, 0, 0));  // a0 a0 a1 a1
  const __m128i six = _mm_set1_epi32(0x3f3f3f3f);
  const __m128i high = _mm_or_si128(  // lanes 1 and 3: four low bits, then two high ones
      _mm_and_si128(_mm_srlv_epi32(p, _mm_set_epi32(4, 0, 0, 0)), _mm_set1_epi32(0x0f0f0f0f)),
      _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(q, 6), _mm_set1_epi32(0x03030303)), 4));
  return _mm_blend_epi32(_mm_and_si128(p, six), high, 0b1010);
}

// R activation rows against one Q4_K weight row; out[r] = the r-th row's dot product.
template <int R>
AVX2 void q4k_rows_avx2(const uint8_t* w, const ActBlock* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  // shuffle masks: scale 2i into the low half's lanes, scale 2i + 1 into the high half's
  __m256i pick[4];
  for (int i = 0; i < 4; ++i) {
    const auto lo = static_cast<int16_t>((4 * i) | ((4 * i + 1) << 8));
    const auto hi = static_cast<int16_t>((4 * i + 2) | ((4 * i + 3) << 8));
    pick[i] = _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi);
  }
  for (int64_t b = 0; b < nb; ++b, w += Q4K_BYTES) {
    const __m128 dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(w)));
    const float wd = _mm_cvtss_f32(dmin), wm = _mm_cvtss_f32(_mm_movehdup_ps(dmin));
    const __m256i sm16 = _mm256_cvtepu8_epi16(q4k_scales_avx2(w + 4));
    const __m256i scales = _mm256_permute2x128_si256(sm16, sm16, 0x00);  // sc0..7 in both halves
    const __m128i mins = _mm256_extracti128_si256(sm16, 1);
    const __m256i mins_pairs = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins),
                                                _mm_unpacklo_epi16(mins, mins));
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    const uint8_t* qs = w + 16;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i + 1 (high)
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
      const __m256i lo = _mm256_and_si256(bytes, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20);  // lo[0:16] hi[0:16]
      const __m256i second = _mm256_permute2x128_si256(lo, hi, 0x31);  // lo[16:32] hi[16:32]
      const __m256i sc = _mm256_shuffle_epi8(scales, pick[i]);  // 2i low lanes, 2i + 1 high
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a[r][b].q + 64 * i;
        const __m256i p = _mm256_add_epi16(  // at most 2 x 3,840: no 16-bit overflow
            _mm256_maddubs_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_maddubs_epi16(second,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sc));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r][b].sums));
      const __m256i msum = _mm256_madd_epi16(sums, mins_pairs);  // lane j: mins_j x (sums of 32)
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * a[r][b].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(wm * a[r][b].d), _mm256_cvtepi32_ps(msum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

template <int R>
AVX2 void q6k_rows_avx2(const uint8_t* w, const ActBlock* const* a, int64_t nb, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b, w += Q6K_BYTES) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));
    const float wd = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(w + 208));
    __m256i sumi[R];
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int r = 0; r < R; ++r) {  // the offset: 32 x scale x (sum of 16), subtracted first
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r][b].sums));
      sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(sums, sc16), 5));
    }
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = w + 64 * half;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half));
      __m256i q[4];  // the 32 values of groups t = 0..3 of this half, in order
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m256i lo = (t % 2 == 0) ? l0 : l1;
        const __m256i nib = t < 2 ? _mm256_and_si256(lo, low4)
                                  : _mm256_and_si256(_mm256_srli_epi16(lo, 4), low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * t), two);
        q[t] = _mm256_or_si256(nib, _mm256_slli_epi16(hi, 4));
      }
#pragma GCC unroll 2
      for (int pair = 0; pair < 2; ++pair) {  // groups 2 pair and 2 pair + 1: 64 values
        const __m256i first = _mm256_permute2x128_si256(q[2 * pair], q[2 * pair + 1], 0x20);
        const __m256i second = _mm256_permute2x128_si256(q[2 * pair], q[2 * pair + 1], 0x31);
        const int s0 = 8 * half + 4 * pair;  // the 16-value scales of the first group: s0, s0+1
        const long long ones = 0x0101010101010101LL;
        const __m256i sc_first = _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(sc8, _mm_set_epi64x(ones * (s0 + 2), ones * s0)));
        const __m256i sc_second = _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(sc8, _mm_set_epi64x(ones * (s0 + 3), ones * (s0 + 1))));
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a[r][b].q + 128 * half + 64 * pair;
          const __m256i p0 = _mm256_madd_epi16(
              _mm256_maddubs_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
              sc_first);
          const __m256i p1 = _mm256_madd_epi16(
              _mm256_maddubs_epi16(second,
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))),
              sc_second);
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * a[r][b].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

// quantize_row's arithmetic in 8 lanes: the max is exact in any order, the rest elementwise,
// so both paths give the same bytes (rounding half to even, as nearbyint does by default).
AVX2 void quantize_row_avx2(const float* x, int64_t k, ActBlock* out) {
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
    if (amax == 0.0f) {
      std::memset(&blk, 0, sizeof(ActBlock));
      continue;
    }
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

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

int g_isa = -1;  // -1: the best this CPU has; 0: portable (tests)

bool use_avx2() { return g_isa != 0 && cpu_has_avx2(); }

constexpr int TILE = 8;  // activation rows sharing one unpacking of a weight block, at most

template <int R>
void rows_dot(int type, const uint8_t* w, const ActBlock* const* a, int64_t nb, float* out) {
  if (use_avx2()) {
    if (type == GGML_Q4_K) q4k_rows_avx2<R>(w, a, nb, out);
    else q6k_rows_avx2<R>(w, a, nb, out);
    return;
  }
  for (int r = 0; r < R; ++r)
    out[r] = type == GGML_Q4_K ? q4k_dot_portable(w, a[r], nb) : q6k_dot_portable(w, a[r], nb);
}

// `count` rows (at most TILE) against one weight row: a tile as wide as the rows left.
void tile_dot(int type, const uint8_t* w, const ActBlock* const* a, int count, int64_t nb,
              float* out) {
  switch (count) {
    case 8: rows_dot<8>(type, w, a, nb, out); break;
    case 7: rows_dot<7>(type, w, a, nb, out); break;
    case 6: rows_dot<6>(type, w, a, nb, out); break;
    case 5: rows_dot<5>(type, w, a, nb, out); break;
    case 4: rows_dot<4>(type, w, a, nb, out); break;
    case 3: rows_dot<3>(type, w, a, nb, out); break;
    case 2: rows_dot<2>(type, w, a, nb, out); break;
    default: rows_dot<1>(type, w, a, nb, out); break;
  }
}

int64_t row_bytes(int type, int64_t k) {
  return (k / QK) * (type == GGML_Q4_K ? Q4K_BYTES : Q6K_BYTES);
}

// ---- the float work around the products, a row at a time ------------------------------------

AVX2 float dot_f16_avx2(const float* q, const uint16_t* k, int d) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) {
    const __m256 kv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i), kv));
  }
  return hsum8(acc);
}

float dot_f16_portable(const float* q, const uint16_t* k, int d) {
  float lanes[8] = {0};
  for (int i = 0; i < d; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = lanes[l] + q[i + l] * half_to_float(k[i + l]);
  return lanes_sum(lanes);
}

AVX2 void axpy_f16_avx2(float* y, float p, const uint16_t* v, int d) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int i = 0; i < d; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)));
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(pv, x)));
  }
}

void axpy_f16_portable(float* y, float p, const uint16_t* v, int d) {
  for (int i = 0; i < d; ++i) y[i] += p * half_to_float(v[i]);
}

}  // namespace

extern "C" {

// 1 where the AVX2 path runs, 0 on the portable one. set_isa(0) forces the portable path.
int w4a8_isa() { return use_avx2() ? 1 : 0; }
void w4a8_set_isa(int isa) { g_isa = isa; }

int64_t w4a8_act_bytes(int64_t k) { return (k / QK) * static_cast<int64_t>(sizeof(ActBlock)); }

// x [n, k] float32 -> [n, k / 256] activation blocks, each row alone.
void w4a8_quantize(const float* x, int64_t n, int64_t k, void* out) {
  auto* blocks = static_cast<ActBlock*>(out);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (use_avx2()) quantize_row_avx2(x + r * k, k, blocks + r * (k / QK));
      else quantize_row(x + r * k, k, blocks + r * (k / QK));
    }
  });
}

// y[r, c] (row stride ldy) = activations[r] . weight row c (+ bias[c]), for c < n_out.
// The weight is a GGUF tensor of type Q4_K or Q6_K, [n_out, k] row-major in blocks.
int w4a8_matmul(int type, const uint8_t* weight, int64_t n_out, int64_t k, const void* act,
                int64_t n, const float* bias, float* y, int64_t ldy) {
  if ((type != GGML_Q4_K && type != GGML_Q6_K) || k % QK != 0) return -1;
  const auto* blocks = static_cast<const ActBlock*>(act);
  const int64_t nb = k / QK, stride = row_bytes(type, k);
  constexpr int64_t COLUMNS = 16;  // output columns a task: the unit threads share out
  at::parallel_for(0, (n_out + COLUMNS - 1) / COLUMNS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin * COLUMNS; c < std::min(n_out, end * COLUMNS); ++c) {
      const uint8_t* w = weight + c * stride;
      const float add = bias ? bias[c] : 0.0f;
      float out[TILE];
      const ActBlock* rows[TILE];
      for (int64_t r = 0; r < n; r += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, n - r));
        for (int t = 0; t < count; ++t) rows[t] = blocks + (r + t) * nb;
        tile_dot(type, w, rows, count, nb, out);
        for (int t = 0; t < count; ++t) y[(r + t) * ldy + c] = out[t] + add;
      }
    }
  });
  return 0;
}

// Rows `ids` of a [rows, k] GGUF tensor (Q4_K, Q6_K, F16 or F32) as float32 [n, k].
int w4a8_dequantize_rows(int type, const uint8_t* weight, int64_t k, const int64_t* ids, int64_t n,
                         float* out) {
  if (type != GGML_Q4_K && type != GGML_Q6_K && type != GGML_F16 && type != GGML_F32) return -1;
  if ((type == GGML_Q4_K || type == GGML_Q6_K) && k % QK != 0) return -1;
  for (int64_t r = 0; r < n; ++r) {
    float* y = out + r * k;
    if (type == GGML_F32) {
      std::memcpy(y, weight + ids[r] * k * 4, k * 4);
      continue;
    }
    if (type == GGML_F16) {
      const auto* h = reinterpret_cast<const uint16_t*>(weight) + ids[r] * k;
      for (int64_t i = 0; i < k; ++i) y[i] = half_to_float(h[i]);
      continue;
    }
    const uint8_t* w = weight + ids[r] * row_bytes(type, k);
    for (int64_t b = 0; b < k / QK; ++b, y += QK) {
      if (type == GGML_Q4_K) {
        const uint8_t* blk = w + b * Q4K_BYTES;
        uint16_t dh, mh;
        std::memcpy(&dh, blk, 2);
        std::memcpy(&mh, blk + 2, 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const float d = half_to_float(dh), dmin = half_to_float(mh);
        for (int j = 0; j < 8; ++j) {
          const float scale = d * sc[j], offset = dmin * mn[j];
          for (int l = 0; l < 32; ++l) {
            const int q = (blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
            y[32 * j + l] = scale * q - offset;
          }
        }
      } else {
        const uint8_t* blk = w + b * Q6K_BYTES;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        uint16_t dh;
        std::memcpy(&dh, blk + 208, 2);
        const float d = half_to_float(dh);
        for (int i = 0; i < QK; ++i) y[i] = d * sc[i / 16] * (q6k_value(blk, i) - 32);
      }
    }
  }
  return 0;
}

// RMSNorm of each row: out = x / sqrt(mean(x^2) + eps) * weight (sum in 8 lanes, fixed order).
void w4a8_rms_norm(const float* x, const float* weight, float eps, int64_t n, int64_t d,
                   float* out) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = x + r * d;
      float lanes[8] = {0};
      for (int64_t i = 0; i < d; ++i) lanes[i % 8] += v[i] * v[i];
      const float ss = lanes_sum(lanes);
      const float scale = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = v[i] * scale * weight[i];
    }
  });
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]: gate and up side by side, elementwise.
void w4a8_silu_mul(const float* gate_up, int64_t n, int64_t width, float* out) {
  at::parallel_for(0, n * width, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t r = e / width, i = e % width;
      const float g = gate_up[r * 2 * width + i];
      out[e] = g / (1.0f + std::exp(-g)) * gate_up[r * 2 * width + width + i];
    }
  });
}

// One attention layer for n rows. qkv [n, (heads + 2 kv_heads) * d]: each row's query, key and
// value. Rotary embeddings turn its query and key (cos / sin: [positions, d / 2]; `interleaved`:
// llama.cpp's llama layout, pairs (2i, 2i + 1), else rotate-half, pairs (i, i + d / 2)); the key
// and value go into the cache (float16 [slots, kv_heads, slot_tokens, d], this layer's) at the
// row's slot and position; then each row attends to its slot's positions 0..position. out:
// [n, heads * d].
void w4a8_attention(float* qkv, int64_t n, const int64_t* slots, const int64_t* positions,
                    int heads, int kv_heads, int d, const float* cos, const float* sin,
                    int interleaved, uint16_t* keys, uint16_t* values, int64_t slot_tokens,
                    float* out) {
  const int64_t width = static_cast<int64_t>(heads + 2 * kv_heads) * d;
  const int half = d / 2;
  auto rotate = [&](float* v, int64_t pos) {
    const float* c = cos + pos * half;
    const float* s = sin + pos * half;
    for (int i = 0; i < half; ++i) {
      const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * c[i] - x1 * s[i];
      v[b] = x1 * c[i] + x0 * s[i];
    }
  };
  // 1. rotate and store every row's key and value (a row may read an earlier row's)
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = qkv + r * width;
      for (int h = 0; h < heads + kv_heads; ++h) rotate(row + h * d, positions[r]);
      for (int h = 0; h < kv_heads; ++h) {
        const int64_t at = ((slots[r] * kv_heads + h) * slot_tokens + positions[r]) * d;
        for (int i = 0; i < d; ++i) {
          keys[at + i] = float_to_half(row[(heads + h) * d + i]);
          values[at + i] = float_to_half(row[(heads + kv_heads + h) * d + i]);
        }
      }
    }
  });
  // 2. each (row, query head) over its own prefix
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int group = heads / kv_heads;
  const bool avx2 = use_avx2();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> q(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads;
      const int h = static_cast<int>(task % heads), kv = h / group;
      const int64_t length = positions[r] + 1;
      const int64_t base = (slots[r] * kv_heads + kv) * slot_tokens * d;
      for (int i = 0; i < d; ++i) q[i] = qkv[r * width + h * d + i] * scale;
      scores.resize(length);
      float top = -INFINITY;
      for (int64_t t = 0; t < length; ++t) {
        scores[t] = avx2 ? dot_f16_avx2(q.data(), keys + base + t * d, d)
                         : dot_f16_portable(q.data(), keys + base + t * d, d);
        top = std::max(top, scores[t]);
      }
      float total = 0.0f;
      for (int64_t t = 0; t < length; ++t) {
        scores[t] = std::exp(scores[t] - top);
        total += scores[t];
      }
      float* o = out + r * heads * d + h * d;
      std::fill(o, o + d, 0.0f);
      for (int64_t t = 0; t < length; ++t) {
        if (avx2) axpy_f16_avx2(o, scores[t], values + base + t * d, d);
        else axpy_f16_portable(o, scores[t], values + base + t * d, d);
      }
      const float inv = 1.0f / total;
      for (int i = 0; i < d; ++i) o[i] *= inv;
    }
  });
}

}  // extern "C"
