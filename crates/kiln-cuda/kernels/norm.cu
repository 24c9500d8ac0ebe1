// The norm family (RMSNorm, LayerNorm) with an optional residual add, weight (plain or 1 + w),
// bias, SiLU gate, groups, and float / INT8 / NVFP4 / FP8 outputs: the CUDA twin of
// `kiln_core::ops::norm`, equal to it bit for bit.
//
// Memory floor: one read of x (and of the residual and gate when present), one write of the
// output (and of the updated residual); the weight comes from L1/L2. The kernel is one pass: a
// warp holds its share of a segment in registers (UNITS_PER_WARP units of 256 elements, 8 per
// lane, loaded with 16-byte loads), reduces, and writes.
//
// What makes it fast is the instruction count per element, since a norm moves only 4 bytes per
// bf16 element (2.6 with an NVFP4 output) and the H200 issues about 24-37 thread instructions per
// element-time of DRAM: every rounding to bf16 / fp16 is the hardware's packed conversion
// (`cvt.rn.bf16x2.f32`, one instruction for two elements, round to nearest even like the
// reference; the NaN it makes is the canonical one the GPU's arithmetic makes anyway), the E4M3
// scale of NVFP4 and the FP8 output use the hardware's `cvt.rn.satfinite.e4m3x2.f32` on sm_89
// and later, INT8 and E2M1 codes come from fp32 arithmetic alone (a rounding "magic" addition
// whose low bits are the code, no conversion instruction): an INT8 code is one fused multiply-add
// by the block's rounded 1 / scale (`kiln_int8_fast`: the reference defines the code as rint of
// that exact product, and 1 / scale is __frcp_rn's sequence, `kiln_rcp_rn`), an E2M1 code is
// two fused multiply-adds and their minimum (`kiln_e2m1_product`: the reference defines it as
// the E2M1 value nearest the exact product y * inverse, inverse = qscale / f32(s) rounded once,
// which is Markstein's correction of the rounded reciprocal, `kiln_nvfp4_inverse`; the sums
// straddle powers of two so that fp32's own spacing doubles where E2M1's does; no check, no
// division a value: only a block out of the fast path's range goes the reference's way), eight
// of them packed by multiply-adds and one subtraction (`kiln_e2m1_pack8`); the block scales
// divide by 127 and 6 with a reciprocal and one correction (`kiln_div_const`), the block
// maximum's shuffle runs outside any branch, quantized bytes and E2M1 signs are packed with
// `prmt`, a warp's unit sums are reduced together (`kiln_norm_units_reduce`: 6 shuffles for 4
// units, not 20), and the unit sums of several warps are combined from shared memory four at a
// time. With an NVFP4 output the budget is about 20 instructions a value at the copy ceiling
// (2.56 bytes a bf16 value) and the kernel needs about 20.6 as compiled for sm_90 (one lane a
// block at 8192 x 8192, 8 warps a row: 659 instructions a lane for its 32 values on the fast
// path; the loads, squares, sums and 1 / rms about 255 a lane, 8 a value, of which about 70 are
// each warp adding the row's 32 unit sums and finishing the total (ROW_TOTAL_WARP leaves that
// to one warp: 604 a lane on average); then per block of 16: the norm's products and roundings
// 5 a value, the block maximum 15, the scale, its checks and the inverse about 22, the codes 3
// a value with their products, their packing and signs 32, the stores about 4; 2048 x 4096, 4
// warps a row: 648, 20.25 a value; 617 with ROW_TOTAL_WARP): it is bound by issue, not by DRAM;
// INT8 (3.25 bytes, about 26) needs 16.6 (531 a lane at 8192 x 8192; 16.2 at 2048 x 4096, 4
// warps a row; of which the codes 1 and their packing 0.75). Hugging Face's rounding with bf16 x,
// weight and output takes the weight's product packed (`kiln_bf16x2_mul`, see
// KILN_NORM_PACKED_BF16): about 6 a value for the whole norm. The INT8 / NVFP4 / FP8 outputs of
// that rounding quantize those same bf16 values (ops::norm) and take the same packed product
// (KILN_NORM_PACKED_Q: 2.5 a value with the widening, where the fp32 product and its rounding
// took 4.5 before the reference quantized the bf16 values); NVFP4 at 8 units a warp takes each
// block's maximum from the packed pairs on sm_86 and later (10 instructions a block, not 15).
// The default NVFP4 kernel at 8192 x 8192 (4 warps a row, 8 units a warp, +n) then runs 48.0 us
// on the H200, 84% of the copy ceiling (bench/results/2026-12-01-h200-g, g2).
// At 2048 x 4096 the defaults run as one wave (2048 blocks of 2 warps, 31 warps a
// multiprocessor, every row's x in registers at once, which caps a lane at 64 registers), so no
// later wave's loads hide a warp's instructions. On sm_90 the fast path (`scripts/sass-fast-path`)
// of RMSNorm with Hugging Face's rounding is 580 instructions a lane for its 64 values (9.1 a
// value), 2.3 us of issue a multiprocessor on the H200 (31 warps, 4 a clock at 1.98 GHz); of
// LayerNorm with weight and bias 1139 (17.8 a value: x widened for the mean, the variance and
// the output, and four fp32 operations a value for the output, none fusable without changing the
// bits), 4.5 us, where 85% of the copy ceiling leaves 9.3 us for the whole launch.
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
//   PERSISTENT    1: each block loops over groups of ROWS_PER_BLOCK segments (blockIdx.x, then
//                 gridDim.x further each time) and issues the loads of its next group before
//                 the reductions and stores of the current one, so reads and writes overlap
//                 through the whole launch instead of a wave of reads, then a wave of writes;
//                 with one group per segment the weight (EARLY_WEIGHT) stays in registers
//                 across segments. 0: one group per block.
//   STAGES        (optional, 0 by default) 2 or more: persistent as well, but the loads go by
//                 cp.async into STAGES stages of dynamic shared memory, each thread's own 16-byte
//                 pieces (no barrier: a thread reads back only what it copied), issued
//                 STAGES - 1 groups ahead of the group being reduced and written; registers hold
//                 only the current group, as without PERSISTENT. The launcher sizes the grid to a
//                 few blocks a multiprocessor, so that each block walks many groups and the reads
//                 of later groups overlap the stores of earlier ones over the whole launch.
//                 Dynamic shared memory: STAGES * KILN_NORM_SLOTS * KILN_NORM_THREADS * 16 bytes.
//   SEGMENT_N     (optional) the segment length `n` as a constant, equal to the argument.
//   BLOCK_LANE    (optional, 0 by default) 1: a lane holds 16 consecutive elements, one block of
//                 the INT8 / NVFP4 outputs (see its definition below): unit sums by the same
//                 tree, each block's maximum, scale, checks and stores one lane's.
//
// Registers hold x as loaded (its raw bits, half the registers of fp32 values for 16-bit types)
// unless a gate multiplies it before the norm; with more than 4 units per warp every use converts
// the bits again, exactly, so that only the bits stay live across the reductions. All loads of a
// warp's x (and residual) are issued before the first use; x bypasses L1 (it is read once).

#if STAGES == 1 || (STAGES && PERSISTENT)
#error "STAGES is 0 or at least 2, and replaces PERSISTENT"
#endif
#if defined(BLOCK_LANE) && BLOCK_LANE && ((UNITS_PER_WARP % 2) || (defined(I8_PLANES) && I8_PLANES))
#error "BLOCK_LANE needs an even UNITS_PER_WARP and no I8_PLANES"
#endif

#define KILN_OUT_INT8 3
#define KILN_OUT_NVFP4 4
#define KILN_OUT_FP8 5

#define KILN_NORM_UNITS (UNITS_PER_WARP * WARPS_PER_ROW)
// One segment a block, neither persistent nor staged: the launcher's grid is then exactly one
// block a segment (ops::norm), so every block's segment exists and the kernel drops the checks
// (uniform branches around each unit's loads, products and stores: 46 instructions a lane of
// 1139 for NVFP4 at 8192 x 8192, 4 warps a row, on sm_90).
#ifndef STAGES
#define STAGES 0
#endif
#define KILN_NORM_EXACT_GRID (ROWS_PER_BLOCK == 1 && !PERSISTENT && !STAGES)
// Block-quantized outputs (one scale per 16 values).
#define KILN_NORM_BLOCKED (OUT_T == KILN_OUT_INT8 || OUT_T == KILN_OUT_NVFP4)
#define KILN_NORM_THREADS (32 * WARPS_PER_ROW * ROWS_PER_BLOCK)

// BLOCK_LANE (optional, 0 by default) 1: a lane holds 16 consecutive elements, one block of the
// INT8 / NVFP4 outputs, so that each block's maximum, scale, checks and stores are one lane's
// (no shuffle, half the scale computations, 16-byte INT8 stores). Register units go in pairs:
// units 2P and 2P + 1 of a warp are the two halves (elements 0-7 and 8-15 of each lane's 16) of
// the 512 elements (warp_in_row + P WARPS_PER_ROW) * 512 ...; lanes 0-15 hold the segment's unit
// 2 (warp_in_row + P WARPS_PER_ROW) and lanes 16-31 the one after it, lane l holding what the
// 8-element layout gives lanes 2 (l & 15) and 2 (l & 15) + 1. The unit sums are the same tree of
// the same additions (kiln_norm_pairs_reduce). UNITS_PER_WARP even; not I8_PLANES. Staged
// (STAGES), each lane copies the pieces of its own columns, which kiln_norm_col gives for
// either layout.
#ifndef BLOCK_LANE
#define BLOCK_LANE 0
#endif

// Register unit u's columns past the lane's first (a compile-time constant).
__device__ __forceinline__ constexpr int kiln_norm_off(int u) {
    return BLOCK_LANE ? (u >> 1) * WARPS_PER_ROW * 512 + (u & 1) * 8 : u * WARPS_PER_ROW * 256;
}

// The first of the 8 elements of register unit u that this lane holds, within the segment.
__device__ __forceinline__ int kiln_norm_col(int warp_in_row, int u, int lane) {
#if BLOCK_LANE
    return warp_in_row * 512 + lane * 16 + kiln_norm_off(u);
#else
    return (warp_in_row + u * WARPS_PER_ROW) * 256 + lane * 8;
#endif
}

// base + kiln_norm_col(warp_in_row, u, lane) (warp_in_row and lane from the caller's scope); with
// BLOCK_LANE written as (base + the lane's first column) + u's constant, so that the row's
// address is computed once and each unit's is an immediate offset from it.
#if BLOCK_LANE
#define KILN_NORM_AT(base, u) ((base) + (long long)kiln_norm_col(warp_in_row, 0, lane) + (long long)kiln_norm_off(u))
#else
#define KILN_NORM_AT(base, u) ((base) + kiln_norm_col(warp_in_row, u, lane))
#endif

