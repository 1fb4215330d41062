// The AVX2 path: one weight column at a time, in the GGUF's own layout, against tiles of up to
// 8 rows. Each weight block is
// unpacked once for the tile; the products of 64 values take two `maddubs`, a 16-bit add, a
// `madd` by the two sub-blocks' scales and an add (no VNNI).

#include "x86.h"

namespace w4a8 {
namespace {

constexpr int TILE = 8;

// R activation rows (a, a + nb, ...) against one Q4_K weight row; out[r] = row r's dot product.
template <int R>
W4A8_AVX2 void q4k_rows(const uint8_t* w, const ActBlock* a, int64_t nb, float* out) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
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
    const __m256i sm16 = _mm256_cvtepu8_epi16(q4k_scales_x86(w + 4));
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
        const int8_t* x = a[r * nb + b].q + 64 * i;
        const __m256i p = _mm256_add_epi16(  // at most 2 x 3,840: no 16-bit overflow
            _mm256_maddubs_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_maddubs_epi16(second,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, sc));
      }
    }
    for (int r = 0; r < R; ++r) {
      const ActBlock& blk = a[r * nb + b];
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.sums));
      const __m256i msum = _mm256_madd_epi16(sums, mins_pairs);  // lane j: mins_j x (sums of 32)
      acc[r] = std::fma(wd * blk.d, static_cast<float>(hsum8_epi32(sumi[r])), acc[r]);
      acc[r] = std::fma(-(wm * blk.d), static_cast<float>(hsum8_epi32(msum)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
W4A8_AVX2 void q6k_rows(const uint8_t* w, const ActBlock* a, int64_t nb, float* out) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b, w += Q6K_BYTES) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));
    const float wd = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(w + 208));
    __m256i sumi[R];
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int r = 0; r < R; ++r) {  // the offset: 32 x scale x (sum of 16), subtracted first
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r * nb + b].sums));
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
          const int8_t* x = a[r * nb + b].q + 128 * half + 64 * pair;
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
    for (int r = 0; r < R; ++r)
      acc[r] = std::fma(wd * a[r * nb + b].d, static_cast<float>(hsum8_epi32(sumi[r])), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R>
void rows_dot(int type, const uint8_t* w, const ActBlock* a, int64_t nb, float* out) {
  if (type == GGML_Q4_K) q4k_rows<R>(w, a, nb, out);
  else q6k_rows<R>(w, a, nb, out);
}

// `count` rows (at most TILE) against one weight row: a tile as wide as the rows left; each
// row's instructions are the same in every tile width (the tile only repeats them).
void tile_dot(int type, const uint8_t* w, const ActBlock* a, int count, int64_t nb, float* out) {
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

void matmul(int type, const uint8_t* weight, const uint8_t*, int64_t stride, int64_t c_begin,
            int64_t c_end,
            const ActBlock* act, int64_t n, int64_t nb, const float* bias, float* y,
            int64_t ldy) {
  for (int64_t c = c_begin; c < c_end; ++c) {
    const uint8_t* w = weight + c * stride;
    const float add = bias ? bias[c] : 0.0f;
    float out[TILE];
    for (int64_t r = 0; r < n; r += TILE) {
      const int count = static_cast<int>(n - r < TILE ? n - r : TILE);
      tile_dot(type, w, act + r * nb, count, nb, out);
      for (int t = 0; t < count; ++t) y[(r + t) * ldy + c] = out[t] + add;
    }
  }
}

W4A8_AVX2 void quantize_row(const float* x, int64_t k, ActBlock* out) { quantize_row_x86(x, k, out); }
W4A8_AVX2 void attend(const float* q, int group, const uint16_t* keys, const uint16_t* values,
                      int64_t length, int d, float* scores, float* out) {
  attend_x86(q, group, keys, values, length, d, scores, out);
}
W4A8_AVX2 void silu_mul(const float* g, const float* u, int64_t count, float* out) {
  silu_mul_x86(g, u, count, out);
}
W4A8_AVX2 void exp_inplace(float* x, int64_t count) { exp_inplace_x86(x, count); }

const Paths kPaths = {"avx2", quantize_row, matmul, attend, silu_mul, exp_inplace, false};

}  // namespace

const Paths* avx2_paths() { return &kPaths; }

}  // namespace w4a8
