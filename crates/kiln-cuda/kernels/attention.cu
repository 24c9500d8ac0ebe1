// Causal grouped-query attention over the paged KV cache, in the FlashAttention-2 manner: one
// kernel (kiln_attention) serves prefill (ragged sequences, chunks after cached positions) and
// decode (split along the context, flash-decoding, its partials combined in the same launch);
// with STREAMING = 1 the module holds instead the streaming decode kernel (kiln_attention_decode,
// one query token per sequence, described at its definition); plus the K/V append.
//
// Layouts (row-major, indices in elements; see kiln_core::ops::attention and kiln_engine::kv):
//   q, out        [query_token][q_head][HEAD_DIM] bf16; sequence b's query tokens are
//                 [query_offsets[b], query_offsets[b + 1])
//   k_cache,      [page][kv_head][slot][HEAD_DIM] bf16, page_tokens = 1 << page_shift slots;
//   v_cache       position p of sequence b is page page_ids[page_offsets[b] + (p >> page_shift)],
//                 slot p & (page_tokens - 1)
//   partial_out   [split][query_token][q_head][HEAD_DIM] f32, normalized by its own softmax sum
//   partial_lse   [split][query_token][q_head] f32, log2 of the split's softmax sum (in units of
//                 scale_log2 * q.k), -inf for a split that saw no key
// Query token i of sequence b (q_len tokens, context_lens[b] positions) is at position
// context - q_len + i and attends to positions 0..= that.
//
// Work: a thread block takes BLOCK_M = 16 * WARPS_M "rows" of one sequence and one KV head,
// where row r is (query token r / G, query head kv_head * G + r % G) with G = q_heads / kv_heads:
// the query heads of a group are packed into the rows, so each K/V tile is read once for all of
// them. It walks its key range in tiles of BLOCK_N = WARPS_N * WARP_KEYS keys, STAGES deep in
// shared memory by cp.async (16-byte copies, the page looked up per key row; `.L2::128B`, so a
// miss fetches the whole line: 1-3% more decode bandwidth on sm_90), S = Q K^T and
// O += P V on bf16 tensor cores (mma.m16n8k16, operands by ldmatrix: Q from rows padded by 16
// bytes, K and V from unpadded rows with their 16-byte chunks swizzled, kiln_kv_offset, so the
// eight row addresses of an 8x8 matrix hit distinct banks), with the online softmax
// in f32 between them. Prefill uses WARPS_N = 1 (each warp owns 16 rows and all keys of a tile);
// decode, whose rows are the G heads of one token, uses WARPS_M = 1 and splits each tile among
// WARPS_N warps, merged at the end in warp order through shared memory.
//
// Grid: x = row tile (reversed, so the longest causal tiles start first), y = kv_head * splits +
// split, z = sequence. A split s takes the keys [s * chunk, (s + 1) * chunk) with chunk = the
// context divided by `splits`, rounded up to BLOCK_N: the grid does not depend on the context
// length, so a captured decode step replays as the cache grows.
//
// Latency (what decode at short contexts is made of): Q and the first STAGES tiles are all in
// flight before the first wait, the page ids of a tile are read one tile ahead of its copies, and
// the splits are combined in the same launch (no second kernel): each split block writes its
// partial, then takes a ticket (an atomic counter per (sequence, row tile, kv head), a module
// global that every launch leaves at zero); the block that takes the last ticket combines all the
// partials in split order (on sm_90, the decode variants' grids of at most one block a
// multiprocessor at 2 to 8 splits run as clusters of a group's splits instead, and split 0
// combines from the others' shared memory: see TILED_CLUSTER_COMBINE).
// The combine reads every partial from memory in a fixed order, whichever block runs it, so the
// output is the same bits run to run. Decode variants (WARPS_M = 1) gather every split's log-sum
// in shared memory first, then read the partials TILED_COMBINE_BATCH at a time (a few round trips
// to L2 for 33 splits); the others combine in one online pass, 8 splits in flight. Launches of one module run in stream order (one stream per
// Gpu), so no two launches share a counter at the same time.
//
// Memory floor: K and V of the context read once per (sequence, kv head, row tile); q read and
// out written once. Decode reaches it (one row tile); prefill re-reads K/V once per row tile from
// L2, as FlashAttention-2 does.
#include "kiln_prelude.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef WARPS_M
#define WARPS_M 4
#endif
#ifndef WARPS_N
#define WARPS_N 1
#endif
#ifndef WARP_KEYS
#define WARP_KEYS 64
#endif
// K/V tiles in flight (shared-memory stages): 2, or 3 for the deep decode variants (two tiles in
// flight while one is computed; ops/attention.rs DECODE_DEEP, DECODE_WIDE_DEEP), or 1 for the
// alternating decode variants (WARPS_M = 1; ops/attention.rs DECODE_ALT, DECODE_ALT_WIDE): one K
// and one V buffer, each refilled as soon as every warp is done with it (a barrier), so the
// copies of a tile's V fly while its K is waited for and S = Q K^T computed, and those of the
// next tile's K while its V is waited for and O += P V made: two tiles in flight a block while
// it waits, in half the shared memory of two stages.
#ifndef STAGES
#define STAGES 2
#endif
// 1: compile the streaming decode kernel (kiln_attention_decode) instead of kiln_attention.
#ifndef STREAMING
#define STREAMING 0
#endif
// 1 (the tiled kernel, STAGES >= 2): the cache holds FP8 E4M3 rows with one fp32 scale each
// (`kiln_core::ops::attention::kv_fp8_row`): k_cache / v_cache are [page][kv_head][slot][HEAD_DIM]
// bytes and k_scales / v_scales [page][kv_head][slot]. Each tile's codes and scales are copied by
// cp.async into FP8_STAGES staging buffers, then widened exactly into the one 16-bit stage the
// products read: K to fp16 (against Q in fp16, each row scaled by a power of two), V to bf16
// (E4M3 values are fp16 and bf16 values); a key's K scale multiplies its scores, its V scale its
// probabilities (after the softmax sum, before they are rounded for O += P V).
#ifndef KV_FP8
#define KV_FP8 0
#endif
#if KV_FP8 && (STREAMING || HYBRID || STAGES < 2)
#error "KV_FP8 is the tiled kernel's, two stages or more"
#endif
// With KV_FP8 the cp.async pipeline runs FP8_STAGES tiles of codes deep (FP8 tiles are half the
// bytes: more of them keep as many bytes in flight), and one bf16 stage holds the tile being
// computed, widened from its codes; without it, STAGES bf16 stages do both.
#ifndef FP8_STAGES
#define FP8_STAGES 4
#endif
#define PIPE (KV_FP8 ? FP8_STAGES : STAGES)
#define BF16_STAGES (KV_FP8 ? 1 : STAGES)
// 1 (with STREAMING 0, WARPS_M 1, WARPS_N 4, WARP_KEYS 16): compile the hybrid decode kernel
// (kiln_attention_decode_hybrid) instead of kiln_attention: the streaming kernel's path where a
// split holds at most HYBRID_STREAM_CHUNK keys, the tiled kernel's (STAGES deep) past that.
#ifndef HYBRID
#define HYBRID 0
#endif
#ifndef HYBRID_STREAM_CHUNK
#define HYBRID_STREAM_CHUNK 512
#endif
// Ticket counters of the combine, one per (sequence, row tile, kv head) of a split launch; the
// launcher refuses a split grid with more groups.
#define KILN_ATTENTION_TICKETS 65536
// Partials in flight per thread in the combines that gather the log-sums first.
#define COMBINE_BATCH 32

#define THREADS (32 * WARPS_M * WARPS_N)
#define BLOCK_M (16 * WARPS_M)
#define BLOCK_N (WARPS_N * WARP_KEYS)
// A shared-memory row: HEAD_DIM bf16 plus 16 bytes of padding.
#define ROW (HEAD_DIM + 8)
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
// 16-byte chunks of one K (or V) tile each thread copies.
#define TILE_CHUNKS_PER_THREAD (BLOCK_N * CHUNKS_PER_ROW / THREADS)
// With KV_FP8: 16-byte chunks of a row of codes, and of one K (or V) tile each thread copies.
#define FP8_CHUNKS_PER_ROW (HEAD_DIM / 16)
#define FP8_TILE_CHUNKS (BLOCK_N * FP8_CHUNKS_PER_ROW / THREADS)
// The chunks each thread copies a tile (their page ids read one tile ahead), and with KV_FP8 one
// more id: the page of the tile's row `tid`, whose two scales this thread copies.
#define KV_CHUNKS (KV_FP8 ? FP8_TILE_CHUNKS : TILE_CHUNKS_PER_THREAD)
#define KV_CHUNKS_PER_ROW (KV_FP8 ? FP8_CHUNKS_PER_ROW : CHUNKS_PER_ROW)
#define KV_IDS (KV_CHUNKS + (KV_FP8 ? 1 : 0))
#define KILN_NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM is a multiple of 32");
static_assert(WARP_KEYS % 16 == 0, "WARP_KEYS is a multiple of 16");

struct alignas(16) kiln_chunk16 { kiln_u32 x, y, z, w; };

#if KV_FP8
static_assert((BLOCK_N * FP8_CHUNKS_PER_ROW) % THREADS == 0 && BLOCK_N <= THREADS,
              "an FP8 tile's chunks split evenly over the threads, and a thread copies a row's scales");
// 4 bytes by cp.async (through L1: the 16-byte .cg form has no 4-byte size); zeros when !valid.
KILN_DEVICE void kiln_cp_async_4(kiln_u32 shared_address, const void* global, bool valid) {
    int source_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_address), "l"(global), "r"(source_bytes)
                 : "memory");
}
// Two E4M3 codes (the low one in the low byte) as two bf16 values: every E4M3 value is a bf16
// value, so the widening is exact (sm_89 and later through fp16 in hardware).
KILN_DEVICE kiln_u32 kiln_e4m3x2_bf16x2(kiln_u32 codes) {
#if __CUDA_ARCH__ >= 890
    kiln_u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((kiln_u16)codes));
    return kiln_pack_bf16x2(kiln_f16_to_f32((kiln_u16)(h2 & 0xFFFFu)), kiln_f16_to_f32((kiln_u16)(h2 >> 16)));
