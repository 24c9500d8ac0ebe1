//! GPU tests of the attention kernels against the float64 CPU reference
//! (`kiln_core::ops::attention::paged_attention`): prefill over ragged batches, chunked prefill
//! after cached positions, and split decode (the streaming kernel and the tiled one), over GQA
//! ratios, head dims, page sizes and every kernel variant, on fresh random inputs (the seed is
//! printed), with outputs and scratch poisoned (NaN) before each launch and every element
//! checked; decode repeated, bit for bit; the K/V append byte for byte. Needs an NVIDIA GPU: `cargo test -p kiln-cuda --features gpu-tests --test
//! gpu_attention -- --test-threads 1`.

use kiln_core::ops::attention::{
    kv_fp8_cache, kv_fp8_row, paged_attention, AttentionSequence, AttentionShape,
};
use kiln_core::ops::primitives::{bf16_bits_to_f32, f32_to_bf16_bits};
use kiln_core::Error;
use kiln_cuda::ops::attention::{
    attention, cluster_combines, decode_splits, decode_stream_splits_for, kv_append, scratch_bytes,
    AttentionKernel, AttentionVariant, KvBuffers, KvScales, PagedBatch, DECODE_L2_HINT_ENV,
    HYBRID_STREAM_CHUNK, MAX_CLUSTER_SPLITS,
};
use kiln_cuda::{DeviceMemory, Gpu};

mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// bf16 values uniform in [-amplitude, amplitude).
    fn bf16(&mut self, len: usize, amplitude: f32) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
                bf16_bits_to_f32(f32_to_bf16_bits((2.0 * u - 1.0) * amplitude))
            })
            .collect()
    }
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes()).collect()
}

/// fp32 values as their bytes (the FP8 pages' scales).
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn upload(gpu: &Gpu, host: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(host.len().max(16)).expect("device allocation");
    memory.copy_from_host(0, host).expect("host to device copy");
    memory
}

fn poisoned(gpu: &Gpu, len: usize) -> DeviceMemory {
    let memory = gpu.alloc(len.max(16)).expect("device allocation");
    memory.fill_bytes(0xFF).expect("poison"); // bf16 and f32 NaN
    memory
}

/// One attention case: sequences given as (query tokens, context tokens).
struct Case {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    page_tokens: usize,
    sequences: Vec<(usize, usize)>,
    splits: Option<u32>,
    variant: AttentionVariant,
}

struct Inputs {
    shape: AttentionShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    pages: usize,
    tables: Vec<Vec<u32>>,
    /// FP8 pages: K and V codes and scales (`k` and `v` then hold the values they read back).
    fp8: Option<[(Vec<u8>, Vec<f32>); 2]>,
}

