// The w4a8 kernels' shared definitions: the block formats, the logical lane layout every path
// keeps, the scalar helpers, our own exp, and the table of one path's kernels.
//
// Bit-equal across paths. Integer sums are exact in any order, so what each path must repeat
// exactly is the float work. For each (row, column), one float accumulator, block after block:
//   acc = fma(d_w * d_a, float(sumi), acc), then acc = fma(-(dmin_w * d_a), float(msum), acc)
// where sumi is the block's whole integer sum of scale x weight x activation (Q6_K's with its
// -32 offset in it) and msum Q4_K's integer sum of min x the sub-blocks' activation sums (Q6_K
// has none). How a path reaches those two integers (8 lanes, 16, a lane a column) is its own
// affair. Everything else in float (RMSNorm, SiLU, rotary, attention) is elementwise or summed
// in 8 lanes in one order (lanes_sum's tree), and uses exp_fixed (below), never a library exp
// whose rounding varies by library and by width. Every file is compiled with
// -ffp-contract=off: nothing is fused unless the source says so.
//
// Every helper here is `static inline`: each translation unit keeps its own copy, compiled for
// that unit's baseline, so no ISA file's instantiation can stand in for the portable one.

#ifndef SPECDEC_W4A8_BLOCKS_H
#define SPECDEC_W4A8_BLOCKS_H

#include <cmath>
#include <cstdint>
#include <cstring>

namespace w4a8 {

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
// one 256-bit register then holds 16 values of each of two Q4_K sub-blocks, a 512-bit one all
// 64 with each 128-bit lane in one sub-block. 320 bytes: q starts every block on a cache line.
struct alignas(64) ActBlock {
  int8_t q[QK];
  int16_t sums[16];
  float d;
  uint8_t pad[28];
};
static_assert(sizeof(ActBlock) == 320, "ActBlock is 5 cache lines");

// Where value e (0..255) of a block is kept in ActBlock::q.
static inline int at(int e) {
  const int half = (e % 64) / 32, l = e % 32;
  return 64 * (e / 64) + 32 * (l / 16) + 16 * half + l % 16;
}

// The 8 lanes added in one fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7)).
static inline float lanes_sum(const float* lanes) {
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
         ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

static inline float half_to_float(uint16_t h) {
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

static inline uint16_t float_to_half(float f) {  // round to nearest even
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
static inline void q4k_scales(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
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

// The 6-bit value of element i (0..255) of a Q6_K block, 0..63.
static inline int q6k_value(const uint8_t* w, int i) {
  const int half = i / 128, l = i % 128, t = l / 32, e = l % 32;
  const uint8_t* ql = w + 64 * half;
  const uint8_t* qh = w + 128 + 32 * half;
  const int low = (t % 2 == 0 ? ql[e] : ql[e + 32]);
  const int nib = t < 2 ? (low & 0xf) : (low >> 4);
  return nib | (((qh[e] >> (2 * t)) & 3) << 4);
}

// ---- our own exp ----------------------------------------------------------------------------
// exp(x) = 2^n e^r with n = round(x log2 e) and r = x - n ln 2 (ln 2 in two parts), e^r by
// Cephes' degree-5 minimax polynomial (expf.c's coefficients; within 2 ulp on [-87, 88]).
// Each SIMD path repeats these operations lane by lane, unfused, in this order, so every path
// and every machine rounds alike. x is clamped to [EXP_LO, EXP_HI] first (NaN becomes EXP_LO,
// as a SIMD max whose second operand is the bound gives it).
constexpr float EXP_LO = -87.3f, EXP_HI = 88.37626f;
constexpr float EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_C1 = 0.693359375f, EXP_C2 = -2.12194440e-4f;
constexpr float EXP_P0 = 1.9875691500e-4f, EXP_P1 = 1.3981999507e-3f, EXP_P2 = 8.3334519073e-3f,
                EXP_P3 = 4.1665795894e-2f, EXP_P4 = 1.6666665459e-1f, EXP_P5 = 5.0000001201e-1f;

static inline float max_like_simd(float a, float b) { return a > b ? a : b; }  // maxps(a, b)
static inline float min_like_simd(float a, float b) { return a < b ? a : b; }  // minps(a, b)

static inline float exp_fixed(float x) {
  x = min_like_simd(max_like_simd(x, EXP_LO), EXP_HI);
  const float n = std::nearbyint(x * EXP_LOG2E);
  float r = x - n * EXP_C1;
  r = r - n * EXP_C2;
  float p = EXP_P0 * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  const float z = r * r;
  float y = p * z;
  y = y + r;
  y = y + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// ---- one path's kernels ---------------------------------------------------------------------

// The paths, in the order the dispatcher prefers the last one the CPU has.
// AVX512_VNNI_256 is the AVX-VNNI path's code in EVEX encoding, for testing it where AVX-512
// runs; `auto` never picks it.
enum Isa {
  PORTABLE = 0, AVX2 = 1, AVX_VNNI = 2, AVX512_VNNI_256 = 3, AVX512_VNNI = 4, ISA_COUNT = 5
};

struct Paths {
  const char* name;
  // x [k] float32 -> k / 256 blocks
  void (*quantize_row)(const float* x, int64_t k, ActBlock* out);
  // y[r * ldy + c] = act[r] . weight row c (+ bias[c]) for rows r < n and columns
  // c_begin <= c < c_end; `type` Q4_K or Q6_K, each weight row `nb` blocks, `stride` bytes apart;
  // act: n rows of nb blocks each. `packed`: the same matrix in packed.h's panels, or null (a
  // path that reads panels then falls back to one that reads the GGUF bytes); c_begin and c_end
  // are multiples of 16 or c_end = n_out.
  void (*matmul)(int type, const uint8_t* weight, const uint8_t* packed, int64_t stride,
                 int64_t c_begin, int64_t c_end, const ActBlock* act, int64_t n, int64_t nb,
                 const float* bias, float* y, int64_t ldy);
  // One key-value head's attention for the `group` query heads that share it, over `length`
  // positions: for each head h, scores[h][t] = q_h . float(keys[t]) (8 lanes, i % 8, added
  // in lanes_sum's tree), p = exp_fixed(scores - their max), out_h = (sum over t in order of
  // p[t] * float(values[t])) * (1 / the sum of p in order). q: [group][d], keys / values:
  // [length][d] float16, scores: [group][length] of room, out: [group][d]; d a multiple of 8.
  void (*attend)(const float* q, int group, const uint16_t* keys, const uint16_t* values,
                 int64_t length, int d, float* scores, float* out);
  // out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp_fixed(-gate[i])) * up[i]
  void (*silu_mul)(const float* gate, const float* up, int64_t count, float* out);
  // x[i] = exp_fixed(x[i])
  void (*exp_inplace)(float* x, int64_t count);
  // whether `matmul` reads packed.h's panels (then a matrix is packed at load)
  bool packs;
};

// Each ISA file's table.
const Paths* portable_paths();
const Paths* avx2_paths();
const Paths* avx_vnni_paths();
const Paths* avx512_vnni256_paths();
const Paths* avx512_vnni_paths();

}  // namespace w4a8

#endif