#else
    return kiln_pack_bf16x2(kiln_e4m3_to_f32((kiln_u8)(codes & 0xFFu)), kiln_e4m3_to_f32((kiln_u8)((codes >> 8) & 0xFFu)));
#endif
}
// Two E4M3 codes (the low one in the low byte) as two fp16 values (exact; one conversion on
// sm_89 and later).
KILN_DEVICE kiln_u32 kiln_e4m3x2_f16x2(kiln_u32 codes) {
#if __CUDA_ARCH__ >= 890
    kiln_u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((kiln_u16)codes));
    return h2;
#else
    kiln_u32 h2;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;"
        : "=r"(h2)
        : "f"(kiln_e4m3_to_f32((kiln_u8)((codes >> 8) & 0xFFu))), "f"(kiln_e4m3_to_f32((kiln_u8)(codes & 0xFFu))));
    return h2;
#endif
}
// d += a b on fp16 tensor cores (m16n8k16, fp32 accumulators): Q (prescaled) against K codes.
KILN_DEVICE void kiln_mma_f16_16816(float (&d)[4], const kiln_u32 (&a)[4], kiln_u32 b0, kiln_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The E4M3 code of `value` (to nearest even, saturating to 448, NaN 0x7F: the prelude's
// kiln_f32_to_e4m3), in hardware on sm_89 and later.
KILN_DEVICE kiln_u32 kiln_e4m3_code(float value) {
#if __CUDA_ARCH__ >= 890
    kiln_u16 d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(value));
    return d & 0xFFu;
#else
    return kiln_f32_to_e4m3(value);
#endif
}
#endif

// The parameters of every attention kernel of this file (but the append), and their names.
#define KILN_ATTENTION_PARAMS                                                                                    \
    const kiln_u16 *__restrict__ q, const kiln_u16 *__restrict__ k_cache, const kiln_u16 *__restrict__ v_cache, \
        const kiln_i32 *__restrict__ query_offsets, const kiln_i32 *__restrict__ context_lens,                   \
        const kiln_i32 *__restrict__ page_offsets, const kiln_u32 *__restrict__ page_ids,                        \
        kiln_u16 *__restrict__ out, float *__restrict__ partial_out, float *__restrict__ partial_lse, int q_heads, \
        int kv_heads, int page_shift, float scale_log2, int splits, const float *__restrict__ k_scales,           \
        const float *__restrict__ v_scales
#define KILN_ATTENTION_ARGS                                                                                   \
    q, k_cache, v_cache, query_offsets, context_lens, page_offsets, page_ids, out, partial_out, partial_lse, \
        q_heads, kv_heads, page_shift, scale_log2, splits, k_scales, v_scales

// Zero at module load; each launch's last block of a group puts its counter back to zero.
__device__ kiln_u32 kiln_attention_tickets[KILN_ATTENTION_TICKETS];

#if !STREAMING
static_assert((BLOCK_N * CHUNKS_PER_ROW) % THREADS == 0, "a K/V tile splits evenly over the threads");
static_assert((BLOCK_M * CHUNKS_PER_ROW) % THREADS == 0, "a Q tile splits evenly over the threads");
// The merge of WARPS_N > 1 reuses the K/V buffers: WARPS_M * WARPS_N * 16 rows of HEAD_DIM + 4 f32.
static_assert(WARPS_N == 1 || WARPS_M * WARPS_N * 16 * (HEAD_DIM + 4) * 4 <= 2 * BF16_STAGES * BLOCK_N * ROW * 2,
              "merge fits in K/V");
static_assert(STAGES >= 2 || (STAGES == 1 && WARPS_M == 1), "at least two stages, or one (decode: K and V alternate)");
// The decode variants (one row tile of 16 rows) combine by gathering every split's log-sums into
// the K/V stages first, where the launcher's most splits (MAX_TILED_SPLITS) x 16 rows of f32 fit;
// the other variants combine in one online pass over the splits.
#define MAX_TILED_SPLITS 1024
#if WARPS_M == 1 && MAX_TILED_SPLITS * 16 * 4 <= 2 * BF16_STAGES * BLOCK_N * ROW * 2
#define TILED_GATHERED_COMBINE 1
// Partials in flight per thread there.
#define TILED_COMBINE_BATCH 24
#else
#define TILED_GATHERED_COMBINE 0
#endif
// The cluster combine (sm_90 and later, decode variants: one row tile): launched as clusters of
// the `splits` blocks of one (sequence, kv head) (`kiln_cuda::ops::attention`, up to 8), each
// block leaves its partial rows and log-sums in its own shared memory, and after a cluster barrier
// split 0 reads every split's through distributed shared memory, in split order, with the
// arithmetic of the gathered combine below (the same bits), and stores the output: no partials
// through L2, no fence, ticket or second round trip. A launch without clusters (the cluster is
// one block) takes the ticket.
#if TILED_GATHERED_COMBINE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TILED_CLUSTER_COMBINE 1
#else
#define TILED_CLUSTER_COMBINE 0
#endif
#if TILED_CLUSTER_COMBINE && KV_FP8
static_assert(16 * (HEAD_DIM + 1) * 4 <= 2 * FP8_STAGES * BLOCK_N * HEAD_DIM, "the cluster partials fit in the FP8 staging");
#elif TILED_CLUSTER_COMBINE
static_assert(WARPS_M * WARPS_N * 16 * (HEAD_DIM + 4) * 4 <= STAGES * BLOCK_N * ROW * 2,
              "the merge stays in the K stages, so the cluster partials can take the V stages");
static_assert(16 * (HEAD_DIM + 1) * 4 <= STAGES * BLOCK_N * ROW * 2, "the cluster partials fit in the V stages");
#endif
#if TILED_CLUSTER_COMBINE
KILN_DEVICE kiln_u32 kiln_cluster_blocks() {
    kiln_u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
// Every thread of every block of the cluster: shared-memory writes before it are seen by the
// cluster's reads after it.
KILN_DEVICE void kiln_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The shared::cluster address of `address` (this block's shared memory) in block `rank`.
KILN_DEVICE kiln_u32 kiln_cluster_map(kiln_u32 address, kiln_u32 rank) {
    kiln_u32 mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}
KILN_DEVICE float kiln_cluster_load_f32(kiln_u32 address) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(address) : "memory");
    return v;
}
KILN_DEVICE float4 kiln_cluster_load_f32x4(kiln_u32 address) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(address)
                 : "memory");
    return v;
}
#endif
// The decode variants run two blocks a multiprocessor (decode_splits counts on it); saying so
// lets the compiler give them the registers of the combine's batch (up to 255) instead of
// spilling under its own occupancy target.
#if WARPS_M == 1
#define TILED_LAUNCH_BOUNDS __launch_bounds__(THREADS, 2)
#else
#define TILED_LAUNCH_BOUNDS __launch_bounds__(THREADS)
#endif

// Element offset of 16-byte chunk c of row r of a K or V tile: rows of HEAD_DIM elements with no
// padding, chunk c stored at chunk c ^ (r & 7) of its row, so the eight rows an ldmatrix reads
// hit distinct banks, and every 128 bytes a warp copies from the cache fill one aligned 128-byte
// line of shared memory. (Rows padded by 16 bytes instead made the L2 see 1.5x the sectors of K
// and V requested at batch-8 decode, bench/results/2026-11-30-h200-late/e3 and e5.)
static_assert(HEAD_DIM % 64 == 0, "K/V rows of at least 8 chunks (the swizzle)");
KILN_DEVICE int kiln_kv_offset(int r, int c) { return r * HEAD_DIM + ((c ^ (r & 7)) << 3); }