fn inputs(rng: &mut Rng, case: &Case) -> Inputs {
    let shape = AttentionShape {
        q_heads: case.q_heads,
        kv_heads: case.kv_heads,
        head_dim: case.head_dim,
        page_tokens: case.page_tokens,
        scale: 1.0 / (case.head_dim as f32).sqrt(),
    };
    let needed: usize = case.sequences.iter().map(|&(_, c)| c.div_ceil(case.page_tokens)).sum();
    let pages = needed + 3;
    // Pages handed out in a shuffled order, so no table is contiguous.
    let mut order: Vec<u32> = (0..pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut next = order.into_iter();
    let tables = case
        .sequences
        .iter()
        .map(|&(_, c)| (0..c.div_ceil(case.page_tokens)).map(|_| next.next().unwrap()).collect())
        .collect();
    let cache = pages * shape.kv_heads * shape.page_tokens * shape.head_dim;
    let total_q: usize = case.sequences.iter().map(|&(q, _)| q).sum();
    Inputs {
        shape,
        // Queries large enough that the softmax is far from uniform.
        q: rng.bf16(total_q * shape.q_heads * shape.head_dim, 3.0),
        k: rng.bf16(cache, 1.0),
        v: rng.bf16(cache, 1.0),
        pages,
        tables,
        fp8: None,
    }
}

/// `inputs` with FP8 pages: each K and V row quantized (`kv_fp8_cache`), the reference reading
/// back the FP8 values.
fn fp8_inputs(rng: &mut Rng, case: &Case) -> Inputs {
    let mut inputs = inputs(rng, case);
    let (k_codes, k_scales, k_back) = kv_fp8_cache(&inputs.k, case.head_dim).expect("fp8 k");
    let (v_codes, v_scales, v_back) = kv_fp8_cache(&inputs.v, case.head_dim).expect("fp8 v");
    inputs.k = k_back;
    inputs.v = v_back;
    inputs.fp8 = Some([(k_codes, k_scales), (v_codes, v_scales)]);
    inputs
}

/// Runs `case` on the GPU (twice when `twice`), returns the output bytes of each run.
fn run_gpu(gpu: &Gpu, case: &Case, inputs: &Inputs, runs: usize) -> Vec<Vec<u8>> {
    let sequences: Vec<AttentionSequence<'_>> = case
        .sequences
        .iter()
        .zip(&inputs.tables)
        .map(|(&(query_tokens, context_tokens), pages)| AttentionSequence {
            query_tokens,
            context_tokens,
            pages,
        })
        .collect();
    let batch = PagedBatch::upload(gpu, &inputs.shape, &sequences, inputs.pages).expect("batch upload");
    let q = upload(gpu, &bytes(&inputs.q));
    let (k, v, scales) = match &inputs.fp8 {
        Some([(k_codes, k_scales), (v_codes, v_scales)]) => (
            upload(gpu, k_codes),
            upload(gpu, v_codes),
            Some((upload(gpu, &f32_bytes(k_scales)), upload(gpu, &f32_bytes(v_scales)))),
        ),
        None => (upload(gpu, &bytes(&inputs.k)), upload(gpu, &bytes(&inputs.v)), None),
    };
    let scales = scales.as_ref().map(|(k, v)| KvScales { k, v });
    let cache = KvBuffers { k: &k, v: &v, pages: inputs.pages, scales };
    let splits = case.splits.unwrap_or_else(|| decode_splits(gpu, case.sequences.len(), case.kv_heads));
    let scratch = poisoned(gpu, scratch_bytes(&inputs.shape, batch.total_queries, splits));
    (0..runs)
        .map(|_| {
            let out = poisoned(gpu, inputs.q.len() * 2);
            attention(
                gpu,
                &inputs.shape,
                &batch,
                &q,
                cache,
                &out,
                Some(&scratch),
                splits,
                Some(case.variant),
            )
            .expect("attention launch");
            gpu.synchronize().expect("attention run");
            let mut host = out.to_host_bytes().expect("device to host copy");
            host.truncate(inputs.q.len() * 2);
            host
        })
        .collect()
}

/// Runs `case` and checks every element against the float64 reference; returns the output bytes.
fn check(gpu: &Gpu, rng: &mut Rng, case: &Case, runs: usize) -> Vec<Vec<u8>> {
    let inputs = inputs(rng, case);
    let want = reference(case, &inputs);
    check_on(gpu, case, &inputs, &want, runs)
}

/// The float64 reference of `case` on `inputs`.
fn reference(case: &Case, inputs: &Inputs) -> Vec<f64> {
    let sequences: Vec<AttentionSequence<'_>> = case
        .sequences
        .iter()
        .zip(&inputs.tables)
        .map(|(&(query_tokens, context_tokens), pages)| AttentionSequence {
            query_tokens,
            context_tokens,
            pages,
        })
        .collect();
    paged_attention(&inputs.shape, &inputs.q, &inputs.k, &inputs.v, &sequences).expect("reference")
}

/// Runs `case` on `inputs` and checks every element against `want`; returns the output bytes.
fn check_on(gpu: &Gpu, case: &Case, inputs: &Inputs, want: &[f64], runs: usize) -> Vec<Vec<u8>> {
    let outputs = run_gpu(gpu, case, inputs, runs);
    let label = format!(
        "q_heads {} kv_heads {} head_dim {} page {} sequences {:?} splits {:?} {:?}",
        case.q_heads,
        case.kv_heads,
        case.head_dim,
        case.page_tokens,
        case.sequences,
        case.splits,
        case.variant
    );
    for got in &outputs {
        let (mut error, mut norm, mut worst) = (0f64, 0f64, 0f64);
        for (i, (chunk, &w)) in got.chunks_exact(2).zip(want).enumerate() {
            let g = f64::from(bf16_bits_to_f32(u16::from_le_bytes([chunk[0], chunk[1]])));
            assert!(g.is_finite(), "{label}: element {i} is {g} (unwritten or NaN), want {w}");
            error += (g - w) * (g - w);
            norm += w * w;
            worst = worst.max((g - w).abs());
        }
        let relative = (error / norm.max(1e-300)).sqrt();
        println!("{label}: relative L2 error {relative:.2e}, worst element {worst:.2e}");
        assert!(relative < 1e-2, "{label}: relative L2 error {relative:.3e}");
        assert!(worst < 0.05, "{label}: an element is off by {worst:.3e}");
    }
    outputs
}

fn gpu() -> std::sync::Arc<Gpu> {
    Gpu::open(0).expect("a CUDA device (these tests need one)")
}

/// (q_heads, kv_heads): group sizes 1, 3, 4, 8 and 16.
const RATIOS: [(usize, usize); 5] = [(4, 4), (12, 4), (32, 8), (16, 2), (16, 1)];

#[test]
fn prefill_over_ragged_batches_matches_float64() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for head_dim in [64, 128] {
        for (i, &(q_heads, kv_heads)) in RATIOS.iter().enumerate() {
            let page_tokens = [1, 16, 64, 8, 128][i];
            let lengths: Vec<usize> = (0..1 + rng.below(4)).map(|_| 1 + rng.below(300)).collect();
            for variant in [AttentionVariant::PREFILL, AttentionVariant::PREFILL_WIDE] {
                let case = Case {
                    q_heads,
                    kv_heads,
                    head_dim,
                    page_tokens,
                    sequences: lengths.iter().map(|&n| (n, n)).collect(),
                    splits: Some(1),
                    variant,
                };
                check(&gpu, &mut rng, &case, 1);
            }
        }
    }
}

#[test]
fn chunked_prefill_after_cached_positions_matches_float64() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for head_dim in [64, 128] {
        for &(q_heads, kv_heads) in &RATIOS {
            let sequences: Vec<(usize, usize)> = (0..1 + rng.below(3))
                .map(|_| {
                    let chunk = 1 + rng.below(130);
                    (chunk, chunk + rng.below(700))
                })
                .collect();
            for splits in [1, 3] {
                let case = Case {
                    q_heads,
                    kv_heads,
                    head_dim,
                    page_tokens: 16,
                    sequences: sequences.clone(),
                    splits: Some(splits),
                    variant: AttentionVariant::PREFILL,
                };
                check(&gpu, &mut rng, &case, 1);
            }
        }
    }
}

#[test]
fn decode_matches_float64_and_repeats_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for head_dim in [64, 128] {
        for (i, &(q_heads, kv_heads)) in RATIOS.iter().enumerate() {
            let batch = [1, 3, 8, 5, 2][i];
            let sequences: Vec<(usize, usize)> = (0..batch).map(|_| (1, 1 + rng.below(3000))).collect();
            for (variant, splits) in [
                (AttentionVariant::DECODE, None),
                (AttentionVariant::DECODE, Some(1)),
                (AttentionVariant::DECODE, Some(7)),
                (AttentionVariant::DECODE, Some(64)),
                (AttentionVariant::DECODE_TILED, None),
                (AttentionVariant::DECODE_WIDE, Some(7)),
                (AttentionVariant::DECODE_DEEP, None),
                (AttentionVariant::DECODE_DEEP, Some(1)),
                (AttentionVariant::DECODE_WIDE_DEEP, Some(16)),
                (AttentionVariant::DECODE_HYBRID, None),
                (AttentionVariant::DECODE_HYBRID, Some(1)),
                (AttentionVariant::DECODE_HYBRID, Some(5)),
                (AttentionVariant::DECODE_STREAM_WIDE, Some(2)),
                (AttentionVariant::DECODE_STREAM_WIDE, Some(16)),
                (AttentionVariant::DECODE_STREAM_DEEP, Some(2)),
                (AttentionVariant::DECODE_STREAM_DEEP, Some(16)),
                (AttentionVariant::DECODE_ALT, Some(3)),
                (AttentionVariant::DECODE_ALT_WIDE, None),
                (AttentionVariant::DECODE_ALT_WIDE, Some(4)),
                (AttentionVariant::PREFILL, None),
            ] {
                let case = Case {
                    q_heads,
                    kv_heads,
                    head_dim,
                    page_tokens: [16, 64, 1, 32, 8][i],
                    sequences: sequences.clone(),
                    splits,
                    variant,
                };
                let outputs = check(&gpu, &mut rng, &case, 2);
                assert!(outputs[0] == outputs[1], "decode differs between two runs: {variant:?} {splits:?}");
            }
        }
    }
}

