// The decode-side linear layer: out[t][r] = epilogue(sum_c W[r][c] * x[t][c] (+ bias[r])) for
// TOKENS (1..8) tokens at once, W in f32, bf16, f16 or a GGUF block format (Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), dequantized in registers; fp32
// accumulation. Beside it: the gather of embedding rows, the conversion of weights to bf16 (the
// prefill path's cuBLAS input) and fp32 -> bf16.
//
// Memory floor: W read once for all tokens (rows x row_bytes); x (at most 8 x cols fp32) stays in
// L1/L2. A 4096 x 4096 f16 layer is 33.5 MB, 8 us at 4.2 TB/s.
//
// Shape: a block owns ROWS output rows (2 x ROWS weight rows for SwiGLU: the gate row r and the up
// row rows + r). Its WARPS x 32 threads split the columns in "pieces" (8 values of f32 / bf16 /
// f16, 16 of Q8_0, 32 of the 4-bit and 6-bit formats), thread i taking pieces i, i + THREADS, ...;
// each step issues the loads of UNROLL pieces of every weight row before decoding any, so
// UNROLL x rows loads are in flight per thread. Decoded values are consumed 8 at a time: for each
// token the 8 matching x values are loaded once (read-only path, L1) and used for every weight row
// of the block, so x traffic falls with the rows per block. Accumulators (rows x tokens) stay in
// registers. Read from global memory, a piece's x spans 32 to 128 bytes, so for the block formats
// each 16-byte x load of a warp touches 32 cache lines (L1-bound at a fraction of the weight
// stream); STAGE = 1 copies x once per block into shared memory, transposed so that a warp's reads
// are 512 consecutive bytes, and the block formats' defaults use it with up to 8 rows per block
// (Q8_0 / Q4_0 at 1-2 tokens also sum q x per piece and scale by d once). The warp's sums are
// reduced by a transposed butterfly (each shuffle step halves the sums a lane carries), the
// warps' partial sums are added in warp order in shared memory. No atomics: the result depends
// only on the variant (WARPS, ROWS, UNROLL, STAGE) and the shape.
//
// Loads: 16-byte streaming loads (no L1 allocation) for f32 / bf16 / f16 rows (16-byte aligned when
// cols is a multiple of 8) and Q4_K's quants (its 144-byte blocks keep 16-byte alignment);
// Q5_K's quants and high bits (176-byte blocks) too; Q4_1's, Q5_1's, Q2_K's and IQ4_XS's 20-,
// 24-, 84- and 136-byte blocks are 4-byte aligned (4-byte loads); Q8_0, Q4_0, Q5_0, IQ4_NL (34,
// 18, 22, 18 bytes), Q3_K (110) and Q6_K (210) are only 2-byte aligned: their bytes come from
// aligned 4-byte loads joined by byte permutes. Such a load may read up to 2 bytes past the bytes
// it needs, never past the aligned 4-byte word that holds the last of them.
//
// Dequantization equals `dequantize_row` of the CPU reference bit for bit: small integers become
// floats exactly by the 2^23 bias trick (or'ing them into the mantissa of 2^23 and subtracting),
// and every rounding of the reference is an explicit __fmul_rn / __fadd_rn / __fsub_rn, which the
// compiler never contracts. The dot products use explicit FMAs.
//
// Compile-time constants: W_T (0 f32, 1 bf16, 2 f16, 3 Q8_0, 4 Q4_0, 5 Q4_1, 6 Q4_K, 7 Q6_K,
// 8 Q5_0, 9 Q5_1, 10 Q5_K, 11 IQ4_NL, 12 IQ4_XS, 13 Q2_K, 14 Q3_K),
// X_T (0 f32, 1 bf16), TOKENS (1..8), EPI (0 store, 1 accumulate, 2 SwiGLU), HAS_BIAS, WARPS,
// ROWS, UNROLL, STAGE (0 x from global memory, 1 staged in shared memory), MMA (1: the tensor-core
// path below, for bf16 / f16 weights).

#include "kiln_prelude.cuh"

#ifndef W_T
#define W_T 1
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
#define WARPS 4
#endif
#ifndef ROWS
#define ROWS 1
#endif
#ifndef UNROLL
#define UNROLL 2
#endif
#ifndef STAGE
#define STAGE 0
#endif
#ifndef MMA
#define MMA 0
#endif

#define THREADS (WARPS * 32)
#define GATES (EPI == 2 ? 2 : 1)
#define WROWS (ROWS * GATES)
#define SLOTS (WROWS * TOKENS)
#define SLOTS_P2 (SLOTS <= 1 ? 1 : SLOTS <= 2 ? 2 : SLOTS <= 4 ? 4 : SLOTS <= 8 ? 8 : SLOTS <= 16 ? 16 : SLOTS <= 32 ? 32 : 64)
#define GROUP_SLOTS (SLOTS_P2 < 32 ? SLOTS_P2 : 32)
static_assert(TOKENS >= 1 && TOKENS <= 8, "TOKENS must be 1..8");
static_assert(MMA || SLOTS <= 64, "ROWS x (2 for SwiGLU) x TOKENS must be at most 64");
static_assert(EPI != 2 || HAS_BIAS == 0, "SwiGLU takes no bias");

// Values per piece, 8-value groups per piece, 32-bit words of a piece's raw bytes (the block
// formats: see lin_load_piece).
#if W_T < 0 || W_T > 14
#error "W_T must be 0..14"
#endif
#define PIECE (W_T <= 2 ? 8 : W_T == 3 ? 16 : 32)
#define RAW_WORDS                                                                                  \
    (W_T == 0 ? 8 : W_T <= 2 ? 4 : W_T == 10 ? 12 : W_T == 7 ? 9 : W_T == 6 || W_T == 14 ? 8      \
     : W_T == 8 || W_T == 9 || W_T == 12 ? 6 : 5)
#define SUBS (PIECE / 8)
#define QUADS (PIECE / 4)

// Staged x (STAGE = 1): the block copies x, CHUNK_P pieces of every token at a time, into shared
// memory transposed by quads: quad q (values 4q .. 4q + 4 of a piece) of local piece l of token t
// is at xs[t * XS_TOKEN + q * XS_STRIDE + 4 l]. A warp's threads read consecutive pieces, so each
// 16-byte read of the product covers 512 consecutive bytes (no bank conflict), where reading x
// from global memory would touch one 128-byte line per thread (a piece's x spans 32 .. 128 bytes).
// XS_STRIDE = 32 / QUADS words past a multiple of 32 makes the staging writes (a warp's threads
// take consecutive quads) conflict-free too. 8192 floats of x per chunk: 32 KiB of static shared
// memory, 6 blocks per SM.
#define CHUNK_P ((8192 / (PIECE * TOKENS)) & ~7)
#define XS_STRIDE (4 * CHUNK_P + 32 / QUADS)
#define XS_TOKEN (QUADS * XS_STRIDE)
static_assert(STAGE == 0 || STAGE == 1, "STAGE must be 0 or 1");
static_assert(CHUNK_P >= 8, "a chunk holds at least 8 pieces");

// ---- loads -----------------------------------------------------------------------------------

