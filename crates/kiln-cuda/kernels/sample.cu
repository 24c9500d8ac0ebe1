// The sampler: one token per row from fp32 logits, equal token for token to
// `kiln_core::ops::sample::sample` (its module docs are the specification: penalties, order
// keys, fixed-point weights, radix-selected top-k / top-p cutoffs, min-p, the Philox draw).
//
// One block per row (up to 256 rows, each with its own parameters). Every quantity that decides
// the token is an integer (counts, masses in units of 2^-31) or a value computed element-wise
// with the same fp32 operations as the reference, so the result does not depend on the order in
// which threads reduce: integer sums are exact in any order. No pass sorts the vocabulary: the
// top-k and top-p cutoffs are found by radix selection over the order keys, 8 bits per pass,
// with a 256-bin histogram in shared memory, and the tie at the chosen key by a scan in index
// order. The seed (in the parameters) and the step are read from device memory, so a captured
// decode step replays without the host.
//
// Memory floor: one read of the logits per row; this version reads them once per pass
// (argmax, 4 + 1 per radix selection, the mass, the draw), from L2 after the first.
//
// Penalties: the row's logits are copied to `scratch`; the history's tokens are counted in
// `counts` (zero on entry, zero again on exit: the first thread to take a token's count with
// atomicExch applies the penalty), so the count of every token is exact whatever the order.
//
// Compile-time constants: THREADS per block (a multiple of 32 up to 1024), PENALTIES (0 when the
// launcher has no penalty scratch: the penalties of the parameters are then not applied).
// Compiled with --fmad=false; the exp polynomial is the shared `kiln_exp_poly`.

#ifndef THREADS
#define THREADS 1024
#endif
#ifndef PENALTIES
#define PENALTIES 1
#endif
#define SAMPLE_WARPS (THREADS / 32)
#define NO_TOKEN 0xFFFFFFFFu

// Per-row parameters, laid out as `kiln_cuda::ops::sample::DeviceSamplingParams`.
struct KilnSampleParams {
    float temperature;        // 0: greedy
    kiln_u32 top_k;           // 0: off
    kiln_u32 top_p_units;     // round(top_p * 2^24); 2^24: off
    kiln_u32 min_weight;      // round(min_p * 2^24) << 7; 0: off
    float repetition;
    float presence;
    float frequency;
    kiln_u32 reserved;
    kiln_u64 seed;
    kiln_u64 stream;
};

