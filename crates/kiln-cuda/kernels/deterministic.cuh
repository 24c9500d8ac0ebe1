// Kiln's determinism primitives, the CUDA twins of `kiln_core::ops::primitives` and
// `kiln_core::ops::quantize`. Every function here performs the same fp32 operations in the same
// order as its Rust counterpart; fused multiply-adds are written out (`__fmaf_rn`) and the
// kernels that include this are compiled with `--fmad=false`, so nothing else is contracted.
#pragma once
#include "kiln_prelude.cuh"

#define KILN_F32 0
#define KILN_F16 1
#define KILN_BF16 2

// ---- float types: conversions from the prelude (round to nearest even) ----------------------

// Storage type of a KILN_* code, and conversions through it.
template <int T> struct KilnFloat;
template <> struct KilnFloat<KILN_F32> {
    typedef float storage;
    static __device__ __forceinline__ float load(storage s) { return s; }
    static __device__ __forceinline__ storage store(float v) { return v; }
};
template <> struct KilnFloat<KILN_F16> {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(storage s) { return kiln_f16_to_f32(s); }
    static __device__ __forceinline__ storage store(float v) { return kiln_f32_to_f16(v); }
};
template <> struct KilnFloat<KILN_BF16> {
    typedef unsigned short storage;
    static __device__ __forceinline__ float load(storage s) { return kiln_bf16_to_f32(s); }
    static __device__ __forceinline__ storage store(float v) { return kiln_f32_to_bf16(v); }
};
template <int T> __device__ __forceinline__ float kiln_round(float v) {
    return KilnFloat<T>::load(KilnFloat<T>::store(v));
}

// Loads 8 consecutive elements (16-byte aligned) as fp32: one 16-byte load for 2-byte types,
// two for fp32.
template <int T> __device__ __forceinline__ void kiln_load8(const void* base, long long i, float v[8]) {
    if (T == KILN_F32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 q = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(base) + i);
        unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = KilnFloat<T>::load((unsigned short)(w[k] & 0xFFFF));
            v[2 * k + 1] = KilnFloat<T>::load((unsigned short)(w[k] >> 16));
        }
    }
}

// Stores 8 fp32 values rounded to T (16-byte aligned).
template <int T> __device__ __forceinline__ void kiln_store8(void* base, long long i, const float v[8]) {
    if (T == KILN_F32) {
        float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
        p[0] = make_float4(v[0], v[1], v[2], v[3]);
        p[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = (unsigned int)KilnFloat<T>::store(v[2 * k]) | ((unsigned int)KilnFloat<T>::store(v[2 * k + 1]) << 16);
        }
        *reinterpret_cast<uint4*>(static_cast<unsigned short*>(base) + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// ---- fixed-order sums ----------------------------------------------------------------------

// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), as `lane_sum8` in Rust.
__device__ __forceinline__ float kiln_lane_sum8(const float v[8]) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// The unit's sum from each lane's `lane_sum8`: the prelude's xor butterfly 16, 8, 4, 2, 1.
// Addition is commutative bit for bit, so every lane ends with the same value, the Rust `unit_tree`.
__device__ __forceinline__ float kiln_unit_reduce(float s) { return kiln_warp_sum(s); }

// ---- exp and SiLU -------------------------------------------------------------------------

__device__ __forceinline__ float kiln_pow2(int e) { return __uint_as_float((unsigned int)(e + 127) << 23); }

__device__ __forceinline__ float kiln_exp_poly(float x) {
    if (x != x) return x;
    if (x > 88.72284f) return __int_as_float(0x7F800000);
    if (x < -87.33655f) return 0.0f;
    float k = rintf(x * __uint_as_float(0x3FB8AA3Bu));  // LOG2_E as f32
    float r = __fmaf_rn(-k, 0.6933594f, x);
    r = __fmaf_rn(-k, -2.1219444e-4f, r);
    float p = 1.9875691e-4f;
    p = __fmaf_rn(p, r, 1.3981999e-3f);
    p = __fmaf_rn(p, r, 8.333452e-3f);
    p = __fmaf_rn(p, r, 4.1665796e-2f);
    p = __fmaf_rn(p, r, 1.6666665e-1f);
    p = __fmaf_rn(p, r, 0.5f);
    float r2 = r * r;
    float y = __fmaf_rn(p, r2, r) + 1.0f;
    int ki = (int)k;
    int half = ki / 2;
    return y * kiln_pow2(half) * kiln_pow2(ki - half);
}

__device__ __forceinline__ float kiln_silu(float z) { return z / (1.0f + kiln_exp_poly(-z)); }

// ---- FP4 E2M1 ---------------------------------------------------------------

// E4M3 encode / decode: the prelude's kiln_f32_to_e4m3 / kiln_e4m3_to_f32.

// The Rust `f32_to_e2m1` without branches: its rounding of each range (ties to even) equals
// counting the thresholds the magnitude passes, strictly where the tie rounds down, inclusively
// where it rounds up (checked equal for all 2^32 floats).
__device__ __forceinline__ unsigned int kiln_f32_to_e2m1(float x) {
    if (x != x) return 0;
    const unsigned int sign = (__float_as_uint(x) >> 28) & 0x8u;
    const float a = fabsf(x);
    const unsigned int m = (unsigned int)(a > 0.25f) + (unsigned int)(a >= 0.75f) + (unsigned int)(a > 1.25f) +
                           (unsigned int)(a >= 1.75f) + (unsigned int)(a > 2.5f) + (unsigned int)(a >= 3.5f) +
                           (unsigned int)(a > 5.0f);
    return sign | m;
}