__device__ __forceinline__ uint4 lin_load_stream16(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ kiln_u32 lin_load32(const void* p) {
    kiln_u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ kiln_u32 lin_load16(const void* p) {
    unsigned short r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return (kiln_u32)r;
}

__device__ __forceinline__ float4 lin_load_x4(const float* p) {
    float4 r;
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ uint4 lin_load_xb(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// N little-endian words of the bytes at p (2-byte aligned): aligned 4-byte loads, joined by byte
// permutes when p is not 4-byte aligned (the extra word is loaded only then).
template <int N>
__device__ __forceinline__ void lin_load_words(const kiln_u8* p, kiln_u32* out) {
    const kiln_u64 address = (kiln_u64)p;
    const kiln_u32* w = reinterpret_cast<const kiln_u32*>(address & ~3ull);
    const bool odd = (address & 2ull) != 0;
    kiln_u32 raw[N + 1];
#pragma unroll
    for (int k = 0; k < N; ++k) raw[k] = lin_load32(w + k);
    raw[N] = odd ? lin_load32(w + N) : 0u;
    const kiln_u32 selector = odd ? 0x5432u : 0x3210u;
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = __byte_perm(raw[k], raw[k + 1], selector);
}

// ---- pieces ----------------------------------------------------------------------------------
// A piece is PIECE values of one row, loaded as RAW_WORDS words; group s (0..SUBS) of a piece is
// 8 consecutive values of the row starting at lin_piece_element(p, s).

struct LinRaw {
    kiln_u32 v[RAW_WORDS];
};

__device__ __forceinline__ int lin_piece_element(int p, int s) {
#if W_T <= 2
    return 8 * p + 8 * s;
#elif W_T == 3
    return 16 * p + 8 * s;
#elif W_T == 4 || W_T == 5 || W_T == 8 || W_T == 9 || W_T == 11 || W_T == 12
    // (IQ4_XS: a super-block's eight sub-blocks of 32 are consecutive pieces.)
    return 32 * p + 8 * s;
#elif W_T == 6 || W_T == 10
    // Piece q of a super-block: quant bytes 16q .. 16q + 16 (chunk q / 2, half q % 2); groups 0, 1
    // are their low nibbles, groups 2, 3 their high nibbles.
    const int q = p & 7;
    return 256 * (p >> 3) + 64 * (q >> 1) + 16 * (q & 1) + 8 * (s & 1) + 32 * (s >> 1);
#else
    // Q6_K, Q2_K, Q3_K: piece q of a super-block: half q / 4, l0 = 8 (q % 4); group s holds
    // values 32 s + l0 .. + 8 of the half (Q2_K, Q3_K: the 2-bit field s of the quant bytes
    // l0 .. l0 + 8 of the half).
    const int q = p & 7;
    return 256 * (p >> 3) + 128 * (q >> 2) + 32 * s + 8 * (q & 3);
#endif
}

__device__ __forceinline__ void lin_load_piece(const kiln_u8* row, int p, LinRaw& r) {
#if W_T == 0
    const uint4 a = lin_load_stream16(row + 32ll * p);
    const uint4 b = lin_load_stream16(row + 32ll * p + 16);
    r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
    r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
#elif W_T == 1 || W_T == 2
    const uint4 a = lin_load_stream16(row + 16ll * p);
    r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
#elif W_T == 3
    const kiln_u8* block = row + 34ll * (p >> 1);
    r.v[0] = lin_load16(block);
    lin_load_words<4>(block + 2 + 16 * (p & 1), r.v + 1);
#elif W_T == 4 || W_T == 8 || W_T == 11
    // d | (Q5_0: qh, 4 bytes |) qs[16]
    const kiln_u8* block = row + (W_T == 8 ? 22ll : 18ll) * p;
    r.v[0] = lin_load16(block);
    lin_load_words<RAW_WORDS - 1>(block + 2, r.v + 1);
#elif W_T == 5 || W_T == 9
    // d, m | (Q5_1: qh |) qs[16]
    const kiln_u32* block = reinterpret_cast<const kiln_u32*>(row + 4ll * RAW_WORDS * p);
#pragma unroll
    for (int k = 0; k < RAW_WORDS; ++k) r.v[k] = lin_load32(block + k);
#elif W_T == 6 || W_T == 10
    // d, dmin | scales[12] | (Q5_K: qh[32] |) qs[128]: piece q takes quant bytes 16q .. 16q + 16
    // (Q5_K: and the high-bit bytes of the same positions in its chunk, 16 (q % 2) .. + 16).
    const kiln_u8* block = row + (W_T == 6 ? 144ll : 176ll) * (p >> 3);
    const kiln_u32* head = reinterpret_cast<const kiln_u32*>(block);
#pragma unroll
    for (int k = 0; k < 4; ++k) r.v[k] = lin_load32(head + k);
    const uint4 q = lin_load_stream16(block + (W_T == 6 ? 16 : 48) + 16 * (p & 7));
    r.v[4] = q.x; r.v[5] = q.y; r.v[6] = q.z; r.v[7] = q.w;
#if W_T == 10
    const uint4 h = lin_load_stream16(block + 16 + 16 * (p & 1));
    r.v[8] = h.x; r.v[9] = h.y; r.v[10] = h.z; r.v[11] = h.w;
#endif
#elif W_T == 13
    // scales[16] | qs[64] | d, dmin: piece q (half q / 4, l0 = 8 (q % 4)) takes quant bytes
    // 32 half + l0 .. + 8 (their four 2-bit fields are its four groups), the half's 8 scale
    // bytes, and d, dmin.
    const kiln_u8* block = row + 84ll * (p >> 3);
    const int q = p & 7, half = q >> 2, l0 = 8 * (q & 3);
    const kiln_u32* qs = reinterpret_cast<const kiln_u32*>(block + 16 + 32 * half + l0);
    const kiln_u32* scales = reinterpret_cast<const kiln_u32*>(block + 8 * half);
    r.v[0] = lin_load32(qs);
    r.v[1] = lin_load32(qs + 1);
    r.v[2] = lin_load32(scales);
    r.v[3] = lin_load32(scales + 1);
    r.v[4] = lin_load32(block + 80);
#elif W_T == 14
    // hmask[32] | qs[64] | scales[12] | d: piece q (half q / 4, l0 = 8 (q % 4)) takes quant bytes
    // 32 half + l0 .. + 8, the high-bit bytes l0 % 32 .. + 8, the 12 packed scale bytes and d.
    const kiln_u8* block = row + 110ll * (p >> 3);
    const int q = p & 7, half = q >> 2, l0 = 8 * (q & 3);
    lin_load_words<2>(block + 32 + 32 * half + l0, r.v);  // qs
    lin_load_words<2>(block + l0, r.v + 2);                // hmask
    lin_load_words<3>(block + 96, r.v + 4);                // scales
    r.v[7] = lin_load16(block + 108);                      // d
#elif W_T == 12
    // d, scales_h | scales_l[4] | qs[128]: piece q of a super-block takes sub-block q's 16 bytes.
    const kiln_u8* block = row + 136ll * (p >> 3);
    const kiln_u32* head = reinterpret_cast<const kiln_u32*>(block);
    r.v[0] = lin_load32(head);
    r.v[1] = lin_load32(head + 1);
    const kiln_u32* q = reinterpret_cast<const kiln_u32*>(block + 8 + 16 * (p & 7));
#pragma unroll
    for (int k = 0; k < 4; ++k) r.v[2 + k] = lin_load32(q + k);
#else
    const kiln_u8* block = row + 210ll * (p >> 3);
    const int q = p & 7, half = q >> 2, l0 = 8 * (q & 3);
    lin_load_words<2>(block + 64 * half + l0, r.v);            // ql[l0 ..]
    lin_load_words<2>(block + 64 * half + 32 + l0, r.v + 2);   // ql[l0 + 32 ..]
    lin_load_words<2>(block + 128 + 32 * half + l0, r.v + 4);  // qh[l0 ..]
    lin_load_words<2>(block + 192 + 8 * half, r.v + 6);        // scales of the half
    r.v[8] = lin_load16(block + 208);                          // d
#endif
}

// x = the integer in the low bits of `bits` (below 2^23) plus 2^23, as a float: exact.
__device__ __forceinline__ float lin_biased(kiln_u32 bits) { return __uint_as_float(0x4B000000u | bits); }

// Byte k of `word` (k a compile-time constant after unrolling) plus 2^23, as a float.
__device__ __forceinline__ float lin_biased_byte(kiln_u32 word, int k) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (kiln_u32)k));
}

__device__ __forceinline__ kiln_u32 lin_byte(kiln_u32 word, int k) { return (word >> (8 * k)) & 0xFFu; }

__device__ __forceinline__ kiln_u32 lin_byte3(kiln_u32 a, kiln_u32 b, kiln_u32 c, int i) {
    const kiln_u32 word = i < 4 ? a : (i < 8 ? b : c);
    return lin_byte(word, i & 3);
}

// Bits 0 .. 4 of `bits` moved to bit 4 of bytes 0 .. 4 (the products' terms do not overlap, so
// no carry).
__device__ __forceinline__ kiln_u32 lin_spread4(kiln_u32 bits) { return ((bits * 0x00204081u) & 0x01010101u) << 4; }

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block, whose scales[12] are raw words
// 1 .. 3 (`get_scale_min_k4`).
__device__ __forceinline__ void lin_scale_min_k4(const LinRaw& r, int j, kiln_u32& sc, kiln_u32& mn) {
    if (j < 4) {
        sc = lin_byte3(r.v[1], r.v[2], r.v[3], j) & 63u;
        mn = lin_byte3(r.v[1], r.v[2], r.v[3], j + 4) & 63u;
    } else {
        const kiln_u32 b = lin_byte3(r.v[1], r.v[2], r.v[3], j + 4);
        sc = (b & 0x0Fu) | ((lin_byte3(r.v[1], r.v[2], r.v[3], j - 4) >> 6) << 4);
        mn = (b >> 4) | ((lin_byte3(r.v[1], r.v[2], r.v[3], j) >> 6) << 4);
    }
}

// The IQ4 table's signed byte values of four codes (one 0 .. 15 a byte): two byte permutes pick
// each code's value from the table's low and high halves (3 bits of selector a code), and the
// code's bit 3 chooses between them.
__device__ __forceinline__ kiln_u32 lin_iq4_values(kiln_u32 nibbles) {
    // -127, -104, -83, -65 | -49, -35, -22, -10 | 1, 13, 25, 38 | 53, 69, 89, 113
    const kiln_u32 t = nibbles & 0x07070707u;
    const kiln_u32 a = t | (t >> 4);                           // byte 0: c0 | c1 << 4, byte 2: c2 | c3 << 4
    const kiln_u32 selector = (a & 0xFFu) | ((a >> 8) & 0xFF00u);
    const kiln_u32 low = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, selector);
    const kiln_u32 high = __byte_perm(0x26190D01u, 0x71594535u, selector);
    const kiln_u32 upper = ((nibbles >> 3) & 0x01010101u) * 0xFFu;
    return (high & upper) | (low & ~upper);
}

