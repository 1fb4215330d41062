// The AVX-512 VNNI path (Zen 4, Intel since Ice Lake), on packed.h's panels: each 32-bit lane
// of a register is one of 16 output columns, so one `vpdpbusd` multiplies 4 weights of each of
// 16 columns by the same 4 activation values (one broadcast load), each weight register is
// unpacked once for a tile of up to 4 rows, and each activation value is loaded once for all 16
// columns. A sub-block's sums are scaled as integers (`vpmulld`), the mins and Q6_K's offsets
// come from the activations' sums of 16 by `vpdpwssd`, and the float step is blocks.h's rule on
// 16 columns at once. Without panels (a matrix not packed), and for Q6_K below 4 rows, it runs
// the AVX2 kernel.

#include "packed.h"
#include "x86.h"

#define W4A8_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace w4a8 {
namespace {

constexpr int ROWS = 4;  // rows a tile
// Panels stream from memory while a tile of rows computes; the hardware's prefetchers alone
// left the two apart (28 gate matrices, 8 rows: 16-18 ms, with this 11-12 ms here): each
// part of a block asks for its share of the lines of the block AHEAD blocks on, into L2.
constexpr int AHEAD = 4;

template <int LINES>
W4A8_AVX512 inline void ahead(const uint8_t* block, int part) {
  for (int l = 0; l < LINES; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(block + (LINES * part + l) * 64), _MM_HINT_T1);
}

W4A8_AVX512 inline __m512i bcast4(const int8_t* q) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

W4A8_AVX512 inline __m512i bcast_sums(const int16_t* sums) {  // (sums[0], sums[1]) in every lane
  int32_t v;
  std::memcpy(&v, sums, 4);
  return _mm512_set1_epi32(v);
}

W4A8_AVX512 inline __m512i u8x16(const uint8_t* p) {  // 16 bytes as 16 unsigned 32-bit lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

W4A8_AVX512 inline __m512i s8x16(const uint8_t* p) {  // 16 bytes as 16 signed 32-bit lanes
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

W4A8_AVX512 inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows (a, a + nb, ...) against one Q4_K panel: out[r * 16 + c].
template <int R>
W4A8_AVX512 void q4k_panel(const uint8_t* p, const ActBlock* a, int64_t nb, float* out) {
  constexpr int CHAINS = R == 1 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b, p += Q4K_PANEL_BYTES) {
    const uint8_t* scales = p + 64;
    const uint8_t* mins = p + 192;
    const uint8_t* nibbles = p + 320;
    __m512i sumi[R], msum[R];
    for (int r = 0; r < R; ++r) sumi[r] = msum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i + 1 (high)
      if constexpr (R > 1) ahead<10>(p + AHEAD * Q4K_PANEL_BYTES, i);
      // CHAINS accumulators a sum (even and odd quads apart at 1 row: vpdpbusd's latency)
      __m512i lo[CHAINS][R], hi[CHAINS][R];
      for (int k = 0; k < CHAINS; ++k)
        for (int r = 0; r < R; ++r) lo[k][r] = hi[k][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i z = _mm512_loadu_si512(nibbles + (i * 8 + t) * 64);
        const __m512i wl = _mm512_and_si512(z, low4);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
        const int k = t % CHAINS;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a[r * nb + b].q;
          lo[k][r] = _mm512_dpbusd_epi32(lo[k][r], wl, bcast4(q + at(64 * i + 4 * t)));
          hi[k][r] = _mm512_dpbusd_epi32(hi[k][r], wh, bcast4(q + at(64 * i + 32 + 4 * t)));
        }
      }
      for (int k = 1; k < CHAINS; ++k)
        for (int r = 0; r < R; ++r) {
          lo[0][r] = _mm512_add_epi32(lo[0][r], lo[k][r]);
          hi[0][r] = _mm512_add_epi32(hi[0][r], hi[k][r]);
        }
      const __m512i sc_lo = u8x16(scales + 16 * (2 * i)), sc_hi = u8x16(scales + 16 * (2 * i + 1));
      for (int r = 0; r < R; ++r)
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[0][r], sc_lo),
                                                             _mm512_mullo_epi32(hi[0][r], sc_hi)));
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // min j x (sums of 16 2j and 2j + 1), 16-bit pairs
      const __m512i m = u8x16(mins + 16 * j);
      const __m512i pairs = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
      for (int r = 0; r < R; ++r)
        msum[r] = _mm512_dpwssd_epi32(msum[r], bcast_sums(a[r * nb + b].sums + 2 * j), pairs);
    }
    const __m512 wd = f16x16(p), wm = f16x16(p + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 ad = _mm512_set1_ps(a[r * nb + b].d);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(wd, ad), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(wm, ad), _mm512_cvtepi32_ps(msum[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// ((high >> 2 t) & 3) << 4: the two high bits of Q6_K group t, in place over each byte
W4A8_AVX512 inline __m512i high_bits(__m512i high, int t) {
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, 2 * t), _mm512_set1_epi8(3)),
                           4);
}

