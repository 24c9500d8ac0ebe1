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
// Memory floor: one read of the logits per row; the single-block path reads them once per pass
// (argmax as float4, 4 + 1 per radix selection, the kept mass), from L2 after the first. The
// searches in index order (the tie at a selected key, the draw) take no barrier per chunk: each
// warp sums a contiguous segment, and only the warp whose segment holds the answer walks it.
// Radix histograms add warp-aggregated amounts (keys crowd into a few digits).
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

// The top-p target of a mass: max(1, ceil(mass * units / 2^24)), exact in 128 bits (units < 2^24:
// the kept tokens are those whose mass before them, in the order, is below it).
__device__ __forceinline__ kiln_u64 sample_top_p_target(kiln_u64 mass, kiln_u32 units) {
    const kiln_u64 lo = mass * (kiln_u64)units, hi = __umul64hi(mass, (kiln_u64)units);
    const kiln_u64 add = lo + 0xFFFFFFull;
    const kiln_u64 carry = add < lo ? 1ull : 0ull;
    const kiln_u64 target = (add >> 24) | ((hi + carry) << 40);
    return target == 0ull ? 1ull : target;
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

// The first index i of the row, in index order, at which the running sum of amount(i) (u64,
// exact) passes `t` (inclusive sum > t), with t = target_of(total of every amount); NO_TOKEN if
// none. Each warp sums a contiguous segment (coalesced, no block barrier per chunk), one scan of
// the warps' sums finds the segment that holds the crossing, and that warp alone walks it 32
// indices at a time with warp scans. Exact in any order: the sums are integers.
template <class Amount, class TargetOf>
__device__ __forceinline__ kiln_u32 sample_first_passing(Amount amount, TargetOf target_of, long long vocab,
                                                          SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long seg = (((vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS) + 31) & ~31ll;
    const long long s0 = (long long)warp * seg < vocab ? (long long)warp * seg : vocab;
    const long long s1 = s0 + seg < vocab ? s0 + seg : vocab;
    kiln_u64 sum = 0ull;
#pragma unroll 4
    for (long long i = s0 + lane; i < s1; i += 32) sum += amount(i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(KILN_FULL_MASK, sum, o);
    if (lane == 0) sh.warp_values[warp] = sum;
    if (threadIdx.x == 0) sh.found_index = NO_TOKEN;
    __syncthreads();
    kiln_u64 before = 0ull, total = 0ull;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const kiln_u64 v = sh.warp_values[w];
        before += w < warp ? v : 0ull;
        total += v;
    }
    const kiln_u64 t = target_of(total);
    if (sum != 0ull && before <= t && t - before < sum) {
        // This warp's segment holds the crossing (warp-uniform condition). Each lane sums a
        // contiguous run of it (from L1: the warp just read the segment), a warp scan finds the
        // run that holds the crossing, and the warp walks that run alone.
        const long long per = (s1 - s0 + 31) / 32;
        const long long r0 = s0 + lane * per < s1 ? s0 + lane * per : s1;
        const long long r1 = r0 + per < s1 ? r0 + per : s1;
        kiln_u64 run = 0ull;
#pragma unroll 4
        for (long long i = r0; i < r1; ++i) run += amount(i);
        kiln_u64 run_inclusive = run;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, run_inclusive, o);
            if (lane >= o) run_inclusive += n;
        }
        const bool holds = run != 0ull && before + run_inclusive > t && before + run_inclusive - run <= t;
        const int holder = __ffs(__ballot_sync(KILN_FULL_MASK, holds)) - 1;  // exactly one lane
        const long long w0 = __shfl_sync(KILN_FULL_MASK, r0, holder);
        const long long w1 = __shfl_sync(KILN_FULL_MASK, r1, holder);
        kiln_u64 running = before + __shfl_sync(KILN_FULL_MASK, run_inclusive - run, holder);
        for (long long base = w0; holder >= 0 && base < w1; base += 32) {
            const long long i = base + lane;
            const kiln_u64 a = i < w1 ? amount(i) : 0ull;
            kiln_u64 inclusive = a;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, inclusive, o);
                if (lane >= o) inclusive += n;
            }
            const bool hit = a != 0ull && running + inclusive > t && running + inclusive - a <= t;
            if (__ballot_sync(KILN_FULL_MASK, hit) != 0u) {
                if (hit) sh.found_index = (kiln_u32)i;
                break;
            }
            running += __shfl_sync(KILN_FULL_MASK, inclusive, 31);
        }
    }
    __syncthreads();
    const kiln_u32 found = sh.found_index;
    __syncthreads();
    return found;
}

// The largest packed (key, lowest index) of the row: the greedy token. The body of the row is
// read as float4 (four loads in flight per thread), the few logits before its first 16-byte
// boundary and after its last one one at a time.
__device__ __forceinline__ kiln_u64 sample_argmax(const SampleRow& row, SampleShared& sh) {
    kiln_u64 best = 0ull;
    auto consider = [&](float v, long long i) {
        const kiln_u64 packed = ((kiln_u64)sample_order_key(v) << 32) | (kiln_u64)(0xFFFFFFFFu - (kiln_u32)i);
        best = packed > best ? packed : best;
    };
    const long long misaligned = (long long)((16u - ((kiln_u32)(size_t)row.x & 15u)) & 15u) / 4;
    const long long head = misaligned < row.vocab ? misaligned : row.vocab;
    const long long quads = (row.vocab - head) / 4;
    const float4* body = reinterpret_cast<const float4*>(row.x + head);
    for (long long i = threadIdx.x; i < head; i += THREADS) consider(row.x[i], i);
#pragma unroll 4
    for (long long q = threadIdx.x; q < quads; q += THREADS) {
        const float4 f = body[q];
        const long long i = head + 4 * q;
        consider(f.x, i);
        consider(f.y, i + 1);
        consider(f.z, i + 2);
        consider(f.w, i + 3);
    }
    for (long long i = head + 4 * quads + threadIdx.x; i < row.vocab; i += THREADS) consider(row.x[i], i);
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
        // Keys crowd into few digits: the lanes of a warp with the same digit add their amounts
        // (each below 2^32, summed as two 16-bit halves) and one of them adds to the bin.
        for (long long base = 0; base < row.vocab; base += THREADS) {
            const long long i = base + threadIdx.x;
            kiln_u32 a = 0u, digit = 0xFFFFFFFFu;
            if (i < row.vocab) {
                const float x = row.x[i];
                const kiln_u32 key = sample_order_key(x);
                if ((key & mask) == prefix) {
                    a = (kiln_u32)sample_amount(row, mass, x, key, (kiln_u32)i);
                    if (a) digit = (key >> shift) & 0xFFu;
                }
            }
            const kiln_u32 peers = __match_any_sync(KILN_FULL_MASK, digit);
            const kiln_u32 low = __reduce_add_sync(peers, a & 0xFFFFu);
            const kiln_u32 high = __reduce_add_sync(peers, a >> 16);
            if (digit != 0xFFFFFFFFu && __ffs(peers) - 1 == (int)(threadIdx.x & 31))
                atomicAdd(&sh.bins[digit], (kiln_u64)low + ((kiln_u64)high << 16));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            kiln_u64 above = shift == 24 ? 0ull : sh.above;
            if (shift == 24 && mass) {
                kiln_u64 total = 0ull;
                for (int b = 0; b < 256; ++b) total += sh.bins[b];
                target = sample_top_p_target(total, p_units);
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
    // The tie at key `prefix`, in index order: the first index at which the running amount from
    // `above` reaches the target (above < target by the digit choice).
    const kiln_u64 above = sh.above;
    __syncthreads();
    auto tie_amount = [&](long long i) -> kiln_u64 {
        const float x = row.x[i];
        const kiln_u32 key = sample_order_key(x);
        return key == prefix ? sample_amount(row, mass, x, key, (kiln_u32)i) : 0ull;
    };
    const kiln_u64 t = target - 1ull - above;
    const kiln_u32 index = sample_first_passing(tie_amount, [&](kiln_u64) { return t; }, row.vocab, sh);
    return index != NO_TOKEN ? (((kiln_u64)prefix << 32) | index) : SAMPLE_NOT_FOUND;
}

// The single-block path: block (0, r) samples row r alone, with up to 12 passes over its logits.
// It serves what the multi-block path does not (top-k 0 or above FAST_KMAX at temperature > 0,
// greedy rows read from the LM head's statistics, and greedy rows without penalties when the
// launcher sets `greedy_single`).
__device__ __forceinline__ void sample_row_single(
    int r, const float* __restrict__ logits, long long vocab, long long row_stride,
    const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
    const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
    kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
    int stats_per_row, kiln_u32* __restrict__ tokens) {
    __shared__ SampleShared sh;
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

    // The kept mass and the draw in index order, in one pass over the row and a walk of one
    // warp's segment.
    auto kept_weight = [&](long long i) -> kiln_u64 {
        const float x = row.x[i];
        const kiln_u32 key = sample_order_key(x);
        if (!sample_within(row, key, (kiln_u32)i)) return 0ull;
        const kiln_u32 w = sample_weight(x, p.temperature, row.m);
        return w >= p.min_weight ? (kiln_u64)w : 0ull;
    };
    const kiln_u64 u = sample_uniform(p.seed, steps[r], p.stream);
    const kiln_u32 token =
        sample_first_passing(kept_weight, [&](kiln_u64 mass) { return __umul64hi(u, mass); }, vocab, sh);
    if (threadIdx.x == 0) tokens[r] = token;
}

// ---- The multi-block path ------------------------------------------------------------------
//
// Serves greedy rows and rows with 1 <= top_k <= FAST_KMAX (with any temperature, top-p, min-p
// and penalties). The grid is (slices, rows); block (s, r) holds slice s of row r in shared
// memory (read once from memory), applies the penalties of the history tokens that fall in its
// slice, and writes its exact local top-k (every candidate when the slice has at most k): short
// lists keep the last block's serial work small. The global top-k lies within the union of the
// local top-k's, and no token after any block's last candidate in the order (for a block with at least
// k candidates) can be in it, so the last block of the row to finish (a ticket counter) prunes
// the union by the earliest of those cutoffs, selects the exact top-k among what is left, and
// finishes on those k tokens alone: the weights (from the greedy token, the first of the order),
// top-p in rank order, min-p, and the draw in index order. Every quantity is the same integer or
// the same fp32 operation as in the reference, so the token does not depend on the slices.

#define FAST_SLICE_MAX 8192                  // logits one block holds (its slice)
#define FAST_BINS 2048                       // radix digits: 11, 11 and 10 bits of the order key
#define FAST_KMAX 256                        // the largest top-k this path serves
#define FAST_BLOCK_CAP 512                   // candidates one block may write
#define FAST_SMEM_CAP (FAST_SLICE_MAX / 2)   // candidates the last block keeps in shared memory
#if THREADS < FAST_KMAX
#error "the multi-block path needs THREADS >= FAST_KMAX (one thread per top-k survivor)"
#endif

struct FastShared {
    float vals[FAST_SLICE_MAX];      // the slice; in the last block, the pruned candidates
    kiln_u32 bins[FAST_BINS];        // a radix histogram; in the last block, the blocks' offsets
    float surv_val[FAST_KMAX];       // the top-k survivors, in index order
    kiln_u32 surv_idx[FAST_KMAX];
    kiln_u32 sorted_w[FAST_KMAX];    // survivors' weights in the order's rank
    kiln_u64 warp_u64[SAMPLE_WARPS];
    kiln_u32 warp_u32[SAMPLE_WARPS];
    kiln_u64 value;
    kiln_u32 sel_digit, sel_above, sel_count, top_p_rank;
    float top_value;
    int last;
};

// (key, lowest index) packed so that a larger value comes earlier in the order.
__device__ __forceinline__ kiln_u64 fast_pack(kiln_u32 key, kiln_u32 index) {
    return ((kiln_u64)key << 32) | (kiln_u64)(0xFFFFFFFFu - index);
}

// Exclusive prefix over the block's threads (thread order); the block's total in `total`.
template <typename T> __device__ __forceinline__ T fast_scan(T v, T* warp_buf, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(KILN_FULL_MASK, x, o);
        if (lane >= o) x += n;
    }
    if (lane == 31) warp_buf[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < SAMPLE_WARPS ? warp_buf[lane] : (T)0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(KILN_FULL_MASK, w, o);
            if (lane >= o) w += n;
        }
        if (lane < SAMPLE_WARPS) warp_buf[lane] = w;
    }
    __syncthreads();
    const T before = warp > 0 ? warp_buf[warp - 1] : (T)0;
    total = warp_buf[SAMPLE_WARPS - 1];
    __syncthreads();
    return before + x - v;
}

// The block's largest (MAX) or smallest u64.
template <bool MAX> __device__ __forceinline__ kiln_u64 fast_extreme(kiln_u64 v, FastShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, v, o);
        v = MAX ? (n > v ? n : v) : (n < v ? n : v);
    }
    if (lane == 0) sh.warp_u64[warp] = v;
    __syncthreads();
    if (warp == 0) {
        kiln_u64 w = lane < SAMPLE_WARPS ? sh.warp_u64[lane] : (MAX ? 0ull : ~0ull);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, w, o);
            w = MAX ? (n > w ? n : w) : (n < w ? n : w);
        }
        if (lane == 0) sh.value = w;
    }
    __syncthreads();
    const kiln_u64 out = sh.value;
    __syncthreads();
    return out;
}

struct FastCut {
    kiln_u32 prefix;  // the chosen key bits (lower bits 0 unless exact)
    kiln_u32 above;   // candidates whose key is above every key with this prefix
    bool exact;       // all 32 bits chosen: `prefix` is the key of the target-th token
};

// Radix selection over the n keys key_at(j) (0: not a candidate): the key at which the count of
// candidates in the order reaches `target` (1 <= target <= the candidates), 11, 11, then 10 bits
// at a time. Stops after a level whose chosen prefix has at most `cap` candidates at or above it.
// Counts in shared memory, one atomic per group of lanes with the same digit (keys crowd into few
// digits, and a lone atomic per token would serialize on them).
template <class KeyAt> __device__ __forceinline__ FastCut fast_select(KeyAt key_at, int n, kiln_u32 target,
                                                                      kiln_u32 cap, FastShared& sh) {
    FastCut cut;
    cut.prefix = 0u;
    cut.above = 0u;
    cut.exact = false;
#pragma unroll 1
    for (int level = 0; level < 3; ++level) {
        const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
        const int nbins = level == 2 ? 1024 : 2048;
        const kiln_u32 high = level == 0 ? 0u : (0xFFFFFFFFu << (shift + (level == 2 ? 10 : 11)));
        for (int b = threadIdx.x; b < nbins; b += THREADS) sh.bins[b] = 0u;
        __syncthreads();
        for (int base = 0; base < n; base += THREADS) {
            const int j = base + threadIdx.x;
            const kiln_u32 key = j < n ? key_at(j) : 0u;
            const bool match = key != 0u && (key & high) == cut.prefix;
            const kiln_u32 digit = (key >> shift) & (kiln_u32)(nbins - 1);
            const kiln_u32 peers = __match_any_sync(KILN_FULL_MASK, match ? digit : 0xFFFFFFFFu);
            if (match && __ffs(peers) - 1 == (int)(threadIdx.x & 31)) atomicAdd(&sh.bins[digit], (kiln_u32)__popc(peers));
        }
        __syncthreads();
        // The digit: the largest d with above + (candidates in digits >= d) >= target.
        const int per = (nbins + THREADS - 1) / THREADS;
        const int b0 = min(nbins, (int)threadIdx.x * per), b1 = min(nbins, b0 + per);
        kiln_u32 mine = 0u;
        for (int b = b0; b < b1; ++b) mine += sh.bins[b];
        kiln_u32 total;
        const kiln_u32 below = fast_scan(mine, sh.warp_u32, total);
        const kiln_u32 higher = cut.above + (total - below - mine);
        if (mine != 0u && higher < target && higher + mine >= target) {
            kiln_u32 acc = higher;
            for (int b = b1 - 1; b >= b0; --b) {
                const kiln_u32 c = sh.bins[b];
                if (acc + c >= target) {
                    sh.sel_digit = (kiln_u32)b;
                    sh.sel_above = acc;
                    sh.sel_count = c;
                    break;
                }
                acc += c;
            }
        }
        __syncthreads();
        cut.prefix |= sh.sel_digit << shift;
        cut.above = sh.sel_above;
        const kiln_u32 at_or_above = cut.above + sh.sel_count;
        __syncthreads();
        if (level == 2) {
            cut.exact = true;
        } else if (at_or_above <= cap) {
            break;
        }
    }
    return cut;
}

// Writes, in index order, the tokens j of [0, n) whose key is above `tau`, and the first `need`
// in index order of those whose key equals it: out(position, j). Each thread takes a run of
// consecutive j, so two block scans place every token. Returns the count; `last` gets the
// smallest fast_pack of the tokens written (the last of them in the order), ~0 if none.
template <class KeyAt, class IndexAt, class Out>
__device__ __forceinline__ kiln_u32 fast_emit(KeyAt key_at, IndexAt index_at, int n, kiln_u32 tau, kiln_u32 need,
                                              Out out, FastShared& sh, kiln_u64& last) {
    const int per = (n + THREADS - 1) / THREADS;
    const int j0 = min(n, (int)threadIdx.x * per), j1 = min(n, j0 + per);
    kiln_u32 total, tie_rank = 0u;
    if (need != 0u) {
        kiln_u32 ties = 0u;
        for (int j = j0; j < j1; ++j) ties += key_at(j) == tau ? 1u : 0u;
        tie_rank = fast_scan(ties, sh.warp_u32, total);
    }
    kiln_u32 count = 0u;
    {
        kiln_u32 t = tie_rank;
        for (int j = j0; j < j1; ++j) {
            const kiln_u32 key = key_at(j);
            if (key > tau || (key == tau && t < need)) ++count;
            if (key == tau) ++t;
        }
    }
    kiln_u32 position = fast_scan(count, sh.warp_u32, total);
    kiln_u64 lowest = ~0ull;
    {
        kiln_u32 t = tie_rank;
        for (int j = j0; j < j1; ++j) {
            const kiln_u32 key = key_at(j);
            const bool emit = key > tau || (key == tau && t < need);
            if (key == tau) ++t;
            if (emit) {
                out(position++, j);
                const kiln_u64 packed = fast_pack(key, index_at(j));
                lowest = packed < lowest ? packed : lowest;
            }
        }
    }
    last = fast_extreme<false>(lowest, sh);
    return total;
}

// Candidate lists of the multi-block path, in the launcher's scratch (`SampleScratch`):
// for row r and block s, slot r * slots + s of `counts` and `cuts`, and the candidates
// (value after the penalties, token index) at [(r * slots + s) * FAST_BLOCK_CAP, + count).
// `overflow_*` holds a row's pruned candidates (slots * FAST_BLOCK_CAP per row) when they
// exceed FAST_SMEM_CAP. `tickets` (one per row) is zero on entry and left zero.
struct FastWork {
    kiln_u32* tickets;
    kiln_u32* counts;
    kiln_u64* cuts;
    float* values;
    kiln_u32* indices;
    float* overflow_values;
    kiln_u32* overflow_indices;
    int slots;
    long long slice_len;
};

