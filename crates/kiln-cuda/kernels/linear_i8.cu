// The decode-side linear layer for Q8_0, Q4_0 and Q4_1 weights on the integer dot-product units:
// out[t][r] = epilogue(sum_c W[r][c] * x[t][c] (+ bias[r])) for TOKENS (1..8) tokens. x is written
// per block of 32 values as 16-bit fixed point in two int8 planes: x ~ d (254 q1 + q2) with
// d = amax / (127 x 254), q1 = round(x 127 / amax) and q2 the rounded rest (|q2| <= 127). The
// products of a block are exact 32-bit integer sums (dp4a, twice); the scales apply once per
// block in fp32.
//
// Accuracy: each x moves by at most half a step, amax / 64516 of its block (bf16 rounds to 1/256
// of the value), so a row's sum moves by at most sum |int part of w| |step| / 2 plus fp32
// rounding of the block sums. Deterministic: the sums run in a fixed order for a given shape and
// variant, and a token's sums do not depend on the other tokens of the call.
//
// Two kernels. kiln_linear_i8_quantize writes every token's planes and scales into a scratch
// buffer, once for all blocks of the product. kiln_linear_i8 gives each warp a group of output
// rows: a row's columns go to LPR lanes (32, 16 or 8; a warp then serves 32 / LPR rows side by
// side), each lane taking "units" of 4 GGUF blocks (128 values: 72 bytes of Q4_0, 80 of Q4_1,
// 136 of Q8_0, 8-byte aligned when cols is a multiple of 128) in turn, UNR units of each of its
// RL output rows (2 x RL weight rows for SwiGLU) a round. A round's units are copied into the
// warp's part of shared memory by coalesced 8-byte cp.async (consecutive lanes, consecutive
// words: a lane reading its own 72-byte unit would make every load touch 18 cache lines), then
// each lane reads its own. Lane sums are added by a butterfly over the row's lanes; the first
// lane of the row writes.
//
// Scratch layout (U = cols / 128 units a row): plane p of x in 16-byte chunks (8 a unit), chunk
// j of unit u of token t at ((p * TOKENS + t) * 8 + j) * U + u, so a warp's lanes (consecutive
// units) read 512 consecutive bytes; then the scales (d, and the block's fp32 sum for Q4_1 or its
// integer sum of 254 q1 + q2 for Q4_0) of block k of unit u of token t at (t * 4 + k) * U + u.
//
// Compile-time constants: W_T (3 Q8_0, 4 Q4_0, 5 Q4_1), X_T (0 f32, 1 bf16), TOKENS, EPI (0 store,
// 1 accumulate, 2 SwiGLU), HAS_BIAS, WARPS, RL (output rows a lane group carries), UNR (units in
// flight per weight row), LPR (lanes per row).

#include "kiln_prelude.cuh"

#ifndef W_T
#define W_T 4
#endif
#ifndef X_T
#define X_T 0
#endif
#ifndef TOKENS
#define TOKENS 1
#endif
#ifndef EPI
#define EPI 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef RL
#define RL 1
#endif
#ifndef UNR
#define UNR 1
#endif
#ifndef LPR
#define LPR 32
#endif

#define THREADS (WARPS * 32)
#define GATES (EPI == 2 ? 2 : 1)
#define WR (RL * GATES)
#define SIDE (32 / LPR)
static_assert(W_T >= 3 && W_T <= 5, "W_T must be 3 (Q8_0), 4 (Q4_0) or 5 (Q4_1)");
static_assert(TOKENS >= 1 && TOKENS <= 8, "TOKENS must be 1..8");
static_assert(LPR == 8 || LPR == 16 || LPR == 32, "LPR must be 8, 16 or 32");
static_assert(EPI != 2 || HAS_BIAS == 0, "SwiGLU takes no bias");
// FUSE = 1: the product kernel rounds x itself into dynamic shared memory (TOKENS x cols x 2.25
// bytes), with no separate rounding launch; 0: x comes rounded in the scratch.
#ifndef FUSE
#define FUSE 0
#endif

#if W_T == 3
#define UNIT_WORDS 34
#elif W_T == 4
#define UNIT_WORDS 18
#else
#define UNIT_WORDS 20
#endif


