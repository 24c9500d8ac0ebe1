//! GPU tests of the sampler kernel: the same token as the CPU reference
//! (`kiln_core::ops::sample::sample`) over thousands of random cases in every mode, greedy from
//! the LM head's statistics, the penalty counts left at zero, and a chi-square test of the GPU's
//! token frequencies against the exact distribution. Fresh random inputs every run (the seed is
//! printed), outputs poisoned before each launch. Needs an NVIDIA GPU:
//! `cargo test -p kiln-cuda --features gpu-tests --test gpu_sample`.

use kiln_core::ops::lm_head::{greedy_from_stats, LmHead};
use kiln_core::ops::primitives::f32_to_bf16_bits;
use kiln_core::ops::sample::{sample, SamplingParams, NO_TOKEN};
use kiln_core::DType;
use kiln_cuda::ops::lm_head::{lm_head, LmHeadBuffers};
use kiln_cuda::ops::sample::{
    encode_histories, encode_params, sample_with_path, sample_with_path_profiled, topk_bound_slices,
    topk_merge_slices, topk_wide_slices, PenaltyScratch, SampleBuffers, SamplePath, SampleScratch, FAST_KMAX,
    FUSED_KMAX, MAX_SAMPLE_ROWS, PROFILE_SLOTS,
};
use kiln_cuda::{DeviceMemory, Gpu};

mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Logits with ties (rounded values), some NaN, -inf, +inf and -0.0.
    fn logit(&mut self) -> f32 {
        match self.below(400) {
            0..=9 => f32::NAN,
            10..=19 => f32::NEG_INFINITY,
            20 => f32::INFINITY,
            21 => -0.0,
            22..=99 => (self.uniform(-4.0, 4.0)).round(),
            _ => self.uniform(-12.0, 12.0),
        }
    }
    /// A row of logits in one of several shapes: mixed, all tied, few distinct values, all NaN,
    /// a single finite value among NaN, or a peaked distribution like a model's.
    fn row(&mut self, vocab: usize) -> Vec<f32> {
        match self.below(24) {
            0 => vec![self.uniform(-3.0, 3.0).round(); vocab],
            1 => (0..vocab).map(|_| self.below(3) as f32).collect(),
            2 => vec![f32::NAN; vocab],
            3 => {
                let mut row = vec![f32::NAN; vocab];
                row[self.below(vocab)] = self.uniform(-5.0, 5.0);
                row
            }
            4..=7 => (0..vocab)
                .map(|_| {
                    let u = self.uniform(0.0, 1.0);
                    if u < 0.001 {
                        self.uniform(10.0, 25.0)
                    } else {
                        self.uniform(-8.0, 6.0)
                    }
                })
                .collect(),
            _ => (0..vocab).map(|_| self.logit()).collect(),
        }
    }
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len().max(1)).expect("device allocation");
    memory.copy_from_host(0, bytes).expect("host to device copy");
    memory
}

fn words<T: Copy>(values: &[T], bytes: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    values.iter().flat_map(|&v| bytes(v)).collect()
}

/// Each mode: a generator of parameters.
fn mode_params(mode: &str, rng: &mut Rng) -> SamplingParams {
    let seed = rng.next();
    let temperature = rng.uniform(0.1, 2.0);
    let d = SamplingParams { temperature, seed, ..SamplingParams::default() };
    match mode {
        "greedy" => SamplingParams { temperature: 0.0, ..d },
        "temperature" => d,
        "top-k" => SamplingParams {
            // Mostly within the multi-block path's reach, sometimes just beyond it.
            top_k: match rng.below(8) {
                0 => 1,
                1 => FAST_KMAX - rng.below(3) as u32,
                2 => FAST_KMAX + 1 + rng.below(100) as u32,
                _ => 1 + rng.below(100) as u32,
            },
            ..d
        },
        "top-p" => SamplingParams { top_p: rng.uniform(0.05, 1.0), ..d },
        "min-p" => SamplingParams { min_p: rng.uniform(0.0, 0.5), ..d },
        "top-k + top-p" => {
            SamplingParams { top_k: 1 + rng.below(300) as u32, top_p: rng.uniform(0.1, 0.99), ..d }
        }
        "top-k + min-p" => {
            SamplingParams { top_k: 1 + rng.below(120) as u32, min_p: rng.uniform(0.0, 0.6), ..d }
        }
        "top-k + penalties" => SamplingParams {
            top_k: 1 + rng.below(80) as u32,
            top_p: if rng.below(2) == 0 { 1.0 } else { rng.uniform(0.2, 1.0) },
            repetition_penalty: rng.uniform(0.8, 1.8),
            presence_penalty: rng.uniform(-0.5, 1.0),
            frequency_penalty: rng.uniform(-0.3, 0.6),
            ..d
        },
        "penalties" => SamplingParams {
            repetition_penalty: rng.uniform(0.8, 1.8),
            presence_penalty: rng.uniform(-0.5, 1.0),
            frequency_penalty: rng.uniform(-0.3, 0.6),
            temperature: if rng.below(4) == 0 { 0.0 } else { temperature },
            ..d
        },
        _ => SamplingParams {
            top_k: rng.below(100) as u32,
            top_p: if rng.below(2) == 0 { 1.0 } else { rng.uniform(0.1, 1.0) },
            min_p: if rng.below(2) == 0 { 0.0 } else { rng.uniform(0.0, 0.3) },
            repetition_penalty: rng.uniform(0.9, 1.5),
            presence_penalty: rng.uniform(0.0, 0.5),
            frequency_penalty: rng.uniform(0.0, 0.5),
            ..d
        },
    }
}

