// The glue of a transformer block on the device, between the matrix products: the attention
// input (per-head q/k RMSNorm, RoPE from a cos/sin table at positions read from device memory, q
// rounded to bf16, k and v written into the paged cache at slots read from device memory), the
// SwiGLU activation of the prefill path, conversions to the matrix inputs' 16-bit types, a bias
// add and a row gather. Every index comes from device memory, so a captured decode step replays
// as positions and pages move.
//
// Float types (OUT codes): 0 = fp32, 1 = fp16, 2 = bf16.

#include "kiln_prelude.cuh"

KILN_DEVICE void kiln_store_typed(void* out, kiln_u64 index, float value, int type) {
    if (type == 0) {
        ((float*)out)[index] = value;
    } else if (type == 1) {
        ((kiln_u16*)out)[index] = kiln_f32_to_f16(value);
    } else {
        ((kiln_u16*)out)[index] = kiln_f32_to_bf16(value);
    }
}

// One warp per (token, head) of the fused q|k|v rows: `qkv` is fp32 [tokens][(heads + 2 kv_heads)
// * head_dim]. Heads 0..heads are q, then kv_heads of k, then kv_heads of v. q and k are
// normalized per head (when `q_norm` / `k_norm` are given) and rotated; v is copied.
// The cache is [page][kv_head][slot][head_dim] bf16 with 2^page_shift slots a page; `slots[t]`
// is `page << page_shift | slot`. `cos_t` / `sin_t` are [position][rotary_dim / 2].
extern "C" __global__ void kiln_qkv_prepare(const float* __restrict__ qkv,
                                            const float* __restrict__ q_norm,
                                            const float* __restrict__ k_norm, float eps,
                                            const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, int rotary_dim,
                                            int interleaved, const int* __restrict__ positions,
                                            const kiln_u32* __restrict__ slots, kiln_u16* q_out,
                                            kiln_u16* k_cache, kiln_u16* v_cache, int tokens,
                                            int heads, int kv_heads, int head_dim, int page_shift) {
    kiln_wait_prior();
    __shared__ float row[FWD_WARPS][FWD_MAX_HEAD_DIM];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int all_heads = heads + 2 * kv_heads;
    const int token = blockIdx.y;
    const int head = blockIdx.x * FWD_WARPS + warp;
    if (token >= tokens || head >= all_heads) {
        return;
    }
    const float* src = qkv + ((kiln_u64)token * all_heads + head) * head_dim;
    float* x = row[warp];
    const bool is_q = head < heads;
    const bool is_k = !is_q && head < heads + kv_heads;
    const float* weight = is_q ? q_norm : (is_k ? k_norm : (const float*)0);
    float sum = 0.0f;
    for (int e = lane; e < head_dim; e += 32) {
        float v = src[e];
        x[e] = v;
        sum += v * v;
    }
    if (weight != 0) {
        sum = kiln_warp_sum(sum);
        const float r = 1.0f / sqrtf(sum / (float)head_dim + eps);
        for (int e = lane; e < head_dim; e += 32) {
            x[e] = x[e] * r * weight[e];
        }
    }
    __syncwarp();
    const int position = positions[token];
    const int half = rotary_dim / 2;
    const float* c = cos_t + (kiln_u64)position * half;
    const float* s = sin_t + (kiln_u64)position * half;
    kiln_u16* dst;
    if (is_q) {
        dst = q_out + ((kiln_u64)token * heads + head) * head_dim;
    } else {
        const kiln_u32 slot = slots[token];
        const kiln_u32 page = slot >> page_shift;
        const kiln_u32 in_page = slot & ((1u << page_shift) - 1u);
        const int kv_head = is_k ? head - heads : head - heads - kv_heads;
        const kiln_u64 offset =
            ((((kiln_u64)page * kv_heads + kv_head) << page_shift) + in_page) * head_dim;
        dst = (is_k ? k_cache : v_cache) + offset;
    }
    for (int e = lane; e < head_dim; e += 32) {
        float out = x[e];
        if (!is_k && !is_q) {
            // v passes through.
        } else if (e < rotary_dim) {
            if (interleaved) {
                const int i = e >> 1;
                out = (e & 1) ? x[e] * c[i] + x[e - 1] * s[i] : x[e] * c[i] - x[e + 1] * s[i];
            } else if (e < half) {
                out = x[e] * c[e] - x[e + half] * s[e];
            } else {
                const int i = e - half;
                out = x[e] * c[i] + x[i] * s[i];
            }
        }
        dst[e] = kiln_f32_to_bf16(out);
    }
}

// out[t][i] = silu(gate) * up of fp32 `gate_up` [tokens][2 * width] (gate columns, then up),
// written as `out_type`.
extern "C" __global__ void kiln_swiglu(const float* __restrict__ gate_up, void* out, kiln_u64 tokens,
                                       kiln_u64 width, int out_type) {
    kiln_wait_prior();
    const kiln_u64 total = tokens * width;
    for (kiln_u64 i = kiln_global_index(); i < total; i += kiln_grid_stride()) {
        const kiln_u64 t = i / width;
        const kiln_u64 j = i - t * width;
        const float g = gate_up[t * 2 * width + j];
        const float u = gate_up[t * 2 * width + width + j];
        kiln_store_typed(out, i, g / (1.0f + expf(-g)) * u, out_type);
    }
}

// bf16 -> fp16 of `count` values (the attention output into an fp16 matrix product).
extern "C" __global__ void kiln_bf16_to_f16(const kiln_u16* __restrict__ src, kiln_u16* dst, kiln_u64 count) {
    kiln_wait_prior();
    for (kiln_u64 i = kiln_global_index(); i < count; i += kiln_grid_stride()) {
        dst[i] = kiln_f32_to_f16(kiln_bf16_to_f32(src[i]));
    }
}

// x[t][i] += bias[i] for fp32 x [tokens][width].
extern "C" __global__ void kiln_add_bias(float* x, const float* __restrict__ bias, kiln_u64 tokens,
                                         kiln_u64 width) {
    kiln_wait_prior();
    const kiln_u64 total = tokens * width;
    for (kiln_u64 i = kiln_global_index(); i < total; i += kiln_grid_stride()) {
        x[i] += bias[i % width];
    }
}

// dst[r] = src[rows[r]] for fp32 rows of `width` values.
extern "C" __global__ void kiln_gather_rows(const float* __restrict__ src, const int* __restrict__ rows,
                                            int count, kiln_u64 width, float* dst) {
    kiln_wait_prior();
    const kiln_u64 total = (kiln_u64)count * width;
    for (kiln_u64 i = kiln_global_index(); i < total; i += kiln_grid_stride()) {
        const kiln_u64 r = i / width;
        const kiln_u64 j = i - r * width;
        dst[i] = src[(kiln_u64)rows[r] * width + j];
    }
}