__device__ __forceinline__ void sample_row_fast(int r, kiln_u32 k, bool penalties, const float* __restrict__ x,
                                                long long vocab, const KilnSampleParams& p,
                                                const kiln_u64* __restrict__ steps, kiln_u32 h0, kiln_u32 h1,
                                                const kiln_u32* __restrict__ history,
                                                kiln_u32* __restrict__ counts, kiln_u32* __restrict__ tokens,
                                                const FastWork& work) {
    __shared__ FastShared sh;
    const int s = blockIdx.x;
    const long long lo = (long long)s * work.slice_len;
    const long long hi_raw = lo + work.slice_len < vocab ? lo + work.slice_len : vocab;
    const int n = hi_raw > lo ? (int)(hi_raw - lo) : 0;  // the launcher keeps n <= FAST_SLICE_MAX
    {
        // Every load of the slice in flight before the first store.
        float v[(FAST_SLICE_MAX + THREADS - 1) / THREADS];
#pragma unroll
        for (int u = 0; u < (FAST_SLICE_MAX + THREADS - 1) / THREADS; ++u) {
            const int i = u * THREADS + (int)threadIdx.x;
            v[u] = i < n ? __ldg(&x[lo + i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < (FAST_SLICE_MAX + THREADS - 1) / THREADS; ++u) {
            const int i = u * THREADS + (int)threadIdx.x;
            if (i < n) sh.vals[i] = v[u];
        }
    }
    __syncthreads();
    if (penalties) {
        // The history tokens of this slice: counted in `counts` (zero on entry and on exit; only
        // this block touches this slice's entries), the penalty applied by the thread that takes
        // a token's count.
        kiln_u32* count = counts + (long long)r * vocab;
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t >= lo && (long long)t < lo + n) atomicAdd(&count[t], 1u);
        }
        __syncthreads();
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t < lo || (long long)t >= lo + n) continue;
            const kiln_u32 c = atomicExch(&count[t], 0u);
            if (c) {
                const float l = sh.vals[t - lo];
                const float v = l > 0.0f ? l / p.repetition : l * p.repetition;
                sh.vals[t - lo] = v - (((float)c * p.frequency) + p.presence);
            }
        }
        __syncthreads();
    }

    const long long slot = (long long)r * work.slots + s;
    float* out_values = work.values + slot * FAST_BLOCK_CAP;
    kiln_u32* out_indices = work.indices + slot * FAST_BLOCK_CAP;
    auto slice_key = [&](int j) { return sample_order_key(sh.vals[j]); };
    auto slice_index = [&](int j) { return (kiln_u32)(lo + j); };
    kiln_u32 written;
    kiln_u64 last;
    if (k == 1u) {
        // The slice's first token of the order.
        kiln_u64 best = 0ull;
        for (int j = threadIdx.x; j < n; j += THREADS) {
            const kiln_u32 key = slice_key(j);
            const kiln_u64 packed = fast_pack(key, slice_index(j));
            if (key != 0u && packed > best) best = packed;
        }
        best = fast_extreme<true>(best, sh);
        written = best != 0ull ? 1u : 0u;
        last = best;
        if (threadIdx.x == 0 && written) {
            const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)best;
            out_values[0] = sh.vals[index - lo];
            out_indices[0] = index;
        }
    } else {
        kiln_u32 valid = 0u, total;
        for (int j = threadIdx.x; j < n; j += THREADS) valid += slice_key(j) != 0u ? 1u : 0u;
        fast_scan(valid, sh.warp_u32, total);
        kiln_u32 tau = 0u, need = 0u;  // default: every candidate of the slice
        if (total > k) {
            // The exact local top-k: short lists keep the last block's union small.
            const FastCut cut = fast_select(slice_key, n, k, k, sh);
            if (cut.exact) {
                tau = cut.prefix;
                need = k - cut.above;
            } else {
                tau = cut.prefix - 1u;  // key >= prefix (a valid key's top 11 bits are never 0)
            }
        }
        auto write = [&](kiln_u32 position, int j) {
            out_values[position] = sh.vals[j];
            out_indices[position] = slice_index(j);
        };
        written = fast_emit(slice_key, slice_index, n, tau, need, write, sh, last);
    }
    if (threadIdx.x == 0) {
        work.counts[slot] = written;
        work.cuts[slot] = written ? last : 0ull;
    }

    // The last block of the row to finish goes on; every thread fences its own writes first.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const kiln_u32 ticket = atomicAdd(&work.tickets[r], 1u);
        sh.last = ticket == gridDim.x - 1u;
        if (sh.last) {
            work.tickets[r] = 0u;  // every block of the row has taken its ticket
            __threadfence();
        }
    }
    __syncthreads();
    if (!sh.last) return;

    // The blocks' lists: offsets (in sh.bins) and the earliest cutoff of a block with >= k.
    const int blocks = (int)gridDim.x;  // <= THREADS (launcher)
    kiln_u32 listed = 0u;
    kiln_u64 cut = 0ull;
    if ((int)threadIdx.x < blocks) {
        const long long b = (long long)r * work.slots + threadIdx.x;
        listed = __ldcg(&work.counts[b]);
        const kiln_u64 c = __ldcg(&work.cuts[b]);
        cut = listed >= k ? c : 0ull;
    }
    const kiln_u64 prune = fast_extreme<true>(cut, sh);
    kiln_u32 all;
    const kiln_u32 offset = fast_scan(listed, sh.warp_u32, all);
    if ((int)threadIdx.x < blocks) sh.bins[threadIdx.x] = offset;
    if (threadIdx.x == 0) sh.bins[blocks] = all;
    __syncthreads();

    // Pruned union, in index order (block order, then each list's order), into shared memory
    // or, when too many, into the row's overflow lists.
    const float* lists_values = work.values + (long long)r * work.slots * FAST_BLOCK_CAP;
    const kiln_u32* lists_indices = work.indices + (long long)r * work.slots * FAST_BLOCK_CAP;
    float* cand_values = sh.vals;
    kiln_u32* cand_indices = reinterpret_cast<kiln_u32*>(sh.vals + FAST_SMEM_CAP);
    kiln_u32 m_count;
    if (all <= FAST_SMEM_CAP) {
        // Staged in shared memory with every load in flight (thread j takes union entries j,
        // j + THREADS, ...), then pruned in place: each thread holds its run in registers
        // across the scan's barriers, so no write lands before every read.
#pragma unroll 4
        for (int j = threadIdx.x; j < (int)all; j += THREADS) {
            int a = 0, z = blocks - 1;
            while (a < z) {
                const int mid = (a + z + 1) >> 1;
                if (sh.bins[mid] <= (kiln_u32)j) a = mid; else z = mid - 1;
            }
            const long long at = (long long)a * FAST_BLOCK_CAP + (j - (int)sh.bins[a]);
            cand_values[j] = __ldcg(&lists_values[at]);
            cand_indices[j] = __ldcg(&lists_indices[at]);
        }
        __syncthreads();
        constexpr int RUN = (FAST_SMEM_CAP + THREADS - 1) / THREADS;
        const int per = ((int)all + THREADS - 1) / THREADS;  // <= RUN
        const int j0 = min((int)all, (int)threadIdx.x * per), j1 = min((int)all, j0 + per);
        float run_values[RUN];
        kiln_u32 run_indices[RUN];
        kiln_u32 kept = 0u;
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
            const int j = j0 + u;
            run_values[u] = j < j1 ? cand_values[j] : 0.0f;
            run_indices[u] = j < j1 ? cand_indices[j] : 0u;
            if (j < j1 && fast_pack(sample_order_key(run_values[u]), run_indices[u]) >= prune) ++kept;
        }
        kiln_u32 position = fast_scan(kept, sh.warp_u32, m_count);
#pragma unroll
        for (int u = 0; u < RUN; ++u) {
            if (j0 + u < j1 && fast_pack(sample_order_key(run_values[u]), run_indices[u]) >= prune) {
                cand_values[position] = run_values[u];
                cand_indices[position] = run_indices[u];
                ++position;
            }
        }
    } else {
        const int per = ((int)all + THREADS - 1) / THREADS;
        const int j0 = min((int)all, (int)threadIdx.x * per), j1 = min((int)all, j0 + per);
        int b_start = 0;
        if (j0 < j1) {
            int a = 0, z = blocks - 1;
            while (a < z) {
                const int mid = (a + z + 1) >> 1;
                if (sh.bins[mid] <= (kiln_u32)j0) a = mid; else z = mid - 1;
            }
            b_start = a;
        }
        kiln_u32 kept = 0u;
        {
            int b = b_start;
            for (int j = j0; j < j1; ++j) {
                while (sh.bins[b + 1] <= (kiln_u32)j) ++b;
                const long long at = (long long)b * FAST_BLOCK_CAP + (j - (int)sh.bins[b]);
                const kiln_u32 key = sample_order_key(__ldcg(&lists_values[at]));
                if (fast_pack(key, __ldcg(&lists_indices[at])) >= prune) ++kept;
            }
        }
        kiln_u32 position = fast_scan(kept, sh.warp_u32, m_count);
        if (m_count > FAST_SMEM_CAP) {
            cand_values = work.overflow_values + (long long)r * work.slots * FAST_BLOCK_CAP;
            cand_indices = work.overflow_indices + (long long)r * work.slots * FAST_BLOCK_CAP;
        }
        {
            int b = b_start;
            for (int j = j0; j < j1; ++j) {
                while (sh.bins[b + 1] <= (kiln_u32)j) ++b;
                const long long at = (long long)b * FAST_BLOCK_CAP + (j - (int)sh.bins[b]);
                const float v = __ldcg(&lists_values[at]);
                const kiln_u32 index = __ldcg(&lists_indices[at]);
                if (fast_pack(sample_order_key(v), index) >= prune) {
                    cand_values[position] = v;
                    cand_indices[position] = index;
                    ++position;
                }
            }
        }
    }
    __syncthreads();
    const int m_n = (int)m_count;
    auto cand_key = [&](int j) { return sample_order_key(cand_values[j]); };
    auto cand_index = [&](int j) { return cand_indices[j]; };

    if (m_n == 0 || p.temperature == 0.0f) {
        kiln_u64 best = 0ull;
        for (int j = threadIdx.x; j < m_n; j += THREADS) {
            const kiln_u64 packed = fast_pack(cand_key(j), cand_index(j));
            best = packed > best ? packed : best;
        }
        best = fast_extreme<true>(best, sh);
        if (threadIdx.x == 0) tokens[r] = best != 0ull ? 0xFFFFFFFFu - (kiln_u32)best : NO_TOKEN;
        return;
    }

    // The exact top-k among the pruned union (all of it when it holds at most k).
    kiln_u32 tau = 0u, need = 0u;
    if ((kiln_u32)m_n > k) {
        const FastCut top = fast_select(cand_key, m_n, k, 0u, sh);
        tau = top.prefix;
        need = k - top.above;
    }
    auto keep = [&](kiln_u32 position, int j) {
        sh.surv_val[position] = cand_values[j];
        sh.surv_idx[position] = cand_indices[j];
    };
    kiln_u64 unused;
    const int kk = (int)fast_emit(cand_key, cand_index, m_n, tau, need, keep, sh, unused);
    __syncthreads();

    // Survivor j (thread j) in index order; its rank in the order; the weights from the first.
    const int j = threadIdx.x;
    const bool mine = j < kk;
    const float v = mine ? sh.surv_val[j] : 0.0f;
    const kiln_u32 key = mine ? sample_order_key(v) : 0u;
    kiln_u32 rank = 0u;
    if (mine) {
        for (int l = 0; l < kk; ++l) {
            const kiln_u32 other = sample_order_key(sh.surv_val[l]);
            rank += (other > key || (other == key && l < j)) ? 1u : 0u;
        }
        if (rank == 0u) sh.top_value = v;
    }
    __syncthreads();
    float m = sh.top_value / p.temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const kiln_u32 w = mine ? sample_weight(v, p.temperature, m) : 0u;
    bool kept_token = mine;
    if (p.top_p_units < (1u << 24)) {
        kiln_u64 mass;
        fast_scan((kiln_u64)w, sh.warp_u64, mass);
        const kiln_u64 target = sample_top_p_target(mass, p.top_p_units);
        if (mine) sh.sorted_w[rank] = w;
        __syncthreads();
        const kiln_u64 ws = j < kk ? (kiln_u64)sh.sorted_w[j] : 0ull;
        kiln_u64 unused_total;
        const kiln_u64 before = fast_scan(ws, sh.warp_u64, unused_total);
        if (j < kk && before < target && before + ws >= target) sh.top_p_rank = (kiln_u32)j;
        __syncthreads();
        kept_token = mine && rank <= sh.top_p_rank;
    }
    const kiln_u64 kw = kept_token && w >= p.min_weight ? (kiln_u64)w : 0ull;
    kiln_u64 kept_mass;
    const kiln_u64 before = fast_scan(kw, sh.warp_u64, kept_mass);
    const kiln_u64 u = sample_uniform(p.seed, steps[r], p.stream);
    const kiln_u64 target = __umul64hi(u, kept_mass);
    if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
    __syncthreads();
    if (kw != 0ull && before <= target && before + kw > target) tokens[r] = sh.surv_idx[j];
}

// ---- The multi-block mass path ------------------------------------------------------------
//
// Serves rows at temperature > 0 with top-k off (temperature, top-p, min-p, penalties), on the
// same (slices, rows) grid, in three launches of one sequence:
//   1. `kiln_sample` (block (s, r)): applies the penalties of the history tokens in slice s into
//      the penalty scratch, and writes the slice's packed (key, lowest index) maximum.
//   2. `kiln_sample_mass`: every block takes the row's greedy token from the slices' maxima,
//      hence m, and sums its slice's kept weights (w >= min_weight). For top-p it also adds each
//      weight into a per-row histogram over the bin of d = m - z (MASS_BINS bins of 1/128): d is
//      monotone in the order key, so a lower bin holds only tokens earlier in the order, and the
//      order's running mass crosses the top-p target in one bin b*. Without top-p, the last block
//      (ticket) draws: the slice whose running kept mass passes r, then the token within it. With
//      top-p, the last block finds b* and the mass above it, and zeroes the histogram.
//   3. `kiln_sample_mass_pick` (top-p rows only): every block sums its slice's kept weights in
//      bins before b* and lists its tokens of bin b*; the last block sorts the (at most
//      MASS_LIST_CAP) listed tokens in the order (bitonic, in shared memory), finds the exact
//      cutoff by a scan of their weights from the mass above b*, adds the listed tokens within the
//      cutoff to their slices' kept mass, and draws as above. A bin b* with more tokens than the
//      lists hold (ties crowd one bin) is flagged in the row state, and
//   4. `kiln_sample_mass_fallback` (grid (1, rows)) samples the flagged rows on the single-block
//      path.
// Every sum is an integer and every weight the reference's fp32 operations on the same value, so
// the token is the reference's whatever the slices and the order of the atomics.

#define MASS_BINS 4096          // bins of d = m - z, 1/MASS_BIN_SCALE wide; the last one open
#define MASS_BIN_SCALE 128.0f
#define MASS_LIST_CAP 2048      // tokens of bin b* the last block sorts (a power of two)
#define MASS_MAX_SLICES 1024    // slices per row (the launcher keeps them <= SAMPLE_THREADS)

// Rows the mass path serves (the same test in all three kernels).
__device__ __forceinline__ bool sample_mass_row(const KilnSampleParams& p, int mass_path) {
    return mass_path != 0 && p.temperature != 0.0f && p.top_k == 0u;
}

__device__ __forceinline__ bool sample_penalized(const KilnSampleParams& p, const kiln_u32* counts, kiln_u32 h0,
                                                 kiln_u32 h1) {
    return PENALTIES && counts != nullptr && h1 > h0 &&
           (p.repetition != 1.0f || p.presence != 0.0f || p.frequency != 0.0f);
}

// The bin of a token of scaled logit z <= m: monotone non-increasing in z (each step is).
__device__ __forceinline__ int sample_mass_bin(float z, float m) {
    return (int)fminf((m - z) * MASS_BIN_SCALE, (float)(MASS_BINS - 1));
}

// The scratch regions of the mass path (`SampleScratch`), row r and block s at slot
// r * slots + s: `maxima` (packed slice maxima), `slot_mass` (kept mass of a slice, u64),
// `list_counts` / `list_values` / `list_indices` (a slice's tokens of bin b*, FAST_BLOCK_CAP per
// slot), `histogram` (MASS_BINS u64 per row, zero between launches), `row_state` (4 u64 per row:
// b*, the mass above it, the top-p target), `tickets` (one per row, zero between launches).
struct MassWork {
    kiln_u32* tickets;
    kiln_u64* maxima;
    kiln_u64* slot_mass;
    kiln_u64* histogram;
    kiln_u64* row_state;
    kiln_u32* list_counts;
    float* list_values;
    kiln_u32* list_indices;
    int slots;
    long long slice_len;
};

// Step 1, in `kiln_sample`: the penalties of slice s into `penalized` and the slice's maximum.
__device__ __forceinline__ void sample_mass_maxima(int r, bool penalties, const float* __restrict__ row,
                                                   float* penalized, long long vocab, const KilnSampleParams& p,
                                                   kiln_u32 h0, kiln_u32 h1, const kiln_u32* __restrict__ history,
                                                   kiln_u32* counts, const MassWork& work) {
    __shared__ kiln_u64 best_shared;
    const long long lo = (long long)blockIdx.x * work.slice_len;
    const long long hi = lo + work.slice_len < vocab ? lo + work.slice_len : vocab;
    const float* x = row;
    if (penalties) {
        for (long long i = lo + threadIdx.x; i < hi; i += THREADS) penalized[i] = row[i];
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t >= lo && (long long)t < hi) atomicAdd(&counts[t], 1u);
        }
        __syncthreads();
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t < lo || (long long)t >= hi) continue;
            const kiln_u32 c = atomicExch(&counts[t], 0u);
            if (c) {
                const float l = row[t];
                const float v = l > 0.0f ? l / p.repetition : l * p.repetition;
                penalized[t] = v - (((float)c * p.frequency) + p.presence);
            }
        }
        __syncthreads();
        x = penalized;
    }
    kiln_u64 best = 0ull;
    for (long long i = lo + threadIdx.x; i < hi; i += THREADS) {
        const kiln_u32 key = sample_order_key(x[i]);
        const kiln_u64 packed = key != 0u ? fast_pack(key, (kiln_u32)i) : 0ull;
        best = packed > best ? packed : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, best, o);
        best = n > best ? n : best;
    }
    if (threadIdx.x == 0) best_shared = 0ull;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicMax(&best_shared, best);
    __syncthreads();
    if (threadIdx.x == 0) work.maxima[(long long)r * work.slots + blockIdx.x] = best_shared;
}

struct MassDrawShared {
    kiln_u64 slice_mass[MASS_MAX_SLICES];
    kiln_u64 warp_u64[SAMPLE_WARPS];
    kiln_u64 value;
    kiln_u64 pick_before;
    int pick_slice;
    int last;
};

// The row's greedy token (packed) from the slices' maxima; 0 when every logit is NaN.
__device__ __forceinline__ kiln_u64 sample_mass_greedy(int r, const MassWork& work, MassDrawShared& sh) {
    kiln_u64 best = 0ull;
    for (int s = threadIdx.x; s < (int)gridDim.x; s += THREADS) {
        const kiln_u64 v = work.maxima[(long long)r * work.slots + s];
        best = v > best ? v : best;
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

// The block's sum of a u64 (every thread gets it).
__device__ __forceinline__ kiln_u64 sample_mass_sum(kiln_u64 v, MassDrawShared& sh) {
    kiln_u64 total;
    fast_scan(v, sh.warp_u64, total);
    return total;
}

// Takes the row's ticket after every thread's writes; true in the last block of the row, which
// leaves the ticket at zero.
__device__ __forceinline__ bool sample_mass_ticket(int r, const MassWork& work, MassDrawShared& sh) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const kiln_u32 ticket = atomicAdd(&work.tickets[r], 1u);
        sh.last = ticket == gridDim.x - 1u;
        if (sh.last) {
            work.tickets[r] = 0u;
            __threadfence();
        }
    }
    __syncthreads();
    return sh.last != 0;
}

// The draw (step 8) from the slices' kept masses in sh.slice_mass: the slice whose running kept
// mass passes r = (u * total) >> 64, then, within it, the first index whose running kept weight
// passes it. Kept: within the cutoff (cut_key, cut_index) and weight >= min_weight.
__device__ __forceinline__ void sample_mass_draw(int r, const float* x, long long vocab, float m,
                                                 kiln_u32 cut_key, kiln_u32 cut_index, const KilnSampleParams& p,
                                                 const kiln_u64* __restrict__ steps, kiln_u32* tokens,
                                                 const MassWork& work, MassDrawShared& sh) {
    const int slices = (int)gridDim.x;
    const int per_slices = (slices + THREADS - 1) / THREADS;
    const int s0 = min(slices, (int)threadIdx.x * per_slices), s1 = min(slices, s0 + per_slices);
    kiln_u64 local = 0ull;
    for (int s = s0; s < s1; ++s) local += sh.slice_mass[s];
    kiln_u64 total;
    const kiln_u64 before = fast_scan(local, sh.warp_u64, total);
    const kiln_u64 u = sample_uniform(p.seed, steps[r], p.stream);
    const kiln_u64 target = __umul64hi(u, total);  // < total (total >= 2^31: the greedy token)
    if (threadIdx.x == 0) {
        sh.pick_slice = -1;
        tokens[r] = NO_TOKEN;
    }
    __syncthreads();
    if (local != 0ull && before <= target && target - before < local) {
        kiln_u64 acc = before;
        for (int s = s0; s < s1; ++s) {
            const kiln_u64 v = sh.slice_mass[s];
            if (target - acc < v) {
                sh.pick_slice = s;
                sh.pick_before = acc;
                break;
            }
            acc += v;
        }
    }
    __syncthreads();
    const int pick = sh.pick_slice;
    if (pick < 0) return;
    const kiln_u64 t = target - sh.pick_before;
    const long long lo = (long long)pick * work.slice_len;
    const long long hi = lo + work.slice_len < vocab ? lo + work.slice_len : vocab;
    const long long per = (hi - lo + THREADS - 1) / THREADS;
    const long long j0 = lo + threadIdx.x * per < hi ? lo + threadIdx.x * per : hi;
    const long long j1 = j0 + per < hi ? j0 + per : hi;
    auto kept = [&](long long i) -> kiln_u64 {
        const float v = x[i];
        const kiln_u32 key = sample_order_key(v);
        if (key == 0u || !(key > cut_key || (key == cut_key && (kiln_u32)i <= cut_index))) return 0ull;
        const kiln_u32 w = sample_weight(v, p.temperature, m);
        return w >= p.min_weight ? (kiln_u64)w : 0ull;
    };
    kiln_u64 run = 0ull;
    for (long long i = j0; i < j1; ++i) run += kept(i);
    kiln_u64 unused;
    const kiln_u64 run_before = fast_scan(run, sh.warp_u64, unused);
    if (run != 0ull && run_before <= t && t - run_before < run) {
        kiln_u64 acc = run_before;
        for (long long i = j0; i < j1; ++i) {
            acc += kept(i);
            if (acc > t) {
                tokens[r] = (kiln_u32)i;
                break;
            }
        }
    }
}