const MODES: [&str; 10] = [
    "greedy",
    "temperature",
    "top-k",
    "top-p",
    "min-p",
    "top-k + top-p",
    "top-k + min-p",
    "top-k + penalties",
    "penalties",
    "all",
];

/// Runs the sampler on the GPU for `rows` rows; returns the tokens.
#[allow(clippy::too_many_arguments)]
fn run_gpu(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    params: &[(SamplingParams, u64)],
    steps: &[u64],
    histories: &[&[u32]],
    penalty: bool,
    stats: Option<(&DeviceMemory, usize)>,
    logits_dev: Option<&DeviceMemory>,
    path: SamplePath,
    scratch: Option<&SampleScratch>,
) -> (Vec<u32>, Vec<u8>) {
    let rows = params.len();
    let owned;
    let logits_dev = match logits_dev {
        Some(d) => d,
        None => {
            owned = upload(gpu, &words(logits, |v: f32| v.to_le_bytes().to_vec()));
            &owned
        }
    };
    let params_dev = upload(gpu, &encode_params(params).expect("valid parameters"));
    let steps_dev = upload(gpu, &words(steps, |v: u64| v.to_le_bytes().to_vec()));
    let (offsets, tokens) = encode_histories(histories, vocab).expect("histories");
    let offsets_dev = upload(gpu, &words(&offsets, |v: u32| v.to_le_bytes().to_vec()));
    let history_dev = upload(gpu, &words(&tokens, |v: u32| v.to_le_bytes().to_vec()));
    let counts = gpu.alloc(rows * vocab * 4).expect("counts");
    counts.fill_bytes(0).expect("zero counts");
    let penalized = gpu.alloc(rows * vocab * 4).expect("penalized logits");
    let out = gpu.alloc(rows * 4).expect("tokens");
    out.fill_bytes(0xA7).expect("poison");
    let buffers = SampleBuffers {
        logits: logits_dev,
        row_stride: vocab,
        params: &params_dev,
        steps: &steps_dev,
        history_offsets: &offsets_dev,
        history: &history_dev,
        penalty: penalty.then_some(PenaltyScratch { counts: &counts, scratch: &penalized }),
        stats,
        tokens: &out,
        scratch,
    };
    sample_with_path(gpu, rows, vocab, buffers, path).expect("launch");
    let bytes = out.to_host_bytes().expect("copy back");
    let tokens = bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    (tokens, counts.to_host_bytes().expect("copy back"))
}

/// Every mode, through every path (both multi-block paths where they serve a row, each alone,
/// and the single-block path for every row), against the CPU reference token for token. The
/// multi-block launches alternate between a scratch made once per shape and one allocated per
/// launch.
#[test]
fn tokens_equal_the_cpu_reference_in_every_mode() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut failures = Vec::new();
    let mut checked = 0usize;
    for mode in MODES {
        let mut mode_cases = 0;
        for launch in 0..24 {
            let vocab = match launch % 8 {
                0 => 151_936,
                1 => 1 + rng.below(40),
                2 => 1023 + rng.below(3),
                3 => 8191 + rng.below(3),
                4 => 32_000 + rng.below(300),
                _ => 100 + rng.below(6000),
            };
            let rows = match vocab {
                v if v > 100_000 => [1, 2, 8, 17][rng.below(4)],
                v if v > 20_000 => 1 + rng.below(24),
                _ => 1 + rng.below(MAX_SAMPLE_ROWS),
            };
            let logits: Vec<f32> = (0..rows).flat_map(|_| rng.row(vocab)).collect();
            let params: Vec<(SamplingParams, u64)> =
                (0..rows).map(|_| (mode_params(mode, &mut rng), rng.next())).collect();
            let steps: Vec<u64> = (0..rows).map(|_| rng.next()).collect();
            let histories: Vec<Vec<u32>> = (0..rows)
                .map(|_| {
                    // Repeats: draw from a small range of ids most of the time.
                    let range = vocab.min(50 + rng.below(vocab));
                    (0..rng.below(300)).map(|_| rng.below(range) as u32).collect()
                })
                .collect();
            let history_refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
            let want: Vec<u32> = (0..rows)
                .map(|r| {
                    let (p, stream) = params[r];
                    sample(&logits[r * vocab..(r + 1) * vocab], &p, &histories[r], steps[r], stream)
                        .unwrap_or(NO_TOKEN)
                })
                .collect();
            let made = (launch % 2 == 0).then(|| SampleScratch::new(&gpu, rows, vocab).expect("scratch"));
            for path in SamplePath::ALL {
                let scratch = if path == SamplePath::SingleBlock { None } else { made.as_ref() };
                let (got, counts) = run_gpu(
                    &gpu,
                    &logits,
                    vocab,
                    &params,
                    &steps,
                    &history_refs,
                    true,
                    None,
                    None,
                    path,
                    scratch,
                );
                if counts.iter().any(|&b| b != 0) {
                    failures.push(format!("{mode} {path:?}: the penalty counts were not left at zero"));
                }
                for r in 0..rows {
                    if got[r] != want[r] {
                        let (p, stream) = params[r];
                        failures.push(format!(
                            "{mode} {path:?}: vocab {vocab} rows {rows} row {r}: gpu {} cpu {} ({p:?}, step {}, \
                             stream {stream}, history {})",
                            got[r],
                            want[r],
                            steps[r],
                            histories[r].len()
                        ));
                    }
                    checked += 1;
                }
            }
            mode_cases += rows;
        }
        println!("{mode}: {mode_cases} cases per path");
        assert!(mode_cases >= 1000, "{mode}: only {mode_cases} cases");
    }
    println!("{checked} cases checked");
    let shown: Vec<&String> = failures.iter().take(20).collect();
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{shown:#?}", failures.len());
}

