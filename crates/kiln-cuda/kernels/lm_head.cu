// The LM head: logits[r][v] = epilogue(sum_j h[r][j] * W[v][j]) for ROWS rows (1..8), equal bit
// for bit to `kiln_core::ops::lm_head` for every WARPS / VROWS / tile.
//
// Memory floor: W read once (vocab * row_bytes), for all rows together; h (at most 8 x hidden
// fp32) stays in L2 and registers. At 151936 x 4096 bf16 that is 1.24 GB, about 300 us at
// 4.2 TB/s.
//
// Shape: a block owns tiles of `tile` consecutive vocabulary rows (a persistent grid-stride loop
// over tiles). Its WARPS warps split the hidden dimension in units of 256: warp w takes units w,
// w + WARPS, ...; for each, every lane keeps its eight h values of every row in registers and
// streams the tile's W rows, VROWS at a time with one 16-byte load each (bf16 / fp16), so VROWS
// loads per lane are in flight. A lane's eight elements make one chain, as `unit_dot_fma` in
// Rust: the first product rounded, then seven fused multiply-adds in order (`lm_chain8`, one
// FFMA per weight and row); the weights are decoded once per step for every row. The
// unit's sum over the warp uses the prelude's butterfly tree, computed for VSUB x ROWS (at most
// 32) sums at once by a transposed reduction (each step halves the sums a lane carries: 31 shuffles for 32
// sums instead of 160; each sum sees the same additions in the same tree). Unit sums go to
// shared memory and one thread per (row, token) adds them left to right, applies the epilogue,
// and writes the logit; with STATS the tile's largest logit and its lowest index, packed as
// `kiln_core::ops::lm_head::pack_argmax`, are written per (row, tile).
//
// XSLOT = 1 drops the two selects per shuffle of the transposed reduction: lane L keeps in its
// register k the sum of slot k ^ (L / (32 / SLOTS)) (it loads vocabulary row i ^ xi and holds h
// row r ^ xr in the registers of (i, r)), so at every step each lane keeps its lower half and
// sends its upper half, and its partner's upper half is the very slot of its own lower half.
// The sums are the same additions in the same tree; only which register holds which slot moves.
// PIPE = 1 issues the weight loads of the next step (next VROWS rows, or the next unit) before
// the products of the current one, so a warp keeps loads in flight while it computes (2-byte
// weights; quantized weights are decoded at the load either way).
//
// STAGES > 0 (without PIPE) takes the weights through a per-warp ring of STAGES steps
// in shared memory, filled by cp.async STAGES - 1 steps ahead of the products, so the bytes in
// flight are no longer bounded by registers, and the ring runs on across tiles, so the loads of
// the next tile are in flight while the block adds up the last one (the launcher sizes the grid
// to the resident blocks: persistent). Each lane copies and later reads only its own 16 bytes,
// so no lane waits for another. The producer keeps the next step's source address and moves it
// VROWS rows on per step; only steps in the last tile or a partial unit take the checked copy,
// where rows past the vocabulary and elements past `hidden` are copied as zeros (cp.async's
// source size 0). At 8 rows the instructions come close to the bytes: one
// FFMA per weight and row, one shift or mask per bf16 weight, and the butterfly's 31 SHFL + 31
// FADD per 32 unit sums, about 1.2 instructions per weight and row, which at 151936 x 4096 x 8
// rows is ~250 us of the H200's issue slots; the ring frees the registers of the next step's
// weights and keeps addressing off the products' path.
//
// COOP = 1 (on the ring) copies each step cooperatively: LPR = 32 / VROWS lanes copy one row of
// the step, lane l chunks l % LPR + j * LPR (j < VROWS) of row l / LPR, so each lane keeps a
// single source address, moved VROWS rows on per step, and every copy of a step is that address
// plus a constant; the step loop is unrolled by STAGES (tile / VROWS a multiple of STAGES, which
// the launcher checks), so ring slots are constants too, and each lane reads its 16 bytes of step
// row i (vocabulary row i ^ xi) at one of VROWS fixed offsets. A lane reads what other lanes
// copied: __syncwarp() after cp.async.wait_group orders their copies before its reads, and its
// reads of a slot before the next copies into it. The products and sums are those of the ring.
//
// Compile-time constants: ROWS (1..8), W_T (0 bf16, 1 fp16, 2 Q8_0, 3 Q4_0, 4 Q4_1), WARPS,
// VROWS (a power of two <= 16; reduced VSUB = min(VROWS, 32 / next_pow2(ROWS), VSUB_MAX) rows
// at a time), XSLOT, PIPE, STAGES (0, 2, 4, 8), MIN_BLOCKS (blocks a multiprocessor the registers
// must allow: 1, 2 or 4; two 8-warp blocks keep 16 warps resident while one of them adds up a
// tile), COOP (0 / 1), ROW_SCALE, SOFT_CAP, STATS (0 / 1), PBUF (1 / 2), SPLIT (0 / 1), TCDEC
// (0 / 1: the matrix-unit decode, see lm_decode), VSUB_MAX (a power of two, 16 by default).
// Compiled with --fmad=false; the fused operations (the chains, Q4_1's d * q + m) are explicit
// __fmaf_rn.

#ifndef ROWS
#define ROWS 1
#endif
#ifndef W_T
#define W_T 0
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef VROWS
#define VROWS 4
#endif
#ifndef XSLOT
#define XSLOT 0
#endif
#ifndef PIPE
#define PIPE 0
#endif
#ifndef STAGES
#define STAGES 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef COOP
#define COOP 0
#endif
#ifndef ROW_SCALE
#define ROW_SCALE 0
#endif
#ifndef SOFT_CAP
#define SOFT_CAP 0
#endif
#ifndef STATS
#define STATS 0
#endif
// TCDEC (0 or 1): 2-byte weights decoded by the matrix units (lm_decode); quantized weights as
// without it.
#ifndef TCDEC
#define TCDEC 0
#endif
// The matrix-unit decode's NaN check and its way back (lm_fix_nan).
#define LM_TC_FIX (TCDEC && (W_T == 0 || W_T == 1))
// PBUF (1 or 2): buffers of unit sums. With 2 (persistent grids), tile k's sums go to buffer
// k % 2, so a block needs one barrier a tile (before the sums are added up), not two: its warps
// go on to the next tile's steps while the slowest threads still add up the last one.
#ifndef PBUF
#define PBUF 1
#endif
static_assert(PBUF == 1 || (PBUF == 2 && STAGES > 0), "PBUF is 1, or 2 on the persistent ring (STAGES)");
// SPLIT (0 or 1, 1 by default; the cooperative ring): where a (tile, unit) needs no checked
// copies (all but the last tile and a partial unit), its steps but the last STAGES run in a loop
// of their own whose copies stay in that tile and unit, so its producer keeps no count and tests
// nothing a step; the other steps take the general producer, which moves on to the next tile or
// unit.
#ifndef SPLIT
#define SPLIT 1
#endif

