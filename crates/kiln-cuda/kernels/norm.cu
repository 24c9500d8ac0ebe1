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
//   EARLY_WEIGHT  1: the weight and bias are loaded with x, before the reduction (more loads in
//                 flight, more registers); 0: after it
//
// Registers hold x as loaded (its raw bits, half the registers of fp32 values for 16-bit types)
// unless a gate multiplies it before the norm; every use converts the bits again, exactly. All
// loads of a warp's x (and residual) are issued before the first use; x bypasses L1 (it is read
// once).

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

// x holds its raw bits unless a gate before the norm changes the values.
#define KILN_NORM_RAW (GATE != 1)

// Eight consecutive elements of type T as loaded: one 16-byte vector for 2-byte types, two for fp32.
template <int T> struct KilnRaw8 {
    uint4 q[T == KILN_F32 ? 2 : 1];
};

// Loads 8 elements (16-byte aligned); STREAM: through the non-coherent path without allocating
// in L1 (data read once and never written by the kernel).
template <int T, bool STREAM> __device__ __forceinline__ KilnRaw8<T> kiln_raw8_load(const void* base, long long i) {
    KilnRaw8<T> r;
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(base) +
                                                    i * (T == KILN_F32 ? 4 : 2));
#pragma unroll
    for (int h = 0; h < (T == KILN_F32 ? 2 : 1); ++h) {
        if (STREAM) {
            asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(r.q[h].x), "=r"(r.q[h].y), "=r"(r.q[h].z), "=r"(r.q[h].w)
                : "l"(p + h));
        } else {
            r.q[h] = p[h];
        }
    }
    return r;
}

template <int T> __device__ __forceinline__ void kiln_raw8_zero(KilnRaw8<T>& r) {
#pragma unroll
    for (int h = 0; h < (T == KILN_F32 ? 2 : 1); ++h) r.q[h] = make_uint4(0u, 0u, 0u, 0u);
}

// The 8 values as fp32 (exact).
template <int T> __device__ __forceinline__ void kiln_raw8_unpack(const KilnRaw8<T>& r, float v[8]) {
    if (T == KILN_F32) {
        const uint4 a = r.q[0], b = r.q[T == KILN_F32 ? 1 : 0];
        v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y);
        v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
    } else {
        const unsigned int w[4] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = KilnFloat<T>::load((unsigned short)(w[k] & 0xFFFF));
            v[2 * k + 1] = KilnFloat<T>::load((unsigned short)(w[k] >> 16));
        }
    }
}