// One token and one unit a round: x is loaded beside the weights (see the product loop).
#define PREFETCH_X (TOKENS == 1 && UNR == 1)
// PIPE = 1: a persistent grid, each warp with two rounds of weights in flight (two stages).
#ifndef PIPE
#define PIPE 0
#endif
static_assert(!(PIPE && FUSE), "the pipelined kernel takes x from the scratch");
#define UNIT_BYTES (UNIT_WORDS * 4)
#define STAGE_BYTES (UNR * WR * 32 * UNIT_BYTES)
static_assert(WARPS * STAGE_BYTES * (PIPE ? 2 : 1) <= 48 * 1024, "the warps' weight stages must fit 48 KiB of shared memory");

__device__ __forceinline__ void i8_copy8(void* smem, const void* gmem) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void i8_copy_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void i8_copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Every committed group of copies but the last has landed.
__device__ __forceinline__ void i8_copy_wait_but_last() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

__device__ __forceinline__ float i8_half(kiln_u32 bits) {
    float f;
    unsigned short h = (unsigned short)(bits & 0xFFFFu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Bytes 2..5 of the pair (a, b): the word of a block whose quants start 2 bytes into a word.
__device__ __forceinline__ int i8_shifted(kiln_u32 a, kiln_u32 b) { return (int)__byte_perm(a, b, 0x5432); }

__device__ __forceinline__ int i8_dot4(int a, int b, int c) { return __dp4a(a, b, c); }

#if X_T == 1
__device__ __forceinline__ float4 i8_load_x4(const void* x, long long i) {
    const uint2 v = *reinterpret_cast<const uint2*>(reinterpret_cast<const kiln_u16*>(x) + i);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xFFFF0000u));
}
#else
__device__ __forceinline__ float4 i8_load_x4(const void* x, long long i) {
    return *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(x) + i);
}
#endif