// The 8 values of group s of piece p (the piece's raw words r), as `dequantize_row` gives them.
__device__ __forceinline__ void lin_decode(const LinRaw& r, int p, int s, float w[8]) {
#if W_T == 0
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = __uint_as_float(r.v[k]);
#elif W_T == 1 || W_T == 2
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if W_T == 1
        w[2 * k] = __uint_as_float(r.v[k] << 16);
        w[2 * k + 1] = __uint_as_float(r.v[k] & 0xFFFF0000u);
#else
        w[2 * k] = kiln_f16_to_f32((kiln_u16)(r.v[k] & 0xFFFFu));
        w[2 * k + 1] = kiln_f16_to_f32((kiln_u16)(r.v[k] >> 16));
#endif
    }
#elif W_T == 3
    // y = q * d, q the signed byte (its top bit flipped gives q + 128).
    const float d = kiln_f16_to_f32((kiln_u16)r.v[0]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const kiln_u32 word = r.v[1 + 2 * s + j] ^ 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(word, k), 8388736.0f);
            w[4 * j + k] = __fmul_rn(q, d);
        }
    }
#elif W_T == 4 || W_T == 5 || W_T == 8 || W_T == 9
    // Q4_0: y = d * (q - 8), Q5_0: d * (q - 16), Q4_1 and Q5_1: d * q + m, q a nibble (the Q5
    // formats: | bit e of qh << 4 for element e of the block). Group s: quant bytes
    // 8 (s % 2) .. + 8, low nibbles for s < 2, high nibbles after (the Q5 formats: bits
    // 8 s .. 8 s + 8 of qh, word 1, before the quants).
#define LIN_Q5 (W_T == 8 || W_T == 9)
#define LIN_WITH_MIN (W_T == 5 || W_T == 9)
    const float d = kiln_f16_to_f32((kiln_u16)(r.v[0] & 0xFFFFu));
#if LIN_WITH_MIN
    const float m = kiln_f16_to_f32((kiln_u16)(r.v[0] >> 16));
    const float offset = 8388608.0f;  // 2^23
#else
    const float offset = W_T == 4 ? 8388616.0f : 8388624.0f;  // 2^23 + 8, 2^23 + 16
#endif
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const kiln_u32 word = r.v[(LIN_Q5 ? 2 : 1) + 2 * (s & 1) + j];
        kiln_u32 q4 = (s >> 1) ? (word >> 4) & 0x0F0F0F0Fu : word & 0x0F0F0F0Fu;
        if (LIN_Q5) q4 |= lin_spread4((r.v[1] >> (8 * s + 4 * j)) & 0xFu);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(q4, k), offset);
#if LIN_WITH_MIN
            w[4 * j + k] = __fadd_rn(__fmul_rn(d, q), m);
#else
            w[4 * j + k] = __fmul_rn(d, q);
#endif
        }
    }
#undef LIN_Q5
#undef LIN_WITH_MIN
#elif W_T == 6 || W_T == 10
    // Sub-block j = 2 (chunk) + (s >= 2): y = (d * sc_j) * q - dmin * m_j (get_scale_min_k4), q a
    // nibble (Q5_K: | bit j of the value's qh byte << 4, words 8 .. 12).
    const float d = kiln_f16_to_f32((kiln_u16)(r.v[0] & 0xFFFFu));
    const float dmin = kiln_f16_to_f32((kiln_u16)(r.v[0] >> 16));
    const int j = 2 * ((p & 7) >> 1) + (s >> 1);
    kiln_u32 sc, mn;
    lin_scale_min_k4(r, j, sc, mn);
    const float d1 = __fmul_rn(d, __fsub_rn(lin_biased(sc), 8388608.0f));
    const float m1 = __fmul_rn(dmin, __fsub_rn(lin_biased(mn), 8388608.0f));
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        const kiln_u32 word = r.v[4 + 2 * (s & 1) + jj];
        kiln_u32 q5 = (s >> 1) ? (word >> 4) & 0x0F0F0F0Fu : word & 0x0F0F0F0Fu;