#define ROWS_P2 (ROWS <= 1 ? 1 : (ROWS <= 2 ? 2 : (ROWS <= 4 ? 4 : 8)))
// A step's VROWS rows are reduced VSUB at a time: at most 32 sums per transposed reduction.
// VSUB_MAX (a power of two, 16 by default): at most this many of a step's rows reduced at once.
#ifndef VSUB_MAX
#define VSUB_MAX 16
#endif
#define VSUB_FIT (VROWS * ROWS_P2 <= 32 ? VROWS : 32 / ROWS_P2)
#define VSUB (VSUB_FIT < VSUB_MAX ? VSUB_FIT : VSUB_MAX)
#define SLOTS (VSUB * ROWS_P2)
#define GROUP (32 / SLOTS)
static_assert(ROWS >= 1 && ROWS <= 8, "ROWS must be 1..8");
static_assert(VROWS >= 1 && VROWS <= 16 && (VROWS & (VROWS - 1)) == 0, "VROWS must be a power of two <= 16");
static_assert(SLOTS <= 32 && (SLOTS & (SLOTS - 1)) == 0, "VSUB x next_pow2(ROWS) must be a power of two <= 32");
static_assert(STAGES == 0 || (STAGES >= 2 && (STAGES & (STAGES - 1)) == 0), "STAGES must be 0 or a power of two >= 2");
// The shared-memory ring of the STAGES path holds 2-byte weights; quantized ones are decoded at
// the load, straight into registers.
#define RING (STAGES > 0 && W_T <= 1)
static_assert(STAGES == 0 || PIPE == 0, "STAGES replaces PIPE");
static_assert(COOP == 0 || (STAGES > 0 && XSLOT == 1), "COOP runs on the ring with permuted slots");
// The ring with cooperative copies (COOP, 2-byte weights): see the header.
#define RING_COOP (RING && COOP)
// Lanes that copy one row of a step (each copies VROWS of the row's 32 chunks of 16 bytes).
#define LPR (32 / VROWS)

// 16 bytes streamed past L1 (W is read once).
__device__ __forceinline__ uint4 lm_load_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ kiln_u16 lm_load_u16(const kiln_u8* p) {
    return *reinterpret_cast<const kiln_u16*>(p);
}

// Elements e0 .. e0 + 8 of one weight row, in fp32, as `weight_element` in Rust.
__device__ __forceinline__ void lm_load_w8(const kiln_u8* row, int e0, float w[8]) {
#if W_T == 0 || W_T == 1
    uint4 q = lm_load_stream16(row + 2 * (long long)e0);
    kiln_u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if W_T == 0
        w[2 * k] = kiln_bf16_to_f32((kiln_u16)(words[k] & 0xFFFFu));
        w[2 * k + 1] = kiln_bf16_to_f32((kiln_u16)(words[k] >> 16));
#else
        w[2 * k] = kiln_f16_to_f32((kiln_u16)(words[k] & 0xFFFFu));
        w[2 * k + 1] = kiln_f16_to_f32((kiln_u16)(words[k] >> 16));
#endif
    }
#else
    const int block = e0 >> 5, k0 = e0 & 31;
#if W_T == 2
    const kiln_u8* base = row + 34 * (long long)block;
    const float d = kiln_f16_to_f32(lm_load_u16(base));
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        kiln_u16 pair = lm_load_u16(base + 2 + k0 + k);
        w[k] = __fmul_rn(d, (float)(signed char)(pair & 0xFF));
        w[k + 1] = __fmul_rn(d, (float)(signed char)(pair >> 8));
    }
#elif W_T == 3
    const kiln_u8* base = row + 18 * (long long)block;
    const float d = kiln_f16_to_f32(lm_load_u16(base));
    const int shift = k0 < 16 ? 0 : 4;
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
        kiln_u16 pair = lm_load_u16(base + 2 + (k0 & 15) + k);
        w[k] = __fmul_rn(d, __fsub_rn((float)((pair >> shift) & 0xF), 8.0f));
        w[k + 1] = __fmul_rn(d, __fsub_rn((float)((pair >> (8 + shift)) & 0xF), 8.0f));
    }
#elif W_T == 4
    const kiln_u8* base = row + 20 * (long long)block;
    const float d = kiln_f16_to_f32(lm_load_u16(base));
    const float m = kiln_f16_to_f32(lm_load_u16(base + 2));
    const int shift = k0 < 16 ? 0 : 4;
    const kiln_u32* q = reinterpret_cast<const kiln_u32*>(base + 4 + (k0 & 15));
    kiln_u32 words[2] = {q[0], q[1]};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        kiln_u32 byte = (words[k >> 2] >> (8 * (k & 3))) & 0xFFu;
        w[k] = __fmaf_rn(d, (float)((byte >> shift) & 0xFu), m);
    }
#else
#error "W_T must be 0..4"
#endif
#endif
}

// One step's weights of one vocabulary row for one lane: the raw 16 bytes of 2-byte weights
// (decoded at use), or the eight decoded values of quantized ones.
struct LmW {
#if W_T == 0 || W_T == 1
    uint4 q;
#else
    float w[8];
#endif
};

__device__ __forceinline__ void lm_fetch(const kiln_u8* row, int e0, LmW& out) {
#if W_T == 0 || W_T == 1
    out.q = lm_load_stream16(row + 2 * (long long)e0);
#else
    lm_load_w8(row, e0, out.w);
#endif
}