// Dynamic shared memory (128-byte aligned): Q [BLOCK_M][ROW], then K [STAGES][BLOCK_N x ROW
// elements, the tile's rows at kiln_kv_offset], V the same (bf16). The body of kiln_attention
// (after the wait), and the hybrid kernel's long path.
KILN_DEVICE void kiln_attention_tiled(KILN_ATTENTION_PARAMS) {
    extern __shared__ __align__(128) kiln_chunk16 shared_tiles[];
    __shared__ int is_last_block;
    kiln_u16* q_smem = reinterpret_cast<kiln_u16*>(shared_tiles);
    kiln_u16* k_smem = q_smem + BLOCK_M * ROW;
    kiln_u16* v_smem = k_smem + BF16_STAGES * BLOCK_N * ROW;
#if KV_FP8
    // [pipe stage][row][HEAD_DIM] codes, then [pipe stage][row] scales, past the bf16 stage.
    kiln_u8* k8_smem = reinterpret_cast<kiln_u8*>(v_smem + BF16_STAGES * BLOCK_N * ROW);
    kiln_u8* v8_smem = k8_smem + PIPE * BLOCK_N * HEAD_DIM;
    float* ks_smem = reinterpret_cast<float*>(v8_smem + PIPE * BLOCK_N * HEAD_DIM);
    float* vs_smem = ks_smem + PIPE * BLOCK_N;
    const kiln_u8* k_codes = reinterpret_cast<const kiln_u8*>(k_cache);
    const kiln_u8* v_codes = reinterpret_cast<const kiln_u8*>(v_cache);
#endif

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int group = lane >> 2, thread_in_group = lane & 3;

    const int sequence = blockIdx.z;
    const int kv_head = blockIdx.y / splits, split = blockIdx.y % splits;
    const int q_begin = query_offsets[sequence];
    const int q_len = query_offsets[sequence + 1] - q_begin;
    const int context = context_lens[sequence];
    const int heads_per_group = q_heads / kv_heads;
    const int rows = q_len * heads_per_group;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;
    if (row0 >= rows) return;
    const int first_position = context - q_len;
    const int total_queries = query_offsets[gridDim.z];
    const kiln_u32* pages = page_ids + page_offsets[sequence];

    // This block's keys: the split's chunk, cut at the context and at the causal limit of its last row.
    const int last_row = min(rows, row0 + BLOCK_M) - 1;
    const int chunk = (((context + splits - 1) / splits) + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
    const int kv_begin = split * chunk;
    const int kv_end = min(min(context, kv_begin + chunk), first_position + last_row / heads_per_group + 1);
    const int tiles = kv_end > kv_begin ? (kv_end - kv_begin + BLOCK_N - 1) / BLOCK_N : 0;

    // Q rows into shared memory by cp.async (rows past the sequence are zeros): its own group,
    // issued first, so it flies beside the first K/V tiles instead of ahead of them.
#pragma unroll
    for (int i = 0; i < BLOCK_M * CHUNKS_PER_ROW / THREADS; ++i) {
        const int index = tid + i * THREADS;
        const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
        const int row = row0 + r;
        const bool valid = row < rows;
        const int token = valid ? row / heads_per_group : 0;
        const int head = kv_head * heads_per_group + (valid ? row % heads_per_group : 0);
        const kiln_u16* source = q + ((kiln_u64)(q_begin + token) * q_heads + head) * HEAD_DIM + c * 8;
        kiln_cp_async_16(kiln_smem_address(q_smem + r * ROW + c * 8), valid ? source : q, valid);
    }
    kiln_cp_async_commit();

    // The page of each K/V row this thread copies in tile `t` (0 past kv_end, not read). Read one
    // tile ahead of the copies, so the page-table load does not stall the copy it feeds.
    auto tile_pages = [&](int t, kiln_u32 (&ids)[KV_IDS]) {
        const int tile_start = kv_begin + t * BLOCK_N;
#pragma unroll
        for (int i = 0; i < KV_CHUNKS; ++i) {
            const int position = tile_start + (tid + i * THREADS) / KV_CHUNKS_PER_ROW;
            ids[i] = (t < tiles && position < kv_end) ? pages[position >> page_shift] : 0u;
        }
#if KV_FP8
        const int position = tile_start + tid;
        ids[KV_CHUNKS] = (t < tiles && tid < BLOCK_N && position < kv_end) ? pages[position >> page_shift] : 0u;
#endif
    };
#if STAGES > 1
    // K and V of tile `t` into buffer `stage`: 16-byte chunks, positions past kv_end zeroed.
    auto load_tile = [&](int t, int stage, const kiln_u32 (&ids)[KV_IDS]) {
        const int tile_start = kv_begin + t * BLOCK_N;
#if KV_FP8
        // Codes into the staging rows (plain [row][HEAD_DIM] bytes), scales beside them; rows
        // past kv_end zeroed (scores masked, probabilities 0).
#pragma unroll
        for (int i = 0; i < FP8_TILE_CHUNKS; ++i) {
            const int index = tid + i * THREADS;
            const int r = index / FP8_CHUNKS_PER_ROW, c = index % FP8_CHUNKS_PER_ROW;
            const int position = tile_start + r;
            const bool valid = position < kv_end;
            const kiln_u64 offset =
                (((kiln_u64)ids[i] * kv_heads + kv_head) << page_shift | (kiln_u64)(position & ((1 << page_shift) - 1))) *
                    HEAD_DIM +
                c * 16;
            const int smem_offset = (stage * BLOCK_N + r) * HEAD_DIM + c * 16;
            kiln_cp_async_16_line(kiln_smem_address(k8_smem + smem_offset), valid ? k_codes + offset : k_codes, valid);
            kiln_cp_async_16_line(kiln_smem_address(v8_smem + smem_offset), valid ? v_codes + offset : v_codes, valid);
        }
        if (tid < BLOCK_N) {
            const int position = tile_start + tid;
            const bool valid = position < kv_end;
            const kiln_u64 row = ((kiln_u64)ids[KV_CHUNKS] * kv_heads + kv_head) << page_shift |
                                 (kiln_u64)(position & ((1 << page_shift) - 1));
            kiln_cp_async_4(kiln_smem_address(ks_smem + stage * BLOCK_N + tid), valid ? k_scales + row : k_scales, valid);
            kiln_cp_async_4(kiln_smem_address(vs_smem + stage * BLOCK_N + tid), valid ? v_scales + row : v_scales, valid);
        }
#else
#pragma unroll
        for (int i = 0; i < TILE_CHUNKS_PER_THREAD; ++i) {
            const int index = tid + i * THREADS;
            const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
            const int position = tile_start + r;
            const bool valid = position < kv_end;
            const kiln_u64 offset =
                (((kiln_u64)ids[i] * kv_heads + kv_head) << page_shift | (kiln_u64)(position & ((1 << page_shift) - 1))) *
                    HEAD_DIM +
                c * 8;
            const int smem_offset = stage * BLOCK_N * ROW + kiln_kv_offset(r, c);
            kiln_cp_async_16_line(kiln_smem_address(k_smem + smem_offset), valid ? k_cache + offset : k_cache, valid);
            kiln_cp_async_16_line(kiln_smem_address(v_smem + smem_offset), valid ? v_cache + offset : v_cache, valid);
        }
#endif
    };
#if KV_FP8
    // The codes of pipe stage `stage` widened into the bf16 stage, in the swizzled layout the
    // products read: K to fp16 (one conversion for two codes; Q is fp16 too, see below), V to bf16
    // (E4M3 -> f16 -> f32 -> bf16), every step exact. Between two barriers.
    auto widen_tile = [&](int stage) {
#pragma unroll
        for (int i = 0; i < FP8_TILE_CHUNKS; ++i) {
            const int index = tid + i * THREADS;
            const int r = index / FP8_CHUNKS_PER_ROW, c = index % FP8_CHUNKS_PER_ROW;
            const int from = (stage * BLOCK_N + r) * HEAD_DIM + c * 16;
            const uint4 kc = *reinterpret_cast<const uint4*>(k8_smem + from);
            const uint4 vc = *reinterpret_cast<const uint4*>(v8_smem + from);
            const int to0 = kiln_kv_offset(r, 2 * c);
            const int to1 = kiln_kv_offset(r, 2 * c + 1);
            *reinterpret_cast<uint4*>(k_smem + to0) = make_uint4(kiln_e4m3x2_f16x2(kc.x & 0xFFFFu), kiln_e4m3x2_f16x2(kc.x >> 16),
                                                                 kiln_e4m3x2_f16x2(kc.y & 0xFFFFu), kiln_e4m3x2_f16x2(kc.y >> 16));
            *reinterpret_cast<uint4*>(k_smem + to1) = make_uint4(kiln_e4m3x2_f16x2(kc.z & 0xFFFFu), kiln_e4m3x2_f16x2(kc.z >> 16),
                                                                 kiln_e4m3x2_f16x2(kc.w & 0xFFFFu), kiln_e4m3x2_f16x2(kc.w >> 16));
            *reinterpret_cast<uint4*>(v_smem + to0) = make_uint4(kiln_e4m3x2_bf16x2(vc.x & 0xFFFFu), kiln_e4m3x2_bf16x2(vc.x >> 16),
                                                                 kiln_e4m3x2_bf16x2(vc.y & 0xFFFFu), kiln_e4m3x2_bf16x2(vc.y >> 16));
            *reinterpret_cast<uint4*>(v_smem + to1) = make_uint4(kiln_e4m3x2_bf16x2(vc.z & 0xFFFFu), kiln_e4m3x2_bf16x2(vc.z >> 16),
                                                                 kiln_e4m3x2_bf16x2(vc.w & 0xFFFFu), kiln_e4m3x2_bf16x2(vc.w >> 16));
        }
    };
#endif
#endif

#if STAGES == 1
    // One stage (decode): K of a tile or V of a tile in flight, never both (see the header).
    auto load_half = [&](int t, kiln_u16* smem, const kiln_u16* cache, const kiln_u32 (&ids)[TILE_CHUNKS_PER_THREAD]) {
        const int tile_start = kv_begin + t * BLOCK_N;
#pragma unroll
        for (int i = 0; i < TILE_CHUNKS_PER_THREAD; ++i) {
            const int index = tid + i * THREADS;
            const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
            const int position = tile_start + r;
            const bool valid = position < kv_end;
            const kiln_u64 offset =
                (((kiln_u64)ids[i] * kv_heads + kv_head) << page_shift | (kiln_u64)(position & ((1 << page_shift) - 1))) *
                    HEAD_DIM +
                c * 8;
            kiln_cp_async_16_line(kiln_smem_address(smem + kiln_kv_offset(r, c)), valid ? cache + offset : cache, valid);
        }
    };
    // K and V of tile 0 both in flight (both buffers are free), one commit group each, then the
    // pages of tile 1.
    kiln_u32 next_pages[TILE_CHUNKS_PER_THREAD];
    tile_pages(0, next_pages);
    if (tiles > 0) load_half(0, k_smem, k_cache, next_pages);
    kiln_cp_async_commit();
    if (tiles > 0) load_half(0, v_smem, v_cache, next_pages);
    kiln_cp_async_commit();
    tile_pages(1, next_pages);
    kiln_cp_async_wait<2>();
    __syncthreads();
#else
    // Tiles 0 .. PIPE - 2 in flight, one commit group each (empty groups past the last tile),
    // and the pages of tile PIPE - 1 read.
    kiln_u32 next_pages[KV_IDS];
    {
        // Every page id read before the first copy is issued (a copy's asm is a compiler barrier).
        kiln_u32 first_pages[PIPE - 1][KV_IDS];
#pragma unroll
        for (int t = 0; t < PIPE - 1; ++t) tile_pages(t, first_pages[t]);
        tile_pages(PIPE - 1, next_pages);
#pragma unroll
        for (int t = 0; t < PIPE - 1; ++t) {
            if (t < tiles) load_tile(t, t, first_pages[t]);
            kiln_cp_async_commit();
        }
    }

    // This warp's 16 rows of Q as A fragments, one per 16 columns (the Q group is complete when
    // at most the PIPE - 1 tile groups are pending).
    kiln_cp_async_wait<PIPE - 1>();
    __syncthreads();
#endif
#if KV_FP8
    // Q to fp16 for the fp16 products with K's codes: each row scaled by a power of two that
    // brings its largest |q| under 2^15 (exact: bf16 values are fp16 values in fp16's range), the
    // power put back on the row's scores with the K scale. Only values under 2^-24 in the scaled
    // row (2^-38 of its largest) lose bits (fp16 subnormals and zero).
    __shared__ float q_unscale[BLOCK_M];
    if (tid < BLOCK_M) {
        float amax = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS_PER_ROW; ++c) {
            const uint4 w = *reinterpret_cast<const uint4*>(q_smem + tid * ROW + c * 8);
            const kiln_u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                amax = fmaxf(amax, fabsf(__uint_as_float(words[i] << 16)));
                amax = fmaxf(amax, fabsf(__uint_as_float(words[i] & 0xFFFF0000u)));
            }
        }
        // 2^k with k = max(0, exponent(amax) - 14): the scaled row stays under 2^15.
        const int exponent = (int)((__float_as_uint(amax) >> 23) & 0xFFu) - 127;
        const int k = (amax <= 3.0e38f && exponent > 14) ? exponent - 14 : 0;
        q_unscale[tid] = __uint_as_float((kiln_u32)(127 + k) << 23);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < BLOCK_M * CHUNKS_PER_ROW / THREADS; ++i) {
        const int index = tid + i * THREADS;
        const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
        uint4* at = reinterpret_cast<uint4*>(q_smem + r * ROW + c * 8);
        const uint4 w = *at;
        const float scale = 1.0f / q_unscale[r];  // a power of two: exact
        const kiln_u32 words[4] = {w.x, w.y, w.z, w.w};
        kiln_u32 out[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            asm("cvt.rn.f16x2.f32 %0, %1, %2;"
                : "=r"(out[j])
                : "f"(__uint_as_float(words[j] & 0xFFFF0000u) * scale), "f"(__uint_as_float(words[j] << 16) * scale));
        }
        *at = make_uint4(out[0], out[1], out[2], out[3]);
    }
    __syncthreads();
    // This thread's two rows' powers (rows g and g + 8 of its warp's 16).
    const float q_power[2] = {q_unscale[warp_m * 16 + group], q_unscale[warp_m * 16 + group + 8]};