#if W_T == 10
        q5 |= ((r.v[8 + 2 * (s & 1) + jj] >> j) & 0x01010101u) << 4;
#endif
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(q5, k), 8388608.0f);
            w[4 * jj + k] = __fsub_rn(__fmul_rn(d1, q), m1);
        }
    }
#elif W_T == 11 || W_T == 12
    // y = scale * the code's value in the IQ4 table, scale = d (IQ4_NL) or d * (ls - 32) for
    // sub-block ls of an IQ4_XS super-block (rounded once, as the reference does). Group s: as
    // Q4_0, from the quant words at 1 (IQ4_NL) or 2 (IQ4_XS).
#if W_T == 11
    const float scale = kiln_f16_to_f32((kiln_u16)r.v[0]);
    const int first = 1;
#else
    const int ib = p & 7;
    const kiln_u32 ls = ((r.v[1] >> (4 * ib)) & 0xFu) | (((r.v[0] >> (16 + 2 * ib)) & 3u) << 4);
    const float scale = __fmul_rn(kiln_f16_to_f32((kiln_u16)(r.v[0] & 0xFFFFu)),
                                  __fsub_rn(lin_biased(ls), 8388640.0f));  // ls - 32, exact
    const int first = 2;
#endif
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const kiln_u32 word = r.v[first + 2 * (s & 1) + j];
        const kiln_u32 nibbles = (s >> 1) ? (word >> 4) & 0x0F0F0F0Fu : word & 0x0F0F0F0Fu;
        const kiln_u32 codes = lin_iq4_values(nibbles) ^ 0x80808080u;  // value + 128 per byte
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(codes, k), 8388736.0f);
            w[4 * j + k] = __fmul_rn(scale, q);
        }
    }
#elif W_T == 13
    // Scale byte 8 half + 2 s + (l0 >= 16) of the block: y = (d * (sc & 15)) * q - dmin * (sc >> 4),
    // q the 2-bit field s of each quant byte.
    const float d = kiln_f16_to_f32((kiln_u16)(r.v[4] & 0xFFFFu));
    const float dmin = kiln_f16_to_f32((kiln_u16)(r.v[4] >> 16));
    const int index = 2 * s + ((p & 3) >> 1);
    const kiln_u32 sc = lin_byte(index < 4 ? r.v[2] : r.v[3], index & 3);
    const float dl = __fmul_rn(d, __fsub_rn(lin_biased(sc & 0xFu), 8388608.0f));
    const float ml = __fmul_rn(dmin, __fsub_rn(lin_biased(sc >> 4), 8388608.0f));
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        const kiln_u32 q2 = (r.v[jj] >> (2 * s)) & 0x03030303u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(q2, k), 8388608.0f);
            w[4 * jj + k] = __fsub_rn(__fmul_rn(dl, q), ml);
        }
    }
#elif W_T == 14
    // Scale 8 half + 2 s + (l0 >= 16) of the 16 six-bit scales: its low 4 bits from packed word
    // (g & 1) (g = the scale / 4; the high nibbles for g >= 2), its high 2 from word 2.
    // y = (d * (scale - 32)) * (q - 4), q + 4 = the 2-bit field s | (high-bit set ? 4 : 0), the
    // high bit being bit 4 half + s of the value's hmask byte.
    const float d = kiln_f16_to_f32((kiln_u16)r.v[7]);
    const int half = (p & 7) >> 2;
    const int index = 8 * half + 2 * s + ((p & 3) >> 1), g = index >> 2, b = index & 3;
    const kiln_u32 low4 = (lin_byte(r.v[4 + (g & 1)], b) >> (4 * (g >> 1))) & 0xFu;
    const kiln_u32 high2 = (lin_byte(r.v[6], b) >> (2 * g)) & 3u;
    const float dl = __fmul_rn(d, __fsub_rn(lin_biased(low4 | (high2 << 4)), 8388640.0f));  // - 32
    const int bit = 4 * half + s;
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        const kiln_u32 q3 = ((r.v[jj] >> (2 * s)) & 0x03030303u) | (((r.v[2 + jj] >> bit) & 0x01010101u) << 2);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(q3, k), 8388612.0f);  // 2^23 + 4
            w[4 * jj + k] = __fmul_rn(dl, q);
        }
    }
#else
    // y = (d * sc) * (q - 32), q = 4 bits of ql | 2 bits of qh << 4; group s takes ql[l0 + 32 (s % 2)],
    // its low nibbles for s < 2, and bits 2s, 2s + 1 of qh.
    const float d = kiln_f16_to_f32((kiln_u16)r.v[8]);
    const int index = ((p & 3) >> 1) + 2 * s;  // scale byte of the half: l0 / 16 + 2 s
    const int sc = (int)(signed char)lin_byte(index < 4 ? r.v[6] : r.v[7], index & 3);
    const float scale = __fmul_rn(d, (float)sc);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        const kiln_u32 ql = r.v[2 * (s & 1) + jj];
        const kiln_u32 low = (s >> 1) ? (ql >> 4) & 0x0F0F0F0Fu : ql & 0x0F0F0F0Fu;
        const kiln_u32 high = ((r.v[4 + jj] >> (2 * s)) & 0x03030303u) << 4;
        const kiln_u32 q6 = low | high;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = __fsub_rn(lin_biased_byte(q6, k), 8388640.0f);
            w[4 * jj + k] = __fmul_rn(scale, q);
        }
    }
#endif
}

#if W_T == 3 || W_T == 4
// Q8_0 and Q4_0 as integers and one scale: group s of the piece is d times the 8 values
// lin_integers gives, exactly, so a product can sum q x over the piece and multiply by d once.
#define LIN_FACTORED 1
__device__ __forceinline__ float lin_scale(const LinRaw& r) { return kiln_f16_to_f32((kiln_u16)r.v[0]); }

__device__ __forceinline__ void lin_integers(const LinRaw& r, int s, float q[8]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#if W_T == 3
        const kiln_u32 word = r.v[1 + 2 * s + j] ^ 0x80808080u;  // q + 128 per byte
#pragma unroll
        for (int k = 0; k < 4; ++k) q[4 * j + k] = __fsub_rn(lin_biased_byte(word, k), 8388736.0f);
#else
        const kiln_u32 word = r.v[1 + 2 * (s & 1) + j];
        const kiln_u32 nibbles = (s >> 1) ? (word >> 4) & 0x0F0F0F0Fu : word & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; ++k) q[4 * j + k] = __fsub_rn(lin_biased_byte(nibbles, k), 8388616.0f);
#endif
    }
}
#else
#define LIN_FACTORED 0
#endif

// ---- the matrix-vector product ---------------------------------------------------------------

