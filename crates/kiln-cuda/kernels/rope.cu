// RoPE applied in place to the q and k heads of a batch of tokens, optionally after Qwen3's
// per-head q/k RMSNorm: the CUDA twin of `kiln_core::ops::rope` (`apply_rope_typed` and
// `qk_norm_rope_typed`), equal to it bit for bit.
//
// Memory floor: one read and one write of every rotated head (of the rotary part only, without
// the norm); the positions, the cos / sin table rows and the norm weights come from L2.
//
// Layout: q is `tokens x q_heads x head_dim`, k is `tokens x k_heads x head_dim`, both row-major
// in X_T; `positions[t]` (u32) is token t's position, a row of the table: `cos[p * half + i]` and
// `sin[p * half + i]` (fp32, half = rotary_dim / 2) are pair i's cos and sin at position p, built
// by the CPU (`RopeTable`), so every frequency scaling comes with the table and no `sin` / `cos`
// of either side enters the bit-exact path.
//
// Work: one task per (token, head), q heads first; a group of LANES_PER_HEAD lanes (8, 16 or 32,
// aligned within a warp) owns a task, HEADS_PER_BLOCK groups per block. Lane l holds elements
// 256u + 8l .. + 8 of its head (16-byte loads), the layout of the fixed-order unit sum: with 8 or
// 16 lanes a head has at most one unit whose missing lanes would hold +0, and x + 0 = x for the
// non-negative sums of squares, so the shorter butterfly computes the same bits. The pairs of a
// rotation cross lanes (by rotary_dim / 2 elements, any even rotary_dim), so each group stages
// its head in shared memory after the norm and reads the partners back.
//
// A position outside the table makes the token's heads zero (all of each head) and sets `*flag`
// to 1; the kernel never clears the flag.
//
// Compile-time constants: X_T, W_T (KILN_F32 / KILN_F16 / KILN_BF16: activations, norm weights),
// LAYOUT (0 half-split, 1 interleaved), QK_NORM (0 / 1), LANES_PER_HEAD, HEADS_PER_BLOCK, UNITS
// (units of 256 per head; 1 unless LANES_PER_HEAD is 32).

#define KILN_ROPE_STAGE (UNITS * LANES_PER_HEAD * 8)

static_assert(LANES_PER_HEAD == 8 || LANES_PER_HEAD == 16 || LANES_PER_HEAD == 32, "LANES_PER_HEAD");
static_assert(LANES_PER_HEAD == 32 || UNITS == 1, "a head of more than 256 elements needs a full warp");

// The sum of a unit over the group's lanes, in the butterfly order of `kiln_warp_sum`.
__device__ __forceinline__ float kiln_rope_group_sum(float s) {
#pragma unroll
    for (int distance = LANES_PER_HEAD / 2; distance > 0; distance >>= 1) {
        s += __shfl_xor_sync(0xFFFFFFFFu, s, distance);
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(LANES_PER_HEAD * HEADS_PER_BLOCK)
kiln_rope(void* q, void* k, const unsigned int* __restrict__ positions, const float* __restrict__ cos_table,
          const float* __restrict__ sin_table, const void* __restrict__ q_weight,
          const void* __restrict__ k_weight, unsigned int* flag, float eps, long long tasks, int q_heads,
          int k_heads, int head_dim, int rotary_dim, unsigned int table_positions) {
    kiln_wait_prior();
    __shared__ float stage[HEADS_PER_BLOCK][KILN_ROPE_STAGE];
    const int lane = threadIdx.x % LANES_PER_HEAD;
    const int group = threadIdx.x / LANES_PER_HEAD;
    const long long task = (long long)blockIdx.x * HEADS_PER_BLOCK + group;
    const bool active = task < tasks;
    const int heads = q_heads + k_heads;
    const long long token = active ? task / heads : 0;
    const int head = active ? (int)(task % heads) : 0;
    const bool is_q = head < q_heads;
    void* data = is_q ? q : k;
    const long long base = (token * (is_q ? q_heads : k_heads) + (is_q ? head : head - q_heads)) * head_dim;
    const unsigned int position = active ? positions[token] : 0u;
    const bool in_table = position < table_positions;
    const int half = rotary_dim / 2;
    float* own = stage[group];

    // Without the norm, chunks past the rotary part are neither read nor written.
    float v[UNITS][8];
#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
        const int col = u * 256 + lane * 8;
        if (active && col < head_dim && (QK_NORM || col < rotary_dim)) {
            kiln_load8<X_T>(data, base + col, v[u]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[u][e] = 0.0f;
        }
    }

    if (QK_NORM) {
        float total = 0.0f;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            float sq[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) sq[e] = v[u][e] * v[u][e];
            total += kiln_rope_group_sum(kiln_lane_sum8(sq));
        }
        const float r = 1.0f / sqrtf(total / (float)head_dim + eps);
        const void* weight = is_q ? q_weight : k_weight;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int col = u * 256 + lane * 8;
            if (active && col < head_dim) {
                float w[8];
                kiln_load8<W_T>(weight, col, w);
#pragma unroll
                for (int e = 0; e < 8; ++e) v[u][e] = kiln_round<X_T>(kiln_round<X_T>(v[u][e] * r) * w[e]);
            }
        }
    }

#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
        const int col = u * 256 + lane * 8;
        if (col < head_dim) {
#pragma unroll
            for (int e = 0; e < 8; ++e) own[col + e] = v[u][e];
        }
    }
    __syncwarp();

    if (active && !in_table && lane == 0) *flag = 1u;
    const float* cos_row = cos_table + (long long)position * half;
    const float* sin_row = sin_table + (long long)position * half;
#pragma unroll
    for (int u = 0; u < UNITS; ++u) {
        const int col = u * 256 + lane * 8;
        if (!active || col >= head_dim || !(QK_NORM || col < rotary_dim || !in_table)) continue;
        float out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int j = col + e;
            float value = v[u][e];
            if (!in_table) {
                value = 0.0f;
            } else if (j < rotary_dim) {
                // Pair i is (ia, ib); this element is its first (a) or second (b) member.
                int i, ia, ib;
                if (LAYOUT == 0) {
                    i = j < half ? j : j - half;
                    ia = i;
                    ib = i + half;
                } else {
                    i = j >> 1;
                    ia = 2 * i;
                    ib = ia + 1;
                }
                const float c = cos_row[i];
                const float s = sin_row[i];
                const float a = own[ia];
                const float b = own[ib];
                value = kiln_round<X_T>(j == ia ? a * c - b * s : b * c + a * s);
            }
            out[e] = value;
        }
        kiln_store8<X_T>(data, base + col, out);
    }
}