/// One scratch serves many launches (its tickets and mass histograms are left at zero), in the
/// modes of every multi-block path, the launches alternating between the paths: the same logits
/// sampled again and again give the reference's token every time, at vocab 151936 for batches 1
/// and 64.
#[test]
fn a_scratch_is_reused_across_launches() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let vocab = 151_936;
    for rows in [1usize, 64] {
        let scratch = SampleScratch::new(&gpu, rows, vocab).expect("scratch");
        let logits: Vec<f32> = (0..rows).flat_map(|_| rng.row(vocab)).collect();
        let logits_dev = upload(&gpu, &words(&logits, |v: f32| v.to_le_bytes().to_vec()));
        let empty: Vec<&[u32]> = vec![&[]; rows];
        let mut failures = 0;
        // 49 launches: every mode on every path (7 modes, 7 paths).
        for launch in 0..49 {
            let params: Vec<(SamplingParams, u64)> = (0..rows)
                .map(|_| {
                    let mode = [
                        "greedy",
                        "top-k",
                        "top-k + top-p",
                        "top-k + min-p",
                        "top-p",
                        "temperature",
                        "min-p",
                    ][launch % 7];
                    (mode_params(mode, &mut rng), rng.next())
                })
                .collect();
            let steps: Vec<u64> = (0..rows).map(|_| rng.next()).collect();
            let path = [
                SamplePath::Auto,
                SamplePath::Fused,
                SamplePath::Lists,
                SamplePath::Greedy,
                SamplePath::TopKMerge,
                SamplePath::TopKBound,
                SamplePath::TopKWide,
                SamplePath::TopKHeads,
            ][launch % 8];
            let (got, _) = run_gpu(
                &gpu,
                &[],
                vocab,
                &params,
                &steps,
                &empty,
                false,
                None,
                Some(&logits_dev),
                path,
                Some(&scratch),
            );
            for r in 0..rows {
                let (p, stream) = params[r];
                let want = sample(&logits[r * vocab..(r + 1) * vocab], &p, &[], steps[r], stream)
                    .unwrap_or(NO_TOKEN);
                if got[r] != want {
                    failures += 1;
                    println!(
                        "{path:?} rows {rows} launch {launch} row {r}: gpu {} cpu {want} ({p:?})",
                        got[r]
                    );
                }
            }
        }
        assert_eq!(failures, 0, "rows {rows}: {failures} tokens differ");
    }
}