// Step 2: see the section's comment.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_sample_mass(const float* __restrict__ logits, long long vocab, long long row_stride,
                 const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                 const kiln_u32* __restrict__ history_offsets, const kiln_u32* counts, const float* scratch,
                 kiln_u32* tokens, int mass_path, kiln_u32* tickets, kiln_u64* maxima, kiln_u64* slot_mass,
                 kiln_u64* histogram, kiln_u64* row_state, int slots, long long slice_len) {
    kiln_wait_prior();
    __shared__ MassDrawShared sh;
    __shared__ kiln_u64 bins[MASS_BINS];
    const int r = blockIdx.y;
    const KilnSampleParams p = params[r];
    if (!sample_mass_row(p, mass_path)) return;
    MassWork work = {};
    work.tickets = tickets;
    work.maxima = maxima;
    work.slot_mass = slot_mass;
    work.histogram = histogram;
    work.row_state = row_state;
    work.slots = slots;
    work.slice_len = slice_len;
    const bool penalties = sample_penalized(p, counts, history_offsets[r], history_offsets[r + 1]);
    const float* x = penalties ? scratch + (long long)r * vocab : logits + (long long)r * row_stride;
    const kiln_u64 best = sample_mass_greedy(r, work, sh);
    if ((best >> 32) == 0ull) {
        if (blockIdx.x == 0 && threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return;
    }
    float m = x[0xFFFFFFFFu - (kiln_u32)best] / p.temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const bool top_p = p.top_p_units < (1u << 24);
    if (top_p) {
        for (int b = threadIdx.x; b < MASS_BINS; b += THREADS) bins[b] = 0ull;
        __syncthreads();
    }
    const long long lo = (long long)blockIdx.x * slice_len;
    const long long hi = lo + slice_len < vocab ? lo + slice_len : vocab;
    kiln_u64 kept = 0ull;
    for (long long base = lo; base < hi; base += THREADS) {
        const long long i = base + threadIdx.x;
        kiln_u32 w = 0u;
        int bin = -1;
        if (i < hi) {
            const float v = x[i];
            if (sample_order_key(v) != 0u) {
                w = sample_weight(v, p.temperature, m);
                kept += w >= p.min_weight ? (kiln_u64)w : 0ull;
                float z = v / p.temperature;
                z = fminf(fmaxf(z, -3.40282347e38f), 3.40282347e38f);
                if (w != 0u) bin = sample_mass_bin(z, m);
            }
        }
        if (top_p) {
            // Lanes of one bin add their weights together (two 16-bit halves: exact).
            const kiln_u32 peers = __match_any_sync(KILN_FULL_MASK, (kiln_u32)bin);
            const kiln_u32 low = __reduce_add_sync(peers, w & 0xFFFFu);
            const kiln_u32 high = __reduce_add_sync(peers, w >> 16);
            if (bin >= 0 && __ffs(peers) - 1 == (int)(threadIdx.x & 31))
                atomicAdd(&bins[bin], (kiln_u64)low + ((kiln_u64)high << 16));
        }
    }
    const kiln_u64 slice_kept = sample_mass_sum(kept, sh);
    if (top_p) {
        kiln_u64* row_bins = histogram + (long long)r * MASS_BINS;
        for (int b = threadIdx.x; b < MASS_BINS; b += THREADS)
            if (bins[b] != 0ull) atomicAdd(&row_bins[b], bins[b]);
    }
    if (threadIdx.x == 0) slot_mass[(long long)r * slots + blockIdx.x] = slice_kept;
    if (!sample_mass_ticket(r, work, sh)) return;

    if (!top_p) {
        for (int s = threadIdx.x; s < (int)gridDim.x; s += THREADS)
            sh.slice_mass[s] = __ldcg(&slot_mass[(long long)r * slots + s]);
        __syncthreads();
        sample_mass_draw(r, x, vocab, m, 0u, 0xFFFFFFFFu, p, steps, tokens, work, sh);
        return;
    }
    // The bin b* where the order's running mass reaches the target (step 6), and the mass above.
    kiln_u64* row_bins = histogram + (long long)r * MASS_BINS;
    constexpr int PER = (MASS_BINS + THREADS - 1) / THREADS;
    const int b0 = min(MASS_BINS, (int)threadIdx.x * PER), b1 = min(MASS_BINS, b0 + PER);
    kiln_u64 local = 0ull;
    for (int b = b0; b < b1; ++b) local += __ldcg(&row_bins[b]);
    kiln_u64 total;
    const kiln_u64 before = fast_scan(local, sh.warp_u64, total);
    const kiln_u64 target = sample_top_p_target(total, p.top_p_units);
    if (local != 0ull && before < target && before + local >= target) {
        kiln_u64 acc = before;
        for (int b = b0; b < b1; ++b) {
            const kiln_u64 v = __ldcg(&row_bins[b]);
            if (acc + v >= target) {
                row_state[(long long)r * 4] = (kiln_u64)b;
                row_state[(long long)r * 4 + 1] = acc;
                row_state[(long long)r * 4 + 2] = target;
                break;
            }
            acc += v;
        }
    }
    __syncthreads();
    for (int b = b0; b < b1; ++b) row_bins[b] = 0ull;  // zero for the next launch
}

// Step 3: see the section's comment.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_sample_mass_pick(const float* __restrict__ logits, long long vocab, long long row_stride,
                      const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                      const kiln_u32* __restrict__ history_offsets, const kiln_u32* counts, const float* scratch,
                      kiln_u32* tokens, int mass_path, kiln_u32* tickets,
                      kiln_u64* maxima, kiln_u64* slot_mass, kiln_u64* row_state, kiln_u32* list_counts,
                      float* list_values, kiln_u32* list_indices, int slots, long long slice_len) {
    kiln_wait_prior();
    __shared__ MassDrawShared sh;
    __shared__ kiln_u64 packed[MASS_LIST_CAP];
    __shared__ kiln_u32 weights[MASS_LIST_CAP];
    __shared__ kiln_u32 offsets[MASS_MAX_SLICES + 1];
    __shared__ kiln_u32 listed;
    __shared__ kiln_u64 cut;
    const int r = blockIdx.y;
    const KilnSampleParams p = params[r];
    if (!sample_mass_row(p, mass_path) || p.top_p_units >= (1u << 24)) return;
    MassWork work = {};
    work.tickets = tickets;
    work.maxima = maxima;
    work.slots = slots;
    work.slice_len = slice_len;
    const bool penalties = sample_penalized(p, counts, history_offsets[r], history_offsets[r + 1]);
    const float* x = penalties ? scratch + (long long)r * vocab : logits + (long long)r * row_stride;
    const kiln_u64 best = sample_mass_greedy(r, work, sh);
    if ((best >> 32) == 0ull) return;  // NO_TOKEN, written by kiln_sample_mass
    float m = x[0xFFFFFFFFu - (kiln_u32)best] / p.temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const int b_star = (int)row_state[(long long)r * 4];
    const kiln_u64 above = row_state[(long long)r * 4 + 1];
    const kiln_u64 target = row_state[(long long)r * 4 + 2];

    // This slice: the kept mass before bin b*, and its tokens of bin b* (in any order).
    const int s = blockIdx.x;
    const long long slot = (long long)r * slots + s;
    const long long lo = (long long)s * slice_len;
    const long long hi = lo + slice_len < vocab ? lo + slice_len : vocab;
    if (threadIdx.x == 0) listed = 0u;
    __syncthreads();
    kiln_u64 kept = 0ull;
    for (long long i = lo + threadIdx.x; i < hi; i += THREADS) {
        const float v = x[i];
        if (sample_order_key(v) == 0u) continue;
        const kiln_u32 w = sample_weight(v, p.temperature, m);
        if (w == 0u) continue;
        float z = v / p.temperature;
        z = fminf(fmaxf(z, -3.40282347e38f), 3.40282347e38f);
        const int bin = sample_mass_bin(z, m);
        if (bin < b_star) {
            kept += w >= p.min_weight ? (kiln_u64)w : 0ull;
        } else if (bin == b_star) {
            const kiln_u32 at = atomicAdd(&listed, 1u);
            if (at < FAST_BLOCK_CAP) {
                list_values[slot * FAST_BLOCK_CAP + at] = v;
                list_indices[slot * FAST_BLOCK_CAP + at] = (kiln_u32)i;
            }
        }
    }
    const kiln_u64 slice_kept = sample_mass_sum(kept, sh);
    if (threadIdx.x == 0) {
        slot_mass[slot] = slice_kept;
        list_counts[slot] = listed;
    }
    if (!sample_mass_ticket(r, work, sh)) return;

    // The last block: the lists' offsets; more than the lists or the sort hold goes to the
    // single-block path.
    const int slices = (int)gridDim.x;
    const int per_slices = (slices + THREADS - 1) / THREADS;
    const int s0 = min(slices, (int)threadIdx.x * per_slices), s1 = min(slices, s0 + per_slices);
    kiln_u32 mine = 0u;
    bool overflow = false;
    for (int t = s0; t < s1; ++t) {
        const kiln_u32 c = __ldcg(&list_counts[(long long)r * slots + t]);
        overflow |= c > FAST_BLOCK_CAP;
        mine += c;
    }
    const bool any_overflow = __syncthreads_or(overflow) != 0;
    kiln_u64 all64;
    kiln_u64 at64 = fast_scan((kiln_u64)mine, sh.warp_u64, all64);
    const bool overflows = any_overflow || all64 > MASS_LIST_CAP;
    if (threadIdx.x == 0) row_state[(long long)r * 4 + 3] = overflows ? 1ull : 0ull;
    if (overflows) return;  // `kiln_sample_mass_fallback` samples the row
    for (int t = s0; t < s1; ++t) {
        offsets[t] = (kiln_u32)at64;
        at64 += __ldcg(&list_counts[(long long)r * slots + t]);
    }
    if (threadIdx.x == 0) offsets[slices] = (kiln_u32)all64;
    __syncthreads();
    const int n = (int)all64;  // >= 1: bin b* holds mass
    int size = 1;
    while (size < n) size <<= 1;
    for (int j = threadIdx.x; j < size; j += THREADS) {
        kiln_u64 key_index = 0ull;
        kiln_u32 w = 0u;
        if (j < n) {
            int a = 0, z = slices - 1;
            while (a < z) {
                const int mid = (a + z + 1) >> 1;
                if (offsets[mid] <= (kiln_u32)j) a = mid; else z = mid - 1;
            }
            const long long from = ((long long)r * slots + a) * FAST_BLOCK_CAP + (j - (int)offsets[a]);
            const float v = __ldcg(&list_values[from]);
            key_index = fast_pack(sample_order_key(v), __ldcg(&list_indices[from]));
            w = sample_weight(v, p.temperature, m);
        }
        packed[j] = key_index;
        weights[j] = w;
    }
    __syncthreads();
    // Bitonic sort, descending: the order (key descending, index ascending); padding (0) last.
    for (int k = 2; k <= size; k <<= 1) {
        for (int half = k >> 1; half > 0; half >>= 1) {
            for (int i = threadIdx.x; i < size; i += THREADS) {
                const int partner = i ^ half;
                if (partner > i) {
                    const kiln_u64 a = packed[i], b = packed[partner];
                    if ((i & k) == 0 ? a < b : a > b) {
                        packed[i] = b;
                        packed[partner] = a;
                        const kiln_u32 wa = weights[i];
                        weights[i] = weights[partner];
                        weights[partner] = wa;
                    }
                }
            }
            __syncthreads();
        }
    }
    // The cutoff: the first listed token in the order at which the running mass from `above`
    // reaches the target (above < target <= above + the bin's mass).
    const int per = (size + THREADS - 1) / THREADS;
    const int j0 = min(size, (int)threadIdx.x * per), j1 = min(size, j0 + per);
    kiln_u64 run = 0ull;
    for (int j = j0; j < j1; ++j) run += weights[j];
    kiln_u64 unused;
    kiln_u64 acc = above + fast_scan(run, sh.warp_u64, unused);
    if (threadIdx.x == 0) cut = ~0ull;  // nothing listed within: cannot happen (see above)
    __syncthreads();
    if (run != 0ull && acc < target && acc + run >= target) {
        for (int j = j0; j < j1; ++j) {
            acc += weights[j];
            if (acc >= target) {
                cut = packed[j];
                break;
            }
        }
    }
    __syncthreads();
    const kiln_u64 c = cut;
    for (int t = threadIdx.x; t < slices; t += THREADS) sh.slice_mass[t] = __ldcg(&slot_mass[(long long)r * slots + t]);
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += THREADS) {
        const kiln_u64 e = packed[j];
        if (e >= c && weights[j] >= p.min_weight) {
            const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)e;
            atomicAdd(&sh.slice_mass[index / (kiln_u64)slice_len], (kiln_u64)weights[j]);
        }
    }
    __syncthreads();
    sample_mass_draw(r, x, vocab, m, (kiln_u32)(c >> 32), 0xFFFFFFFFu - (kiln_u32)c, p, steps, tokens, work, sh);
}

// Step 4: the single-block path for the rows whose bin b* overflowed the lists.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_sample_mass_fallback(const float* __restrict__ logits, long long vocab, long long row_stride,
                          const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                          const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
                          kiln_u32* __restrict__ counts, float* __restrict__ scratch, kiln_u32* __restrict__ tokens,
                          int mass_path, const kiln_u64* __restrict__ row_state) {
    kiln_wait_prior();
    const int r = blockIdx.y;
    const KilnSampleParams p = params[r];
    if (!sample_mass_row(p, mass_path) || p.top_p_units >= (1u << 24)) return;
    if (row_state[(long long)r * 4 + 3] == 0ull) return;
    sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts, scratch,
                      nullptr, 0, tokens);
}

// One launch serves every row: grid (slices, rows). Rows the multi-block paths serve
// (`fast_kmax` > 0 for greedy and top-k, `mass_path` for the others at temperature > 0) use every
// block of their row; the others use block 0 alone.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kiln_sample(const float* __restrict__ logits, long long vocab, long long row_stride,
            const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
            const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
            kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
            int stats_per_row, kiln_u32* __restrict__ tokens, int fast_kmax, int greedy_single, kiln_u32* tickets,
            kiln_u32* list_counts, kiln_u64* list_cuts, float* list_values, kiln_u32* list_indices,
            float* overflow_values, kiln_u32* overflow_indices, int slots, long long slice_len, int mass_path,
            kiln_u64* mass_maxima) {
    kiln_wait_prior();
    const int r = blockIdx.y;
    const KilnSampleParams p = params[r];
    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const bool penalties = sample_penalized(p, counts, h0, h1);
    if (sample_mass_row(p, mass_path)) {
        // Step 1 of the mass path; `kiln_sample_mass` and `kiln_sample_mass_pick` follow.
        MassWork work = {};
        work.maxima = mass_maxima;
        work.slots = slots;
        work.slice_len = slice_len;
        sample_mass_maxima(r, penalties, logits + (long long)r * row_stride, scratch + (long long)r * vocab, vocab,
                           p, h0, h1, history, counts + (long long)r * vocab, work);
        return;
    }
    const bool greedy = p.temperature == 0.0f;
    const bool from_stats = greedy && stats != nullptr && !penalties;
    const kiln_u32 kmax = fast_kmax < FAST_KMAX ? (kiln_u32)(fast_kmax > 0 ? fast_kmax : 0) : FAST_KMAX;
    // Greedy rows without penalties take one block each when the batch alone fills the device
    // (`greedy_single`): a streaming argmax, with no lists and no ticket.
    const bool fast = !from_stats && (greedy ? kmax > 0u && (penalties || !greedy_single)
                                             : (p.top_k >= 1u && p.top_k <= kmax));
    if (fast) {
        FastWork work;
        work.tickets = tickets;
        work.counts = list_counts;
        work.cuts = list_cuts;
        work.values = list_values;
        work.indices = list_indices;
        work.overflow_values = overflow_values;
        work.overflow_indices = overflow_indices;
        work.slots = slots;
        work.slice_len = slice_len;
        sample_row_fast(r, greedy ? 1u : p.top_k, penalties, logits + (long long)r * row_stride, vocab, p, steps,
                        h0, h1, history, counts, tokens, work);
    } else if (blockIdx.x == 0) {
        sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts, scratch,
                          stats, stats_per_row, tokens);
    }
}

// ---- The fused path ---------------------------------------------------------------------------
//
// Serves greedy rows and rows with 1 <= top_k <= FUSED_KMAX (with any temperature, top-p, min-p
// and penalties) in one launch of `kiln_sample_fused` on a (slices, rows) grid, with about one
// block per multiprocessor at batch 1. Where the microseconds went on the lists path: its blocks
// selected their local top-k with three 2048-bin radix levels and a dozen block scans, and its
// last block pruned the union of the lists by the best block's k-th token, which for a flat tail
// (every block's k-th far below the row's) left thousands of candidates to select again, serially.
// Here:
//   1. Block (s, r) loads slice s once (every load in flight), applies the penalties of the
//      history tokens in it, and finds its local top-k with one 256-bin histogram of the distance
//      below the slice maximum d = M - x (bins of the float bits of d: 3 mantissa bits, so the
//      bins are narrow near the maximum, where the top-k lies). d is monotone in the order key,
//      so every token of a lower bin comes earlier in the order, and the bin that holds the k-th
//      token bounds a superset of the local top-k (a few tokens more). Only when that bin holds
//      too many tokens (ties, a +inf maximum) do radix levels over the packed (key, index) follow,
//      down to the exact k-th if need be. The superset is ranked in shared memory and the block
//      writes its exact local top-k *in the order*, as packed (key, ~index) u64.
//   2. The last block of the row (an atomic ticket, reset by that block) bounds the row's k-th
//      token from below by the k-th largest of the lists' first h entries (h * slices >= k: the
//      slices' maxima at batch 1) and by the best block's k-th, both k distinct tokens of the row,
//      so every token of the row's top-k is at or above the bound. The lists are sorted, so it
//      reads each list only down to the bound (usually k + a few tokens in all), ranks those, and
//      finishes on the top-k in the order: weights from the first, top-p by a scan in rank order,
//      min-p, and the draw by prefix sums in index order.
// Every quantity is an integer or the reference's fp32 operation on the same value (a value is
// recovered exactly from its order key; -0.0 comes back as +0.0, which gives the same weights),
// so the token is the reference's whatever the slices and the order of the atomics. A row whose
// candidates overflow the last block's buffers (ties across many slices) is sampled by that block
// on the single-block path. Rows the fused code does not serve take step 1 of the mass path
// (when the launcher runs it) or the single-block path.

#define FUSED_KMAX 256            // the largest top-k the fused path serves
#define FUSED_SLICE_MAX 8192      // logits one block holds
#define FUSED_LIST_CAP 512        // a block's superset of its local top-k
#define FUSED_BINS 256            // histogram bins (of d, then of the packed key's bytes)
#define FUSED_BIN_BASE 856        // (127 - 20) << 3: d below 2^-20 shares bin 0 with d = 0
// The lists' first entries the last block stages (at batch 1, 7 of each of 132 lists: the
// lists rarely hold more above the bound, so the merge rarely reads L2 again).
#define FUSED_HEAD_CAP (THREADS <= 256 ? 1024 : 512)
#define FUSED_SURV_CAP 2048       // tokens at or above the bound the last block ranks
#define FUSED_RANK_MAX 512        // ranked by counting up to this many, by a bitonic sort above
#define FUSED_OVERFLOW 1
// Blocks a multiprocessor keeps resident: the launcher compiles the fused kernel with 256
// threads, so that at batch 64 (1216 blocks) several blocks share a multiprocessor, one
// computing while another waits on its loads or at a barrier.
#define FUSED_MIN_BLOCKS (THREADS <= 256 ? 2 : 1)
#if THREADS < FUSED_KMAX
#error "the fused path needs THREADS >= FUSED_KMAX (one thread per top-k token)"
#endif

struct FusedShared {
    // The slice; in the last block: the staged heads [0, HEAD_CAP), the survivors
    // [HEAD_CAP, HEAD_CAP + SURV_CAP) and three u32 arrays of THREADS (per-list state) after them.
    union {
        float vals[FUSED_SLICE_MAX];
        kiln_u64 buf[FUSED_SLICE_MAX / 2];
    };
    kiln_u64 list[FUSED_LIST_CAP];  // the block's superset; in the last block, the top-k in order
    kiln_u32 bins[FUSED_BINS];
    kiln_u64 warp_u64[SAMPLE_WARPS];
    kiln_u32 warp_u32[SAMPLE_WARPS];
    kiln_u64 best, bound;
    kiln_u32 valid, listed, chosen, above, count, nopen, nsurv, total;
    int last;
};
static_assert((FUSED_HEAD_CAP + FUSED_SURV_CAP) * 8 + 3 * THREADS * 4 <= FUSED_SLICE_MAX * 4,
              "the last block's arrays fit in the slice buffer");
static_assert(2 * FUSED_LIST_CAP >= THREADS, "the last block's open lists (u32) fit in `list`");

// The float of an order key (not 0): exact, but -0.0 comes back as +0.0.
__device__ __forceinline__ float fused_value(kiln_u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The bin of a token of value x <= M (not NaN) below the slice maximum M: non-decreasing in
// M - x, so a lower bin holds only tokens earlier in the order, and equal values share a bin.
__device__ __forceinline__ int fused_dbin(float x, float M) {
    const float d = x == M ? 0.0f : M - x;  // >= 0; +inf below a +inf maximum or at -inf
    const int b = (int)(__float_as_uint(d) >> 20) - FUSED_BIN_BASE;
    return min(max(b, 0), FUSED_BINS - 1);
}

// Adds one to bins[bin] for the lanes with bin >= 0; lanes with the same bin as the warp's first
// such lane add together (a row of ties lands in one bin).
__device__ __forceinline__ void fused_count(kiln_u32* bins, int bin) {
    const kiln_u32 active = __ballot_sync(KILN_FULL_MASK, bin >= 0);
    if (active == 0u) return;
    const int leader_bin = __shfl_sync(KILN_FULL_MASK, bin, __ffs(active) - 1);
    const kiln_u32 same = __ballot_sync(KILN_FULL_MASK, bin >= 0 && bin == leader_bin);
    const int lane = threadIdx.x & 31;
    if (bin >= 0 && bin == leader_bin) {
        if (lane == __ffs(same) - 1) atomicAdd(&bins[bin], (kiln_u32)__popc(same));
    } else if (bin >= 0) {
        atomicAdd(&bins[bin], 1u);
    }
}

// One warp (warp 0) finds the first bin, in the order (bin 0 first, or bin 255 first when
// `descending`), at which the running count reaches `target` (>= 1, at most the total): its
// index in sh.chosen, `base` plus the count before it in sh.above, its count in sh.count.
// Followed by a barrier of the whole block.
__device__ __forceinline__ void fused_pick(FusedShared& sh, bool descending, kiln_u32 target, kiln_u32 base) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        kiln_u32 sum = 0u;
#pragma unroll
        for (int q = 0; q < FUSED_BINS / 32; ++q) {
            const int o = lane * (FUSED_BINS / 32) + q;
            sum += sh.bins[descending ? FUSED_BINS - 1 - o : o];
        }
        kiln_u32 inclusive = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const kiln_u32 n = __shfl_up_sync(KILN_FULL_MASK, inclusive, o);
            if (lane >= o) inclusive += n;
        }
        const kiln_u32 before = inclusive - sum;
        if (before < target && inclusive >= target) {
            kiln_u32 acc = before;
            for (int q = 0; q < FUSED_BINS / 32; ++q) {
                const int o = lane * (FUSED_BINS / 32) + q;
                const int b = descending ? FUSED_BINS - 1 - o : o;
                const kiln_u32 c = sh.bins[b];
                if (acc + c >= target) {
                    sh.chosen = (kiln_u32)b;
                    sh.above = base + acc;
                    sh.count = c;
                    break;
                }
                acc += c;
            }
        }
    }
    __syncthreads();
}