#endif
    kiln_u32 q_fragments[HEAD_DIM / 16][4];
    {
        const int r = warp_m * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int c = (lane >> 4) * 8;
#pragma unroll
        for (int kd = 0; kd < HEAD_DIM / 16; ++kd) {
            kiln_ldmatrix_x4(q_fragments[kd], kiln_smem_address(q_smem + r * ROW + kd * 16 + c));
        }
    }

    // The positions of this thread's two rows (g and g + 8); rows past the sequence take the
    // last position, so they see keys and stay finite (their output is not stored).
    int row_position[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = min(row0 + warp_m * 16 + group + h * 8, rows - 1);
        row_position[h] = first_position + row / heads_per_group;
    }
    const int min_position = first_position + row0 / heads_per_group;

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF};  // in units of scale_log2 * q.k
    float row_sum[2] = {0.0f, 0.0f};                  // this thread's columns only, until the end

    for (int t = 0; t < tiles; ++t) {
#if STAGES == 1
        // K of tile t has landed (V of tile t may still fly: groups complete in order) and every
        // warp sees it (this barrier).
        kiln_cp_async_wait<1>();
        __syncthreads();
#else
        // Tile t + STAGES - 1 into the stage tile t - 1 used (every warp is past it: the barrier
        // at the end of the previous iteration), then the pages of the tile after it.
        if (t + PIPE - 1 < tiles) load_tile(t + PIPE - 1, (t + PIPE - 1) % PIPE, next_pages);
        kiln_cp_async_commit();
        tile_pages(t + PIPE, next_pages);
        kiln_cp_async_wait<PIPE - 1>();
        __syncthreads();
#if KV_FP8
        widen_tile(t % PIPE);
        __syncthreads();
#endif
#endif

        // The bf16 stage the products read, and (FP8) the pipe stage of the tile's scales.
        const int stage = KV_FP8 ? 0 : t % STAGES;
        const int pipe_stage = t % PIPE;
        (void)pipe_stage;
        const int warp_key0 = warp_n * WARP_KEYS;  // within the tile
        const kiln_u16* k_tile = k_smem + stage * BLOCK_N * ROW;
        const kiln_u16* v_tile = v_smem + stage * BLOCK_N * ROW;

        // S = Q K^T over this warp's keys.
        float s[WARP_KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < WARP_KEYS / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const int key = warp_key0 + j * 8 + (lane & 7);
#pragma unroll
            for (int kd = 0; kd < HEAD_DIM / 16; kd += 2) {
                kiln_u32 b[4];
                kiln_ldmatrix_x4(b, kiln_smem_address(k_tile + kiln_kv_offset(key, kd * 2 + (lane >> 3))));
#if KV_FP8
                kiln_mma_f16_16816(s[j], q_fragments[kd], b[0], b[1]);
                kiln_mma_f16_16816(s[j], q_fragments[kd + 1], b[2], b[3]);
#else
                kiln_mma_bf16_16816(s[j], q_fragments[kd], b[0], b[1]);
                kiln_mma_bf16_16816(s[j], q_fragments[kd + 1], b[2], b[3]);
#endif
            }
        }

#if KV_FP8
        // Each key's K scale and each row's power of two on the scores.
#pragma unroll
        for (int j = 0; j < WARP_KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] *= ks_smem[pipe_stage * BLOCK_N + warp_key0 + j * 8 + 2 * thread_in_group + (e & 1)] * q_power[e >> 1];
            }
        }
#endif
        // Mask keys past a row's position or past kv_end, only where the tile reaches them.
        const int tile_start = kv_begin + t * BLOCK_N;
        if (tile_start + BLOCK_N > kv_end || tile_start + BLOCK_N - 1 > min_position) {
#pragma unroll
            for (int j = 0; j < WARP_KEYS / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = tile_start + warp_key0 + j * 8 + 2 * thread_in_group + (e & 1);
                    if (key > row_position[e >> 1] || key >= kv_end) s[j][e] = KILN_NEG_INF;
                }
            }
        }

#if STAGES == 1
        // Every warp is done with K of tile t (this barrier): K of tile t + 1 (next_pages holds
        // its pages) flies beside V of tile t, which is then waited for and seen by every warp.
        __syncthreads();
        if (t + 1 < tiles) load_half(t + 1, k_smem, k_cache, next_pages);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
#endif
        // Online softmax: new row maxima (over the quad that shares a row), rescale, exponentiate.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = KILN_NEG_INF;
#pragma unroll
            for (int j = 0; j < WARP_KEYS / 8; ++j) m = fmaxf(m, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
            m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 1));
            m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 2));
            const float new_max = fmaxf(row_max[h], m * scale_log2);
            // A row that has seen no key yet keeps -inf; subtracting 0 then gives 0 weights, not NaN.
            const float base = new_max == KILN_NEG_INF ? 0.0f : new_max;
            const float alpha = kiln_exp2_approx(row_max[h] - base);
            row_max[h] = new_max;
            row_sum[h] *= alpha;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
#pragma unroll
            for (int j = 0; j < WARP_KEYS / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = kiln_exp2_approx(fmaf(s[j][2 * h + e], scale_log2, -base));
                    s[j][2 * h + e] = p;
                    row_sum[h] += p;
                }
            }
        }

#if KV_FP8
        // Each key's V scale on its probabilities (the softmax sums above are of the plain ones).
#pragma unroll
        for (int j = 0; j < WARP_KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= vs_smem[pipe_stage * BLOCK_N + warp_key0 + j * 8 + 2 * thread_in_group + (e & 1)];
        }
#endif
        // O += P V: P from the S accumulators as A fragments, V by transposed ldmatrix.
#pragma unroll
        for (int kk = 0; kk < WARP_KEYS / 16; ++kk) {
            const kiln_u32 p[4] = {
                kiln_pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                kiln_pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                kiln_pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                kiln_pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
            const int key = warp_key0 + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int nd = 0; nd < HEAD_DIM / 16; ++nd) {
                kiln_u32 b[4];
                kiln_ldmatrix_x4_trans(b, kiln_smem_address(v_tile + kiln_kv_offset(key, nd * 2 + (lane >> 4))));
                kiln_mma_bf16_16816(o[2 * nd], p, b[0], b[1]);
                kiln_mma_bf16_16816(o[2 * nd + 1], p, b[2], b[3]);
            }
        }
        __syncthreads();
#if STAGES == 1
        // Every warp is done with V of tile t (the barrier above): V of tile t + 1 flies beside K
        // of tile t + 1, then the pages of tile t + 2 are read.
        if (t + 1 < tiles) load_half(t + 1, v_smem, v_cache, next_pages);
        kiln_cp_async_commit();
        tile_pages(t + 2, next_pages);
#endif
    }
    kiln_cp_async_wait<0>();

    // Row sums over the quad, in a fixed order.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 2);
    }

    // Stores two adjacent elements of a row: bf16 to out, or f32 with the lse to the partials.
#if TILED_CLUSTER_COMBINE
    // The block's partial rows [16][HEAD_DIM] and log-sums [16] for the cluster combine, in the V
    // stages (free past the last tile; the warps' merge uses the K stages and Q's rows).
    const bool cluster = splits > 1 && kiln_cluster_blocks() == (kiln_u32)splits;
#if KV_FP8
    float* cluster_part = reinterpret_cast<float*>(k8_smem);  // the FP8 staging, free past the last tile
#else
    float* cluster_part = reinterpret_cast<float*>(v_smem);
#endif
    float* cluster_lse = cluster_part + 16 * HEAD_DIM;