/// The top-k bound (both last blocks) and top-k merge kernels compiled with SAMPLE_PROFILE=1 sample the reference's
/// tokens and write their phases' counts: row 0's k and slices, the bound kernel's candidate
/// groups and candidates (at least k), the merge kernel's survivors (at least k), no fallback on
/// a uniform row, and a span that starts before it ends.
#[test]
fn the_profiled_top_k_kernels_sample_and_count() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let vocab = 151_936;
    for rows in [1usize, 64] {
        let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.uniform(-8.0, 8.0)).collect();
        let logits_dev = upload(&gpu, &words(&logits, |v: f32| v.to_le_bytes().to_vec()));
        let k = 1 + rng.below(256) as u32;
        let params: Vec<(SamplingParams, u64)> = (0..rows)
            .map(|_| {
                let p = SamplingParams {
                    temperature: 0.8,
                    top_k: k,
                    top_p: 0.9,
                    seed: rng.next(),
                    ..Default::default()
                };
                (p, rng.next())
            })
            .collect();
        let steps: Vec<u64> = (0..rows).map(|_| rng.next()).collect();
        let (offsets, _) = encode_histories(&vec![&[][..]; rows], vocab).expect("histories");
        let params_dev = upload(&gpu, &encode_params(&params).expect("params"));
        let steps_dev = upload(&gpu, &words(&steps, |v: u64| v.to_le_bytes().to_vec()));
        let offsets_dev = upload(&gpu, &words(&offsets, |v: u32| v.to_le_bytes().to_vec()));
        let history_dev = upload(&gpu, &[0u8; 4]);
        let out = gpu.alloc(rows * 4).expect("tokens");
        out.fill_bytes(0xAB).expect("poison");
        let scratch = SampleScratch::new(&gpu, rows, vocab).expect("scratch");
        let sms = gpu.facts().multiprocessors as usize;
        for path in
            [SamplePath::TopKBound, SamplePath::TopKWide, SamplePath::TopKHeads, SamplePath::TopKMerge]
        {
            out.fill_bytes(0xAB).expect("poison");
            let profile = gpu.alloc(PROFILE_SLOTS * 8).expect("profile");
            profile.fill_bytes(0).expect("zero");
            let buffers = SampleBuffers {
                logits: &logits_dev,
                row_stride: vocab,
                params: &params_dev,
                steps: &steps_dev,
                history_offsets: &offsets_dev,
                history: &history_dev,
                penalty: None,
                stats: None,
                tokens: &out,
                scratch: Some(&scratch),
            };
            sample_with_path_profiled(&gpu, rows, vocab, buffers, path, Some(&profile))
                .expect("profiled launch");
            let bytes = out.to_host_bytes().expect("copy back");
            for r in 0..rows {
                let got =
                    u32::from_le_bytes([bytes[4 * r], bytes[4 * r + 1], bytes[4 * r + 2], bytes[4 * r + 3]]);
                let (p, stream) = params[r];
                let want = sample(&logits[r * vocab..(r + 1) * vocab], &p, &[], steps[r], stream)
                    .expect("reference");
                assert_eq!(got, want, "{path:?} rows {rows} row {r}: k {k}");
            }
            let slots: Vec<u64> = profile
                .to_host_bytes()
                .expect("copy back")
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect();
            assert_eq!(slots[35], k as u64, "{path:?} rows {rows}: k");
            assert_eq!(slots[36], 0, "{path:?} rows {rows}: fell back");
            let first_entry = !slots[0];
            assert!(slots[2] > first_entry && slots[25] > slots[24], "{path:?} rows {rows}: {slots:?}");
            if path == SamplePath::TopKHeads && slots[40] == 0 {
                // The heads path's last block: listed tokens (32), candidates (34).
                let (count, len) = topk_wide_slices(rows, vocab, sms).expect("grid");
                assert_eq!(slots[37], count as u64, "rows {rows}: slices");
                assert_eq!(slots[38], (len / 32) as u64, "rows {rows}: groups a slice");
                assert!(slots[32] >= k as u64 && slots[34] >= k as u64, "rows {rows}: {slots:?}");
            } else if path != SamplePath::TopKMerge {
                let grid = if path == SamplePath::TopKBound { topk_bound_slices } else { topk_wide_slices };
                let (count, len) = grid(rows, vocab, sms).expect("grid");
                assert_eq!(slots[37], count as u64, "rows {rows}: slices");
                assert_eq!(slots[38], (len / 32) as u64, "rows {rows}: groups a slice");
                assert_eq!(slots[32], vocab.div_ceil(32) as u64, "rows {rows}: valid groups");
                assert!(slots[33] >= k as u64 && slots[34] >= k as u64, "rows {rows}: {slots:?}");
            } else {
                let (count, _) = topk_merge_slices(rows, vocab, sms).expect("grid");
                assert_eq!(slots[37], count as u64, "rows {rows}: merge slices");
                assert!(k == 1 || slots[33] >= k as u64, "rows {rows}: {slots:?}");
            }
            println!(
                "{path:?} rows {rows} k {k}: counts {:?}, span {} ns",
                &slots[32..40],
                slots[2] - first_entry
            );
        }
    }
}

