// Kiln's kernel prelude, included by every kernel as "kiln_prelude.cuh".
//
// Self-contained: no CUDA toolkit header is needed, so a machine with only the driver and libnvrtc
// compiles every kernel. It holds what kernels share:
// - fixed-width integer names;
// - bf16, fp16 and fp8 (e4m3, e5m2) conversions that round to nearest even, written so that the
//   CPU reference (the `half` crate for bf16/fp16) gives the same bits for every finite value and
//   infinity. bf16 and fp8 are plain bit arithmetic (any architecture); fp16 uses PTX `cvt.rn`.
//   NaN payloads are not preserved: a NaN converts to a NaN;
// - warp reductions in one fixed butterfly order (lane distance 16, 8, 4, 2, 1), so a warp's sum
//   is the same on every run and every GPU, and the CPU can replay it.
#pragma once

typedef unsigned char kiln_u8;
typedef unsigned short kiln_u16;
typedef unsigned int kiln_u32;
typedef unsigned long long kiln_u64;
typedef signed char kiln_i8;
typedef int kiln_i32;
typedef long long kiln_i64;

#define KILN_DEVICE static __device__ __forceinline__
#define KILN_FULL_MASK 0xffffffffu

// ---- bf16 -----------------------------------------------------------------------------------

KILN_DEVICE float kiln_bf16_to_f32(kiln_u16 bits) {
    return __uint_as_float(((kiln_u32)bits) << 16);
}

KILN_DEVICE kiln_u16 kiln_f32_to_bf16(float value) {
    kiln_u32 bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (kiln_u16)((bits >> 16) | 0x0040u);  // quiet NaN, sign and top payload kept
    }
    // Round to nearest even: add 0x7fff plus the lowest kept bit; overflow rolls into infinity.
    kiln_u32 rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return (kiln_u16)(rounded >> 16);
}

// ---- fp16 -----------------------------------------------------------------------------------

KILN_DEVICE float kiln_f16_to_f32(kiln_u16 bits) {
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
    return out;
}

KILN_DEVICE kiln_u16 kiln_f32_to_f16(float value) {
    kiln_u16 out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(value));
    return out;
}

// ---- fp8 ------------------------------------------------------------------------------------
// e4m3 (OCP "fn" variant): bias 7, no infinities, one NaN code per sign (S.1111.111), largest
// finite 448. e5m2: bias 15, IEEE-like with infinities, largest finite 57344.
// Encoding rounds to nearest even and saturates out-of-range finite values to the largest finite
// value (PTX's `.satfinite`); infinity saturates for e4m3 and stays infinity for e5m2.

KILN_DEVICE float kiln_fp8_decode(kiln_u8 code, int mantissa_bits, int bias, bool has_infinity) {
    kiln_u32 sign = ((kiln_u32)(code & 0x80u)) << 24;
    int exponent_bits = 7 - mantissa_bits;
    int exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1);
    kiln_u32 mantissa = code & ((1u << mantissa_bits) - 1u);
    int exponent_max = (1 << exponent_bits) - 1;
    if (has_infinity && exponent == exponent_max) {
        return __uint_as_float(sign | (mantissa ? 0x7fc00000u : 0x7f800000u));
    }
    if (!has_infinity && exponent == exponent_max && mantissa == (1u << mantissa_bits) - 1u) {
        return __uint_as_float(sign | 0x7fc00000u);
    }
    if (exponent == 0) {
        // Subnormal: mantissa * 2^(1 - bias - mantissa_bits), exact in f32.
        float magnitude = (float)mantissa * __uint_as_float((kiln_u32)(127 + 1 - bias - mantissa_bits) << 23);
        return __uint_as_float(sign | __float_as_uint(magnitude));
    }
    return __uint_as_float(sign | ((kiln_u32)(exponent - bias + 127) << 23) | (mantissa << (23 - mantissa_bits)));
}