__device__ __forceinline__ void lm_zero(LmW& out) {
#if W_T == 0 || W_T == 1
    out.q = make_uint4(0u, 0u, 0u, 0u);
#else
#pragma unroll
    for (int k = 0; k < 8; ++k) out.w[k] = 0.0f;
#endif
}

// The matrix-unit decode (TCDEC, 2-byte weights): kiln_tc_widen4 widens a lane's eight weights in
// two instructions instead of eight shifts and masks. A non-finite weight can turn the other
// weights of its A row (the same vocabulary row, see lm_fetch_step's permutation) into NaN; a
// logit that comes out NaN is computed again the reference's way (lm_exact_sum), so the logits
// stay the reference's for every input (lm_fix_nan, after the block's last tile). `sel`: this
// lane's fragment of the identity (kiln_tc_identity).
#define LM_TC_T (W_T == 0 ? KILN_BF16 : KILN_F16)

// Elements e0 .. e0 + 8 in fp32, as `weight_element` in Rust (bf16: one shift or one mask per
// element, done once per step and shared by every row; TCDEC: two mma for the eight).
__device__ __forceinline__ void lm_decode(const LmW& in, float w[8], kiln_u32 sel) {
#if TCDEC && (W_T == 0 || W_T == 1)
    kiln_tc_widen4<LM_TC_T>(in.q.x, in.q.y, sel, w);
    kiln_tc_widen4<LM_TC_T>(in.q.z, in.q.w, sel, w + 4);
#elif W_T == 0 || W_T == 1
    (void)sel;
    const kiln_u32 words[4] = {in.q.x, in.q.y, in.q.z, in.q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if W_T == 0
        w[2 * k] = __uint_as_float(words[k] << 16);
        w[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
#else
        w[2 * k] = kiln_f16_to_f32((kiln_u16)(words[k] & 0xFFFFu));
        w[2 * k + 1] = kiln_f16_to_f32((kiln_u16)(words[k] >> 16));
#endif
    }
#else
    (void)sel;
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = in.w[k];
#endif
}

// One transposed step: C sums per lane become C / 2, exchanged with the lane at distance O.
template <int C, int O>
struct LmTransposedStep {
    static __device__ __forceinline__ void run(float* s, int lane) {
#if XSLOT
        // Registers hold permuted slots (see the header): keep the lower half, send the upper.
#pragma unroll
        for (int k = 0; k < C / 2; ++k) {
            s[k] = s[k] + __shfl_xor_sync(KILN_FULL_MASK, s[k + C / 2], O);
        }
#else
        const bool upper = (lane & O) != 0;
#pragma unroll
        for (int k = 0; k < C / 2; ++k) {
            const float send = upper ? s[k] : s[k + C / 2];
            const float keep = upper ? s[k + C / 2] : s[k];
            s[k] = keep + __shfl_xor_sync(KILN_FULL_MASK, send, O);
        }
#endif
        LmTransposedStep<C / 2, O / 2>::run(s, lane);
    }
};
template <int O>
struct LmTransposedStep<1, O> {
    static __device__ __forceinline__ void run(float*, int) {}
};

// The sums of N values across the warp, each by the prelude's butterfly tree (distances 16, 8,
// 4, 2, 1). The first log2(N) steps are transposed: a lane sends half of its sums to its partner
// and adds the partner's half to the half it keeps, so after them each lane carries one sum,
// number lane / (32 / N) (with XSLOT, the lanes' registers start permuted so that no select is
// needed; the slot each lane ends with is the same); the remaining distances are a plain butterfly. Returns that sum.
template <int N>
__device__ __forceinline__ float lm_reduce_slots(float (&s)[N], int lane) {
    LmTransposedStep<N, 16>::run(s, lane);
    float v = s[0];
#pragma unroll
    for (int o = 16 / N; o > 0; o >>= 1) {
        v += __shfl_xor_sync(KILN_FULL_MASK, v, o);
    }
    return v;
}

// One step's weights: vocabulary rows v0 + i0 + (i ^ xi) for i < VROWS, unit u, this lane's
// eight elements (zeros past the vocabulary or the hidden dimension).
__device__ __forceinline__ void lm_fetch_step(const kiln_u8* __restrict__ weights, long long row_bytes,
                                              long long vocab, int hidden, long long v0, int u, int i0,
                                              int lane, int xi, LmW (&dst)[VROWS]) {
    const int e0 = u * 256 + lane * 8;
#pragma unroll
    for (int i = 0; i < VROWS; ++i) {
        const long long v = v0 + i0 + (i ^ xi);
        if (e0 < hidden && v < vocab) {
            lm_fetch(weights + v * row_bytes, e0, dst[i]);
        } else {
            lm_zero(dst[i]);
        }
    }
}

// This lane's eight h values of unit u: register row r holds h row r ^ xr (zeros past ROWS or
// the hidden dimension).
__device__ __forceinline__ void lm_load_h(const float* __restrict__ h, int hidden, int u, int lane, int xr,
                                          float (&hv)[ROWS_P2][8]) {
    const int e0 = u * 256 + lane * 8;
#pragma unroll
    for (int r = 0; r < ROWS_P2; ++r) {
        const int hr = r ^ xr;
        if (e0 < hidden && hr < ROWS) {
            const float4* p = reinterpret_cast<const float4*>(h + (long long)hr * hidden + e0);
            const float4 a = p[0], b = p[1];
            hv[r][0] = a.x; hv[r][1] = a.y; hv[r][2] = a.z; hv[r][3] = a.w;
            hv[r][4] = b.x; hv[r][5] = b.y; hv[r][6] = b.z; hv[r][7] = b.w;
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) hv[r][k] = 0.0f;
        }
    }
}

// Kiln's tanh, as `tanh_poly` in Rust.
__device__ __forceinline__ float lm_tanh_poly(float x) {
    const float a = fabsf(x);
    if (a < 0.25f) {
        const float x2 = x * x;
        float p = __uint_as_float(0xbc11371bu);
        p = __fmaf_rn(p, x2, __uint_as_float(0x3cb327a4u));
        p = __fmaf_rn(p, x2, __uint_as_float(0xbd5d0dd1u));
        p = __fmaf_rn(p, x2, __uint_as_float(0x3e088889u));
        p = __fmaf_rn(p, x2, __uint_as_float(0xbeaaaaabu));
        return __fmaf_rn(x * x2, p, x);
    }
    const float t = 1.0f - 2.0f / (kiln_exp_poly(a + a) + 1.0f);
    return x < 0.0f ? -t : t;
}

