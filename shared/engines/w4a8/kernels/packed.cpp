// Packing a GGUF Q4_K / Q6_K matrix into packed.h's panels (at load, once).

#include <ATen/Parallel.h>

#include "packed.h"

namespace w4a8 {
namespace {

void pack_q4k(const uint8_t* src, int64_t valid, int64_t nb, uint8_t* out) {
  // src: the panel's first column; valid: how many of its 16 columns exist
  for (int64_t b = 0; b < nb; ++b, out += Q4K_PANEL_BYTES) {
    std::memset(out, 0, Q4K_PANEL_BYTES);
    auto* d = reinterpret_cast<uint16_t*>(out);
    uint8_t* scales = out + 64;
    uint8_t* mins = out + 64 + 128;
    uint8_t* nibbles = out + 64 + 256;
    for (int c = 0; c < valid; ++c) {
      const uint8_t* w = src + c * nb * Q4K_BYTES + b * Q4K_BYTES;
      std::memcpy(d + c, w, 2);
      std::memcpy(d + 16 + c, w + 2, 2);
      uint8_t sc[8], mn[8];
      q4k_scales(w + 4, sc, mn);
      for (int j = 0; j < 8; ++j) {
        scales[16 * j + c] = sc[j];
        mins[16 * j + c] = mn[j];
      }
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 8; ++t)
          std::memcpy(nibbles + ((i * 8 + t) * 16 + c) * 4, w + 16 + 32 * i + 4 * t, 4);
    }
  }
}

void pack_q6k(const uint8_t* src, int64_t valid, int64_t nb, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b, out += Q6K_PANEL_BYTES) {
    std::memset(out, 0, Q6K_PANEL_BYTES);
    auto* d = reinterpret_cast<uint16_t*>(out);
    auto* scales = out + 32;
    uint8_t* low = out + 32 + 256;
    uint8_t* high = low + 2048;
    for (int c = 0; c < valid; ++c) {
      const uint8_t* w = src + c * nb * Q6K_BYTES + b * Q6K_BYTES;
      std::memcpy(d + c, w + 208, 2);
      for (int j = 0; j < 16; ++j) scales[16 * j + c] = w[192 + j];
      for (int h = 0; h < 2; ++h)
        for (int u = 0; u < 8; ++u) {
          for (int s = 0; s < 2; ++s)
            std::memcpy(low + (((h * 2 + s) * 8 + u) * 16 + c) * 4, w + 64 * h + 32 * s + 4 * u,
                        4);
          std::memcpy(high + ((h * 8 + u) * 16 + c) * 4, w + 128 + 32 * h + 4 * u, 4);
        }
    }
  }
}

}  // namespace
}  // namespace w4a8

using namespace w4a8;

extern "C" {

// Bytes of the packed form of a [n_out, k] Q4_K / Q6_K matrix (-1: not a packable matrix).
int64_t w4a8_packed_bytes(int type, int64_t n_out, int64_t k) {
  if ((type != GGML_Q4_K && type != GGML_Q6_K) || n_out <= 0 || k <= 0 || k % QK != 0) return -1;
  return panels_of(n_out) * (k / QK) * panel_block_bytes(type);
}

// Pack `weight` (weight_bytes) into `out` (out_bytes, at least w4a8_packed_bytes).
int w4a8_pack(int type, const uint8_t* weight, int64_t weight_bytes, int64_t n_out, int64_t k,
              uint8_t* out, int64_t out_bytes) {
  const int64_t need = w4a8_packed_bytes(type, n_out, k);
  if (need < 0) return -1;
  const int64_t nb = k / QK, stride = nb * (type == GGML_Q4_K ? Q4K_BYTES : Q6K_BYTES);
  if (weight_bytes < n_out * stride || out_bytes < need) return -2;
  const int64_t panel_bytes = nb * panel_block_bytes(type);
  at::parallel_for(0, panels_of(n_out), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t valid = std::min<int64_t>(PANEL, n_out - p * PANEL);
      if (type == GGML_Q4_K) pack_q4k(weight + p * PANEL * stride, valid, nb, out + p * panel_bytes);
      else pack_q6k(weight + p * PANEL * stride, valid, nb, out + p * panel_bytes);
    }
  });
  return 0;
}

}  // extern "C"
