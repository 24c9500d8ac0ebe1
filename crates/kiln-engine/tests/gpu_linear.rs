//! GPU tests of the linear kernels (`kiln_cuda::ops::linear`) against the CPU reference of the
//! GGUF formats (`kiln_engine::formats::quant::dequantize_row`):
//! - `linear`: every weight dtype, ragged shapes, 1..8 tokens, f32 and bf16 inputs, every epilogue
//!   and every variant (and the default), with and without bias, against a float64 product of the
//!   dequantized rows within `2e-6 sum |w| |x| + 1e-6`; outputs poisoned (NaN) or, for the residual
//!   add, filled with random values; guard bytes after each output must stay untouched; a second
//!   launch must give the same bits; the tensor-core (`/mma`) variants, which serve only BF16 and
//!   F16 weights at 2 to 8 tokens, are skipped by name elsewhere (their refusal checked) and run on
//!   every such configuration by a test of their own;
//! - `embed_rows`, `to_bf16_weights` and `f32_to_bf16`: equal to the reference bit for bit.
//!
//! Fresh random inputs every run (the seed is printed). `KILN_LINEAR_DTYPES=Q5_0,Q5_K` takes only
//! those weight dtypes in the products' tests (printed). Needs an NVIDIA GPU:
//! `cargo test --release -p kiln-engine --features gpu-tests --test gpu_linear`
//! (and `-- --ignored --nocapture` for the bandwidth table; `KILN_LINEAR_DTYPES=BF16,F16` limits it
//! to those weight dtypes).

use std::time::Instant;

use half::{bf16, f16};
use kiln_core::{DType, Error};
use kiln_cuda::ops::linear::{
    embed_rows, f32_to_bf16, int8_fused_shared_bytes, linear, linear_with_scratch, to_bf16_weights, Epilogue,
    LinearCall, LinearVariant, INT8_FUSED_ENV, INT8_VARIANTS, LINEAR_VARIANTS, WEIGHT_DTYPES,
};
use kiln_cuda::{DeviceMemory, Gpu};
use kiln_engine::formats::quant::dequantize_row;
use rayon::prelude::*;

#[path = "../../kiln-cuda/tests/common/mod.rs"]
mod common;
use common::Rng;

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn f16_bytes(&mut self, lo: f32, hi: f32) -> [u8; 2] {
        f16::from_f32(self.uniform(lo, hi)).to_bits().to_le_bytes()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const DTYPES: [DType; 15] = WEIGHT_DTYPES;

const GUARD_BYTES: usize = 256;

fn is_k(dtype: DType) -> bool {
    matches!(dtype, DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS)
}

/// (rows, cols): one row, odd rows, 2048 + 3 rows, 576 and 1536 columns, and one 14336.
fn shapes(dtype: DType) -> Vec<(usize, usize)> {
    if is_k(dtype) {
        vec![(1, 256), (37, 1536), (576, 512), (2051, 4096), (64, 14336), (5, 768)]
    } else {
        vec![(1, 32), (37, 1536), (576, 576), (2051, 4096), (64, 14336), (5, 96)]
    }
}

/// [`DTYPES`], or those `KILN_LINEAR_DTYPES` names (comma-separated; an unknown name fails),
/// printed: each dtype of the products' tests compiles every variant, so a run on new formats can
/// take only them.
fn selected_dtypes() -> Vec<DType> {
    let Ok(names) = std::env::var("KILN_LINEAR_DTYPES") else { return DTYPES.to_vec() };
    let selected: Vec<DType> = names
        .split(',')
        .map(|name| {
            let name = name.trim();
            DTYPES
                .into_iter()
                .find(|t| t.to_string().eq_ignore_ascii_case(name))
                .unwrap_or_else(|| panic!("KILN_LINEAR_DTYPES names {name:?}, not one of {DTYPES:?}"))
        })
        .collect();
    assert!(!selected.is_empty(), "KILN_LINEAR_DTYPES names no dtype");
    println!("KILN_LINEAR_DTYPES: only {selected:?} of {DTYPES:?}");
    selected
}

/// `rows` random rows of `dtype`: random floats for the float types; random quants with sane f16
/// scales (random signs) for the block formats.
fn random_weights(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let mut out = Vec::new();
    match dtype {
        DType::F32 => (0..n).for_each(|_| out.extend(rng.uniform(-1.0, 1.0).to_le_bytes())),
        DType::BF16 => {
            (0..n).for_each(|_| out.extend(bf16::from_f32(rng.uniform(-1.0, 1.0)).to_bits().to_le_bytes()))
        }
        DType::F16 => {
            (0..n).for_each(|_| out.extend(f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits().to_le_bytes()))
        }
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            for _ in 0..n / 32 {
                out.extend(rng.f16_bytes(-0.05, 0.05));
                if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                    out.extend(rng.f16_bytes(-0.2, 0.2));
                }
                // Q5_0 / Q5_1: 4 bytes of high bits before the 16 bytes of nibbles.
                let quants = match dtype {
                    DType::Q8_0 => 32,
                    DType::Q5_0 | DType::Q5_1 => 4 + 16,
                    _ => 16,
                };
                out.extend(rng.bytes(quants));
            }
        }
        DType::Q4_K | DType::Q5_K => {
            for _ in 0..n / 256 {
                out.extend(rng.f16_bytes(-0.01, 0.01));
                out.extend(rng.f16_bytes(-0.01, 0.01));
                // scales[12], (Q5_K: qh[32]), qs[128]
                out.extend(rng.bytes(if dtype == DType::Q5_K { 12 + 32 + 128 } else { 12 + 128 }));
            }
        }
        DType::Q2_K => {
            for _ in 0..n / 256 {
                // scales[16], qs[64], d, dmin
                out.extend(rng.bytes(16 + 64));
                out.extend(rng.f16_bytes(-0.01, 0.01));
                out.extend(rng.f16_bytes(-0.01, 0.01));
            }
        }
        DType::Q3_K => {
            for _ in 0..n / 256 {
                // hmask[32], qs[64], scales[12], d
                out.extend(rng.bytes(32 + 64 + 12));
                out.extend(rng.f16_bytes(-0.002, 0.002));
            }
        }
        DType::IQ4_NL => {
            for _ in 0..n / 32 {
                out.extend(rng.f16_bytes(-0.0005, 0.0005));
                out.extend(rng.bytes(16));
            }
        }
        DType::IQ4_XS => {
            for _ in 0..n / 256 {
                // d, scales_h, scales_l[4], qs[128]
                out.extend(rng.f16_bytes(-0.00003, 0.00003));
                out.extend(rng.bytes(2 + 4 + 128));
            }
        }
        DType::Q6_K => {
            for _ in 0..n / 256 {
                out.extend(rng.bytes(128 + 64 + 16));
                out.extend(rng.f16_bytes(-0.002, 0.002));
            }
        }
        other => panic!("no generator for {other}"),
    }
    assert_eq!(out.len() as u64, dtype.bytes_for(n as u64).unwrap());
    out
}