// As `order_key` in Rust: monotone in the value, NaN lowest (0), -0 equal to +0.
__device__ __forceinline__ kiln_u32 lm_order_key(float y) {
    if (y != y) return 0u;
    kiln_u32 bits = y == 0.0f ? 0u : __float_as_uint(y);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// One lane's chain over its eight elements, as `unit_dot_fma` in Rust: the first product
// rounded, then seven fused multiply-adds in order (explicit, so nothing can reassociate).
__device__ __forceinline__ float lm_chain8(const float (&x)[8], const float (&w)[8]) {
    float acc = __fmul_rn(x[0], w[0]);
#pragma unroll
    for (int k = 1; k < 8; ++k) acc = __fmaf_rn(x[k], w[k], acc);
    return acc;
}

// One step: the chains of VROWS weight rows with every h row and the warp's unit sums, written
// to out[r * stride + i] for the step's token i and row r; VSUB rows per reduction. (Every step
// lies inside its tile: the tile is a multiple of VROWS, which the launcher checks.)
__device__ __forceinline__ void lm_step(const LmW (&cur)[VROWS], const float (&hv)[ROWS_P2][8], int lane,
                                        float* out, int stride, kiln_u32 sel) {
#pragma unroll
    for (int c = 0; c < VROWS / VSUB; ++c) {
        float s[SLOTS];
#pragma unroll
        for (int i = 0; i < VSUB; ++i) {
            float wv[8];
            lm_decode(cur[c * VSUB + i], wv, sel);
#pragma unroll
            for (int r = 0; r < ROWS_P2; ++r) {
                s[i * ROWS_P2 + r] = (XSLOT || r < ROWS) ? lm_chain8(hv[r], wv) : 0.0f;
            }
        }
        const float sum = lm_reduce_slots<SLOTS>(s, lane);
        if ((lane & (GROUP - 1)) == 0) {
            const int j = lane / GROUP;
            const int i = c * VSUB + j / ROWS_P2, r = j % ROWS_P2;
            if (r < ROWS) out[r * stride + i] = sum;
        }
    }
}

#if LM_TC_FIX
// One lane position's chain of unit u the reference's way (zeros past `hidden`): lm_chain8's
// first product rounded, then seven fused multiply-adds, in a rolled loop (lm_chain8's unrolled
// one here costs the streaming loop 12 instructions a step at 2 stages: ptxas gives it the
// registers this path would take).
__device__ __forceinline__ float lm_exact_chain(const float* __restrict__ x, const kiln_u16* __restrict__ w,
                                                int hidden, int e0) {
    float acc = 0.0f;
#pragma unroll 1
    for (int k = 0; k < 8; ++k) {
        const bool inside = e0 + k < hidden;
        const float xk = inside ? x[e0 + k] : 0.0f;
        const float wk = inside ? (W_T == 0 ? kiln_bf16_to_f32(w[e0 + k]) : kiln_f16_to_f32(w[e0 + k])) : 0.0f;
        acc = k == 0 ? __fmul_rn(xk, wk) : __fmaf_rn(xk, wk, acc);
    }
    return acc;
}

// The dot product of h row `hr` with vocabulary row `v` the reference's way, in one thread (the
// matrix-unit decode's way back when a logit comes out NaN, see lm_decode): per unit the 32
// chains of eight and the prelude's butterfly tree, then the unit sums left to right from +0.
// The tree's sum at distance d adds slots p and p + d (which the lanes p and p ^ d both
// compute), so the sum over the positions = q mod S is the sum over q mod 2S plus the sum over
// q + S mod 2S: with p = i0 + 2 i1 + 4 i2 + 8 i3 + 16 i4, the innermost loop adds over i4
// first. Rolled loops keep the registers few (this is not the fast path).
__device__ __forceinline__ float lm_exact_sum(const float* __restrict__ h, const kiln_u8* __restrict__ weights,
                                              long long row_bytes, int hidden, int hr, long long v) {
    const float* x = h + (long long)hr * hidden;
    const kiln_u16* w = reinterpret_cast<const kiln_u16*>(weights + v * row_bytes);
    float acc = 0.0f;
#pragma unroll 1
    for (int u = 0; u * 256 < hidden; ++u) {
        float s1 = 0.0f;
#pragma unroll 1
        for (int i0 = 0; i0 < 2; ++i0) {
            float s2 = 0.0f;
#pragma unroll 1
            for (int i1 = 0; i1 < 2; ++i1) {
                float s4 = 0.0f;
#pragma unroll 1
                for (int i2 = 0; i2 < 2; ++i2) {
                    float s8 = 0.0f;
#pragma unroll 1
                    for (int i3 = 0; i3 < 2; ++i3) {
                        float s16 = 0.0f;
#pragma unroll 1
                        for (int i4 = 0; i4 < 2; ++i4) {
                            const float c = lm_exact_chain(x, w, hidden, u * 256 + 8 * (i0 + 2 * i1 + 4 * i2 + 8 * i3 + 16 * i4));
                            s16 = i4 ? s16 + c : c;
                        }
                        s8 = i3 ? s8 + s16 : s16;
                    }
                    s4 = i2 ? s4 + s8 : s8;
                }
                s2 = i1 ? s2 + s4 : s4;
            }
            s1 = i0 ? s1 + s2 : s2;
        }
        acc = acc + s1;
    }
    return acc;
}
#endif

// A logit from its sum: the deferred row scale, the logit scale and the soft cap, as
// `LmHead::epilogue` in Rust (lm_fix_nan; lm_finish_tile writes the same operations out).
__device__ __forceinline__ float lm_epilogue(float acc, int r, const float* __restrict__ row_scale,
                                             float logit_scale, float cap) {
    float y = acc;
#if ROW_SCALE
    y = y * row_scale[r];
#else
    (void)r; (void)row_scale;
#endif
    y = y * logit_scale;
#if SOFT_CAP
    y = cap * lm_tanh_poly(y / cap);
#else
    (void)cap;
#endif
    return y;
}

// A (logit, token) pair as `pack_argmax` in Rust: the larger the logit, then the lower the
// token, the larger the key.
__device__ __forceinline__ kiln_u64 lm_pack_stat(float y, long long v) {
    return ((kiln_u64)lm_order_key(y) << 32) | (kiln_u64)(0xFFFFFFFFu - (kiln_u32)v);
}

// The end of a tile: after every warp's unit sums are in `partial`, one thread per (row, token)
// adds them left to right, applies the epilogue and writes the logit (and, with STATS, the
// tile's largest logit per row). Every thread of the block calls it.
__device__ __forceinline__ void lm_finish_tile(const float* partial, const float* __restrict__ row_scale,
                                               float* __restrict__ logits, kiln_u64* __restrict__ stats,
                                               kiln_u64* tile_max, long long vocab, int units, int tile,
                                               long long tiles, long long t, float logit_scale, float cap,
                                               int* nan_seen) {
    const int stride = tile + 1;
    const long long v0 = t * tile;
#if STATS
    if (threadIdx.x < ROWS) tile_max[threadIdx.x] = 0ull;
#endif
    __syncthreads();
    for (int p = threadIdx.x; p < ROWS * tile; p += blockDim.x) {
        const int r = p / tile, i = p - r * tile;
        const long long v = v0 + i;
        if (v < vocab) {
            // Left to right; eight loads issued before their additions.
            const float* col = partial + r * stride + i;
            const int step = ROWS * stride;
            float acc = 0.0f;
            int u = 0;
            for (; u + 8 <= units; u += 8) {
                float s[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) s[k] = col[(u + k) * step];
#pragma unroll
                for (int k = 0; k < 8; ++k) acc = acc + s[k];
            }
            for (; u < units; ++u) acc = acc + col[u * step];
            // lm_epilogue and lm_pack_stat's operations, written out here: as calls, ptxas lays
            // out the 1- and 4-row defaults differently (same count, other schedule).
            float y = acc;
#if ROW_SCALE
            y = y * row_scale[r];
#endif
            y = y * logit_scale;
#if SOFT_CAP
            y = cap * lm_tanh_poly(y / cap);
#endif
            logits[(long long)r * vocab + v] = y;
#if LM_TC_FIX
            if (y != y) *nan_seen = 1;
#else
            (void)nan_seen;
#endif
#if STATS
            const kiln_u64 packed = ((kiln_u64)lm_order_key(y) << 32) | (kiln_u64)(0xFFFFFFFFu - (kiln_u32)v);
            atomicMax(&tile_max[r], packed);
#endif
        }
    }
#if STATS
    __syncthreads();
    if (threadIdx.x < ROWS) stats[(long long)threadIdx.x * tiles + t] = tile_max[threadIdx.x];
#endif
    // With one buffer, the next tile's sums overwrite these: every thread must be done. With two
    // (PBUF), they go to the other buffer, and this one is written again only after the next
    // tile's first barrier, which every thread passes after finishing here (and a thread that
    // writes a row's statistics is the one that resets it at the next tile's start).
    if (PBUF == 1) __syncthreads();
}

#if LM_TC_FIX
// The end of the kernel with the matrix-unit decode (see lm_decode): where a logit of this block
// came out NaN (`nan_seen`), every NaN logit of its tiles is computed again the reference's way
// and each tile's statistics are taken again. This runs after the block's last tile, when the
// streaming loop's registers are free, and only in a block that saw a NaN.
__device__ __forceinline__ void lm_fix_nan(const float* const* h_at, const kiln_u8* __restrict__ weights,
                                           long long row_bytes, const int* hidden_at,
                                           const float* __restrict__ row_scale,
                                           float* __restrict__ logits, kiln_u64* __restrict__ stats,
                                           kiln_u64* tile_max, long long vocab, int tile, float logit_scale,
                                           float cap, const int* nan_seen) {
    __syncthreads();
    if (*nan_seen == 0) return;
    // Computed again here, so that nothing of the streaming loop stays live for this.
    const long long tiles = (vocab + tile - 1) / tile;
    const float* h = *h_at;
    const int hidden = *hidden_at;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
#if STATS
        if (threadIdx.x < ROWS) tile_max[threadIdx.x] = 0ull;
        __syncthreads();
#endif
        for (int p = threadIdx.x; p < ROWS * tile; p += blockDim.x) {
            const int r = p / tile;
            const long long v = t * tile + (p - r * tile);
            if (v < vocab) {
                float* out = logits + (long long)r * vocab + v;
                float y = *out;
                if (y != y) {
                    y = lm_epilogue(lm_exact_sum(h, weights, row_bytes, hidden, r, v), r, row_scale, logit_scale,
                                    cap);
                    *out = y;
                }
#if STATS
                atomicMax(&tile_max[r], lm_pack_stat(y, v));
#endif
            }
        }
#if STATS
        __syncthreads();
        if (threadIdx.x < ROWS) stats[(long long)threadIdx.x * tiles + t] = tile_max[threadIdx.x];
        __syncthreads();
#else
        (void)stats; (void)tile_max;
#endif
    }
}
#endif

