// Causal grouped-query prefill attention over the paged KV cache on Hopper's warpgroup tensor
// cores (wgmma, sm_90a only): the same function as kiln_attention in attention.cu for calls whose
// context is not split (prefill and chunked prefill), in FlashAttention-3's manner. Two kernels
// share the per-tile work: kiln_attention_prefill (every thread copies and computes, a block
// barrier per tile) and kiln_attention_prefill_pingpong (a copying warpgroup and two computing
// warpgroups taking turns; described at its definition).
//
// Layouts: as attention.cu (q, out [query_token][q_head][HEAD_DIM] bf16; k_cache, v_cache
// [page][kv_head][slot][HEAD_DIM] bf16, position p of sequence b at page
// page_ids[page_offsets[b] + (p >> page_shift)], slot p & (page_tokens - 1)). Query token i of
// sequence b (q_len tokens, context_lens[b] positions) is at position context - q_len + i and
// attends to positions 0..= that.
//
// Work: two computing warpgroups (256 threads) take BLOCK_M = 128 rows of one sequence and
// one KV head, row r being (query token r / G, query head kv_head * G + r % G) with
// G = q_heads / kv_heads, so each K/V tile is read once for the G heads of a group; warpgroup w
// owns rows 64 w .. 64 w + 63. The block walks its keys in tiles of BLOCK_N = 128, two stages
// deep in shared memory (three in the ping-pong kernel; cp.async, 16-byte copies, the page of
// each key row read one tile ahead).
// Per tile and warpgroup: S = Q K^T by eight wgmma.m64n128k16 with Q and K from shared memory
// (K-major), the online softmax in f32 on the accumulators (exp2, log2 e folded into the scale),
// then O += P V by eight wgmma.m64n128k16 with P from registers (the accumulators rounded to
// bf16 pairs) and V from shared memory (N-major: the hardware transposes it). A warpgroup skips
// the tiles past its own causal limit; only tiles that reach the diagonal or kv_end are masked.
//
// Shared memory: Q, K and V rows are 256 bytes (HEAD_DIM = 128 bf16), stored as two column
// halves of 64 elements: [half][row][128 bytes], each 8-row block of 1024 bytes with the
// 16-byte chunk c of row r at chunk c ^ (r % 8) (the 128-byte swizzle the wgmma descriptors
// name), so cp.async writes and the tensor cores' reads are free of bank conflicts.
//
// Grid: x = row tile (reversed, so the longest causal tiles start first), y = kv_head,
// z = sequence. Memory floor: q read and out written once, K and V once per row tile (from L2
// after the first). The order of every sum is fixed, so the output is the same bits run to run.
#include "kiln_prelude.cuh"

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_prefill.cu uses wgmma: compile it for sm_90a"
#endif

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
static_assert(HEAD_DIM == 128, "the wgmma prefill serves head dim 128");

#define WARPGROUPS 2
#define THREADS (128 * WARPGROUPS)
#define BLOCK_M (64 * WARPGROUPS)
#define BLOCK_N 128
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
// Bytes of one column half (64 elements of each row) of an array of `rows` rows.
#define HALF_BYTES(rows) ((rows) * 128)
#define Q_BYTES (BLOCK_M * HEAD_DIM * 2)
#define TILE_BYTES (BLOCK_N * HEAD_DIM * 2)
// 16-byte chunks of one K (or V) tile, and of the Q rows, each thread copies.
#define TILE_CHUNKS_PER_THREAD (BLOCK_N * CHUNKS_PER_ROW / THREADS)
#define Q_CHUNKS_PER_THREAD (BLOCK_M * CHUNKS_PER_ROW / THREADS)
#define KILN_NEG_INF (-__int_as_float(0x7f800000))

static_assert(TILE_CHUNKS_PER_THREAD * THREADS == BLOCK_N * CHUNKS_PER_ROW, "a tile splits evenly");
static_assert(Q_CHUNKS_PER_THREAD * THREADS == BLOCK_M * CHUNKS_PER_ROW, "Q splits evenly");