/// The streaming decode kernel at its edges: contexts shorter than a step, than the splits (splits
/// past the context take no ticket), one split holding the whole context (the output written
/// directly), long contexts through many pipeline turns; groups of 1 to 32 query heads (two row
/// tiles), sequences without a query beside ones with; three runs in a row (the ticket counters
/// must come back to zero), against the reference and bit for bit.
#[test]
fn streaming_decode_at_its_edges_matches_float64_and_repeats_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let contexts = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129, 1000, 4096];
    for head_dim in [64, 128] {
        for (i, &(q_heads, kv_heads, page_tokens)) in
            [(32, 8, 64), (32, 1, 16), (6, 6, 1), (16, 2, 8), (8, 1, 128)].iter().enumerate()
        {
            // Ragged: every listed context once (shuffled into batches of up to 5), plus a
            // sequence with no query (its rows are not written, the others must be right).
            let mut lengths: Vec<usize> = contexts.to_vec();
            lengths.push(1 + rng.below(6000));
            for j in (1..lengths.len()).rev() {
                lengths.swap(j, rng.below(j + 1));
            }
            for batch in lengths.chunks(5) {
                let mut sequences: Vec<(usize, usize)> = batch.iter().map(|&c| (1, c)).collect();
                if i % 2 == 0 {
                    sequences.insert(rng.below(sequences.len() + 1), (0, 1 + rng.below(300)));
                }
                // One set of inputs and its reference for every split count.
                let mut case = Case {
                    q_heads,
                    kv_heads,
                    head_dim,
                    page_tokens,
                    sequences: sequences.clone(),
                    splits: None,
                    variant: AttentionVariant::DECODE,
                };
                let inputs = inputs(&mut rng, &case);
                let want = reference(&case, &inputs);
                for splits in [None, Some(1), Some(2), Some(33), Some(64)] {
                    case.splits = splits;
                    let outputs = check_on(&gpu, &case, &inputs, &want, 3);
                    assert!(
                        outputs[0] == outputs[1] && outputs[1] == outputs[2],
                        "streaming decode differs between runs: {sequences:?} {splits:?}"
                    );
                }
            }
        }
    }
}

/// A long context through the streaming kernel's pipeline: hundreds of steps per warp unsplit,
/// and the default splits; against the reference, as are the tiled kernel's decode variants (one,
/// two and three tiles deep) on the same inputs.
#[test]
fn streaming_decode_over_a_long_context_matches_float64() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let mut case = Case {
        q_heads: 8,
        kv_heads: 2,
        head_dim: 128,
        page_tokens: 64,
        sequences: vec![(1, 30_000 + rng.below(3000))],
        splits: None,
        variant: AttentionVariant::DECODE,
    };
    let inputs = inputs(&mut rng, &case);
    let want = reference(&case, &inputs);
    for splits in [Some(1), None, Some(64)] {
        for variant in [
            AttentionVariant::DECODE,
            AttentionVariant::DECODE_TILED,
            AttentionVariant::DECODE_DEEP,
            AttentionVariant::DECODE_WIDE_DEEP,
            AttentionVariant::DECODE_HYBRID,
            AttentionVariant::DECODE_ALT,
            AttentionVariant::DECODE_ALT_WIDE,
        ] {
            (case.splits, case.variant) = (splits, variant);
            let outputs = check_on(&gpu, &case, &inputs, &want, 2);
            assert!(outputs[0] == outputs[1], "long decode differs between runs: {splits:?} {variant:?}");
        }
    }
}

/// The tiled kernel's decode variants (one row tile of 16 rows) combine their splits by
/// gathering every split's log-sums in shared memory first, then the partials 24 at a time: from
/// 2 to the launcher's most splits (1024 log-sums of 16 rows fill the stages), splits past the
/// context (no key: lse -inf), groups of 4, 16 and 32 query heads (two row tiles), and a sequence
/// of 3 query tokens beside the decode ones (rows whose causal limit leaves a split without a
/// key); three runs in a row, against the reference and bit for bit.
#[test]
fn tiled_decode_combine_over_many_splits_matches_float64_and_repeats_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for &(q_heads, kv_heads) in &[(32, 8), (16, 1), (32, 1)] {
        let mut sequences: Vec<(usize, usize)> = (0..3).map(|_| (1, 1 + rng.below(2500))).collect();
        sequences.insert(rng.below(sequences.len() + 1), (3, 3 + rng.below(700)));
        for variant in [
            AttentionVariant::DECODE_TILED,
            AttentionVariant::DECODE_WIDE,
            AttentionVariant::DECODE_DEEP,
            AttentionVariant::DECODE_WIDE_DEEP,
            AttentionVariant::DECODE_ALT,
            AttentionVariant::DECODE_ALT_WIDE,
        ] {
            let mut case = Case {
                q_heads,
                kv_heads,
                head_dim: 128,
                page_tokens: 16,
                sequences: sequences.clone(),
                splits: None,
                variant,
            };
            let inputs = inputs(&mut rng, &case);
            let want = reference(&case, &inputs);
            for splits in [2, 24, 25, 33, 300, 1024] {
                case.splits = Some(splits);
                let outputs = check_on(&gpu, &case, &inputs, &want, 3);
                assert!(
                    outputs[0] == outputs[1] && outputs[1] == outputs[2],
                    "tiled decode combine differs between runs: {sequences:?} {splits} {variant:?}"
                );
            }
        }
    }
}