/// The top-k bound kernel's three compiles (256-thread blocks, `TopKBound`, 512-thread blocks,
/// `TopKWide`, and those with the slices' lists, `TopKHeads`) at batch 1
/// and vocab 151936, on fresh rows of every edge shape and rows like the benchmark's, each with
/// its own top-k (1, 2, 50, 255, 256 and random), greedy or with a temperature, top-p and min-p:
/// the token is the CPU reference's, and the first two find the same bound (row 0's counts of valid
/// groups, candidate groups, candidates, k, fallbacks and radix passes are equal: the same bin
/// and the same prefix, whatever the slices).
#[test]
fn the_wide_bound_equals_the_binary_search_and_the_reference() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let vocab = 151_936;
    let scratch = SampleScratch::new(&gpu, 1, vocab).expect("scratch");
    let mut failures = Vec::new();
    let mut checked = 0usize;
    let mut saturated = 0usize;
    for case in 0..96 {
        let logits: Vec<f32> = match case % 16 {
            shape @ 0..=11 => edge_row(&mut rng, vocab, shape),
            12 | 13 => (0..vocab).map(|_| rng.uniform(-8.0, 8.0)).collect(),
            // Sums of uniforms (close to normal) times 12, as `kiln bench sample` draws them.
            _ => (0..vocab)
                .map(|_| (rng.uniform(-1.0, 1.0) + rng.uniform(-1.0, 1.0) + rng.uniform(-1.0, 1.0)) * 12.0)
                .collect(),
        };
        let top_k = match case % 6 {
            0 => 1,
            1 => 2,
            2 => 50,
            3 => 255,
            4 => 256,
            _ => 1 + rng.below(256) as u32,
        };
        let mut p = SamplingParams {
            temperature: if rng.below(8) == 0 { 0.0 } else { rng.uniform(0.05, 3.0) },
            top_k,
            seed: rng.next(),
            ..SamplingParams::default()
        };
        if rng.below(2) == 0 {
            p.top_p = rng.uniform(0.05, 1.0);
        }
        if rng.below(3) == 0 {
            p.min_p = rng.uniform(0.0, 0.5);
        }
        let params = vec![(p, rng.next())];
        let steps = vec![rng.next()];
        let want = sample(&logits, &p, &[], steps[0], params[0].1).unwrap_or(NO_TOKEN);
        let logits_dev = upload(&gpu, &words(&logits, |v: f32| v.to_le_bytes().to_vec()));
        let params_dev = upload(&gpu, &encode_params(&params).expect("params"));
        let steps_dev = upload(&gpu, &words(&steps, |v: u64| v.to_le_bytes().to_vec()));
        let (offsets, _) = encode_histories(&[&[][..]], vocab).expect("histories");
        let offsets_dev = upload(&gpu, &words(&offsets, |v: u32| v.to_le_bytes().to_vec()));
        let history_dev = upload(&gpu, &[0u8; 4]);
        let out = gpu.alloc(4).expect("tokens");
        let mut counts = Vec::new();
        for path in [SamplePath::TopKBound, SamplePath::TopKWide, SamplePath::TopKHeads] {
            out.fill_bytes(0xAB).expect("poison");
            let profile = gpu.alloc(PROFILE_SLOTS * 8).expect("profile");
            profile.fill_bytes(0).expect("zero");
            let buffers = SampleBuffers {
                logits: &logits_dev,
                row_stride: vocab,
                params: &params_dev,
                steps: &steps_dev,
                history_offsets: &offsets_dev,
                history: &history_dev,
                penalty: None,
                stats: None,
                tokens: &out,
                scratch: Some(&scratch),
            };
            sample_with_path_profiled(&gpu, 1, vocab, buffers, path, Some(&profile))
                .expect("profiled launch");
            let bytes = out.to_host_bytes().expect("copy back");
            let got = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            if got != want {
                failures.push(format!("{path:?} case {case}: gpu {got} cpu {want} ({p:?})"));
            }
            checked += 1;
            let slots: Vec<u64> = profile
                .to_host_bytes()
                .expect("copy back")
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect();
            // Slots 37 and 38 (slices, groups a slice) are the grid's: the wide path's differs.
            counts.push([slots[32], slots[33], slots[34], slots[35], slots[36], slots[39]]);
            if path == SamplePath::TopKHeads {
                saturated += slots[40] as usize;
            }
        }
        if counts[0] != counts[1] {
            failures.push(format!(
                "case {case} (shape {}, k {top_k}): bound counts {:?}, wide counts {:?}",
                case % 16,
                counts[0],
                counts[1]
            ));
        }
    }
    println!("{checked} cases checked, {saturated} rows sent from the heads path to the bound path");
    let shown: Vec<&String> = failures.iter().take(20).collect();
    assert!(failures.is_empty(), "{} failures:\n{shown:#?}", failures.len());
}