// The byte offset of 16-byte chunk c of row r in a swizzled [half][rows][128 bytes] array.
KILN_DEVICE kiln_u32 kiln_swizzled(int rows, int r, int c) {
    return (kiln_u32)((c >> 3) * HALF_BYTES(rows) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A wgmma shared-memory descriptor with the 128-byte swizzle: the start address, the leading
// byte offset (N-major operands: from one 64-element column half to the next; unused, 16, for
// K-major ones) and the stride byte offset (from one 8-row block to the next: 1024 bytes here).
// The swizzle pattern repeats every 1024 bytes and every array starts on a multiple of that, so
// the base offset field is 0.
KILN_DEVICE kiln_u64 kiln_wgmma_descriptor(kiln_u32 address, kiln_u32 leading_bytes, kiln_u32 stride_bytes) {
    return (kiln_u64)((address & 0x3FFFF) >> 4) | ((kiln_u64)(leading_bytes >> 4) << 16) |
           ((kiln_u64)(stride_bytes >> 4) << 32) | (1ull << 62);
}

KILN_DEVICE void kiln_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
KILN_DEVICE void kiln_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
KILN_DEVICE void kiln_wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Ties the accumulators to the surrounding asm: the compiler may not move their reads or writes
// across this point (before a wgmma.fence, after a wgmma.wait_group).
KILN_DEVICE void kiln_wgmma_hold(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Orders this thread's ordinary (cp.async) writes to shared memory before the tensor cores'
// reads of them (the async proxy), once a barrier follows.
KILN_DEVICE void kiln_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// D (+)= A B, m64n128k16, A and B from shared memory (K-major, both descriptors), f32 D. With
// `accumulate` 0 the old D is ignored (the first product of a sum).
KILN_DEVICE void kiln_wgmma_m64n128_ss(float (&d)[64], kiln_u64 a, kiln_u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// D += A B, m64n128k16, A from registers (four bf16 pairs, the mma.m16n8k16 A layout per warp),
// B from shared memory N-major (transposed: the descriptor's rows run along K), f32 D.
KILN_DEVICE void kiln_wgmma_m64n128_rs_transposed_b(float (&d)[64], const kiln_u32 (&a)[4], kiln_u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// S = Q K^T of one K tile for this warpgroup (64 rows of Q at q_group, 128 keys at k_tile):
// issued and committed, not waited. Step kd takes 16 columns of HEAD_DIM, 32 bytes into column
// half kd / 4.
KILN_DEVICE void kiln_prefill_scores(float (&s)[64], kiln_u32 q_group, kiln_u32 k_tile) {
    kiln_wgmma_fence();
#pragma unroll
    for (int kd = 0; kd < HEAD_DIM / 16; ++kd) {
        const kiln_u32 column = (kd & 3) * 32;
        const kiln_u64 a = kiln_wgmma_descriptor(q_group + (kd >> 2) * HALF_BYTES(BLOCK_M) + column, 16, 1024);
        const kiln_u64 b = kiln_wgmma_descriptor(k_tile + (kd >> 2) * HALF_BYTES(BLOCK_N) + column, 16, 1024);
        kiln_wgmma_m64n128_ss(s, a, b, kd > 0);
    }
    kiln_wgmma_commit();
}

// This thread's rows of one warpgroup: the positions of its two rows (16 w + g and + 8 within
// the warpgroup), and the first and last positions of the warpgroup's rows.
struct kiln_prefill_rows {
    int position[2];
    int first_position, last_position;
};

// Waits for the scores of kiln_prefill_scores, masks keys past a row's position or past kv_end
// (only where the tile reaches them), updates the online softmax (maxima in units of
// scale_log2 * q.k, this thread's share of the row sums) and adds P V of the tile's V rows at
// v_tile to o (waited).
KILN_DEVICE void kiln_prefill_update(float (&s)[64], float (&o)[64], float (&row_max)[2], float (&row_sum)[2],
                                     const kiln_prefill_rows& rows, int tile_start, int kv_end, kiln_u32 v_tile,
                                     float scale_log2, int thread_in_group) {
    kiln_wgmma_wait_all();
    kiln_wgmma_hold(s);
    if (tile_start + BLOCK_N > kv_end || tile_start + BLOCK_N - 1 > rows.first_position) {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = tile_start + j * 8 + 2 * thread_in_group + (e & 1);
                if (key > rows.position[e >> 1] || key >= kv_end) s[4 * j + e] = KILN_NEG_INF;
            }
        }
    }

    // New row maxima (over the quad that shares a row), rescale, exponentiate.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float m = KILN_NEG_INF;
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) m = fmaxf(m, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 1));
        m = fmaxf(m, __shfl_xor_sync(KILN_FULL_MASK, m, 2));
        const float new_max = fmaxf(row_max[h], m * scale_log2);
        // A row that has seen no key yet keeps -inf; subtracting 0 then gives 0 weights, not NaN.
        const float base = new_max == KILN_NEG_INF ? 0.0f : new_max;
        const float alpha = kiln_exp2_approx(row_max[h] - base);
        row_max[h] = new_max;
        row_sum[h] *= alpha;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
            o[4 * j + 2 * h] *= alpha;
            o[4 * j + 2 * h + 1] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = kiln_exp2_approx(fmaf(s[4 * j + 2 * h + e], scale_log2, -base));
                s[4 * j + 2 * h + e] = p;
                row_sum[h] += p;
            }
        }
    }

    // O += P V: P as A fragments (keys 16 kk .. 16 kk + 15: accumulator columns 2 kk and
    // 2 kk + 1), V's step kk 16 rows (2048 bytes) further, its column halves HALF_BYTES apart.
    kiln_u32 p[BLOCK_N / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        p[kk][0] = kiln_pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = kiln_pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = kiln_pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = kiln_pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
    }
    // P and the rescaled O are written before the fence (an A operand too must not be written
    // between the fence and the wgmma that reads it).
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(p[kk][i])::"memory");
    }
    kiln_wgmma_hold(o);
    kiln_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const kiln_u64 b = kiln_wgmma_descriptor(v_tile + kk * 16 * 128, HALF_BYTES(BLOCK_N), 1024);
        kiln_wgmma_m64n128_rs_transposed_b(o, p[kk], b);
    }
    kiln_wgmma_commit();
    kiln_wgmma_wait_all();
    kiln_wgmma_hold(o);
}