KILN_DEVICE kiln_u8 kiln_fp8_encode(float value, int mantissa_bits, int bias, bool has_infinity,
                                     kiln_u8 max_finite_code) {
    kiln_u32 bits = __float_as_uint(value);
    kiln_u8 sign = (kiln_u8)((bits >> 24) & 0x80u);
    kiln_u32 magnitude_bits = bits & 0x7fffffffu;
    if (magnitude_bits > 0x7f800000u) {
        return sign | (has_infinity ? 0x7eu : 0x7fu);  // NaN
    }
    if (magnitude_bits == 0x7f800000u) {
        return sign | (has_infinity ? (kiln_u8)(max_finite_code + 1) : max_finite_code);
    }
    float magnitude = __uint_as_float(magnitude_bits);
    int min_normal_exponent = 1 - bias;
    int f32_exponent = (int)(magnitude_bits >> 23) - 127;
    kiln_u32 code;
    if (f32_exponent < min_normal_exponent) {
        // Subnormal range: count units of 2^(min_normal_exponent - mantissa_bits); rintf rounds to
        // nearest even and the scaling by a power of two is exact. A count of 2^mantissa_bits is
        // the smallest normal, which the code layout gives for free.
        float units = magnitude * __uint_as_float((kiln_u32)(127 - min_normal_exponent + mantissa_bits) << 23);
        code = (kiln_u32)rintf(units);
    } else {
        // Normal: the significand in units of its last place, rounded to nearest even.
        float scaled = magnitude * __uint_as_float((kiln_u32)(127 - f32_exponent + mantissa_bits) << 23);
        kiln_u32 significand = (kiln_u32)rintf(scaled);  // in [2^m, 2^(m+1)]
        int exponent = f32_exponent;
        if (significand == (2u << mantissa_bits)) {
            significand >>= 1;
            exponent += 1;
        }
        code = ((kiln_u32)(exponent + bias) << mantissa_bits) | (significand - (1u << mantissa_bits));
    }
    if (code > max_finite_code) {
        code = max_finite_code;
    }
    return sign | (kiln_u8)code;
}

KILN_DEVICE float kiln_e4m3_to_f32(kiln_u8 code) { return kiln_fp8_decode(code, 3, 7, false); }
KILN_DEVICE float kiln_e5m2_to_f32(kiln_u8 code) { return kiln_fp8_decode(code, 2, 15, true); }
KILN_DEVICE kiln_u8 kiln_f32_to_e4m3(float value) { return kiln_fp8_encode(value, 3, 7, false, 0x7e); }
KILN_DEVICE kiln_u8 kiln_f32_to_e5m2(float value) { return kiln_fp8_encode(value, 2, 15, true, 0x7b); }

// ---- warp reductions ------------------------------------------------------------------------
// Butterfly over lane distances 16, 8, 4, 2, 1: every lane ends with the same value, combined in
// the same order on every run. The CPU replays it as: for d in [16, 8, 4, 2, 1], v[i] = v[i] + v[i ^ d].

KILN_DEVICE float kiln_warp_sum(float value) {
#pragma unroll
    for (int distance = 16; distance > 0; distance >>= 1) {
        value += __shfl_xor_sync(KILN_FULL_MASK, value, distance);
    }
    return value;
}

KILN_DEVICE float kiln_warp_max(float value) {
#pragma unroll
    for (int distance = 16; distance > 0; distance >>= 1) {
        value = fmaxf(value, __shfl_xor_sync(KILN_FULL_MASK, value, distance));
    }
    return value;
}

KILN_DEVICE kiln_u64 kiln_warp_sum_u64(kiln_u64 value) {
#pragma unroll
    for (int distance = 16; distance > 0; distance >>= 1) {
        value += __shfl_xor_sync(KILN_FULL_MASK, value, distance);
    }
    return value;
}

// The global index of this thread in a 1-D grid, in 64 bits.
KILN_DEVICE kiln_u64 kiln_global_index() {
    return (kiln_u64)blockIdx.x * blockDim.x + threadIdx.x;
}

// The stride of a 1-D grid-stride loop, in 64 bits.
KILN_DEVICE kiln_u64 kiln_grid_stride() {
    return (kiln_u64)gridDim.x * blockDim.x;
}