__device__ __forceinline__ uint4 i8_ldg16(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float2 i8_ldg8(const float2* p) {
    float2 r;
    asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}

// x's planes and scales: from the scratch (global, read-only for the kernel) or, FUSE, from the
// block's shared copy.
#if FUSE
extern __shared__ __align__(16) uint4 i8_x_shared[];
__device__ __forceinline__ uint4 i8_ldx16(const uint4* p) { return *p; }
__device__ __forceinline__ float2 i8_ldx8(const float2* p) { return *p; }
#else
__device__ __forceinline__ uint4 i8_ldx16(const uint4* p) { return i8_ldg16(p); }
__device__ __forceinline__ float2 i8_ldx8(const float2* p) { return i8_ldg8(p); }
#endif

__device__ __forceinline__ int i8_round(float v, float inv) {
    int q = __float2int_rn(v * inv);
    return max(-127, min(127, q));
}

// silu(g) * u, with the accurate expf (as the CUDA-core linear kernel).
__device__ __forceinline__ float i8_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Copies round r0's units of every weight row of this lane's row group into the warp's stage
// (asynchronously, consecutive lanes in 8-byte words): UNR units of LPR lanes each.
__device__ __forceinline__ void i8_issue_round(kiln_u8* stage, const kiln_u8* const (&wrow)[WR], int r0, int units,
                                               int sl, int side) {
#pragma unroll
    for (int k = 0; k < UNR; ++k) {
        const int base = r0 + k * LPR;
#pragma unroll
        for (int i = 0; i < WR; ++i) {
            const kiln_u8* src = wrow[i] + (long long)base * UNIT_BYTES;
            kiln_u8* dst = stage + ((k * WR + i) * 32 + side * LPR) * UNIT_BYTES;
#pragma unroll
            for (int j = 0; j < UNIT_WORDS / 2; ++j) {
                const int w = sl + LPR * j;
                if (base + (w * 8) / UNIT_BYTES < units) i8_copy8(dst + 8 * w, src + 8 * w);
            }
        }
    }
}

#define I8_BATCH 8

// Rounds x (TOKENS x cols, f32 or bf16) to int8 per block of 32 values into `xq` (the scratch,
// or shared memory): 8 threads a block of 32, 4 values each; thread `first` takes quads first,
// first + stride, ...; `stride` a multiple of 32, so every lane of a warp takes part.
__device__ __forceinline__ void i8_quantize(const void* __restrict__ x, uint4* xq, int cols, int first, int stride) {
    const int units = cols >> 7;
    float2* xs = reinterpret_cast<float2*>(xq + 2 * TOKENS * 8 * units);
    const int quads = cols >> 2;
    const int total = TOKENS * quads;  // a multiple of 32: every lane of a warp takes part
    kiln_u32* xw = reinterpret_cast<kiln_u32*>(xq);
    // I8_BATCH quads a thread are loaded before any is rounded, so their loads wait for memory
    // together (a block rounding a whole row of x takes many quads a thread).
    for (int base = first; base < total; base += I8_BATCH * stride) {
        float4 batch[I8_BATCH];
#pragma unroll
        for (int k = 0; k < I8_BATCH; ++k) {
            const int i = base + k * stride;
            const int t = i / quads, v = i - t * quads;
            batch[k] = i < total ? i8_load_x4(x, (long long)t * cols + 4 * v) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < I8_BATCH; ++k) {
            const int i = base + k * stride;
            if (i >= total) break;  // the same for every lane of a warp (stride and total multiples of 32)
            const int t = i / quads, v = i - t * quads;
            const float4 a = batch[k];
            float m = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w)));
            float s = (a.x + a.y) + (a.z + a.w);
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
                s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
            }
            const float inv = m > 0.0f ? 127.0f / m : 0.0f;
            const float d1 = m / 127.0f;
            const float inv2 = 254.0f * inv;
            const int q0 = i8_round(a.x, inv), q1 = i8_round(a.y, inv), q2 = i8_round(a.z, inv),
                      q3 = i8_round(a.w, inv);
            // The rests x - d1 q (|rest| <= d1 / 2, so |254 rest / d1| <= 127).
            // One rounding (a fused multiply-add), written out so that the norm's copy of this
            // rounding (norm.cu, I8_PLANES; compiled without contraction) gives the same bits.
            const int r0 = i8_round(__fmaf_rn(-d1, (float)q0, a.x), inv2),
                      r1 = i8_round(__fmaf_rn(-d1, (float)q1, a.y), inv2),
                      r2 = i8_round(__fmaf_rn(-d1, (float)q2, a.z), inv2),
                      r3 = i8_round(__fmaf_rn(-d1, (float)q3, a.w), inv2);
            int qs = 254 * (q0 + q1 + q2 + q3) + (r0 + r1 + r2 + r3);
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) qs += __shfl_xor_sync(0xFFFFFFFFu, qs, o);
            const kiln_u32 packed = (kiln_u32)(q0 & 0xFF) | ((kiln_u32)(q1 & 0xFF) << 8) |
                                    ((kiln_u32)(q2 & 0xFF) << 16) | ((kiln_u32)(q3 & 0xFF) << 24);
            const kiln_u32 rest = (kiln_u32)(r0 & 0xFF) | ((kiln_u32)(r1 & 0xFF) << 8) |
                                  ((kiln_u32)(r2 & 0xFF) << 16) | ((kiln_u32)(r3 & 0xFF) << 24);
            const int c = v >> 2, u = c >> 3, j = c & 7;
            xw[(((t * 8 + j) * units) + u) * 4 + (v & 3)] = packed;
            xw[((((TOKENS + t) * 8 + j) * units) + u) * 4 + (v & 3)] = rest;
            if ((v & 7) == 0) {
                const int b = v >> 3;
#if W_T == 4
                const float second = __int_as_float(qs);
#else
                const float second = s;
#endif
                xs[(t * 4 + (b & 3)) * units + (b >> 2)] = make_float2(d1 * (1.0f / 254.0f), second);
            }
        }
    }
}