// Row sums over the quad, in a fixed order, then this thread's rows (of the warpgroup starting
// at group_row0) into out, normalized.
KILN_DEVICE void kiln_prefill_store(kiln_u16* __restrict__ out, float (&o)[64], float (&row_sum)[2], int group_row0,
                                    int rows, int heads_per_group, int q_begin, int q_heads, int kv_head,
                                    int warp_in_group, int group, int thread_in_group) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(KILN_FULL_MASK, row_sum[h], 2);
        const int row = group_row0 + 16 * warp_in_group + group + 8 * h;
        if (row >= rows) continue;
        const int token = q_begin + row / heads_per_group;
        const int head = kv_head * heads_per_group + row % heads_per_group;
        const float inverse = row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f;
        kiln_u16* out_row = out + ((kiln_u64)token * q_heads + head) * HEAD_DIM + 2 * thread_in_group;
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) {
            *reinterpret_cast<kiln_u32*>(out_row + 8 * j) =
                kiln_pack_bf16x2(o[4 * j + 2 * h] * inverse, o[4 * j + 2 * h + 1] * inverse);
        }
    }
}

// The rows of warpgroup `warpgroup` of the block at row0 (rows past the sequence take the last
// row's position, so they see keys and stay finite; their output is not stored).
KILN_DEVICE kiln_prefill_rows kiln_prefill_rows_of(int row0, int warpgroup, int warp_in_group, int group, int rows,
                                                   int first_position, int heads_per_group) {
    kiln_prefill_rows r;
    const int group_row0 = row0 + 64 * warpgroup;
    r.first_position = first_position + min(group_row0, rows - 1) / heads_per_group;
    r.last_position = first_position + min(group_row0 + 63, rows - 1) / heads_per_group;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = min(group_row0 + 16 * warp_in_group + group + 8 * h, rows - 1);
        r.position[h] = first_position + row / heads_per_group;
    }
    return r;
}

// Q row r, 16-byte chunk c of the block's rows: its address in q (rows past the sequence read
// nothing: `valid` false).
KILN_DEVICE const kiln_u16* kiln_prefill_q_source(const kiln_u16* q, int row0, int r, int c, int rows,
                                                   int heads_per_group, int q_begin, int q_heads, int kv_head,
                                                   bool& valid) {
    const int row = row0 + r;
    valid = row < rows;
    const int token = valid ? row / heads_per_group : 0;
    const int head = kv_head * heads_per_group + (valid ? row % heads_per_group : 0);
    return valid ? q + ((kiln_u64)(q_begin + token) * q_heads + head) * HEAD_DIM + c * 8 : q;
}

