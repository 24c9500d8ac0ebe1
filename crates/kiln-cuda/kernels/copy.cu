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

// The streaming floor of a kernel that reads read16 16-byte words once and writes write16 once:
// `kiln bench norm` times it with each case's bytes (x, residual, weight read; output, scales,
// residual written) in the same launch mode as the norm, so that the fixed cost of a launch at a
// small shape shows as this kernel's shortfall from the copy ceiling. Each block moves contiguous
// chunks of blockDim.x * UNROLL words (a norm's block reads whole rows), the loads all in flight
// before the stores, through the non-coherent path without allocating in L1 as the norm's x
// loads. SPREAD 0: word j of dst is word j of src (zero past read16), so that with fewer words
// written than read the stores all come from the first chunks. SPREAD 1 (read16 >= write16; no
// more than read16 words are written): each chunk c0 .. c1 of src goes with its share of dst,
// words c0 w / r .. c1 w / r (w = write16, r = read16), as a norm with a quantized output writes a
// fraction of each row it reads; the division comes after the loads are issued. Words read and
// not stored fold into a value that is stored only if it equals `never`, so that no load is dead
// code.
#ifndef SPREAD
#define SPREAD 0
#endif
extern "C" __global__ void stream_floor(const kiln_vec16* __restrict__ src, kiln_u64 read16,
                                        kiln_vec16* __restrict__ dst, kiln_u64 write16, kiln_u32 never) {
    kiln_wait_prior();
    const kiln_u64 chunk = (kiln_u64)blockDim.x * UNROLL;
#if SPREAD
    const kiln_u64 n = read16;
    const kiln_u64 m = write16 < read16 ? write16 : read16;
#else
    const kiln_u64 n = read16 > write16 ? read16 : write16;
#endif
    kiln_u32 folded = 0;
    for (kiln_u64 c0 = blockIdx.x * chunk; c0 < n; c0 += (kiln_u64)gridDim.x * chunk) {
        kiln_vec16 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const kiln_u64 j = c0 + (kiln_u64)u * blockDim.x + threadIdx.x;
            v[u] = kiln_vec16{0u, 0u, 0u, 0u};
            if (j < read16) {
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                    : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                    : "l"(src + j));
            }
        }
#if SPREAD
        const kiln_u64 c1 = c0 + chunk < n ? c0 + chunk : n;
        const kiln_u64 w0 = c0 * m / n, w1 = c1 * m / n;
#else
        const kiln_u64 w0 = c0, w1 = write16;
#endif
        // Every store depends on every load (through `mix`, zero unless `never` is not the value
        // the host passes), so that the compiler issues all UNROLL loads before the first store
        // instead of alternating them.
        kiln_u32 mix = 0;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) mix ^= v[u].x;
        mix = never == 0x9e3779b9u ? 0u : mix;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const kiln_u64 j = w0 + (kiln_u64)u * blockDim.x + threadIdx.x;
            v[u].w ^= mix;
            if (j < w1) dst[j] = v[u];
            else folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (folded == never && write16 > 0) dst[kiln_global_index() % write16] = kiln_vec16{folded, 0u, 0u, 0u};
}

// Fills n 32-bit words with `pattern` (tests poison outputs with it).
extern "C" __global__ void fill_u32(kiln_u32* __restrict__ dst, kiln_u32 pattern, kiln_u64 n) {
    kiln_wait_prior();
    for (kiln_u64 i = kiln_global_index(); i < n; i += kiln_grid_stride()) dst[i] = pattern;
}