// ---- tensor cores, ldmatrix, asynchronous copies (sm_80 and later) ---------------------------
// Fragment layouts of mma.m16n8k16 (lane = 4 * group + thread_in_group, g = group, t = thread):
//   A (16 x 16, row-major) a[0]: (g, 2t..2t+1)  a[1]: (g + 8, 2t..)  a[2]: (g, 2t + 8..)  a[3]: (g + 8, 2t + 8..)
//   B (16 x 8, column)     b[0]: (2t..2t+1, g)  b[1]: (2t + 8.., g)
//   C (16 x 8, f32)        c[0], c[1]: (g, 2t), (g, 2t + 1)  c[2], c[3]: (g + 8, 2t), (g + 8, 2t + 1)
// Each 32-bit register holds two bf16, the lower column (or row, for B) in the low half.

// The shared-memory address of a generic pointer into shared memory.
KILN_DEVICE kiln_u32 kiln_smem_address(const void* pointer) {
    kiln_u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// D += A * B, bf16 inputs, f32 accumulators.
KILN_DEVICE void kiln_mma_bf16_16816(float (&d)[4], const kiln_u32 (&a)[4], kiln_u32 b0, kiln_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i,
// and r[i] is this lane's part of matrix i (row lane / 4, columns 2 (lane % 4) and + 1).
KILN_DEVICE void kiln_ldmatrix_x4(kiln_u32 (&r)[4], kiln_u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// As kiln_ldmatrix_x4, each matrix transposed: r[i] holds rows 2 (lane % 4) and + 1 of column lane / 4.
KILN_DEVICE void kiln_ldmatrix_x4_trans(kiln_u32 (&r)[4], kiln_u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Two f32 rounded to nearest even into a bf16 pair, `low` in the low half.
KILN_DEVICE kiln_u32 kiln_pack_bf16x2(float low, float high) {
    kiln_u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

// 2^x with the hardware's approximation (2 ulp); 2^-inf = 0.
KILN_DEVICE float kiln_exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes from global to shared memory without passing through registers; when `valid` is
// false nothing is read and the 16 bytes are zeroed.
KILN_DEVICE void kiln_cp_async_16(kiln_u32 shared_address, const void* global, bool valid) {
    int source_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address), "l"(global),
                 "r"(source_bytes)
                 : "memory");
}

// kiln_cp_async_16 asking L2 to fetch the whole 128-byte line from memory on a miss (`.L2::128B`):
// streams of 16-byte copies (decode attention's K/V) read 1-3% faster on sm_90 with it.
KILN_DEVICE void kiln_cp_async_16_line(kiln_u32 shared_address, const void* global, bool valid) {
    int source_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(shared_address), "l"(global),
                 "r"(source_bytes)
                 : "memory");
}

KILN_DEVICE void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `PENDING` committed groups of this thread are still in flight.
template <int PENDING>
KILN_DEVICE void kiln_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// ---- launches that overlap (programmatic dependent launch, sm_90 and later) ----------------
// Kiln launches its kernels so that each may start while the one before it on the stream is
// finishing (the host side: `kiln_cuda::launch`). Every kernel therefore calls kiln_wait_prior()
// in every thread before it reads or writes anything an earlier kernel may write: the call returns
// once the kernels before it have finished and their writes are visible. What a kernel may do
// before it is read what no kernel writes (weights) into registers or shared memory. Global loads
// written as inline PTX are `asm volatile`, so the compiler keeps them after the wait.
//
// KILN_HANDOFF says when the next kernel may start (`kiln_cuda::launch::HANDOFF_ENV`):
// 0: once every block of this kernel has exited (the default: no block of the next kernel shares
//    a multiprocessor with a block of this one); 1: once every block has passed its wait, then an
//    acquire fence at GPU scope before the block reads anything; 2: once every block has passed
//    its wait, no fence. 2 broke the default model's decode on an H200 (see kiln_cuda::launch).
#ifndef KILN_HANDOFF
#define KILN_HANDOFF 0
#endif
KILN_DEVICE void kiln_wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if KILN_HANDOFF == 1
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
#if KILN_HANDOFF >= 1
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}