#ifndef I8_PLANES
#define I8_PLANES 0
#endif
// Hugging Face's round(round(x * r) * w) with bf16 x, weight and output: the product of two bf16
// values is exact in fp32 (16 significant bits; below fp32's normal range it has too few bits
// for a rounding to fp32 and then to bf16 to differ from one rounding, and above bf16's largest
// value both round to infinity), so round(x_r * w) is the exact product rounded once, which
// `fma.rn.bf16x2` with a -0 addend gives for two values in one instruction, from the packed
// rounding of x * r and the weight's raw bits: 1 instruction a value where unpacking, the fp32
// product and the second rounding take 4.
#define KILN_NORM_PACKED_PRODUCT                                                                   \
    (KIND == 0 && HF_ROUNDING && X_T == KILN_BF16 && W_T == KILN_BF16 && WEIGHT == 0 && !HAS_BIAS &&  \
     GATE != 2 && !I8_PLANES)
#define KILN_NORM_PACKED_BF16 (KILN_NORM_PACKED_PRODUCT && OUT_T == KILN_BF16)
// The same product for a quantized output with Hugging Face's rounding, which quantizes exactly
// those bf16 values (ops::norm): 2.5 instructions a value with the widening for the quantizer,
// where unpacking the weight, the fp32 product, the rounding and its widening take 4.5.
#define KILN_NORM_PACKED_Q (KILN_NORM_PACKED_PRODUCT && OUT_T > KILN_BF16)
// A staged grid with the weight loaded early keeps it (and the bias) as fp32 values, 1 + w for
// WEIGHT 1, across the segments it walks: no conversion a value and segment (up to 4 units a
// warp: 32 registers for the weight, 32 for the bias).
#define KILN_NORM_WF (STAGES && EARLY_WEIGHT && !KILN_NORM_PACKED_BF16 && !KILN_NORM_PACKED_Q && UNITS_PER_WARP <= 4)

// x rounded to bf16 and widened back, in one conversion where kiln_round2 takes one for two
// values and two to widen them: cvt.rn.bf16x2.f32 puts bf16(x) in the upper half and bf16(0) = 0
// in the lower, which is bf16(x) as an fp32 value (kiln_round2's bits; a NaN x gives the same
// canonical NaN 0x7FFF0000 both ways). Used with BLOCK_LANE where it adds no spill on sm_80 - 90:
// up to 8 units a warp, 4 with the NVFP4 output (at 8 it spilled on sm_80, at 16 on sm_90).
__device__ __forceinline__ float kiln_round_bf16(float x) {
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(x), "f"(0.0f));
    return __uint_as_float(d);
}

// round(a * b) for two packed pairs of bf16: the exact products rounded once (a -0 addend keeps
// the sign of a zero product).
__device__ __forceinline__ unsigned int kiln_bf16x2_mul(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// round(round(a * r) * w) for 8 values a (x as fp32) and the weight's raw bf16 bits, packed:
// KILN_NORM_PACKED_BF16's and KILN_NORM_PACKED_Q's product.
__device__ __forceinline__ uint4 kiln_norm_packed_product(const float (&a)[8], float r, uint4 w) {
    return make_uint4(kiln_bf16x2_mul(kiln_pack_bf16x2(a[0] * r, a[1] * r), w.x),
                      kiln_bf16x2_mul(kiln_pack_bf16x2(a[2] * r, a[3] * r), w.y),
                      kiln_bf16x2_mul(kiln_pack_bf16x2(a[4] * r, a[5] * r), w.z),
                      kiln_bf16x2_mul(kiln_pack_bf16x2(a[6] * r, a[7] * r), w.w));
}

// max(a, b), NaN when either is (PTX max.NaN, sm_80 and later): a NaN reaching a fast-path
// check makes it fail.
__device__ __forceinline__ float kiln_max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// 1 / x within 1 ulp (one MUFU instruction) for x in [2^-126, 2^126].
__device__ __forceinline__ float kiln_rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// 1 / x rounded to nearest even for x in [2^-126, 2^126): __frcp_rn's own sequence in that range
// (rcp.rn.f32 becomes the MUFU reciprocal and this one fused Newton step; outside it, a call to a
// slow path), without the range test and call. Bit for bit __frcp_rn, as the reference's 1 / x.
__device__ __forceinline__ float kiln_rcp_rn(float x) {
    const float r = kiln_rcp_approx(x);
    const float e = __fmaf_rn(x, r, -1.0f);
    return __fmaf_rn(r, -e, r);
}

// a / b, rounded as the division, from b's rounded reciprocal and one fused correction: three
// instructions where the division takes about ten. Exact for every a in [2^-100, 2^100] with b =
// 127 or 6 (ops::norm's tests replay it on every mantissa of both ends' binades and of 1; every
// operation scales by a power of two between them); callers divide for other a.
#define KILN_DIV_RANGE_LO 7.88860905e-31f  // 2^-100
#define KILN_DIV_RANGE_HI 1.26765060e30f   // 2^100
__device__ __forceinline__ float kiln_div_const(float a, float b, float inverse_b) {
    const float q = a * inverse_b;
    return __fmaf_rn(__fmaf_rn(-q, b, a), inverse_b, q);
}

// 1.5 * 2^23: for |t| < 2^22, t + KILN_ROUND_MAGIC is t rounded to the nearest integer (ties to
// even) plus the magic, exactly, and its low bits are that integer in two's complement.
#define KILN_ROUND_MAGIC 12582912.0f

// INT8 code of p with a finite inverse = 1 / scale (rounded) and |p * inverse| < 2^22: rint of the
// exact product, ties to even, plus the magic, in one fused multiply-add (exactly the reference's
// `p.mul_add(inverse, MAGIC)`); the low byte of its bits is the code in two's complement.
__device__ __forceinline__ unsigned int kiln_int8_fast(float p, float inverse) {
    return __float_as_uint(__fmaf_rn(p, inverse, KILN_ROUND_MAGIC));
}

// The reference's INT8 codes (`ops::quantize::int8_code`) of N values p for any scale: with
// (factor, inverse) = (1, 1 / scale), or (2^64, 1 / (scale 2^64)) where 1 / scale overflows (a
// scale under 2^-128; both scalings exact), each code is rint(p factor inverse) (the exact
// product, one fused multiply-add with the magic) clamped to +-127, a NaN to -127 (fmaxf, as
// Rust's `max`); 0 for a scale that is not positive.
template <int N>
__device__ __forceinline__ void kiln_int8_codes(const float* p, float scale, unsigned int* q) {
    float factor = 1.0f, inverse = __frcp_rn(scale);
    if (inverse == __int_as_float(0x7F800000)) {
        factor = 18446744073709551616.0f;  // 2^64
        inverse = __frcp_rn(scale * factor);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const float t = __fmaf_rn(p[k] * factor, inverse, KILN_ROUND_MAGIC) - KILN_ROUND_MAGIC;
        q[k] = scale > 0.0f ? (unsigned int)(int)fminf(fmaxf(t, -127.0f), 127.0f) : 0u;
    }
}

// NVFP4 (`ops::quantize::nvfp4_block`): the scale s = e4m3((amax / 6) qscale), the block's
// inverse = qscale / f32(s) rounded once, and each code the E2M1 value nearest the exact product
// y * inverse: min(rint(2a), rint(a) + 2, rint(a / 2) + 4, 7) for a = |y * inverse|
// (`e2m1_of_product` says why), with y's sign.
//
// The fast path serves a block whose `scaled` = (amax / 6) qscale, as kiln_div_const and one
// product compute it, lies in [7.5 * 2^-9, 448], with qscale in [2^-80, 2^80] (a launch's
// constant). Then amax is in kiln_div_const's range [2^-100, 2^100] (above it `scaled` would be
// past 2^17, below it under 2^-22; a NaN or infinite amax gives a NaN), so `scaled` is the
// reference's; s is a normal E4M3 code (7.5 * 2^-9, a tie, rounds to 2^-6) that did not
// saturate, so f32(s) >= (15/16) scaled and every |y * inverse| <= amax * inverse <= 6.4 (1 +
// 3 * 2^-24) < 7: the clamp to 7 never acts; inverse is in [2^-89, 2^86], so 2 inverse is
// exact; and kiln_nvfp4_inverse is the division's rounding.
#define KILN_NVFP4_QSCALE_LO 8.271806125530277e-25f  // 2^-80
#define KILN_NVFP4_QSCALE_HI 1.2089258196146292e24f  // 2^80
#define KILN_NVFP4_SCALED_LO 0.0146484375f           // 7.5 * 2^-9

// qscale / scale_value rounded as the division, for qscale in [2^-100, 2^100] and a normal
// E4M3 scale_value: Markstein's correction (kiln_div_const) of the product by the rounded
// reciprocal (kiln_rcp_rn, 1 / scale_value as the division rounds it). ops::norm's tests check it
// against the division for every fp32 mantissa of qscale and each of the 8 E4M3 mantissas; every
// operation scales by powers of two from there (the residual -q * b + a is a multiple of
// 2^(e(a) - 27), e(a) >= -100, so it stays exact): 6 instructions a block where the division
// takes about 10 and a branch.
__device__ __forceinline__ float kiln_nvfp4_inverse(float qscale, float scale_value) {
    return kiln_div_const(qscale, scale_value, kiln_rcp_rn(scale_value));
}

// The E2M1 code of |y * inverse| for the fast path (a = |y * inverse| < 7, 2 inverse exact),
// as the bits of a float: KILN_E2M1_ZERO + the code. Floats double their spacing at each power
// of two, as E2M1 values do at 2 and 4, so two fused multiply-adds cover the three pieces of
// the reference's min(rint(2a), rint(a) + 2, rint(a / 2) + 4): `low` = 2a + 2^24 - 4 (|y| times
// 2 inverse) lies in [2^23, 2^24), spacing 1, for a < 2 and in [2^24, 2^25), spacing 2, above,
// so that it is rounded once to 2^24 - 4 + rint(2a), then 2^24 + 2 (rint(a) - 2); `high` = a +
// 2^24 is 2^24 + 2 rint(a / 2). Both round ties to the even bit pattern, which is rint's even
// integer (2^24 - 4 and 2^24 have even patterns), and each pattern is 0x4B800000 (2^24) plus
// the code - 4 of its piece: rint(2a) below 2, rint(a) + 2 from 2 on, rint(a / 2) + 4. The
// lesser of the two (floats of one sign order as their bits) is the reference's least of three:
// rint(2a) <= rint(a) + 2 below 2 and rint(a) + 2 <= rint(2a) from 2 on. 3 instructions a value
// with its product, and no check: the code is the reference's for every y the fast path
// serves. kiln_e2m1_pack8 removes KILN_E2M1_ZERO from eight packed codes at once.
#define KILN_E2M1_ZERO 0x4B7FFFFCu  // the bits of 2^24 - 4: code 0
__device__ __forceinline__ unsigned int kiln_e2m1_product(float y, float twice, float inverse) {
    const float a = fabsf(y);
    const float low = __fmaf_rn(a, twice, 16777212.0f);  // 2^24 - 4
    const float high = __fmaf_rn(a, inverse, 16777216.0f);  // 2^24
    return __float_as_uint(fminf(low, high));
}

// The reference's code of y * inverse (`e2m1_of_product`), for any inverse: the product is exact
// in double, as is each step after it (2a, a / 2, rint, + 2, + 4, min). The slow path's.
__device__ __forceinline__ unsigned int kiln_e2m1_of_product(float y, float inverse) {
    if (!(fabsf(inverse) <= 3.402823466e38f)) return 0u;  // not finite
    const double p = (double)y * (double)inverse;
    if (p != p) return 0u;
    const double a = fabs(p);
    const double code = fmin(fmin(rint(2.0 * a), rint(a) + 2.0), fmin(rint(0.5 * a) + 4.0, 7.0));
    return (unsigned int)code | (__double_as_longlong(p) < 0 ? 8u : 0u);
}

// Bit 3 of every nibble of eight packed E2M1 codes (value 2i in the low nibble of byte i, 2i + 1
// in the high one): the sign bits of v[0..8]. `prmt` with a selector nibble of 8 + b replicates
// the sign of source byte b over the target byte, so two levels of `prmt` gather the signs of the
// even values into one word, one byte each, and of the odd values into another.
__device__ __forceinline__ unsigned int kiln_e2m1_signs(const float (&v)[8]) {
    unsigned int e01, e23, o01, o23, even, odd;
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(e01) : "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[2])));
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(e23) : "r"(__float_as_uint(v[4])), "r"(__float_as_uint(v[6])));
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(o01) : "r"(__float_as_uint(v[1])), "r"(__float_as_uint(v[3])));
    asm("prmt.b32 %0, %1, %2, 0x00FB;" : "=r"(o23) : "r"(__float_as_uint(v[5])), "r"(__float_as_uint(v[7])));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(even) : "r"(e01), "r"(e23));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(odd) : "r"(o01), "r"(o23));
    return (even & 0x08080808u) | (odd & 0x80808080u);
}