/// The tiled kernel's split decode combined through a thread block cluster (2 to
/// MAX_CLUSTER_SPLITS splits and at most one block a multiprocessor: `cluster_combines`, the
/// default on sm_90) against the ticket combine: the same bits, both against the reference, over
/// GQA groups of 1 to 16 query heads, a sequence of 3 query tokens, contexts shorter than the
/// splits (splits that see no key) and a sequence without a query.
#[test]
fn tiled_decode_cluster_combine_gives_the_ticket_combines_bits() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    assert!(gpu.arch().0 < 90 || gpu.cluster_combine(), "the cluster combine is on by default on sm_90");
    let mut clustered = 0;
    for &(q_heads, kv_heads) in &[(32, 8), (16, 1), (8, 8), (12, 4)] {
        let mut sequences: Vec<(usize, usize)> = (0..2).map(|_| (1, 1 + rng.below(3000))).collect();
        sequences.push((1, 1 + rng.below(5)));
        sequences.insert(rng.below(sequences.len() + 1), (0, 1 + rng.below(300)));
        if q_heads / kv_heads <= 4 {
            sequences.insert(rng.below(sequences.len() + 1), (3, 3 + rng.below(700)));
        }
        let max_rows = sequences.iter().map(|&(q, _)| q).max().unwrap_or(0) * (q_heads / kv_heads);
        for variant in [
            AttentionVariant::DECODE_TILED,
            AttentionVariant::DECODE_WIDE,
            AttentionVariant::DECODE_DEEP,
            AttentionVariant::DECODE_WIDE_DEEP,
            AttentionVariant::DECODE_ALT_WIDE,
        ] {
            let mut case = Case {
                q_heads,
                kv_heads,
                head_dim: [64, 128][rng.below(2)],
                page_tokens: [16, 64][rng.below(2)],
                sequences: sequences.clone(),
                splits: None,
                variant,
            };
            let inputs = inputs(&mut rng, &case);
            let want = reference(&case, &inputs);
            for splits in 2..=MAX_CLUSTER_SPLITS {
                let blocks = sequences.len() * kv_heads * splits as usize;
                if !cluster_combines(&gpu, variant, max_rows.div_ceil(16), blocks, splits) {
                    continue;
                }
                clustered += 1;
                case.splits = Some(splits);
                let cluster = check_on(&gpu, &case, &inputs, &want, 2);
                gpu.set_cluster_combine(false);
                let ticket = check_on(&gpu, &case, &inputs, &want, 1);
                gpu.set_cluster_combine(true);
                assert!(
                    cluster[0] == cluster[1],
                    "cluster combine differs between runs: {splits} {variant:?}"
                );
                assert!(
                    cluster[0] == ticket[0],
                    "cluster and ticket combines differ: {sequences:?} {q_heads}/{kv_heads} {splits} {variant:?}"
                );
            }
        }
    }
    assert!(gpu.arch().0 < 90 || clustered >= 40, "only {clustered} cases took the cluster combine");
}

/// The hybrid decode kernel in one launch over sequences on both sides of its threshold (splits
/// of at most HYBRID_STREAM_CHUNK keys take the streaming path, longer ones the three-deep tiled
/// path), with a sequence without a query beside them: against the reference, three runs bit for
/// bit, and each sequence's rows the bits of the kernel whose path it took (the streaming
/// default's, or DECODE_DEEP's), at the same splits.
#[test]
fn hybrid_decode_takes_each_sequences_path_and_repeats_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let t = HYBRID_STREAM_CHUNK;
    for &(q_heads, kv_heads, head_dim, page_tokens) in &[(32, 8, 128, 64), (16, 2, 64, 16), (8, 1, 128, 32)] {
        for splits in [1u32, 3, 13] {
            let s = splits as usize;
            // Contexts whose splits hold exactly t keys, one more, a few, many; then shuffled.
            let mut contexts =
                [t * s, t * s + 1, 1 + rng.below(t * s), t * s + 1 + rng.below(2 * t * s), 1, 17];
            for j in (1..contexts.len()).rev() {
                contexts.swap(j, rng.below(j + 1));
            }
            let mut sequences: Vec<(usize, usize)> = contexts.iter().map(|&c| (1, c)).collect();
            sequences.insert(rng.below(sequences.len() + 1), (0, 1 + rng.below(200)));
            let mut case = Case {
                q_heads,
                kv_heads,
                head_dim,
                page_tokens,
                sequences: sequences.clone(),
                splits: Some(splits),
                variant: AttentionVariant::DECODE_HYBRID,
            };
            let inputs = inputs(&mut rng, &case);
            let want = reference(&case, &inputs);
            let hybrid = check_on(&gpu, &case, &inputs, &want, 3);
            assert!(
                hybrid[0] == hybrid[1] && hybrid[1] == hybrid[2],
                "hybrid decode differs between runs: {sequences:?} {splits}"
            );
            case.variant = AttentionVariant::DECODE;
            let streaming = check_on(&gpu, &case, &inputs, &want, 1);
            case.variant = AttentionVariant::DECODE_DEEP;
            let tiled = check_on(&gpu, &case, &inputs, &want, 1);
            let row_bytes = q_heads * head_dim * 2;
            let mut offset = 0;
            for &(query_tokens, context) in &sequences {
                let rows = offset..offset + query_tokens * row_bytes;
                offset = rows.end;
                let (path, name) = if context.div_ceil(s) <= t {
                    (&streaming[0], "streaming")
                } else {
                    (&tiled[0], "tiled")
                };
                assert!(
                    hybrid[0][rows.clone()] == path[rows],
                    "hybrid decode of a context of {context} over {splits} splits is not the {name} kernel's: \
                     {sequences:?}"
                );
            }
        }
    }
}