// 8 x values of token row `x` from element e.
__device__ __forceinline__ void lin_load_x8(const void* x, long long offset, float xv[8]) {
#if X_T == 0
    const float* p = reinterpret_cast<const float*>(x) + offset;
    const float4 a = lin_load_x4(p), b = lin_load_x4(p + 4);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
#else
    const uint4 q = lin_load_xb(reinterpret_cast<const kiln_u16*>(x) + offset);
    const kiln_u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        xv[2 * k] = __uint_as_float(words[k] << 16);
        xv[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
    }
#endif
}

// 4 x values of token row `x` from element `offset` (a multiple of 4), as floats.
__device__ __forceinline__ float4 lin_load_x4_any(const void* x, long long offset) {
#if X_T == 0
    return lin_load_x4(reinterpret_cast<const float*>(x) + offset);
#else
    kiln_u32 a, b;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(reinterpret_cast<const kiln_u16*>(x) + offset));
    return make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xFFFF0000u), __uint_as_float(b << 16),
                       __uint_as_float(b & 0xFFFF0000u));
#endif
}

// Copies pieces c0 .. c0 + cn of every token's x into xs (the layout above CHUNK_P). Each thread
// issues up to 8 loads before its first store, so the copy costs about one L2 round trip per 8
// quads a thread, not one per quad.
__device__ __forceinline__ void lin_stage_x(float* xs, const void* x, int cols, int c0, int cn) {
    const int total = TOKENS * QUADS * cn;
    for (int first = threadIdx.x; first < total; first += 8 * THREADS) {
        float4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int n = first + k * THREADS;
            if (n < total) {
                const int q = n % QUADS, rest = n / QUADS;
                const int l = rest % cn, t = rest / cn;
                v[k] = lin_load_x4_any(x, (long long)t * cols + lin_piece_element(c0 + l, q >> 1) + 4 * (q & 1));
            }
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int n = first + k * THREADS;
            if (n < total) {
                const int q = n % QUADS, rest = n / QUADS;
                const int l = rest % cn, t = rest / cn;
                *reinterpret_cast<float4*>(xs + t * XS_TOKEN + q * XS_STRIDE + 4 * l) = v[k];
            }
        }
    }
}

// The 8 x values of group s of local piece l of token t, from xs.
__device__ __forceinline__ void lin_staged_x8(const float* xs, int t, int l, int s, float xv[8]) {
    const float4 a = *reinterpret_cast<const float4*>(xs + t * XS_TOKEN + (2 * s) * XS_STRIDE + 4 * l);
    const float4 b = *reinterpret_cast<const float4*>(xs + t * XS_TOKEN + (2 * s + 1) * XS_STRIDE + 4 * l);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
}

// One transposed step of the warp reduction: C sums per lane become C / 2, the lane keeping the
// lower or upper half by its bit O and adding its partner's copy of that half.
template <int C, int O>
struct LinReduceStep {
    static __device__ __forceinline__ void run(float* s, int lane) {
        const bool upper = (lane & O) != 0;
#pragma unroll
        for (int k = 0; k < C / 2; ++k) {
            const float send = upper ? s[k] : s[k + C / 2];
            const float keep = upper ? s[k + C / 2] : s[k];
            s[k] = keep + __shfl_xor_sync(KILN_FULL_MASK, send, O);
        }
        LinReduceStep<C / 2, O / 2>::run(s, lane);
    }
};
template <int O>
struct LinReduceStep<1, O> {
    static __device__ __forceinline__ void run(float*, int) {}
};

// The warp sums of N slots: afterwards lane L holds the sum of slot L / (32 / N) (complete in the
// lanes with L % (32 / N) == 0).
template <int N>
__device__ __forceinline__ float lin_reduce_slots(float* s, int lane) {
    LinReduceStep<N, 16>::run(s, lane);
    float v = s[0];
#pragma unroll
    for (int o = 16 / N; o > 0; o >>= 1) v += __shfl_xor_sync(KILN_FULL_MASK, v, o);
    return v;
}

// The pieces c0 + base + u THREADS (u < UNROLL) of every weight row, zeros past local piece cn.
__device__ __forceinline__ void lin_load_round(LinRaw (&raw)[UNROLL][WROWS], const kiln_u8* const (&wrow)[WROWS],
                                               int c0, int base, int cn) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int l = base + u * THREADS;
#pragma unroll
        for (int i = 0; i < WROWS; ++i) {
            if (l < cn) {
                lin_load_piece(wrow[i], c0 + l, raw[u][i]);
            } else {
#pragma unroll
                for (int k = 0; k < RAW_WORDS; ++k) raw[u][i].v[k] = 0u;
            }
        }
    }
}

// acc += the products of the round's pieces (local pieces base + u THREADS below cn of the chunk
// at piece c0) with x: from global memory at `x`, or staged at `x` (STAGE).
__device__ __forceinline__ void lin_product_round(float (&acc)[WROWS][TOKENS], const LinRaw (&raw)[UNROLL][WROWS],
                                                  const void* x, int cols, int c0, int base, int cn) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int l = base + u * THREADS;
        if (l < cn) {
#if STAGE && TOKENS <= 2 && LIN_FACTORED
            // Q8_0, Q4_0: the piece's sums of q x per weight row and token, times d once (one
            // multiplication per value fewer). x of every token first (shared-memory reads, cheap
            // to keep), then one weight row at a time: 8 decoded values live, not 8 per row.
            float part[WROWS][TOKENS];
#pragma unroll
            for (int i = 0; i < WROWS; ++i)
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) part[i][t] = 0.0f;
#pragma unroll
            for (int s = 0; s < SUBS; ++s) {
                float xv[TOKENS][8];
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) lin_staged_x8(reinterpret_cast<const float*>(x), t, l, s, xv[t]);
#pragma unroll
                for (int i = 0; i < WROWS; ++i) {
                    float q[8];
                    lin_integers(raw[u][i], s, q);
#pragma unroll
                    for (int t = 0; t < TOKENS; ++t)
#pragma unroll
                        for (int k = 0; k < 8; ++k) part[i][t] = __fmaf_rn(q[k], xv[t][k], part[i][t]);
                }
            }
#pragma unroll
            for (int i = 0; i < WROWS; ++i) {
                const float d = lin_scale(raw[u][i]);
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) acc[i][t] = __fmaf_rn(d, part[i][t], acc[i][t]);
            }
#elif STAGE && TOKENS <= 2
            // x of every token first, then one weight row at a time (as above).
            const int p = c0 + l;
#pragma unroll
            for (int s = 0; s < SUBS; ++s) {
                float xv[TOKENS][8];
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) lin_staged_x8(reinterpret_cast<const float*>(x), t, l, s, xv[t]);
#pragma unroll
                for (int i = 0; i < WROWS; ++i) {
                    float w[8];
                    lin_decode(raw[u][i], p, s, w);
#pragma unroll
                    for (int t = 0; t < TOKENS; ++t)
#pragma unroll
                        for (int k = 0; k < 8; ++k) acc[i][t] = __fmaf_rn(w[k], xv[t][k], acc[i][t]);
                }
            }
#else
            // Every weight row's 8 values first, then one token's x at a time.
            const int p = c0 + l;