/// A row shaped to stress the fused path's selection: `shape` picks it.
fn edge_row(rng: &mut Rng, vocab: usize, shape: usize) -> Vec<f32> {
    match shape {
        0 => vec![f32::NEG_INFINITY; vocab],
        1 => vec![f32::NAN; vocab],
        2 => vec![1.5; vocab],
        // +inf among finite logits: the ties at +inf take all the mass.
        3 => (0..vocab)
            .map(|_| if rng.below(300) == 0 { f32::INFINITY } else { rng.uniform(-10.0, 10.0) })
            .collect(),
        // The whole top in one run of indices (one slice holds every top-k token).
        4 => {
            let start = rng.below(vocab);
            (0..vocab)
                .map(|i| {
                    if i >= start && i < start + 400 {
                        rng.uniform(20.0, 30.0)
                    } else {
                        rng.uniform(-5.0, 5.0)
                    }
                })
                .collect()
        }
        // A spread beyond the histogram's range (distances of 1e30).
        5 => (0..vocab)
            .map(|_| match rng.below(3) {
                0 => 1e30 * rng.uniform(-1.0, 1.0),
                1 => f32::NEG_INFINITY,
                _ => rng.uniform(-3.0, 3.0),
            })
            .collect(),
        // Near-ties: thousands of distinct values within a few ulps (one histogram bin).
        6 => (0..vocab).map(|_| f32::from_bits(10.0f32.to_bits() - rng.below(4000) as u32)).collect(),
        // A maximum of -0.0 / +0.0 shared by many tokens, the rest negative.
        7 => (0..vocab)
            .map(|_| match rng.below(4) {
                0 => -0.0,
                1 => 0.0,
                _ => -rng.uniform(0.0, 3.0).abs() - 1e-3,
            })
            .collect(),
        // Fewer candidates than top-k: a few finite logits among NaN.
        8 => (0..vocab)
            .map(|_| if rng.below(vocab / 20 + 1) == 0 { rng.uniform(-2.0, 2.0) } else { f32::NAN })
            .collect(),
        // Few distinct values (many ties at the top) and a model-like peak.
        9 => (0..vocab).map(|_| rng.below(3) as f32).collect(),
        // A crowded bin of distinct values below the maximum: 200 logits in (8.9, 9.0) under one
        // 10.0 (the top-k bound path splits the bin by radix passes over its groups' keys).
        10 => {
            let mut row: Vec<f32> = (0..vocab).map(|_| rng.uniform(-5.0, 5.0)).collect();
            for _ in 0..200 {
                let at = rng.below(vocab);
                row[at] = rng.uniform(8.9, 8.999);
            }
            row[rng.below(vocab)] = 10.0;
            row
        }
        _ => rng.row(vocab),
    }
}