// The element offset of chunk c of the K (or V) row of `position` in the cache.
KILN_DEVICE kiln_u64 kiln_prefill_kv_offset(kiln_u32 page, int position, int c, int kv_heads, int kv_head,
                                            int page_shift) {
    return (((kiln_u64)page * kv_heads + kv_head) << page_shift | (kiln_u64)(position & ((1 << page_shift) - 1))) *
               HEAD_DIM +
           c * 8;
}

// ---- kiln_attention_prefill: every thread loads and computes ----------------------------------
// Dynamic shared memory (the launcher's shared_bytes): up to 1 KiB of alignment, Q
// [2][BLOCK_M][128 B], then per stage K [2][BLOCK_N][128 B] and V [2][BLOCK_N][128 B].
extern "C" __global__ void __launch_bounds__(THREADS, 1) kiln_attention_prefill(
    const kiln_u16* __restrict__ q, const kiln_u16* __restrict__ k_cache, const kiln_u16* __restrict__ v_cache,
    const kiln_i32* __restrict__ query_offsets, const kiln_i32* __restrict__ context_lens,
    const kiln_i32* __restrict__ page_offsets, const kiln_u32* __restrict__ page_ids, kiln_u16* __restrict__ out,
    int q_heads, int kv_heads, int page_shift, float scale_log2) {
    kiln_wait_prior();
    extern __shared__ __align__(1024) kiln_u8 shared_bytes[];
    const kiln_u32 q_smem = (kiln_smem_address(shared_bytes) + 1023u) & ~1023u;
    const kiln_u32 kv_smem = q_smem + Q_BYTES;  // stage s: K at kv_smem + 2 s TILE_BYTES, V after it

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warpgroup = warp >> 2, warp_in_group = warp & 3;
    const int group = lane >> 2, thread_in_group = lane & 3;

    const int sequence = blockIdx.z, kv_head = blockIdx.y;
    const int q_begin = query_offsets[sequence];
    const int q_len = query_offsets[sequence + 1] - q_begin;
    const int context = context_lens[sequence];
    const int heads_per_group = q_heads / kv_heads;
    const int rows = q_len * heads_per_group;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;
    if (row0 >= rows) return;
    const int first_position = context - q_len;
    const kiln_u32* pages = page_ids + page_offsets[sequence];

    // The block's keys end at the causal limit of its last row.
    const int last_row = min(rows, row0 + BLOCK_M) - 1;
    const int kv_end = min(context, first_position + last_row / heads_per_group + 1);
    const int tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    // Q rows by cp.async (rows past the sequence are zeros).
#pragma unroll
    for (int i = 0; i < Q_CHUNKS_PER_THREAD; ++i) {
        const int index = tid + i * THREADS;
        const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
        bool valid;
        const kiln_u16* source =
            kiln_prefill_q_source(q, row0, r, c, rows, heads_per_group, q_begin, q_heads, kv_head, valid);
        kiln_cp_async_16(q_smem + kiln_swizzled(BLOCK_M, r, c), source, valid);
    }

    // The page of each K/V row this thread copies in tile `t` (0 past kv_end, not read), read one
    // tile ahead of the copies so the page-table load does not stall the copy it feeds.
    auto tile_pages = [&](int t, kiln_u32 (&ids)[TILE_CHUNKS_PER_THREAD]) {
#pragma unroll
        for (int i = 0; i < TILE_CHUNKS_PER_THREAD; ++i) {
            const int position = t * BLOCK_N + (tid + i * THREADS) / CHUNKS_PER_ROW;
            ids[i] = (t < tiles && position < kv_end) ? pages[position >> page_shift] : 0u;
        }
    };
    // K and V of tile `t` into `stage`: 16-byte chunks, 16 threads along a row, positions past
    // kv_end zeroed.
    auto load_tile = [&](int t, int stage, const kiln_u32 (&ids)[TILE_CHUNKS_PER_THREAD]) {
        const kiln_u32 k_stage = kv_smem + stage * 2 * TILE_BYTES;
#pragma unroll
        for (int i = 0; i < TILE_CHUNKS_PER_THREAD; ++i) {
            const int index = tid + i * THREADS;
            const int r = index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
            const int position = t * BLOCK_N + r;
            const bool valid = position < kv_end;
            const kiln_u64 offset = kiln_prefill_kv_offset(ids[i], position, c, kv_heads, kv_head, page_shift);
            const kiln_u32 at = kiln_swizzled(BLOCK_N, r, c);
            kiln_cp_async_16(k_stage + at, valid ? k_cache + offset : k_cache, valid);
            kiln_cp_async_16(k_stage + TILE_BYTES + at, valid ? v_cache + offset : v_cache, valid);
        }
    };

    kiln_u32 next_pages[TILE_CHUNKS_PER_THREAD];
    {
        kiln_u32 first_pages[TILE_CHUNKS_PER_THREAD];
        tile_pages(0, first_pages);
        tile_pages(1, next_pages);
        load_tile(0, 0, first_pages);
        kiln_cp_async_commit();
    }

    const int group_row0 = row0 + 64 * warpgroup;
    const bool group_active = group_row0 < rows;
    const kiln_prefill_rows my_rows =
        kiln_prefill_rows_of(row0, warpgroup, warp_in_group, group, rows, first_position, heads_per_group);
    const kiln_u32 q_group = q_smem + warpgroup * 64 * 128;

    // Accumulator layout of wgmma.m64nN (per warp, as mma.m16n8): d[4 j + 2 h + e] is row
    // 16 w + g + 8 h, column 8 j + 2 t + e.
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF};
    float row_sum[2] = {0.0f, 0.0f};

    for (int t = 0; t < tiles; ++t) {
        // Tile t (and Q) landed for every thread, and every warpgroup is done with tile t - 1,
        // whose stage takes tile t + 1.
        kiln_cp_async_wait<0>();
        kiln_fence_proxy_async();
        __syncthreads();
        if (t + 1 < tiles) {
            load_tile(t + 1, (t + 1) & 1, next_pages);
            kiln_cp_async_commit();
            tile_pages(t + 2, next_pages);
        }

        const int tile_start = t * BLOCK_N;
        // A warpgroup skips the tiles past its own causal limit.
        if (!group_active || tile_start > my_rows.last_position) continue;
        const kiln_u32 k_tile = kv_smem + (t & 1) * 2 * TILE_BYTES;
        float s[64];
        kiln_prefill_scores(s, q_group, k_tile);
        kiln_prefill_update(s, o, row_max, row_sum, my_rows, tile_start, kv_end, k_tile + TILE_BYTES, scale_log2,
                            thread_in_group);
    }
    kiln_cp_async_wait<0>();
    if (!group_active) return;
    kiln_prefill_store(out, o, row_sum, group_row0, rows, heads_per_group, q_begin, q_heads, kv_head, warp_in_group,
                       group, thread_in_group);
}