// Eight E2M1 codes (value 2i in the low nibble of byte i, 2i + 1 in the high one) from
// kiln_e2m1_product's c = KILN_E2M1_ZERO + code and v's signs: sum c[k] 16^k modulo 2^32 (two
// Horner chains of multiply-adds and one to join them) is sum code[k] 16^k, the packed codes,
// plus KILN_E2M1_ZERO * 0x11111111: a constant, removed with one subtraction (codes below 8
// never carry into the next nibble).
__device__ __forceinline__ unsigned int kiln_e2m1_pack8(const unsigned int (&c)[8], const float (&v)[8]) {
    const unsigned int lo = ((c[3] * 16u + c[2]) * 16u + c[1]) * 16u + c[0];
    const unsigned int hi = ((c[7] * 16u + c[6]) * 16u + c[5]) * 16u + c[4];
    return (hi * 65536u + lo - KILN_E2M1_ZERO * 0x11111111u) | kiln_e2m1_signs(v);
}

// ---- x as loaded ----------------------------------------------------------------------------

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
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
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
    if constexpr (T == KILN_F32) {
        const uint4 a = r.q[0], b = r.q[T == KILN_F32 ? 1 : 0];
        v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y);
        v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
    } else {
        kiln_unpack2<T>(r.q[0].x, v[0], v[1]);
        kiln_unpack2<T>(r.q[0].y, v[2], v[3]);
        kiln_unpack2<T>(r.q[0].z, v[4], v[5]);
        kiln_unpack2<T>(r.q[0].w, v[6], v[7]);
    }
}

// The 8 values rounded to T (to nearest even), as T's bits.
template <int T> __device__ __forceinline__ void kiln_raw8_pack(const float v[8], KilnRaw8<T>& r) {
    if constexpr (T == KILN_F32) {
        r.q[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
        r.q[T == KILN_F32 ? 1 : 0] =
            make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
    } else {
        r.q[0] = make_uint4(kiln_pack2<T>(v[0], v[1]), kiln_pack2<T>(v[2], v[3]), kiln_pack2<T>(v[4], v[5]),
                            kiln_pack2<T>(v[6], v[7]));
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

// ---- the fixed-order total ------------------------------------------------------------------

// Every unit's sum over the warp (the lane_sum8 of each lane): the xor butterfly 16, 8, 4, 2, 1 of
// kiln_unit_reduce on each unit, run on all of a warp's units at once. While a lane carries more
// than one unit, each step splits them: the lane whose `distance` bit is clear keeps the even
// half of its list and sends the odd half, its partner the reverse, and each adds what it kept
// to what it received, so that every unit's partial sums are the butterfly's, pair for pair
// (addition is commutative bit for bit), in half the lanes; 4 units take 6 shuffles instead of
// 20. The lane ends with the whole sum of unit kiln_norm_unit_of(lane).
__device__ __forceinline__ float kiln_norm_units_reduce(const float (&lane_sums)[UNITS_PER_WARP], int lane) {
    float v[UNITS_PER_WARP];
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) v[u] = lane_sums[u];
#pragma unroll
    for (int j = 0; j < 5; ++j) {
        const int distance = 16 >> j;
        const int carried = UNITS_PER_WARP >> j;  // units a lane carries before this step (0: one)
        if (carried > 1) {
            const bool odd = (lane & distance) != 0;
#pragma unroll
            for (int i = 0; i < (UNITS_PER_WARP > 1 ? UNITS_PER_WARP / 2 : 1); ++i) {
                if (2 * i < carried) {
                    const float keep = odd ? v[2 * i + 1] : v[2 * i];
                    const float send = odd ? v[2 * i] : v[2 * i + 1];
                    v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, distance);
                }
            }
        } else {
            v[0] += __shfl_xor_sync(0xFFFFFFFFu, v[0], distance);
        }
    }
    return v[0];
}

// The lane bits that pick a unit in kiln_norm_units_reduce: the j-th split (distance 16 >> j)
// puts bit j of the unit in lane bit 4 - j.
__device__ __forceinline__ int kiln_norm_unit_of(int lane) {
    int unit = 0;
#pragma unroll
    for (int j = 0; (1 << j) < UNITS_PER_WARP; ++j) unit |= ((lane >> (4 - j)) & 1) << j;
    return unit;
}

__device__ __forceinline__ int kiln_norm_lane_of(int unit) {
    int lane = 0;
#pragma unroll
    for (int j = 0; (1 << j) < UNITS_PER_WARP; ++j) lane |= ((unit >> j) & 1) << (4 - j);
    return lane;
}

// Sums `s` (one unit's lane_sum8 per lane) of every unit into the segment's total, left to right.
// `unit_sums` is this segment's row of shared memory (unused with one warp per row), 16-byte
// aligned and KILN_NORM_UNITS long; every warp reads it four sums at a time.
#if BLOCK_LANE
// The unit sums of the BLOCK_LANE layout: lane_sums[2P + h] is the lane_sum8 of what the 8-element
// layout gives lane 2 (lane & 15) + h of unit 2 (warp_in_row + P WARPS_PER_ROW) + (lane >> 4).
// That layout's butterfly (distances 16, 8, 4, 2, 1 over its lane bits 4 .. 0) is here lane xor
// 8 (bit 4), 4, 2, 1 (bits 3 .. 1) and the two halves h (bit 0): the first step keeps the half h
// = lane bit 3 and sends the other (the butterfly's own pairs), so that bit 3 then carries h and
// the last step, xor 8, adds the two halves. Every partial sum is the butterfly's, pair for pair
// (addition is commutative bit for bit). v[P]: the whole sum of unit 2 (warp_in_row + P
// WARPS_PER_ROW) + (lane >> 4).
__device__ __forceinline__ void kiln_norm_pairs_reduce(const float (&lane_sums)[UNITS_PER_WARP], int lane,
                                                       float (&v)[UNITS_PER_WARP / 2]) {
    const bool hi = (lane & 8) != 0;
#pragma unroll
    for (int p = 0; p < UNITS_PER_WARP / 2; ++p) {
        const float keep = hi ? lane_sums[2 * p + 1] : lane_sums[2 * p];
        const float send = hi ? lane_sums[2 * p] : lane_sums[2 * p + 1];
        v[p] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, 8);
    }
#pragma unroll
    for (int distance = 4; distance > 0; distance >>= 1) {
#pragma unroll
        for (int p = 0; p < UNITS_PER_WARP / 2; ++p) v[p] += __shfl_xor_sync(0xFFFFFFFFu, v[p], distance);
    }
#pragma unroll
    for (int p = 0; p < UNITS_PER_WARP / 2; ++p) v[p] += __shfl_xor_sync(0xFFFFFFFFu, v[p], 8);
}
#endif

// ROW_TOTAL_WARP (optional, 0 by default) 1, with more than one warp a row: only the row's warp 0
// adds the unit sums from shared memory and finishes the total (`finish`: the mean, or 1 / the
// root mean square), and writes the result beside the unit sums for the row's other warps to read
// after a second barrier. The same operations in the same order, once a row instead of once a
// warp: the serial sum of the row's units (one addition a unit) and the division, square root
// and reciprocal are issued by one warp, not WARPS_PER_ROW, at the cost of a barrier.
#ifndef ROW_TOTAL_WARP
#define ROW_TOTAL_WARP 0
#endif
#if ROW_TOTAL_WARP && WARPS_PER_ROW == 1
#error "ROW_TOTAL_WARP shares the total of several warps of a row"
#endif
// Floats of a segment's row of unit sums in shared memory: the units, and with ROW_TOTAL_WARP
// the finished total at index KILN_NORM_UNITS (4 more, so that rows stay 16-byte aligned).
#define KILN_NORM_SUM_SLOTS (KILN_NORM_UNITS + (ROW_TOTAL_WARP ? 4 : 0))