#pragma unroll
            for (int s = 0; s < SUBS; ++s) {
                float w[WROWS][8];
#pragma unroll
                for (int i = 0; i < WROWS; ++i) lin_decode(raw[u][i], p, s, w[i]);
#if !STAGE
                const long long e = lin_piece_element(p, s);
#endif
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) {
                    float xv[8];
#if STAGE
                    lin_staged_x8(reinterpret_cast<const float*>(x), t, l, s, xv);
#else
                    lin_load_x8(x, (long long)t * cols + e, xv);
#endif
#pragma unroll
                    for (int i = 0; i < WROWS; ++i)
#pragma unroll
                        for (int k = 0; k < 8; ++k) acc[i][t] = __fmaf_rn(w[i][k], xv[k], acc[i][t]);
                }
            }
#endif
        }
    }
}

// silu(g) * u, with the accurate expf.
__device__ __forceinline__ float lin_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

#if !MMA
extern "C" __global__ void __launch_bounds__(THREADS)
kiln_linear(const kiln_u8* __restrict__ weight, const float* __restrict__ bias, const void* __restrict__ x,
            float* __restrict__ out, int rows, int cols, long long row_bytes) {
    __shared__ float partial[WARPS][SLOTS_P2];
#if STAGE
    __shared__ __align__(16) float xs[TOKENS * XS_TOKEN];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long r0 = (long long)blockIdx.x * ROWS;
    const int pieces = cols / PIECE;

    // Weight row of slot i: gate rows first (i < ROWS), then up rows; rows past the end repeat
    // the last one (their sums are dropped).
    const kiln_u8* wrow[WROWS];
#pragma unroll
    for (int i = 0; i < WROWS; ++i) {
        long long o = r0 + (i % ROWS);
        o = o < rows ? o : rows - 1;
        wrow[i] = weight + ((long long)(i / ROWS) * rows + o) * row_bytes;
    }

    float acc[WROWS][TOKENS];
#pragma unroll
    for (int i = 0; i < WROWS; ++i)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) acc[i][t] = 0.0f;

#if STAGE
    // Chunks of CHUNK_P pieces. The first round of weight loads of a chunk is issued before x is
    // staged, so the staging overlaps their latency.
    // The first chunk's first weights are requested before the wait for the kernel before (they
    // overlap its end); x only after it.
    if (pieces <= 0) kiln_wait_prior();
    for (int c0 = 0; c0 < pieces; c0 += CHUNK_P) {
        const int cn = min(CHUNK_P, pieces - c0);
        int base = threadIdx.x;
        LinRaw raw[UNROLL][WROWS];
        lin_load_round(raw, wrow, c0, base, cn);
        if (c0 == 0) kiln_wait_prior();
        __syncthreads();  // every thread has read the previous chunk
        lin_stage_x(xs, x, cols, c0, cn);
        __syncthreads();
        while (base < cn) {
            lin_product_round(acc, raw, xs, cols, c0, base, cn);
            base += UNROLL * THREADS;
            if (base < cn) lin_load_round(raw, wrow, c0, base, cn);
        }
    }
#else
    // At one token the first round of weights is requested before the wait for the kernel before
    // (it overlaps that kernel's end); x only after it. A thread without a piece waits all the
    // same. With more tokens the wait comes first (the registers are fuller).
    if (TOKENS > 1 || (int)threadIdx.x >= pieces) kiln_wait_prior();
    for (int base = threadIdx.x; base < pieces; base += UNROLL * THREADS) {
        LinRaw raw[UNROLL][WROWS];
        lin_load_round(raw, wrow, 0, base, pieces);
        if (TOKENS == 1 && base == (int)threadIdx.x) kiln_wait_prior();
        lin_product_round(acc, raw, x, cols, 0, base, pieces);
    }
#endif

    // Warp sums, slot = i * TOKENS + t, in groups of at most 32 slots.
    float s[SLOTS_P2];
#pragma unroll
    for (int k = 0; k < SLOTS_P2; ++k) s[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < WROWS; ++i)
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) s[i * TOKENS + t] = acc[i][t];
#pragma unroll
    for (int g = 0; g < SLOTS_P2 / GROUP_SLOTS; ++g) {
        const float v = lin_reduce_slots<GROUP_SLOTS>(s + g * GROUP_SLOTS, lane);
        const int per = 32 / GROUP_SLOTS;
        if ((lane & (per - 1)) == 0) partial[warp][g * GROUP_SLOTS + lane / per] = v;
    }
    __syncthreads();

    for (int j = threadIdx.x; j < ROWS * TOKENS; j += THREADS) {
        const int i = j / TOKENS, t = j % TOKENS;
        const long long o = r0 + i;
        if (o >= rows) continue;
        float y = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += partial[w][i * TOKENS + t];
        float* dst = out + (long long)t * rows + o;
#if EPI == 2
        float up = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) up += partial[w][(ROWS + i) * TOKENS + t];
        *dst = lin_swiglu(y, up);
#else
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
#else
// ---- the tensor-core path (MMA = 1): bf16 / f16 weights, 2..8 tokens --------------------------
// out^T (ROWS x tokens) = W (ROWS x cols) x^T (cols x tokens) in mma.m16n8k16 tiles: 16 weight rows
// x 16 columns the A operand, the tokens' x (16 columns x 8 tokens; columns past TOKENS are computed
// on token 0's x and dropped) the B operand, fp32 accumulators. At 8 tokens the CUDA-core path
// spends one FMA per weight value and token and is bound by them (2.4 of 4.2 TB/s on an H200);
// here the tensor cores take the products and the lanes only split x.
//
// Fragments from 16-byte loads: the sum over k may run in any order as long as A and B agree, so
// lane (g, t) (g = lane / 4, t = lane % 4) of a 32-column step at column c loads columns
// c + 8t .. c + 8t + 8 of rows g and g + 8 of each tile (two 16-byte loads a tile) and of x of
// token g. Words 0, 1 of those 8 columns are the first mma's k = (2t, 2t + 1) and (2t + 8, 2t + 9)
// (a[0] / a[1] rows g / g + 8, a[2] / a[3] the same rows, b[0], b[1]); words 2, 3 the second's.
// A warp's load of a tile covers 64 consecutive bytes of each of 16 rows (whole 32-byte sectors).
//
// Exactness: the tensor cores multiply 16-bit operands exactly, so x (fp32) is split into 16-bit
// parts that sum to x, or to within 2^-22 |x|:
// - bf16 weights: x = hi + mid + lo, each the top 16 bits of what is left (truncation): x - hi is
//   x's low 16 mantissa bits, exact in fp32; mid takes its top 8 significant bits and the rest, at
//   most 8 significant bits, is lo exactly. Three mma per tile (two parts would leave up to
//   2^-16 |x|, over the 2e-6 relative tolerance); bf16 x is one part as it is.
// - f16 weights (mma takes f16 with f16 only: 11 significant bits, largest 65504): each step
//   scales a token's x by the power of two that brings the largest |x| of its 32 columns into
//   [2^14, 2^15) (exact, no overflow), then hi = f16(x 2^e) and mid = f16(x 2^e - hi), rounded to
//   nearest; what is left is at most 2^-22 |x| (in f16's subnormal range 2^-25 2^-e, under 2^-39
//   of the step's largest |x|). bf16 x scaled is one f16 part, exact bar that subnormal range.
//   The step's sums are multiplied back by 2^-e (exact) as they are added.
// Each step's mma chain starts from zero, the smaller parts first, and its 32-column sums are
// added to fp32 accumulators with ordinary rounding, so the tensor cores' own rounding of a chain
// (a few units of fp32 of the step's partial sums) never compounds over the row.
//
// Work split: a block owns ROWS (16 or 32) output rows (MT tiles, and as many up-row tiles for
// SwiGLU); its warps take UNROLL consecutive 32-column steps each in turn, issuing every load of
// them (2 x UNROLL x tiles 16-byte weight loads a lane) before the first mma; the steps after the
// last whole round of the block go one at a time, loads past the row's end skipped. The warps'
// sums go to shared memory and are added in warp order (no atomics), then the epilogue.
//
// Cost (sm_90 SASS, bf16 weights, f32 x, 16 rows, UNROLL 4): 342 instructions a round, 85 per
// 32-column step (1 KB of weights a warp: 6 HMMA, 4 16-byte loads, 44 for the split, the rest
// operand moves and adds); the memory floor leaves about 240 a KB per SM, so issue is not the
// bound. x is read once per block (f32 x at 8 tokens: as many bytes as 16 weight rows; 32 rows or
// SwiGLU halve that), from L2 or L1.