// The separate rounding launch: x into the scratch; any grid, blocks of a multiple of 32 threads.
extern "C" __global__ void kiln_linear_i8_quantize(const void* __restrict__ x, uint4* __restrict__ xq, int cols) {
    kiln_wait_prior();
    i8_quantize(x, xq, cols, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

// The weight rows of row group g for this lane: output row g * SIDE * RL + (i % RL) * SIDE + side
// of gate i / RL; past the end, row 0 (its sums are dropped).
__device__ __forceinline__ void i8_group_rows(const kiln_u8* (&wrow)[WR], const kiln_u8* __restrict__ weight,
                                              int rows, long long row_bytes, int g, int side) {
#pragma unroll
    for (int i = 0; i < WR; ++i) {
        int o = g * SIDE * RL + (i % RL) * SIDE + side;
        o = o < rows ? o : 0;
        wrow[i] = weight + ((long long)(i / RL) * rows + o) * row_bytes;
    }
}

// One round of a row group's products: the round's x (PREFETCH_X), the wait for its weights
// (every copy, or every copy but the last group committed when PENDING, the next round's), and
// the products of its units into acc.
template <int PENDING>
__device__ __forceinline__ void i8_round_products(const kiln_u8* stage, int r0, int units, int sl, int side,
                                                  const uint4* xq, const uint4* xr, const float2* xs,
                                                  float (&acc)[WR][TOKENS]) {
    const int u0 = r0 + sl;
#if PREFETCH_X
    // One token, one unit a round: the unit's x (both planes and the scales of its 4
    // blocks) is loaded while the weights are on their way, so a round waits for memory once.
    uint4 px[4][4];
    float2 ps[4];
    {
        const int uu = u0 < units ? u0 : 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            px[b][0] = i8_ldx16(xq + (2 * b) * units + uu);
            px[b][1] = i8_ldx16(xq + (2 * b + 1) * units + uu);
            px[b][2] = i8_ldx16(xr + (2 * b) * units + uu);
            px[b][3] = i8_ldx16(xr + (2 * b + 1) * units + uu);
            ps[b] = i8_ldx8(xs + b * units + uu);
        }
    }
#endif
    if (PENDING) i8_copy_wait_but_last(); else i8_copy_wait();
    __syncwarp();
#pragma unroll
    for (int k = 0; k < UNR; ++k) {
        const int u = u0 + k * LPR;
        if (u >= units) break;
#if PREFETCH_X
#pragma unroll
#else
        // One block at a time: unrolled, the compiler would hold every block's x in registers.
#pragma unroll 1
#endif
        for (int b = 0; b < 4; ++b) {
            // Block b's weight scale (and Q4_1's offset) and quant words, per weight row.
            float dw[WR];
#if W_T == 5
            float mw[WR];
#endif
#if W_T == 3
            int q[WR][8];
#else
            int q[WR][4];
#endif
#pragma unroll
            for (int i = 0; i < WR; ++i) {
                // This lane's unit in the stage (read where used: no copy in registers).
                const kiln_u32* w = reinterpret_cast<const kiln_u32*>(
                    stage + ((k * WR + i) * 32 + side * LPR + sl) * UNIT_BYTES);
#if W_T == 3
                // 34-byte blocks at 0, 34, 68, 102: quants at 2, 36, 70, 104.
                if (b == 0 || b == 2) {
                    const int o = b == 0 ? 0 : 17;
                    dw[i] = i8_half(w[o]);
#pragma unroll
                    for (int n = 0; n < 8; ++n) q[i][n] = i8_shifted(w[o + n], w[o + n + 1]);
                } else {
                    const int o = b == 1 ? 8 : 25;
                    dw[i] = i8_half(w[o] >> 16);
#pragma unroll
                    for (int n = 0; n < 8; ++n) q[i][n] = (int)w[o + 1 + n];
                }
#elif W_T == 4
                // 18-byte blocks at 0, 18, 36, 54: quants at 2, 20, 38, 56.
                if (b == 0 || b == 2) {
                    const int o = b == 0 ? 0 : 9;
                    dw[i] = i8_half(w[o]);
#pragma unroll
                    for (int n = 0; n < 4; ++n) q[i][n] = i8_shifted(w[o + n], w[o + n + 1]);
                } else {
                    const int o = b == 1 ? 4 : 13;
                    dw[i] = i8_half(w[o] >> 16);
#pragma unroll
                    for (int n = 0; n < 4; ++n) q[i][n] = (int)w[o + 1 + n];
                }
#else
                // 20-byte blocks: d, m, 16 bytes of quants.
                dw[i] = i8_half(w[5 * b]);
                mw[i] = i8_half(w[5 * b] >> 16);
#pragma unroll
                for (int n = 0; n < 4; ++n) q[i][n] = (int)w[5 * b + 1 + n];
#endif
            }
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
#if PREFETCH_X
                const uint4 lo = px[b][0], hi = px[b][1], lo2 = px[b][2], hi2 = px[b][3];
                const float2 sc = ps[b];
#else
                const uint4 lo = i8_ldx16(xq + (t * 8 + 2 * b) * units + u);
                const uint4 hi = i8_ldx16(xq + (t * 8 + 2 * b + 1) * units + u);
                const uint4 lo2 = i8_ldx16(xr + (t * 8 + 2 * b) * units + u);
                const uint4 hi2 = i8_ldx16(xr + (t * 8 + 2 * b + 1) * units + u);
                const float2 sc = i8_ldx8(xs + (t * 4 + b) * units + u);
#endif
#pragma unroll
                for (int i = 0; i < WR; ++i) {
                    int sum = 0, sum2 = 0;
#if W_T == 3
                    sum = i8_dot4(q[i][0], (int)lo.x, sum);
                    sum = i8_dot4(q[i][1], (int)lo.y, sum);
                    sum = i8_dot4(q[i][2], (int)lo.z, sum);
                    sum = i8_dot4(q[i][3], (int)lo.w, sum);
                    sum = i8_dot4(q[i][4], (int)hi.x, sum);
                    sum = i8_dot4(q[i][5], (int)hi.y, sum);
                    sum = i8_dot4(q[i][6], (int)hi.z, sum);
                    sum = i8_dot4(q[i][7], (int)hi.w, sum);
                    sum2 = i8_dot4(q[i][0], (int)lo2.x, sum2);
                    sum2 = i8_dot4(q[i][1], (int)lo2.y, sum2);
                    sum2 = i8_dot4(q[i][2], (int)lo2.z, sum2);
                    sum2 = i8_dot4(q[i][3], (int)lo2.w, sum2);
                    sum2 = i8_dot4(q[i][4], (int)hi2.x, sum2);
                    sum2 = i8_dot4(q[i][5], (int)hi2.y, sum2);
                    sum2 = i8_dot4(q[i][6], (int)hi2.z, sum2);
                    sum2 = i8_dot4(q[i][7], (int)hi2.w, sum2);
                    acc[i][t] += (dw[i] * sc.x) * (float)(254 * sum + sum2);
#else
                    // Byte n of quant word m: low nibble value 4m + n, high nibble 16 + 4m + n.
                    const int m0 = q[i][0] & 0x0F0F0F0F, m1 = q[i][1] & 0x0F0F0F0F;
                    const int m2 = q[i][2] & 0x0F0F0F0F, m3 = q[i][3] & 0x0F0F0F0F;
                    const int h0 = (q[i][0] >> 4) & 0x0F0F0F0F, h1 = (q[i][1] >> 4) & 0x0F0F0F0F;
                    const int h2 = (q[i][2] >> 4) & 0x0F0F0F0F, h3 = (q[i][3] >> 4) & 0x0F0F0F0F;
                    sum = i8_dot4(m0, (int)lo.x, sum);
                    sum = i8_dot4(m1, (int)lo.y, sum);
                    sum = i8_dot4(m2, (int)lo.z, sum);
                    sum = i8_dot4(m3, (int)lo.w, sum);
                    sum = i8_dot4(h0, (int)hi.x, sum);
                    sum = i8_dot4(h1, (int)hi.y, sum);
                    sum = i8_dot4(h2, (int)hi.z, sum);
                    sum = i8_dot4(h3, (int)hi.w, sum);
                    sum2 = i8_dot4(m0, (int)lo2.x, sum2);
                    sum2 = i8_dot4(m1, (int)lo2.y, sum2);
                    sum2 = i8_dot4(m2, (int)lo2.z, sum2);
                    sum2 = i8_dot4(m3, (int)lo2.w, sum2);
                    sum2 = i8_dot4(h0, (int)hi2.x, sum2);
                    sum2 = i8_dot4(h1, (int)hi2.y, sum2);
                    sum2 = i8_dot4(h2, (int)hi2.z, sum2);
                    sum2 = i8_dot4(h3, (int)hi2.w, sum2);
                    const int total = 254 * sum + sum2;
#if W_T == 4
                    // w = d (q - 8): sum (q - 8) xq = sum q xq - 8 sum xq, exact in int.
                    acc[i][t] += (dw[i] * sc.x) * (float)(total - 8 * __float_as_int(sc.y));
#else
                    // w = d q + m: d dx sum q xq + m sum x.
                    acc[i][t] += (dw[i] * sc.x) * (float)total + mw[i] * sc.y;
#endif
#endif
                }
            }
        }
    }
}