#if RING
// Copies one step of weights (vocabulary rows t * tile + g * VROWS + (i ^ xi), unit u, this
// lane's 16 bytes) into ring slot `dst` (this lane's address of row 0; rows 512 bytes apart);
// past the vocabulary or past `hidden` it copies zeros, past the last tile nothing (the caller
// commits a group either way, so the group count of every step stays the same). Row
// indices fit 32 bits (the vocabulary is below 2^32) and so do rows of 2-byte weights
// (`hidden` is an int), so each row's address is one 32 x 32 + 64-bit multiply-add.
__device__ __forceinline__ void lm_issue(const kiln_u8* __restrict__ weights, kiln_u32 row_bytes, kiln_u32 vocab,
                                         int hidden, int tile, long long tiles, int lane, int xi, kiln_u32 dst,
                                         long long t, int u, int g) {
    if (t < tiles) {
        const int e0 = u * 256 + lane * 8;
        const kiln_u32 vb = (kiln_u32)t * (kiln_u32)tile + (kiln_u32)(g * VROWS);
        const kiln_u64 row0 = (kiln_u64)weights + (kiln_u64)vb * row_bytes + (kiln_u64)(2 * e0);
        if (vb + VROWS <= vocab && u * 256 + 256 <= hidden) {
#pragma unroll
            for (int i = 0; i < VROWS; ++i) {
                const kiln_u64 source = row0 + (kiln_u64)(kiln_u32)(i ^ xi) * row_bytes;
                kiln_cp_async_16(dst + i * 512, reinterpret_cast<const void*>(source), true);
            }
        } else {
            // The last tile or a partial last unit.
            const bool inside = e0 < hidden;
#pragma unroll
            for (int i = 0; i < VROWS; ++i) {
                const kiln_u32 ii = (kiln_u32)(i ^ xi);
                const bool valid = inside && vb + ii < vocab;
                const kiln_u64 source = valid ? row0 + (kiln_u64)ii * row_bytes : (kiln_u64)weights;
                kiln_cp_async_16(dst + i * 512, reinterpret_cast<const void*>(source), valid);
            }
        }
    }
}

