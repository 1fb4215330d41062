// The packed layout of the wide paths: a weight matrix in panels of 16 output columns, each
// 32-bit lane of a 512-bit register one column, so that one `vpdpbusd` multiplies 4 values of
// 16 columns by the same 4 activation values (broadcast) and each activation value is loaded
// once for 16 columns. Packed once at load from the GGUF bytes (kernels/packed.cpp); a last
// panel of fewer columns is padded with zero blocks (computed and dropped).
//
// A panel block (block b of 16 columns c), in order:
//   Q4_K (2,368 bytes): d[16], dmin[16] (fp16); scales[8][16], mins[8][16] (u8, sub-block
//     major); nibbles[4][8][16][4]: for sub-block pair i and quad t, column c's qs bytes
//     32 i + 4 t .. + 3 (low nibbles: sub-block 2 i's values 4 t .. 4 t + 3, high: 2 i + 1's).
//   Q6_K (3,360 bytes): d[16] (fp16); scales[16][16] (s8); low[2][2][8][16][4]: for half h,
//     s = 0 / 1 and quad u, column c's ql bytes 64 h + 32 s + 4 u .. + 3 (low nibbles: values
//     128 h + 32 s + 4 u + v, high: 128 h + 32 (s + 2) + 4 u + v); high[2][8][16][4]: column c's
//     qh bytes 32 h + 4 u .. + 3.

#ifndef SPECDEC_W4A8_PACKED_H
#define SPECDEC_W4A8_PACKED_H

#include "blocks.h"

namespace w4a8 {

constexpr int PANEL = 16;  // columns a panel
constexpr int64_t Q4K_PANEL_BYTES = 2368;
constexpr int64_t Q6K_PANEL_BYTES = 3360;

static inline int64_t panels_of(int64_t n_out) { return (n_out + PANEL - 1) / PANEL; }

static inline int64_t panel_block_bytes(int type) {
  return type == GGML_Q4_K ? Q4K_PANEL_BYTES : Q6K_PANEL_BYTES;
}

}  // namespace w4a8

#endif