// Appends `e` (when `take`) to out[] at a slot taken from `*counter` (one atomic per warp);
// entries past `cap` are counted, not written.
__device__ __forceinline__ void fused_append(bool take, kiln_u64 e, kiln_u64* out, kiln_u32* counter, kiln_u32 cap) {
    const kiln_u32 mask = __ballot_sync(KILN_FULL_MASK, take);
    if (mask == 0u) return;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
    kiln_u32 at = 0u;
    if (lane == leader) at = atomicAdd(counter, (kiln_u32)__popc(mask));
    at = __shfl_sync(KILN_FULL_MASK, at, leader) + (kiln_u32)__popc(mask & ((1u << lane) - 1u));
    if (take && at < cap) out[at] = e;
}

// For each nonzero entry e of a[0, n) (distinct), f(e, rank) with rank the count of entries
// above it: g threads (a power of two within a warp) per entry, g as large as the block allows.
template <class F> __device__ __forceinline__ void fused_rank(const kiln_u64* a, int n, F f) {
    int g = 1;
    while (g < 32 && 2 * g * n <= THREADS) g <<= 1;
    const int per_round = THREADS / g;
    for (int base = 0; base < n; base += per_round) {
        const int j = base + (int)threadIdx.x / g, part = (int)threadIdx.x & (g - 1);
        const kiln_u64 e = j < n ? a[j] : 0ull;
        kiln_u32 rank = 0u;
#pragma unroll 4
        for (int i = part; i < n; i += g) rank += a[i] > e ? 1u : 0u;
        for (int o = g >> 1; o > 0; o >>= 1) rank += __shfl_xor_sync(KILN_FULL_MASK, rank, o);
        if (j < n && part == 0 && e != 0ull) f(e, rank);
    }
}

// Sorts a[0, size) descending in place (size a power of two, THREADS-strided pairs).
__device__ __forceinline__ void fused_bitonic(kiln_u64* a, int size) {
    for (int k = 2; k <= size; k <<= 1) {
        for (int stride = k >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < size / 2; t += THREADS) {
                const int i = 2 * t - (t & (stride - 1));
                const kiln_u64 x = a[i], y = a[i + stride];
                if ((i & k) == 0 ? x < y : x > y) {
                    a[i] = y;
                    a[i + stride] = x;
                }
            }
            __syncthreads();
        }
    }
}

// The block's sum of a u32 (every thread gets it).
__device__ __forceinline__ kiln_u32 fused_sum(kiln_u32 v, FusedShared& sh) {
    kiln_u32 total;
    fast_scan(v, sh.warp_u32, total);
    return total;
}

// The block's largest u64 (every thread gets it).
__device__ __forceinline__ kiln_u64 fused_max(kiln_u64 v, FusedShared& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, v, o);
        v = n > v ? n : v;
    }
    if (threadIdx.x == 0) sh.best = 0ull;
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && v != 0ull) atomicMax(&sh.best, v);
    __syncthreads();
    const kiln_u64 out = sh.best;
    __syncthreads();
    return out;
}

// The scratch of the fused path (`SampleScratch`): for row r and block s, slot r * slots + s of
// `counts` (entries in the list) and the list at `lists + slot * FUSED_KMAX` (packed (key, ~index),
// descending: the block's top tokens in the order). `tickets` (one per row) is zero on entry and
// left zero.
struct FusedWork {
    kiln_u32* tickets;
    kiln_u32* counts;
    kiln_u64* lists;
    int slots;
    long long slice_len;
};

// Block (s, r) of a fused row. Returns FUSED_OVERFLOW in the last block of a row whose candidates
// overflow its buffers (the caller then samples the row on the single-block path), else 0.
__device__ __forceinline__ int sample_row_fused(int r, kiln_u32 k, bool penalties, const float* __restrict__ x,
                                               long long vocab, const KilnSampleParams* __restrict__ p,
                                               const kiln_u64* __restrict__ steps, kiln_u32 h0, kiln_u32 h1,
                                               const kiln_u32* __restrict__ history, kiln_u32* __restrict__ counts,
                                               kiln_u32* __restrict__ tokens, const FusedWork& work) {
    __shared__ FusedShared sh;
    const int s = blockIdx.x;
    const long long lo = (long long)s * work.slice_len;
    const long long hi_raw = lo + work.slice_len < vocab ? lo + work.slice_len : vocab;
    const int n = hi_raw > lo ? (int)(hi_raw - lo) : 0;  // the launcher keeps n <= FUSED_SLICE_MAX
    // The thread's maximum and candidates (not NaN), taken from the registers as the slice is
    // stored (again from shared memory after penalties).
    kiln_u64 thread_best = 0ull;
    kiln_u32 thread_valid = 0u;
    {
        constexpr int PER = FUSED_SLICE_MAX / THREADS;
        float v[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int i = u * THREADS + (int)threadIdx.x;
            v[u] = i < n ? __ldg(&x[lo + i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int i = u * THREADS + (int)threadIdx.x;
            if (i < n) {
                sh.vals[i] = v[u];
                const kiln_u32 key = sample_order_key(v[u]);
                if (key != 0u) {
                    ++thread_valid;
                    const kiln_u64 packed = fast_pack(key, (kiln_u32)(lo + i));
                    thread_best = packed > thread_best ? packed : thread_best;
                }
            }
        }
    }
    if (threadIdx.x == 0) {
        sh.best = 0ull;
        sh.valid = 0u;
        sh.listed = 0u;
    }
    for (int b = threadIdx.x; b < FUSED_BINS; b += THREADS) sh.bins[b] = 0u;
    __syncthreads();
    if (penalties) {
        // As on the lists path: the history tokens of this slice, counted in `counts` (zero on
        // entry and on exit), the penalty applied by the thread that takes a token's count.
        kiln_u32* count = counts + (long long)r * vocab;
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t >= lo && (long long)t < lo + n) atomicAdd(&count[t], 1u);
        }
        __syncthreads();
        for (kiln_u32 j = h0 + threadIdx.x; j < h1; j += THREADS) {
            const kiln_u32 t = history[j];
            if ((long long)t < lo || (long long)t >= lo + n) continue;
            const kiln_u32 c = atomicExch(&count[t], 0u);
            if (c) {
                const float l = sh.vals[t - lo];
                const float v = l > 0.0f ? l / p->repetition : l * p->repetition;
                sh.vals[t - lo] = v - (((float)c * p->frequency) + p->presence);
            }
        }
        __syncthreads();
        thread_best = 0ull;
        thread_valid = 0u;
        for (int j = threadIdx.x; j < n; j += THREADS) {
            const kiln_u32 key = sample_order_key(sh.vals[j]);
            if (key != 0u) {
                ++thread_valid;
                const kiln_u64 packed = fast_pack(key, (kiln_u32)(lo + j));
                thread_best = packed > thread_best ? packed : thread_best;
            }
        }
    }

    // The slice's maximum and candidates.
    {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const kiln_u64 other = __shfl_xor_sync(KILN_FULL_MASK, thread_best, o);
            thread_best = other > thread_best ? other : thread_best;
        }
        thread_valid = __reduce_add_sync(KILN_FULL_MASK, thread_valid);
        if ((threadIdx.x & 31) == 0) {
            if (thread_best != 0ull) atomicMax(&sh.best, thread_best);
            if (thread_valid != 0u) atomicAdd(&sh.valid, thread_valid);
        }
        __syncthreads();
    }
    const kiln_u64 slice_best = sh.best;
    const kiln_u32 valid = sh.valid;
    const long long slot = (long long)r * work.slots + s;
    kiln_u64* out = work.lists + slot * FUSED_KMAX;
    kiln_u32 written = 0u;
    if (valid != 0u && k == 1u) {
        if (threadIdx.x == 0) out[0] = slice_best;
        written = 1u;
    } else if (valid != 0u) {
        // The selection: a token is listed when its d-bin is below `dbin`, or equal to it and
        // (when the radix levels ran) its packed key's bits above `shift` at least `prefix`'s.
        int dbin = FUSED_BINS - 1;
        int shift = 64;
        kiln_u64 prefix = 0ull;
        const float M = fused_value((kiln_u32)(slice_best >> 32));
        const int n_warps = (n + 31) & ~31;  // whole warps in the loops below (warp-wide votes)
        if (valid > k) {
            for (int j = threadIdx.x; j < n_warps; j += THREADS) {
                int bin = -1;
                if (j < n) {
                    const float v = sh.vals[j];
                    if (sample_order_key(v) != 0u) bin = fused_dbin(v, M);
                }
                fused_count(sh.bins, bin);
            }
            __syncthreads();
            fused_pick(sh, false, k, 0u);
            dbin = (int)sh.chosen;
            kiln_u32 above = sh.above;
            bool done = above + sh.count <= FUSED_LIST_CAP;
            // Rare: the bin is crowded. Radix levels of 8 bits over the packed (key, ~index) of
            // the bin's tokens, until the tokens at or above the chosen prefix fit (at the last
            // level, exactly k).
            while (!done) {
                shift -= 8;
                const kiln_u64 high = shift == 56 ? 0ull : (~0ull << (shift + 8));
                __syncthreads();  // every thread has read sh.* of the level before
                for (int b = threadIdx.x; b < FUSED_BINS; b += THREADS) sh.bins[b] = 0u;
                __syncthreads();
                for (int j = threadIdx.x; j < n_warps; j += THREADS) {
                    int digit = -1;
                    if (j < n) {
                        const float v = sh.vals[j];
                        const kiln_u32 key = sample_order_key(v);
                        if (key != 0u && fused_dbin(v, M) == dbin) {
                            const kiln_u64 packed = fast_pack(key, (kiln_u32)(lo + j));
                            if ((packed & high) == prefix) digit = (int)((packed >> shift) & 0xFFull);
                        }
                    }
                    fused_count(sh.bins, digit);
                }
                __syncthreads();
                fused_pick(sh, true, k - above, above);
                prefix |= (kiln_u64)sh.chosen << shift;
                above = sh.above;
                done = above + sh.count <= FUSED_LIST_CAP || shift == 0;
            }
        }
        for (int j = threadIdx.x; j < n_warps; j += THREADS) {
            bool take = false;
            kiln_u64 packed = 0ull;
            if (j < n) {
                const float v = sh.vals[j];
                const kiln_u32 key = sample_order_key(v);
                if (key != 0u) {
                    packed = fast_pack(key, (kiln_u32)(lo + j));
                    const int b = fused_dbin(v, M);
                    take = b < dbin || (b == dbin && (shift == 64 || (packed >> shift) >= (prefix >> shift)));
                }
            }
            fused_append(take, packed, sh.list, &sh.listed, FUSED_LIST_CAP);
        }
        __syncthreads();
        // The superset ranked: its first k entries, in the order, are the slice's top-k.
        const int listed = (int)sh.listed;  // <= FUSED_LIST_CAP by the selection
        written = min((kiln_u32)listed, k);
        fused_rank(sh.list, listed, [&](kiln_u64 e, kiln_u32 rank) {
            if (rank < written) out[rank] = e;
        });
    }
    if (threadIdx.x == 0) work.counts[slot] = written;

    // The last block of the row to finish goes on; every thread fences its own writes first.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const kiln_u32 ticket = atomicAdd(&work.tickets[r], 1u);
        sh.last = ticket == gridDim.x - 1u;
        if (sh.last) {
            work.tickets[r] = 0u;  // every block of the row has taken its ticket
            __threadfence();
        }
    }
    __syncthreads();
    if (!sh.last) return 0;

    const kiln_u64 step = steps[r];  // read now: its latency hides behind the merge
    const int blocks = (int)gridDim.x;  // <= THREADS (launcher)
    const kiln_u32* list_counts = work.counts + (long long)r * work.slots;
    const kiln_u64* lists = work.lists + (long long)r * work.slots * FUSED_KMAX;
    const bool owner = (int)threadIdx.x < blocks;  // thread b owns list b
    // The lists' first `depth` entries, column-major (entry i of list b at staged[i * blocks + b]:
    // the first h columns are contiguous), 0 past a list's count.
    kiln_u64* staged = sh.buf;
    kiln_u64* surv = sh.buf + FUSED_HEAD_CAP;
    kiln_u32* pos = reinterpret_cast<kiln_u32*>(sh.buf + FUSED_HEAD_CAP + FUSED_SURV_CAP);
    kiln_u32* cnt = pos + THREADS;
    kiln_u32* more = cnt + THREADS;
    kiln_u32* open_list = reinterpret_cast<kiln_u32*>(sh.list);
    // One round trip to L2 for what the merge usually needs: each owner reads its list's count
    // and k-th entry (kept in surv[b] until the bound is known), and the block stages the first
    // `depth` entries of every list (each thread reads the count of the list of each entry it
    // stages; entries past a count are left over from earlier launches and never used). Thread
    // b stages entry 0 of list b itself.
    const int depth = min((int)k, FUSED_HEAD_CAP / blocks);  // 0 only with more than HEAD_CAP slices
    kiln_u32 c = 0u;
    if (owner) {
        c = __ldcg(&list_counts[threadIdx.x]);
        surv[threadIdx.x] = __ldcg(&lists[(long long)threadIdx.x * FUSED_KMAX + (k - 1u)]);
    }
#pragma unroll 2
    for (int e = threadIdx.x; e < depth * blocks; e += THREADS) {
        const int i = e / blocks, b = e - i * blocks;
        const kiln_u32 cb = __ldcg(&list_counts[b]);
        const kiln_u64 v = __ldcg(&lists[(long long)b * FUSED_KMAX + i]);
        staged[e] = (kiln_u32)i < cb ? v : 0ull;
    }
    if (owner) cnt[threadIdx.x] = c;  // published by the barriers of the sums below
    if (k == 1u) {
        // Greedy (or top-k 1): the best of the slices' maxima.
        kiln_u64 first = 0ull;
        if (c != 0u) first = depth > 0 ? staged[threadIdx.x] : __ldcg(&lists[(long long)threadIdx.x * FUSED_KMAX]);
        const kiln_u64 best = fused_max(first, sh);
        if (threadIdx.x == 0) tokens[r] = best != 0ull ? 0xFFFFFFFFu - (kiln_u32)best : NO_TOKEN;
        return 0;
    }
    // The candidates of the row, and how many the lists' first h entries hold, h from
    // ceil(k / blocks), summed together (each sum below 2^32).
    int h = (int)((k + (kiln_u32)blocks - 1u) / (kiln_u32)blocks);
    kiln_u64 sums;
    fast_scan(((kiln_u64)c << 32) | (kiln_u64)min(c, (kiln_u32)h), sh.warp_u64, sums);
    const kiln_u32 total = (kiln_u32)(sums >> 32);
    if (total == 0u) {  // every logit of the row is NaN
        if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return 0;
    }
    // The bound: every token of the row's top-k is at or above it (0 when the row has at most k
    // candidates: every listed token is kept).
    kiln_u64 bound = 0ull;
    if (total > k) {
        // The best block's k-th token.
        const kiln_u64 local = fused_max(owner && c == k ? surv[threadIdx.x] : 0ull, sh);
        // The k-th largest of the lists' first h entries, h the least from ceil(k / blocks) up
        // (doubling) with at least k of them: k distinct tokens of the row, so the row's k-th
        // is at or above it. Staged: h <= k, and h <= HEAD_CAP / blocks past the check.
        kiln_u32 within = (kiln_u32)sums;
        while (within < k) {
            h = min(2 * h, (int)k);
            within = fused_sum(min(c, (kiln_u32)h), sh);
        }
        if (blocks * h > FUSED_HEAD_CAP) return FUSED_OVERFLOW;
        if (threadIdx.x == 0) sh.bound = 0ull;
        __syncthreads();
        fused_rank(staged, blocks * h, [&](kiln_u64 e, kiln_u32 rank) {
            if (rank == k - 1u) sh.bound = e;
        });
        __syncthreads();
        bound = sh.bound > local ? sh.bound : local;
    }

    // The survivors: every list down to the bound. First the staged entries, then rounds in
    // which each list still at or above the bound after them reads its next entries (the open
    // lists share the block's threads).
    if (threadIdx.x == 0) sh.nsurv = 0u;
    __syncthreads();
    for (int base = 0; base < depth * blocks; base += THREADS) {
        const int e = base + (int)threadIdx.x;
        const kiln_u64 v = e < depth * blocks ? staged[e] : 0ull;
        fused_append(v != 0ull && v >= bound, v, surv, &sh.nsurv, FUSED_SURV_CAP);
    }
    if (owner) {
        const kiln_u32 seen = min(c, (kiln_u32)depth);
        pos[threadIdx.x] = seen;
        more[threadIdx.x] =
            c > seen && (seen == 0u || staged[(int)(seen - 1u) * blocks + (int)threadIdx.x] >= bound) ? 1u : 0u;
    }
    for (;;) {
        if (threadIdx.x == 0) sh.nopen = 0u;
        __syncthreads();
        if (owner && more[threadIdx.x] != 0u) open_list[atomicAdd(&sh.nopen, 1u)] = threadIdx.x;
        __syncthreads();
        const int open = (int)sh.nopen;
        if (open == 0) break;
        const int q = THREADS / open;
        const int t = threadIdx.x;
        bool take = false;
        kiln_u64 v = 0ull;
        if (t < open * q) {
            const int b = (int)open_list[t / q];
            const kiln_u32 i = pos[b] + (kiln_u32)(t % q);
            if (i < cnt[b]) {
                v = __ldcg(&lists[(long long)b * FUSED_KMAX + i]);
                take = v >= bound;
            }
            if (t % q == q - 1) more[b] = take && i + 1u < cnt[b] ? 1u : 0u;
        }
        fused_append(take, v, surv, &sh.nsurv, FUSED_SURV_CAP);
        __syncthreads();
        if (owner && more[threadIdx.x] != 0u) pos[threadIdx.x] += (kiln_u32)q;
        if (owner && pos[threadIdx.x] >= cnt[threadIdx.x]) more[threadIdx.x] = 0u;
    }
    // `more` of an open list is written by its chunk's last thread in the round and read by its
    // owner after the barrier; a list that closed keeps 0.
    const int m_n = (int)sh.nsurv;
    if (m_n > FUSED_SURV_CAP) return FUSED_OVERFLOW;

    // The top-k in the order, into sh.list.
    const int kk = min((int)k, m_n);
    kiln_u64* top = sh.list;
    if (m_n <= FUSED_RANK_MAX) {
        fused_rank(surv, m_n, [&](kiln_u64 e, kiln_u32 rank) {
            if ((int)rank < kk) top[rank] = e;
        });
    } else {
        int size = 1;
        while (size < m_n) size <<= 1;
        for (int j = m_n + (int)threadIdx.x; j < size; j += THREADS) surv[j] = 0ull;
        __syncthreads();
        fused_bitonic(surv, size);
        for (int j = threadIdx.x; j < kk; j += THREADS) top[j] = surv[j];
    }
    __syncthreads();

    // Token j of the order (thread j): its weight from the first; top-p in rank order; min-p;
    // the draw in index order.
    const int j = threadIdx.x;
    const bool mine = j < kk;
    const kiln_u64 e = mine ? top[j] : 0ull;
    const float v = fused_value((kiln_u32)(e >> 32));
    float m = fused_value((kiln_u32)(top[0] >> 32)) / p->temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const kiln_u32 w = mine ? sample_weight(v, p->temperature, m) : 0u;
    kiln_u64 mass;
    const kiln_u64 before = fast_scan((kiln_u64)w, sh.warp_u64, mass);
    bool kept = mine;
    if (p->top_p_units < (1u << 24)) {
        // The cutoff is the first rank whose inclusive mass reaches the target.
        const kiln_u64 target = sample_top_p_target(mass, p->top_p_units);
        kept = mine && before < target;
    }
    const kiln_u32 kw = kept && w >= p->min_weight ? w : 0u;
    kiln_u32* kept_weight = reinterpret_cast<kiln_u32*>(surv);  // the survivors are no longer read
    kiln_u32* kept_index = kept_weight + FUSED_KMAX;
    const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)e;
    if (mine) {
        kept_weight[j] = kw;
        kept_index[j] = index;
    }
    kiln_u64 kept_mass;
    fast_scan((kiln_u64)kw, sh.warp_u64, kept_mass);  // its barriers publish kept_*
    const kiln_u64 u = sample_uniform(p->seed, step, p->stream);
    const kiln_u64 target = __umul64hi(u, kept_mass);  // < kept_mass: the first token is kept
    // The draw in index order: the token whose inclusive kept mass over the tokens of lower or
    // equal index passes the target; g threads sum a token's (a power of two within a warp, as
    // many as the block allows), so no thread walks all k.
    int g = 1;
    while (g < 32 && 2 * g * kk <= THREADS) g <<= 1;
    if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
    __syncthreads();
    for (int base = 0; base < kk; base += THREADS / g) {
        const int jj = base + (int)threadIdx.x / g, part = (int)threadIdx.x & (g - 1);
        const kiln_u32 own_index = jj < kk ? kept_index[jj] : 0u;
        const kiln_u32 own_weight = jj < kk ? kept_weight[jj] : 0u;
        kiln_u64 inclusive = 0ull;
        if (own_weight != 0u) {
            for (int i = part; i < kk; i += g) inclusive += kept_index[i] <= own_index ? (kiln_u64)kept_weight[i] : 0ull;
        }
        for (int o = g >> 1; o > 0; o >>= 1) inclusive += __shfl_xor_sync(KILN_FULL_MASK, inclusive, o);
        if (part == 0 && own_weight != 0u && inclusive - own_weight <= target && target < inclusive) {
            tokens[r] = own_index;
        }
    }
    return 0;
}