__device__ __forceinline__ kiln_u32 sample_order_key(float y) {
    if (y != y) return 0u;
    kiln_u32 bits = y == 0.0f ? 0u : __float_as_uint(y);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// trunc(exp_poly(clamp(x / T) - m) * 2^31), as `weight(scaled_logit(x, T), m)` in Rust.
__device__ __forceinline__ kiln_u32 sample_weight(float x, float temperature, float m) {
    float z = x / temperature;
    z = fminf(fmaxf(z, -3.40282347e38f), 3.40282347e38f);
    return __float2uint_rz(kiln_exp_poly(z - m) * 2147483648.0f);
}

// Philox4x32-10 (Random123), the counter (step, stream) and the key seed.
__device__ __forceinline__ kiln_u64 sample_uniform(kiln_u64 seed, kiln_u64 step, kiln_u64 stream) {
    kiln_u32 c0 = (kiln_u32)step, c1 = (kiln_u32)(step >> 32), c2 = (kiln_u32)stream, c3 = (kiln_u32)(stream >> 32);
    kiln_u32 k0 = (kiln_u32)seed, k1 = (kiln_u32)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const kiln_u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const kiln_u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const kiln_u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return (kiln_u64)c0 | ((kiln_u64)c1 << 32);
}

// The row's view of the logits and the filters decided so far.
struct SampleRow {
    const float* x;
    long long vocab;
    float temperature;
    float m;             // the largest scaled logit
    kiln_u32 cut_key;    // a token is within the cutoff when key > cut_key, or key == cut_key and
    kiln_u32 cut_index;  // index <= cut_index (no cutoff: 0 and 0xFFFFFFFF, NaN excluded apart)
};

__device__ __forceinline__ bool sample_within(const SampleRow& row, kiln_u32 key, kiln_u32 index) {
    return key != 0u && (key > row.cut_key || (key == row.cut_key && index <= row.cut_index));
}

struct SampleShared {
    kiln_u64 bins[256];
    kiln_u64 warp_values[SAMPLE_WARPS];
    kiln_u64 value;
    kiln_u64 above;
    kiln_u32 prefix;
    kiln_u32 found_index;
    int found;
};

// Block-wide inclusive scan of a u64 per thread; returns the thread's inclusive prefix and
// writes the block's total to `total`. Exact in any order (integers).
__device__ __forceinline__ kiln_u64 sample_block_scan(kiln_u64 v, SampleShared& sh, kiln_u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, v, o);
        if (lane >= o) v += n;
    }
    if (lane == 31) sh.warp_values[warp] = v;
    __syncthreads();
    if (warp == 0) {
        kiln_u64 w = lane < SAMPLE_WARPS ? sh.warp_values[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, w, o);
            if (lane >= o) w += n;
        }
        if (lane < SAMPLE_WARPS) sh.warp_values[lane] = w;
    }
    __syncthreads();
    const kiln_u64 before = warp > 0 ? sh.warp_values[warp - 1] : 0ull;
    total = sh.warp_values[SAMPLE_WARPS - 1];
    __syncthreads();
    return before + v;
}

// The largest packed (key, lowest index) of the row: the greedy token.
__device__ __forceinline__ kiln_u64 sample_argmax(const SampleRow& row, SampleShared& sh) {
    kiln_u64 best = 0ull;
    for (long long i = threadIdx.x; i < row.vocab; i += THREADS) {
        const kiln_u64 packed = ((kiln_u64)sample_order_key(row.x[i]) << 32) | (kiln_u64)(0xFFFFFFFFu - (kiln_u32)i);
        best = packed > best ? packed : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, best, o);
        best = n > best ? n : best;
    }
    if (threadIdx.x == 0) sh.value = 0ull;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicMax(&sh.value, best);
    __syncthreads();
    const kiln_u64 out = sh.value;
    __syncthreads();
    return out;
}

// Amount of token i in a selection: 1 (top-k) or its weight (top-p); 0 outside `eligible`.
__device__ __forceinline__ kiln_u64 sample_amount(const SampleRow& row, bool mass, float x, kiln_u32 key,
                                                 kiln_u32 index) {
    if (!sample_within(row, key, index)) return 0ull;
    return mass ? (kiln_u64)sample_weight(x, row.temperature, row.m) : 1ull;
}