template <int R>
W4A8_AVX512 void q6k_panel(const uint8_t* p, const ActBlock* a, int64_t nb, float* out) {
  constexpr int CHAINS = R == 1 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b, p += Q6K_PANEL_BYTES) {
    const uint8_t* scales = p + 32;
    const uint8_t* low = p + 288;
    const uint8_t* high = low + 2048;
    __m512i sumi[R], offset[R];
    for (int r = 0; r < R; ++r) sumi[r] = offset[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s)
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) {  // quads 4g .. 4g + 3: sub-blocks 8h + 2s + g and + 4
          if constexpr (R > 1) ahead<7>(p + AHEAD * Q6K_PANEL_BYTES, 4 * h + 2 * s + g);
          __m512i lo[CHAINS][R], hi[CHAINS][R];
          for (int k = 0; k < CHAINS; ++k)
            for (int r = 0; r < R; ++r) lo[k][r] = hi[k][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int uu = 0; uu < 4; ++uu) {
            const int k = uu % CHAINS;
            const int u = 4 * g + uu;
            const __m512i l = _mm512_loadu_si512(low + (((h * 2 + s) * 8 + u) * 16) * 4);
            const __m512i hb = _mm512_loadu_si512(high + ((h * 8 + u) * 16) * 4);
            const __m512i vl = _mm512_or_si512(_mm512_and_si512(l, low4), high_bits(hb, s));
            const __m512i vh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                               high_bits(hb, s + 2));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const int8_t* q = a[r * nb + b].q;
              lo[k][r] = _mm512_dpbusd_epi32(lo[k][r], vl,
                                             bcast4(q + at(128 * h + 32 * s + 4 * u)));
              hi[k][r] = _mm512_dpbusd_epi32(hi[k][r], vh,
                                             bcast4(q + at(128 * h + 32 * (s + 2) + 4 * u)));
            }
          }
          for (int k = 1; k < CHAINS; ++k)
            for (int r = 0; r < R; ++r) {
              lo[0][r] = _mm512_add_epi32(lo[0][r], lo[k][r]);
              hi[0][r] = _mm512_add_epi32(hi[0][r], hi[k][r]);
            }
          const int sub = 8 * h + 2 * s + g;
          const __m512i sc_lo = s8x16(scales + 16 * sub), sc_hi = s8x16(scales + 16 * (sub + 4));
          for (int r = 0; r < R; ++r)
            sumi[r] = _mm512_add_epi32(sumi[r],
                                       _mm512_add_epi32(_mm512_mullo_epi32(lo[0][r], sc_lo),
                                                        _mm512_mullo_epi32(hi[0][r], sc_hi)));
        }
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) {  // scales 2m and 2m + 1 as 16-bit pairs x the sums of 16
      const __m512i pairs = _mm512_or_si512(
          _mm512_and_si512(s8x16(scales + 16 * (2 * m)), _mm512_set1_epi32(0xffff)),
          _mm512_slli_epi32(s8x16(scales + 16 * (2 * m + 1)), 16));
      for (int r = 0; r < R; ++r)
        offset[r] = _mm512_dpwssd_epi32(offset[r], bcast_sums(a[r * nb + b].sums + 2 * m), pairs);
    }
    const __m512 wd = f16x16(p);
    for (int r = 0; r < R; ++r) {
      const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(offset[r], 5));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(wd, _mm512_set1_ps(a[r * nb + b].d)),
                               _mm512_cvtepi32_ps(total), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int R>
