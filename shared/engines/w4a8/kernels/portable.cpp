// The portable path: plain C++, one (row, column) at a time, by blocks.h's float rule.
// It is the reference every SIMD path must equal bit for bit, and the path of a CPU without
// AVX2.

#include <algorithm>

#include "blocks.h"

namespace w4a8 {
namespace {

void quantize_row(const float* x, int64_t k, ActBlock* out) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* v = x + b * QK;
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = max_like_simd(amax, std::fabs(v[i]));
    ActBlock& blk = out[b];
    std::memset(&blk, 0, sizeof(ActBlock));
    if (amax == 0.0f) continue;
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

float q4k_dot(const uint8_t* w, const ActBlock* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b, w += Q4K_BYTES) {
    uint16_t dh, mh;
    std::memcpy(&dh, w, 2);
    std::memcpy(&mh, w + 2, 2);
    uint8_t sc[8], mn[8];
    q4k_scales(w + 4, sc, mn);
    const uint8_t* qs = w + 16;
    int32_t sumi = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* bytes = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        const int q = (bytes[l] >> shift) & 0xf;
        sumi += sc[j] * q * a[b].q[at(32 * j + l)];
      }
      msum += mn[j] * (a[b].sums[2 * j] + a[b].sums[2 * j + 1]);
    }
    const float dd = half_to_float(dh) * a[b].d;
    const float dm = half_to_float(mh) * a[b].d;
    acc = std::fma(dd, static_cast<float>(sumi), acc);
    acc = std::fma(-dm, static_cast<float>(msum), acc);
  }
  return acc;
}

float q6k_dot(const uint8_t* w, const ActBlock* a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b, w += Q6K_BYTES) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    uint16_t dh;
    std::memcpy(&dh, w + 208, 2);
    int32_t sumi = 0;
    for (int m = 0; m < 8; ++m)
      sumi -= 32 * (a[b].sums[2 * m] * sc[2 * m] + a[b].sums[2 * m + 1] * sc[2 * m + 1]);
    for (int i = 0; i < QK; ++i) sumi += sc[i / 16] * q6k_value(w, i) * a[b].q[at(i)];
    const float dd = half_to_float(dh) * a[b].d;
    acc = std::fma(dd, static_cast<float>(sumi), acc);
  }
  return acc;
}

void matmul(int type, const uint8_t* weight, const uint8_t*, int64_t stride, int64_t c_begin,
            int64_t c_end,
            const ActBlock* act, int64_t n, int64_t nb, const float* bias, float* y,
            int64_t ldy) {
  for (int64_t c = c_begin; c < c_end; ++c) {
    const uint8_t* w = weight + c * stride;
    const float add = bias ? bias[c] : 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      const float dot = type == GGML_Q4_K ? q4k_dot(w, act + r * nb, nb)
                                          : q6k_dot(w, act + r * nb, nb);
      y[r * ldy + c] = dot + add;
    }
  }
}

void attend(const float* q, int group, const uint16_t* keys, const uint16_t* values,
            int64_t length, int d, float* scores, float* out) {
  for (int h = 0; h < group; ++h) {
    const float* qh = q + h * d;
    float* sh = scores + h * length;
    float top = -INFINITY;
    for (int64_t t = 0; t < length; ++t) {
      float lanes[8] = {0};
      for (int i = 0; i < d; i += 8)
        for (int l = 0; l < 8; ++l)
          lanes[l] = lanes[l] + qh[i + l] * half_to_float(keys[t * d + i + l]);
      sh[t] = lanes_sum(lanes);
      top = max_like_simd(top, sh[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < length; ++t) {
      sh[t] = exp_fixed(sh[t] - top);
      total += sh[t];
    }
    float* o = out + h * d;
    for (int i = 0; i < d; ++i) o[i] = 0.0f;
    for (int64_t t = 0; t < length; ++t)
      for (int i = 0; i < d; ++i) o[i] = o[i] + sh[t] * half_to_float(values[t * d + i]);
    const float inv = 1.0f / total;
    for (int i = 0; i < d; ++i) o[i] *= inv;
  }
}

void silu_mul(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + exp_fixed(-g)) * up[i];
  }
}

void exp_inplace(float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = exp_fixed(x[i]);
}

const Paths kPaths = {"portable", quantize_row, matmul, attend, silu_mul, exp_inplace, false};

}  // namespace

const Paths* portable_paths() { return &kPaths; }

}  // namespace w4a8