// One launch: grid (slices, rows). Fused rows (greedy, or 1 <= top_k <= FUSED_KMAX) use every
// block of their row; with `mass_path`, rows at temperature > 0 without top-k take step 1 of the
// mass path on its own slices (blocks below their count), `kiln_sample_mass` and
// `kiln_sample_mass_pick` following; every other row (and greedy rows read from the LM head's
// statistics) runs on block 0 alone.
// Compiled with 256 threads (the launcher's FUSED_THREADS) only; the other kernels with 1024.
#if THREADS <= 256
extern "C" __global__ void __launch_bounds__(THREADS, FUSED_MIN_BLOCKS)
kiln_sample_fused(const float* __restrict__ logits, long long vocab, long long row_stride,
                  const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                  const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
                  kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
                  int stats_per_row, kiln_u32* __restrict__ tokens, kiln_u32* tickets, kiln_u32* fused_counts,
                  kiln_u64* fused_lists, int fused_slots, long long fused_slice_len, int mass_path,
                  kiln_u64* mass_maxima, int mass_slots, long long mass_slice_len) {
    kiln_wait_prior();
    {
        // This block's fused slice into L1 while the parameters load (a line a thread): a fused
        // row's loads below then wait on L1, not L2; other rows lose a few requests.
        const long long lo = (long long)blockIdx.x * fused_slice_len;
        const long long hi = lo + fused_slice_len < vocab ? lo + fused_slice_len : vocab;
        const float* x = logits + (long long)blockIdx.y * row_stride;
        for (long long i = lo + 32ll * threadIdx.x; i < hi; i += 32ll * THREADS)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(x + i));
    }
    const int r = blockIdx.y;
    const KilnSampleParams p = params[r];
    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const bool penalties = sample_penalized(p, counts, h0, h1);
    if (sample_mass_row(p, mass_path)) {
        if ((long long)blockIdx.x * mass_slice_len >= vocab) return;  // beyond the mass path's slices
        MassWork work = {};
        work.maxima = mass_maxima;
        work.slots = mass_slots;
        work.slice_len = mass_slice_len;
        sample_mass_maxima(r, penalties, logits + (long long)r * row_stride, scratch + (long long)r * vocab, vocab,
                           p, h0, h1, history, counts + (long long)r * vocab, work);
        return;
    }
    const bool greedy = p.temperature == 0.0f;
    const bool from_stats = greedy && stats != nullptr && !penalties;
    bool single;
    if (!from_stats && (greedy || (p.top_k >= 1u && p.top_k <= FUSED_KMAX))) {
        FusedWork work;
        work.tickets = tickets;
        work.counts = fused_counts;
        work.lists = fused_lists;
        work.slots = fused_slots;
        work.slice_len = fused_slice_len;
        single = sample_row_fused(r, greedy ? 1u : p.top_k, penalties, logits + (long long)r * row_stride, vocab,
                                  params + r, steps, h0, h1, history, counts, tokens, work) == FUSED_OVERFLOW;
    } else {
        single = blockIdx.x == 0;
    }
    if (single) {
        sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts, scratch,
                          stats, stats_per_row, tokens);
    }
}
#endif  // THREADS <= 256

// ---- The greedy path --------------------------------------------------------------------------
//
// Greedy rows without penalties (and without the LM head's statistics) need only the row's
// largest (key, lowest index): `kiln_sample_greedy` reads the logits once, on a (slices, rows)
// grid sized so that every block is resident at once (GREEDY_MIN_BLOCKS a multiprocessor), each
// block streaming its slice as float4 with GREEDY_UNROLL loads in flight a thread and keeping the
// best in registers. No shared slice, no histogram, no lists: the block's best goes to its slot,
// and the last block of the row (an atomic ticket, reset by that block) takes the best of the
// slots in one read. Integer comparisons of packed (key, ~index) only, so the token is the
// reference's argmax whatever the slices. Any other row is sampled by its block 0 on the
// single-block path (the launcher picks this kernel for batches of plain greedy rows). Two blocks
// a multiprocessor: that path's registers, which every block of the kernel is allotted, spill at
// the 64 and 80 of four and three (sm_80 to sm_90); 16 float4 in flight a thread keep 128 KiB a
// multiprocessor in flight all the same.
#define GREEDY_MIN_BLOCKS 2
#define GREEDY_UNROLL 16

// The largest packed (key, ~index) of x[lo, hi) (not NaN; 0 when none) over this thread's share.
__device__ __forceinline__ kiln_u64 greedy_slice_best(const float* __restrict__ x, long long lo, long long hi) {
    kiln_u64 best = 0ull;
    auto consider = [&](float v, long long i) {
        const kiln_u32 key = sample_order_key(v);
        const kiln_u64 packed = key != 0u ? fast_pack(key, (kiln_u32)i) : 0ull;
        best = packed > best ? packed : best;
    };
    const long long misaligned = (long long)((16u - ((kiln_u32)(size_t)(x + lo) & 15u)) & 15u) / 4;
    const long long head = lo + (misaligned < hi - lo ? misaligned : hi - lo);
    const long long quads = (hi - head) / 4;
    const float4* body = reinterpret_cast<const float4*>(x + head);
    for (long long i = lo + threadIdx.x; i < head; i += THREADS) consider(x[i], i);
    for (long long q0 = 0; q0 < quads; q0 += (long long)GREEDY_UNROLL * THREADS) {
        float4 f[GREEDY_UNROLL];
#pragma unroll
        for (int u = 0; u < GREEDY_UNROLL; ++u) {
            const long long q = q0 + (long long)u * THREADS + threadIdx.x;
            f[u] = q < quads ? __ldcs(&body[q]) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < GREEDY_UNROLL; ++u) {
            const long long q = q0 + (long long)u * THREADS + threadIdx.x;
            if (q < quads) {
                const long long i = head + 4 * q;
                consider(f[u].x, i);
                consider(f[u].y, i + 1);
                consider(f[u].z, i + 2);
                consider(f[u].w, i + 3);
            }
        }
    }
    for (long long i = head + 4 * quads + threadIdx.x; i < hi; i += THREADS) consider(x[i], i);
    return best;
}

// The block's largest u64, in thread 0 (the others get their warp's).
__device__ __forceinline__ kiln_u64 greedy_block_max(kiln_u64 v, kiln_u64* warp_best) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, v, o);
        v = n > v ? n : v;
    }
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < SAMPLE_WARPS; ++w) v = warp_best[w] > v ? warp_best[w] : v;
    }
    return v;
}

// Grid (slices, rows), `slice_len` logits a block (the launcher keeps the slices <= THREADS and
// <= `slots`); `partials` holds `slots` u64 a row, `tickets` one u32 a row (zero on entry, left
// zero).
#if THREADS <= 256
extern "C" __global__ void __launch_bounds__(THREADS, GREEDY_MIN_BLOCKS)
kiln_sample_greedy(const float* __restrict__ logits, long long vocab, long long row_stride,
                   const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                   const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
                   kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
                   int stats_per_row, kiln_u32* __restrict__ tokens, kiln_u32* tickets, kiln_u64* partials, int slots,
                   long long slice_len) {
    kiln_wait_prior();
    __shared__ kiln_u64 warp_best[SAMPLE_WARPS];
    __shared__ int last;
    const int r = blockIdx.y;
    // The parameters load while the slice streams; a row they do not make plain greedy wasted
    // only its read.
    // (Only the fields that decide it: the single-block path reads the parameters itself.)
    const float temperature = params[r].temperature, repetition = params[r].repetition;
    const float presence = params[r].presence, frequency = params[r].frequency;
    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const long long lo = (long long)blockIdx.x * slice_len;
    const long long hi = lo + slice_len < vocab ? lo + slice_len : vocab;
    const kiln_u64 thread_best = greedy_slice_best(logits + (long long)r * row_stride, lo, hi);
    const bool penalized = PENALTIES && counts != nullptr && h1 > h0 &&
                           (repetition != 1.0f || presence != 0.0f || frequency != 0.0f);  // sample_penalized
    const bool plain = temperature == 0.0f && stats == nullptr && !penalized;
    if (!plain) {
        if (blockIdx.x == 0) {
            sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts,
                              scratch, stats, stats_per_row, tokens);
        }
        return;
    }
    const kiln_u64 best = greedy_block_max(thread_best, warp_best);
    if (threadIdx.x == 0) {
        partials[(long long)r * slots + blockIdx.x] = best;
        __threadfence();
        const kiln_u32 ticket = atomicAdd(&tickets[r], 1u);
        last = ticket == gridDim.x - 1u;
        if (last) tickets[r] = 0u;  // every block of the row has taken its ticket
    }
    __syncthreads();
    if (!last) return;
    const kiln_u64 mine =
        (int)threadIdx.x < (int)gridDim.x ? __ldcg(&partials[(long long)r * slots + threadIdx.x]) : 0ull;
    const kiln_u64 row_best = greedy_block_max(mine, warp_best);
    if (threadIdx.x == 0) tokens[r] = row_best != 0ull ? 0xFFFFFFFFu - (kiln_u32)row_best : NO_TOKEN;
}
#endif  // THREADS <= 256

// ---- Phase profiles ----------------------------------------------------------------------------
//
// SAMPLE_PROFILE=1 compiles time stamps and counts of the top-k merge and top-k bound kernels
// into their `profile` argument (64 u64, zero on entry; null otherwise): slot 0 the largest
// ~%globaltimer at a block's entry (the first entry, complemented), 1 the latest ticket, 2 the
// latest end of a row's last block; clock64 of block (0, 0) from slot 8 and of the last block of
// row 0 from slot 16 at the phase boundaries each kernel lists, %globaltimer at that last block's
// start (24) and end (25); row 0's counts from slot 32. `kiln bench sample --profile` prints them.
#ifndef SAMPLE_PROFILE
#define SAMPLE_PROFILE 0
#endif
__device__ __forceinline__ kiln_u64 tkb_globaltimer() {
    kiln_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#if SAMPLE_PROFILE
#define TKB_CLOCK(slot, when)                                               \
    do {                                                                    \
        if ((when) && profile != nullptr && threadIdx.x == 0)               \
            profile[slot] = (kiln_u64)clock64();                            \
    } while (0)
#define TKB_SET(slot, when, value)                                          \
    do {                                                                    \
        if ((when) && profile != nullptr && threadIdx.x == 0)               \
            profile[slot] = (kiln_u64)(value);                              \
    } while (0)
// The end of a row's last block: clock64 (22) and %globaltimer (25) for row 0, the latest end
// of any row (2).
#define TKB_END(row0)                                                         \
    do {                                                                      \
        if (profile != nullptr && threadIdx.x == 0) {                         \
            if (row0) {                                                       \
                profile[22] = (kiln_u64)clock64();                            \
                profile[25] = tkb_globaltimer();                              \
            }                                                                 \
            atomicMax(&profile[2], tkb_globaltimer());                        \
        }                                                                     \
    } while (0)
#else
#define TKB_END(row0) \
    do {              \
        (void)(row0); \
    } while (0)
#define TKB_CLOCK(slot, when) \
    do {                      \
        (void)(when);         \
    } while (0)
#define TKB_SET(slot, when, value) \
    do {                           \
        (void)(when);              \
        (void)sizeof(value);       \
    } while (0)
#endif


// ---- The top-k merge path ---------------------------------------------------------------------
//
// Serves greedy rows and rows with 1 <= top_k <= TKM_KMAX (with any temperature, top-p and
// min-p; rows with penalties, rows read from the LM head's statistics and every other row run on
// block 0 of their row on the single-block path) in one launch of `kiln_sample_topk_merge` on a
// (slices, rows) grid of about two blocks a multiprocessor. Designed for latency:
//   1. Block (s, r) loads its slice into registers (TKM_PER logits a thread, every load in flight;
//      no copy in shared memory) and finds its local top-k from one histogram of the distance
//      below the slice maximum (the bins of `fused_dbin`), kept per warp: each warp owns its row
//      of bins, and the lanes of one bin add together after a match (no atomics), so ties and
//      crowded bins cost no serialization. One warp finds the bin of the k-th token from the
//      column sums; the tokens of the bins up to it (a superset of the local top-k, at most
//      TKM_LIST_CAP) are ranked by counting and the block writes its exact local top-k in the
//      order, as packed (key, ~index) u64. A bin too crowded for the list (ties, a +inf maximum)
//      marks the block's list as overflowed.
//   2. The last block of the row (an atomic ticket, reset by that block) reads every list's count,
//      its k-th entry and the lists' first entries (column-major) in one round trip to L2, bounds
//      the row's k-th token from below by the k-th largest of the lists' first h entries (k
//      distinct tokens of the row) and by the best block's k-th, collects the entries at or above
//      the bound (a prefix of each sorted list: the staged ones, then, for a list whose staged
//      entries are all above the bound, its next entries read from L2 by its owner), ranks them
//      (counting, or a bitonic sort in shared memory past TKM_RANK_MAX) and finishes on the top-k
//      in the order as the fused path does: weights from the first, top-p in rank order by one
//      block scan, min-p, and the draw in index order.
// A row with an overflowed list or more survivors than the buffers hold is sampled by its last
// block on the single-block path. Every quantity is an integer or the reference's fp32 operation
// on the same value, so the token is the reference's whatever the slices.
// Profile slots (SAMPLE_PROFILE=1, see above): block (0, 0): clock64 at entry (8), slice loaded
// and its maximum found (9), bin of the k-th chosen (10), list written (11), ticket taken (12);
// the last block of row 0: clock64 at its start (16), heads staged (17), bound (18), survivors
// (19), top-k ranked (20), token written (22); counts: survivors (33), k (35), fallback (36),
// slices (37), staged depth (38).

#define TKM_KMAX 256          // the largest top-k the path serves
#define TKM_PER 32            // logits a thread holds: a slice is at most TKM_PER * THREADS
#define TKM_LIST_CAP 512      // a block's superset of its local top-k
#define TKM_BINS 256          // histogram bins (those of fused_dbin)
#define TKM_HEAD_CAP 1024     // the lists' first entries the last block stages
#define TKM_SURV_CAP 2048     // entries at or above the bound the last block ranks
#define TKM_RANK_MAX 512      // ranked by counting up to this many, by a bitonic sort above
#define TKM_OVERFLOW 0xFFFFFFFFu  // a list count: the block's bin was too crowded
#define TKM_FALLBACK 1
#define TKM_MIN_BLOCKS 2

#if THREADS <= 256
struct TopKMergeShared {
    union {
        kiln_u32 bins[SAMPLE_WARPS][TKM_BINS];  // a row of bins a warp (the block's selection)
        kiln_u64 staged[TKM_HEAD_CAP];          // the lists' first entries (the last block)
    };
    kiln_u64 surv[TKM_SURV_CAP];   // the survivors; then the kept weights and indices
    kiln_u64 list[TKM_LIST_CAP];   // the block's superset; in the last block, the top-k in order
    kiln_u32 column[TKM_BINS];     // the bins summed over the warps
    kiln_u64 warp_u64[SAMPLE_WARPS];
    kiln_u32 warp_u32[SAMPLE_WARPS];
    kiln_u64 best, bound;
    kiln_u32 valid, listed, chosen, above, count, nsurv;
    int last;
};
static_assert(SAMPLE_WARPS * TKM_BINS * 4 == TKM_HEAD_CAP * 8, "the bins and the staged heads share memory");
static_assert(THREADS >= TKM_KMAX, "one thread per top-k token, one list per thread");

// Adds one to bins[bin] (the warp's own row) for the lanes with bin >= 0: the lanes of one bin
// are matched and their first lane adds their count (one writer per address, no atomics).
__device__ __forceinline__ void tkm_count(kiln_u32* warp_bins, int bin) {
    const kiln_u32 peers = __match_any_sync(KILN_FULL_MASK, bin);
    if (bin >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1) warp_bins[bin] += (kiln_u32)__popc(peers);
}

// The block's largest u64 (every thread gets it).
__device__ __forceinline__ kiln_u64 tkm_max(kiln_u64 v, TopKMergeShared& sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 n = __shfl_xor_sync(KILN_FULL_MASK, v, o);
        v = n > v ? n : v;
    }
    if (threadIdx.x == 0) sh.best = 0ull;
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && v != 0ull) atomicMax(&sh.best, v);
    __syncthreads();
    const kiln_u64 out = sh.best;
    __syncthreads();
    return out;
}

// Block (s, r) of a served row, k >= 1. Returns TKM_FALLBACK in the last block of a row whose
// candidates overflow the buffers (the caller then samples the row on the single-block path).
__device__ __forceinline__ int sample_row_topk_merge(int r, kiln_u32 k, const float (&v)[TKM_PER], int n,
                                                     long long lo, const KilnSampleParams* __restrict__ p,
                                                     const kiln_u64* __restrict__ steps,
                                                     kiln_u32* __restrict__ tokens, kiln_u32* tickets,
                                                     kiln_u32* list_counts, kiln_u64* lists, int slots,
                                                     kiln_u64* profile) {
    __shared__ TopKMergeShared sh;
    const bool first = blockIdx.x == 0 && r == 0, row0 = r == 0;
    const int warp = threadIdx.x >> 5;
    // The slice's maximum and candidates from the registers; the bins zeroed meanwhile.
    kiln_u64 thread_best = 0ull;
    kiln_u32 thread_valid = 0u;
#pragma unroll
    for (int u = 0; u < TKM_PER; ++u) {
        const int i = u * THREADS + (int)threadIdx.x;
        const kiln_u32 key = i < n ? sample_order_key(v[u]) : 0u;
        if (key != 0u) {
            ++thread_valid;
            const kiln_u64 packed = fast_pack(key, (kiln_u32)(lo + i));
            thread_best = packed > thread_best ? packed : thread_best;
        }
    }
    TKB_CLOCK(9, first);
    if (threadIdx.x == 0) {
        sh.best = 0ull;
        sh.valid = 0u;
        sh.listed = 0u;
    }
    for (int b = threadIdx.x; b < SAMPLE_WARPS * TKM_BINS; b += THREADS) (&sh.bins[0][0])[b] = 0u;
    __syncthreads();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const kiln_u64 other = __shfl_xor_sync(KILN_FULL_MASK, thread_best, o);
        thread_best = other > thread_best ? other : thread_best;
    }
    thread_valid = __reduce_add_sync(KILN_FULL_MASK, thread_valid);
    if ((threadIdx.x & 31) == 0) {
        if (thread_best != 0ull) atomicMax(&sh.best, thread_best);
        if (thread_valid != 0u) atomicAdd(&sh.valid, thread_valid);
    }
    __syncthreads();
    const kiln_u64 slice_best = sh.best;
    const kiln_u32 valid = sh.valid;
    const long long slot = (long long)r * slots + blockIdx.x;
    kiln_u64* out = lists + slot * TKM_KMAX;
    kiln_u32 written = 0u;
    if (valid != 0u && k == 1u) {
        if (threadIdx.x == 0) out[0] = slice_best;
        written = 1u;
    } else if (valid != 0u) {
        const float M = fused_value((kiln_u32)(slice_best >> 32));
        int chosen = TKM_BINS - 1;  // every valid token is listed when the slice has at most k
        bool crowded = false;
        if (valid > k) {
#pragma unroll
            for (int u = 0; u < TKM_PER; ++u) {
                if (u * THREADS >= n) break;  // the same for the whole block
                const int i = u * THREADS + (int)threadIdx.x;
                int bin = -1;
                if (i < n && sample_order_key(v[u]) != 0u) bin = fused_dbin(v[u], M);
                tkm_count(sh.bins[warp], bin);
            }
            __syncthreads();
            for (int b = threadIdx.x; b < TKM_BINS; b += THREADS) {
                kiln_u32 sum = 0u;
#pragma unroll
                for (int w = 0; w < SAMPLE_WARPS; ++w) sum += sh.bins[w][b];
                sh.column[b] = sum;
            }
            __syncthreads();
            if (threadIdx.x < 32) {
                // The first bin (ascending distance) at which the running count reaches k.
                const int lane = threadIdx.x;
                kiln_u32 sum = 0u;
#pragma unroll
                for (int q = 0; q < TKM_BINS / 32; ++q) sum += sh.column[lane * (TKM_BINS / 32) + q];
                kiln_u32 inclusive = sum;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const kiln_u32 m = __shfl_up_sync(KILN_FULL_MASK, inclusive, o);
                    if (lane >= o) inclusive += m;
                }
                const kiln_u32 before = inclusive - sum;
                if (before < k && inclusive >= k) {
                    kiln_u32 acc = before;
                    for (int q = 0; q < TKM_BINS / 32; ++q) {
                        const int b = lane * (TKM_BINS / 32) + q;
                        const kiln_u32 c = sh.column[b];
                        if (acc + c >= k) {
                            sh.chosen = (kiln_u32)b;
                            sh.above = acc;
                            sh.count = c;
                            break;
                        }
                        acc += c;
                    }
                }
            }
            __syncthreads();
            chosen = (int)sh.chosen;
            crowded = sh.above + sh.count > TKM_LIST_CAP;
        }
        TKB_CLOCK(10, first);
        if (crowded) {
            written = TKM_OVERFLOW;
        } else {
#pragma unroll
            for (int u = 0; u < TKM_PER; ++u) {
                if (u * THREADS >= n) break;
                const int i = u * THREADS + (int)threadIdx.x;
                const kiln_u32 key = i < n ? sample_order_key(v[u]) : 0u;
                const bool take = key != 0u && fused_dbin(v[u], M) <= chosen;
                fused_append(take, take ? fast_pack(key, (kiln_u32)(lo + i)) : 0ull, sh.list, &sh.listed,
                             TKM_LIST_CAP);
            }
            __syncthreads();
            const int listed = (int)sh.listed;  // <= TKM_LIST_CAP: not crowded
            written = min((kiln_u32)listed, k);
            fused_rank(sh.list, listed, [&](kiln_u64 e, kiln_u32 rank) {
                if (rank < written) out[rank] = e;
            });
        }
    }
    TKB_CLOCK(11, first);
    if (threadIdx.x == 0) list_counts[slot] = written;

    // The last block of the row to finish goes on; every thread fences its own writes first.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const kiln_u32 ticket = atomicAdd(&tickets[r], 1u);
        sh.last = ticket == gridDim.x - 1u;
        if (sh.last) {
            tickets[r] = 0u;  // every block of the row has taken its ticket
            __threadfence();
        }