/// The streaming kernel compiled to read K/V under the default L2 policy
/// (`KILN_DECODE_L2_HINT=none`, a measurement knob) computes the same bits as the default
/// evict-first one, and both agree with the reference.
#[test]
fn streaming_decode_without_the_l2_hint_gives_the_same_bits() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let mut case = Case {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        page_tokens: 64,
        sequences: (0..3).map(|_| (1, 1 + rng.below(9000))).collect(),
        splits: None,
        variant: AttentionVariant::DECODE,
    };
    let inputs = inputs(&mut rng, &case);
    let want = reference(&case, &inputs);
    for splits in [None, Some(1), Some(64)] {
        case.splits = splits;
        let hinted = check_on(&gpu, &case, &inputs, &want, 1);
        std::env::set_var(DECODE_L2_HINT_ENV, "none");
        let plain = check_on(&gpu, &case, &inputs, &want, 1);
        std::env::remove_var(DECODE_L2_HINT_ENV);
        assert!(hinted[0] == plain[0], "the L2 hint changed the output: {:?} {splits:?}", case.sequences);
    }
}

/// The streaming kernel takes one query token a sequence and at most 64 splits; it says so
/// instead of running.
#[test]
fn streaming_decode_refuses_what_it_does_not_serve() {
    let gpu = gpu();
    assert_eq!(AttentionVariant::DECODE.kernel, AttentionKernel::Streaming);
    assert_eq!(AttentionVariant::default_for(1), AttentionVariant::DECODE);
    let shape = AttentionShape { q_heads: 8, kv_heads: 2, head_dim: 64, page_tokens: 16, scale: 0.125 };
    let pages: Vec<u32> = (0..4).collect();
    let q = gpu.alloc(2 * 8 * 64 * 2).expect("device allocation");
    let out = gpu.alloc(2 * 8 * 64 * 2).expect("device allocation");
    let cache_bytes = 4 * 2 * 16 * 64 * 2;
    let (k, v) = (gpu.alloc(cache_bytes).expect("k"), gpu.alloc(cache_bytes).expect("v"));
    let cache = KvBuffers { k: &k, v: &v, pages: 4, scales: None };
    let scratch = gpu.alloc(scratch_bytes(&shape, 2, 65)).expect("scratch");
    let prefill = [AttentionSequence { query_tokens: 2, context_tokens: 40, pages: &pages }];
    let prefill = PagedBatch::upload(&gpu, &shape, &prefill, 4).expect("batch upload");
    let decode = [AttentionSequence { query_tokens: 1, context_tokens: 40, pages: &pages }];
    let decode = PagedBatch::upload(&gpu, &shape, &decode, 4).expect("batch upload");
    for variant in
        [AttentionVariant::DECODE, AttentionVariant::DECODE_STREAM_WIDE, AttentionVariant::DECODE_STREAM_DEEP]
    {
        assert_eq!(variant.kernel, AttentionKernel::Streaming);
        let refused = attention(&gpu, &shape, &prefill, &q, cache, &out, Some(&scratch), 1, Some(variant));
        assert!(matches!(refused, Err(Error::NotServed { .. })), "{variant:?}: {refused:?}");
        let refused = attention(&gpu, &shape, &decode, &q, cache, &out, Some(&scratch), 65, Some(variant));
        assert!(matches!(refused, Err(Error::NotServed { .. })), "{variant:?}: {refused:?}");
        attention(&gpu, &shape, &decode, &q, cache, &out, Some(&scratch), 64, Some(variant))
            .expect("64 splits are served");
        gpu.synchronize().expect("attention run");
    }
}

/// The streaming kernel one block a multiprocessor (DECODE_STREAM_WIDE: 8 warps; DECODE_STREAM_DEEP:
/// six steps in flight a warp) at its edges: ragged batches of contexts shorter than a step, than
/// the splits (splits past the context take no ticket), one split holding the whole context, long
/// contexts through many pipeline turns; groups of 1 to 32 query heads (two row tiles), page sizes
/// 1 to 128, head dims 64 and 128, sequences without a query beside ones with; at their own splits
/// (`decode_stream_splits_for`), 1, 2, 33 and 64; three runs in a row (the ticket counters must
/// come back to zero), against the float64 reference and bit for bit.
#[test]
fn wide_and_deep_streaming_decode_at_their_edges_match_float64_and_repeat_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let multiprocessors = gpu.facts().multiprocessors;
    let contexts = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129, 1000, 4096];
    for variant in [AttentionVariant::DECODE_STREAM_WIDE, AttentionVariant::DECODE_STREAM_DEEP] {
        for head_dim in [64, 128] {
            for (i, &(q_heads, kv_heads, page_tokens)) in
                [(32, 8, 64), (32, 1, 16), (6, 6, 1), (16, 2, 8), (8, 1, 128)].iter().enumerate()
            {
                let mut lengths: Vec<usize> = contexts.to_vec();
                lengths.push(1 + rng.below(6000));
                for j in (1..lengths.len()).rev() {
                    lengths.swap(j, rng.below(j + 1));
                }
                for batch in lengths.chunks(5) {
                    let mut sequences: Vec<(usize, usize)> = batch.iter().map(|&c| (1, c)).collect();
                    if i % 2 == 0 {
                        sequences.insert(rng.below(sequences.len() + 1), (0, 1 + rng.below(300)));
                    }
                    let mut case = Case {
                        q_heads,
                        kv_heads,
                        head_dim,
                        page_tokens,
                        sequences: sequences.clone(),
                        splits: None,
                        variant,
                    };
                    let inputs = inputs(&mut rng, &case);
                    let want = reference(&case, &inputs);
                    let own = decode_stream_splits_for(multiprocessors, sequences.len(), kv_heads);
                    for splits in [own, 1, 2, 33, 64] {
                        case.splits = Some(splits);
                        let outputs = check_on(&gpu, &case, &inputs, &want, 3);
                        assert!(
                            outputs[0] == outputs[1] && outputs[1] == outputs[2],
                            "{variant:?} differs between runs: {sequences:?} {splits}"
                        );
                    }
                }
            }
        }
    }
}