fn dequantize(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let row_bytes = bytes.len() / rows;
    let mut out = vec![0f32; rows * cols];
    for (r, values) in out.chunks_exact_mut(cols).enumerate() {
        dequantize_row(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], values).expect("CPU dequantizer");
    }
    out
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> DeviceMemory {
    let memory = gpu.alloc(bytes.len().max(1)).expect("device allocation");
    memory.copy_from_host(0, bytes).expect("host to device copy");
    memory
}

/// A buffer of `bytes` + guard bytes, all 0xFF (NaN as f32).
fn poisoned(gpu: &Gpu, bytes: usize) -> DeviceMemory {
    let memory = gpu.alloc(bytes + GUARD_BYTES).expect("device allocation");
    memory.fill_bytes(0xFF).expect("poison");
    memory
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The guard bytes after the first `bytes` of `memory` are still 0xFF.
fn guard_intact(host: &[u8], bytes: usize) -> bool {
    host[bytes..bytes + GUARD_BYTES].iter().all(|&b| b == 0xFF)
}

/// One weight matrix of a shape: `2 x rows` rows (SwiGLU uses them all, the others the first
/// `rows`), on the host dequantized, on the device as stored.
struct Weights {
    rows: usize,
    cols: usize,
    values: Vec<f32>,
    /// |the part of each value that multiplies x's int8 rounding on the integer path|: |w - m|
    /// for Q4_1 (whose offsets m meet the exact sum of x), |w| otherwise.
    ints: Vec<f32>,
    device: DeviceMemory,
    row_bytes: usize,
}

impl Weights {
    /// `2 x rows` rows of `dtype` in `bytes`, dequantized on the host and uploaded as stored.
    fn new(gpu: &Gpu, dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Weights {
        let values = dequantize(dtype, bytes, 2 * rows, cols);
        let ints = if dtype == DType::Q4_1 {
            // 20-byte blocks: d, m (f16), 16 bytes of quants.
            values
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let b = 20 * (i / 32);
                    let m = f16::from_bits(u16::from_le_bytes([bytes[b + 2], bytes[b + 3]])).to_f32();
                    (v - m).abs()
                })
                .collect()
        } else {
            values.iter().map(|v| v.abs()).collect()
        };
        Weights { rows, cols, values, ints, device: upload(gpu, bytes), row_bytes: bytes.len() / (2 * rows) }
    }
}

/// `(sum w x, sum |w| |x|)` of weight row `row` and token `t`, in float64.
fn dot(w: &Weights, x: &[f32], row: usize, t: usize) -> (f64, f64) {
    let wr = &w.values[row * w.cols..(row + 1) * w.cols];
    let xr = &x[t * w.cols..(t + 1) * w.cols];
    wr.iter().zip(xr).fold((0.0, 0.0), |(s, m), (&a, &b)| {
        let p = f64::from(a) * f64::from(b);
        (s + p, m + p.abs())
    })
}