// finish(the segment's total), the total of the unit sums left to right (see kiln_norm_total).
template <typename F>
__device__ __forceinline__ float kiln_norm_total(float (&lane_sums)[UNITS_PER_WARP], int warp_in_row, int units,
                                                 float* unit_sums, F finish) {
    const int lane = threadIdx.x & 31;
#if BLOCK_LANE
    float v[UNITS_PER_WARP / 2];
    kiln_norm_pairs_reduce(lane_sums, lane, v);
#else
    const float mine = kiln_norm_units_reduce(lane_sums, lane);
#endif
    float total = 0.0f;
    if (WARPS_PER_ROW == 1) {
#if BLOCK_LANE
        // Units 2P (lane 0) and 2P + 1 (lane 16), left to right.
#pragma unroll
        for (int p = 0; p < UNITS_PER_WARP / 2; ++p) {
            const float a = __shfl_sync(0xFFFFFFFFu, v[p], 0);
            const float b = __shfl_sync(0xFFFFFFFFu, v[p], 16);
            if (2 * p < units) total += a;
            if (2 * p + 1 < units) total += b;
        }
#else
        if (UNITS_PER_WARP == 1) {
            total = mine;
        } else {
#pragma unroll
            for (int u = 0; u < UNITS_PER_WARP; ++u) {
                const float s = __shfl_sync(0xFFFFFFFFu, mine, kiln_norm_lane_of(u));
                if (u < units) total += s;
            }
        }
#endif
    } else {
#if BLOCK_LANE
        // Lanes 0 and 16 write their units' sums.
        if ((lane & 15) == 0) {
#pragma unroll
            for (int p = 0; p < UNITS_PER_WARP / 2; ++p) {
                unit_sums[2 * (warp_in_row + p * WARPS_PER_ROW) + (lane >> 4)] = v[p];
            }
        }
#else
        // One lane of each unit's group writes its sum.
        if ((lane & (32 / UNITS_PER_WARP - 1)) == 0) {
            unit_sums[warp_in_row + kiln_norm_unit_of(lane) * WARPS_PER_ROW] = mine;
        }
#endif
        __syncthreads();
        if (ROW_TOTAL_WARP && warp_in_row != 0) {
            // The row's warp 0 finishes the total.
        } else if (KILN_NORM_UNITS % 4 == 0 && units == KILN_NORM_UNITS) {
            // Every unit present (the row fills the warps' units): the same sums in the same
            // order, without a test a unit.
#pragma unroll
            for (int i = 0; i < KILN_NORM_UNITS; i += 4) {
                const float4 s = *reinterpret_cast<const float4*>(unit_sums + i);
                total += s.x;
                total += s.y;
                total += s.z;
                total += s.w;
            }
        } else if (KILN_NORM_UNITS % 4 == 0) {
#pragma unroll
            for (int i = 0; i < KILN_NORM_UNITS; i += 4) {
                if (i < units) {
                    const float4 s = *reinterpret_cast<const float4*>(unit_sums + i);
                    total += s.x;
                    if (i + 1 < units) total += s.y;
                    if (i + 2 < units) total += s.z;
                    if (i + 3 < units) total += s.w;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < KILN_NORM_UNITS; ++i) {
                if (i < units) total += unit_sums[i];
            }
        }
    }
    if (ROW_TOTAL_WARP && WARPS_PER_ROW > 1) {
        if (warp_in_row == 0 && lane == 0) unit_sums[KILN_NORM_UNITS] = finish(total);
        __syncthreads();
        return unit_sums[KILN_NORM_UNITS];
    }
    return finish(total);
}

// x holds its raw bits unless a gate before the norm changes the values.
#define KILN_NORM_RAW (GATE != 1)

// One group's inputs as loaded, for this warp: its units of x, the residual and the gate.
struct KilnNormLoads {
    KilnRaw8<X_T> x[UNITS_PER_WARP];
    KilnRaw8<X_T> residual[HAS_RESIDUAL ? UNITS_PER_WARP : 1];
    KilnRaw8<X_T> gate[GATE == 1 ? UNITS_PER_WARP : 1];
};

// Issues every load of this warp's share of the segment at `base` (x zero where not valid, but
// for RMSNorm without a persistent grid).
__device__ __forceinline__ void kiln_norm_load(KilnNormLoads& in, const void* x, const void* residual,
                                               const void* gate, long long base, bool active, int n,
                                               int warp_in_row, int lane) {
    // x of the lane's first element of the segment, computed once for every unit (the empty asm
    // keeps ptxas from computing it again under each unit's predicate, 9 instructions at 4 units):
    // each unit's load is a constant offset from it (kiln_norm_off). Not for a persistent grid,
    // whose next group's loads then spill beside the current group (8 warps a row, INT8 / NVFP4).
    const void* x_first = static_cast<const unsigned char*>(x) + KILN_NORM_AT(base, 0) * (X_T == KILN_F32 ? 4 : 2);
    if (!PERSISTENT) asm volatile("" : "+l"(x_first));
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = kiln_norm_col(warp_in_row, u, lane);
        if (active && col < n) {
            in.x[u] = PERSISTENT ? kiln_raw8_load<X_T, true>(x, KILN_NORM_AT(base, u))
                                 : kiln_raw8_load<X_T, true>(x_first, kiln_norm_off(u));
            if (HAS_RESIDUAL) in.residual[HAS_RESIDUAL ? u : 0] = kiln_raw8_load<X_T, false>(residual, KILN_NORM_AT(base, u));
            if (GATE == 1) in.gate[GATE == 1 ? u : 0] = kiln_raw8_load<X_T, true>(gate, KILN_NORM_AT(base, u));
        } else if (KIND == 1 || PERSISTENT) {
            // LayerNorm's mean adds every unit's values; RMSNorm's squares of a unit past the
            // segment are zeros whatever x holds (kiln_norm_segment), so its registers stay as
            // they are, but for a persistent grid (left unset, the next group's registers
            // spilled on sm_90 at one warp a row with the int8 planes).
            kiln_raw8_zero<X_T>(in.x[u]);
        }
    }
}

#if STAGES
// A stage holds, for every thread, KILN_NORM_SLOTS pieces of 16 bytes: slot (u * streams +
// stream) * pieces + h is piece h of unit u of x (stream 0), the residual (1) and the gate before
// the norm (last); slot s of thread t is the stage's 16-byte element s * KILN_NORM_THREADS + t,
// so a warp's reads of one slot are 512 consecutive bytes.
#define KILN_NORM_PIECES (X_T == KILN_F32 ? 2 : 1)
#define KILN_NORM_STREAMS (1 + HAS_RESIDUAL + (GATE == 1 ? 1 : 0))
#define KILN_NORM_SLOTS (UNITS_PER_WARP * KILN_NORM_STREAMS * KILN_NORM_PIECES)

// Issues the cp.async copies of this thread's share of the segment at `base` into the stage
// whose slot 0 of this thread is at shared address `stage` (zeros where not valid: the copy
// reads nothing and fills the 16 bytes with zeros). No commit. Addresses are the row's, plus
// constants: a few instructions a copy.
__device__ __forceinline__ void kiln_norm_stage_issue(kiln_u32 stage, const void* x, const void* residual,
                                                      const void* gate, long long base, bool active, int n,
                                                      int warp_in_row, int lane) {
    // The lane's first column and each unit's constant offset from it (kiln_norm_col: the
    // 8-element layout or BLOCK_LANE's).
    const int first_col = kiln_norm_col(warp_in_row, 0, lane);
    const long long first = (base + first_col) * (X_T == KILN_F32 ? 4 : 2);
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const bool valid = active && first_col + kiln_norm_off(u) < n;
        // Past the segment nothing is read: the address is never dereferenced.
        const long long offset = first + (long long)kiln_norm_off(u) * (X_T == KILN_F32 ? 4 : 2);
#pragma unroll
        for (int stream = 0; stream < KILN_NORM_STREAMS; ++stream) {
            // Stream 1 is the residual when there is one, else the gate; the last is the gate.
            const void* source = stream == 0 ? x : (stream == 1 && HAS_RESIDUAL ? residual : gate);
#pragma unroll
            for (int h = 0; h < KILN_NORM_PIECES; ++h) {
                const int slot = (u * KILN_NORM_STREAMS + stream) * KILN_NORM_PIECES + h;
                kiln_cp_async_16(stage + slot * KILN_NORM_THREADS * 16,
                                 static_cast<const unsigned char*>(source) + offset + 16 * h, valid);
            }
        }
    }
}

// This thread's pieces of `stage` into registers, as kiln_norm_load leaves them.
__device__ __forceinline__ void kiln_norm_stage_read(KilnNormLoads& in, const uint4* stage) {
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
#pragma unroll
        for (int h = 0; h < KILN_NORM_PIECES; ++h) {
            const uint4* slot = stage + ((u * KILN_NORM_STREAMS) * KILN_NORM_PIECES + h) * KILN_NORM_THREADS + threadIdx.x;
            in.x[u].q[h] = slot[0];
            if (HAS_RESIDUAL) in.residual[HAS_RESIDUAL ? u : 0].q[h] = slot[KILN_NORM_PIECES * KILN_NORM_THREADS];
            if (GATE == 1) {
                in.gate[GATE == 1 ? u : 0].q[h] = slot[(KILN_NORM_STREAMS - 1) * KILN_NORM_PIECES * KILN_NORM_THREADS];
            }
        }
    }
}
#endif

// The weight (and bias) units of the segment whose weight row starts at `wbase`.
__device__ __forceinline__ void kiln_norm_load_weight(KilnRaw8<W_T> (&wr)[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1],
                                                      KilnRaw8<W_T> (&br)[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1],
                                                      const void* weight, const void* bias, long long wbase, int n,
                                                      int warp_in_row, int lane) {
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = kiln_norm_col(warp_in_row, u, lane);
        if (col < n) {
            if (EARLY_WEIGHT && WEIGHT != 2) wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0] = kiln_raw8_load<W_T, false>(weight, KILN_NORM_AT(wbase, u));
            if (EARLY_WEIGHT && HAS_BIAS) br[EARLY_WEIGHT && HAS_BIAS ? u : 0] = kiln_raw8_load<W_T, false>(bias, KILN_NORM_AT(wbase, u));
        }
    }
}