// 16 bytes from global to shared memory, all of them (the fast path of the ring's producer).
__device__ __forceinline__ void lm_cp_async_16_full(kiln_u32 shared_address, kiln_u64 global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address), "l"(global) : "memory");
}

// The ring's producer: the next step to copy (tile t, unit u, group g), this lane's source for it
// and whether the step lies wholly inside the vocabulary and a full unit (then its copies need no
// checks: `fast`). Tiles <= vocab < 2^32, and t + gridDim.x (at most 2^20 blocks) stays below
// 2^32 for any vocabulary whose rows fit a GPU.
struct LmProducer {
    kiln_u32 t;
    int u, g;
    kiln_u64 src;
    bool fast;
};

// Points the producer at its step: this lane's 16 bytes of the step's row 0 (the ring), or
// with COOPERATIVE (COOP) its first chunk, lane % LPR, of row lane / LPR.
template <bool COOPERATIVE>
__device__ __forceinline__ void lm_locate(const kiln_u8* weights, kiln_u32 row_bytes, kiln_u32 vocab, int hidden,
                                          int tile, long long tiles, int lane, LmProducer& p) {
    if constexpr (COOPERATIVE) {
        const kiln_u32 row = p.t * (kiln_u32)tile + (kiln_u32)(p.g * VROWS) + (kiln_u32)(lane / LPR);
        p.src = (kiln_u64)weights + (kiln_u64)row * row_bytes + (kiln_u64)(2 * (p.u * 256) + 16 * (lane % LPR));
    } else {
        const kiln_u32 vb = p.t * (kiln_u32)tile + (kiln_u32)(p.g * VROWS);
        p.src = (kiln_u64)weights + (kiln_u64)vb * row_bytes + (kiln_u64)(2 * (p.u * 256 + lane * 8));
    }
    p.fast = p.t < tiles && (kiln_u64)p.t * (kiln_u32)tile + (kiln_u32)tile <= vocab &&
             p.u * 256 + 256 <= hidden;
}

// Commits the group of the producer's step and moves it on by one step: within a tile and unit
// the source just moves VROWS rows on (`step_bytes`), past them it is located anew.
template <bool COOPERATIVE>
__device__ __forceinline__ void lm_advance(const kiln_u8* weights, kiln_u32 row_bytes, kiln_u32 vocab, int hidden,
                                           int tile, long long tiles, int units, int groups, int warp, int lane,
                                           kiln_u32 step_bytes, LmProducer& p) {
    kiln_cp_async_commit();
    if (++p.g == groups) {
        p.g = 0;
        p.u += WARPS;
        if (p.u >= units) {
            p.u = warp;
            p.t += gridDim.x;
        }
        lm_locate<COOPERATIVE>(weights, row_bytes, vocab, hidden, tile, tiles, lane, p);
    } else {
        p.src += step_bytes;
    }
}

// The producer of warp `warp` at its first step (tile blockIdx.x, unit warp, group 0); a warp
// with no unit starts past the last tile, so it copies nothing.
template <bool COOPERATIVE>
__device__ __forceinline__ LmProducer lm_start(const kiln_u8* weights, kiln_u32 row_bytes, kiln_u32 vocab, int hidden,
                                               int tile, long long tiles, int units, int warp, int lane) {
    LmProducer p;
    p.t = warp < units ? blockIdx.x : (kiln_u32)tiles;
    p.u = warp;
    p.g = 0;
    lm_locate<COOPERATIVE>(weights, row_bytes, vocab, hidden, tile, tiles, lane, p);
    return p;
}

// Copies the producer's step into ring slot `slot`, commits the group and moves on by one step.
__device__ __forceinline__ void lm_produce(const kiln_u8* __restrict__ weights, kiln_u32 row_bytes, kiln_u32 vocab,
                                           int hidden, int tile, long long tiles, int units, int groups, int warp,
                                           int lane, int xi, kiln_u32 ring, int slot, kiln_u32 step_bytes,
                                           LmProducer& p) {
    const kiln_u32 dst = ring + slot * (VROWS * 512);
    if (p.fast) {
#pragma unroll
        for (int i = 0; i < VROWS; ++i) {
            lm_cp_async_16_full(dst + i * 512, p.src + (kiln_u64)(kiln_u32)(i ^ xi) * row_bytes);
        }
    } else {
        lm_issue(weights, row_bytes, vocab, hidden, tile, tiles, lane, xi, dst, p.t, p.u, p.g);
    }
    lm_advance<false>(weights, row_bytes, vocab, hidden, tile, tiles, units, groups, warp, lane, step_bytes, p);
}
#endif