static_assert(W_T == 1 || W_T == 2, "the mma path takes bf16 or f16 weights");
static_assert(ROWS == 16 || ROWS == 32, "the mma path takes 16 or 32 rows a block");
#define MT (ROWS / 16)
#define TILES (MT * GATES)
#if X_T == 1
#define PARTS 1
#elif W_T == 1
#define PARTS 3
#else
#define PARTS 2
#endif
#define XWORDS (X_T == 0 ? 8 : 4)

// D += A B, f16 inputs, f32 accumulators (the fragment layouts of kiln_mma_bf16_16816).
__device__ __forceinline__ void lin_mma_f16_16816(float (&d)[4], const kiln_u32 (&a)[4], kiln_u32 b0, kiln_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 rounded to nearest even into an f16 pair, `low` in the low half.
__device__ __forceinline__ kiln_u32 lin_pack_f16x2(float low, float high) {
    kiln_u32 packed;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

__device__ __forceinline__ kiln_u32 lin_word(const uint4& v, int k) {
    return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}

// The top 16 bits of two floats as a 16-bit pair, `low` in the low half (bf16 by truncation).
__device__ __forceinline__ kiln_u32 lin_top_halves(float low, float high) {
    return __byte_perm(__float_as_uint(low), __float_as_uint(high), 0x7632u);
}

// The B operands of one step from this lane's 8 x values (raw words of token g): part p's word j
// holds columns 8t + 2j, 8t + 2j + 1, part 0 the largest. Returns the factor that undoes the
// step's scaling of token g (f16 weights; 1 for bf16). Every lane of the warp must call it.
__device__ __forceinline__ float lin_mma_operands(const kiln_u32 (&xw)[XWORDS], kiln_u32 (&b)[PARTS][4]) {
#if W_T == 1 && X_T == 1
#pragma unroll
    for (int j = 0; j < 4; ++j) b[0][j] = xw[j];
    return 1.0f;
#elif W_T == 1
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float x0 = __uint_as_float(xw[2 * j]), x1 = __uint_as_float(xw[2 * j + 1]);
        const float r0 = __fsub_rn(x0, __uint_as_float(xw[2 * j] & 0xFFFF0000u));
        const float r1 = __fsub_rn(x1, __uint_as_float(xw[2 * j + 1] & 0xFFFF0000u));
        const float l0 = __fsub_rn(r0, __uint_as_float(__float_as_uint(r0) & 0xFFFF0000u));
        const float l1 = __fsub_rn(r1, __uint_as_float(__float_as_uint(r1) & 0xFFFF0000u));
        b[0][j] = lin_top_halves(x0, x1);
        b[1][j] = lin_top_halves(r0, r1);
        b[2][j] = lin_top_halves(l0, l1);
    }
    return 1.0f;
#else
    float v[8];
#pragma unroll
    for (int k = 0; k < XWORDS; ++k) {
#if X_T == 0
        v[k] = __uint_as_float(xw[k]);
#else
        v[2 * k] = __uint_as_float(xw[k] << 16);
        v[2 * k + 1] = __uint_as_float(xw[k] & 0xFFFF0000u);
#endif
    }
    // The largest |x| of token g's 32 columns (lanes 4g .. 4g + 3); a NaN drops out of the
    // maximum but not out of the product.
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
    m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 1));
    m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 2));
    // m < 2^(E - 126) for its biased exponent E: 2^(141 - E) brings it under 2^15. E is clamped so
    // that the scale and its inverse are normal floats (x below 2^-112 stays far from them).
    const int exponent = min(max((int)(__float_as_uint(m) >> 23), 15), 254);
    const float scale = __uint_as_float((kiln_u32)(268 - exponent) << 23);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float s0 = __fmul_rn(v[2 * j], scale), s1 = __fmul_rn(v[2 * j + 1], scale);
        const kiln_u32 hi = lin_pack_f16x2(s0, s1);
        b[0][j] = hi;
#if PARTS == 2
        const float r0 = __fsub_rn(s0, kiln_f16_to_f32((kiln_u16)(hi & 0xFFFFu)));
        const float r1 = __fsub_rn(s1, kiln_f16_to_f32((kiln_u16)(hi >> 16)));
        b[1][j] = lin_pack_f16x2(r0, r1);
#endif
    }
    return __uint_as_float((kiln_u32)(exponent - 14) << 23);
#endif
}

// One round: U consecutive 32-column steps from step s0, every load issued before the first mma.
// CHECKED: chunks past the row's end (4 s + t >= chunks) load nothing and count as zeros.
template <int U, bool CHECKED>
__device__ __forceinline__ void lin_mma_round(float (&acc)[TILES][4], const kiln_u8* const (&wrow)[TILES][2],
                                              const void* x, long long x_offset, int s0, int chunks, int t) {
    uint4 wv[U][TILES][2];
    kiln_u32 xw[U][XWORDS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int s = s0 + u;
        const bool valid = !CHECKED || 4 * s + t < chunks;
#pragma unroll
        for (int i = 0; i < TILES; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                wv[u][i][h] = valid ? lin_load_stream16(wrow[i][h] + 64ll * s) : make_uint4(0u, 0u, 0u, 0u);
        if (valid) {
#if X_T == 0
            const float* p = reinterpret_cast<const float*>(x) + x_offset + 32ll * s;
            const uint4 a = lin_load_xb(p), c = lin_load_xb(p + 4);
            xw[u][0] = a.x; xw[u][1] = a.y; xw[u][2] = a.z; xw[u][3] = a.w;
            xw[u][4] = c.x; xw[u][5] = c.y; xw[u][6] = c.z; xw[u][7] = c.w;
#else
            const uint4 q = lin_load_xb(reinterpret_cast<const kiln_u16*>(x) + x_offset + 32ll * s);
            xw[u][0] = q.x; xw[u][1] = q.y; xw[u][2] = q.z; xw[u][3] = q.w;
#endif
        } else {
#pragma unroll
            for (int k = 0; k < XWORDS; ++k) xw[u][k] = 0u;
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        kiln_u32 b[PARTS][4];
        const float unscale = lin_mma_operands(xw[u], b);
#if W_T == 2
        // The factors of this lane's output columns: tokens 2t and 2t + 1 (lanes 8t, 8t + 4).
        const float unscale0 = __shfl_sync(KILN_FULL_MASK, unscale, 8 * t);
        const float unscale1 = __shfl_sync(KILN_FULL_MASK, unscale, 8 * t + 4);
#else
        (void)unscale;
#endif
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int p = PARTS - 1; p >= 0; --p)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const kiln_u32 a[4] = {lin_word(wv[u][i][0], 2 * half), lin_word(wv[u][i][1], 2 * half),
                                           lin_word(wv[u][i][0], 2 * half + 1), lin_word(wv[u][i][1], 2 * half + 1)};
#if W_T == 1
                    kiln_mma_bf16_16816(d, a, b[p][2 * half], b[p][2 * half + 1]);
#else
                    lin_mma_f16_16816(d, a, b[p][2 * half], b[p][2 * half + 1]);
#endif
                }
#if W_T == 2
            acc[i][0] = __fmaf_rn(d[0], unscale0, acc[i][0]);
            acc[i][1] = __fmaf_rn(d[1], unscale1, acc[i][1]);
            acc[i][2] = __fmaf_rn(d[2], unscale0, acc[i][2]);
            acc[i][3] = __fmaf_rn(d[3], unscale1, acc[i][3]);
#else
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][k] = __fadd_rn(acc[i][k], d[k]);
#endif
        }
    }
}

