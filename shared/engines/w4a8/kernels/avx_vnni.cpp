// The AVX-VNNI path (Intel clients since Alder Lake: 256-bit VEX `vpdpbusd`, no AVX-512):
// vnni256.inc's kernels on packed.h's panels.

#include "packed.h"
#include "x86.h"

#define W4A8_T256 __attribute__((target("avxvnni,avx2,fma,f16c")))
#define DPBUSD _mm256_dpbusd_avx_epi32
#define DPWSSD _mm256_dpwssd_avx_epi32

namespace w4a8 {
namespace avx_vnni {

#include "vnni256.inc"

const Paths kPaths = {"avx-vnni", quantize_row, matmul, attend, silu_mul, exp_inplace, true};

}  // namespace avx_vnni

const Paths* avx_vnni_paths() { return &avx_vnni::kPaths; }

}  // namespace w4a8