#endif
    auto store = [&](int row, int d, float v0, float v1, float sum, float max) {
        if (row >= rows) return;
        const int token = q_begin + row / heads_per_group;
        const int head = kv_head * heads_per_group + row % heads_per_group;
        const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
#if TILED_CLUSTER_COMBINE
        if (cluster) {
            *reinterpret_cast<float2*>(cluster_part + (row - row0) * HEAD_DIM + d) = make_float2(v0 * inverse, v1 * inverse);
            if (d == 0) cluster_lse[row - row0] = sum > 0.0f ? max + __log2f(sum) : KILN_NEG_INF;
            return;
        }
#endif
        if (splits == 1) {
            *reinterpret_cast<kiln_u32*>(out + ((kiln_u64)token * q_heads + head) * HEAD_DIM + d) =
                kiln_pack_bf16x2(v0 * inverse, v1 * inverse);
        } else {
            const kiln_u64 query_row = (kiln_u64)split * total_queries * q_heads + (kiln_u64)token * q_heads + head;
            *reinterpret_cast<float2*>(partial_out + query_row * HEAD_DIM + d) =
                make_float2(v0 * inverse, v1 * inverse);
            if (d == 0) partial_lse[query_row] = sum > 0.0f ? max + __log2f(sum) : KILN_NEG_INF;
        }
    };

    if (WARPS_N == 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + warp_m * 16 + group + h * 8;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                store(row, n * 8 + 2 * thread_in_group, o[n][2 * h], o[n][2 * h + 1], row_sum[h], row_max[h]);
            }
        }
    } else {
        // WARPS_N > 1: merge the warps' partial rows through shared memory, in warp order.
        float* merge = reinterpret_cast<float*>(k_smem);  // [WARPS_M][WARPS_N][16][HEAD_DIM + 4]
        float* maxima = reinterpret_cast<float*>(q_smem);  // [WARPS_M][WARPS_N][16]
        float* sums = maxima + WARPS_M * WARPS_N * 16;     // [WARPS_M][WARPS_N][16]
        __syncthreads();  // every warp has read its Q fragments and its last tile
        if (thread_in_group == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                maxima[warp * 16 + group + 8 * h] = row_max[h];
                sums[warp * 16 + group + 8 * h] = row_sum[h];
            }
        }
        __syncthreads();
        float total_sum[2], total_max[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = group + 8 * h;
            float m = KILN_NEG_INF;
            for (int w = 0; w < WARPS_N; ++w) m = fmaxf(m, maxima[(warp_m * WARPS_N + w) * 16 + r]);
            const float base = m == KILN_NEG_INF ? 0.0f : m;
            float l = 0.0f;
            for (int w = 0; w < WARPS_N; ++w) {
                const int i = (warp_m * WARPS_N + w) * 16 + r;
                l += sums[i] * kiln_exp2_approx(maxima[i] - base);
            }
            total_sum[h] = l;
            total_max[h] = m;
            const float factor = kiln_exp2_approx(row_max[h] - base);
            float* merge_row = merge + ((kiln_u64)warp * 16 + r) * (HEAD_DIM + 4);
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                *reinterpret_cast<float2*>(merge_row + n * 8 + 2 * thread_in_group) =
                    make_float2(o[n][2 * h] * factor, o[n][2 * h + 1] * factor);
            }
        }
        __syncthreads();
        // Warps with warp_n == 0 sum the rows of their warp_m group and store them.
        if (warp_n == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = group + 8 * h;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n) {
                    const int d = n * 8 + 2 * thread_in_group;
                    float v0 = 0.0f, v1 = 0.0f;
                    for (int w = 0; w < WARPS_N; ++w) {
                        const float2 part = *reinterpret_cast<const float2*>(
                            merge + ((kiln_u64)(warp_m * WARPS_N + w) * 16 + r) * (HEAD_DIM + 4) + d);
                        v0 += part.x;
                        v1 += part.y;
                    }
                    store(row0 + warp_m * 16 + r, d, v0, v1, total_sum[h], total_max[h]);
                }
            }
        }
    }
    if (splits == 1) return;

#if TILED_CLUSTER_COMBINE
    if (cluster) {
        kiln_cluster_sync();  // every split's partial rows are in its shared memory
        if (split == 0) {
            const int block_rows = min(rows - row0, BLOCK_M);
            const kiln_u32 part_base = kiln_smem_address(cluster_part);
            const kiln_u32 lse_base = kiln_smem_address(cluster_lse);
            for (int item = tid; item < block_rows * (HEAD_DIM / 4); item += THREADS) {
                const int r = item / (HEAD_DIM / 4), d = (item % (HEAD_DIM / 4)) * 4;
                const int row = row0 + r;
                const kiln_u64 query_row = (kiln_u64)(q_begin + row / heads_per_group) * q_heads +
                                           kv_head * heads_per_group + row % heads_per_group;
                float m = KILN_NEG_INF;
                for (int s = 0; s < splits; ++s) m = fmaxf(m, kiln_cluster_load_f32(kiln_cluster_map(lse_base + r * 4, s)));
                float denominator = 0.0f;
                float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int s = 0; s < splits; ++s) {
                    const float split_lse = kiln_cluster_load_f32(kiln_cluster_map(lse_base + r * 4, s));
                    if (split_lse != KILN_NEG_INF) {
                        const float4 part =
                            kiln_cluster_load_f32x4(kiln_cluster_map(part_base + (r * HEAD_DIM + d) * 4, s));
                        const float w = kiln_exp2_approx(split_lse - m);
                        denominator += w;
                        sum.x = fmaf(part.x, w, sum.x);
                        sum.y = fmaf(part.y, w, sum.y);
                        sum.z = fmaf(part.z, w, sum.z);
                        sum.w = fmaf(part.w, w, sum.w);
                    }
                }
                const float inverse = denominator > 0.0f ? 1.0f / denominator : 0.0f;
                *reinterpret_cast<uint2*>(out + query_row * HEAD_DIM + d) =
                    make_uint2(kiln_pack_bf16x2(sum.x * inverse, sum.y * inverse),
                               kiln_pack_bf16x2(sum.z * inverse, sum.w * inverse));
            }
        }
        kiln_cluster_sync();  // split 0 has read every partial before any block leaves
        return;
    }
#endif

    // The combine: the last block of this group to finish (a ticket) combines the splits.
    // Every thread fences its own partial stores before the ticket is taken.
    __threadfence();
    __syncthreads();
    const int ticket_index = (sequence * (int)gridDim.x + (int)blockIdx.x) * kv_heads + kv_head;
    if (tid == 0) {
        const kiln_u32 ticket = atomicAdd(&kiln_attention_tickets[ticket_index], 1u);
        is_last_block = ticket == (kiln_u32)splits - 1u;
        if (is_last_block) kiln_attention_tickets[ticket_index] = 0u;  // every split has taken its ticket
    }
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();

#if TILED_GATHERED_COMBINE
    // Decode tiles (one row tile of at most 16 rows): the streaming kernel's combine, a few
    // round trips to L2 whatever the splits. The log-sums of every split into shared memory (the
    // K/V stages are free: every warp is past the ticket's barrier), with the first TILED_COMBINE_BATCH
    // partials of this thread's first item already requested; then per item M = max_s lse_s and
    // out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - M), in split order (a split that saw no
    // key of a row has lse -inf and no weight).
    {
        const int block_rows = min(rows - row0, BLOCK_M);
        const kiln_u64 split_stride = (kiln_u64)total_queries * q_heads;
        const kiln_u64 split_floats = split_stride * HEAD_DIM;
        float* lse = reinterpret_cast<float*>(k_smem);  // [splits][block_rows]
        auto query_row_of = [&](int r) -> kiln_u64 {
            const int row = row0 + r;
            return (kiln_u64)(q_begin + row / heads_per_group) * q_heads + kv_head * heads_per_group +
                   row % heads_per_group;
        };
        // Item `item`'s 4 columns of split 0's partial; split s's are s * split_floats further.
        auto partials = [&](int item) -> const float* {
            return partial_out + query_row_of(item / (HEAD_DIM / 4)) * HEAD_DIM + (item % (HEAD_DIM / 4)) * 4;
        };
        const int items = block_rows * (HEAD_DIM / 4);
        float4 parts[TILED_COMBINE_BATCH];
        if (tid < items) {
            const float* first = partials(tid);
#pragma unroll
            for (int b = 0; b < TILED_COMBINE_BATCH; ++b) {
                if (b < splits) parts[b] = __ldcg(reinterpret_cast<const float4*>(first + b * split_floats));
            }
        }
        for (int i = tid; i < splits * block_rows; i += THREADS) {
            lse[i] = __ldcg(partial_lse + (i / block_rows) * split_stride + query_row_of(i % block_rows));
        }
        __syncthreads();
        for (int item = tid; item < items; item += THREADS) {
            const int r = item / (HEAD_DIM / 4), d = (item % (HEAD_DIM / 4)) * 4;
            float m = KILN_NEG_INF;
#pragma unroll 16
            for (int s = 0; s < splits; ++s) m = fmaxf(m, lse[s * block_rows + r]);
            float denominator = 0.0f;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int s0 = 0; s0 < splits; s0 += TILED_COMBINE_BATCH) {
                if (s0 > 0 || item != tid) {
                    const float* batch = partials(item) + s0 * split_floats;
#pragma unroll
                    for (int b = 0; b < TILED_COMBINE_BATCH; ++b) {
                        if (s0 + b < splits) parts[b] = __ldcg(reinterpret_cast<const float4*>(batch + b * split_floats));
                    }
                }
#pragma unroll
                for (int b = 0; b < TILED_COMBINE_BATCH; ++b) {
                    const float split_lse = s0 + b < splits ? lse[(s0 + b) * block_rows + r] : KILN_NEG_INF;
                    if (split_lse != KILN_NEG_INF) {
                        const float w = kiln_exp2_approx(split_lse - m);
                        denominator += w;
                        sum.x = fmaf(parts[b].x, w, sum.x);
                        sum.y = fmaf(parts[b].y, w, sum.y);
                        sum.z = fmaf(parts[b].z, w, sum.z);
                        sum.w = fmaf(parts[b].w, w, sum.w);
                    }
                }
            }
            const float inverse = denominator > 0.0f ? 1.0f / denominator : 0.0f;
            *reinterpret_cast<uint2*>(out + query_row_of(r) * HEAD_DIM + d) = make_uint2(
                kiln_pack_bf16x2(sum.x * inverse, sum.y * inverse), kiln_pack_bf16x2(sum.z * inverse, sum.w * inverse));
        }
    }