/// The wide and deep streaming variants where they are meant to serve: a batch of 8 ragged long
/// contexts at GQA 32/8, head dim 128, page 64, at their own splits (2 on 132 multiprocessors) and
/// twice that, and one sequence of about 30k positions (hundreds of steps a warp unsplit, at 1,
/// their own and 64 splits); against the float64 reference, three runs bit for bit.
#[test]
fn wide_and_deep_streaming_decode_over_long_contexts_match_float64() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    let multiprocessors = gpu.facts().multiprocessors;
    let batch8: Vec<(usize, usize)> = (0..8).map(|_| (1, 3000 + rng.below(6000))).collect();
    let one = vec![(1, 30_000 + rng.below(3000))];
    for (q_heads, kv_heads, sequences) in [(32, 8, batch8), (8, 2, one)] {
        let mut case = Case {
            q_heads,
            kv_heads,
            head_dim: 128,
            page_tokens: 64,
            sequences: sequences.clone(),
            splits: None,
            variant: AttentionVariant::DECODE_STREAM_WIDE,
        };
        let inputs = inputs(&mut rng, &case);
        let want = reference(&case, &inputs);
        let own = decode_stream_splits_for(multiprocessors, sequences.len(), kv_heads);
        for splits in [own, 2 * own, 1, 64] {
            for variant in [AttentionVariant::DECODE_STREAM_WIDE, AttentionVariant::DECODE_STREAM_DEEP] {
                (case.splits, case.variant) = (Some(splits.min(64)), variant);
                let outputs = check_on(&gpu, &case, &inputs, &want, 3);
                assert!(
                    outputs[0] == outputs[1] && outputs[1] == outputs[2],
                    "{variant:?} differs between runs: {sequences:?} {splits}"
                );
            }
        }
    }
}

/// The combine of the splits runs in the attention launch (the last block of a group, by ticket
/// counters): from 2 to 300 splits over several row tiles, three runs in a row (the counters must
/// come back to zero), against the reference and bit for bit between runs.
#[test]
fn split_combine_in_the_launch_matches_float64_and_repeats_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for &(q_heads, kv_heads) in &[(32, 8), (12, 4)] {
        let sequences: Vec<(usize, usize)> = (0..1 + rng.below(3))
            .map(|_| {
                let chunk = 1 + rng.below(200);
                (chunk, chunk + rng.below(1500))
            })
            .collect();
        for splits in [2, 64, 300] {
            let case = Case {
                q_heads,
                kv_heads,
                head_dim: 64,
                page_tokens: 16,
                sequences: sequences.clone(),
                splits: Some(splits),
                variant: AttentionVariant::PREFILL_WIDE,
            };
            let outputs = check(&gpu, &mut rng, &case, 3);
            assert!(outputs[0] == outputs[1] && outputs[1] == outputs[2], "split prefill differs: {splits}");
        }
    }
}

/// FP8 E4M3 pages (one scale a row) through every tiled variant that reads them: prefill over a
/// ragged batch with a chunk after cached positions, and split decode (1 to 64 splits, the
/// cluster combine at 2 to 8 where the grid allows), against the float64 reference over the
/// values the FP8 rows read back, two runs bit for bit; the variants that read bf16 pages only
/// refuse FP8 pages by name.
#[test]
fn fp8_pages_match_float64_and_repeat_bit_for_bit() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for &(q_heads, kv_heads, head_dim, page_tokens) in &[(32, 8, 128, 64), (12, 4, 64, 16), (16, 1, 128, 32)]
    {
        let decode: Vec<(usize, usize)> = (0..3).map(|_| (1, 1 + rng.below(3000))).collect();
        let mut prefill: Vec<(usize, usize)> = vec![(1 + rng.below(300), 0), (1 + rng.below(200), 0)];
        prefill[1].1 = 150 + rng.below(400);
        let prefill: Vec<(usize, usize)> = prefill.into_iter().map(|(q, c)| (q, q + c)).collect();
        let mut cases = vec![
            (AttentionVariant::PREFILL, prefill.clone(), Some(1)),
            (AttentionVariant::DECODE_TILED, decode.clone(), None),
            (AttentionVariant::DECODE_TILED, decode.clone(), Some(2)),
            (AttentionVariant::DECODE_TILED, decode.clone(), Some(64)),
        ];
        if head_dim == 128 {
            cases.push((AttentionVariant::DECODE_DEEP, decode.clone(), Some(5)));
            cases.push((AttentionVariant::PREFILL_WIDE, prefill.clone(), Some(3)));
            cases.push((AttentionVariant::DECODE_WIDE, decode.clone(), Some(2)));
            cases.push((AttentionVariant::DECODE_WIDE, decode.clone(), Some(16)));
        }
        for (variant, sequences, splits) in cases {
            let case = Case { q_heads, kv_heads, head_dim, page_tokens, sequences, splits, variant };
            let inputs = fp8_inputs(&mut rng, &case);
            let want = reference(&case, &inputs);
            let outputs = check_on(&gpu, &case, &inputs, &want, 2);
            assert!(outputs[0] == outputs[1], "fp8 attention differs between runs: {variant:?} {splits:?}");
        }
    }
    // Variants without an FP8 path say so.
    let case = Case {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        page_tokens: 64,
        sequences: vec![(1, 100)],
        splits: Some(2),
        variant: AttentionVariant::DECODE,
    };
    let inputs = fp8_inputs(&mut rng, &case);
    let sequences = [AttentionSequence { query_tokens: 1, context_tokens: 100, pages: &inputs.tables[0] }];
    let batch = PagedBatch::upload(&gpu, &inputs.shape, &sequences, inputs.pages).expect("batch upload");
    let q = upload(&gpu, &bytes(&inputs.q));
    let Some([(k_codes, k_scales), (v_codes, v_scales)]) = &inputs.fp8 else { unreachable!() };
    let (k, v) = (upload(&gpu, k_codes), upload(&gpu, v_codes));
    let (ks, vs) = (upload(&gpu, &f32_bytes(k_scales)), upload(&gpu, &f32_bytes(v_scales)));
    let cache = KvBuffers { k: &k, v: &v, pages: inputs.pages, scales: Some(KvScales { k: &ks, v: &vs }) };
    let scratch = poisoned(&gpu, scratch_bytes(&inputs.shape, 1, 2));
    let out = poisoned(&gpu, inputs.q.len() * 2);
    for variant in
        [AttentionVariant::DECODE, AttentionVariant::DECODE_HYBRID, AttentionVariant::DECODE_ALT_WIDE]
    {
        let result =
            attention(&gpu, &inputs.shape, &batch, &q, cache, &out, Some(&scratch), 2, Some(variant));
        assert!(matches!(result, Err(Error::NotServed { .. })), "{variant:?} took FP8 pages: {result:?}");
    }
}