// WEIGHT_AHEAD (optional, 0 by default) 1, without EARLY_WEIGHT: the output loop loads the weight
// (and bias) of register unit u + 1 before it computes unit u, so that each unit's weight is in
// registers when the unit needs it: otherwise each unit's load sits inside the unit's branch, after
// the previous unit's stores, and the loads of a warp's units wait one after the other (8 round
// trips to L1 or L2 at 8 units a warp). Costs the registers of one unit of weight and bias.
#ifndef WEIGHT_AHEAD
#define WEIGHT_AHEAD 0
#endif
#if WEIGHT_AHEAD && EARLY_WEIGHT
#error "WEIGHT_AHEAD loads the weight one unit ahead; EARLY_WEIGHT holds it all already"
#endif

// The weight and bias of register unit u (past the segment's end: nothing read, the registers
// keep what they held, unused).
__device__ __forceinline__ void kiln_norm_weight_ahead(KilnRaw8<W_T>& w, KilnRaw8<W_T>& b, const void* weight,
                                                       const void* bias, long long wbase, int n, int warp_in_row,
                                                       int lane, int u) {
    if (kiln_norm_col(warp_in_row, u, lane) < n) {
        if (WEIGHT != 2) w = kiln_raw8_load<W_T, false>(weight, KILN_NORM_AT(wbase, u));
        if (HAS_BIAS) b = kiln_raw8_load<W_T, false>(bias, KILN_NORM_AT(wbase, u));
    }
}

// The early weight and bias units as fp32 values (1 + w for WEIGHT 1), for KILN_NORM_WF.
__device__ __forceinline__ void kiln_norm_weight_values(
    const KilnRaw8<W_T> (&wr)[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1],
    const KilnRaw8<W_T> (&br)[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1],
    float (&wf)[KILN_NORM_WF && WEIGHT != 2 ? UNITS_PER_WARP : 1][8],
    float (&bf)[KILN_NORM_WF && HAS_BIAS ? UNITS_PER_WARP : 1][8]) {
    if constexpr (KILN_NORM_WF) {
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) {
            if (WEIGHT != 2) {
                float w[8];
                kiln_raw8_unpack<W_T>(wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0], w);
#pragma unroll
                for (int k = 0; k < 8; ++k) wf[KILN_NORM_WF && WEIGHT != 2 ? u : 0][k] = WEIGHT == 1 ? 1.0f + w[k] : w[k];
            }
            if (HAS_BIAS) kiln_raw8_unpack<W_T>(br[EARLY_WEIGHT && HAS_BIAS ? u : 0], bf[KILN_NORM_WF && HAS_BIAS ? u : 0]);
        }
    }
}

#ifndef I8_SECOND_INT
#define I8_SECOND_INT 0
#endif
#if I8_PLANES
// I8_PLANES = 1 (fp32 output, one group, n a multiple of 128): the output y is also written as
// the integer-path matrix products take x (`kernels/linear_i8.cu`, `kiln_linear_i8_quantize`)
// into `planes`, with the same operations in the same order, so that the products need no
// rounding launch of their own: per block of 32 values, d1 = amax / 127, q = rn(y 127 / amax),
// rest = rn((y - d1 q) 254 127 / amax), the two int8 planes and (d1 / 254, second), where second
// is the block's integer sum 254 sum q + sum rest (I8_SECOND_INT, for Q4_0 weights) or its float
// sum, added quad by quad as the rounding launch adds them. A lane holds 8 values (two quads) of a
// block; a block is 4 lanes.
__device__ __forceinline__ int kiln_norm_i8_round(float v, float inv) {
    const int q = __float2int_rn(v * inv);
    return max(-127, min(127, q));
}

__device__ __forceinline__ void kiln_norm_i8_planes(const float (&p)[8], void* planes, long long token,
                                                    long long tokens, int col, int n, bool valid) {
    const int units = n >> 7;
    float m = fmaxf(fmaxf(fmaxf(fabsf(p[0]), fabsf(p[1])), fmaxf(fabsf(p[2]), fabsf(p[3]))),
                    fmaxf(fmaxf(fabsf(p[4]), fabsf(p[5])), fmaxf(fabsf(p[6]), fabsf(p[7]))));
    float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    }
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    const float d1 = m / 127.0f;
    const float inv2 = 254.0f * inv;
    int q[8], r[8];
    int qs = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        q[k] = kiln_norm_i8_round(p[k], inv);
        r[k] = kiln_norm_i8_round(__fmaf_rn(-d1, (float)q[k], p[k]), inv2);  // as linear_i8.cu rounds it
        qs += 254 * q[k] + r[k];
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) qs += __shfl_xor_sync(0xFFFFFFFFu, qs, o);
    if (!valid) return;
    const uint2 planes_q = make_uint2(kiln_bytes4(q[0], q[1], q[2], q[3]), kiln_bytes4(q[4], q[5], q[6], q[7]));
    const uint2 planes_r = make_uint2(kiln_bytes4(r[0], r[1], r[2], r[3]), kiln_bytes4(r[4], r[5], r[6], r[7]));
    // Quads v, v + 1 (v = col / 4, even): words v & 3, v & 3 + 1 of 16-byte chunk c = col / 16,
    // chunk j = c % 8 of unit u = c / 8.
    const int v = col >> 2, c = v >> 2, u = c >> 3, j = c & 7;
    unsigned int* xw = static_cast<unsigned int*>(planes);
    const long long first = ((token * 8 + j) * units + u) * 4 + (v & 3);
    const long long second = (((tokens + token) * 8 + j) * units + u) * 4 + (v & 3);
    *reinterpret_cast<uint2*>(xw + first) = planes_q;
    *reinterpret_cast<uint2*>(xw + second) = planes_r;
    if ((v & 7) == 0) {
        const int b = v >> 3;
        float2* xs = reinterpret_cast<float2*>(xw + 2 * tokens * 8 * units * 4);
#if I8_SECOND_INT
        const float sum = __int_as_float(qs);
#else
        const float sum = s;
#endif
        xs[(token * 4 + (b & 3)) * units + (b >> 2)] = make_float2(d1 * (1.0f / 254.0f), sum);
    }
}
#endif

#if BLOCK_LANE && KILN_NORM_BLOCKED
// The INT8 or NVFP4 codes and scale of one block of 16 values y (BLOCK_LANE: one lane's), stored
// at `codes_at` (16 bytes of INT8 or 8 of E2M1) and `scale_at` (an fp32 or E4M3 scale): the fast
// paths and checks of the two-lane blocks (kiln_norm_segment), with the block maximum, the scale
// and its store once for 16 values, and the codes in one store.
// The largest |y| of a block of 16 values, NaN when any value is (the reference's maximum skips
// NaN: the slow path takes it again).
__device__ __forceinline__ float kiln_block16_amax(const float (&y)[16]) {
    float m8[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) m8[k] = kiln_max_nan(fabsf(y[k]), fabsf(y[k + 8]));
#pragma unroll
    for (int k = 0; k < 4; ++k) m8[k] = kiln_max_nan(m8[k], m8[k + 4]);
    return kiln_max_nan(kiln_max_nan(m8[0], m8[2]), kiln_max_nan(m8[1], m8[3]));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 860
// The same maximum from the block's 16 values as 8 packed pairs of bf16 (the values y holds,
// exactly): `max.NaN.xorsign.abs.bf16x2` takes the larger magnitude of each pair of pairs (a
// canonical NaN when either is NaN; the sign it gives is dropped at the end), 7 of them and 3 to
// finish where the fp32 values take 15 (sm_86 and later). NVFP4 with 8 units a warp or more (the
// 8192 default): elsewhere the packed pairs held beside the fp32 values spilled (INT8 at 8 units
// a warp, NVFP4 at 4 under the 64-register bound).
__device__ __forceinline__ unsigned int kiln_bf16x2_max_abs(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ float kiln_bf16x16_amax(const unsigned int (&q)[8]) {
    const unsigned int m = kiln_bf16x2_max_abs(
        kiln_bf16x2_max_abs(kiln_bf16x2_max_abs(q[0], q[4]), kiln_bf16x2_max_abs(q[2], q[6])),
        kiln_bf16x2_max_abs(kiln_bf16x2_max_abs(q[1], q[5]), kiln_bf16x2_max_abs(q[3], q[7])));
    return kiln_max_nan(fabsf(__uint_as_float(m << 16)), fabsf(__uint_as_float(m & 0xFFFF0000u)));
}
#define KILN_NORM_PACKED_AMAX (OUT_T == KILN_OUT_NVFP4 && UNITS_PER_WARP >= 8)
#else
#define KILN_NORM_PACKED_AMAX 0
#endif

// qscale where it is in the NVFP4 fast path's range, NaN otherwise: once a segment, so that each
// block checks only its scaled maximum.
__device__ __forceinline__ float kiln_nvfp4_qscale_fast(float qscale) {
    return qscale >= KILN_NVFP4_QSCALE_LO && qscale <= KILN_NVFP4_QSCALE_HI ? qscale : __int_as_float(0x7FC00000);
}

// `amax`: kiln_block16_amax(y); `qscale_fast`: kiln_nvfp4_qscale_fast(qscale) (NVFP4).
__device__ __forceinline__ void kiln_norm_block16(const float (&y)[16], float amax, unsigned char* codes_at,
                                                  unsigned char* scale_at, float qscale, float qscale_fast) {
    // The maximum without NaN values, as the reference takes it (slow paths only).
    auto reference_amax = [&]() {
        float m = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) m = fmaxf(m, fabsf(y[k]));
        return m;
    };
    if (OUT_T == KILN_OUT_INT8) {
        // amax / 127 exactly where amax is in kiln_div_const's range; then 1 / scale is a
        // normal float, |y / scale| <= 127 (1 + 2^-23) and each code one fused multiply-add. An
        // amax out of range (0, NaN, infinite, tiny or huge) goes the reference's way.
        const bool normal = amax >= KILN_DIV_RANGE_LO && amax <= KILN_DIV_RANGE_HI;
        unsigned int w[4];
        float scale;
        if (normal) {
            scale = kiln_div_const(amax, 127.0f, __uint_as_float(0x3C010204u));
            const float inverse = kiln_rcp_rn(scale);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                w[j] = kiln_bytes4(kiln_int8_fast(y[4 * j], inverse), kiln_int8_fast(y[4 * j + 1], inverse),
                                   kiln_int8_fast(y[4 * j + 2], inverse), kiln_int8_fast(y[4 * j + 3], inverse));
            }
        } else {
            scale = (amax != amax ? reference_amax() : amax) / 127.0f;
            unsigned int q[16];
            kiln_int8_codes<16>(y, scale, q);
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = kiln_bytes4(q[4 * j], q[4 * j + 1], q[4 * j + 2], q[4 * j + 3]);
        }
        *reinterpret_cast<uint4*>(codes_at) = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<float*>(scale_at) = scale;
    } else {
        // The fast path's conditions: see KILN_NVFP4_SCALED_LO (1 / 6 is 0x3E2AAAAB). qscale_fast
        // is qscale where it is in the fast path's range, NaN otherwise (kiln_nvfp4_qscale_fast),
        // so that its check is the scaled value's (NaN fails both comparisons).
        const float scaled = kiln_div_const(amax, 6.0f, __uint_as_float(0x3E2AAAABu)) * qscale_fast;
        // Each path stores its own results (no merge of the two paths' registers before a
        // shared store).
        if (scaled >= KILN_NVFP4_SCALED_LO && scaled <= 448.0f) {
            const unsigned int s = kiln_e4m3x2(scaled, 0.0f);  // e4m3(0) = 0 above the code: no mask
            const float inverse = kiln_nvfp4_inverse(qscale_fast, kiln_e4m3_value(s));
            const float twice = inverse * 2.0f;
            unsigned int c[2][8];
#pragma unroll
            for (int k = 0; k < 16; ++k) c[k >> 3][k & 7] = kiln_e2m1_product(y[k], twice, inverse);
            const float(&lo)[8] = *reinterpret_cast<const float(*)[8]>(&y[0]);
            const float(&hi)[8] = *reinterpret_cast<const float(*)[8]>(&y[8]);
            // The signs of y are those of y * inverse (inverse > 0).
            *reinterpret_cast<uint2*>(codes_at) = make_uint2(kiln_e2m1_pack8(c[0], lo), kiln_e2m1_pack8(c[1], hi));
            *scale_at = (unsigned char)s;
            return;
        }
        // The reference's way: its maximum (NaN skipped), scale, division and codes.
        const float m = amax != amax ? reference_amax() : amax;
        const unsigned int s = kiln_e4m3x2((m / 6.0f) * qscale, 0.0f);
        const float inverse = qscale / kiln_e4m3_value(s);
        unsigned int word[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; ++k) word[k >> 3] |= kiln_e2m1_of_product(y[k], inverse) << (4 * (k & 7));
        *reinterpret_cast<uint2*>(codes_at) = make_uint2(word[0], word[1]);
        *scale_at = (unsigned char)s;
    }
}
#endif