#else
    // out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - M), M = max_s lse_s, in one pass in split
    // order (the running maximum rescales the running sums, an online softmax over the splits).
    // The partials are read through L2 (other blocks wrote them), eight splits in flight.
    const int block_rows = min(rows - row0, BLOCK_M);
    for (int item = tid; item < block_rows * (HEAD_DIM / 4); item += THREADS) {
        const int row = row0 + item / (HEAD_DIM / 4), d = (item % (HEAD_DIM / 4)) * 4;
        const kiln_u64 query_row = (kiln_u64)(q_begin + row / heads_per_group) * q_heads +
                                   kv_head * heads_per_group + row % heads_per_group;
        const kiln_u64 split_stride = (kiln_u64)total_queries * q_heads;
        float m = KILN_NEG_INF, denominator = 0.0f;
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int s = 0; s < splits; ++s) {
            const kiln_u64 partial_row = s * split_stride + query_row;
            const float lse = __ldcg(partial_lse + partial_row);
            const float4 part = __ldcg(reinterpret_cast<const float4*>(partial_out + partial_row * HEAD_DIM + d));
            if (lse > m) {
                const float rescale = kiln_exp2_approx(m - lse);  // 0 while m is -inf
                sum.x *= rescale;
                sum.y *= rescale;
                sum.z *= rescale;
                sum.w *= rescale;
                denominator *= rescale;
                m = lse;
            }
            if (lse != KILN_NEG_INF) {
                const float w = kiln_exp2_approx(lse - m);
                sum.x = fmaf(w, part.x, sum.x);
                sum.y = fmaf(w, part.y, sum.y);
                sum.z = fmaf(w, part.z, sum.z);
                sum.w = fmaf(w, part.w, sum.w);
                denominator += w;
            }
        }
        const float inverse = denominator > 0.0f ? 1.0f / denominator : 0.0f;
        *reinterpret_cast<uint2*>(out + query_row * HEAD_DIM + d) = make_uint2(
            kiln_pack_bf16x2(sum.x * inverse, sum.y * inverse), kiln_pack_bf16x2(sum.z * inverse, sum.w * inverse));
    }
#endif  // TILED_GATHERED_COMBINE
}

#if !HYBRID
extern "C" __global__ void TILED_LAUNCH_BOUNDS kiln_attention(KILN_ATTENTION_PARAMS) {
    kiln_wait_prior();
    kiln_attention_tiled(KILN_ATTENTION_ARGS);
}
#endif
#endif  // !STREAMING

#if STREAMING || HYBRID
// ---- The streaming decode kernel (STREAMING = 1) ----------------------------------------------
// One query token per sequence (a decode step). A block takes one (sequence, kv head, split, row
// tile of 16 query heads); its WARPS_N warps stream the split's keys in steps of 16 (warp w takes
// steps w, w + WARPS_N, ...), each warp with its own STREAM_STAGES-deep cp.async pipeline in its
// own shared memory: no block barrier until the end, and every step of a short split is in flight
// at once. K and V rows are stored unpadded with chunk c of row r at c ^ (r & 7), so ldmatrix's
// eight rows of a matrix hit distinct banks. Q lives in registers as mma A fragments (read once
// from global memory). The page ids of a step are read one step ahead, one per lane and shared
// by shuffles.
// End: the warps merge in warp order through shared memory; a split that holds the whole context
// writes the output, else each split writes its partial and takes a ticket, and the last block of
// the (sequence, row tile, kv head) combines the partials in split order: the log-sums first, then
// the outputs weighted by 2^(lse - max), up to COMBINE_BATCH splits in flight per thread.
// Splits past the context (chunk = the context / splits rounded up to 16) return at once and take
// no ticket, so the ticket count is the number of splits that hold keys.
// Steps in flight per warp: 3 (the default decode variant, and the hybrid kernel's short path);
// the wide and deep streaming variants (ops/attention.rs DECODE_STREAM_WIDE, DECODE_STREAM_DEEP)
// compile WARPS_N = 8 at 3 stages, or WARPS_N = 4 at 6 stages: 192 KiB of K/V in flight a block
// at HEAD_DIM 128, one block a multiprocessor, so that a batch of a few sequences at 2 splits
// keeps 8 warps (or 24 steps) streaming on every multiprocessor it covers.
#ifndef STREAM_STAGES
#define STREAM_STAGES 3
#endif
// Blocks a multiprocessor the registers are budgeted for: two for the default shape (96 KiB of
// shared memory at HEAD_DIM 128), one past 12 warp-stages (more shared memory than two blocks fit).
#if WARPS_N * STREAM_STAGES > 12
#define STREAM_MIN_BLOCKS 1
#else
#define STREAM_MIN_BLOCKS 2
#endif
// 1: K and V are read under an L2 evict-first policy (the default); 0: under the default policy,
// as the tiled kernel reads them (for measurement: KILN_DECODE_L2_HINT=none, ops/attention.rs).
#ifndef STREAM_L2_EVICT_FIRST
#define STREAM_L2_EVICT_FIRST 1
#endif
#define STEP_KEYS 16
#define STEP_ELEMENTS (STEP_KEYS * HEAD_DIM)
#define STEP_CHUNKS_PER_LANE (STEP_KEYS * CHUNKS_PER_ROW / 32)
// One warp's shared memory: STREAM_STAGES stages of K then V steps (bf16).
#define WARP_ELEMENTS (STREAM_STAGES * 2 * STEP_ELEMENTS)
// The merge rows of a warp (f32, padded by 4 so a quad's float2 stores hit distinct banks).
#define MERGE_ROW (HEAD_DIM + 4)
#define MAX_COMBINE_SPLITS 64

static_assert(WARPS_M == 1 && WARP_KEYS == STEP_KEYS, "the streaming kernel takes 16 rows and steps of 16 keys");
static_assert(STREAM_STAGES >= 2 && STREAM_STAGES <= 8, "two to eight steps in flight a warp");
static_assert(!HYBRID || (WARPS_N == 4 && STREAM_STAGES == 3), "the hybrid kernel's short path is the default shape");
static_assert(HEAD_DIM % 64 == 0, "rows of at least 8 chunks (the swizzle)");
static_assert(16 * MERGE_ROW * 4 <= WARP_ELEMENTS * 2, "a warp's merge rows fit in its stages");
static_assert(MAX_COMBINE_SPLITS * 16 * 4 <= WARPS_N * WARP_ELEMENTS * 2, "the combine's log-sums fit");

// The element offset of chunk `c` (8 bf16) of row `r` in a swizzled step.
KILN_DEVICE int kiln_step_offset(int r, int c) {
    return (r * CHUNKS_PER_ROW + (c ^ (r & 7))) * 8;
}

#if STREAM_L2_EVICT_FIRST
// An L2 policy that evicts the lines it brings in first: K and V are read once per step, and
// should not push out what is read again (the page tables, Q, the partials, weights).
KILN_DEVICE kiln_u64 kiln_evict_first_policy() {
    kiln_u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// kiln_cp_async_16 under an L2 cache policy.
KILN_DEVICE void kiln_cp_async_16_policy(kiln_u32 shared_address, const void* global, bool valid, kiln_u64 policy) {
    int source_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;" ::"r"(shared_address),
                 "l"(global), "r"(source_bytes), "l"(policy)
                 : "memory");
}
#endif