// The minimum of one block per SM lets ptxas keep a round's loads in registers ahead of its first
// mma (about 130 registers at UNROLL 4, three blocks of 4 warps per SM); with the default target
// it sank each step's loads to just before that step's mma, leaving one step in flight.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_linear(const kiln_u8* __restrict__ weight, const float* __restrict__ bias, const void* __restrict__ x,
            float* __restrict__ out, int rows, int cols, long long row_bytes) {
    // Each warp's sums: [warp][row of the block: gate rows 0 .. ROWS, then up rows][token].
    __shared__ __align__(16) float partial[WARPS][TILES * 16][8];
    kiln_wait_prior();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long r0 = (long long)blockIdx.x * ROWS;

    // This lane's rows g and g + 8 of each tile (gate tiles, then up tiles) from its 16-byte chunk
    // of a step; rows past the end repeat the last one (their sums are dropped).
    const kiln_u8* wrow[TILES][2];
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            long long o = r0 + 16 * (i % MT) + g + 8 * h;
            o = o < rows ? o : rows - 1;
            wrow[i][h] = weight + ((long long)(i / MT) * rows + o) * row_bytes + 16 * t;
        }
    // x of token g from the same chunk. Lanes of tokens past TOKENS read token 0's: B's column n
    // only reaches D's column n, which is dropped for n >= TOKENS.
    const long long x_offset = (long long)(g < TOKENS ? g : 0) * cols + 8 * t;
    const int chunks = cols / 8;         // 16-byte chunks of a weight row
    const int steps = (chunks + 3) / 4;  // 32-column steps

    float acc[TILES][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[i][k] = 0.0f;

    // Whole rounds (every lane's chunks inside the row) load without conditions, so the compiler
    // keeps all of a round's loads ahead of its first mma; the last steps go one at a time.
    const int full_steps = chunks / 4;
    int base = 0;
    for (; base + WARPS * UNROLL <= full_steps; base += WARPS * UNROLL) {
        lin_mma_round<UNROLL, false>(acc, wrow, x, x_offset, base + warp * UNROLL, chunks, t);
    }
    for (int s = base + warp; s < steps; s += WARPS) lin_mma_round<1, true>(acc, wrow, x, x_offset, s, chunks, t);

    // c[0], c[1]: row g, tokens 2t, 2t + 1; c[2], c[3]: row g + 8.
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        *reinterpret_cast<float2*>(&partial[warp][16 * i + g][2 * t]) = make_float2(acc[i][0], acc[i][1]);
        *reinterpret_cast<float2*>(&partial[warp][16 * i + g + 8][2 * t]) = make_float2(acc[i][2], acc[i][3]);
    }
    __syncthreads();

    // Consecutive threads take consecutive rows of one token (coalesced stores).
    for (int j = threadIdx.x; j < ROWS * TOKENS; j += THREADS) {
        const int i = j % ROWS, token = j / ROWS;
        const long long o = r0 + i;
        if (o >= rows) continue;
        float y = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += partial[w][i][token];
        float* dst = out + (long long)token * rows + o;
#if EPI == 2
        float up = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) up += partial[w][ROWS + i][token];
        *dst = lin_swiglu(y, up);
#else
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
#endif

// ---- embedding rows, bf16 weights, fp32 -> bf16 ----------------------------------------------

// out[t] = row ids[t] of the table in fp32 (zeros for an id >= vocab); one thread per piece.
extern "C" __global__ void kiln_linear_embed(const kiln_u8* __restrict__ table, const kiln_u32* __restrict__ ids,
                                             float* __restrict__ out, long long vocab, int cols,
                                             long long row_bytes, long long tokens) {
    kiln_wait_prior();
    const long long pieces = cols / PIECE;
    for (long long n = kiln_global_index(); n < tokens * pieces; n += kiln_grid_stride()) {
        const long long t = n / pieces;
        const int p = (int)(n - t * pieces);
        const kiln_u32 id = ids[t];
        float* row = out + t * cols;
        LinRaw raw;
        if (id < vocab) lin_load_piece(table + (long long)id * row_bytes, p, raw);
#pragma unroll
        for (int s = 0; s < SUBS; ++s) {
            float w[8];
            if (id < vocab) {
                lin_decode(raw, p, s, w);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) w[k] = 0.0f;
            }
            float4* dst = reinterpret_cast<float4*>(row + lin_piece_element(p, s));
            dst[0] = make_float4(w[0], w[1], w[2], w[3]);
            dst[1] = make_float4(w[4], w[5], w[6], w[7]);
        }
    }
}

// out (rows x cols bf16) = the weights rounded to nearest even; one thread per piece.
extern "C" __global__ void kiln_linear_to_bf16(const kiln_u8* __restrict__ src, kiln_u16* __restrict__ out,
                                               long long rows, int cols, long long row_bytes) {
    kiln_wait_prior();
    const long long pieces = cols / PIECE;
    for (long long n = kiln_global_index(); n < rows * pieces; n += kiln_grid_stride()) {
        const long long r = n / pieces;
        const int p = (int)(n - r * pieces);
        LinRaw raw;
        lin_load_piece(src + r * row_bytes, p, raw);
#pragma unroll
        for (int s = 0; s < SUBS; ++s) {
            float w[8];
            lin_decode(raw, p, s, w);
            kiln_u32 packed[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                packed[k] = (kiln_u32)kiln_f32_to_bf16(w[2 * k]) | ((kiln_u32)kiln_f32_to_bf16(w[2 * k + 1]) << 16);
            }
            *reinterpret_cast<uint4*>(out + r * cols + lin_piece_element(p, s)) =
                make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
    }
}

// out[i] = bf16(src[i]), rounded to nearest even.
extern "C" __global__ void kiln_linear_f32_to_bf16(const float* __restrict__ src, kiln_u16* __restrict__ out,
                                                   long long count) {
    kiln_wait_prior();
    for (long long i = kiln_global_index(); i < count; i += kiln_grid_stride()) {
        out[i] = kiln_f32_to_bf16(src[i]);
    }
}