#if SAMPLE_PROFILE
        if (profile != nullptr) atomicMax(&profile[1], tkb_globaltimer());
#endif
    }
    TKB_CLOCK(12, first);
    __syncthreads();
    if (!sh.last) return 0;
    TKB_CLOCK(16, row0);
    TKB_SET(24, row0, tkb_globaltimer());
    TKB_SET(35, row0, k);
    TKB_SET(37, row0, gridDim.x);

    const kiln_u64 step = steps[r];  // read now: its latency hides behind the merge
    const int blocks = (int)gridDim.x;  // <= THREADS (launcher)
    const kiln_u32* row_counts = list_counts + (long long)r * slots;
    const kiln_u64* row_lists = lists + (long long)r * slots * TKM_KMAX;
    const bool owner = (int)threadIdx.x < blocks;  // thread b owns list b
    // One round trip: each owner's count and k-th entry, the first `depth` entries of every list
    // (entry i of list b at staged[i * blocks + b]; 0 past a list's count).
    const int depth = min((int)k, TKM_HEAD_CAP / blocks);  // >= 4: at most 256 blocks
    kiln_u32 c = 0u;
    kiln_u64 kth = 0ull;
    if (owner) {
        c = __ldcg(&row_counts[threadIdx.x]);
        kth = __ldcg(&row_lists[(long long)threadIdx.x * TKM_KMAX + (k - 1u)]);
    }
    for (int e = threadIdx.x; e < depth * blocks; e += THREADS) {
        const int i = e / blocks, b = e - i * blocks;
        const kiln_u32 cb = __ldcg(&row_counts[b]);
        const kiln_u64 x = __ldcg(&row_lists[(long long)b * TKM_KMAX + i]);
        sh.staged[e] = cb != TKM_OVERFLOW && (kiln_u32)i < cb ? x : 0ull;
    }
    if (__syncthreads_or(owner && c == TKM_OVERFLOW)) return TKM_FALLBACK;
    TKB_CLOCK(17, row0);
    TKB_SET(38, row0, depth);
    if (k == 1u) {
        // Greedy (or top-k 1): the best of the slices' maxima.
        const kiln_u64 best = tkm_max(owner && c != 0u ? sh.staged[threadIdx.x] : 0ull, sh);
        if (threadIdx.x == 0) tokens[r] = best != 0ull ? 0xFFFFFFFFu - (kiln_u32)best : NO_TOKEN;
        TKB_END(row0);
        return 0;
    }
    // The candidates of the row, and how many the lists' first h entries hold, h from
    // ceil(k / blocks), summed together (each sum below 2^32).
    int h = (int)((k + (kiln_u32)blocks - 1u) / (kiln_u32)blocks);
    kiln_u64 sums;
    fast_scan(((kiln_u64)c << 32) | (kiln_u64)min(c, (kiln_u32)h), sh.warp_u64, sums);
    const kiln_u32 total = (kiln_u32)(sums >> 32);
    if (total == 0u) {  // every logit of the row is NaN
        if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return 0;
    }
    // The bound: every token of the row's top-k is at or above it (0 when the row has at most k
    // candidates: every listed token is kept).
    kiln_u64 bound = 0ull;
    if (total > k) {
        const kiln_u64 local = tkm_max(owner && c == k ? kth : 0ull, sh);  // the best block's k-th
        kiln_u32 within = (kiln_u32)sums;
        while (within < k) {
            h = min(2 * h, (int)k);
            fast_scan(min(c, (kiln_u32)h), sh.warp_u32, within);
        }
        if (h > depth) return TKM_FALLBACK;  // the heads are not all staged
        if (threadIdx.x == 0) sh.bound = 0ull;
        __syncthreads();
        fused_rank(sh.staged, blocks * h, [&](kiln_u64 e, kiln_u32 rank) {
            if (rank == k - 1u) sh.bound = e;
        });
        __syncthreads();
        bound = sh.bound > local ? sh.bound : local;
    }
    TKB_CLOCK(18, row0);

    // The survivors: the staged entries at or above the bound, then the next entries of each list
    // whose staged ones all are (read by its owner, 8 at a time, down to the bound).
    if (threadIdx.x == 0) sh.nsurv = 0u;
    __syncthreads();
    for (int base = 0; base < depth * blocks; base += THREADS) {
        const int e = base + (int)threadIdx.x;
        const kiln_u64 x = e < depth * blocks ? sh.staged[e] : 0ull;
        fused_append(x != 0ull && x >= bound, x, sh.surv, &sh.nsurv, TKM_SURV_CAP);
    }
    if (owner && c > (kiln_u32)depth && sh.staged[(depth - 1) * blocks + (int)threadIdx.x] >= bound) {
        const kiln_u64* list = row_lists + (long long)threadIdx.x * TKM_KMAX;
        bool open = true;
        for (int i0 = depth; open && i0 < (int)c; i0 += 8) {
            kiln_u64 x[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) x[q] = i0 + q < (int)c ? __ldcg(&list[i0 + q]) : 0ull;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                if (open && x[q] != 0ull && x[q] >= bound) {
                    const kiln_u32 at = atomicAdd(&sh.nsurv, 1u);
                    if (at < TKM_SURV_CAP) sh.surv[at] = x[q];
                } else {
                    open = false;
                }
            }
        }
    }
    __syncthreads();
    const int m_n = (int)sh.nsurv;
    TKB_CLOCK(19, row0);
    TKB_SET(33, row0, m_n);
    if (m_n > TKM_SURV_CAP) return TKM_FALLBACK;

    // The top-k in the order, into sh.list.
    const int kk = min((int)k, m_n);
    kiln_u64* top = sh.list;
    if (m_n <= TKM_RANK_MAX) {
        fused_rank(sh.surv, m_n, [&](kiln_u64 e, kiln_u32 rank) {
            if ((int)rank < kk) top[rank] = e;
        });
    } else {
        int size = 1;
        while (size < m_n) size <<= 1;
        for (int j = m_n + (int)threadIdx.x; j < size; j += THREADS) sh.surv[j] = 0ull;
        __syncthreads();
        fused_bitonic(sh.surv, size);
        for (int j = threadIdx.x; j < kk; j += THREADS) top[j] = sh.surv[j];
    }
    __syncthreads();

    TKB_CLOCK(20, row0);
    // Token j of the order (thread j): its weight from the first; top-p in rank order; min-p;
    // the draw in index order (as the fused path).
    const int j = threadIdx.x;
    const bool mine = j < kk;
    const kiln_u64 e = mine ? top[j] : 0ull;
    const float x = fused_value((kiln_u32)(e >> 32));
    float m = fused_value((kiln_u32)(top[0] >> 32)) / p->temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const kiln_u32 w = mine ? sample_weight(x, p->temperature, m) : 0u;
    kiln_u64 mass;
    const kiln_u64 before = fast_scan((kiln_u64)w, sh.warp_u64, mass);
    bool kept = mine;
    if (p->top_p_units < (1u << 24)) {
        // The cutoff is the first rank whose inclusive mass reaches the target.
        const kiln_u64 target = sample_top_p_target(mass, p->top_p_units);
        kept = mine && before < target;
    }
    const kiln_u32 kw = kept && w >= p->min_weight ? w : 0u;
    kiln_u32* kept_weight = reinterpret_cast<kiln_u32*>(sh.surv);  // the survivors are no longer read
    kiln_u32* kept_index = kept_weight + TKM_KMAX;
    const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)e;
    if (mine) {
        kept_weight[j] = kw;
        kept_index[j] = index;
    }
    kiln_u64 kept_mass;
    fast_scan((kiln_u64)kw, sh.warp_u64, kept_mass);  // its barriers publish kept_*
    const kiln_u64 u = sample_uniform(p->seed, step, p->stream);
    const kiln_u64 target = __umul64hi(u, kept_mass);  // < kept_mass: the first token is kept
    // The draw in index order: the token whose inclusive kept mass over the tokens of lower or
    // equal index passes the target; g threads sum a token's.
    int g = 1;
    while (g < 32 && 2 * g * kk <= THREADS) g <<= 1;
    if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
    __syncthreads();
    for (int base = 0; base < kk; base += THREADS / g) {
        const int jj = base + (int)threadIdx.x / g, part = (int)threadIdx.x & (g - 1);
        const kiln_u32 own_index = jj < kk ? kept_index[jj] : 0u;
        const kiln_u32 own_weight = jj < kk ? kept_weight[jj] : 0u;
        kiln_u64 inclusive = 0ull;
        if (own_weight != 0u) {
            for (int i = part; i < kk; i += g) inclusive += kept_index[i] <= own_index ? (kiln_u64)kept_weight[i] : 0ull;
        }
        for (int o = g >> 1; o > 0; o >>= 1) inclusive += __shfl_xor_sync(KILN_FULL_MASK, inclusive, o);
        if (part == 0 && own_weight != 0u && inclusive - own_weight <= target && target < inclusive) {
            tokens[r] = own_index;
        }
    }
    TKB_END(row0);
    return 0;
}

// One launch: grid (slices, rows), `slice_len` logits a block (at most TKM_PER * THREADS; the
// launcher keeps the slices <= THREADS and <= `slots`). `list_counts` holds `slots` u32 a row,
// `lists` `slots` lists of TKM_KMAX u64 a row, `tickets` one u32 a row (zero on entry, left zero).
extern "C" __global__ void __launch_bounds__(THREADS, TKM_MIN_BLOCKS)
kiln_sample_topk_merge(const float* __restrict__ logits, long long vocab, long long row_stride,
                       const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                       const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
                       kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
                       int stats_per_row, kiln_u32* __restrict__ tokens, kiln_u32* tickets, kiln_u32* list_counts,
                       kiln_u64* lists, int slots, long long slice_len, kiln_u64* profile) {
    kiln_wait_prior();
#if SAMPLE_PROFILE
    if (profile != nullptr && threadIdx.x == 0) atomicMax(&profile[0], ~tkb_globaltimer());
#else
    (void)profile;
#endif
    TKB_CLOCK(8, blockIdx.x == 0 && blockIdx.y == 0);
    const int r = blockIdx.y;
    const long long lo = (long long)blockIdx.x * slice_len;
    const long long hi = lo + slice_len < vocab ? lo + slice_len : vocab;
    const int n = hi > lo ? (int)(hi - lo) : 0;  // <= TKM_PER * THREADS (launcher)
    const float* x = logits + (long long)r * row_stride + lo;
    // The slice into registers (every load in flight), the parameters beside it; a row this path
    // does not serve wasted only its read.
    float v[TKM_PER];
#pragma unroll
    for (int u = 0; u < TKM_PER; ++u) {
        const int i = u * THREADS + (int)threadIdx.x;
        v[u] = i < n ? __ldcs(&x[i]) : 0.0f;
    }
    const KilnSampleParams p = params[r];
    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const bool penalties = sample_penalized(p, counts, h0, h1);
    const bool greedy = p.temperature == 0.0f;
    const bool from_stats = greedy && stats != nullptr && !penalties;
    const bool served = !from_stats && !penalties && (greedy || (p.top_k >= 1u && p.top_k <= TKM_KMAX));
    bool single = !served && blockIdx.x == 0;
    if (served) {
        single = sample_row_topk_merge(r, greedy ? 1u : p.top_k, v, n, lo, params + r, steps, tokens, tickets,
                                       list_counts, lists, slots, profile) == TKM_FALLBACK;
        TKB_SET(36, r == 0 && single, 1);
    }
    if (single) {
        sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts, scratch,
                          stats, stats_per_row, tokens);
    }
}
#endif  // THREADS <= 256

// ---- The top-k bound path ---------------------------------------------------------------------
//
// Serves the rows of the top-k merge path (greedy rows and rows with 1 <= top_k <= TKB_KMAX,
// without penalties or the LM head's statistics; every other row on block 0 of its row on the
// single-block path) in one launch of `kiln_sample_topk_bound` on a (slices, rows) grid, with no
// selection in the blocks that read the logits:
//   1. Block (s, r) loads its slice (TKB_PER order keys a thread, every load issued before any
//      is converted) and writes
//      the maximum order key of each group of 32 consecutive logits (one warp-wide max a group;
//      slices are multiples of 32 logits, so no group crosses a slice). Then it takes the row's
//      ticket; every block but the last of the row is done.
//   2. The last block of the row holds the row's group maxima in registers (TKB_GROUP_PER a
//      thread), takes their maximum M (the row's) and bins them by the distance below M (the
//      bins of `fused_dbin`, monotone in the key; four bins packed in a word). A binary
//      search over the 256 bins (eight block-wide counts, one barrier each, no atomics) finds cb,
//      the first bin at which the count reaches k. The bins up to cb hold at least k groups, so k
//      distinct tokens: every token of the row's top-k lies in a bin up to cb. When bin cb holds
//      more than TKB_SLACK groups, 8-bit
//      radix passes over the keys of its groups choose a prefix too, and the bound B is the
//      lowest key with it. Each warp lists its own candidate groups (maxima in a bin up to cb and
//      at or above B) without a barrier and reads them again from L2, a lane a logit and
//      TKB_GATHER groups in flight (one shared atomic a warp and round for their slots); their
//      tokens in a bin up to cb and at or above B are the candidates: k and a few more. They are ranked (counting, or a bitonic sort past
//      TKB_RANK_MAX) and the block finishes on the top-k in the order as the top-k merge path
//      does: weights from the first, top-p in rank order by one block scan, min-p, and the draw
//      in index order (the Philox uniform computed while the maxima load; each scan one barrier).
// A row with more candidate groups or candidates than the buffers hold (ties) is sampled by its
// last block on the single-block path; a row whose group maxima are fewer than k takes every
// valid token as a candidate. Every quantity is an integer or the reference's fp32 operation on
// the same value, so the token is the reference's whatever the slices.
//
// Profile slots (SAMPLE_PROFILE=1, see above): block (0, 0): clock64 at entry (8),
// keys loaded (9), maxima stored (10), ticket taken (11); the last block of row 0: clock64 at its
// start (16), maxima loaded and M found (17), bins and bound searched (18), warp 0's candidate
// groups listed (19), candidates gathered (20), ranked (21), token written (22), %globaltimer at
// its start (24) and end (25); row 0's counts: valid groups (32), candidate groups (33),
// candidates (34), k (35), fallback (36), slices (37), groups a slice (38), radix passes over a
// crowded bin (39). `kiln bench sample --profile` prints them.

// Compiled where a block holds a slice's keys and the last block the row's group maxima in
// registers: TKB_PER * THREADS and TKB_GROUP_PER * THREADS at most 8192 (THREADS = 256 with the
// defaults; `SamplePath::TopKWide` compiles it with THREADS = 512, TKB_PER = TKB_GROUP_PER = 16
// and TKB_MIN_BLOCKS = 1: half the serial work a thread of the last block, 16 warps).
#define TKB_KMAX 256          // the largest top-k the path serves
#ifndef TKB_PER
#define TKB_PER 32            // order keys a thread holds: a slice is at most TKB_PER * THREADS
#endif
#ifndef TKB_GROUP_PER
#define TKB_GROUP_PER 32      // group maxima a thread of the last block holds (a multiple of 4)
#endif
#define TKB_GROUP_CAP 1024    // candidate groups the last block gathers
#define TKB_CAND_CAP 2048     // candidates the last block ranks (a power of two)
#define TKB_RANK_MAX 512      // ranked by counting up to this many, by a bitonic sort above
#define TKB_SLACK 48          // a bin of at most this many groups bounds without radix passes
#define TKB_WARP_GROUPS (TKB_GROUP_CAP / SAMPLE_WARPS)  // candidate groups a warp lists
#ifndef TKB_GATHER
#define TKB_GATHER 16         // candidate groups a warp reads at once
#endif
#define TKB_FALLBACK 1
#ifndef TKB_HEADS
#define TKB_HEADS 0           // TKB_HEADS > 0: each slice block lists its TKB_HEADS largest tokens
#endif
#define TKB_HEAD_CAP TKB_CAND_CAP  // the lists' entries a row's last block reads (heads path)
#define TKB_SATURATED 2       // the heads path could not bound the row: the bound path takes it
#ifndef TKB_MIN_BLOCKS
#define TKB_MIN_BLOCKS 2
#endif
// The top-k in the order (TKB_KMAX u64); tkb_finish_few's kept weights and indices (THREADS u32
// each) in the same memory.
#define TKB_TOP (THREADS > TKB_KMAX ? THREADS : TKB_KMAX)

#if TKB_PER * THREADS <= 8192 && TKB_GROUP_PER * THREADS <= 8192
struct TopKBoundShared {
    kiln_u64 cand[TKB_CAND_CAP];      // the candidates; then the kept weights and indices
    kiln_u64 top[TKB_TOP];            // the top-k in the order
    __align__(16) kiln_u32 bins[256];
    kiln_u32 wgroups[SAMPLE_WARPS][TKB_WARP_GROUPS];  // each warp's candidate groups
    kiln_u64 mass_sums[SAMPLE_WARPS];  // the warps' weight sums (top-p)
    kiln_u64 kept_sums[SAMPLE_WARPS];  // the warps' kept weight sums (the draw)
    kiln_u32 warp_max[SAMPLE_WARPS];
    kiln_u32 warp_counts[2][SAMPLE_WARPS];  // the bound search's per-warp counts (by step parity)
    union {
        // The bins of each thread's group maxima, four to a word (its own column: no barrier).
        kiln_u32 packed[TKB_GROUP_PER / 4][THREADS];
        // The weights of the first THREADS candidates (tkb_finish_few), by slot.
        struct {
            kiln_u32 weights[THREADS];
        } hist;
    };
    kiln_u64 mass;  // tkb_finish_few: the top-k's mass
    kiln_u32 chosen, above, count, total, ngroups, ncand, overflow;
    int last;
};
static_assert(THREADS >= TKB_KMAX, "one thread per top-k token");
static_assert(2 * TKB_KMAX * 4 <= TKB_CAND_CAP * 8, "the kept weights and indices fit in `cand`");
static_assert(2 * THREADS * 4 <= TKB_TOP * 8, "tkb_finish_few's kept weights and indices fit in `top`");
static_assert(TKB_GROUP_PER % 4 == 0 && TKB_GROUP_CAP % SAMPLE_WARPS == 0, "whole words of bins, whole warp lists");
static_assert(sizeof(TopKBoundShared) <= 48 * 1024, "static shared memory");

// One warp (warp 0) finds the first bin, in the order (bin 0 first, or bin 255 first when
// `descending`), at which the running count reaches `target`: sh.chosen, the count before it in
// sh.above, its own in sh.count, the total of the bins in sh.total (the bin is meaningless when
// the total is below the target). Each lane holds eight consecutive bins in registers (two
// 16-byte loads). Followed by a barrier.
__device__ __forceinline__ void tkb_pick(TopKBoundShared& sh, kiln_u32 target, bool descending) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int chunk = descending ? 31 - lane : lane;
        const uint4 a = reinterpret_cast<const uint4*>(sh.bins)[2 * chunk];
        const uint4 b = reinterpret_cast<const uint4*>(sh.bins)[2 * chunk + 1];
        kiln_u32 c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if (descending) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const kiln_u32 t = c[q];
                c[q] = c[7 - q];
                c[7 - q] = t;
            }
        }
        kiln_u32 sum = 0u;
#pragma unroll
        for (int q = 0; q < 8; ++q) sum += c[q];
        kiln_u32 inclusive = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const kiln_u32 n = __shfl_up_sync(KILN_FULL_MASK, inclusive, o);
            if (lane >= o) inclusive += n;
        }
        const kiln_u32 before = inclusive - sum;
        if (lane == 31) sh.total = inclusive;
        if (before < target && inclusive >= target) {
            kiln_u32 acc = before;
            bool done = false;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                if (!done && acc + c[q] >= target) {
                    sh.chosen = (kiln_u32)(descending ? 8 * chunk + 7 - q : 8 * chunk + q);
                    sh.above = acc;
                    sh.count = c[q];
                    done = true;
                }
                acc += c[q];
            }
        }
    }
    __syncthreads();
}

