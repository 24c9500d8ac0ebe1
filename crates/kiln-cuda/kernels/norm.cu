// The norm family (RMSNorm, LayerNorm) with an optional residual add, weight (plain or 1 + w),
// bias, SiLU gate, groups, and float / INT8 / NVFP4 / FP8 outputs: the CUDA twin of
// `kiln_core::ops::norm`, equal to it bit for bit.
//
// Memory floor: one read of x (and of the residual and gate when present), one write of the
// output (and of the updated residual); the weight comes from L2. The kernel is one pass: a
// warp holds its share of a segment in registers (UNITS_PER_WARP units of 256 elements, 8 per
// lane, loaded with 16-byte loads), reduces, and writes.
//
// A segment is one norm: a row, or one group of a row (`n` elements, `groups` per row). Unit `u`
// of a segment (elements 256u .. 256u + 256) belongs to warp `u % WARPS_PER_ROW` of the row's
// warps, and lane `l` holds its elements 8l .. 8l + 8. Unit sums are combined left to right:
// in registers with one warp per row, through shared memory otherwise.
//
// Compile-time constants (all required):
//   KIND          0 RMSNorm, 1 LayerNorm
//   X_T, W_T      KILN_F32 / KILN_F16 / KILN_BF16: x, residual and gate; weight and bias
//   OUT_T         KILN_F32 / KILN_F16 / KILN_BF16, or 3 INT8, 4 NVFP4, 5 FP8 E4M3
//   WEIGHT        0 plain, 1 one plus w, 2 none
//   HAS_BIAS, HAS_RESIDUAL, HF_ROUNDING   0 or 1
//   GATE          0 none, 1 before the norm, 2 after
//   WARPS_PER_ROW, ROWS_PER_BLOCK, UNITS_PER_WARP

#define KILN_OUT_INT8 3
#define KILN_OUT_NVFP4 4
#define KILN_OUT_FP8 5

#define KILN_NORM_UNITS (UNITS_PER_WARP * WARPS_PER_ROW)

// Sums `s` (one unit's lane_sum8 per lane) of every unit into the segment's total, left to right.
// `unit_sums` is this segment's row of shared memory (unused with one warp per row).
__device__ __forceinline__ float kiln_norm_total(float (&lane_sums)[UNITS_PER_WARP], int warp_in_row, int units,
                                                 float* unit_sums) {
    float total = 0.0f;
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int unit = warp_in_row + u * WARPS_PER_ROW;
        float s = kiln_unit_reduce(lane_sums[u]);
        if (WARPS_PER_ROW == 1) {
            if (unit < units) total += s;
        } else if ((threadIdx.x & 31) == 0) {
            unit_sums[unit] = s;
        }
    }
    if (WARPS_PER_ROW > 1) {
        __syncthreads();
        for (int i = 0; i < units; ++i) total += unit_sums[i];
    }
    return total;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_ROW * ROWS_PER_BLOCK)
