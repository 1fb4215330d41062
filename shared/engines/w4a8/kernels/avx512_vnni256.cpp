// The AVX-VNNI path's kernels (vnni256.inc) in their EVEX encoding (AVX-512 VL + VNNI): the
// same instructions on 256-bit registers, so that a machine with AVX-512 tests the code the
// AVX-VNNI path runs. Never chosen by `auto` (the 512-bit path is faster where it runs).

#include "packed.h"
#include "x86.h"

#define W4A8_T256 __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,fma,f16c")))
#define DPBUSD _mm256_dpbusd_epi32
#define DPWSSD _mm256_dpwssd_epi32

namespace w4a8 {
namespace avx512_vnni256 {

#include "vnni256.inc"

const Paths kPaths = {"avx512-vnni-256", quantize_row, matmul, attend, silu_mul, exp_inplace,
                      true};

}  // namespace avx512_vnni256

const Paths* avx512_vnni256_paths() { return &avx512_vnni256::kPaths; }

}  // namespace w4a8