// The bin (`fused_dbin`) of a group maximum's order key g (not 0) below the row maximum M.
__device__ __forceinline__ int tkb_bin(kiln_u32 g, float M) {
    return fused_dbin(fused_value(g), M);
}

// The largest (tkb_warps_max) and the sum (tkb_warps_sum) of the u32 the block's warps wrote, one
// a warp, for every thread: a loop over them up to 8 warps; above, each lane reads one warp's and
// the warp reduces them (at 16 or 32 warps a loop would cost each thread as many loads).
__device__ __forceinline__ kiln_u32 tkb_warps_max(const kiln_u32* v) {
#if SAMPLE_WARPS > 8
    const int lane = threadIdx.x & 31;
    return __reduce_max_sync(KILN_FULL_MASK, lane < SAMPLE_WARPS ? v[lane] : 0u);
#else
    kiln_u32 m = 0u;
#pragma unroll
    for (int w = 0; w < SAMPLE_WARPS; ++w) m = max(m, v[w]);
    return m;
#endif
}

__device__ __forceinline__ kiln_u32 tkb_warps_sum(const kiln_u32* v) {
#if SAMPLE_WARPS > 8
    const int lane = threadIdx.x & 31;
    return __reduce_add_sync(KILN_FULL_MASK, lane < SAMPLE_WARPS ? v[lane] : 0u);
#else
    kiln_u32 t = 0u;
#pragma unroll
    for (int w = 0; w < SAMPLE_WARPS; ++w) t += v[w];
    return t;
#endif
}

// Exclusive prefix of v over the block's threads (thread order) and the block's total, with one
// barrier: `warp_sums` must not be written again by this block.
__device__ __forceinline__ kiln_u64 tkb_scan(kiln_u64 v, kiln_u64* warp_sums, kiln_u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    kiln_u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, x, o);
        if (lane >= o) x += n;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
#if SAMPLE_WARPS > 8
    // Lane w holds warp w's sum, scanned over the lanes: the warps before this one and the total
    // by two shuffles (the warp index is the same for the whole warp).
    kiln_u64 s = lane < SAMPLE_WARPS ? warp_sums[lane] : 0ull;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const kiln_u64 n = __shfl_up_sync(KILN_FULL_MASK, s, o);
        if (lane >= o) s += n;
    }
    const kiln_u64 prior = __shfl_sync(KILN_FULL_MASK, s, warp > 0 ? warp - 1 : 0);
    total = __shfl_sync(KILN_FULL_MASK, s, 31);
    return (warp > 0 ? prior : 0ull) + x - v;
#else
    kiln_u64 before = 0ull, all = 0ull;
#pragma unroll
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const kiln_u64 s = warp_sums[w];
        before += w < warp ? s : 0ull;
        all += s;
    }
    total = all;
    return before + x - v;
#endif
}

// The m_n candidates of served row r (sh.cand, packed (key, ~index), distinct; they hold the
// row's top-k) ranked into the top-k in the order (sh.top), then the token: weights from the
// first, top-p in rank order by one block scan, min-p, and the draw in index order with the
// Philox uniform u (each scan one barrier). Every thread calls it.
__device__ __forceinline__ void tkb_rank_finish(int r, kiln_u32 k, int m_n, const KilnSampleParams& p, kiln_u64 u,
                                                kiln_u32* __restrict__ tokens, TopKBoundShared& sh,
                                                kiln_u64* profile) {
    const bool row0 = r == 0;
    // The top-k in the order, into sh.top.
    const int kk = min((int)k, m_n);
    kiln_u64* top = sh.top;
    if (m_n <= TKB_RANK_MAX) {
        fused_rank(sh.cand, m_n, [&](kiln_u64 e, kiln_u32 rank) {
            if ((int)rank < kk) top[rank] = e;
        });
    } else {
        int size = 1;
        while (size < m_n) size <<= 1;
        for (int j = m_n + (int)threadIdx.x; j < size; j += THREADS) sh.cand[j] = 0ull;
        __syncthreads();
        fused_bitonic(sh.cand, size);
        for (int j = threadIdx.x; j < kk; j += THREADS) top[j] = sh.cand[j];
    }
    __syncthreads();
    TKB_CLOCK(21, row0);
    if (k == 1u) {  // greedy, or top-k 1: the first of the order
        if (threadIdx.x == 0) tokens[r] = 0xFFFFFFFFu - (kiln_u32)top[0];
        return;
    }

    // Token j of the order (thread j): its weight from the first; top-p in rank order; min-p;
    // the draw in index order (as the top-k merge path).
    const int j = threadIdx.x;
    const bool mine = j < kk;
    const kiln_u64 e = mine ? top[j] : 0ull;
    const float xv = fused_value((kiln_u32)(e >> 32));
    float m = fused_value((kiln_u32)(top[0] >> 32)) / p.temperature;
    m = fminf(fmaxf(m, -3.40282347e38f), 3.40282347e38f);
    const kiln_u32 w = mine ? sample_weight(xv, p.temperature, m) : 0u;
    kiln_u64 mass;
    const kiln_u64 before = tkb_scan((kiln_u64)w, sh.mass_sums, mass);
    bool kept = mine;
    if (p.top_p_units < (1u << 24)) {
        // The cutoff is the first rank whose inclusive mass reaches the target.
        const kiln_u64 target_p = sample_top_p_target(mass, p.top_p_units);
        kept = mine && before < target_p;
    }
    const kiln_u32 kw = kept && w >= p.min_weight ? w : 0u;
    kiln_u32* kept_weight = reinterpret_cast<kiln_u32*>(sh.cand);  // the candidates are no longer read
    kiln_u32* kept_index = kept_weight + TKB_KMAX;
    const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)e;
    if (mine) {
        kept_weight[j] = kw;
        kept_index[j] = index;
    }
    if (threadIdx.x == 0) tokens[r] = NO_TOKEN;  // before the barrier: the winner writes after it
    kiln_u64 kept_mass;
    tkb_scan((kiln_u64)kw, sh.kept_sums, kept_mass);  // its barrier publishes kept_*
    const kiln_u64 draw = __umul64hi(u, kept_mass);  // < kept_mass: the first token is kept
    // The draw in index order: the token whose inclusive kept mass over the tokens of lower or
    // equal index passes the target; gw threads sum a token's.
    int gw = 1;
    while (gw < 32 && 2 * gw * kk <= THREADS) gw <<= 1;
    for (int base = 0; base < kk; base += THREADS / gw) {
        const int jj = base + (int)threadIdx.x / gw, part = (int)threadIdx.x & (gw - 1);
        const kiln_u32 own_index = jj < kk ? kept_index[jj] : 0u;
        const kiln_u32 own_weight = jj < kk ? kept_weight[jj] : 0u;
        kiln_u64 inclusive = 0ull;
        if (own_weight != 0u) {
#pragma unroll 4
            for (int i = part; i < kk; i += gw) inclusive += kept_index[i] <= own_index ? (kiln_u64)kept_weight[i] : 0ull;
        }
        for (int o = gw >> 1; o > 0; o >>= 1) inclusive += __shfl_xor_sync(KILN_FULL_MASK, inclusive, o);
        if (part == 0 && own_weight != 0u && inclusive - own_weight <= draw && draw < inclusive) {
            tokens[r] = own_index;
        }
    }
}

// The last block of served row r: the top-k from the group maxima, then the token. Returns
// TKB_FALLBACK when the candidates overflow the buffers (the caller samples the row on the
// single-block path), else 0.
__device__ __forceinline__ int sample_row_topk_bound(int r, kiln_u32 k, const float* __restrict__ row,
                                                     long long vocab, const KilnSampleParams& p, kiln_u64 step,
                                                     kiln_u32* __restrict__ tokens, const kiln_u32* row_maxima,
                                                     int groups, TopKBoundShared& sh, kiln_u64* profile) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool row0 = r == 0;
    kiln_u32 g[TKB_GROUP_PER];
#pragma unroll
    for (int q = 0; q < TKB_GROUP_PER; ++q) {
        const int i = q * THREADS + (int)threadIdx.x;
        g[q] = i < groups ? __ldcg(&row_maxima[i]) : 0u;
    }
    // The draw's uniform does not depend on the logits: computed while the maxima load.
    const kiln_u64 u = sample_uniform(p.seed, step, p.stream);
    if (threadIdx.x == 0) {
        sh.ngroups = 0u;
        sh.ncand = 0u;
        sh.overflow = 0u;
    }
    // The row's largest key (0: every logit is NaN).
    kiln_u32 mine_max = 0u;
#pragma unroll
    for (int q = 0; q < TKB_GROUP_PER; ++q) mine_max = max(mine_max, g[q]);
    mine_max = __reduce_max_sync(KILN_FULL_MASK, mine_max);
    if (lane == 0) sh.warp_max[warp] = mine_max;
    __syncthreads();
    const kiln_u32 mkey = tkb_warps_max(sh.warp_max);
    TKB_CLOCK(17, row0);
    if (mkey == 0u) {  // every logit of the row is NaN
        TKB_SET(32, row0, 0);
        TKB_SET(33, row0, 0);
        if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return 0;
    }
    const float M = fused_value(mkey);

    // The bound: the group maxima by their distance below the row maximum (the bins of
    // `fused_dbin`: a lower bin holds only larger keys). The candidate groups are those of the
    // bins up to the bin cb at which the count reaches k (at least k groups: k distinct tokens);
    // every token of the row's top-k lies in a bin up to cb (a bin is monotone in the key), and
    // so in a candidate group. Each thread packs its groups' bins four to a word of shared memory
    // (byte q % 4 of word q / 4; 255 for no group, and for a group in the last bin, which no
    // count below it includes) and
    // cb is found by a binary search over the bins, each step one count of the groups in a bin up
    // to the middle (a warp-wide sum, one barrier), instead of a histogram (contended atomics).
    // A crowded bin cb (more than TKB_SLACK groups) is split by 8-bit radix passes over the keys
    // of its groups: the bound is then the lowest key with the chosen prefix, and the candidates
    // those in a bin up to cb and at or above it.
    kiln_u32(*packed)[THREADS] = sh.packed;  // packed[q / 4][thread]: byte q % 4 is group q's bin
    kiln_u32 nvalid = 0u;
#pragma unroll
    for (int w4 = 0; w4 < TKB_GROUP_PER / 4; ++w4) {
        kiln_u32 word = 0xFFFFFFFFu;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int q = 4 * w4 + t;
            if (q * THREADS < groups && g[q] != 0u) {
                word = (word & ~(0xFFu << (8 * t))) | ((kiln_u32)tkb_bin(g[q], M) << (8 * t));
                ++nvalid;
            }
        }
        packed[w4][threadIdx.x] = word;
    }
    // The number of this thread's groups in a bin up to b (b < 255).
    auto count_upto = [&](int b) {
        kiln_u32 c = 0u;
#pragma unroll
        for (int w4 = 0; w4 < TKB_GROUP_PER / 4; ++w4) {
            if (4 * w4 * THREADS >= groups) break;  // the same for the whole block
            const kiln_u32 word = packed[w4][threadIdx.x];  // 255 past the row's groups
#pragma unroll
            for (int t = 0; t < 4; ++t) c += ((word >> (8 * t)) & 0xFFu) <= (kiln_u32)b ? 1u : 0u;
        }
        return c;
    };
    // Binary search for cb, the first bin whose inclusive count reaches k: the count up to bin
    // lo - 1 is below k (below_lo) and that up to hi reaches it (upto_hi); the first step also
    // sums the valid groups (the high half of the packed sums: at most 8192 groups a row).
    kiln_u32 valid = 0u;
    int lo = 0, hi = FUSED_BINS - 1;
    kiln_u32 below_lo = 0u, upto_hi = 0u;
    for (int step_i = 0;; ++step_i) {
        const int mid = (lo + hi) >> 1;  // < hi <= 255
        kiln_u32 mine = count_upto(mid) | (step_i == 0 ? nvalid << 16 : 0u);
        mine = __reduce_add_sync(KILN_FULL_MASK, mine);
        if (lane == 0) sh.warp_counts[step_i & 1][warp] = mine;
        __syncthreads();  // the other parity's counts are read before the next barrier
        const kiln_u32 total = tkb_warps_sum(sh.warp_counts[step_i & 1]);
        if (step_i == 0) {
            valid = total >> 16;
            upto_hi = valid;
            if (valid < k) break;  // every valid token
        }
        const kiln_u32 c = total & 0xFFFFu;
        if (c >= k) {
            hi = mid;
            upto_hi = c;
        } else {
            lo = mid + 1;
            below_lo = c;
        }
        if (lo >= hi) break;  // the same for the whole block
    }
    TKB_SET(32, row0, valid);
    kiln_u32 bound = 1u;  // candidates: keys at or above it, in bins up to cb_limit
    int cb_limit = FUSED_BINS - 1;
    int passes = 0;
    if (valid >= k) {  // else fewer valid groups than k: every valid token
        const int cb = lo;
        kiln_u32 target = k - below_lo;
        const bool crowded = upto_hi - below_lo > TKB_SLACK;
        cb_limit = cb;
        if (crowded) {
            // Within bin cb (the bins below it hold larger keys than any of cb): at least k
            // groups lie in a bin below cb or in cb at or above the prefix.
            kiln_u32 prefix = 0u, mask = 0u;
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int b = threadIdx.x; b < 256; b += THREADS) sh.bins[b] = 0u;
                __syncthreads();
#pragma unroll
                for (int q = 0; q < TKB_GROUP_PER; ++q) {
                    if (q * THREADS >= groups) break;
                    const int bq = (int)((packed[q >> 2][threadIdx.x] >> (8 * (q & 3))) & 0xFFu);
                    const bool in = g[q] != 0u && (g[q] & mask) == prefix && bq == cb;
                    fused_count(sh.bins, in ? (int)((g[q] >> shift) & 0xFFu) : -1);
                }
                __syncthreads();
                tkb_pick(sh, target, true);
                prefix |= sh.chosen << shift;
                mask |= 0xFFu << shift;
                target -= sh.above;
                const bool enough = sh.count <= TKB_SLACK;
                __syncthreads();  // sh.chosen, sh.above, sh.count are read before reuse
                ++passes;
                if (enough) break;
            }
            bound = prefix > 1u ? prefix : 1u;
        }
    }
    TKB_SET(39, row0, passes);
    TKB_CLOCK(18, row0);

    // Each warp lists its own candidate groups (no barrier) and gathers their tokens at or above
    // the bound, a lane a logit, TKB_GATHER groups in flight.
    int nw = 0;
#pragma unroll
    for (int q = 0; q < TKB_GROUP_PER; ++q) {
        if (q * THREADS >= groups) break;
        const int bq = (int)((packed[q >> 2][threadIdx.x] >> (8 * (q & 3))) & 0xFFu);
        const bool take = g[q] != 0u && g[q] >= bound && bq <= cb_limit;
        const kiln_u32 mask = __ballot_sync(KILN_FULL_MASK, take);
        const int at = nw + __popc(mask & ((1u << lane) - 1u));
        if (take && at < TKB_WARP_GROUPS) sh.wgroups[warp][at] = (kiln_u32)(q * THREADS + (int)threadIdx.x);
        nw += __popc(mask);
    }
    __syncwarp();
    TKB_CLOCK(19, row0);
    if (lane == 0 && nw > 0) {
        atomicAdd(&sh.ngroups, (kiln_u32)nw);
        if (nw > TKB_WARP_GROUPS) sh.overflow = 1u;
    }
    const int listed = min(nw, TKB_WARP_GROUPS);
    for (int base = 0; base < listed; base += TKB_GATHER) {
        float x[TKB_GATHER];
        int idx[TKB_GATHER];  // the row's groups are at most TKB_GROUP_PER * THREADS (launcher)
        // Every load of the round is issued before any is used.
#pragma unroll
        for (int t = 0; t < TKB_GATHER; ++t) {
            const bool has = base + t < listed;
            const long long i =
                has ? 32ll * (long long)sh.wgroups[warp][min(base + t, TKB_WARP_GROUPS - 1)] + lane : vocab;
            idx[t] = i < vocab ? (int)i : -1;
            x[t] = i < vocab ? __ldcg(&row[i]) : 0.0f;
        }
        // The round's candidates take their slots with one atomic a warp: the lane's takes as
        // bits, the warp's count of each group's before it.
        kiln_u32 takes = 0u;
        kiln_u32 warp_total = 0u;
#pragma unroll
        for (int t = 0; t < TKB_GATHER; ++t) {
            const kiln_u32 key = idx[t] >= 0 ? sample_order_key(x[t]) : 0u;
            const bool take = key != 0u && key >= bound && fused_dbin(x[t], M) <= cb_limit;
            takes |= take ? 1u << t : 0u;
            warp_total += (kiln_u32)__popc(__ballot_sync(KILN_FULL_MASK, take));
        }
        if (warp_total == 0u) continue;  // the same for the whole warp
        kiln_u32 at = 0u;
        if (lane == 0) at = atomicAdd(&sh.ncand, warp_total);
        at = __shfl_sync(KILN_FULL_MASK, at, 0);
#pragma unroll
        for (int t = 0; t < TKB_GATHER; ++t) {
            const bool take = ((takes >> t) & 1u) != 0u;
            const kiln_u32 mask = __ballot_sync(KILN_FULL_MASK, take);
            const kiln_u32 slot = at + (kiln_u32)__popc(mask & ((1u << lane) - 1u));
            if (take && slot < TKB_CAND_CAP) sh.cand[slot] = fast_pack(sample_order_key(x[t]), (kiln_u32)idx[t]);
            at += (kiln_u32)__popc(mask);
        }
    }
    __syncthreads();
    const int m_n = (int)sh.ncand;
    TKB_CLOCK(20, row0);
    TKB_SET(33, row0, sh.ngroups);
    TKB_SET(34, row0, m_n);
    if (sh.overflow != 0u || m_n > TKB_CAND_CAP) return TKB_FALLBACK;
    tkb_rank_finish(r, k, m_n, p, u, tokens, sh, profile);
    return 0;
}

// The finish of tkb_rank_finish for at most THREADS candidates whose weights are in
// sh.hist.weights, with two barriers instead of three and no top-k array: g threads a candidate
// count the candidates before it in the order (its rank) and sum their weights (its mass before
// it: they all lie in the top-k when it does), so the top-k's mass is that of rank kk - 1 plus its
// weight; then top-p, min-p and the draw in index order as there.
__device__ __forceinline__ void tkb_finish_few(int r, kiln_u32 k, int m_n, const KilnSampleParams& p, kiln_u64 u,
                                               kiln_u32* __restrict__ tokens, TopKBoundShared& sh,
                                               kiln_u64* profile) {
    const bool row0 = r == 0;
    const int kk = min((int)k, m_n);
    int g = 1;
    while (g < 32 && 2 * g * m_n <= THREADS) g <<= 1;
    const int j = (int)threadIdx.x / g, part = (int)threadIdx.x & (g - 1);
    const bool has = j < m_n;
    const kiln_u64 e = has ? sh.cand[j] : ~0ull;  // ~0: above every candidate, counts nothing
    const bool weigh = k > 1u;
    kiln_u32 rank = 0u;
    kiln_u64 before = 0ull;
#pragma unroll 4
    for (int i = part; i < m_n; i += g) {
        const bool above = sh.cand[i] > e;
        rank += above ? 1u : 0u;
        if (weigh) before += above ? (kiln_u64)sh.hist.weights[i] : 0ull;
    }
    for (int o = g >> 1; o > 0; o >>= 1) {
        rank += __shfl_xor_sync(KILN_FULL_MASK, rank, o);
        before += __shfl_xor_sync(KILN_FULL_MASK, before, o);
    }
    TKB_CLOCK(21, row0);
    const bool lead = has && part == 0;
    const kiln_u32 index = 0xFFFFFFFFu - (kiln_u32)e;
    if (k == 1u) {  // greedy, or top-k 1: the first of the order
        if (lead && rank == 0u) tokens[r] = index;
        return;
    }
    const kiln_u32 w = lead ? sh.hist.weights[j] : 0u;
    if (lead && (int)rank == kk - 1) sh.mass = before + w;  // exactly one candidate
    if (threadIdx.x == 0) tokens[r] = NO_TOKEN;  // before the barriers: the winner writes after them
    __syncthreads();
    const kiln_u64 mass = sh.mass;
    bool kept = lead && (int)rank < kk;
    if (p.top_p_units < (1u << 24)) {
        const kiln_u64 target_p = sample_top_p_target(mass, p.top_p_units);
        kept = kept && before < target_p;
    }
    const kiln_u32 kw = kept && w >= p.min_weight ? w : 0u;
    kiln_u32* kept_weight = reinterpret_cast<kiln_u32*>(sh.top);  // THREADS u32 each
    kiln_u32* kept_index = kept_weight + THREADS;
    if (lead) {
        kept_weight[j] = kw;
        kept_index[j] = index;
    }
    kiln_u64 kept_mass;
    tkb_scan((kiln_u64)kw, sh.kept_sums, kept_mass);  // its barrier publishes kept_*
    const kiln_u64 draw = __umul64hi(u, kept_mass);  // < kept_mass: the first token is kept
    // The draw in index order: the candidate whose inclusive kept mass over the candidates of
    // lower or equal index passes the target (the others' kept weights are 0).
    const kiln_u32 own_weight = has ? kept_weight[j] : 0u;
    kiln_u64 inclusive = 0ull;
    if (own_weight != 0u) {
#pragma unroll 4
        for (int i = part; i < m_n; i += g) inclusive += kept_index[i] <= index ? (kiln_u64)kept_weight[i] : 0ull;
    }
    for (int o = g >> 1; o > 0; o >>= 1) inclusive += __shfl_xor_sync(KILN_FULL_MASK, inclusive, o);
    if (lead && own_weight != 0u && inclusive - own_weight <= draw && draw < inclusive) tokens[r] = index;
}