/// The fused, greedy and top-k merge paths on rows shaped against their selection (all -inf, all NaN, all tied, +inf
/// ties, the whole top in one slice, spreads of 1e30, near-ties, a maximum of -0.0 / +0.0, fewer
/// candidates than k, few distinct values, a crowded bin below the maximum), each row with its own top-k (1, 2, 3, 50, 255, 256,
/// 257 and random), some greedy, some with top-p, min-p and penalties that hit the top tokens;
/// against the CPU reference, with the penalty counts left at zero.
#[test]
fn fused_paths_equal_the_cpu_reference_on_edge_rows() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut failures = Vec::new();
    let mut checked = 0usize;
    for launch in 0..24 {
        // One or two rows of 151936: the batch-1 grid (132 slices, 7 staged entries a list in
        // the last block) and the batch-2 grid (66 slices, 15 staged).
        let (vocab, rows) = match launch % 4 {
            0 => (151_936, 11),
            1 => (5000 + rng.below(3000), 64),
            2 => (300 + rng.below(2000), 200),
            _ => (151_936, 1 + rng.below(2)),
        };
        let logits: Vec<f32> = (0..rows).flat_map(|r| edge_row(&mut rng, vocab, (r + launch) % 12)).collect();
        let params: Vec<(SamplingParams, u64)> = (0..rows)
            .map(|r| {
                let top_k = match (r + launch) % 9 {
                    0 => 1,
                    1 => 2,
                    2 => 3,
                    3 => 50,
                    4 => FUSED_KMAX - 1,
                    5 => FUSED_KMAX,
                    6 => FUSED_KMAX + 1,
                    _ => 1 + rng.below(FUSED_KMAX as usize) as u32,
                };
                let mut p = SamplingParams {
                    temperature: if rng.below(6) == 0 { 0.0 } else { rng.uniform(0.05, 3.0) },
                    top_k,
                    seed: rng.next(),
                    ..SamplingParams::default()
                };
                if rng.below(2) == 0 {
                    p.top_p = rng.uniform(0.05, 1.0);
                }
                if rng.below(3) == 0 {
                    p.min_p = rng.uniform(0.0, 0.5);
                }
                if rng.below(2) == 0 {
                    p.repetition_penalty = rng.uniform(0.7, 1.8);
                    p.presence_penalty = rng.uniform(-0.5, 1.0);
                    p.frequency_penalty = rng.uniform(-0.3, 0.6);
                }
                (p, rng.next())
            })
            .collect();
        let steps: Vec<u64> = (0..rows).map(|_| rng.next()).collect();
        // Histories that hit the row's best tokens (penalties move them across the top-k).
        let histories: Vec<Vec<u32>> = (0..rows)
            .map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let mut order: Vec<usize> = (0..vocab).filter(|&i| !row[i].is_nan()).collect();
                order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
                let best = order.len().min(300);
                (0..rng.below(200))
                    .map(|_| if best > 0 && rng.below(2) == 0 { order[rng.below(best)] } else { rng.below(vocab) } as u32)
                    .collect()
            })
            .collect();
        let history_refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let want: Vec<u32> = (0..rows)
            .map(|r| {
                let (p, stream) = params[r];
                sample(&logits[r * vocab..(r + 1) * vocab], &p, &histories[r], steps[r], stream)
                    .unwrap_or(NO_TOKEN)
            })
            .collect();
        let scratch = SampleScratch::new(&gpu, rows, vocab).expect("scratch");
        // The greedy path too: its greedy rows (without penalties) on the greedy kernel, the
        // others on one block each; and the top-k merge path (its rows without penalties on the
        // merge kernel, the crowded ones and the others on one block each).
        for path in [
            SamplePath::Fused,
            SamplePath::Auto,
            SamplePath::Greedy,
            SamplePath::TopKMerge,
            SamplePath::TopKBound,
            SamplePath::TopKWide,
            SamplePath::TopKHeads,
        ] {
            for penalty in [true, false] {
                let want_here: Vec<u32> = if penalty {
                    want.clone()
                } else {
                    (0..rows)
                        .map(|r| {
                            let (p, stream) = params[r];
                            let plain = SamplingParams {
                                repetition_penalty: 1.0,
                                presence_penalty: 0.0,
                                frequency_penalty: 0.0,
                                ..p
                            };
                            sample(&logits[r * vocab..(r + 1) * vocab], &plain, &[], steps[r], stream)
                                .unwrap_or(NO_TOKEN)
                        })
                        .collect()
                };
                let (got, counts) = run_gpu(
                    &gpu,
                    &logits,
                    vocab,
                    &params,
                    &steps,
                    &history_refs,
                    penalty,
                    None,
                    None,
                    path,
                    Some(&scratch),
                );
                if counts.iter().any(|&b| b != 0) {
                    failures.push(format!("{path:?}: the penalty counts were not left at zero"));
                }
                for r in 0..rows {
                    if got[r] != want_here[r] {
                        failures.push(format!(
                            "{path:?} penalties {penalty}: vocab {vocab} rows {rows} row {r} shape {}: gpu {} cpu {} ({:?})",
                            (r + launch) % 12,
                            got[r],
                            want_here[r],
                            params[r].0
                        ));
                    }
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} cases checked");
    let shown: Vec<&String> = failures.iter().take(20).collect();
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{shown:#?}", failures.len());
}

#[test]
fn greedy_from_the_lm_head_statistics_is_the_argmax() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let (vocab, hidden, rows, block) = (50_021, 512, 4, 64);
    let w: Vec<u8> =
        (0..vocab * hidden).flat_map(|_| f32_to_bf16_bits(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect();
    let h: Vec<f32> = (0..rows * hidden).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let head = LmHead {
        hidden,
        vocab,
        weight: DType::BF16,
        logit_scale: 1.0,
        soft_cap: None,
        stats_block: Some(block),
    };
    let want = head.run(&h, &w, None).expect("CPU reference");
    let h_dev = upload(&gpu, &words(&h, |v: f32| v.to_le_bytes().to_vec()));
    let w_dev = upload(&gpu, &w);
    let logits_dev = gpu.alloc(rows * vocab * 4).expect("logits");
    let per_row = vocab.div_ceil(block);
    let stats_dev = gpu.alloc(rows * per_row * 8).expect("stats");
    let buffers = LmHeadBuffers {
        h: &h_dev,
        weights: &w_dev,
        row_scale: None,
        logits: &logits_dev,
        stats: Some(&stats_dev),
    };
    lm_head(&gpu, &head, rows, buffers, None).expect("lm head");
    let params: Vec<(SamplingParams, u64)> = (0..rows).map(|_| (SamplingParams::greedy(), 0)).collect();
    let empty: Vec<&[u32]> = vec![&[]; rows];
    // The greedy path serves rows with statistics on one block each (from the statistics).
    for path in [SamplePath::Auto, SamplePath::Greedy] {
        let (got, _) = run_gpu(
            &gpu,
            &[],
            vocab,
            &params,
            &vec![0; rows],
            &empty,
            false,
            Some((&stats_dev, per_row)),
            Some(&logits_dev),
            path,
            None,
        );
        for (r, &token) in got.iter().enumerate() {
            let stats = &want.stats[r * per_row..(r + 1) * per_row];
            let argmax = kiln_core::ops::sample::argmax(&want.logits[r * vocab..(r + 1) * vocab]);
            assert_eq!(greedy_from_stats(stats), argmax);
            assert_eq!(Some(token), argmax, "{path:?} row {r}");
        }
    }
}

/// The exact distribution of a mode in f64, from the definitions (sorting freely).
fn exact_distribution(l: &[f32], p: &SamplingParams) -> Vec<f64> {
    let x: Vec<f64> = l.iter().map(|&v| f64::from(v)).collect();
    let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
    let mut prob: Vec<f64> = x.iter().map(|&v| ((v - max) / f64::from(p.temperature)).exp()).collect();
    if p.top_k > 0 {
        for &i in order.iter().skip(p.top_k as usize) {
            prob[i] = 0.0;
        }
    }
    let total: f64 = prob.iter().sum();
    let mut before = 0.0;
    // top-p = 1 keeps every token: no boundary to check (the last shares are tiny).
    for &i in order.iter().filter(|_| p.top_p < 1.0) {
        let share = prob[i] / total;
        if before >= f64::from(p.top_p) {
            prob[i] = 0.0;
        } else {
            assert!((before - f64::from(p.top_p)).abs() > 1e-3, "top-p boundary too close to call");
        }
        before += share;
    }
    let best = prob[order[0]];
    for v in prob.iter_mut() {
        assert!(*v == 0.0 || (*v / best - f64::from(p.min_p)).abs() > 1e-3, "min-p boundary too close");
        if *v / best < f64::from(p.min_p) {
            *v = 0.0;
        }
    }
    let total: f64 = prob.iter().sum();
    prob.iter().map(|v| v / total).collect()
}

/// Chi-square critical values at significance 0.001, by degrees of freedom 1..=20.
const CHI2_CRITICAL_0_001: [f64; 20] = [
    10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264, 32.909, 34.528,
    36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315,
];

/// Each mode's token frequencies over 40,960 GPU draws (fresh seed, steps 0..) match the exact
/// distribution: chi-square at significance 0.001, and no draw outside the support.
#[test]
fn gpu_frequencies_match_the_exact_distribution() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    // Fixed logits whose top-p and min-p boundaries are far from the chosen thresholds.
    let l: Vec<f32> =
        vec![1.2, -0.3, 0.8, 1.9, -1.4, 0.1, 0.55, -0.9, 1.45, -0.05, 0.3, -1.9, 0.95, -0.6, 1.7, -1.1];
    let seed = rng.next();
    let d = SamplingParams { seed, ..SamplingParams::default() };
    let modes: [(&str, SamplingParams); 6] = [
        ("temperature 1", d),
        ("temperature 0.6", SamplingParams { temperature: 0.6, ..d }),
        ("top-k 5", SamplingParams { top_k: 5, temperature: 0.9, ..d }),
        ("top-p 0.7", SamplingParams { top_p: 0.7, ..d }),
        ("min-p 0.3", SamplingParams { min_p: 0.3, temperature: 1.3, ..d }),
        ("top-k 8 + top-p 0.8", SamplingParams { top_k: 8, top_p: 0.8, temperature: 0.8, ..d }),
    ];
    let vocab = l.len();
    let launches = 160;
    let rows = MAX_SAMPLE_ROWS;
    let logits: Vec<f32> = (0..rows).flat_map(|_| l.iter().copied()).collect();
    let logits_dev = upload(&gpu, &words(&logits, |v: f32| v.to_le_bytes().to_vec()));
    let empty: Vec<&[u32]> = vec![&[]; rows];
    for (name, p) in modes {
        let expected = exact_distribution(&l, &p);
        let mut counts = vec![0u64; vocab];
        for launch in 0..launches {
            let params: Vec<(SamplingParams, u64)> = (0..rows).map(|_| (p, 0)).collect();
            let steps: Vec<u64> = (0..rows).map(|r| (launch * rows + r) as u64).collect();
            let path = [
                SamplePath::Auto,
                SamplePath::SingleBlock,
                SamplePath::Fused,
                SamplePath::TopKMerge,
                SamplePath::TopKBound,
                SamplePath::TopKWide,
                SamplePath::TopKHeads,
            ][launch % 7];
            let (got, _) = run_gpu(
                &gpu,
                &[],
                vocab,
                &params,
                &steps,
                &empty,
                false,
                None,
                Some(&logits_dev),
                path,
                None,
            );
            for t in got {
                assert!((t as usize) < vocab, "{name}: token {t}");
                counts[t as usize] += 1;
            }
        }
        let draws = (launches * rows) as f64;
        let mut chi2 = 0.0;
        let mut categories = 0;
        for (i, (&e, &c)) in expected.iter().zip(&counts).enumerate() {
            if e == 0.0 {
                assert_eq!(c, 0, "{name}: token {i} is outside the support but was drawn");
                continue;
            }
            chi2 += (c as f64 - e * draws).powi(2) / (e * draws);
            categories += 1;
        }
        let critical = CHI2_CRITICAL_0_001[categories - 2];
        println!(
            "{name}: chi-square {chi2:.2} with {} degrees of freedom (critical {critical})",
            categories - 1
        );
        assert!(chi2 < critical, "{name}: chi-square {chi2:.2} >= {critical}");
    }
}
