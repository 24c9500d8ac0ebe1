//! GPU tests of the LM head kernel: every weight dtype, every row count 1..8 and every variant
//! equal to the CPU reference (`kiln_core::ops::lm_head`, its fused multiply-add chains per lane:
//! `unit_dot_fma`) bit for bit, logits and block argmax
//! statistics, on fresh random inputs with the outputs poisoned before each launch. Needs an
//! NVIDIA GPU: `cargo test -p kiln-cuda --features gpu-tests --test gpu_lm_head`.

use kiln_core::ops::lm_head::{row_bytes, LmHead, MAX_ROWS, QUANT_BLOCK};
use kiln_core::ops::primitives::{f32_to_bf16_bits, f32_to_f16_bits};
use kiln_core::DType;
use kiln_cuda::ops::lm_head::{lm_head, plan, LmHeadBuffers, LmHeadVariant, LM_HEAD_VARIANTS};
use kiln_cuda::{DeviceMemory, Gpu};

mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_weights(rng: &mut Rng, dtype: DType, vocab: usize, hidden: usize) -> Vec<u8> {
    match dtype {
        DType::BF16 => {
            (0..vocab * hidden).flat_map(|_| f32_to_bf16_bits(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect()
        }
        DType::F16 => {
            (0..vocab * hidden).flat_map(|_| f32_to_f16_bits(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect()
        }
        _ => {
            let (block_bytes, header) = match dtype {
                DType::Q8_0 => (34, 2),
                DType::Q4_0 => (18, 2),
                _ => (20, 4),
            };
            let mut out = Vec::with_capacity(vocab * hidden / QUANT_BLOCK * block_bytes);
            for _ in 0..vocab * hidden / QUANT_BLOCK {
                out.extend_from_slice(&f32_to_f16_bits(rng.uniform(0.001, 0.05)).to_le_bytes());
                if header == 4 {
                    out.extend_from_slice(&f32_to_f16_bits(rng.uniform(-0.2, 0.2)).to_le_bytes());
                }
                out.extend((0..block_bytes - header).map(|_| rng.next() as u8));
            }
            out
        }
    }
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len().max(1)).expect("device allocation");
    memory.copy_from_host(0, bytes).expect("host to device copy");
    memory
}

fn poisoned(gpu: &Gpu, bytes: usize) -> DeviceMemory {
    let memory = gpu.alloc(bytes.max(1)).expect("device allocation");
    memory.fill_bytes(0xA7).expect("poison");
    memory
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Runs `variant` on the given inputs (outputs poisoned first) and compares its logits and, when
/// the head asks for them, its block statistics with the CPU reference bit for bit (NaN equal to
/// NaN). Returns the reference's logits; `Err` describes the first mismatch under `what`.
#[allow(clippy::too_many_arguments)]
fn compare_with_reference(
    gpu: &Gpu,
    head: &LmHead,
    rows: usize,
    variant: LmHeadVariant,
    h: &[f32],
    w: &[u8],
    row_scale: Option<&[f32]>,
    what: &str,
) -> Result<Vec<f32>, String> {
    let (vocab, hidden, dtype) = (head.vocab, head.hidden, head.weight);
    let want = head.run(h, w, row_scale).expect("CPU reference");
    let h_dev = upload(gpu, &h.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
    let w_dev = upload(gpu, w);
    let scale_dev =
        row_scale.map(|s| upload(gpu, &s.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()));
    let logits_dev = poisoned(gpu, rows * vocab * 4);
    let stats_dev = poisoned(gpu, rows * vocab.div_ceil(variant.tile as usize) * 8);
    let with_stats = head.stats_block.is_some();
    let buffers = LmHeadBuffers {
        h: &h_dev,
        weights: &w_dev,
        row_scale: scale_dev.as_ref(),
        logits: &logits_dev,
        stats: with_stats.then_some(&stats_dev),
    };
    lm_head(gpu, head, rows, buffers, Some(variant)).expect("launch");
    let got = f32s(&logits_dev.to_host_bytes().expect("copy back"));
    assert_eq!(row_bytes(dtype, hidden).unwrap() * vocab, w.len());
    let mismatches: Vec<usize> = (0..rows * vocab).filter(|&i| !same_bits(got[i], want.logits[i])).collect();
    if let Some(&i) = mismatches.first() {
        return Err(format!(
            "{what}: {} logits differ; first [{}][{}] gpu {:e} ({:#x}) cpu {:e} ({:#x})",
            mismatches.len(),
            i / vocab,
            i % vocab,
            got[i],
            got[i].to_bits(),
            want.logits[i],
            want.logits[i].to_bits()
        ));
    }
    if with_stats {
        let bytes = stats_dev.to_host_bytes().expect("copy back");
        let stats: Vec<u64> = bytes
            .chunks_exact(8)
            .take(want.stats.len())
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        if stats != want.stats {
            return Err(format!("{what}: block statistics differ"));
        }
    }
    Ok(want.logits)
}

/// Runs one random case (random epilogue, statistics or not, row scale or not) of `variant` at
/// `rows` x `vocab` x `hidden` and compares logits and statistics with the CPU reference bit for
/// bit. `Ok(false)` when the variant does not serve the case; `Err` describes a mismatch.
fn check_case(
    gpu: &Gpu,
    rng: &mut Rng,
    dtype: DType,
    rows: usize,
    variant: LmHeadVariant,
    (vocab, hidden): (usize, usize),
) -> Result<bool, String> {
    let with_stats = rng.below(2) == 0;
    let head = LmHead {
        hidden,
        vocab,
        weight: dtype,
        logit_scale: if rng.below(2) == 0 { 1.0 } else { rng.uniform(0.1, 2.0) },
        soft_cap: (rng.below(2) == 0).then(|| rng.uniform(5.0, 50.0)),
        stats_block: with_stats.then_some(variant.tile as usize),
    };
    if plan(&head, rows, variant).is_err() {
        return Ok(false); // the variant carries more sums per step than 32 at this row count
    }
    let row_scale: Option<Vec<f32>> =
        (rng.below(2) == 0).then(|| (0..rows).map(|_| rng.uniform(0.2, 3.0)).collect());
    let h: Vec<f32> = (0..rows * hidden).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let w = random_weights(rng, dtype, vocab, hidden);
    let what = format!(
        "{dtype} rows {rows} {vocab}x{hidden} {} {head:?} row_scale {}",
        variant.label(),
        row_scale.is_some()
    );
    compare_with_reference(gpu, &head, rows, variant, &h, &w, row_scale.as_deref(), &what)?;
    Ok(true)
}

#[test]
fn logits_and_statistics_equal_the_cpu_reference_for_every_dtype_row_count_and_variant() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    // (vocab, hidden): ragged vocabularies, partial units (576 = 2.25 units, 896 = 3.5).
    let shapes = [(1021usize, 4096usize), (777, 576), (515, 896), (300, 2048)];
    let dtypes = [DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1];
    let mut checked = 0usize;
    let mut failures = Vec::new();
    for dtype in dtypes {
        for rows in 1..=MAX_ROWS {
            for (k, variant) in LM_HEAD_VARIANTS.iter().enumerate() {
                // Every variant for bf16 (the main path) at 1, 4 and 8 rows and half of the other
                // row counts (in turn); two per row count for the others, to keep the number of
                // compiles down. Variants share all code but the weight load.
                let bf16_case = [1, 4, 8].contains(&rows) || (k + rows) % 2 == 0;
                if (dtype == DType::BF16 && !bf16_case)
                    || (dtype != DType::BF16 && (k + rows) % LM_HEAD_VARIANTS.len() > 1)
                {
                    continue;
                }
                let shape = shapes[(rows + k + rng.below(shapes.len())) % shapes.len()];
                match check_case(&gpu, &mut rng, dtype, rows, *variant, shape) {
                    Ok(ran) => checked += usize::from(ran),
                    Err(failure) => failures.push(failure),
                }
            }
        }
    }
    println!("{checked} cases checked");
    assert!(failures.is_empty(), "{} of {checked} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= dtypes.len() * MAX_ROWS, "only {checked} cases ran");
}

#[test]
fn ring_variants_equal_the_cpu_reference_when_blocks_loop_over_many_tiles() {
    // Vocabularies of tens of thousands of rows give a persistent (ring) grid several tiles
    // per block, so each block's ring runs on across tile ends; partial units (896 = 3.5,
    // 576 = 2.25) exercise the zero-filled copies, and the quantized weights the ring-less
    // path of the same loop.
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let rings: Vec<LmHeadVariant> = LM_HEAD_VARIANTS.iter().copied().filter(|v| v.stages > 0).collect();
    assert!(!rings.is_empty(), "no ring variant is listed");
    let mut checked = 0usize;
    let mut failures = Vec::new();
    for (k, variant) in rings.iter().enumerate() {
        for rows in [8, 4, 1 + rng.below(MAX_ROWS)] {
            let dtype = [DType::BF16, DType::F16, DType::BF16, DType::Q4_1][(k + rows) % 4];
            let hidden = [896, 2048, 576][rng.below(3)];
            let vocab = 20_000 + rng.below(5_000);
            match check_case(&gpu, &mut rng, dtype, rows, *variant, (vocab, hidden)) {
                Ok(ran) => checked += usize::from(ran),
                Err(failure) => failures.push(failure),
            }
        }
    }
    println!("{checked} cases checked");
    assert!(failures.is_empty(), "{} of {checked} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 2 * rings.len(), "only {checked} cases ran");
}

#[test]
fn the_default_and_ring_variants_serve_the_benchmark_shape() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let (vocab, hidden) = (151_936, 4096);
    let w = random_weights(&mut rng, DType::BF16, vocab, hidden);
    let w_dev = upload(&gpu, &w);
    for rows in [1, 2, 4, 8] {
        let head = LmHead {
            hidden,
            vocab,
            weight: DType::BF16,
            logit_scale: 1.0,
            soft_cap: None,
            stats_block: Some(64),
        };
        let h: Vec<f32> = (0..rows * hidden).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let want = head.run(&h, &w, None).expect("CPU reference");
        let h_dev = upload(&gpu, &h.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
        let logits_dev = poisoned(&gpu, rows * vocab * 4);
        let stats_dev = poisoned(&gpu, rows * vocab.div_ceil(64) * 8);
        let buffers = LmHeadBuffers {
            h: &h_dev,
            weights: &w_dev,
            row_scale: None,
            logits: &logits_dev,
            stats: Some(&stats_dev),
        };
        let variant =
            LmHeadVariant::default_for_call(&head, rows, gpu.facts().shared_memory_per_block_optin_bytes);
        lm_head(&gpu, &head, rows, buffers, Some(variant)).expect("launch");
        let got = f32s(&logits_dev.to_host_bytes().expect("copy back"));
        let bad = (0..rows * vocab).filter(|&i| !same_bits(got[i], want.logits[i])).count();
        assert_eq!(bad, 0, "{rows} rows: {bad} logits differ from the CPU reference");
        // The ring variants at the benchmark shape for 4 and 8 rows (their own tiles, no
        // statistics): the same logits, from blocks that each loop over dozens of tiles.
        let plain = LmHead { stats_block: None, ..head };
        let rings = LM_HEAD_VARIANTS.iter().copied().filter(|v| v.stages > 0 && rows >= 4);
        for variant in rings {
            if plan(&plain, rows, variant).is_err() {
                continue;
            }
            logits_dev.fill_bytes(0xA7).expect("poison");
            let buffers = LmHeadBuffers {
                h: &h_dev,
                weights: &w_dev,
                row_scale: None,
                logits: &logits_dev,
                stats: None,
            };
            lm_head(&gpu, &plain, rows, buffers, Some(variant)).expect("launch");
            let got = f32s(&logits_dev.to_host_bytes().expect("copy back"));
            let bad = (0..rows * vocab).filter(|&i| !same_bits(got[i], want.logits[i])).count();
            assert_eq!(
                bad,
                0,
                "{rows} rows, {}: {bad} logits differ from the CPU reference",
                variant.label()
            );
        }
    }
}

/// A weight of one of the special classes, as 2-byte bits: a subnormal or a signed zero, a
/// finite value of any exponent from 2^-133 up to 2^40, or an infinity or NaN.
fn special_bits(rng: &mut Rng, dtype: DType, class: usize) -> u16 {
    let sign = if rng.below(2) == 0 { 0u16 } else { 0x8000 };
    let (mantissa_bits, exponent_max) = if dtype == DType::BF16 { (7, 0xFFu16) } else { (10, 0x1F) };
    let mantissa = (rng.next() as u16) & ((1 << mantissa_bits) - 1);
    match class {
        // Subnormal, or a signed zero one time in eight.
        0 => sign | if rng.below(8) == 0 { 0 } else { mantissa.max(1) },
        // Finite, any exponent (bf16: up to 2^40; fp16: all of them).
        1 => {
            let top = if dtype == DType::BF16 { 127 + 40 } else { exponent_max - 1 };
            sign | ((rng.below(top as usize) as u16 + 1) << mantissa_bits) | mantissa
        }
        // Infinity or NaN (any payload).
        _ => sign | (exponent_max << mantissa_bits) | if rng.below(2) == 0 { 0 } else { mantissa.max(1) },
    }
}

#[test]
fn special_weights_give_the_reference_logits_on_the_matrix_decode_and_its_twins() {
    // Subnormal, zero, huge and non-finite bf16 / fp16 weights with h of about 2^50..2^70 (so
    // that products of subnormals are normal floats): the matrix-unit decode (TCDEC) must return
    // each weight exactly, and where a non-finite weight makes its neighbours NaN, the logits it
    // computes again must be the reference's. Each matrix variant runs beside its shift twin.
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let matrix: Vec<LmHeadVariant> = LM_HEAD_VARIANTS.iter().copied().filter(|v| v.matrix_decode).collect();
    assert!(!matrix.is_empty(), "no matrix-decode variant is listed");
    let mut checked = 0usize;
    let mut nan_logits = 0usize;
    let mut failures = Vec::new();
    for variant in matrix.iter().flat_map(|v| [*v, LmHeadVariant { matrix_decode: false, ..*v }]) {
        for dtype in [DType::BF16, DType::F16] {
            for rows in [1, 8, 1 + rng.below(MAX_ROWS)] {
                let (vocab, hidden) = [(1021usize, 4096usize), (20_011, 896), (515, 576)][rng.below(3)];
                let head = LmHead {
                    hidden,
                    vocab,
                    weight: dtype,
                    logit_scale: 1.0,
                    soft_cap: None,
                    stats_block: (rng.below(2) == 0).then_some(variant.tile as usize),
                };
                if plan(&head, rows, variant).is_err() {
                    continue;
                }
                // Each vocabulary row: plain (-1, 1) weights, or mostly plain with one weight in
                // eight of a special class, or (one row in 64) a single non-finite weight.
                let mut w = Vec::with_capacity(vocab * hidden * 2);
                for _ in 0..vocab {
                    let kind = rng.below(64);
                    let lone = rng.below(hidden);
                    for j in 0..hidden {
                        let bits = match kind {
                            0 if j == lone => special_bits(&mut rng, dtype, 2),
                            1..=40 if rng.below(8) == 0 => {
                                let class = rng.below(2);
                                special_bits(&mut rng, dtype, class)
                            }
                            _ if dtype == DType::BF16 => f32_to_bf16_bits(rng.uniform(-1.0, 1.0)),
                            _ => f32_to_f16_bits(rng.uniform(-1.0, 1.0)),
                        };
                        w.extend_from_slice(&bits.to_le_bytes());
                    }
                }
                let h: Vec<f32> = (0..rows * hidden)
                    .map(|_| rng.uniform(-2.0, 2.0) * 2f32.powi(50 + rng.below(21) as i32))
                    .collect();
                let what = format!("{dtype} rows {rows} {vocab}x{hidden} {}", variant.label());
                match compare_with_reference(&gpu, &head, rows, variant, &h, &w, None, &what) {
                    Ok(want) => nan_logits += want.iter().filter(|y| y.is_nan()).count(),
                    Err(failure) => failures.push(failure),
                }
                checked += 1;
            }
        }
    }
    println!("{checked} cases checked, {nan_logits} reference logits NaN");
    assert!(failures.is_empty(), "{} of {checked} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 4 * matrix.len(), "only {checked} cases ran");
    assert!(nan_logits > 0, "no case had a non-finite weight");
}