void panel(int type, const uint8_t* p, const ActBlock* a, int64_t nb, float* out) {
  if (type == GGML_Q4_K) q4k_panel<R>(p, a, nb, out);
  else q6k_panel<R>(p, a, nb, out);
}

void panel_rows(int type, const uint8_t* p, const ActBlock* a, int count, int64_t nb,
                float* out) {
  switch (count) {
    case 4: panel<4>(type, p, a, nb, out); break;
    case 3: panel<3>(type, p, a, nb, out); break;
    case 2: panel<2>(type, p, a, nb, out); break;
    default: panel<1>(type, p, a, nb, out); break;
  }
}

void matmul(int type, const uint8_t* weight, const uint8_t* packed, int64_t stride,
            int64_t c_begin, int64_t c_end, const ActBlock* act, int64_t n, int64_t nb,
            const float* bias, float* y, int64_t ldy) {
  // Q6_K panels unpack 6-bit values at a cost that only a tile of rows repays: below 4 rows the
  // AVX2 kernel is faster (measured: the 1.5B's head, 1 row, 5.5 vs 11 ms). Every path gives
  // the same bits, so the choice changes the time and nothing else.
  if (packed == nullptr || (type == GGML_Q6_K && n < ROWS)) {
    avx2_paths()->matmul(type, weight, nullptr, stride, c_begin, c_end, act, n, nb, bias, y, ldy);
    return;
  }
  const int64_t panel_bytes = nb * panel_block_bytes(type);
  alignas(64) float out[ROWS * PANEL];
  for (int64_t c = c_begin; c < c_end; c += PANEL) {  // c_begin is a multiple of 16
    const uint8_t* p = packed + (c / PANEL) * panel_bytes;
    const int64_t columns = c_end - c < PANEL ? c_end - c : PANEL;
    for (int64_t r = 0; r < n; r += ROWS) {
      const int count = static_cast<int>(n - r < ROWS ? n - r : ROWS);
      panel_rows(type, p, act + r * nb, count, nb, out);
      for (int t = 0; t < count; ++t)
        for (int64_t j = 0; j < columns; ++j)
          y[(r + t) * ldy + c + j] = out[t * PANEL + j] + (bias ? bias[c + j] : 0.0f);
    }
  }
}

// exp_fixed on 16 lanes: the same operations in the same order.
W4A8_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C2)));
  __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(EXP_P0), r), _mm512_set1_ps(EXP_P1));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P2));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P3));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P4));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P5));
  __m512 y = _mm512_mul_ps(p, _mm512_mul_ps(r, r));
  y = _mm512_add_ps(y, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

W4A8_AVX512 void silu_mul(const float* gate, const float* up, int64_t count, float* out) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(zero, g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(up + i)));
  }
  silu_mul_x86(gate + i, up + i, count - i, out + i);
}

W4A8_AVX512 void exp_inplace(float* x, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_loadu_ps(x + i)));
  exp_inplace_x86(x + i, count - i);
}

W4A8_AVX512 void quantize_row(const float* x, int64_t k, ActBlock* out) {
  quantize_row_x86(x, k, out);
}
W4A8_AVX512 void attend(const float* q, int group, const uint16_t* keys, const uint16_t* values,
                        int64_t length, int d, float* scores, float* out) {
  attend_x86(q, group, keys, values, length, d, scores, out);
}

const Paths kPaths = {"avx512-vnni", quantize_row, matmul, attend, silu_mul, exp_inplace,
                      true};

}  // namespace

const Paths* avx512_vnni_paths() { return &kPaths; }

}  // namespace w4a8