// Radix selection (see `radix_select` in Rust): the first token of the order at which the running
// amount over the tokens within the current cutoff reaches the target. For MASS the target is
// computed from the total mass (the first pass's sum) and `p_units`; for counts it is `target`.
// (One instance, called in a loop for both filters: two inlined copies make ptxas spill.)
// Returns the cutoff packed as key << 32 | index, or SAMPLE_NOT_FOUND.
#define SAMPLE_NOT_FOUND 0xFFFFFFFFFFFFFFFFull
__device__ __forceinline__ kiln_u64 sample_select(const SampleRow row, SampleShared& sh, bool mass, kiln_u64 target,
                                                  kiln_u32 p_units) {
    kiln_u32 prefix = 0u;
    bool ok = true;
    for (int shift = 24; shift >= 0 && ok; shift -= 8) {
        const kiln_u32 mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int b = threadIdx.x; b < 256; b += THREADS) sh.bins[b] = 0ull;
        __syncthreads();
        for (long long i = threadIdx.x; i < row.vocab; i += THREADS) {
            const float x = row.x[i];
            const kiln_u32 key = sample_order_key(x);
            if ((key & mask) == prefix) {
                const kiln_u64 a = sample_amount(row, mass, x, key, (kiln_u32)i);
                if (a) atomicAdd(&sh.bins[(key >> shift) & 0xFFu], a);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            kiln_u64 above = shift == 24 ? 0ull : sh.above;
            if (shift == 24 && mass) {
                kiln_u64 total = 0ull;
                for (int b = 0; b < 256; ++b) total += sh.bins[b];
                // max(1, ceil(total * p_units / 2^24)), exact in 128 bits.
                const kiln_u64 lo = total * (kiln_u64)p_units, hi = __umul64hi(total, (kiln_u64)p_units);
                const kiln_u64 add = lo + 0xFFFFFFull;
                const kiln_u64 carry = add < lo ? 1ull : 0ull;
                target = (add >> 24) | ((hi + carry) << 40);
                if (target == 0ull) target = 1ull;
                sh.value = target;
            }
            if (!mass) sh.value = target;
            int digit = -1;
            for (int b = 255; b >= 0; --b) {
                if (above + sh.bins[b] >= sh.value) {
                    digit = b;
                    break;
                }
                above += sh.bins[b];
            }
            sh.above = above;
            sh.found = digit >= 0;
            sh.prefix = prefix | (digit >= 0 ? ((kiln_u32)digit << shift) : 0u);
        }
        __syncthreads();
        ok = sh.found != 0;
        prefix = sh.prefix;
        target = sh.value;
        __syncthreads();
    }
    if (!ok) return SAMPLE_NOT_FOUND;
    // The tie at key `prefix`, in index order.
    kiln_u64 running = sh.above;
    if (threadIdx.x == 0) sh.found = 0;
    __syncthreads();
    bool found = false;
    for (long long base = 0; base < row.vocab && !found; base += THREADS) {
        const long long i = base + threadIdx.x;
        kiln_u64 a = 0ull;
        if (i < row.vocab) {
            const float x = row.x[i];
            const kiln_u32 key = sample_order_key(x);
            if (key == prefix) a = sample_amount(row, mass, x, key, (kiln_u32)i);
        }
        kiln_u64 chunk = 0ull;
        const kiln_u64 inclusive = sample_block_scan(a, sh, chunk);
        if (a && running + inclusive >= target && running + inclusive - a < target) {
            sh.found = 1;
            sh.found_index = (kiln_u32)i;
        }
        __syncthreads();
        found = sh.found != 0;
        running += chunk;
    }
    const kiln_u64 cut = found ? (((kiln_u64)prefix << 32) | sh.found_index) : SAMPLE_NOT_FOUND;
    __syncthreads();
    return cut;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_sample(const float* __restrict__ logits, long long vocab, long long row_stride,
            const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
            const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
            kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
            int stats_per_row, kiln_u32* __restrict__ tokens) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x;
    const KilnSampleParams p = params[r];
    SampleRow row;
    row.x = logits + (long long)r * row_stride;
    row.vocab = vocab;
    row.temperature = p.temperature;
    row.m = 0.0f;
    row.cut_key = 0u;
    row.cut_index = 0xFFFFFFFFu;

    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const bool penalties =
        PENALTIES && h1 > h0 && (p.repetition != 1.0f || p.presence != 0.0f || p.frequency != 0.0f);
    if (penalties) {
        float* out = scratch + (long long)r * vocab;
        kiln_u32* count = counts + (long long)r * vocab;
        for (long long i = threadIdx.x; i < vocab; i += THREADS) out[i] = row.x[i];
        // Tokens outside the vocabulary are refused by the launcher; skipped here all the same.
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            if (history[j] < vocab) atomicAdd(&count[history[j]], 1u);
        }
        __syncthreads();
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if (t >= vocab) continue;
            const kiln_u32 c = atomicExch(&count[t], 0u);
            if (c) {
                const float l = row.x[t];
                const float v = l > 0.0f ? l / p.repetition : l * p.repetition;
                out[t] = v - (((float)c * p.frequency) + p.presence);
            }
        }
        __syncthreads();
        row.x = out;
    }

    kiln_u64 best;
    if (p.temperature == 0.0f && stats != nullptr && !penalties) {
        best = 0ull;
        for (int i = threadIdx.x; i < stats_per_row; i += THREADS) {
            const kiln_u64 s = stats[(long long)r * stats_per_row + i];
            best = s > best ? s : best;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, best, o);
            best = n > best ? n : best;
        }
        if (threadIdx.x == 0) sh.value = 0ull;
        __syncthreads();
        if ((threadIdx.x & 31) == 0) atomicMax(&sh.value, best);
        __syncthreads();
        best = sh.value;
    } else {
        best = sample_argmax(row, sh);
    }
    if ((best >> 32) == 0ull) {
        if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return;
    }
    const kiln_u32 greedy = 0xFFFFFFFFu - (kiln_u32)best;
    if (p.temperature == 0.0f) {
        if (threadIdx.x == 0) tokens[r] = greedy;
        return;
    }
    {
        const float z = row.x[greedy] / p.temperature;
        row.m = fminf(fmaxf(z, -3.40282347e38f), 3.40282347e38f);
    }

    // Top-k (phase 0, counting tokens), then top-p (phase 1, summing weights within top-k).