kiln_norm(const void* __restrict__ x, void* residual, const void* __restrict__ weight,
          const void* __restrict__ bias, const void* __restrict__ gate, void* __restrict__ out,
          void* __restrict__ scales, float eps, float qscale, long long segments, int n, int groups) {
    __shared__ float shared_sums[2][ROWS_PER_BLOCK][WARPS_PER_ROW > 1 ? KILN_NORM_UNITS : 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warp_in_row = warp % WARPS_PER_ROW;
    const int row_in_block = warp / WARPS_PER_ROW;
    const long long seg = (long long)blockIdx.x * ROWS_PER_BLOCK + row_in_block;
    const bool active = seg < segments;
    const int units = (n + 255) >> 8;
    const long long base = seg * n;
    const long long wbase = (long long)(seg % groups) * n;

    float v[UNITS_PER_WARP][8];
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
        if (active && col < n) {
            kiln_load8<X_T>(x, base + col, v[u]);
            if (HAS_RESIDUAL) {
                float r[8];
                kiln_load8<X_T>(residual, base + col, r);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[u][k] = kiln_round<X_T>(v[u][k] + r[k]);
                kiln_store8<X_T>(residual, base + col, v[u]);
            }
            if (GATE == 1) {
                float z[8];
                kiln_load8<X_T>(gate, base + col, z);
#pragma unroll
                for (int k = 0; k < 8; ++k) v[u][k] = v[u][k] * kiln_silu(z[k]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[u][k] = 0.0f;
        }
    }

    float lane_sums[UNITS_PER_WARP];
    float mean = 0.0f;
    if (KIND == 1) {
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) lane_sums[u] = kiln_lane_sum8(v[u]);
        mean = kiln_norm_total(lane_sums, warp_in_row, units, shared_sums[0][row_in_block]) / (float)n;
    }
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
        float sq[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float d = KIND == 1 ? v[u][k] - mean : v[u][k];
            sq[k] = (active && col < n) ? d * d : 0.0f;
        }
        lane_sums[u] = kiln_lane_sum8(sq);
    }
    const float total = kiln_norm_total(lane_sums, warp_in_row, units, shared_sums[1][row_in_block]);
    const float r = 1.0f / sqrtf(total / (float)n + eps);

#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int unit = warp_in_row + u * WARPS_PER_ROW;
        const int col = unit * 256 + lane * 8;
        // Uniform across the warp (n is a multiple of 16 for blocked outputs, so lane pairs agree).
        if (!active || unit >= units) continue;
        const bool valid = col < n;
        float p[8];
        if (valid) {
            float w[8], b[8], z[8];
            if (WEIGHT != 2) kiln_load8<W_T>(weight, wbase + col, w);
            if (HAS_BIAS) kiln_load8<W_T>(bias, wbase + col, b);
            if (GATE == 2) kiln_load8<X_T>(gate, base + col, z);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float q = (KIND == 1 ? v[u][k] - mean : v[u][k]) * r;
                if (HF_ROUNDING) q = kiln_round<X_T>(q);
                if (WEIGHT == 0) q = q * w[k];
                if (WEIGHT == 1) q = q * (1.0f + w[k]);
                if (HAS_BIAS) q = q + b[k];
                if (GATE == 2) q = q * kiln_silu(z[k]);
                p[k] = q;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) p[k] = 0.0f;
        }
        if (OUT_T <= KILN_BF16) {
            if (valid) kiln_store8<(OUT_T <= KILN_BF16 ? OUT_T : KILN_F32)>(out, base + col, p);
        } else if (OUT_T == KILN_OUT_FP8) {
            if (valid) {
                unsigned int lo = 0, hi = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    lo |= (unsigned int)kiln_f32_to_e4m3(p[k] / qscale) << (8 * k);
                    hi |= (unsigned int)kiln_f32_to_e4m3(p[k + 4] / qscale) << (8 * k);
                }
                *reinterpret_cast<uint2*>(static_cast<unsigned char*>(out) + base + col) = make_uint2(lo, hi);
            }
        } else {
            float amax = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(p[k]));
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
            if (!valid) continue;
            const long long block = (base + col) >> 4;
            if (OUT_T == KILN_OUT_INT8) {
                const float scale = amax / 127.0f;
                unsigned int lo = 0, hi = 0;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    int q = scale > 0.0f ? (int)fminf(fmaxf(rintf(p[k] / scale), -127.0f), 127.0f) : 0;
                    unsigned int byte = (unsigned int)q & 0xFFu;
                    if (k < 4) lo |= byte << (8 * k); else hi |= byte << (8 * (k - 4));
                }
                *reinterpret_cast<uint2*>(static_cast<signed char*>(out) + base + col) = make_uint2(lo, hi);
                if ((lane & 1) == 0) static_cast<float*>(scales)[block] = scale;
            } else {
                const unsigned int s = kiln_f32_to_e4m3((amax / 6.0f) * qscale);
                const float divisor = kiln_e4m3_to_f32((kiln_u8)s) / qscale;
                unsigned int packed = 0;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    unsigned int c = divisor > 0.0f ? kiln_f32_to_e2m1(p[k] / divisor) : 0u;
                    packed |= c << (4 * k);
                }
                *reinterpret_cast<unsigned int*>(static_cast<unsigned char*>(out) + ((base + col) >> 1)) = packed;
                if ((lane & 1) == 0) static_cast<unsigned char*>(scales)[block] = (unsigned char)s;
            }
        }
    }
}