/// 1 to 40 distinct random slots of `limit`, in a random order.
fn distinct_slots(rng: &mut Rng, limit: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..limit as u32).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i + 1));
    }
    all.truncate(1 + rng.below(limit.min(40)));
    all
}

/// The FP8 append: each new token's K and V rows quantized at their slots, codes and scales
/// byte for byte the CPU's (`kv_fp8_row`, a zero row among them), every other row untouched.
#[test]
fn fp8_kv_append_writes_the_cpu_codes_and_scales_at_each_slot() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for (head_dim, kv_heads, page_tokens) in [(128, 8, 16), (64, 2, 1), (128, 1, 64)] {
        let shape = AttentionShape { q_heads: kv_heads, kv_heads, head_dim, page_tokens, scale: 1.0 };
        let pages = 9;
        let row = kv_heads * head_dim;
        let slots = &distinct_slots(&mut rng, pages * page_tokens)[..];
        let tokens = slots.len();
        let (mut k_new, v_new) = (rng.bf16(tokens * row, 40.0), rng.bf16(tokens * row, 0.01));
        k_new[..head_dim].iter_mut().for_each(|x| *x = 0.0);
        let rows = pages * page_tokens * kv_heads;
        let old_codes: Vec<u8> = (0..rows * head_dim).map(|_| rng.below(256) as u8).collect();
        let old_scales: Vec<f32> = rng.bf16(rows, 1.0);
        let (dk, dv) = (upload(&gpu, &old_codes), upload(&gpu, &old_codes));
        let (sk, sv) = (upload(&gpu, &f32_bytes(&old_scales)), upload(&gpu, &f32_bytes(&old_scales)));
        let (nk, nv) = (upload(&gpu, &bytes(&k_new)), upload(&gpu, &bytes(&v_new)));
        let cache = KvBuffers { k: &dk, v: &dv, pages, scales: Some(KvScales { k: &sk, v: &sv }) };
        kv_append(&gpu, &shape, &nk, &nv, slots, cache).expect("kv_append");
        gpu.synchronize().expect("kv_append run");
        for (new, codes, scales) in [(&k_new, &dk, &sk), (&v_new, &dv, &sv)] {
            let (mut want_codes, mut want_scales) = (old_codes.clone(), old_scales.clone());
            for (t, &slot) in slots.iter().enumerate() {
                let (page, in_page) = (slot as usize / page_tokens, slot as usize % page_tokens);
                for h in 0..kv_heads {
                    let to = (page * kv_heads + h) * page_tokens + in_page;
                    let from = &new[(t * kv_heads + h) * head_dim..][..head_dim];
                    want_scales[to] =
                        kv_fp8_row(from, &mut want_codes[to * head_dim..][..head_dim]).expect("fp8 row");
                }
            }
            let got = codes.to_host_bytes().expect("device to host copy");
            assert!(
                got[..rows * head_dim] == want_codes[..],
                "fp8 codes {head_dim} {kv_heads} {page_tokens}"
            );
            let got = scales.to_host_bytes().expect("device to host copy");
            assert!(
                got[..rows * 4] == f32_bytes(&want_scales)[..],
                "fp8 scales {head_dim} {kv_heads} {page_tokens}"
            );
        }
    }
}

#[test]
fn kv_append_writes_each_token_at_its_slot_and_nothing_else() {
    let (gpu, mut rng) = (gpu(), Rng::fresh());
    for (head_dim, kv_heads, page_tokens) in [(128, 8, 16), (64, 2, 1), (128, 1, 64)] {
        let shape = AttentionShape { q_heads: kv_heads, kv_heads, head_dim, page_tokens, scale: 1.0 };
        let pages = 9;
        let row = kv_heads * head_dim;
        let slots = &distinct_slots(&mut rng, pages * page_tokens)[..];
        let tokens = slots.len();
        let (k_new, v_new) = (rng.bf16(tokens * row, 2.0), rng.bf16(tokens * row, 2.0));
        let cache_len = pages * page_tokens * row;
        let (k_old, v_old) = (rng.bf16(cache_len, 1.0), rng.bf16(cache_len, 1.0));
        let (dk, dv) = (upload(&gpu, &bytes(&k_old)), upload(&gpu, &bytes(&v_old)));
        let (nk, nv) = (upload(&gpu, &bytes(&k_new)), upload(&gpu, &bytes(&v_new)));
        kv_append(&gpu, &shape, &nk, &nv, slots, KvBuffers { k: &dk, v: &dv, pages, scales: None })
            .expect("kv_append");
        gpu.synchronize().expect("kv_append run");
        for (old, new, device) in [(&k_old, &k_new, &dk), (&v_old, &v_new, &dv)] {
            let mut want = old.clone();
            for (t, &slot) in slots.iter().enumerate() {
                let (page, in_page) = (slot as usize / page_tokens, slot as usize % page_tokens);
                for h in 0..kv_heads {
                    let to = ((page * kv_heads + h) * page_tokens + in_page) * head_dim;
                    want[to..to + head_dim]
                        .copy_from_slice(&new[(t * kv_heads + h) * head_dim..][..head_dim]);
                }
            }
            let got = device.to_host_bytes().expect("device to host copy");
            assert!(
                got[..cache_len * 2] == bytes(&want)[..],
                "kv_append {head_dim} {kv_heads} {page_tokens}"
            );
        }
    }
}