// The 8 values rounded to T, as the bits kiln_store8 writes.
template <int T> __device__ __forceinline__ void kiln_raw8_pack(const float v[8], KilnRaw8<T>& r) {
    if (T == KILN_F32) {
        r.q[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
        r.q[T == KILN_F32 ? 1 : 0] =
            make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
    } else {
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = (unsigned int)KilnFloat<T>::store(v[2 * k]) | ((unsigned int)KilnFloat<T>::store(v[2 * k + 1]) << 16);
        }
        r.q[0] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// An empty asm that claims to change the bits: the values converted after it are converted
// again rather than kept in registers from before (fp32 values take twice the registers).
template <int T> __device__ __forceinline__ void kiln_raw8_reload(KilnRaw8<T>& r) {
#pragma unroll
    for (int h = 0; h < (T == KILN_F32 ? 2 : 1); ++h) {
        asm volatile("" : "+r"(r.q[h].x), "+r"(r.q[h].y), "+r"(r.q[h].z), "+r"(r.q[h].w));
    }
}

template <int T> __device__ __forceinline__ void kiln_raw8_store(void* base, long long i, const KilnRaw8<T>& r) {
    uint4* p = reinterpret_cast<uint4*>(static_cast<unsigned char*>(base) + i * (T == KILN_F32 ? 4 : 2));
#pragma unroll
    for (int h = 0; h < (T == KILN_F32 ? 2 : 1); ++h) p[h] = r.q[h];
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

    // x as loaded (KILN_NORM_RAW), or as fp32 values after the gate.
    KilnRaw8<X_T> xr[KILN_NORM_RAW ? UNITS_PER_WARP : 1];
    float xv[KILN_NORM_RAW ? 1 : UNITS_PER_WARP][8];
    KilnRaw8<W_T> wr[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1];
    KilnRaw8<W_T> br[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1];
#define KILN_NORM_X(u) xr[KILN_NORM_RAW ? (u) : 0]
#define KILN_NORM_XV(u) xv[KILN_NORM_RAW ? 0 : (u)]

    // Every load of x, the residual and the gate first (and the weight with EARLY_WEIGHT).
    {
        KilnRaw8<X_T> rr[HAS_RESIDUAL ? UNITS_PER_WARP : 1];
        KilnRaw8<X_T> zr[GATE == 1 ? UNITS_PER_WARP : 1];
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) {
            const int col = (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
            const bool valid = active && col < n;
            if (valid) {
                xr[KILN_NORM_RAW ? u : 0] = kiln_raw8_load<X_T, true>(x, base + col);
                if (!KILN_NORM_RAW) {
                    // Without raw storage the loaded bits go straight to values (below).
                    kiln_raw8_unpack<X_T>(xr[0], KILN_NORM_XV(u));
                }
                if (HAS_RESIDUAL) rr[HAS_RESIDUAL ? u : 0] = kiln_raw8_load<X_T, false>(residual, base + col);
                if (GATE == 1) zr[GATE == 1 ? u : 0] = kiln_raw8_load<X_T, true>(gate, base + col);
                if (EARLY_WEIGHT && WEIGHT != 2) wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0] = kiln_raw8_load<W_T, false>(weight, wbase + col);
                if (EARLY_WEIGHT && HAS_BIAS) br[EARLY_WEIGHT && HAS_BIAS ? u : 0] = kiln_raw8_load<W_T, false>(bias, wbase + col);
            } else {
                kiln_raw8_zero<X_T>(xr[KILN_NORM_RAW ? u : 0]);
                if (!KILN_NORM_RAW) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) KILN_NORM_XV(u)[k] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) {
            const int col = (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
            if (!(active && col < n)) continue;
            if (HAS_RESIDUAL) {
                float a[8], r[8];
                if (KILN_NORM_RAW) kiln_raw8_unpack<X_T>(KILN_NORM_X(u), a);
                else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) a[k] = KILN_NORM_XV(u)[k];
                }
                kiln_raw8_unpack<X_T>(rr[HAS_RESIDUAL ? u : 0], r);
#pragma unroll
                for (int k = 0; k < 8; ++k) a[k] = kiln_round<X_T>(a[k] + r[k]);
                KilnRaw8<X_T> packed;
                kiln_raw8_pack<X_T>(a, packed);
                kiln_raw8_store<X_T>(residual, base + col, packed);
                if (KILN_NORM_RAW) KILN_NORM_X(u) = packed;
                else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) KILN_NORM_XV(u)[k] = a[k];
                }
            }
            if (GATE == 1) {
                float z[8];
                kiln_raw8_unpack<X_T>(zr[GATE == 1 ? u : 0], z);
#pragma unroll
                for (int k = 0; k < 8; ++k) KILN_NORM_XV(u)[k] = KILN_NORM_XV(u)[k] * kiln_silu(z[k]);
            }
        }
    }

    // Unit u's values as fp32, converted again at each use (exact) so that only the raw bits stay
    // live across the reductions.
#define KILN_NORM_VALUES(u, a)                                                   \
    float a[8];                                                                  \
    if (KILN_NORM_RAW) {                                                         \
        kiln_raw8_unpack<X_T>(KILN_NORM_X(u), a);                                \
    } else {                                                                     \
        _Pragma("unroll") for (int k_ = 0; k_ < 8; ++k_) a[k_] = KILN_NORM_XV(u)[k_]; \
    }

#define KILN_NORM_RELOAD()                                                       \
    if (KILN_NORM_RAW) {                                                         \
        _Pragma("unroll") for (int u_ = 0; u_ < UNITS_PER_WARP; ++u_) kiln_raw8_reload<X_T>(KILN_NORM_X(u_)); \
    }

    float lane_sums[UNITS_PER_WARP];
    float mean = 0.0f;
    if (KIND == 1) {
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) {
            KILN_NORM_VALUES(u, a);
            lane_sums[u] = kiln_lane_sum8(a);
        }
        mean = kiln_norm_total(lane_sums, warp_in_row, units, shared_sums[0][row_in_block]) / (float)n;
        KILN_NORM_RELOAD();
    }
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
        KILN_NORM_VALUES(u, a);
        float sq[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float d = KIND == 1 ? a[k] - mean : a[k];
            sq[k] = (active && col < n) ? d * d : 0.0f;
        }
        lane_sums[u] = kiln_lane_sum8(sq);
    }
    const float total = kiln_norm_total(lane_sums, warp_in_row, units, shared_sums[1][row_in_block]);
    const float r = 1.0f / sqrtf(total / (float)n + eps);
    KILN_NORM_RELOAD();

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
            if (WEIGHT != 2) {
                if (EARLY_WEIGHT) kiln_raw8_unpack<W_T>(wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0], w);
                else kiln_load8<W_T>(weight, wbase + col, w);
            }
            if (HAS_BIAS) {
                if (EARLY_WEIGHT) kiln_raw8_unpack<W_T>(br[EARLY_WEIGHT && HAS_BIAS ? u : 0], b);
                else kiln_load8<W_T>(bias, wbase + col, b);
            }
            if (GATE == 2) kiln_load8<X_T>(gate, base + col, z);
            KILN_NORM_VALUES(u, a);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float q = (KIND == 1 ? a[k] - mean : a[k]) * r;
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
