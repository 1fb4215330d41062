// The w4a8 engine's entry points: one table of kernels chosen once (the best path this CPU
// has, or the one a caller names), the threading, and the float work around the products.
//
// Every output element is computed by one thread, by one fixed sequence of instructions that
// does not depend on how many rows the call holds, which rows sit beside it, or how the work is
// split across threads: threads split output columns (and rows, for the row-wise work), never a
// dot product or a row's sum. Every path gives the same bits (blocks.h says how).
//
// Every entry point checks its sizes against the buffers it is handed and answers an error
// code (negative) rather than read or write past one.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "blocks.h"
#include "packed.h"

extern "C" int64_t w4a8_packed_bytes(int type, int64_t n_out, int64_t k);

namespace w4a8 {
namespace {

bool cpu_has(Isa isa) {
  switch (isa) {
    case PORTABLE: return true;
    case AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case AVX_VNNI: return cpu_has(AVX2) && __builtin_cpu_supports("avxvnni");
    case AVX512_VNNI_256:
      return cpu_has(AVX2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case AVX512_VNNI:
      return cpu_has(AVX512_VNNI_256) && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq");
    default: return false;
  }
}

const Paths* table_of(Isa isa) {
  switch (isa) {
    case AVX2: return avx2_paths();
    case AVX_VNNI: return avx_vnni_paths();
    case AVX512_VNNI_256: return avx512_vnni256_paths();
    case AVX512_VNNI: return avx512_vnni_paths();
    default: return portable_paths();
  }
}

Isa best() {
  __builtin_cpu_init();  // this runs in a static initializer, maybe before libgcc's own
  for (int i = ISA_COUNT - 1; i > 0; --i)
    if (i != AVX512_VNNI_256 && cpu_has(static_cast<Isa>(i))) return static_cast<Isa>(i);
  return PORTABLE;
}

Isa g_isa = best();
const Paths* g = table_of(g_isa);

int64_t row_bytes(int type, int64_t k) {
  return (k / QK) * (type == GGML_Q4_K ? Q4K_BYTES : Q6K_BYTES);
}

constexpr int E_ARGS = -1, E_SIZE = -2;

}  // namespace
}  // namespace w4a8

using namespace w4a8;

extern "C" {

// The paths: how many, each one's name, whether this CPU runs it; the one in use; choose one
// (-1: the best this CPU has). set_isa answers -1 for a path this CPU lacks.
int w4a8_isa_count() { return ISA_COUNT; }
const char* w4a8_isa_name(int isa) {
  return isa >= 0 && isa < ISA_COUNT ? table_of(static_cast<Isa>(isa))->name : "";
}
int w4a8_isa_available(int isa) {
  return isa >= 0 && isa < ISA_COUNT && cpu_has(static_cast<Isa>(isa)) ? 1 : 0;
}
int w4a8_isa_packs(int isa) {
  return isa >= 0 && isa < ISA_COUNT && table_of(static_cast<Isa>(isa))->packs ? 1 : 0;
}
int w4a8_isa() { return g_isa; }
int w4a8_set_isa(int isa) {
  if (isa == -1) isa = best();
  if (!w4a8_isa_available(isa)) return E_ARGS;
  g_isa = static_cast<Isa>(isa);
  g = table_of(g_isa);
  return 0;
}

int64_t w4a8_act_bytes(int64_t k) { return (k / QK) * static_cast<int64_t>(sizeof(ActBlock)); }

// x [n, k] float32 -> [n, k / 256] activation blocks (out_bytes of room), each row alone.
int w4a8_quantize(const float* x, int64_t n, int64_t k, void* out, int64_t out_bytes) {
  if (n < 0 || k <= 0 || k % QK != 0) return E_ARGS;
  if (out_bytes < n * w4a8_act_bytes(k)) return E_SIZE;
  auto* blocks = static_cast<ActBlock*>(out);
  const Paths* paths = g;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) paths->quantize_row(x + r * k, k, blocks + r * (k / QK));
  });
  return 0;
}

// y[r, c] (row stride ldy, y_floats of room) = activations[r] . weight row c (+ bias[c]), for
// c < n_out. The weight (weight_bytes) is a GGUF tensor of type Q4_K or Q6_K, [n_out, k]
// row-major in blocks; `packed` (packed_bytes) the same in packed.h's panels, or null; act
// (act_bytes) holds n rows of k / 256 blocks.
int w4a8_matmul(int type, const uint8_t* weight, int64_t weight_bytes, const uint8_t* packed,
                int64_t packed_bytes, int64_t n_out, int64_t k, const void* act, int64_t act_bytes,
                int64_t n, const float* bias, float* y, int64_t y_floats, int64_t ldy) {
  if ((type != GGML_Q4_K && type != GGML_Q6_K) || k <= 0 || k % QK != 0 || n_out <= 0 || n < 0 ||
      ldy < n_out)
    return E_ARGS;
  const int64_t nb = k / QK, stride = row_bytes(type, k);
  if (weight_bytes < n_out * stride || act_bytes < n * nb * static_cast<int64_t>(sizeof(ActBlock)) ||
      (n > 0 && y_floats < (n - 1) * ldy + n_out) ||
      (packed != nullptr && packed_bytes < w4a8_packed_bytes(type, n_out, k)))
    return E_SIZE;
  const auto* blocks = static_cast<const ActBlock*>(act);
  const Paths* paths = g;
  constexpr int64_t COLUMNS = 16;  // output columns a task: the unit threads share out
  at::parallel_for(0, (n_out + COLUMNS - 1) / COLUMNS, 1, [&](int64_t begin, int64_t end) {
    paths->matmul(type, weight, packed, stride, begin * COLUMNS, std::min(n_out, end * COLUMNS), blocks,
                  n, nb, bias, y, ldy);
  });
  return 0;
}