#if RING_COOP
// Copies the producer's step into ring slot `slot` (`dst`: this lane's first chunk in slot 0),
// commits the group and moves on by one step. Past the vocabulary or `hidden` it copies zeros,
// past the last tile nothing (a group is committed either way).
// FAST: 1 when the step is known to need no checks, 0 when it is known to need them, -1 to test
// the producer's flag. Copies only: no commit, no move.
template <int FAST>
__device__ __forceinline__ void lm_coop_copy(const kiln_u8* __restrict__ weights, kiln_u32 row_bytes,
                                             kiln_u32 vocab, int hidden, int tile, long long tiles, int lane,
                                             kiln_u32 dst, int slot, const LmProducer& p) {
    const kiln_u32 d = dst + slot * (VROWS * 512);
    if (FAST < 0 ? p.fast : FAST == 1) {
#pragma unroll
        for (int j = 0; j < VROWS; ++j) lm_cp_async_16_full(d + j * (LPR * 16), p.src + j * (LPR * 16));
    } else if (p.t < tiles) {
        const kiln_u32 row = p.t * (kiln_u32)tile + (kiln_u32)(p.g * VROWS) + (kiln_u32)(lane / LPR);
        const int e0 = p.u * 256 + 8 * (lane % LPR);
        const bool in_vocab = row < vocab;
        const kiln_u64 base = (kiln_u64)weights + (kiln_u64)row * row_bytes + (kiln_u64)(2 * e0);
#pragma unroll
        for (int j = 0; j < VROWS; ++j) {
            const bool valid = in_vocab && e0 + j * (LPR * 8) < hidden;
            const kiln_u64 source = valid ? base + (kiln_u64)(j * (LPR * 16)) : (kiln_u64)weights;
            kiln_cp_async_16(d + j * (LPR * 16), reinterpret_cast<const void*>(source), valid);
        }
    }
}

__device__ __forceinline__ void lm_coop_produce(const kiln_u8* __restrict__ weights, kiln_u32 row_bytes,
                                                kiln_u32 vocab, int hidden, int tile, long long tiles, int units,
                                                int groups, int warp, int lane, kiln_u32 dst, int slot,
                                                kiln_u32 step_bytes, LmProducer& p) {
    lm_coop_copy<-1>(weights, row_bytes, vocab, hidden, tile, tiles, lane, dst, slot, p);
    lm_advance<true>(weights, row_bytes, vocab, hidden, tile, tiles, units, groups, warp, lane, step_bytes, p);
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
kiln_lm_head(const float* __restrict__ h, const kiln_u8* __restrict__ weights, const float* __restrict__ row_scale,
             float* __restrict__ logits, kiln_u64* __restrict__ stats, long long vocab, int hidden,
             long long row_bytes, int tile, float logit_scale, float cap) {
    kiln_wait_prior();
    // Unit sums: [unit][row][token of the tile], rows of `tile + 1` floats (padded against bank
    // conflicts on the writes); with RING, each warp's ring follows (16-byte aligned).
    extern __shared__ __align__(16) float partial[];
#if STATS
    __shared__ kiln_u64 tile_max[ROWS];
#else
    kiln_u64* tile_max = nullptr;
#endif
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#if LM_TC_FIX
    const kiln_u32 sel = kiln_tc_identity<LM_TC_T>(lane);
    // Set where a logit of this block comes out NaN (lm_finish_tile), read by lm_fix_nan, which
    // takes h and hidden from shared memory too: read from the parameters at the end, they
    // stayed live through the streaming loop in registers it needs.
    __shared__ int nan_seen;
    __shared__ const float* fix_h;
    __shared__ int fix_hidden;
    if (threadIdx.x == 0) {
        nan_seen = 0;
        fix_h = h;
        fix_hidden = hidden;
    }
#else
    const kiln_u32 sel = 0u;
    int nan_seen = 0;
#endif
    const int units = (hidden + 255) >> 8;
    const int stride = tile + 1;
    const long long tiles = (vocab + tile - 1) / tile;
#if STAGES
    // Floats of one buffer of unit sums (16-byte aligned); PBUF buffers, then the ring.
    const int pstride = (units * ROWS * stride + 3) & ~3;
#endif

    // This lane's slot permutation (XSLOT): its registers of step row i and row r hold vocabulary
    // row i ^ xi of the step and h row r ^ xr.
    const int xs = XSLOT ? lane / GROUP : 0;
    const int xi = xs / ROWS_P2, xr = xs % ROWS_P2;

#if RING_COOP
    // As the ring below, with cooperative copies (COOP, see the header).
    const int groups = tile / VROWS;
    const int ring_offset = PBUF * pstride;
    const uint4* ring_warp = reinterpret_cast<const uint4*>(partial + ring_offset) + warp * (STAGES * VROWS * 32);
    const kiln_u32 copy_dst = kiln_smem_address(ring_warp + (lane / LPR) * 32 + lane % LPR);
    // Where this lane reads step row i (vocabulary row i ^ xi) in slot 0, in 16-byte units.
    int read_at[VROWS];
#pragma unroll
    for (int i = 0; i < VROWS; ++i) read_at[i] = (i ^ xi) * 32 + lane;
    const kiln_u32 ring_row_bytes = (kiln_u32)row_bytes, ring_vocab = (kiln_u32)vocab;
    const kiln_u32 step_bytes = VROWS * ring_row_bytes;
    LmProducer producer =
        lm_start<true>(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, warp, lane);
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) {
        lm_coop_produce(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, groups, warp, lane, copy_dst,
                        k, step_bytes, producer);
    }
    float hv[ROWS_P2][8];
    int hu = -1;
    // This tile's buffer of unit sums (PBUF: tile k of the block in buffer k % 2).
    float* sums = partial;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        for (int u = warp; u < units; u += WARPS) {
            if (u != hu) {
                lm_load_h(h, hidden, u, lane, xr, hv);
                hu = u;
            }
            float* out = sums + (long long)u * ROWS * stride;
            // Every (tile, unit) starts at slot 0: its `groups` steps are a multiple of STAGES.
            int g = 0;
#if SPLIT
            if (producer.fast) {
                // The steps whose copies stay in this (tile, unit), none of which needs checks
                // (the producer is at step STAGES - 1 of this tile and unit, located at its
                // start): the producer only moves its source on.
                for (; g < groups - STAGES; g += STAGES) {
#pragma unroll
                    for (int s = 0; s < STAGES; ++s) {
                        kiln_cp_async_wait<STAGES - 2>();
                        __syncwarp();
                        lm_coop_copy<1>(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, lane, copy_dst,
                                        (s + STAGES - 1) % STAGES, producer);
                        kiln_cp_async_commit();
                        producer.src += step_bytes;
                        LmW cur[VROWS];
#pragma unroll
                        for (int i = 0; i < VROWS; ++i) cur[i].q = ring_warp[s * (VROWS * 32) + read_at[i]];
                        lm_step(cur, hv, lane, out + (g + s) * VROWS, stride, sel);
                    }
                }
                // The last STAGES steps, whose copies run on into the next (tile, unit).
                producer.g = groups - 1;
            }
#endif
            for (; g < groups; g += STAGES) {
#pragma unroll
                for (int s = 0; s < STAGES; ++s) {
                    kiln_cp_async_wait<STAGES - 2>();
                    __syncwarp();
                    lm_coop_produce(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, groups, warp,
                                    lane, copy_dst, (s + STAGES - 1) % STAGES, step_bytes, producer);
                    LmW cur[VROWS];
#pragma unroll
                    for (int i = 0; i < VROWS; ++i) cur[i].q = ring_warp[s * (VROWS * 32) + read_at[i]];
                    lm_step(cur, hv, lane, out + (g + s) * VROWS, stride, sel);
                }
            }
        }
        lm_finish_tile(sums, row_scale, logits, stats, tile_max, vocab, units, tile, tiles, t, logit_scale, cap,
                       &nan_seen);
        if (PBUF == 2) sums = sums == partial ? partial + pstride : partial;
    }
