// Device-to-device copy with 16-byte loads and stores, grid-stride: the streaming kernel that
// `kiln bench copy` sets beside the driver's memcpy, and the pattern every memory-bound kernel
// should approach.
//
// Memory floor: read and write n16 * 16 bytes once. Several independent 16-byte loads are in
// flight per thread (UNROLL), which is what keeps HBM busy.
#include "kiln_prelude.cuh"

#ifndef UNROLL
#define UNROLL 4
#endif

struct alignas(16) kiln_vec16 { kiln_u32 x, y, z, w; };

extern "C" __global__ void copy_vec16(const kiln_vec16* __restrict__ src, kiln_vec16* __restrict__ dst,
                                      kiln_u64 n16) {
    kiln_wait_prior();
    const kiln_u64 stride = kiln_grid_stride();
    kiln_u64 i = kiln_global_index();
    for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
        kiln_vec16 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) dst[i + u * stride] = v[u];
    }
    for (; i < n16; i += stride) dst[i] = src[i];
}

// Fills n 32-bit words with `pattern` (tests poison outputs with it).
extern "C" __global__ void fill_u32(kiln_u32* __restrict__ dst, kiln_u32 pattern, kiln_u64 n) {
    kiln_wait_prior();
    for (kiln_u64 i = kiln_global_index(); i < n; i += kiln_grid_stride()) dst[i] = pattern;
}