// Rows `ids` of a [rows, k] GGUF tensor (Q4_K, Q6_K, F16 or F32; weight_bytes) as float32
// [n, k].
int w4a8_dequantize_rows(int type, const uint8_t* weight, int64_t weight_bytes, int64_t rows,
                         int64_t k, const int64_t* ids, int64_t n, float* out) {
  if (type != GGML_Q4_K && type != GGML_Q6_K && type != GGML_F16 && type != GGML_F32) return E_ARGS;
  if (k <= 0 || n < 0 || rows <= 0 || ((type == GGML_Q4_K || type == GGML_Q6_K) && k % QK != 0))
    return E_ARGS;
  const int64_t stride = type == GGML_F32 ? 4 * k : type == GGML_F16 ? 2 * k : row_bytes(type, k);
  if (weight_bytes < rows * stride) return E_SIZE;
  for (int64_t r = 0; r < n; ++r)
    if (ids[r] < 0 || ids[r] >= rows) return E_ARGS;
  for (int64_t r = 0; r < n; ++r) {
    float* y = out + r * k;
    const uint8_t* w = weight + ids[r] * stride;
    if (type == GGML_F32) {
      std::memcpy(y, w, k * 4);
      continue;
    }
    if (type == GGML_F16) {
      const auto* h = reinterpret_cast<const uint16_t*>(w);
      for (int64_t i = 0; i < k; ++i) y[i] = half_to_float(h[i]);
      continue;
    }
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
int w4a8_rms_norm(const float* x, const float* weight, float eps, int64_t n, int64_t d,
                  float* out) {
  if (n < 0 || d <= 0) return E_ARGS;
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
  return 0;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]: gate and up side by side.
int w4a8_silu_mul(const float* gate_up, int64_t n, int64_t width, float* out) {
  if (n < 0 || width <= 0) return E_ARGS;
  const Paths* paths = g;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      paths->silu_mul(gate_up + r * 2 * width, gate_up + r * 2 * width + width, width,
                      out + r * width);
  });
  return 0;
}

// One attention layer for n rows. qkv [n, (heads + 2 kv_heads) * d]: each row's query, key and
// value. Rotary embeddings turn its query and key (cos / sin: [positions, d / 2]; `interleaved`:
// llama.cpp's llama layout, pairs (2i, 2i + 1), else rotate-half, pairs (i, i + d / 2)); the key
// and value go into the cache (float16 [slots, kv_heads, slot_tokens, d], this layer's) at the
// row's slot and position; then each row attends to its slot's positions 0..position. out:
// [n, heads * d]. Slots must be < num_slots, positions < slot_tokens.
int w4a8_attention(float* qkv, int64_t n, const int64_t* slots, const int64_t* positions,
                   int heads, int kv_heads, int d, const float* cos, const float* sin,
                   int interleaved, uint16_t* keys, uint16_t* values, int64_t num_slots,
                   int64_t slot_tokens, float* out) {
  if (n < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > 64 ||
      d <= 0 || d % 8 != 0 || d > 512 ||
      num_slots <= 0 || slot_tokens <= 0)
    return E_ARGS;
  for (int64_t r = 0; r < n; ++r)
    if (slots[r] < 0 || slots[r] >= num_slots || positions[r] < 0 || positions[r] >= slot_tokens)
      return E_ARGS;
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
  // 2. each (row, key-value head) over its own prefix, for the query heads that share it
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int group = heads / kv_heads;
  const Paths* paths = g;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q(static_cast<size_t>(group) * d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads;
      const int kv = static_cast<int>(task % kv_heads);
      const int64_t length = positions[r] + 1;
      const int64_t base = (slots[r] * kv_heads + kv) * slot_tokens * d;
      for (int h = 0; h < group; ++h)
        for (int i = 0; i < d; ++i) q[h * d + i] = qkv[r * width + (kv * group + h) * d + i] * scale;
      scores.resize(static_cast<size_t>(group) * length);
      paths->attend(q.data(), group, keys + base, values + base, length, d, scores.data(),
                    out + r * heads * d + kv * group * d);
    }
  });
  return 0;
}

}  // extern "C"