// ---- kiln_attention_prefill_pingpong: a copying warpgroup, two computing ones taking turns ----
// The same function and shared-memory layout (with PINGPONG_STAGES K/V stages), one more
// warpgroup: warpgroup 2 only copies K/V tiles (cp.async, lanes along a row, each warp a quarter
// of the rows; each tile's copies waited, fenced for the tensor cores and announced on the
// stage's `full` mbarrier), so the computing warpgroups issue no copies; each computing warp
// announces on the stage's `empty` mbarrier that it is done with a tile. The two computing
// warpgroups take turns to issue their S = Q K^T (named barriers 1 and 2), so one's softmax runs
// while the other's product occupies the tensor cores (FlashAttention-3's ping-pong schedule).
// Q: each computing warpgroup copies its own 64 rows. Registers: 384 threads leave 168 a thread
// at entry; setmaxnreg gives the copying warpgroup 40 and the computing ones 232 (a
// sub-partition holds one warp of each: 40 + 2 * 232 = 504 of its 512 a lane).
#define PINGPONG_STAGES 3
#define PRODUCER_GROUP WARPGROUPS
#define PINGPONG_THREADS (THREADS + 128)

KILN_DEVICE void kiln_mbarrier_init(kiln_u32 barrier, kiln_u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(count) : "memory");
}
KILN_DEVICE void kiln_mbarrier_arrive(kiln_u32 barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}
// Waits until the phase of parity `parity` of the barrier has completed.
KILN_DEVICE void kiln_mbarrier_wait(kiln_u32 barrier, kiln_u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nKILN_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra KILN_WAIT;\n}\n" ::"r"(barrier),
        "r"(parity)
        : "memory");
}
KILN_DEVICE void kiln_named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
KILN_DEVICE void kiln_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The computing warpgroups of kiln_attention_prefill_pingpong.
KILN_DEVICE void kiln_prefill_pingpong_compute(const kiln_u16* __restrict__ q, kiln_u16* __restrict__ out,
                                               kiln_u32 q_smem, kiln_u32 kv_smem, kiln_u32 full0, kiln_u32 empty0,
                                               int tid, int warpgroup, int warp_in_group, int lane, int group,
                                               int thread_in_group, int row0, int rows, int first_position,
                                               int heads_per_group, int q_begin, int q_heads, int kv_head,
                                               int kv_end, int tiles, float scale_log2) {
    // This warpgroup's Q rows (zeros past the sequence), visible to its tensor cores.
    const int tid_in_group = tid & 127;
#pragma unroll
    for (int i = 0; i < 64 * CHUNKS_PER_ROW / 128; ++i) {
        const int index = tid_in_group + i * 128;
        const int r = 64 * warpgroup + index / CHUNKS_PER_ROW, c = index % CHUNKS_PER_ROW;
        bool valid;
        const kiln_u16* source =
            kiln_prefill_q_source(q, row0, r, c, rows, heads_per_group, q_begin, q_heads, kv_head, valid);
        kiln_cp_async_16(q_smem + kiln_swizzled(BLOCK_M, r, c), source, valid);
    }
    kiln_cp_async_commit();
    kiln_cp_async_wait<0>();
    kiln_fence_proxy_async();
    kiln_named_sync(3 + warpgroup, 128);

    const int group_row0 = row0 + 64 * warpgroup;
    const bool group_active = group_row0 < rows;
    const kiln_prefill_rows my_rows =
        kiln_prefill_rows_of(row0, warpgroup, warp_in_group, group, rows, first_position, heads_per_group);
    const kiln_u32 q_group = q_smem + warpgroup * 64 * 128;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF};
    float row_sum[2] = {0.0f, 0.0f};

    // Turns: warpgroup w issues its scores after `bar.sync 1 + w` and hands the turn over with
    // `bar.arrive 2 - w`; warpgroup 1 hands warpgroup 0 the first turn, and not the one after its
    // last tile, so every barrier sees as many arrivals as waits.
    if (warpgroup == 1) kiln_named_arrive(1, 256);
    for (int t = 0; t < tiles; ++t) {
        const int stage = t % PINGPONG_STAGES;
        kiln_mbarrier_wait(full0 + 8 * stage, (t / PINGPONG_STAGES) & 1);
        const int tile_start = t * BLOCK_N;
        const bool compute = group_active && tile_start <= my_rows.last_position;
        const kiln_u32 k_tile = kv_smem + stage * 2 * TILE_BYTES;
        const bool hand_over = warpgroup == 0 || t + 1 < tiles;
        kiln_named_sync(1 + warpgroup, 256);
        // The products are issued and waited in one branch: ptxas serializes every wgmma of a
        // kernel whose issue and wait sit in different branches.
        if (compute) {
            float s[64];
            kiln_prefill_scores(s, q_group, k_tile);
            if (hand_over) kiln_named_arrive(2 - warpgroup, 256);
            kiln_prefill_update(s, o, row_max, row_sum, my_rows, tile_start, kv_end, k_tile + TILE_BYTES, scale_log2,
                                thread_in_group);
        } else if (hand_over) {
            kiln_named_arrive(2 - warpgroup, 256);
        }
        // This warp's products are complete (waited): the stage may be refilled.
        __syncwarp();
        if (lane == 0) kiln_mbarrier_arrive(empty0 + 8 * stage);
    }
    if (!group_active) return;
    kiln_prefill_store(out, o, row_sum, group_row0, rows, heads_per_group, q_begin, q_heads, kv_head, warp_in_group,
                       group, thread_in_group);
}