// Dynamic shared memory: WARPS_N * WARP_ELEMENTS bf16. STREAM_MIN_BLOCKS blocks a multiprocessor
// (the registers of the combine's batch fit two of the default shape). The body of
// kiln_attention_decode (after the wait), and the hybrid kernel's short path.
KILN_DEVICE void kiln_attention_streaming(KILN_ATTENTION_PARAMS) {
    extern __shared__ kiln_chunk16 shared_chunks[];
    __shared__ float warp_max[WARPS_N][16], warp_sum[WARPS_N][16];
    __shared__ int is_last_block;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = lane >> 2, thread_in_group = lane & 3;
    const int sequence = blockIdx.z;
    const int kv_head = blockIdx.y / splits, split = blockIdx.y % splits;
    const int q_begin = query_offsets[sequence];
    const int q_len = query_offsets[sequence + 1] - q_begin;
    const int context = context_lens[sequence];
    const int total_queries = query_offsets[gridDim.z];
    const kiln_u32* pages = page_ids + page_offsets[sequence];
    const int heads_per_group = q_heads / kv_heads;
    const int row0 = blockIdx.x * 16;
    const int rows = min(heads_per_group - row0, 16);
    if (q_len != 1 || context <= 0 || rows <= 0) return;

    // This split's keys [kv_begin, kv_end), in steps of 16; `used` splits hold keys.
    const int chunk = ((context + splits - 1) / splits + STEP_KEYS - 1) / STEP_KEYS * STEP_KEYS;
    const int used = (context + chunk - 1) / chunk;
    if (split >= used) return;
    const int kv_begin = split * chunk;
    const int kv_end = min(context, kv_begin + chunk);
    const int steps = (kv_end - kv_begin + STEP_KEYS - 1) / STEP_KEYS;
    const int my_steps = warp < steps ? (steps - warp + WARPS_N - 1) / WARPS_N : 0;
    kiln_u16* stages = reinterpret_cast<kiln_u16*>(shared_chunks) + warp * WARP_ELEMENTS;
#if STREAM_L2_EVICT_FIRST
    const kiln_u64 policy = kiln_evict_first_policy();
#endif

    // The page of key (lane % 16) of this warp's step k (0 when the step or key is past the end).
    auto step_page = [&](int k) -> kiln_u32 {
        const int position = kv_begin + (warp + k * WARPS_N) * STEP_KEYS + (lane & 15);
        return (k < my_steps && position < kv_end) ? pages[position >> page_shift] : 0u;
    };
    // K and V of step k into `stage`: 16-byte chunks, lanes along a row; keys past kv_end zeroed.
    auto load_step = [&](int k, int stage, kiln_u32 page) {
        const int start = kv_begin + (warp + k * WARPS_N) * STEP_KEYS;
        kiln_u16* k_stage = stages + stage * 2 * STEP_ELEMENTS;
        kiln_u16* v_stage = k_stage + STEP_ELEMENTS;
#pragma unroll
        for (int i = 0; i < STEP_CHUNKS_PER_LANE; ++i) {
            const int index = lane + 32 * i;
            const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
            const kiln_u32 row_page = __shfl_sync(KILN_FULL_MASK, page, r);
            const int position = start + r;
            const bool valid = position < kv_end;
            const kiln_u64 offset =
                ((((kiln_u64)row_page * kv_heads + kv_head) << page_shift) |
                 (kiln_u64)(position & ((1 << page_shift) - 1))) *
                    HEAD_DIM +
                c * 8;
            const int smem_offset = kiln_step_offset(r, c);
#if STREAM_L2_EVICT_FIRST
            kiln_cp_async_16_policy(kiln_smem_address(k_stage + smem_offset), valid ? k_cache + offset : k_cache,
                                    valid, policy);
            kiln_cp_async_16_policy(kiln_smem_address(v_stage + smem_offset), valid ? v_cache + offset : v_cache,
                                    valid, policy);
#else
            kiln_cp_async_16_line(kiln_smem_address(k_stage + smem_offset), valid ? k_cache + offset : k_cache, valid);
            kiln_cp_async_16_line(kiln_smem_address(v_stage + smem_offset), valid ? v_cache + offset : v_cache, valid);
#endif
        }
    };

    // The pages of the first STREAM_STAGES steps, then Q, all requested before the first copy
    // waits on a page id.
#if STREAM_STAGES == 3
    kiln_u32 first_pages[STREAM_STAGES] = {step_page(0), step_page(1), step_page(2)};
#else
    kiln_u32 first_pages[STREAM_STAGES];
#pragma unroll
    for (int k = 0; k < STREAM_STAGES; ++k) first_pages[k] = step_page(k);
#endif

    // Q rows as A fragments (rows past the group are zeros): a[e] holds row group + 8 (e & 1),
    // bf16 pair thread_in_group + 4 (e >> 1) of each 16 columns.
    kiln_u32 q_fragments[HEAD_DIM / 16][4];
    {
        const kiln_u32* q_words = reinterpret_cast<const kiln_u32*>(
            q + ((kiln_u64)q_begin * q_heads + kv_head * heads_per_group + row0) * HEAD_DIM);
#pragma unroll
        for (int kd = 0; kd < HEAD_DIM / 16; ++kd) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = group + (e & 1) * 8;
                const int word = kd * 8 + thread_in_group + (e >> 1) * 4;
                q_fragments[kd][e] = r < rows ? q_words[r * (HEAD_DIM / 2) + word] : 0u;
            }
        }
    }

    // The first steps in flight, one commit group each (empty past my_steps). A loop that is not
    // unrolled (the pages rotate through registers): one copy of the copy code, short to fetch.
#pragma unroll 1
    for (int k = 0; k < STREAM_STAGES; ++k) {
        if (k < my_steps) load_step(k, k, first_pages[0]);
        kiln_cp_async_commit();
#if STREAM_STAGES == 3
        first_pages[0] = first_pages[1];
        first_pages[1] = first_pages[2];
#else
#pragma unroll
        for (int j = 0; j + 1 < STREAM_STAGES; ++j) first_pages[j] = first_pages[j + 1];
#endif
    }
    kiln_u32 next_page = step_page(STREAM_STAGES);

    // Rows group + 8 hold heads only in a group of more than 8.
    const bool upper_rows = rows > 8;
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF};  // in units of scale_log2 * q.k
    float row_sum[2] = {0.0f, 0.0f};                  // this thread's columns only, until the end

    for (int k = 0; k < my_steps; ++k) {
        const int stage = k % STREAM_STAGES;
        kiln_cp_async_wait<STREAM_STAGES - 1>();
        __syncwarp();
        const kiln_u16* k_stage = stages + stage * 2 * STEP_ELEMENTS;
        const kiln_u16* v_stage = k_stage + STEP_ELEMENTS;

        // S = Q K^T over the step's 16 keys (two blocks of 8).
        float s[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < HEAD_DIM / 16; kd += 2) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int key = j * 8 + (lane & 7);
                kiln_u32 b[4];
                kiln_ldmatrix_x4(b, kiln_smem_address(k_stage + kiln_step_offset(key, kd * 2 + (lane >> 3))));
                kiln_mma_bf16_16816(s[j], q_fragments[kd], b[0], b[1]);
                kiln_mma_bf16_16816(s[j], q_fragments[kd + 1], b[2], b[3]);
            }
        }

        // Keys past kv_end (only in the split's last step).
        const int start = kv_begin + (warp + k * WARPS_N) * STEP_KEYS;
        if (start + STEP_KEYS > kv_end) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (start + j * 8 + 2 * thread_in_group + (e & 1) >= kv_end) s[j][e] = KILN_NEG_INF;
                }
            }
        }

        // Online softmax (as kiln_attention), the upper rows only where they hold heads.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && !upper_rows) continue;
            float m = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
            m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 1));
            m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 2));
            const float new_max = fmaxf(row_max[h], m * scale_log2);
            const float base = new_max == KILN_NEG_INF ? 0.0f : new_max;
            const float alpha = kiln_exp2_approx(row_max[h] - base);
            row_max[h] = new_max;
            row_sum[h] *= alpha;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = kiln_exp2_approx(fmaf(s[j][2 * h + e], scale_log2, -base));
                    s[j][2 * h + e] = p;
                    row_sum[h] += p;
                }
            }
        }

        // O += P V: P from the S accumulators (zeros for rows without heads), V by transposed ldmatrix.
        const kiln_u32 p[4] = {
            kiln_pack_bf16x2(s[0][0], s[0][1]),
            upper_rows ? kiln_pack_bf16x2(s[0][2], s[0][3]) : 0u,
            kiln_pack_bf16x2(s[1][0], s[1][1]),
            upper_rows ? kiln_pack_bf16x2(s[1][2], s[1][3]) : 0u,
        };
        const int v_key = (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nd = 0; nd < HEAD_DIM / 16; ++nd) {
            kiln_u32 b[4];
            kiln_ldmatrix_x4_trans(b, kiln_smem_address(v_stage + kiln_step_offset(v_key, nd * 2 + (lane >> 4))));
            kiln_mma_bf16_16816(o[2 * nd], p, b[0], b[1]);
            kiln_mma_bf16_16816(o[2 * nd + 1], p, b[2], b[3]);
        }

        // Every lane is done with the stage: step k + STREAM_STAGES into it, then the page of the
        // step after that.
        __syncwarp();
        if (k + STREAM_STAGES < my_steps) load_step(k + STREAM_STAGES, stage, next_page);
        kiln_cp_async_commit();
        next_page = step_page(k + STREAM_STAGES + 1);
    }
    kiln_cp_async_wait<0>();
    __syncwarp();

    // Row sums over the quad, in a fixed order.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 2);
    }

    // Each warp's rows (unnormalized, f32) into its own stages, its maxima and sums beside.
    float* merge = reinterpret_cast<float*>(stages);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (h == 1 && !upper_rows) continue;
        const int r = group + 8 * h;
        if (thread_in_group == 0) {
            warp_max[warp][r] = row_max[h];
            warp_sum[warp][r] = row_sum[h];
        }
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {
            *reinterpret_cast<float2*>(merge + r * MERGE_ROW + n * 8 + 2 * thread_in_group) =
                make_float2(o[n][2 * h], o[n][2 * h + 1]);
        }
    }
    __syncthreads();

    // The block's rows: the warps merged in warp order (warp 0 holds the split's first keys, so
    // the maximum is finite), 4 columns per item; the output itself when one split holds the
    // context, else the partial and its log-sum.
    const kiln_u64 query_row0 = (kiln_u64)q_begin * q_heads + kv_head * heads_per_group + row0;
    const kiln_u64 split_stride = (kiln_u64)total_queries * q_heads;
    const float* merged = reinterpret_cast<const float*>(shared_chunks);
    for (int item = tid; item < rows * (HEAD_DIM / 4); item += THREADS) {
        const int r = item / (HEAD_DIM / 4), d = (item % (HEAD_DIM / 4)) * 4;
        float m = KILN_NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) m = fmaxf(m, warp_max[w][r]);
        float sum = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) {
            const float f = kiln_exp2_approx(warp_max[w][r] - m);
            const float4 part = *reinterpret_cast<const float4*>(merged + w * (WARP_ELEMENTS / 2) + r * MERGE_ROW + d);
            sum = fmaf(warp_sum[w][r], f, sum);
            acc.x = fmaf(part.x, f, acc.x);
            acc.y = fmaf(part.y, f, acc.y);
            acc.z = fmaf(part.z, f, acc.z);
            acc.w = fmaf(part.w, f, acc.w);
        }
        const float inverse = 1.0f / sum;
        const kiln_u64 query_row = query_row0 + r;
        if (used == 1) {
            *reinterpret_cast<uint2*>(out + query_row * HEAD_DIM + d) = make_uint2(
                kiln_pack_bf16x2(acc.x * inverse, acc.y * inverse), kiln_pack_bf16x2(acc.z * inverse, acc.w * inverse));
        } else {
            const kiln_u64 partial_row = split * split_stride + query_row;
            *reinterpret_cast<float4*>(partial_out + partial_row * HEAD_DIM + d) =
                make_float4(acc.x * inverse, acc.y * inverse, acc.z * inverse, acc.w * inverse);
            if (d == 0) partial_lse[partial_row] = m + __log2f(sum);
        }
    }
    if (used == 1) return;

    // The ticket: the last of the `used` blocks of this group to finish combines the partials.
    __threadfence();
    __syncthreads();
    const int ticket_index = (sequence * (int)gridDim.x + (int)blockIdx.x) * kv_heads + kv_head;
    if (tid == 0) {
        const kiln_u32 ticket = atomicAdd(&kiln_attention_tickets[ticket_index], 1u);
        is_last_block = ticket == (kiln_u32)used - 1u;
        if (is_last_block) kiln_attention_tickets[ticket_index] = 0u;  // every split has taken its ticket
    }
    __syncthreads();
    if (!is_last_block) return;
    __threadfence();

    // out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - M), M = max_s lse_s, in split order. The
    // first batch of this thread's partials is requested before the log-sums are gathered.
    float* lse = reinterpret_cast<float*>(shared_chunks);  // [used][rows]
    const kiln_u64 split_floats = split_stride * HEAD_DIM;
    // Item `item`'s 4 columns of split 0's partial; split s's are s * split_floats further.
    auto partials = [&](int item) -> const float* {
        return partial_out + (query_row0 + item / (HEAD_DIM / 4)) * HEAD_DIM + (item % (HEAD_DIM / 4)) * 4;
    };
    const int items = rows * (HEAD_DIM / 4);
    float4 parts[COMBINE_BATCH];
    if (tid < items) {
        const float* first = partials(tid);
#pragma unroll
        for (int b = 0; b < COMBINE_BATCH; ++b) {
            if (b < used) parts[b] = __ldcg(reinterpret_cast<const float4*>(first + b * split_floats));
        }
    }
    for (int i = tid; i < used * rows; i += THREADS) {
        lse[i] = __ldcg(partial_lse + (i / rows) * split_stride + query_row0 + i % rows);
    }
    __syncthreads();
    for (int item = tid; item < items; item += THREADS) {
        const int r = item / (HEAD_DIM / 4), d = (item % (HEAD_DIM / 4)) * 4;
        float m = KILN_NEG_INF;
#pragma unroll 16
        for (int s = 0; s < used; ++s) m = fmaxf(m, lse[s * rows + r]);
        float sum = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = 0; s0 < used; s0 += COMBINE_BATCH) {
            if (s0 > 0 || item != tid) {
                const float* batch = partials(item) + s0 * split_floats;
#pragma unroll
                for (int b = 0; b < COMBINE_BATCH; ++b) {
                    if (s0 + b < used) parts[b] = __ldcg(reinterpret_cast<const float4*>(batch + b * split_floats));
                }
            }
#pragma unroll
            for (int b = 0; b < COMBINE_BATCH; ++b) {
                if (s0 + b < used) {
                    const float w = kiln_exp2_approx(lse[(s0 + b) * rows + r] - m);
                    sum += w;
                    acc.x = fmaf(parts[b].x, w, acc.x);
                    acc.y = fmaf(parts[b].y, w, acc.y);
                    acc.z = fmaf(parts[b].z, w, acc.z);
                    acc.w = fmaf(parts[b].w, w, acc.w);
                }
            }
        }
        const float inverse = 1.0f / sum;
        *reinterpret_cast<uint2*>(out + (query_row0 + r) * HEAD_DIM + d) = make_uint2(
            kiln_pack_bf16x2(acc.x * inverse, acc.y * inverse), kiln_pack_bf16x2(acc.z * inverse, acc.w * inverse));
    }
}