#pragma unroll 1
    for (int phase = 0; phase < 2; ++phase) {
        const bool mass = phase == 1;
        if (mass ? p.top_p_units < (1u << 24) : p.top_k > 0u) {
            const kiln_u64 cut = sample_select(row, sh, mass, mass ? 0ull : (kiln_u64)p.top_k, p.top_p_units);
            if (cut != SAMPLE_NOT_FOUND) {
                row.cut_key = (kiln_u32)(cut >> 32);
                row.cut_index = (kiln_u32)cut;
            }
        }
    }

    // The kept mass, then the draw in index order.
    kiln_u64 mass = 0ull;
    for (long long i = threadIdx.x; i < vocab; i += THREADS) {
        const float x = row.x[i];
        const kiln_u32 key = sample_order_key(x);
        if (sample_within(row, key, (kiln_u32)i)) {
            const kiln_u32 w = sample_weight(x, p.temperature, row.m);
            if (w >= p.min_weight) mass += w;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mass += __shfl_xor_sync(KILN_FULL_MASK, mass, o);
    if (threadIdx.x == 0) sh.value = 0ull;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicAdd(&sh.value, mass);
    __syncthreads();
    mass = sh.value;
    const kiln_u64 u = sample_uniform(p.seed, steps[r], p.stream);
    const kiln_u64 target = __umul64hi(u, mass);
    if (threadIdx.x == 0) {
        sh.found = 0;
        sh.found_index = NO_TOKEN;
    }
    __syncthreads();
    kiln_u64 running = 0ull;
    bool found = false;
    for (long long base = 0; base < vocab && !found; base += THREADS) {
        const long long i = base + threadIdx.x;
        kiln_u64 w = 0ull;
        if (i < vocab) {
            const float x = row.x[i];
            const kiln_u32 key = sample_order_key(x);
            if (sample_within(row, key, (kiln_u32)i)) {
                const kiln_u32 wi = sample_weight(x, p.temperature, row.m);
                if (wi >= p.min_weight) w = wi;
            }
        }
        kiln_u64 chunk = 0ull;
        const kiln_u64 inclusive = sample_block_scan(w, sh, chunk);
        if (w && running + inclusive > target && running + inclusive - w <= target) {
            sh.found = 1;
            sh.found_index = (kiln_u32)i;
        }
        __syncthreads();
        found = sh.found != 0;
        running += chunk;
    }
    if (threadIdx.x == 0) tokens[r] = sh.found_index;
}