#elif STAGES
    // Steps run over (tile, unit, group of VROWS tokens), tile-major then unit-major; the ring's
    // producer runs STAGES - 1 steps ahead of the products, across tile ends.
    const int groups = tile / VROWS;
#if RING
    const int ring_offset = PBUF * pstride;
    const uint4* ring_lane =
        reinterpret_cast<const uint4*>(partial + ring_offset) + warp * (STAGES * VROWS * 32) + lane;
    const kiln_u32 ring = kiln_smem_address(ring_lane);
    // The ring path serves 2-byte weights: rows of 2 * hidden bytes, which fit 32 bits.
    const kiln_u32 ring_row_bytes = (kiln_u32)row_bytes, ring_vocab = (kiln_u32)vocab;
    // VROWS rows of 2 * hidden bytes: below 2^32 (the launcher serves the ring up to hidden 2^24).
    const kiln_u32 step_bytes = VROWS * ring_row_bytes;
    LmProducer producer =
        lm_start<false>(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, warp, lane);
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) {
        lm_produce(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, groups, warp, lane, xi, ring, k,
                   step_bytes, producer);
    }
    // Step n reads slot n % STAGES and copies step n + STAGES - 1 into slot (n - 1) % STAGES.
    int cslot = 0;
#endif
    float hv[ROWS_P2][8];
    int hu = -1;
    // This tile's buffer of unit sums (PBUF: tile k of the block in buffer k % 2).
    float* sums = partial;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        for (int u = warp; u < units; u += WARPS) {
            if (u != hu) {
                lm_load_h(h, hidden, u, lane, xr, hv);
                hu = u;
            }
            float* out = sums + (long long)u * ROWS * stride;
            for (int g = 0; g < groups; ++g) {
                LmW cur[VROWS];
#if RING
                kiln_cp_async_wait<STAGES - 2>();
                lm_produce(weights, ring_row_bytes, ring_vocab, hidden, tile, tiles, units, groups, warp, lane, xi,
                           ring, (cslot + STAGES - 1) & (STAGES - 1), step_bytes, producer);
                const uint4* slot = ring_lane + cslot * (VROWS * 32);
#pragma unroll
                for (int i = 0; i < VROWS; ++i) cur[i].q = slot[i * 32];
                cslot = (cslot + 1) & (STAGES - 1);
#else
                lm_fetch_step(weights, row_bytes, vocab, hidden, t * tile, u, g * VROWS, lane, xi, cur);
#endif
                lm_step(cur, hv, lane, out + g * VROWS, stride, sel);
            }
        }
        lm_finish_tile(sums, row_scale, logits, stats, tile_max, vocab, units, tile, tiles, t, logit_scale, cap,
                       &nan_seen);
        if (PBUF == 2) sums = sums == partial ? partial + pstride : partial;
    }
#else
#if PIPE
    const int my_units = warp < units ? (units - warp + WARPS - 1) / WARPS : 0;
    const int steps = my_units * (tile / VROWS);
#endif
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const long long v0 = t * tile;
        float hv[ROWS_P2][8];
#if PIPE
        // Steps run over (unit, group of VROWS tokens), unit-major; each step's loads are issued
        // before the previous step's products.
        int u = warp, i0 = 0;
        LmW cur[VROWS];
        if (steps > 0) {
            lm_load_h(h, hidden, u, lane, xr, hv);
            lm_fetch_step(weights, row_bytes, vocab, hidden, v0, u, i0, lane, xi, cur);
        }
        for (int step = 0; step < steps; ++step) {
            const int nu = i0 + VROWS < tile ? u : u + WARPS;
            const int ni0 = i0 + VROWS < tile ? i0 + VROWS : 0;
            LmW nxt[VROWS];
            if (step + 1 < steps) {
                lm_fetch_step(weights, row_bytes, vocab, hidden, v0, nu, ni0, lane, xi, nxt);
            } else {
#pragma unroll
                for (int i = 0; i < VROWS; ++i) lm_zero(nxt[i]);
            }
            lm_step(cur, hv, lane, partial + (long long)u * ROWS * stride + i0, stride, sel);
#pragma unroll
            for (int i = 0; i < VROWS; ++i) cur[i] = nxt[i];
            if (nu != u && step + 1 < steps) lm_load_h(h, hidden, nu, lane, xr, hv);
            u = nu;
            i0 = ni0;
        }
#else
        for (int u = warp; u < units; u += WARPS) {
            lm_load_h(h, hidden, u, lane, xr, hv);
            for (int i0 = 0; i0 < tile; i0 += VROWS) {
                LmW cur[VROWS];
                lm_fetch_step(weights, row_bytes, vocab, hidden, v0, u, i0, lane, xi, cur);
                lm_step(cur, hv, lane, partial + (long long)u * ROWS * stride + i0, stride, sel);
            }
        }
#endif
        lm_finish_tile(partial, row_scale, logits, stats, tile_max, vocab, units, tile, tiles, t, logit_scale, cap,
                       &nan_seen);
    }
#endif
#if LM_TC_FIX
    lm_fix_nan(&fix_h, weights, row_bytes, &fix_hidden, row_scale, logits, stats, tile_max, vocab, tile, logit_scale, cap,
               &nan_seen);
#endif
}