/// The integer path's tolerance for weight row `row` and token `t`: x as 16-bit fixed point per
/// block moves each value by at most half its block's step (amax / (127 x 254) over 32 values),
/// times the integer part of
/// the weight; plus fp32 rounding of the block sums, `2e-6 sum (|w| + |int part|) |x| + 1e-6`.
fn int8_tolerance(w: &Weights, x: &[f32], row: usize, t: usize) -> f64 {
    let xr = &x[t * w.cols..(t + 1) * w.cols];
    let wr = &w.values[row * w.cols..(row + 1) * w.cols];
    let ir = &w.ints[row * w.cols..(row + 1) * w.cols];
    let mut rounding = 0.0f64;
    let mut magnitude = 0.0f64;
    for (b, xb) in xr.chunks(32).enumerate() {
        let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / (127.0 * 254.0);
        for (k, &xv) in xb.iter().enumerate() {
            let c = 32 * b + k;
            rounding += f64::from(ir[c]) * step / 2.0;
            magnitude += (f64::from(wr[c].abs()) + f64::from(ir[c])) * f64::from(xv.abs());
        }
    }
    1.0001 * rounding + 2e-6 * magnitude + 1e-6
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// Whether `variant` is a tensor-core (`/mma`) variant that `call` lies outside of (weights other
/// than BF16 / F16, or one token). The tests skip exactly these combinations, and only after
/// checking that `linear` refuses them with an error naming the variant.
fn mma_refuses(call: &LinearCall, variant: Option<LinearVariant>) -> bool {
    let Some(v) = variant.filter(|v| v.mma || v.int8) else { return false };
    let served = if v.int8 {
        matches!(call.weight, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
            && call.cols.is_multiple_of(128)
            && call.defines(v, false).is_ok()
    } else {
        matches!(call.weight, DType::BF16 | DType::F16) && (2..=8).contains(&call.tokens)
    };
    if !served {
        let refusal = call.defines(v, false);
        assert!(
            matches!(&refusal, Err(Error::NotServed { reason, .. }) if reason.contains(&v.label())),
            "{call:?} with {}: expected a refusal naming the variant, got {refusal:?}",
            v.label()
        );
    }
    !served
}

struct Case {
    call: LinearCall,
    variant: Option<LinearVariant>,
    bias: bool,
}

/// Runs `case` on `w` with fresh x, bias and initial output; returns the failures.
fn check_case(gpu: &Gpu, rng: &mut Rng, w: &Weights, case: &Case) -> Vec<String> {
    let call = &case.call;
    let (rows, cols, tokens) = (call.rows, call.cols, call.tokens);
    let gates = call.epilogue.weight_rows_per_output();
    let mut x: Vec<f32> = (0..tokens * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let x_bytes: Vec<u8> = if call.input == DType::BF16 {
        let bits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        x.iter_mut().zip(&bits).for_each(|(v, &b)| *v = bf16::from_bits(b).to_f32());
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    } else {
        to_bytes(&x)
    };
    let bias: Option<Vec<f32>> = case.bias.then(|| (0..rows).map(|_| rng.uniform(-1.0, 1.0)).collect());
    let initial: Vec<f32> = (0..tokens * rows).map(|_| rng.uniform(-4.0, 4.0)).collect();

    let x_dev = upload(gpu, &x_bytes);
    let bias_dev = bias.as_ref().map(|b| upload(gpu, &to_bytes(b)));
    let out_bytes = tokens * rows * 4;
    let run = || {
        let out = poisoned(gpu, out_bytes);
        if call.epilogue == Epilogue::Accumulate {
            out.copy_from_host(0, &to_bytes(&initial)).expect("initial output");
        }
        let weight = w.device.slice(0, rows * gates * w.row_bytes).expect("weight view");
        linear(
            gpu,
            call,
            weight,
            bias_dev.as_ref().map(DeviceMemory::view),
            x_dev.view(),
            out.slice(0, out_bytes).expect("out view"),
            case.variant,
        )
        .expect("launch");
        out.to_host_bytes().expect("copy back")
    };
    let host = run();
    let again = run();
    let what = format!(
        "{} {rows}x{cols} tokens {tokens} x {} {:?} bias {} variant {}",
        call.weight,
        call.input,
        call.epilogue,
        case.bias,
        case.variant.map_or("default".to_owned(), |v| v.label())
    );
    let mut failures = Vec::new();
    if !guard_intact(&host, out_bytes) {
        failures.push(format!("{what}: the guard bytes after the output were written"));
    }
    if host[..out_bytes] != again[..out_bytes] {
        failures.push(format!("{what}: a second launch gave different bits"));
    }
    let got = f32s(&host[..out_bytes]);
    let int8 = case.variant.unwrap_or_else(|| LinearVariant::default_for(call)).int8;
    let tolerance = |row: usize, t: usize, magnitude: f64| {
        if int8 {
            int8_tolerance(w, &x, row, t)
        } else {
            2e-6 * magnitude + 1e-6
        }
    };
    let expected: Vec<(f64, f64)> = (0..tokens * rows)
        .into_par_iter()
        .map(|j| {
            let (t, r) = (j / rows, j % rows);
            let (g, tg) = dot(w, &x, r, t);
            let tg = tolerance(r, t, tg);
            match call.epilogue {
                Epilogue::SwiGlu => {
                    let (u, tu) = dot(w, &x, rows + r, t);
                    let tu = tolerance(rows + r, t, tu);
                    let want = silu(g) * u;
                    (want, 1.1 * tg * u.abs() + silu(g).abs() * tu + tg * tu + 1e-6 * want.abs())
                }
                epilogue => {
                    let b = bias.as_ref().map_or(0.0, |b| f64::from(b[r]));
                    let old = if epilogue == Epilogue::Accumulate { f64::from(initial[j]) } else { 0.0 };
                    let want = old + g + b;
                    (want, tg + 2.4e-7 * (old.abs() + b.abs() + want.abs()))
                }
            }
        })
        .collect();
    let bad: Vec<usize> = (0..tokens * rows)
        .filter(|&j| {
            let (want, tol) = expected[j];
            !got[j].is_finite() || (f64::from(got[j]) - want).abs() > tol
        })
        .collect();
    if let Some(&j) = bad.first() {
        let (want, tol) = expected[j];
        failures.push(format!(
            "{what}: {} of {} outputs off; first [token {}][row {}] gpu {:e} want {want:e} (tolerance {tol:e})",
            bad.len(),
            tokens * rows,
            j / rows,
            j % rows,
            got[j]
        ));
    }
    failures
}

#[test]
fn linear_matches_a_float64_reference_for_every_dtype_epilogue_token_count_and_variant() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let epilogues = [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu];
    // Each dtype runs 24 configurations (every token count with every epilogue), going round the
    // variants, alternating the input dtype and the bias, each also with the default; each on
    // every shape.
    let options = LINEAR_VARIANTS.len() + 1;
    let mut checked = 0usize;
    let mut skipped = 0usize;
    let mut failures = Vec::new();
    for (d, dtype) in selected_dtypes().into_iter().enumerate() {
        let weights: Vec<Weights> = shapes(dtype)
            .into_iter()
            .map(|(rows, cols)| {
                let bytes = random_weights(&mut rng, dtype, 2 * rows, cols);
                Weights::new(&gpu, dtype, &bytes, rows, cols)
            })
            .collect();
        let mut k = d;
        for tokens in 1..=8 {
            for epilogue in epilogues {
                k += 1;
                let input = if k % 2 == 0 { DType::F32 } else { DType::BF16 };
                let bias = epilogue != Epilogue::SwiGlu && (k / 2) % 2 == 0;
                // The variant in turn, and the default (what the engine runs) every time.
                let turn = LINEAR_VARIANTS.get(k % options).copied();
                for variant in [turn, None].into_iter().take(if turn.is_some() { 2 } else { 1 }) {
                    for w in &weights {
                        let call =
                            LinearCall { weight: dtype, rows: w.rows, cols: w.cols, tokens, input, epilogue };
                        if mma_refuses(&call, variant) {
                            skipped += 1;
                            continue;
                        }
                        failures.extend(check_case(&gpu, &mut rng, w, &Case { call, variant, bias }));
                        checked += 1;
                    }
                }
            }
        }
    }
    println!("{checked} linear cases checked; {skipped} skipped (/mma variants refused, checked)");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn mma_variants_match_a_float64_reference_for_16_bit_weights_at_2_to_8_tokens() {
    // Every tensor-core variant on BF16 and F16 weights at every token count it serves (2 to 8),
    // with every epilogue and f32 and bf16 x (f32 x is split into 16-bit parts: the case the
    // tolerance is about), with and without bias, on every shape (ragged rows and columns, one
    // row, 32 columns, a column count that leaves a partial 32-column step).
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let variants: Vec<LinearVariant> = LINEAR_VARIANTS.iter().copied().filter(|v| v.mma).collect();
    assert!(!variants.is_empty(), "LINEAR_VARIANTS lists no /mma variant");
    let mut checked = 0usize;
    let mut failures = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        let weights: Vec<Weights> = shapes(dtype)
            .into_iter()
            .chain([(133, 4104)])
            .map(|(rows, cols)| {
                let bytes = random_weights(&mut rng, dtype, 2 * rows, cols);
                Weights::new(&gpu, dtype, &bytes, rows, cols)
            })
            .collect();
        for (k, &variant) in variants.iter().enumerate() {
            for tokens in 2..=8 {
                // The six (epilogue, input) pairs in turn over the token counts (each kernel build is
                // a compile: every pair for every variant, not every pair at every token count).
                let pair = (tokens + k) % 6;
                let epilogue = [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu][pair % 3];
                let input = if pair < 3 { DType::F32 } else { DType::BF16 };
                let bias = epilogue != Epilogue::SwiGlu && tokens % 2 == 0;
                for w in &weights {
                    let call =
                        LinearCall { weight: dtype, rows: w.rows, cols: w.cols, tokens, input, epilogue };
                    let case = Case { call, variant: Some(variant), bias };
                    failures.extend(check_case(&gpu, &mut rng, w, &case));
                    checked += 1;
                }
            }
        }
    }
    println!("{checked} /mma cases checked");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn int8_variants_stay_within_their_rounding_bound() {
    // Every integer-path variant on Q8_0, Q4_0 and Q4_1 weights, at 1, 2, 3, 5 and 8 tokens, the
    // six (epilogue, input) pairs in turn, with and without bias, on every shape it serves: lanes
    // per row 8 (128 and 1536 columns), 16 (2048) and 32 (4096, 14336; a lane's share ragged),
    // ragged and single rows; against the float64 product within the int8 rounding bound.
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut checked = 0usize;
    let mut refused = 0usize;
    let mut fused = 0usize;
    let mut failures = Vec::new();
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let weights: Vec<Weights> =
            [(3usize, 128usize), (37, 1536), (130, 2048), (1, 4096), (2051, 4096), (64, 14336)]
                .into_iter()
                .map(|(rows, cols)| {
                    let bytes = random_weights(&mut rng, dtype, 2 * rows, cols);
                    Weights::new(&gpu, dtype, &bytes, rows, cols)
                })
                .collect();
        for (k, &variant) in INT8_VARIANTS.iter().enumerate() {
            for tokens in [1usize, 2, 3, 5, 8] {
                let pair = (tokens + k) % 6;
                let epilogue = [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu][pair % 3];
                let input = if pair < 3 { DType::F32 } else { DType::BF16 };
                let bias = epilogue != Epilogue::SwiGlu && tokens % 2 == 1;
                // One token: x rounded by a launch of its own (the default), and inside the product
                // kernel where it fits (KILN_INT8_FUSED=1).
                let fused_too: &[bool] = if tokens == 1 { &[false, true] } else { &[false] };
                for &fuse in fused_too {
                    if fuse {
                        std::env::set_var(INT8_FUSED_ENV, "1");
                    }
                    for w in &weights {
                        let call =
                            LinearCall { weight: dtype, rows: w.rows, cols: w.cols, tokens, input, epilogue };
                        if mma_refuses(&call, Some(variant)) {
                            refused += 1;
                            continue;
                        }
                        if int8_fused_shared_bytes(&call, variant).is_some() {
                            fused += 1;
                        }
                        failures.extend(check_case(
                            &gpu,
                            &mut rng,
                            w,
                            &Case { call, variant: Some(variant), bias },
                        ));
                        checked += 1;
                    }
                    std::env::remove_var(INT8_FUSED_ENV);
                }
            }
        }
        // The integer path refuses columns that are not a multiple of 128, by name.
        let call = LinearCall {
            weight: dtype,
            rows: 4,
            cols: 576,
            tokens: 1,
            input: DType::F32,
            epilogue: Epilogue::Store,
        };
        assert!(mma_refuses(&call, Some(INT8_VARIANTS[0])), "{dtype} with 576 columns");
    }
    for dtype in [DType::F32, DType::BF16, DType::Q4_K, DType::Q6_K] {
        let call = LinearCall {
            weight: dtype,
            rows: 4,
            cols: 256,
            tokens: 1,
            input: DType::F32,
            epilogue: Epilogue::Store,
        };
        assert!(mma_refuses(&call, Some(INT8_VARIANTS[0])), "{dtype} on the integer path");
    }
    println!("{checked} integer-path cases checked ({fused} with x rounded inside the product kernel), {refused} refused (checked by name)");
    assert!(checked > 300, "only {checked} integer-path cases ran");
    assert!(fused > 50, "only {fused} cases rounded x inside the product kernel");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn mma_variants_keep_the_tolerance_on_wide_ranges_of_x() {
    // The f16 path scales x per token and 32-column step by a power of two: tokens whose x spans
    // 1e-30 to 1e30 (beyond f16's range), a token of zeros, and steps mixing tiny and huge values.
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut failures = Vec::new();
    let (rows, cols) = (75usize, 1000usize);
    for dtype in [DType::BF16, DType::F16] {
        let bytes = random_weights(&mut rng, dtype, 2 * rows, cols);
        let w = Weights::new(&gpu, dtype, &bytes, rows, cols);
        for variant in LINEAR_VARIANTS.iter().copied().filter(|v| v.mma) {
            for epilogue in [Epilogue::Store, Epilogue::Accumulate] {
                let tokens = 8;
                let call = LinearCall { weight: dtype, rows, cols, tokens, input: DType::F32, epilogue };
                failures.extend(check_wide_x(&gpu, &mut rng, &w, &call, variant));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// `call` (Store or Accumulate, f32 x) on x whose tokens have magnitudes 10^(-30 + 8t) (token 7
/// all zeros), every 5th value of token 3 a thousand times larger: against the float64 product
/// within `2e-6 sum |w| |x| + 1e-6` (plus the initial output's rounding).
fn check_wide_x(
    gpu: &Gpu,
    rng: &mut Rng,
    w: &Weights,
    call: &LinearCall,
    variant: LinearVariant,
) -> Vec<String> {
    let (rows, cols, tokens) = (call.rows, call.cols, call.tokens);
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| {
            let (t, c) = (i / cols, i % cols);
            let magnitude = if t == 7 { 0.0 } else { 10f32.powi(-30 + 8 * t as i32) };
            let spike = if t == 3 && c % 5 == 0 { 1000.0 } else { 1.0 };
            rng.uniform(-1.0, 1.0) * magnitude * spike
        })
        .collect();
    let initial: Vec<f32> = (0..tokens * rows).map(|_| rng.uniform(-4.0, 4.0)).collect();
    let x_dev = upload(gpu, &to_bytes(&x));
    let out_bytes = tokens * rows * 4;
    let out = poisoned(gpu, out_bytes);
    if call.epilogue == Epilogue::Accumulate {
        out.copy_from_host(0, &to_bytes(&initial)).expect("initial output");
    }
    let weight = w.device.slice(0, rows * w.row_bytes).expect("weight view");
    let out_view = out.slice(0, out_bytes).expect("out view");
    linear(gpu, call, weight, None, x_dev.view(), out_view, Some(variant)).expect("launch");
    let host = out.to_host_bytes().expect("copy back");
    let what =
        format!("{} {rows}x{cols} wide x {:?} variant {}", call.weight, call.epilogue, variant.label());
    let mut failures = Vec::new();
    if !guard_intact(&host, out_bytes) {
        failures.push(format!("{what}: the guard bytes after the output were written"));
    }
    let got = f32s(&host[..out_bytes]);
    for j in 0..tokens * rows {
        let (t, r) = (j / rows, j % rows);
        let (sum, magnitude) = dot(w, &x, r, t);
        let old = if call.epilogue == Epilogue::Accumulate { f64::from(initial[j]) } else { 0.0 };
        let want = old + sum;
        let tol = 2e-6 * magnitude + 1e-6 + 2.4e-7 * (old.abs() + want.abs());
        if !got[j].is_finite() || (f64::from(got[j]) - want).abs() > tol {
            failures.push(format!(
                "{what}: [token {t}][row {r}] gpu {:e} want {want:e} (tolerance {tol:e})",
                got[j]
            ));
            break;
        }
    }
    failures
}

#[test]
fn every_variant_serves_the_largest_configurations() {
    // The test above gives each variant some configurations; here every variant runs the widest
    // ones (8 tokens, SwiGLU and the residual add) on the 4-bit and 16-bit formats (the /mma
    // variants, refused for the 4-bit ones, are skipped there).
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut failures = Vec::new();
    let mut skipped = 0usize;
    for dtype in [DType::F16, DType::BF16, DType::Q4_K, DType::Q4_1] {
        let (rows, cols) = if is_k(dtype) { (133, 1536) } else { (133, 576) };
        let bytes = random_weights(&mut rng, dtype, 2 * rows, cols);
        let w = Weights::new(&gpu, dtype, &bytes, rows, cols);
        for variant in LINEAR_VARIANTS {
            for (epilogue, bias) in [(Epilogue::SwiGlu, false), (Epilogue::Accumulate, true)] {
                let call = LinearCall { weight: dtype, rows, cols, tokens: 8, input: DType::F32, epilogue };
                if mma_refuses(&call, Some(*variant)) {
                    skipped += 1;
                    continue;
                }
                failures.extend(check_case(
                    &gpu,
                    &mut rng,
                    &w,
                    &Case { call, variant: Some(*variant), bias },
                ));
            }
        }
    }
    let mma_variants = LINEAR_VARIANTS.iter().filter(|v| v.mma).count();
    assert_eq!(skipped, mma_variants * 2 * 2, "only the /mma variants on Q4_K and Q4_1 are skipped");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn embed_rows_equal_the_dequantized_rows_and_zeros_past_the_vocabulary() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    for dtype in DTYPES {
        let (vocab, cols) = if is_k(dtype) { (300, 1536) } else { (300, 576) };
        let bytes = random_weights(&mut rng, dtype, vocab, cols);
        let values = dequantize(dtype, &bytes, vocab, cols);
        let mut ids: Vec<u32> = (0..9).map(|_| rng.below(vocab) as u32).collect();
        ids[2] = vocab as u32; // first id past the vocabulary
        ids[6] = u32::MAX;
        ids[7] = (vocab - 1) as u32;
        let tokens = ids.len();
        let table = upload(&gpu, &bytes);
        let ids_dev = upload(&gpu, &ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<_>>());
        let out = poisoned(&gpu, tokens * cols * 4);
        let out_view = out.slice(0, tokens * cols * 4).expect("out view");
        embed_rows(&gpu, dtype, table.view(), vocab, cols, ids_dev.view(), tokens, out_view).expect("launch");
        let host = out.to_host_bytes().expect("copy back");
        assert!(guard_intact(&host, tokens * cols * 4), "{dtype}: guard bytes written");
        let got = f32s(&host[..tokens * cols * 4]);
        for (t, &id) in ids.iter().enumerate() {
            let row = &got[t * cols..(t + 1) * cols];
            if (id as usize) < vocab {
                let want = &values[id as usize * cols..(id as usize + 1) * cols];
                let bad = (0..cols).find(|&c| row[c].to_bits() != want[c].to_bits());
                assert!(
                    bad.is_none(),
                    "{dtype} token {t} id {id}: column {bad:?} differs: {row:?} vs {want:?}"
                );
            } else {
                assert!(row.iter().all(|v| v.to_bits() == 0), "{dtype} token {t} id {id}: not a zero row");
            }
        }
    }
}

#[test]
fn bf16_weights_equal_the_rounded_dequantized_rows() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    for dtype in DTYPES {
        for (rows, cols) in shapes(dtype).into_iter().filter(|&(r, _)| r < 1000) {
            let bytes = random_weights(&mut rng, dtype, rows, cols);
            let want: Vec<u16> =
                dequantize(dtype, &bytes, rows, cols).iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let src = upload(&gpu, &bytes);
            let out = poisoned(&gpu, rows * cols * 2);
            let out_view = out.slice(0, rows * cols * 2).expect("out view");
            to_bf16_weights(&gpu, dtype, src.view(), rows, cols, out_view).expect("launch");
            let host = out.to_host_bytes().expect("copy back");
            assert!(guard_intact(&host, rows * cols * 2), "{dtype} {rows}x{cols}: guard bytes written");
            let got: Vec<u16> =
                host[..rows * cols * 2].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            let bad: Vec<usize> = (0..rows * cols).filter(|&i| got[i] != want[i]).collect();
            assert!(
                bad.is_empty(),
                "{dtype} {rows}x{cols}: {} values differ; first {} gpu {:#06x} want {:#06x}",
                bad.len(),
                bad[0],
                got[bad[0]],
                want[bad[0]]
            );
        }
    }
}

#[test]
fn f32_to_bf16_rounds_to_nearest_even_like_the_half_crate() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let count = 100_003;
    let mut values: Vec<f32> = (0..count)
        .map(|i| if i % 2 == 0 { f32::from_bits(rng.next() as u32) } else { rng.uniform(-100.0, 100.0) })
        .collect();
    // Ties to even, the carry into the exponent, overflow to infinity, subnormals, infinities.
    let edges = [
        0x3F80_8000u32,
        0x3F81_8000,
        0x3F80_7FFF,
        0x3FFF_8000,
        0x7F7F_FFFF,
        0x0000_8000,
        0x8001_8000,
        0x7F80_0000,
    ];
    for (i, bits) in edges.into_iter().enumerate() {
        values[i * 7] = f32::from_bits(bits);
    }
    let src = upload(&gpu, &to_bytes(&values));
    let out = poisoned(&gpu, count * 2);
    f32_to_bf16(&gpu, src.view(), count, out.slice(0, count * 2).expect("out view")).expect("launch");
    let host = out.to_host_bytes().expect("copy back");
    assert!(guard_intact(&host, count * 2), "guard bytes written");
    for (i, &v) in values.iter().enumerate() {
        let got = u16::from_le_bytes([host[2 * i], host[2 * i + 1]]);
        let want = bf16::from_f32(v);
        let same = got == want.to_bits() || (v.is_nan() && bf16::from_bits(got).is_nan());
        assert!(same, "value {i} {v:e} ({:#010x}): gpu {got:#06x} want {:#06x}", v.to_bits(), want.to_bits());
    }
}

/// Bytes per second of a device-to-device copy of 1 GiB (read plus written), the ceiling the
/// products are measured against: 20 copies between two synchronizations.
fn copy_bytes_per_second(gpu: &Gpu) -> f64 {
    let bytes = 1usize << 30;
    let (src, dst) =
        (gpu.alloc(bytes).expect("device allocation"), gpu.alloc(bytes).expect("device allocation"));
    src.fill_bytes(0x3C).expect("fill");
    dst.copy_from_device(&src).expect("copy");
    gpu.synchronize().expect("synchronize");
    let copies = 20;
    let started = Instant::now();
    (0..copies).for_each(|_| dst.copy_from_device(&src).expect("copy"));
    gpu.synchronize().expect("synchronize");
    (2 * bytes * copies) as f64 / started.elapsed().as_secs_f64()
}

/// Weight bandwidth of decode products (1 and 8 tokens; 2 and 4 too for 16-bit weights) at 4096 x 4096 and 14336 x 4096, for the
/// default and every variant, in GB/s and as a share of a device copy measured in the same run:
/// 50 launches between two synchronizations, the weights rotated over copies that together exceed
/// the L2 cache. Per dtype and token count, a line per shape with every variant, then the default
/// and the fastest variant over both shapes (the sum of their times).
#[test]
#[ignore = "prints a bandwidth table; run with --ignored --nocapture"]
fn bandwidth_of_one_token_products() {
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let copy = copy_bytes_per_second(&gpu);
    println!("device copy: {:.0} GB/s (read + written)", copy / 1e9);
    let launches = 50;
    // KILN_LINEAR_DTYPES=BF16,F16 limits the table to those weight dtypes (each variant of each
    // dtype and token count is a compile: the whole table takes minutes).
    for dtype in selected_dtypes() {
        let shapes = [(4096usize, 4096usize), (14336, 4096)];
        let uploaded: Vec<(Vec<DeviceMemory>, usize)> = shapes
            .iter()
            .map(|&(rows, cols)| {
                let bytes = random_weights(&mut rng, dtype, rows, cols);
                let copies = (256usize << 20).div_ceil(bytes.len()).max(2);
                ((0..copies).map(|_| upload(&gpu, &bytes)).collect(), bytes.len())
            })
            .collect();
        // 16-bit weights also at 2 and 4 tokens, where the /mma variants compete.
        let token_counts: &[usize] =
            if matches!(dtype, DType::BF16 | DType::F16) { &[1, 2, 4, 8] } else { &[1, 8] };
        for &tokens in token_counts {
            // Seconds per launch of each variant on each shape; index 0 the default.
            let mut labels: Vec<String> = Vec::new();
            let mut seconds: Vec<Vec<f64>> = Vec::new();
            for (s, &(rows, cols)) in shapes.iter().enumerate() {
                let (weights, weight_bytes) = (&uploaded[s].0, uploaded[s].1);
                let x_values: Vec<f32> = (0..tokens * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
                let x = upload(&gpu, &to_bytes(&x_values));
                let out = gpu.alloc(tokens * rows * 4).expect("device allocation");
                let call = LinearCall {
                    weight: dtype,
                    rows,
                    cols,
                    tokens,
                    input: DType::F32,
                    epilogue: Epilogue::Store,
                };
                let default = LinearVariant::default_for(&call);
                let scratch = gpu.alloc(call.int8_scratch_bytes().max(16)).expect("device allocation");
                let mut line = format!("{dtype:>5} {tokens} tok {rows:>5}x{cols}:");
                for (v, variant) in std::iter::once(default)
                    .chain(LINEAR_VARIANTS.iter().copied())
                    .chain(INT8_VARIANTS.iter().copied())
                    .enumerate()
                {
                    if s == 0 {
                        labels.push(format!("{}{}", if v == 0 { "default " } else { "" }, variant.label()));
                        seconds.push(Vec::new());
                    }
                    if mma_refuses(&call, Some(variant)) {
                        // Refused (checked): never the fastest.
                        line += &format!(" {} n/a", variant.label());
                        seconds[v].push(f64::INFINITY);
                        continue;
                    }
                    let launch = |i: usize| {
                        let weight = weights[i % weights.len()].view();
                        let scratch = Some(scratch.view());
                        linear_with_scratch(
                            &gpu,
                            &call,
                            weight,
                            None,
                            x.view(),
                            out.view(),
                            Some(variant),
                            scratch,
                        )
                        .expect("launch");
                    };
                    (0..5).for_each(launch);
                    gpu.synchronize().expect("synchronize");
                    let started = Instant::now();
                    (0..launches).for_each(launch);
                    gpu.synchronize().expect("synchronize");
                    let per_launch = started.elapsed().as_secs_f64() / launches as f64;
                    let rate = weight_bytes as f64 / per_launch;
                    let mark = if v == 0 { "default " } else { "" };
                    line += &format!(
                        " {mark}{} {:.0} ({:.0}%)",
                        variant.label(),
                        rate / 1e9,
                        100.0 * rate / copy
                    );
                    seconds[v].push(per_launch);
                }
                println!("{line}");
            }
            let total_bytes: usize = uploaded.iter().map(|u| u.1).sum();
            let share = |v: usize| {
                let rate = total_bytes as f64 / seconds[v].iter().sum::<f64>();
                format!("{} {:.0} GB/s {:.1}% of copy", labels[v], rate / 1e9, 100.0 * rate / copy)
            };
            let best = (1..seconds.len())
                .min_by(|&a, &b| seconds[a].iter().sum::<f64>().total_cmp(&seconds[b].iter().sum::<f64>()))
                .expect("variants");
            println!("{dtype:>5} {tokens} tok  both shapes: {} | best variant {}", share(0), share(best));
        }
    }
}

fn norm_buffers<'a>(
    x: &'a DeviceMemory,
    weight: &'a DeviceMemory,
    out: &'a DeviceMemory,
) -> kiln_cuda::ops::norm::NormBuffers<'a> {
    kiln_cuda::ops::norm::NormBuffers {
        x,
        residual: None,
        weight: Some(weight),
        bias: None,
        gate: None,
        out,
        scales: None,
    }
}

#[test]
fn norm_planes_equal_the_rounding_launch_bit_for_bit() {
    // The decode norm can write its output rounded as the integer-path products take it
    // (`norm_with_int8_planes`), so the product after it runs without a rounding launch
    // (`linear_prequantized`). The planes must be the very bytes the rounding launch writes from
    // the norm's fp32 output, and the products the same bits, for every weight format (Q4_0
    // keeps an integer block sum, the others a float one), one and several tokens, rows of one
    // unit of 128 to 32 units; the fp32 output is unchanged.
    use kiln_core::ops::norm::RmsNorm;
    use kiln_cuda::ops::linear::{int8_scratch_bytes, linear_prequantized};
    use kiln_cuda::ops::norm::{norm, norm_with_int8_planes, NormCall};
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let mut checked = 0;
    for dtype in [DType::Q4_0, DType::Q8_0, DType::Q4_1] {
        for (cols, tokens) in [(128usize, 1usize), (1536, 1), (4096, 1), (4096, 3), (2048, 8)] {
            let rows = 96;
            let w = Weights::new(&gpu, dtype, &random_weights(&mut rng, dtype, 2 * rows, cols), rows, cols);
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.uniform(-4.0, 4.0)).collect();
            let gamma: Vec<f32> = (0..cols).map(|_| rng.uniform(0.5, 1.5)).collect();
            let (x_dev, gamma_dev) = (upload(&gpu, &to_bytes(&x)), upload(&gpu, &to_bytes(&gamma)));
            let call = NormCall {
                spec: RmsNorm::llama(1e-5, DType::F32).into(),
                rows: tokens,
                hidden: cols,
                x_type: DType::F32,
                weight_type: DType::F32,
            };
            let scratch_bytes = int8_scratch_bytes(tokens, cols);
            for epilogue in [Epilogue::Store, Epilogue::SwiGlu] {
                let product = LinearCall { weight: dtype, rows, cols, tokens, input: DType::F32, epilogue };
                // The norm, then the product with its own rounding launch.
                let (h_a, scratch_a, out_a) = (
                    poisoned(&gpu, tokens * cols * 4),
                    poisoned(&gpu, scratch_bytes),
                    poisoned(&gpu, tokens * rows * 4),
                );
                norm(&gpu, &call, norm_buffers(&x_dev, &gamma_dev, &h_a), None).expect("norm");
                let launches = linear_with_scratch(
                    &gpu,
                    &product,
                    w.device.view(),
                    None,
                    h_a.view(),
                    out_a.view(),
                    None,
                    Some(scratch_a.view()),
                )
                .expect("product with its rounding launch");
                assert_eq!(launches, 2, "{dtype} {cols} columns: the default should round x itself");
                // The norm writing the planes, then the product without a rounding launch.
                let (h_b, scratch_b, out_b) = (
                    poisoned(&gpu, tokens * cols * 4),
                    poisoned(&gpu, scratch_bytes),
                    poisoned(&gpu, tokens * rows * 4),
                );
                norm_with_int8_planes(
                    &gpu,
                    &call,
                    norm_buffers(&x_dev, &gamma_dev, &h_b),
                    None,
                    scratch_b.view(),
                    dtype,
                )
                .expect("norm with planes");
                let launches = linear_prequantized(
                    &gpu,
                    &product,
                    w.device.view(),
                    None,
                    scratch_b.view(),
                    out_b.view(),
                    None,
                )
                .expect("product on the planes");
                assert_eq!(launches, 1);
                gpu.synchronize().expect("sync");
                let what = format!("{dtype} {tokens}x{cols} {epilogue:?}");
                let (h_a, h_b) = (h_a.to_host_bytes().expect("h"), h_b.to_host_bytes().expect("h"));
                assert!(h_a == h_b, "{what}: the norm's fp32 output changed");
                let (s_a, s_b) = (
                    scratch_a.to_host_bytes().expect("scratch"),
                    scratch_b.to_host_bytes().expect("scratch"),
                );
                assert!(guard_intact(&s_b, scratch_bytes), "{what}: the norm wrote past the planes");
                if let Some(i) = (0..scratch_bytes).find(|&i| s_a[i] != s_b[i]) {
                    panic!("{what}: planes differ from the rounding launch's first at byte {i} of {scratch_bytes}");
                }
                let (o_a, o_b) = (out_a.to_host_bytes().expect("out"), out_b.to_host_bytes().expect("out"));
                assert!(o_a[..tokens * rows * 4] == o_b[..tokens * rows * 4], "{what}: the products differ");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 30);
}

#[test]
fn pipelined_int8_products_equal_the_plain_kernel_bit_for_bit() {
    // The pipelined integer path (KILN_INT8_PIPE=1, the default at one token: a persistent grid,
    // two rounds of weights in flight a warp) sums every row in the order of the plain kernel: the outputs must be the
    // same bits, for every variant it serves, every weight format and epilogue, one to eight
    // tokens, rows of one unit of 128 to 112 units (a lane's share ragged), row counts that leave
    // warps with one, several or no row groups, and the 8B decode shapes.
    use kiln_cuda::ops::linear::{int8_scratch_bytes, INT8_PIPE_ENV};
    let gpu = Gpu::open(0).expect("the GPU tests need CUDA device 0");
    let mut rng = Rng::fresh();
    let (mut checked, mut pipelined) = (0usize, 0usize);
    let mut failures = Vec::new();
    let shapes = [(3usize, 128usize), (37, 1536), (2051, 4096), (4096, 14336), (6144, 4096), (14336, 4096)];
    for dtype in [DType::Q4_0, DType::Q8_0, DType::Q4_1] {
        for &(rows, cols) in &shapes {
            let w = Weights::new(&gpu, dtype, &random_weights(&mut rng, dtype, 2 * rows, cols), rows, cols);
            for tokens in [1usize, 2, 8] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.uniform(-3.0, 3.0)).collect();
                let x_dev = upload(&gpu, &to_bytes(&x));
                for epilogue in [Epilogue::Store, Epilogue::SwiGlu, Epilogue::Accumulate] {
                    let call = LinearCall { weight: dtype, rows, cols, tokens, input: DType::F32, epilogue };
                    let variants: Vec<Option<LinearVariant>> =
                        std::iter::once(None).chain(INT8_VARIANTS.iter().map(|&v| Some(v))).collect();
                    for variant in variants {
                        if mma_refuses(&call, variant) {
                            continue;
                        }
                        let start: Vec<f32> = (0..tokens * rows).map(|_| rng.uniform(-1.0, 1.0)).collect();
                        let run = |pipe: bool| {
                            std::env::set_var(INT8_PIPE_ENV, if pipe { "1" } else { "0" });
                            let v = variant.unwrap_or_else(|| LinearVariant::default_for(&call));
                            let served = call.int8_pipelined(v);
                            let out = upload(&gpu, &to_bytes(&start));
                            let scratch = poisoned(&gpu, int8_scratch_bytes(tokens, cols));
                            let result = linear_with_scratch(
                                &gpu,
                                &call,
                                w.device.view(),
                                None,
                                x_dev.view(),
                                out.view(),
                                Some(v),
                                Some(scratch.view()),
                            );
                            std::env::remove_var(INT8_PIPE_ENV);
                            result.expect("integer-path product");
                            gpu.synchronize().expect("sync");
                            (out.to_host_bytes().expect("out"), served)
                        };
                        let (plain, _) = run(false);
                        let (piped, served) = run(true);
                        if !served {
                            continue;
                        }
                        pipelined += 1;
                        checked += 1;
                        if plain != piped {
                            let v = variant.map_or("default".to_owned(), |v| v.label());
                            failures.push(format!("{dtype} {rows}x{cols} {tokens} tokens {epilogue:?} {v}"));
                        }
                    }
                }
            }
        }
    }
    println!("{checked} pipelined integer-path products compared with the plain kernel");
    assert!(pipelined > 100, "only {pipelined} calls ran pipelined");
    assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
}