// ---- one decoder layer in one call -------------------------------------------------------------
// What model.py's per-operation forward does for a layer, in the same operations and order (so
// the same bits), without a Python round trip between them.

struct W4a8Matrix {
  int32_t type;
  int32_t unused;
  const uint8_t* weight;
  int64_t weight_bytes;
  const uint8_t* packed;  // or null
  int64_t packed_bytes;
  int64_t rows, cols;
  const float* bias;  // [rows] or null
};

struct W4a8Layer {
  const float* attn_norm;
  const float* mlp_norm;
  W4a8Matrix q, k, v, out, gate, up, down;
};

struct W4a8Dims {
  int64_t hidden, intermediate, num_slots, slot_tokens;
  int32_t heads, kv_heads, head_dim, interleaved;
  float eps;
  int32_t unused;
};

// Room for n rows: h [n, hidden], qkv [n, (heads + 2 kv_heads) d], attended [n, heads d],
// gate_up [n, 2 intermediate], inner [n, intermediate], tmp [n, hidden], act (act_bytes).
struct W4a8Scratch {
  float *h, *qkv, *attended, *gate_up, *inner, *tmp;
  uint8_t* act;
  int64_t act_bytes;
};

namespace {

int product(const W4a8Matrix& m, const uint8_t* act, int64_t act_bytes, int64_t n, float* y,
            int64_t ldy, int64_t y_floats) {
  return w4a8_matmul(m.type, m.weight, m.weight_bytes, m.packed, m.packed_bytes, m.rows, m.cols,
                     act, act_bytes, n, m.bias, y, y_floats, ldy);
}

// x += tmp, elementwise (as torch's x += tmp)
void add_into(float* x, const float* tmp, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] = x[i] + tmp[i];
}

}  // namespace

extern "C" {

// x [n, hidden] through one layer in place (its keys and values written at slots / positions).
int w4a8_layer(const W4a8Layer* L, const W4a8Dims* s, float* x, int64_t n, const int64_t* slots,
               const int64_t* positions, const float* cos, const float* sin, uint16_t* keys,
               uint16_t* values, const W4a8Scratch* w) {
  if (n <= 0) return E_ARGS;
  const int64_t d = s->head_dim, q_rows = s->heads * d, kv_rows = s->kv_heads * d;
  const int64_t width = q_rows + 2 * kv_rows;
  if (L->q.rows != q_rows || L->k.rows != kv_rows || L->v.rows != kv_rows ||
      L->out.rows != s->hidden || L->gate.rows != s->intermediate ||
      L->up.rows != s->intermediate || L->down.rows != s->hidden)
    return E_ARGS;
  int status = 0;
  auto ok = [&](int code) { return (status = code) == 0; };
  const int64_t act = w->act_bytes;
  if (!ok(w4a8_rms_norm(x, L->attn_norm, s->eps, n, s->hidden, w->h))) return status;
  if (!ok(w4a8_quantize(w->h, n, s->hidden, w->act, act))) return status;
  if (!ok(product(L->q, w->act, act, n, w->qkv, width, n * width))) return status;
  if (!ok(product(L->k, w->act, act, n, w->qkv + q_rows, width, n * width - q_rows)))
    return status;
  if (!ok(product(L->v, w->act, act, n, w->qkv + q_rows + kv_rows, width,
                  n * width - q_rows - kv_rows)))
    return status;
  if (!ok(w4a8_attention(w->qkv, n, slots, positions, s->heads, s->kv_heads, s->head_dim, cos,
                         sin, s->interleaved, keys, values, s->num_slots, s->slot_tokens,
                         w->attended)))
    return status;
  if (!ok(w4a8_quantize(w->attended, n, q_rows, w->act, act))) return status;
  if (!ok(product(L->out, w->act, act, n, w->tmp, s->hidden, n * s->hidden))) return status;
  add_into(x, w->tmp, n * s->hidden);
  if (!ok(w4a8_rms_norm(x, L->mlp_norm, s->eps, n, s->hidden, w->h))) return status;
  if (!ok(w4a8_quantize(w->h, n, s->hidden, w->act, act))) return status;
  const int64_t inner = s->intermediate;
  if (!ok(product(L->gate, w->act, act, n, w->gate_up, 2 * inner, n * 2 * inner))) return status;
  if (!ok(product(L->up, w->act, act, n, w->gate_up + inner, 2 * inner, n * 2 * inner - inner)))
    return status;
  if (!ok(w4a8_silu_mul(w->gate_up, n, inner, w->inner))) return status;
  if (!ok(w4a8_quantize(w->inner, n, inner, w->act, act))) return status;
  if (!ok(product(L->down, w->act, act, n, w->tmp, s->hidden, n * s->hidden))) return status;
  add_into(x, w->tmp, n * s->hidden);
  return 0;
}

}  // extern "C"