// ---- TKB_HEADS > 0: the bound from the slices' own lists (`SamplePath::TopKHeads`) ----------
//
// The same kernel, with the serial search of the row's last block moved into the slice blocks:
//   1. Block (s, r) also lists its slice's TKB_HEADS largest tokens in the order, as packed
//      (key, ~index) u64 (0 past its valid tokens): the tokens whose key reaches the
//      TKB_HEADS-th largest of the warps' maxima, ranked among themselves (tkb_write_heads).
//      The group maxima are written too (for the fallback).
//   2. The row's last block reads every list (slices * TKB_HEADS <= TKB_HEAD_CAP entries, a few a
//      thread, one round trip to L2), takes their maximum M (the row's), bins them by the
//      distance below M (`fused_dbin`) and picks cb, the first bin at which the count reaches k
//      (one warp, one barrier; every bin when the lists hold fewer than k tokens). The listed
//      tokens are distinct, so at least k tokens of the row lie in bins up to cb, and every token
//      of the row's top-k lies in a bin up to cb (the bins are monotone in the key). Every such
//      token of a slice is in its list unless the list is full and its last entry lies in a bin
//      up to cb (the list is the slice's largest: an unlisted token is at most its last entry);
//      such a saturated list sends the row to the bound path of the group maxima
//      (TKB_SATURATED). Otherwise the listed tokens in bins up to cb are the candidates, already
//      in shared memory with their weights: ranked and finished as tkb_finish_few (or
//      tkb_rank_finish past THREADS candidates). No gather from the logits, no search loop.
// The candidates hold the row's top-k and the finish is the bound path's, so the token is the
// reference's. Profile slots as the bound path's, with block (0, 0)'s (9, 10) its heads, the last
// block's 17 (lists loaded, M), 18 (bins, cb), 20 (candidates written), 21 (ranked); counts:
// listed tokens (32), candidates (34), saturated (40: the bound path's counts follow).

#if TKB_HEADS
static_assert(TKB_HEADS <= 32 && (SAMPLE_WARPS * TKB_HEADS) % 32 == 0, "the warps' lists in whole lanes");
static_assert(SAMPLE_WARPS * TKB_HEADS <= TKB_CAND_CAP, "the warps' lists fit in `cand`");
// The warp's TKB_HEADS largest tokens of its lanes' keys key[0, count) (key[u]: index
// lo + u * THREADS + threadIdx.x, 0 for none; count the same for the whole warp) into
// dst[0, TKB_HEADS) in the order, as packed (key, ~index) (0 past the last); returns how many it
// wrote that are not 0 (the same for the whole warp). Each lane keeps its own largest (the lowest
// u on a tie: the lowest index); a round takes the warp's maximum key, its lane (the one holding
// it, or the lowest (u, lane) on a tie, found only then) writes the entry and finds its next
// largest. Taken keys are zeroed.
template <int N>
__device__ __forceinline__ int tkb_warp_heads(kiln_u32 (&key)[N], int count, long long lo, kiln_u64* dst) {
    const int lane = threadIdx.x & 31;
    kiln_u32 bk = 0u;
    int bu = 0;
#pragma unroll
    for (int u = 0; u < N; ++u) {
        if (u >= count) break;
        if (key[u] > bk) {
            bk = key[u];
            bu = u;
        }
    }
#pragma unroll 1
    for (int h = 0; h < TKB_HEADS; ++h) {
        const kiln_u32 hk = __reduce_max_sync(KILN_FULL_MASK, bk);
        if (hk == 0u) {  // the same for the whole warp: the rest of the list is empty
            if (lane >= h && lane < TKB_HEADS) dst[lane] = 0ull;
            return h;
        }
        const kiln_u32 tied = __ballot_sync(KILN_FULL_MASK, bk == hk);
        int winner = __ffs((int)tied) - 1;
        if ((tied & (tied - 1u)) != 0u) {  // several lanes hold the key: the lowest index
            winner = (int)(__reduce_min_sync(KILN_FULL_MASK, bk == hk ? (kiln_u32)(bu * 32 + lane) : 0xFFFFFFFFu) & 31u);
        }
        if (lane == winner) {
            dst[h] = fast_pack(hk, (kiln_u32)(lo + (long long)bu * THREADS + (int)threadIdx.x));
            const int taken = bu;
            bk = 0u;
            bu = 0;
#pragma unroll
            for (int u = 0; u < N; ++u) {
                if (u >= count) break;
                if (u == taken) key[u] = 0u;
                if (key[u] > bk) {
                    bk = key[u];
                    bu = u;
                }
            }
        }
    }
    return TKB_HEADS;
}

#define TKB_HEAD_PER ((TKB_HEAD_CAP + THREADS - 1) / THREADS)  // list entries a thread of the last block
#define TKB_RANKERS (32 / TKB_HEADS)  // threads that rank one entry of the warps' lists
static_assert(TKB_HEADS * TKB_RANKERS == 32, "TKB_HEADS divides the warp");

// Block (s, r)'s list (see above): its TKB_HEADS largest tokens into `out`, from this thread's
// order keys (key[u]: index lo + u * THREADS + threadIdx.x, 0 for none).
//   1. T, the TKB_HEADS-th largest of the warps' maximum keys: at least TKB_HEADS tokens of the
//      slice have a key >= T (those maxima), so every token of the list has one too.
//   2. The tokens with a key >= T (not 0) are the candidates, compacted into `sh.cand` (a dozen
//      or so for distinct logits).
//   3. Each candidate is ranked among them (the count of those above it in the order: packed
//      (key, ~index) are distinct), and the one of rank h below TKB_HEADS is the list's h-th.
// More than TKB_LIST_CAP candidates (ties at T) take the rounds instead: each warp lists its
// own TKB_HEADS largest (tkb_warp_heads) and every entry of those lists is ranked among them.
#define TKB_LIST_CAP 256
static_assert(SAMPLE_WARPS >= TKB_HEADS && SAMPLE_WARPS <= 32, "a warp maximum of rank TKB_HEADS - 1 exists");
__device__ __forceinline__ void tkb_write_heads(const kiln_u32 (&key)[TKB_PER], long long lo, long long slice_len,
                                                kiln_u64* out, TopKBoundShared& sh, bool first, kiln_u64* profile) {
    (void)profile;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int count = (int)((slice_len + THREADS - 1) / THREADS);
    kiln_u32 own = 0u;
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) {
        if (u >= count) break;
        own = max(own, key[u]);
    }
    own = __reduce_max_sync(KILN_FULL_MASK, own);
    if (lane == 0) sh.warp_max[warp] = own;
    if (threadIdx.x == 0) sh.ncand = 0u;
    __syncthreads();
    // Every warp finds T itself: lane w ranks warp w's maximum (ties in warp order).
    const kiln_u32 wm = lane < SAMPLE_WARPS ? sh.warp_max[lane] : 0u;
    int rank = 0;
#pragma unroll
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const kiln_u32 o = sh.warp_max[w];
        rank += (o > wm || (o == wm && w < lane)) ? 1 : 0;
    }
    const kiln_u32 at_rank = __ballot_sync(KILN_FULL_MASK, lane < SAMPLE_WARPS && rank == TKB_HEADS - 1);
    const kiln_u32 T = __shfl_sync(KILN_FULL_MASK, wm, __ffs((int)at_rank) - 1);  // one lane has that rank
    const kiln_u32 lanes_before = (1u << lane) - 1u;
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) {
        if (u >= count) break;
        const bool take = key[u] != 0u && key[u] >= T;
        const kiln_u32 mask = __ballot_sync(KILN_FULL_MASK, take);
        if (mask == 0u) continue;  // the same for the whole warp
        kiln_u32 at = 0u;
        if (lane == 0) at = atomicAdd(&sh.ncand, (kiln_u32)__popc(mask));
        at = __shfl_sync(KILN_FULL_MASK, at, 0) + (kiln_u32)__popc(mask & lanes_before);
        if (take && at < TKB_LIST_CAP) sh.cand[at] = fast_pack(key[u], (kiln_u32)(lo + u * THREADS + (int)threadIdx.x));
    }
    TKB_CLOCK(12, first);
    __syncthreads();
    const int c = (int)sh.ncand;
    TKB_CLOCK(13, first);
    if (c <= TKB_LIST_CAP) {
        for (int e = threadIdx.x; e < c; e += THREADS) {
            const kiln_u64 mine = sh.cand[e];
            int above = 0;
#pragma unroll 4
            for (int j = 0; j < c; ++j) above += sh.cand[j] > mine ? 1 : 0;
            if (above < TKB_HEADS) out[above] = mine;
        }
        if ((int)threadIdx.x < TKB_HEADS && (int)threadIdx.x >= c) out[threadIdx.x] = 0ull;
        TKB_CLOCK(14, first);
        return;
    }
    // Ties at T: the rounds (the candidates in `sh.cand` are not read again).
    kiln_u32 v[TKB_PER];
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) v[u] = key[u];
    const int found = tkb_warp_heads(v, count, lo, &sh.cand[warp * TKB_HEADS]);
    // The listed entries that are not 0 (the block's list holds as many, up to TKB_HEADS).
    const int listed = __syncthreads_count(lane < found);
    constexpr int ENTRIES = SAMPLE_WARPS * TKB_HEADS;
    constexpr int EACH = ENTRIES / TKB_RANKERS;  // entries each ranker compares against
    const int entry = (int)threadIdx.x / TKB_RANKERS, part = (int)threadIdx.x % TKB_RANKERS;
    const kiln_u64 mine = sh.cand[entry];
    int above = 0;
#pragma unroll
    for (int j = 0; j < EACH; ++j) above += sh.cand[j * TKB_RANKERS + part] > mine ? 1 : 0;
#pragma unroll
    for (int o = 1; o < TKB_RANKERS; o <<= 1) above += __shfl_xor_sync(KILN_FULL_MASK, above, o);
    if (part == 0 && mine != 0ull && above < TKB_HEADS) out[above] = mine;
    if ((int)threadIdx.x < TKB_HEADS && (int)threadIdx.x >= listed) out[threadIdx.x] = 0ull;
    TKB_CLOCK(14, first);
}

// The last block of served row r on the heads path (see above): 0 when the token is written,
// TKB_SATURATED when a list is saturated (the caller runs the bound path after a barrier).
// `slices` * TKB_HEADS <= TKB_HEAD_CAP (the caller's check).
__device__ __forceinline__ int sample_row_topk_heads(int r, kiln_u32 k, const KilnSampleParams& p, kiln_u64 step,
                                                     kiln_u32* __restrict__ tokens, const kiln_u64* row_heads,
                                                     int slices, TopKBoundShared& sh, kiln_u64* profile) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool row0 = r == 0;
    const int n = slices * TKB_HEADS;
    kiln_u64 e[TKB_HEAD_PER];
#pragma unroll
    for (int j = 0; j < TKB_HEAD_PER; ++j) {
        const int i = j * THREADS + (int)threadIdx.x;
        e[j] = i < n ? __ldcg(&row_heads[i]) : 0ull;
    }
    // The draw's uniform does not depend on the logits: computed while the lists load.
    const kiln_u64 u = sample_uniform(p.seed, step, p.stream);
    for (int b = threadIdx.x; b < FUSED_BINS; b += THREADS) sh.bins[b] = 0u;
    if (threadIdx.x == 0) sh.ncand = 0u;
    kiln_u32 mine_max = 0u;
#pragma unroll
    for (int j = 0; j < TKB_HEAD_PER; ++j) mine_max = max(mine_max, (kiln_u32)(e[j] >> 32));
    mine_max = __reduce_max_sync(KILN_FULL_MASK, mine_max);
    if (lane == 0) sh.warp_max[warp] = mine_max;
    __syncthreads();  // also publishes the zeroed bins and count
    const kiln_u32 mkey = tkb_warps_max(sh.warp_max);
    TKB_CLOCK(17, row0);
    if (mkey == 0u) {  // every logit of the row is NaN
        TKB_SET(32, row0, 0);
        if (threadIdx.x == 0) tokens[r] = NO_TOKEN;
        return 0;
    }
    const float M = fused_value(mkey);
#pragma unroll
    for (int j = 0; j < TKB_HEAD_PER; ++j) {
        const kiln_u32 key = (kiln_u32)(e[j] >> 32);
        fused_count(sh.bins, key != 0u ? tkb_bin(key, M) : -1);
    }
    __syncthreads();
    tkb_pick(sh, k, false);
    // Fewer listed tokens than k: every bin (then no list may be full, below).
    const int cb = sh.total >= k ? (int)sh.chosen : FUSED_BINS - 1;
    TKB_SET(32, row0, sh.total);
    TKB_CLOCK(18, row0);
    // The candidates (listed, in a bin up to cb) with their weights (k > 1: greedy rows need
    // none), one atomic a warp and entry; a full list whose last entry lies in a bin up to cb
    // is saturated.
    const bool weigh = k > 1u;
    const float m = weigh ? fminf(fmaxf(M / p.temperature, -3.40282347e38f), 3.40282347e38f) : 0.0f;
    const kiln_u32 lanes_before = (1u << lane) - 1u;
    bool saturated = false;
#pragma unroll
    for (int j = 0; j < TKB_HEAD_PER; ++j) {
        const int i = j * THREADS + (int)threadIdx.x;
        const kiln_u32 key = (kiln_u32)(e[j] >> 32);
        const bool take = key != 0u && tkb_bin(key, M) <= cb;
        if (take && i % TKB_HEADS == TKB_HEADS - 1) saturated = true;
        const kiln_u32 mask = __ballot_sync(KILN_FULL_MASK, take);
        if (mask == 0u) continue;  // the same for the whole warp
        kiln_u32 at = 0u;
        if (lane == 0) at = atomicAdd(&sh.ncand, (kiln_u32)__popc(mask));
        at = __shfl_sync(KILN_FULL_MASK, at, 0) + (kiln_u32)__popc(mask & lanes_before);
        if (take) {  // at < n <= TKB_CAND_CAP
            sh.cand[at] = e[j];
            if (weigh && at < THREADS) sh.hist.weights[at] = sample_weight(fused_value(key), p.temperature, m);
        }
    }
    if (__syncthreads_or(saturated ? 1 : 0) != 0) return TKB_SATURATED;
    const int m_n = (int)sh.ncand;
    TKB_CLOCK(20, row0);
    TKB_SET(34, row0, m_n);
    if (m_n <= THREADS) {
        tkb_finish_few(r, k, m_n, p, u, tokens, sh, profile);
    } else {
        tkb_rank_finish(r, k, m_n, p, u, tokens, sh, profile);
    }
    return 0;
}
#endif  // TKB_HEADS

// The fences around the row's ticket: a block's maxima are published (release) before its
// ticket and read (acquire) after the last one.
__device__ __forceinline__ void tkb_fence() {
    __threadfence();
}

// One launch: grid (slices, rows), `slice_len` logits a block (a multiple of 32, at most
// TKB_PER * THREADS; the launcher keeps ceil(vocab / 32) <= TKB_GROUP_PER * THREADS and
// slices * slice_len / 32 <= `group_stride`). `maxima` holds `group_stride` u32 a row,
// `tickets` one u32 a row (zero on entry, left zero); `heads` (TKB_HEADS > 0 only)
// `heads_stride` u64 a row: a grid whose lists do not fit takes the bound path; `profile` is
// read only with SAMPLE_PROFILE=1.
extern "C" __global__ void __launch_bounds__(THREADS, TKB_MIN_BLOCKS)
kiln_sample_topk_bound(const float* __restrict__ logits, long long vocab, long long row_stride,
                       const KilnSampleParams* __restrict__ params, const kiln_u64* __restrict__ steps,
                       const kiln_u32* __restrict__ history_offsets, const kiln_u32* __restrict__ history,
                       kiln_u32* __restrict__ counts, float* __restrict__ scratch, const kiln_u64* __restrict__ stats,
                       int stats_per_row, kiln_u32* __restrict__ tokens, kiln_u32* tickets, kiln_u32* maxima,
                       int group_stride, long long slice_len, kiln_u64* heads, int heads_stride,
                       kiln_u64* profile) {
    kiln_wait_prior();
    __shared__ TopKBoundShared sh;
#if SAMPLE_PROFILE
    if (profile != nullptr && threadIdx.x == 0) atomicMax(&profile[0], ~tkb_globaltimer());
#else
    (void)profile;
#endif
    const bool first = blockIdx.x == 0 && blockIdx.y == 0;
    TKB_CLOCK(8, first);
    const int r = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long lo = (long long)blockIdx.x * slice_len;
    const long long hi = lo + slice_len < vocab ? lo + slice_len : vocab;
    const int n = hi > lo ? (int)(hi - lo) : 0;  // <= TKB_PER * THREADS (launcher)
    const float* x = logits + (long long)r * row_stride + lo;
    // The slice's order keys (every load in flight), the parameters beside them; a row this
    // path does not serve wasted only its read.
    // Every load is issued before any is converted (a conversion beside its load in a branch
    // waits for that load before the next one is issued).
    float xs[TKB_PER];
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) {
        const int i = u * THREADS + (int)threadIdx.x;
        xs[u] = i < n ? __ldg(&x[i]) : 0.0f;
    }
    kiln_u32 key[TKB_PER];
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) {
        const int i = u * THREADS + (int)threadIdx.x;
        key[u] = i < n ? sample_order_key(xs[u]) : 0u;
    }
    const KilnSampleParams p = params[r];
    const kiln_u32 h0 = history_offsets[r], h1 = history_offsets[r + 1];
    const bool penalties = sample_penalized(p, counts, h0, h1);
    const bool greedy = p.temperature == 0.0f;
    const bool from_stats = greedy && stats != nullptr && !penalties;
    const bool served = !from_stats && !penalties && (greedy || (p.top_k >= 1u && p.top_k <= TKB_KMAX));
    if (!served) {
        if (blockIdx.x == 0) {
            sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts,
                              scratch, stats, stats_per_row, tokens);
        }
        return;
    }
    // The group maxima: group j of the slice is logits [32 j, 32 j + 32), the lanes of warp
    // j % SAMPLE_WARPS at step j / SAMPLE_WARPS; a group past the row's end has maximum 0.
    const int slice_groups = (int)(slice_len / 32);
    kiln_u32* out = maxima + (long long)r * group_stride + (long long)blockIdx.x * slice_groups;
#pragma unroll
    for (int u = 0; u < TKB_PER; ++u) {
        if (u * THREADS >= slice_len) break;  // the same for the whole block
        const kiln_u32 m = __reduce_max_sync(KILN_FULL_MASK, key[u]);
        const int j = u * SAMPLE_WARPS + warp;
        if (lane == 0 && j < slice_groups) out[j] = m;
    }
    TKB_CLOCK(9, first);
#if TKB_HEADS
    // The slice's list (the heads path), where every list of the row fits the stride and the
    // last block's reads (the same for the whole grid).
    const bool headed = (long long)gridDim.x * TKB_HEADS <= min(heads_stride, TKB_HEAD_CAP);
    if (headed) {
        tkb_write_heads(key, lo, slice_len, heads + (long long)r * heads_stride + (long long)blockIdx.x * TKB_HEADS,
                        sh, first, profile);
    }
#else
    (void)heads;
    (void)heads_stride;
#endif
    tkb_fence();
    __syncthreads();
    TKB_CLOCK(10, first);
    if (threadIdx.x == 0) {
        const kiln_u32 ticket = atomicAdd(&tickets[r], 1u);
        sh.last = ticket == gridDim.x - 1u;
        if (sh.last) tickets[r] = 0u;  // every block of the row has taken its ticket
#if SAMPLE_PROFILE
        if (profile != nullptr) atomicMax(&profile[1], tkb_globaltimer());
#endif
    }
    TKB_CLOCK(11, first);
    __syncthreads();
    if (!sh.last) return;
    tkb_fence();  // the other blocks' maxima, published before their tickets, are read after ours
    const bool row0 = r == 0;
    TKB_CLOCK(16, row0);
    TKB_SET(24, row0, tkb_globaltimer());
    const kiln_u32 k = greedy ? 1u : p.top_k;
    const kiln_u64 step = steps[r];  // read now: its latency hides behind the selection
    // Group g of the row is logits [32 g, 32 g + 32) (slices are whole groups); the groups past
    // the row's end hold no logit.
    const int groups = (int)((vocab + 31) / 32);  // <= TKB_GROUP_PER * THREADS (launcher)
    TKB_SET(35, row0, k);
    TKB_SET(37, row0, gridDim.x);
    TKB_SET(38, row0, slice_groups);
#if TKB_HEADS
    int fallback = TKB_SATURATED;
    if (headed) {
        fallback = sample_row_topk_heads(r, k, p, step, tokens, heads + (long long)r * heads_stride, (int)gridDim.x,
                                         sh, profile);
    }
    TKB_SET(40, row0, fallback == TKB_SATURATED ? 1 : 0);
    if (fallback == TKB_SATURATED) {
        __syncthreads();
        fallback = sample_row_topk_bound(r, k, logits + (long long)r * row_stride, vocab, p, step, tokens,
                                         maxima + (long long)r * group_stride, groups, sh, profile);
    }
#else
    const int fallback = sample_row_topk_bound(r, k, logits + (long long)r * row_stride, vocab, p, step, tokens,
                                               maxima + (long long)r * group_stride, groups, sh, profile);
#endif
    TKB_SET(36, row0, fallback);
    if (fallback == TKB_FALLBACK) {
        __syncthreads();
        sample_row_single(r, logits, vocab, row_stride, params, steps, history_offsets, history, counts, scratch,
                          stats, stats_per_row, tokens);
    }
    TKB_END(row0);
}
#endif  // TKB_PER * THREADS <= 8192 && TKB_GROUP_PER * THREADS <= 8192