// Normalizes one segment from its loads and writes its outputs. `sums` holds the block's two
// rows of unit sums for this group (alternate groups use alternate pairs, so that a warp ahead
// by one group never writes sums another warp still reads).
__device__ __forceinline__ void kiln_norm_segment(
    KilnNormLoads& in, KilnRaw8<W_T> (&wr)[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1],
    KilnRaw8<W_T> (&br)[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1],
    const float (&wf)[KILN_NORM_WF && WEIGHT != 2 ? UNITS_PER_WARP : 1][8],
    const float (&bf)[KILN_NORM_WF && HAS_BIAS ? UNITS_PER_WARP : 1][8], void* residual, const void* __restrict__ weight,
    const void* __restrict__ bias, const void* __restrict__ gate, void* __restrict__ out, void* __restrict__ scales,
    float eps, float qscale, long long base, long long wbase, bool active, int n, int units, int warp_in_row,
    int lane, float* mean_sums, float* square_sums, long long i8_tokens) {
    // x as loaded (KILN_NORM_RAW), or as fp32 values after the gate.
    KilnRaw8<X_T>(&xr)[UNITS_PER_WARP] = in.x;
    float xv[KILN_NORM_RAW ? 1 : UNITS_PER_WARP][8];
#define KILN_NORM_X(u) xr[(u)]
#define KILN_NORM_XV(u) xv[KILN_NORM_RAW ? 0 : (u)]
    if (!KILN_NORM_RAW) {
#pragma unroll
        for (int u = 0; u < UNITS_PER_WARP; ++u) kiln_raw8_unpack<X_T>(xr[u], KILN_NORM_XV(u));
    }
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = kiln_norm_col(warp_in_row, u, lane);
        if (!(active && col < n)) continue;
        if (HAS_RESIDUAL) {
            float a[8], r[8];
            if (KILN_NORM_RAW) kiln_raw8_unpack<X_T>(KILN_NORM_X(u), a);
            else {
#pragma unroll
                for (int k = 0; k < 8; ++k) a[k] = KILN_NORM_XV(u)[k];
            }
            kiln_raw8_unpack<X_T>(in.residual[HAS_RESIDUAL ? u : 0], r);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] = a[k] + r[k];
            KilnRaw8<X_T> packed;
            kiln_raw8_pack<X_T>(a, packed);
            kiln_raw8_store<X_T>(residual, KILN_NORM_AT(base, u), packed);
            if (KILN_NORM_RAW) KILN_NORM_X(u) = packed;
            else kiln_raw8_unpack<X_T>(packed, KILN_NORM_XV(u));
        }
        if (GATE == 1) {
            float z[8];
            kiln_raw8_unpack<X_T>(in.gate[GATE == 1 ? u : 0], z);
#pragma unroll
            for (int k = 0; k < 8; ++k) KILN_NORM_XV(u)[k] = KILN_NORM_XV(u)[k] * kiln_silu(z[k]);
        }
    }
    // Unit u's values as fp32 (converted again at each use with many units, exact, so that only
    // the raw bits stay live across the reductions).
#define KILN_NORM_VALUES(u, a)                                                   \
    float a[8];                                                                  \
    if (KILN_NORM_RAW) {                                                         \
        kiln_raw8_unpack<X_T>(KILN_NORM_X(u), a);                                \
    } else {                                                                     \
        _Pragma("unroll") for (int k_ = 0; k_ < 8; ++k_) a[k_] = KILN_NORM_XV(u)[k_]; \
    }

#define KILN_NORM_RELOAD()                                                       \
    if (KILN_NORM_RAW && UNITS_PER_WARP > 4) {                                   \
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
        mean = kiln_norm_total(lane_sums, warp_in_row, units, mean_sums, [&](float t) { return t / (float)n; });
        KILN_NORM_RELOAD();
    }
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int col = kiln_norm_col(warp_in_row, u, lane);
        KILN_NORM_VALUES(u, a);
        float sq[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float d = KIND == 1 ? a[k] - mean : a[k];
            sq[k] = (active && col < n) ? d * d : 0.0f;
        }
        lane_sums[u] = kiln_lane_sum8(sq);
    }
    const float r = kiln_norm_total(lane_sums, warp_in_row, units, square_sums,
                                    [&](float t) { return 1.0f / sqrtf(t / (float)n + eps); });
    KILN_NORM_RELOAD();

    // BLOCK_LANE with a block-quantized output: the lane's 16 values of register units 2P, 2P + 1.
#if BLOCK_LANE && KILN_NORM_BLOCKED
    float p16[16];
    // Held in a register (the empty asm hides where it comes from: ptxas would otherwise load
    // qscale and check it again for each block).
    float qscale_fast = kiln_nvfp4_qscale_fast(qscale);
    if (OUT_T == KILN_OUT_NVFP4) asm volatile("" : "+f"(qscale_fast));
    // The same values as packed bf16 pairs, for the block maximum.
#define KILN_NORM_YQ16 (KILN_NORM_PACKED_AMAX && KILN_NORM_PACKED_Q)
#if KILN_NORM_YQ16
    unsigned int yq16[8];
#endif

    // The codes and scale of this lane's first block of the segment; every later block's are
    // constant offsets from them (kiln_norm_off is a multiple of 16). With 8 warps a row or more
    // they are computed here once (the empty asm keeps ptxas from computing both again for each
    // block, 9 instructions); with fewer, holding them spilled on sm_90 (4 warps, NVFP4).
    unsigned char* codes_first = static_cast<unsigned char*>(out) +
                                 (OUT_T == KILN_OUT_INT8 ? KILN_NORM_AT(base, 0) : KILN_NORM_AT(base, 0) >> 1);
    unsigned char* scales_first =
        static_cast<unsigned char*>(scales) + (KILN_NORM_AT(base, 0) >> 4) * (OUT_T == KILN_OUT_INT8 ? 4 : 1);
    if (WARPS_PER_ROW >= 8) asm volatile("" : "+l"(codes_first), "+l"(scales_first));
    // Global memory still (the asm hides where they point): global stores, not generic ones.
    __builtin_assume(__isGlobal(codes_first) && __isGlobal(scales_first));
#endif
#if WEIGHT_AHEAD
    // The weight and bias of the next register unit, loaded one unit ahead (unit 0's here).
    KilnRaw8<W_T> w_ahead = {}, b_ahead = {};
    kiln_norm_weight_ahead(w_ahead, b_ahead, weight, bias, wbase, n, warp_in_row, lane, 0);