/// The wgmma prefill kernels (`kernels/attention_prefill.cu`, sm_90 only: the plain one and the
/// ping-pong one) against the float64 reference: every GQA ratio and several page sizes, ragged
/// batches whose lengths straddle their 128-row and 128-key tiles, chunks after cached
/// positions, and a 1024-token sequence at the benchmark's shape (32/8 heads, page 64); each case
/// run twice, bit for bit. On any other architecture the kernels must refuse (checked, not
/// skipped).
#[test]
fn wgmma_prefill_matches_float64_and_repeats_bit_for_bit() {
    let gpu = gpu();
    for variant in [AttentionVariant::PREFILL_WGMMA, AttentionVariant::PREFILL_WGMMA_PINGPONG] {
        check_wgmma_prefill(&gpu, variant);
    }
}

fn check_wgmma_prefill(gpu: &Gpu, variant: AttentionVariant) {
    let mut rng = Rng::fresh();
    if gpu.arch() != kiln_cuda::Arch(90) {
        let case = Case {
            q_heads: 8,
            kv_heads: 2,
            head_dim: 128,
            page_tokens: 16,
            sequences: vec![(40, 40)],
            splits: Some(1),
            variant,
        };
        let inputs = inputs(&mut rng, &case);
        let sequences =
            [AttentionSequence { query_tokens: 40, context_tokens: 40, pages: &inputs.tables[0] }];
        let batch = PagedBatch::upload(gpu, &inputs.shape, &sequences, inputs.pages).expect("batch upload");
        let q = upload(gpu, &bytes(&inputs.q));
        let (k, v) = (upload(gpu, &bytes(&inputs.k)), upload(gpu, &bytes(&inputs.v)));
        let out = poisoned(gpu, inputs.q.len() * 2);
        let cache = KvBuffers { k: &k, v: &v, pages: inputs.pages, scales: None };
        let refused = attention(gpu, &inputs.shape, &batch, &q, cache, &out, None, 1, Some(variant));
        assert!(
            matches!(refused, Err(Error::NotServed { .. })),
            "{} ran the wgmma kernel: {refused:?}",
            gpu.arch()
        );
        println!("{}: {variant:?} refuses, as it must off sm_90", gpu.arch());
        return;
    }
    let edges = [1, 2, 31, 32, 33, 127, 128, 129, 255, 256, 257, 300];
    for (i, &(q_heads, kv_heads)) in RATIOS.iter().enumerate() {
        let page_tokens = [1, 16, 64, 8, 128][i];
        let mut lengths: Vec<usize> = (0..1 + rng.below(4)).map(|_| 1 + rng.below(600)).collect();
        lengths.push(edges[rng.below(edges.len())]);
        let cases = [
            lengths.iter().map(|&n| (n, n)).collect::<Vec<_>>(),
            // Chunks after cached positions, one chunk per sequence.
            (0..1 + rng.below(3))
                .map(|_| {
                    let chunk = 1 + rng.below(300);
                    (chunk, chunk + rng.below(700))
                })
                .collect(),
        ];
        for sequences in cases {
            let case =
                Case { q_heads, kv_heads, head_dim: 128, page_tokens, sequences, splits: Some(1), variant };
            let outputs = check(gpu, &mut rng, &case, 2);
            assert!(outputs[0] == outputs[1], "{variant:?} differs between two runs: {:?}", case.sequences);
        }
    }
    let case = Case {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        page_tokens: 64,
        sequences: vec![(1024, 1024)],
        splits: Some(1),
        variant,
    };
    let outputs = check(gpu, &mut rng, &case, 2);
    assert!(outputs[0] == outputs[1], "{variant:?} differs between two runs at 1024 tokens");
}

/// The wgmma prefill kernels serve head dim 128 and one split only; they say so instead of
/// running.
#[test]
fn wgmma_prefill_refuses_what_it_does_not_serve() {
    let gpu = gpu();
    assert_eq!(AttentionVariant::PREFILL_WGMMA.kernel, AttentionKernel::Warpgroup);
    assert_eq!(AttentionVariant::PREFILL_WGMMA_PINGPONG.kernel, AttentionKernel::WarpgroupPingpong);
    for (variant, head_dim, splits) in [
        (AttentionVariant::PREFILL_WGMMA, 64, 1),
        (AttentionVariant::PREFILL_WGMMA, 128, 3),
        (AttentionVariant::PREFILL_WGMMA_PINGPONG, 64, 1),
        (AttentionVariant::PREFILL_WGMMA_PINGPONG, 128, 3),
    ] {
        let shape = AttentionShape { q_heads: 8, kv_heads: 2, head_dim, page_tokens: 16, scale: 0.125 };
        let pages: Vec<u32> = (0..4).collect();
        let q = gpu.alloc(40 * 8 * head_dim * 2).expect("device allocation");
        let out = gpu.alloc(40 * 8 * head_dim * 2).expect("device allocation");
        let cache_bytes = 4 * 2 * 16 * head_dim * 2;
        let (k, v) = (gpu.alloc(cache_bytes).expect("k"), gpu.alloc(cache_bytes).expect("v"));
        let cache = KvBuffers { k: &k, v: &v, pages: 4, scales: None };
        let scratch = gpu.alloc(scratch_bytes(&shape, 40, 3).max(16)).expect("scratch");
        let prefill = [AttentionSequence { query_tokens: 40, context_tokens: 40, pages: &pages }];
        let batch = PagedBatch::upload(&gpu, &shape, &prefill, 4).expect("batch upload");
        let refused = attention(&gpu, &shape, &batch, &q, cache, &out, Some(&scratch), splits, Some(variant));
        assert!(
            matches!(refused, Err(Error::NotServed { .. })),
            "{variant:?} at head dim {head_dim}, {splits} splits: {refused:?}"
        );
    }
}