// Dynamic shared memory: as kiln_attention_prefill's with PINGPONG_STAGES stages.
extern "C" __global__ void __launch_bounds__(PINGPONG_THREADS, 1) kiln_attention_prefill_pingpong(
    const kiln_u16* __restrict__ q, const kiln_u16* __restrict__ k_cache, const kiln_u16* __restrict__ v_cache,
    const kiln_i32* __restrict__ query_offsets, const kiln_i32* __restrict__ context_lens,
    const kiln_i32* __restrict__ page_offsets, const kiln_u32* __restrict__ page_ids, kiln_u16* __restrict__ out,
    int q_heads, int kv_heads, int page_shift, float scale_log2) {
    kiln_wait_prior();
    extern __shared__ __align__(1024) kiln_u8 shared_bytes[];
    __shared__ alignas(8) kiln_u64 full_barriers[PINGPONG_STAGES];
    __shared__ alignas(8) kiln_u64 empty_barriers[PINGPONG_STAGES];
    const kiln_u32 q_smem = (kiln_smem_address(shared_bytes) + 1023u) & ~1023u;
    const kiln_u32 kv_smem = q_smem + Q_BYTES;  // stage s: K at kv_smem + 2 s TILE_BYTES, V after it
    const kiln_u32 full0 = kiln_smem_address(full_barriers), empty0 = kiln_smem_address(empty_barriers);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warpgroup = warp >> 2, warp_in_group = warp & 3;
    const int group = lane >> 2, thread_in_group = lane & 3;

    const int sequence = blockIdx.z, kv_head = blockIdx.y;
    const int q_begin = query_offsets[sequence];
    const int q_len = query_offsets[sequence + 1] - q_begin;
    const int context = context_lens[sequence];
    const int heads_per_group = q_heads / kv_heads;
    const int rows = q_len * heads_per_group;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;
    if (row0 >= rows) return;
    const int first_position = context - q_len;
    const kiln_u32* pages = page_ids + page_offsets[sequence];
    const int last_row = min(rows, row0 + BLOCK_M) - 1;
    const int kv_end = min(context, first_position + last_row / heads_per_group + 1);
    const int tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < PINGPONG_STAGES; ++s) {
            kiln_mbarrier_init(full0 + 8 * s, 128);  // the copying threads
            kiln_mbarrier_init(empty0 + 8 * s, 4 * WARPGROUPS);  // the consumer warps
        }
    }
    __syncthreads();

    if (warpgroup == PRODUCER_GROUP) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        // Warp w of this warpgroup copies rows 32 w .. 32 w + 31 of each tile: lane l chunk
        // l % 16 of rows 32 w + 2 j + l / 16 (j = 0 .. 15), each instruction two whole rows. Lane
        // l reads the page of row 32 w + l, one tile ahead.
        const int warp_row0 = 32 * warp_in_group;
        auto row_page = [&](int t) -> kiln_u32 {
            const int position = t * BLOCK_N + warp_row0 + lane;
            return (t < tiles && position < kv_end) ? pages[position >> page_shift] : 0u;
        };
        kiln_u32 page_of_lane = row_page(0);
        const int c = lane & 15;
        for (int t = 0; t < tiles; ++t) {
            const int stage = t % PINGPONG_STAGES;
            // The computing warps are done with the tile this stage held.
            if (t >= PINGPONG_STAGES) kiln_mbarrier_wait(empty0 + 8 * stage, ((t / PINGPONG_STAGES) - 1) & 1);
            const kiln_u32 k_stage = kv_smem + stage * 2 * TILE_BYTES;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int r = warp_row0 + 2 * j + (lane >> 4);
                const kiln_u32 page = __shfl_sync(KILN_FULL_MASK, page_of_lane, 2 * j + (lane >> 4));
                const int position = t * BLOCK_N + r;
                const bool valid = position < kv_end;
                const kiln_u64 offset = kiln_prefill_kv_offset(page, position, c, kv_heads, kv_head, page_shift);
                const kiln_u32 at = kiln_swizzled(BLOCK_N, r, c);
                kiln_cp_async_16(k_stage + at, valid ? k_cache + offset : k_cache, valid);
                kiln_cp_async_16(k_stage + TILE_BYTES + at, valid ? v_cache + offset : v_cache, valid);
            }
            kiln_cp_async_commit();
            page_of_lane = row_page(t + 1);
            // The tile before this one has landed: make it visible to the tensor cores.
            if (t >= 1) {
                kiln_cp_async_wait<1>();
                kiln_fence_proxy_async();
                kiln_mbarrier_arrive(full0 + 8 * ((t - 1) % PINGPONG_STAGES));
            }
        }
        kiln_cp_async_wait<0>();
        kiln_fence_proxy_async();
        kiln_mbarrier_arrive(full0 + 8 * ((tiles - 1) % PINGPONG_STAGES));
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
        kiln_prefill_pingpong_compute(q, out, q_smem, kv_smem, full0, empty0, tid, warpgroup, warp_in_group, lane,
                                      group, thread_in_group, row0, rows, first_position, heads_per_group, q_begin,
                                      q_heads, kv_head, kv_end, tiles, scale_log2);
    }
}