#endif
#pragma unroll
    for (int u = 0; u < UNITS_PER_WARP; ++u) {
        const int unit = warp_in_row + u * WARPS_PER_ROW;
        const int col = kiln_norm_col(warp_in_row, u, lane);
#if WEIGHT_AHEAD
        const KilnRaw8<W_T> w_unit = w_ahead, b_unit = b_ahead;
        if (u + 1 < UNITS_PER_WARP) {
            kiln_norm_weight_ahead(w_ahead, b_ahead, weight, bias, wbase, n, warp_in_row, lane, u + 1);
        }
#define KILN_NORM_W_UNIT(u) w_unit
#define KILN_NORM_B_UNIT(u) b_unit
#else
#define KILN_NORM_W_UNIT(u) kiln_raw8_load<W_T, false>(weight, KILN_NORM_AT(wbase, u))
#define KILN_NORM_B_UNIT(u) kiln_raw8_load<W_T, false>(bias, KILN_NORM_AT(wbase, u))
#endif
        // Uniform across the warp. Blocked outputs go on with zeros, so that the shuffle of the
        // block maximum runs in every lane outside any branch (n is a multiple of 16 for them, so
        // the two lanes of a block agree on `valid`).
        if (!KILN_NORM_BLOCKED && (BLOCK_LANE ? !(active && col < n) : (!active || unit >= units))) continue;
        const bool valid = KILN_NORM_BLOCKED ? active && col < n : col < n;
        // One block a lane: no shuffle below, so a lane past the segment leaves at once.
        if (BLOCK_LANE && KILN_NORM_BLOCKED && !valid) continue;
        if constexpr (KILN_NORM_PACKED_BF16) {
            if (valid) {
                const KilnRaw8<W_T> wraw = EARLY_WEIGHT ? wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0]
                                                        : KILN_NORM_W_UNIT(u);
                KILN_NORM_VALUES(u, a);
                KilnRaw8<W_T> y;
                y.q[0] = kiln_norm_packed_product(a, r, wraw.q[0]);
                kiln_raw8_store<W_T>(out, KILN_NORM_AT(base, u), y);
            }
        } else {
        float p[8];
        if (KILN_NORM_PACKED_Q && valid) {
            // round(round(x * r) * w) as the packed float output's (KILN_NORM_PACKED_BF16), then
            // widened for the quantizer: no unpacked weight, no fp32 product, no second rounding.
            const KilnRaw8<W_T> wraw = EARLY_WEIGHT ? wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0] : KILN_NORM_W_UNIT(u);
            KILN_NORM_VALUES(u, a);
            KilnRaw8<KILN_BF16> y;
            y.q[0] = kiln_norm_packed_product(a, r, wraw.q[0]);
            kiln_raw8_unpack<KILN_BF16>(y, p);
#if KILN_NORM_YQ16
            yq16[(u & 1) * 4 + 0] = y.q[0].x;
            yq16[(u & 1) * 4 + 1] = y.q[0].y;
            yq16[(u & 1) * 4 + 2] = y.q[0].z;
            yq16[(u & 1) * 4 + 3] = y.q[0].w;
#endif
        } else if (valid) {
            // w: the weight's factor (w, or 1 + w); b: the bias.
            float w[8], b[8], z[8];
            if (WEIGHT != 2) {
                if (KILN_NORM_WF) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) w[k] = wf[KILN_NORM_WF && WEIGHT != 2 ? u : 0][k];
                } else {
                    if (EARLY_WEIGHT) kiln_raw8_unpack<W_T>(wr[EARLY_WEIGHT && WEIGHT != 2 ? u : 0], w);
                    else kiln_raw8_unpack<W_T>(KILN_NORM_W_UNIT(u), w);
                    if (WEIGHT == 1) {
#pragma unroll
                        for (int k = 0; k < 8; ++k) w[k] = 1.0f + w[k];
                    }
                }
            }
            if (HAS_BIAS) {
                if (KILN_NORM_WF) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) b[k] = bf[KILN_NORM_WF && HAS_BIAS ? u : 0][k];
                } else if (EARLY_WEIGHT) {
                    kiln_raw8_unpack<W_T>(br[EARLY_WEIGHT && HAS_BIAS ? u : 0], b);
                } else {
                    kiln_raw8_unpack<W_T>(KILN_NORM_B_UNIT(u), b);
                }
            }
            if (GATE == 2) kiln_raw8_unpack<X_T>(kiln_raw8_load<X_T, true>(gate, KILN_NORM_AT(base, u)), z);
            KILN_NORM_VALUES(u, a);
#pragma unroll
            for (int k = 0; k < 8; ++k) p[k] = (KIND == 1 ? a[k] - mean : a[k]) * r;
            if (HF_ROUNDING && BLOCK_LANE && X_T == KILN_BF16 &&
                UNITS_PER_WARP <= (OUT_T == KILN_OUT_NVFP4 ? 4 : 8)) {
#pragma unroll
                for (int k = 0; k < 8; ++k) p[k] = kiln_round_bf16(p[k]);
            } else if (HF_ROUNDING) {
#pragma unroll
                for (int k = 0; k < 8; k += 2) kiln_round2<X_T>(p[k], p[k + 1]);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float q = p[k];
                if (WEIGHT != 2) q = q * w[k];
                if (HAS_BIAS) q = q + b[k];
                if (GATE == 2) q = q * kiln_silu(z[k]);
                p[k] = q;
            }
            // A quantized output with Hugging Face's rounding quantizes v rounded to x's type.
            if (HF_ROUNDING && OUT_T > KILN_BF16) {
#pragma unroll
                for (int k = 0; k < 8; k += 2) kiln_round2<X_T>(p[k], p[k + 1]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) p[k] = 0.0f;
        }
        if (OUT_T <= KILN_BF16) {
            if (valid) {
                KilnRaw8<(OUT_T <= KILN_BF16 ? OUT_T : KILN_F32)> packed;
                kiln_raw8_pack<(OUT_T <= KILN_BF16 ? OUT_T : KILN_F32)>(p, packed);
                kiln_raw8_store<(OUT_T <= KILN_BF16 ? OUT_T : KILN_F32)>(out, KILN_NORM_AT(base, u), packed);
            }
#if I8_PLANES
            kiln_norm_i8_planes(p, scales, base / n, i8_tokens, col, n, valid);
#endif
        } else if (OUT_T == KILN_OUT_FP8) {
            if (valid) {
                unsigned int e[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) e[k] = kiln_e4m3x2(p[2 * k] / qscale, p[2 * k + 1] / qscale);
                *reinterpret_cast<uint2*>(static_cast<unsigned char*>(out) + KILN_NORM_AT(base, u)) =
                    make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
            }
        } else if (BLOCK_LANE) {
#if BLOCK_LANE && KILN_NORM_BLOCKED
            // INT8 / NVFP4, one block a lane: its first half waits for the second.
#pragma unroll
            for (int k = 0; k < 8; ++k) p16[(u & 1) * 8 + k] = p[k];
            if ((u & 1) == 0) continue;
#if KILN_NORM_YQ16
            const float amax = kiln_bf16x16_amax(yq16);
#else
            const float amax = kiln_block16_amax(p16);
#endif
            kiln_norm_block16(p16, amax, codes_first + kiln_norm_off(u - 1) / (OUT_T == KILN_OUT_INT8 ? 1 : 2),
                              scales_first + kiln_norm_off(u - 1) / 16 * (OUT_T == KILN_OUT_INT8 ? 4 : 1), qscale,
                              qscale_fast);
#endif
        } else {
            // INT8 / NVFP4: lanes 2i and 2i + 1 hold one block of 16 values.
            // NaN when any of the block's values is (the reference's maximum skips NaN, so such a
            // block takes the slow path, which takes that maximum again).
            float amax = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; ++k) amax = kiln_max_nan(amax, fabsf(p[k]));
            amax = kiln_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
            if (!valid) continue;
            const long long block = KILN_NORM_AT(base, u) >> 4;
            // Fast paths for the blocks whose maximum is in range (INT8: kiln_div_const's; NVFP4:
            // see KILN_NVFP4_SCALED_LO), the reference's operations otherwise.
            if (OUT_T == KILN_OUT_INT8) {
                // amax / 127 exactly where amax is in kiln_div_const's range (1 / 127 is
                // 0x3C010204); then 1 / scale is a normal float, |p / scale| <= 127 (1 + 2^-23)
                // and each code one fused multiply-add. An amax out of range (0, NaN, infinite,
                // tiny or huge) goes the reference's way.
                const bool normal = amax >= KILN_DIV_RANGE_LO && amax <= KILN_DIV_RANGE_HI;
                uint2 codes;
                float scale;
                if (normal) {
                    scale = kiln_div_const(amax, 127.0f, __uint_as_float(0x3C010204u));
                    const float inverse = kiln_rcp_rn(scale);
                    codes.x = kiln_bytes4(kiln_int8_fast(p[0], inverse), kiln_int8_fast(p[1], inverse),
                                          kiln_int8_fast(p[2], inverse), kiln_int8_fast(p[3], inverse));
                    codes.y = kiln_bytes4(kiln_int8_fast(p[4], inverse), kiln_int8_fast(p[5], inverse),
                                          kiln_int8_fast(p[6], inverse), kiln_int8_fast(p[7], inverse));
                } else {
                    if (amax != amax) {
                        // Both lanes of the block are here (they share amax): the maximum
                        // without the NaN values, as the reference takes it.
                        float m = 0.0f;
#pragma unroll
                        for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(p[k]));
                        m = fmaxf(m, __shfl_xor_sync(3u << (lane & 30), m, 1));
                        scale = m / 127.0f;
                    } else {
                        scale = amax / 127.0f;
                    }
                    unsigned int q[8];
                    kiln_int8_codes<8>(p, scale, q);
                    codes = make_uint2(kiln_bytes4(q[0], q[1], q[2], q[3]), kiln_bytes4(q[4], q[5], q[6], q[7]));
                }
                *reinterpret_cast<uint2*>(static_cast<signed char*>(out) + KILN_NORM_AT(base, u)) = codes;
                if ((lane & 1) == 0) static_cast<float*>(scales)[block] = scale;
            } else {
                // The fast path's conditions: see KILN_NVFP4_SCALED_LO (1 / 6 is 0x3E2AAAAB). Both
                // lanes of a block take the same path (they share amax).
                const float scaled = kiln_div_const(amax, 6.0f, __uint_as_float(0x3E2AAAABu)) * qscale;
                unsigned int s = kiln_e4m3x2(scaled, 0.0f);  // e4m3(0) = 0 above the code: no mask
                unsigned int packed;
                if (qscale >= KILN_NVFP4_QSCALE_LO && qscale <= KILN_NVFP4_QSCALE_HI &&
                    scaled >= KILN_NVFP4_SCALED_LO && scaled <= 448.0f) {
                    const float inverse = kiln_nvfp4_inverse(qscale, kiln_e4m3_value(s));
                    const float twice = inverse * 2.0f;
                    unsigned int c[8];
#pragma unroll
                    for (int k = 0; k < 8; ++k) c[k] = kiln_e2m1_product(p[k], twice, inverse);
                    // The signs of p are those of p * inverse (inverse > 0).
                    packed = kiln_e2m1_pack8(c, p);
                } else {
                    // The reference's way: its maximum (NaN skipped, from both lanes of the
                    // block), scale, division and codes.
                    float m = amax;
                    if (amax != amax) {
                        m = 0.0f;
#pragma unroll
                        for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(p[k]));
                        m = fmaxf(m, __shfl_xor_sync(3u << (lane & 30), m, 1));
                    }
                    s = kiln_e4m3x2((m / 6.0f) * qscale, 0.0f);
                    const float inverse = qscale / kiln_e4m3_value(s);
                    packed = 0;
#pragma unroll
                    for (int k = 0; k < 8; ++k) packed |= kiln_e2m1_of_product(p[k], inverse) << (4 * k);
                }
                *reinterpret_cast<unsigned int*>(static_cast<unsigned char*>(out) + (KILN_NORM_AT(base, u) >> 1)) = packed;
                if ((lane & 1) == 0) static_cast<unsigned char*>(scales)[block] = (unsigned char)s;
            }
        }
        }  // KILN_NORM_PACKED_BF16
    }
#undef KILN_NORM_W_UNIT
#undef KILN_NORM_B_UNIT
#undef KILN_NORM_X
#undef KILN_NORM_XV
#undef KILN_NORM_VALUES
#undef KILN_NORM_RELOAD
}