// A row group's sums over the row's lanes and its outputs (the epilogue), by the row's first lane.
__device__ __forceinline__ void i8_finish_group(float (&acc)[WR][TOKENS], const float* __restrict__ bias,
                                                float* __restrict__ out, int rows, int g, int side, int sl) {
    const int per_group = SIDE * RL;
    // Sums over the row's lanes (a butterfly inside each group of LPR lanes).
#pragma unroll
    for (int i = 0; i < WR; ++i)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
#pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1) acc[i][t] += __shfl_xor_sync(0xFFFFFFFFu, acc[i][t], o);
        }
    if (sl == 0) {
#pragma unroll
        for (int i = 0; i < RL; ++i) {
            const int o = g * per_group + i * SIDE + side;
            if (o >= rows) continue;
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                float* dst = out + (long long)t * rows + o;
#if EPI == 2
                *dst = i8_swiglu(acc[i][t], acc[RL + i][t]);
#else
                float y = acc[i][t];
#if HAS_BIAS
                y += bias[o];
#endif
#if EPI == 1
                *dst = *dst + y;
#else
                *dst = y;
#endif
#endif
            }
        }
    }
}

// Pipelined, 4 blocks of 4 warps an SM (at most 128 registers a thread): the stages hold the
// weights in flight, registers only one round's quants and sums.
extern "C" __global__ void __launch_bounds__(THREADS, PIPE && TOKENS <= 2 && WARPS <= 4 ? 4 : (WARPS <= 4 ? 2 : 1))
kiln_linear_i8(const kiln_u8* __restrict__ weight, const float* __restrict__ bias, const void* __restrict__ xin,
               float* __restrict__ out, int rows, int cols, long long row_bytes) {
    __shared__ __align__(16) kiln_u8 i8_stage[WARPS][PIPE ? 2 : 1][STAGE_BYTES];
    const int units = cols >> 7;

    // ---- the products ------------------------------------------------------------------------------
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int side = lane / LPR, sl = lane % LPR;
    const int groups = (rows + SIDE * RL - 1) / (SIDE * RL);
    int g = blockIdx.x * WARPS + warp;
    const kiln_u8* wrow[WR];
    i8_group_rows(wrow, weight, rows, row_bytes, g, side);
    // The first round's weights are requested before the wait for the kernel before (they
    // overlap its end); x is read only after it.
    if (g < groups) i8_issue_round(i8_stage[warp][0], wrow, 0, units, sl, side);
#if PIPE
    i8_copy_commit();
#endif
    kiln_wait_prior();
#if FUSE
    // x (the kernel's input) rounded by the block itself into shared memory, as the separate
    // rounding launch would write it into the scratch: the same values, no launch of its own.
    uint4* xq = i8_x_shared;
    i8_quantize(xin, xq, cols, threadIdx.x, THREADS);
    __syncthreads();
#else
    const uint4* xq = reinterpret_cast<const uint4*>(xin);  // the scratch
#endif
    const uint4* xr = xq + TOKENS * 8 * units;  // the second plane
    const float2* xs = reinterpret_cast<const float2*>(xq + 2 * TOKENS * 8 * units);
    float acc[WR][TOKENS];
#pragma unroll
    for (int i = 0; i < WR; ++i)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) acc[i][t] = 0.0f;
