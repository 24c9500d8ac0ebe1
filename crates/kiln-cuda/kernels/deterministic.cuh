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

// ---- packed conversions (sm_80 and later) ------------------------------------------------------

// Two fp32 values rounded to T (KILN_F16 / KILN_BF16) to nearest even, packed as the bits
// kiln_f32_to_bf16 / kiln_f32_to_f16 give (`lo` in the low half). A NaN gives the canonical NaN
// 0x7FFF, as the prelude does for the canonical fp32 NaN every GPU operation returns.
template <int T> __device__ __forceinline__ unsigned int kiln_pack2(float lo, float hi) {
    unsigned int d;
    if constexpr (T == KILN_BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    }
    return d;
}

// The two 16-bit values of a packed word as fp32 (exact).
template <int T> __device__ __forceinline__ void kiln_unpack2(unsigned int w, float& lo, float& hi) {
    if constexpr (T == KILN_BF16) {
        lo = __uint_as_float(w << 16);
        hi = __uint_as_float(w & 0xFFFF0000u);
    } else {
        lo = kiln_f16_to_f32((unsigned short)(w & 0xFFFFu));
        hi = kiln_f16_to_f32((unsigned short)(w >> 16));
    }
}

// a and b rounded to T and widened back (kiln_round<T> on each, two elements per conversion).
template <int T> __device__ __forceinline__ void kiln_round2(float& a, float& b) {
    if constexpr (T != KILN_F32) kiln_unpack2<T>(kiln_pack2<T>(a, b), a, b);
}

// Bytes 0 of a, b, c, d as one word (a lowest).
__device__ __forceinline__ unsigned int kiln_bytes4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) {
    unsigned int ab, cd, r;
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(ab) : "r"(a), "r"(b));
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(cd) : "r"(c), "r"(d));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(ab), "r"(cd));
    return r;
}

// E4M3 codes of two values (`lo` in the low byte): kiln_f32_to_e4m3 on each. sm_89 and later
// convert in hardware (round to nearest even, finite overflow and infinity saturate to 448, NaN
// to 0x7F: the prelude's results for every input but a NaN with its sign bit set, which no GPU
// operation returns).
__device__ __forceinline__ unsigned int kiln_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return (unsigned int)d;
#else
    return (unsigned int)kiln_f32_to_e4m3(lo) | ((unsigned int)kiln_f32_to_e4m3(hi) << 8);
#endif
}

// The value of an E4M3 code (exact), in hardware through fp16 on sm_89 and later.
__device__ __forceinline__ float kiln_e4m3_value(unsigned int code) {
#if __CUDA_ARCH__ >= 890
    unsigned int h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)code));
    return kiln_f16_to_f32((unsigned short)(h2 & 0xFFFFu));
#else
    return kiln_e4m3_to_f32((kiln_u8)code);
#endif
}

// ---- widening by the matrix units (sm_80 and later) --------------------------------------------

// Four 2-byte values (T: KILN_F16 / KILN_BF16) widened to fp32 by one mma.m16n8k8 (fp32
// accumulate, zero C): the lane's words a0, a1 are its A fragment (lane 4g + t supplies
// A[g][2t..2t+1] and A[g + 8][2t..2t+1], and receives D's same places), `b` its fragment of the
// identity (kiln_tc_identity). Each output is the exact product x * 1 plus seven products with 0,
// so it is x itself while the other values of its A row (the same word of lanes 4g .. 4g + 3)
// are finite; a non-finite one can turn them into NaN, which the caller must catch. v[0..3]: a0's
// low and high halves, then a1's, as kiln_unpack2 gives them. Two of these widen 8 values in two
// instructions where shifts and masks take 8. Not volatile: a pure function of its operands.
template <int T>
__device__ __forceinline__ void kiln_tc_widen4(unsigned int a0, unsigned int a1, unsigned int b, float* v) {
    static_assert(T == KILN_F16 || T == KILN_BF16, "2-byte values only");
    if constexpr (T == KILN_BF16) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
            : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
            : "r"(a0), "r"(a1), "r"(b), "f"(0.0f));
    } else {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
            : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
            : "r"(a0), "r"(a1), "r"(b), "f"(0.0f));
    }
}

// Lane `lane`'s B fragment of the 8 x 8 identity in T for kiln_tc_widen4: B[2t][g] in the low
// half, B[2t + 1][g] in the high half (lane 4g + t).
template <int T> __device__ __forceinline__ unsigned int kiln_tc_identity(int lane) {
    const unsigned int one = T == KILN_BF16 ? 0x3F80u : 0x3C00u;
    const int g = lane >> 2, t = lane & 3;
    return (2 * t == g ? one : 0u) | (2 * t + 1 == g ? one << 16 : 0u);
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

// The Rust `f32_to_e2m1` without branches (equal to it for all 2^32 floats, checked on the host):
// adding 2^(22 + e), e = 0, 1, 2 for |x| below 2, below 4, and above, rounds |x| to the E2M1 grid
// of its binade (steps 0.5, 1, 2) to nearest even, and the sum's bits past 2^(22 + e)'s count the
// steps; past 6 the code saturates at 7; a NaN gives 0.
__device__ __forceinline__ unsigned int kiln_f32_to_e2m1(float x) {
    const unsigned int bits = __float_as_uint(x);
    const unsigned int sign = (bits >> 28) & 0x8u;
    const unsigned int abs_bits = bits & 0x7FFFFFFFu;
    const unsigned int e = min(max(abs_bits >> 23, 127u), 129u);
    const unsigned int magic_bits = (e + 22u) << 23;
    const float s = __uint_as_float(abs_bits) + __uint_as_float(magic_bits);
    const unsigned int code = min(__float_as_uint(s) - magic_bits + 2u * e - 254u, 7u);
    return abs_bits > 0x7F800000u ? 0u : (sign | code);
}