// With block-quantized outputs, registers for 1024 threads a multiprocessor (64 a thread), where
// the quantization's temporaries would otherwise cost a quarter of the resident warps; only where
// the inputs held fit beside them (RMSNorm, 4 warps a row or more, at most 4 units a warp of
// 2-byte x, no residual, gate, bias or early weight; not for a persistent grid, whose next
// group's loads and the INT8 or E2M1 codes' temporaries spill at 64), as a spill would cost more.
#if KILN_NORM_BLOCKED && KIND == 0 && WARPS_PER_ROW >= 4 && UNITS_PER_WARP <= 4 && X_T != KILN_F32 && \
    !HAS_RESIDUAL && GATE == 0 && !HAS_BIAS && !EARLY_WEIGHT && !PERSISTENT
#define KILN_NORM_BOUNDS __launch_bounds__(KILN_NORM_THREADS, (1024 / KILN_NORM_THREADS < 32 ? 1024 / KILN_NORM_THREADS : 32))
#elif KIND == 1 && !KILN_NORM_BLOCKED && UNITS_PER_WARP == 8 && WARPS_PER_ROW >= 4 && X_T != KILN_F32 && \
    OUT_T != KILN_F32 && WEIGHT != 2 && HAS_BIAS && !HAS_RESIDUAL && GATE == 0 && !HF_ROUNDING && \
    !EARLY_WEIGHT && !PERSISTENT && !STAGES
// LayerNorm with weight and bias, 2-byte x and output, holding 8 units a warp on 4 warps a row or
// more (bf16 at 8192: the default 4w1r): registers for 1024 threads a multiprocessor, 64 a
// thread, no spill on sm_90 (register allocation only: the same operations, the same bits). With
// a minimum of one block a multiprocessor (the next case) ptxas takes 168 since the exact grid
// (KILN_NORM_EXACT_GRID), 3 blocks a multiprocessor: 8192 x 8192 took 77.9 us on the H200 (81.3%
// of copy) against 72.1 at 87 registers before it. On an H100, 64 registers ran it in 92.1 us,
// 80 in 92.5, 128 in 93.3 and 168 in 95.0 (bench/results/2026-12-05-h200-ln). The other flavors
// spill at 64 (fp32 x or output, a residual, a gate, Llama's rounding, no bias, 16 units).
#define KILN_NORM_BOUNDS __launch_bounds__(KILN_NORM_THREADS, (1024 + KILN_NORM_THREADS - 1) / KILN_NORM_THREADS)
#elif KIND == 1 && !KILN_NORM_BLOCKED && UNITS_PER_WARP >= 8 && WARPS_PER_ROW >= 4 && !EARLY_WEIGHT && \
    !PERSISTENT && !STAGES
// LayerNorm's other flavors holding 8 units a warp or more on 4 warps a row or more: with the
// thread count alone sm_90's ptxas stops at 64 registers and spills 8 to 28 bytes (both totals,
// x, weight and bias); a minimum of one block a multiprocessor lets it take what it needs
// (register allocation only: the same operations, the same bits). Two warps a row (the default
// 2w1r at 4096) keep the thread count's bound: at 92 registers 2048 x 4096 took 13.7 us on the
// H200 against 11.4 at 64 with 12 bytes spilled (fewer resident warps;
// bench/results/2026-11-30-h200-evening, f1 against m1).
#define KILN_NORM_BOUNDS __launch_bounds__(KILN_NORM_THREADS, 1)
#elif I8_PLANES && I8_SECOND_INT && UNITS_PER_WARP >= 4 && !EARLY_WEIGHT
// The planes with Q4_0's integer block sums from 4 units a warp held (the engine's fp32 prefill
// default at 4096, 4w1r): with the thread count alone sm_90's ptxas stops at 64 registers and
// spills 4 bytes; a minimum of one block a multiprocessor lets it take 71, no spill (register
// allocation only: the same operations, the same bits).
#define KILN_NORM_BOUNDS __launch_bounds__(KILN_NORM_THREADS, 1)
#else
#define KILN_NORM_BOUNDS __launch_bounds__(KILN_NORM_THREADS)
#endif

extern "C" __global__ void KILN_NORM_BOUNDS
kiln_norm(const void* __restrict__ x, void* residual, const void* __restrict__ weight,
          const void* __restrict__ bias, const void* __restrict__ gate, void* __restrict__ out,
          void* __restrict__ scales, float eps, float qscale, long long segments, int n, int groups) {
#ifdef SEGMENT_N
    // The segment length as a compile-time constant (the launcher passes the same value as `n`,
    // see NormVariant::fixed_n): the bound checks, the units' count and the totals' loops over
    // a partial row fold away.
    n = SEGMENT_N;
#endif
    kiln_wait_prior();
    // [group parity][mean, squares][segment of the block][unit]
    __shared__ __align__(16) float shared_sums[PERSISTENT || STAGES ? 2 : 1][2][ROWS_PER_BLOCK]
                                              [WARPS_PER_ROW > 1 || BLOCK_LANE ? KILN_NORM_SUM_SLOTS : 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warp_in_row = warp % WARPS_PER_ROW;
    const int row_in_block = warp / WARPS_PER_ROW;
    const int units = (n + 255) >> 8;
    const long long row_groups = (segments + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;

#if STAGES
    // [stage][slot][thread], 16 bytes each (the launcher's dynamic shared memory).
    extern __shared__ __align__(16) uint4 kiln_norm_stages[];
    const int stage_elements = KILN_NORM_SLOTS * KILN_NORM_THREADS;
    // This thread's slot 0 of stage 0, as a shared address.
    const kiln_u32 stage0 = kiln_smem_address(kiln_norm_stages + threadIdx.x);
    // The first STAGES - 1 groups of this block, one commit group each (empty past the end, so
    // that the loop's wait always leaves the STAGES - 1 newest groups in flight).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        const long long g = blockIdx.x + (long long)s * gridDim.x;
        const long long sg = g * ROWS_PER_BLOCK + row_in_block;
        if (g < row_groups) {
            kiln_norm_stage_issue(stage0 + s * stage_elements * 16, x, residual, gate, sg * n, sg < segments, n,
                                  warp_in_row, lane);
        }
        kiln_cp_async_commit();
    }
    KilnRaw8<W_T> wr[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1];
    KilnRaw8<W_T> br[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1];
    float wf[KILN_NORM_WF && WEIGHT != 2 ? UNITS_PER_WARP : 1][8];
    float bf[KILN_NORM_WF && HAS_BIAS ? UNITS_PER_WARP : 1][8];
    if (EARLY_WEIGHT) {
        const long long sg = (long long)blockIdx.x * ROWS_PER_BLOCK + row_in_block;
        kiln_norm_load_weight(wr, br, weight, bias, groups == 1 ? 0 : (sg % groups) * n, n, warp_in_row, lane);
        kiln_norm_weight_values(wr, br, wf, bf);
    }
    int stage = 0, parity = 0;
    for (long long group = blockIdx.x; group < row_groups; group += gridDim.x) {
        const long long seg = group * ROWS_PER_BLOCK + row_in_block;
        // The group STAGES - 1 ahead goes into the stage this thread read back last time round.
        const long long ahead = group + (long long)(STAGES - 1) * gridDim.x;
        const long long ahead_seg = ahead * ROWS_PER_BLOCK + row_in_block;
        const int ahead_stage = stage == 0 ? STAGES - 1 : stage - 1;
        if (ahead < row_groups) {
            kiln_norm_stage_issue(stage0 + ahead_stage * stage_elements * 16, x, residual, gate, ahead_seg * n,
                                  ahead_seg < segments, n, warp_in_row, lane);
        }
        kiln_cp_async_commit();
        kiln_cp_async_wait<STAGES - 1>();
        KilnNormLoads current;
        kiln_norm_stage_read(current, kiln_norm_stages + stage * stage_elements);
        if (EARLY_WEIGHT && groups != 1 && group != blockIdx.x) {
            kiln_norm_load_weight(wr, br, weight, bias, (seg % groups) * n, n, warp_in_row, lane);
            kiln_norm_weight_values(wr, br, wf, bf);
        }
        kiln_norm_segment(current, wr, br, wf, bf, residual, weight, bias, gate, out, scales, eps, qscale, seg * n,
                          groups == 1 ? 0 : (seg % groups) * n, seg < segments, n, units, warp_in_row, lane,
                          shared_sums[parity][0][row_in_block], shared_sums[parity][1][row_in_block], segments);
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        parity ^= 1;
    }
#else
    long long group = blockIdx.x;
    long long seg = group * ROWS_PER_BLOCK + row_in_block;
    KilnNormLoads current;
    // A grid of one block a segment (KILN_NORM_EXACT_GRID): every block's segment exists, and the
    // checks of `active` fold away.
    kiln_norm_load(current, x, residual, gate, seg * n, KILN_NORM_EXACT_GRID || seg < segments, n, warp_in_row, lane);
    KilnRaw8<W_T> wr[EARLY_WEIGHT && WEIGHT != 2 ? UNITS_PER_WARP : 1];
    KilnRaw8<W_T> br[EARLY_WEIGHT && HAS_BIAS ? UNITS_PER_WARP : 1];
    if (EARLY_WEIGHT) {
        kiln_norm_load_weight(wr, br, weight, bias, groups == 1 ? 0 : (seg % groups) * n, n, warp_in_row, lane);
    }
    const float wf[1][8] = {}, bf[1][8] = {};  // unused (KILN_NORM_WF is 0 here)
    int parity = 0;
    for (;;) {
        const long long next_group = group + gridDim.x;
        const bool more = PERSISTENT && next_group < row_groups;
        const long long next_seg = next_group * ROWS_PER_BLOCK + row_in_block;
        KilnNormLoads next;
        if (more) kiln_norm_load(next, x, residual, gate, next_seg * n, next_seg < segments, n, warp_in_row, lane);
        float* sums = shared_sums[PERSISTENT ? parity : 0][0][row_in_block];
        kiln_norm_segment(current, wr, br, wf, bf, residual, weight, bias, gate, out, scales, eps, qscale, seg * n,
                          groups == 1 ? 0 : (seg % groups) * n, KILN_NORM_EXACT_GRID || seg < segments, n, units,
                          warp_in_row, lane, sums,
                          shared_sums[PERSISTENT ? parity : 0][1][row_in_block], segments);
        if (!more) break;
        current = next;
        group = next_group;
        seg = next_seg;
        parity ^= 1;
        if (EARLY_WEIGHT && groups != 1) {
            kiln_norm_load_weight(wr, br, weight, bias, (seg % groups) * n, n, warp_in_row, lane);
        }
    }
#endif
}