#if PIPE
    // Persistent: the warp takes row groups g, g + stride, ... and has two rounds in flight,
    // the next round's copies (the next group's first round at a group's end) issued before the
    // current round is summed. A row's sums run in the same order as without the pipeline.
    const int stride = gridDim.x * WARPS;
    const int step = LPR * UNR;
    int r0 = 0, buf = 0;
    while (g < groups) {
        int ng = g, nr0 = r0 + step;
        if (nr0 >= units) {
            ng = g + stride;
            nr0 = 0;
        }
        const kiln_u8* nrow[WR];
        i8_group_rows(nrow, weight, rows, row_bytes, ng, side);
        if (ng < groups) i8_issue_round(i8_stage[warp][buf ^ 1], nrow, nr0, units, sl, side);
        i8_copy_commit();
        i8_round_products<1>(i8_stage[warp][buf], r0, units, sl, side, xq, xr, xs, acc);
        __syncwarp();  // every lane is done with this stage before it is filled again
        if (nr0 == 0) {
            i8_finish_group(acc, bias, out, rows, g, side, sl);
#pragma unroll
            for (int i = 0; i < WR; ++i)
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) acc[i][t] = 0.0f;
        }
        g = ng;
        r0 = nr0;
        buf ^= 1;
#pragma unroll
        for (int i = 0; i < WR; ++i) wrow[i] = nrow[i];
    }
    i8_copy_wait();  // no copy outlives the block
#else
    if (g < groups) {
        for (int r0 = 0; r0 < units; r0 += LPR * UNR) {
            if (r0 > 0) i8_issue_round(i8_stage[warp][0], wrow, r0, units, sl, side);
            i8_round_products<0>(i8_stage[warp][0], r0, units, sl, side, xq, xr, xs, acc);
            __syncwarp();  // every lane is done with the stage before the next round's copies
        }
        i8_finish_group(acc, bias, out, rows, g, side, sl);
    }
#endif
}