#if !HYBRID
extern "C" __global__ void __launch_bounds__(THREADS, STREAM_MIN_BLOCKS) kiln_attention_decode(KILN_ATTENTION_PARAMS) {
    kiln_wait_prior();
    kiln_attention_streaming(KILN_ATTENTION_ARGS);
}
#endif
#endif  // STREAMING || HYBRID

#if HYBRID
// ---- The hybrid decode kernel (HYBRID = 1) -----------------------------------------------------
// One query token per sequence, the grid of both kernels (row tile, kv_head * splits + split,
// sequence). Each block reads its sequence's context and takes, as every block of that sequence
// does, the streaming kernel's path when a split holds at most HYBRID_STREAM_CHUNK keys
// (ceil(context / splits): short contexts, where the streaming kernel's latency wins), else the
// tiled kernel's, STAGES tiles deep (long contexts, where its bandwidth wins). The path, the
// chunks and the combine's order follow from the context and the splits alone, so a given length
// gives the same bits run to run, and a captured grid serves every length. Dynamic shared memory:
// the larger of the two paths'.
static_assert(WARPS_M == 1 && WARPS_N == 4 && WARP_KEYS == 16, "the hybrid kernel is the 1x4x16 shape");
extern "C" __global__ void __launch_bounds__(THREADS, 2) kiln_attention_decode_hybrid(KILN_ATTENTION_PARAMS) {
    kiln_wait_prior();
    // The sequence's other metadata, which both paths read first, requested into L1 beside the
    // context the choice needs, so the choice costs no round trip of its own.
    asm volatile("prefetch.global.L1 [%0];" ::"l"(query_offsets + blockIdx.z));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(query_offsets + gridDim.z));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(page_offsets + blockIdx.z));
    const int context = context_lens[blockIdx.z];
    if ((context + splits - 1) / splits <= HYBRID_STREAM_CHUNK) {
        kiln_attention_streaming(KILN_ATTENTION_ARGS);
    } else {
        kiln_attention_tiled(KILN_ATTENTION_ARGS);
    }
}
#endif  // HYBRID

// Writes new tokens' K and V into their slots: k_new, v_new [token][kv_head][HEAD_DIM] bf16,
// slots[token] = page * page_tokens + slot. One 16-byte chunk per thread, grid-stride.
extern "C" __global__ void kiln_kv_append(const kiln_chunk16* __restrict__ k_new,
                                          const kiln_chunk16* __restrict__ v_new,
                                          const kiln_u32* __restrict__ slots, kiln_chunk16* __restrict__ k_cache,
                                          kiln_chunk16* __restrict__ v_cache, kiln_u64 tokens, int kv_heads,
                                          int page_shift) {
    kiln_wait_prior();
    const kiln_u64 chunks = tokens * kv_heads * CHUNKS_PER_ROW;
    for (kiln_u64 i = kiln_global_index(); i < chunks; i += kiln_grid_stride()) {
        const kiln_u64 c = i % CHUNKS_PER_ROW;
        const kiln_u64 head = (i / CHUNKS_PER_ROW) % kv_heads;
        const kiln_u64 token = i / CHUNKS_PER_ROW / kv_heads;
        const kiln_u64 slot = slots[token];
        const kiln_u64 page = slot >> page_shift, in_page = slot & ((1ull << page_shift) - 1);
        const kiln_u64 destination = (((page * kv_heads + head) << page_shift) | in_page) * CHUNKS_PER_ROW + c;
        k_cache[destination] = k_new[i];
        v_cache[destination] = v_new[i];
    }
}

#if KV_FP8
// Writes new tokens' K and V into their slots as FP8 rows (`kiln_core::ops::attention::kv_fp8_row`,
// bit for bit): k_new, v_new [token][kv_head][HEAD_DIM] bf16, slots[token] = page * page_tokens +
// slot; codes into k_cache / v_cache [page][kv_head][slot][HEAD_DIM] bytes, scales into k_scales /
// v_scales [page][kv_head][slot]. One warp a row (HEAD_DIM / 32 values a lane), grid-stride:
// amax by a warp maximum (NaN ignored, from 0, as block_amax), scale = amax / 448 and each code
// the E4M3 code of x / scale (IEEE divisions), or of x itself for a zero row. A slot at or past
// `slot_limit` (the caches' pages times page_tokens) writes nothing.
static_assert(HEAD_DIM % 32 == 0, "a warp a row");
extern "C" __global__ void kiln_kv_append_fp8(const kiln_u16* __restrict__ k_new, const kiln_u16* __restrict__ v_new,
                                              const kiln_u32* __restrict__ slots, kiln_u8* __restrict__ k_cache,
                                              kiln_u8* __restrict__ v_cache, float* __restrict__ k_scales,
                                              float* __restrict__ v_scales, kiln_u64 tokens, int kv_heads,
                                              int page_shift, kiln_u64 slot_limit) {
    kiln_wait_prior();
    constexpr int PER_LANE = HEAD_DIM / 32;
    const int lane = threadIdx.x & 31;
    const kiln_u64 rows = tokens * kv_heads;
    const kiln_u64 warps = (kiln_u64)gridDim.x * (blockDim.x >> 5);
    for (kiln_u64 row = kiln_global_index() >> 5; row < rows; row += warps) {
        const kiln_u64 head = row % kv_heads, token = row / kv_heads;
        const kiln_u64 slot = slots[token];
        if (slot >= slot_limit) continue;  // past the caches (the host checks its slots first)
        const kiln_u64 page = slot >> page_shift, in_page = slot & ((1ull << page_shift) - 1);
        const kiln_u64 destination = ((page * kv_heads + head) << page_shift) | in_page;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            const kiln_u16* source = (which == 0 ? k_new : v_new) + row * HEAD_DIM + lane * PER_LANE;
            float x[PER_LANE];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                x[i] = kiln_bf16_to_f32(source[i]);
                amax = fmaxf(amax, fabsf(x[i]));
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(KILN_FULL_MASK, amax, offset));
            }
            const float scale = __fdiv_rn(amax, 448.0f);
            kiln_u8* codes = (which == 0 ? k_cache : v_cache) + destination * HEAD_DIM + lane * PER_LANE;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                codes[i] = (kiln_u8)kiln_e4m3_code(scale > 0.0f ? __fdiv_rn(x[i], scale) : x[i]);
            }
            if (lane == 0) (which == 0 ? k_scales : v_scales)[destination] = scale;
        }
    }
}
#endif
