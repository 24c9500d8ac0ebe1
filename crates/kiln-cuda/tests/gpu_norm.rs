//! GPU tests of the norm kernel: every flavor, dtype and variant equal to the CPU reference
//! (`kiln_core::ops::norm`) bit for bit, on fresh random inputs over ragged shapes, with the
//! outputs poisoned before each launch. Needs an NVIDIA GPU: `cargo test -p kiln-cuda
//! --features gpu-tests --test gpu_norm`.

use kiln_core::ops::norm::{
    Gate, LayerNorm, NormInputs, NormOutput, NormSpec, RmsNorm, RmsNormRounding, WeightMode,
};
use kiln_core::ops::primitives::FloatType;
use kiln_core::ops::quantize::{Quantized, Quantizer};
use kiln_core::DType;
use kiln_cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use kiln_cuda::ops::norm::{norm, NormBuffers, NormCall, NormVariant, NORM_VARIANTS};
use kiln_cuda::{DeviceMemory, Gpu, KernelSource};

mod common;
use common::Rng;

impl Rng {
    /// Uniform in [lo, hi), rounded to `ty`.
    fn values(&mut self, len: usize, lo: f32, hi: f32, ty: FloatType) -> Vec<f32> {
        (0..len)
            .map(|_| ty.round(lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)))
            .collect()
    }
}

fn encode(values: &[f32], ty: FloatType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * ty.bytes());
    for &v in values {
        ty.encode(v, &mut out);
    }
    out
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

fn first_difference(want: &[u8], got: &[u8]) -> Option<usize> {
    want.iter().zip(got).position(|(a, b)| a != b)
}

/// The first byte of the first element of type `ty` whose bits differ between `want` and `got`,
/// where a NaN equals any NaN: the kernels' arithmetic gives the GPU's NaN (the prelude keeps
/// NaN-ness, not payloads), the reference's the CPU's. Every other value, infinities and signed
/// zeros included, must have the same bits.
fn first_float_difference(want: &[u8], got: &[u8], ty: FloatType) -> Option<usize> {
    let size = ty.bytes();
    (0..want.len() / size)
        .find(|&i| {
            let (w, g) = (ty.decode(want, i), ty.decode(got, i));
            want[i * size..(i + 1) * size] != got[i * size..(i + 1) * size] && !(w.is_nan() && g.is_nan())
        })
        .map(|i| i * size)
}

/// Runs one call on the GPU and the CPU and asserts the bytes are equal, with or without the
/// residual add at random.
fn check(gpu: &Gpu, rng: &mut Rng, call: NormCall, variant: NormVariant) {
    let with_residual = rng.next().is_multiple_of(2);
    check_with(gpu, rng, call, variant, with_residual);
}

/// [`check`] with or without the residual add as given, on fresh random x.
fn check_with(gpu: &Gpu, rng: &mut Rng, call: NormCall, variant: NormVariant, with_residual: bool) {
    let xt = FloatType::of(call.x_type, "test").unwrap();
    let x = rng.values(call.rows * call.hidden, -2.0, 2.0, xt);
    check_on(gpu, rng, call, variant, &x, with_residual);
}

/// Each launch with the residual add or without it, at random (decided before the kernels are
/// compiled, so that [`warm`] compiles exactly the kernels the checks launch).
fn with_random_residuals(
    rng: &mut Rng,
    launches: &[(NormCall, NormVariant)],
) -> Vec<(NormCall, NormVariant, bool)> {
    launches.iter().map(|&(call, variant)| (call, variant, rng.next().is_multiple_of(2))).collect()
}

/// [`check`] on the given x (already in x's type), with or without the residual add.
fn check_on(gpu: &Gpu, rng: &mut Rng, call: NormCall, variant: NormVariant, x: &[f32], with_residual: bool) {
    check_on_weight(gpu, rng, call, variant, x, with_residual, None);
}

/// [`check_on`] with the given weight (in the weight's type), random when `None`.
fn check_on_weight(
    gpu: &Gpu,
    rng: &mut Rng,
    call: NormCall,
    variant: NormVariant,
    x: &[f32],
    with_residual: bool,
    weight: Option<&[f32]>,
) {
    check_variants_on_weight(gpu, rng, call, &[variant], x, with_residual, weight);
}

/// [`check_on_weight`] on each of `variants` in turn, from the same inputs and one run of the
/// reference (the residual uploaded again and the outputs poisoned again before each launch).
fn check_variants_on_weight(
    gpu: &Gpu,
    rng: &mut Rng,
    call: NormCall,
    variants: &[NormVariant],
    x: &[f32],
    with_residual: bool,
    weight: Option<&[f32]>,
) {
    let (rows, hidden) = (call.rows, call.hidden);
    let xt = FloatType::of(call.x_type, "test").unwrap();
    let wt = FloatType::of(call.weight_type, "test").unwrap();
    let s = call.spec;
    let residual = rng.values(rows * hidden, -2.0, 2.0, xt);
    let weight = weight.map_or_else(|| rng.values(hidden, 0.25, 1.75, wt), <[f32]>::to_vec);
    let bias = rng.values(hidden, -0.5, 0.5, wt);
    let gate = rng.values(rows * hidden, -6.0, 6.0, xt);
    let inputs = NormInputs {
        x,
        x_type: call.x_type,
        residual: with_residual.then_some(&residual[..]),
        weight: (s.weight != WeightMode::None).then_some(&weight[..]),
        bias: s.bias.then_some(&bias[..]),
        gate: s.gate.map(|_| &gate[..]),
    };
    let want = s.run(hidden, &inputs).expect("CPU reference");

    let (_, _, out_bytes, scale_bytes) = call.buffer_bytes().unwrap();
    let dx = upload(gpu, &encode(x, xt));
    let residual_bytes = encode(&residual, xt);
    let dres = upload(gpu, &residual_bytes);
    let dw = upload(gpu, &encode(&weight, wt));
    let db = upload(gpu, &encode(&bias, wt));
    let dg = upload(gpu, &encode(&gate, xt));
    let dout = poisoned(gpu, out_bytes);
    let dscales = poisoned(gpu, scale_bytes);
    for (i, &variant) in variants.iter().enumerate() {
        if i > 0 {
            dres.copy_from_host(0, &residual_bytes).expect("host to device copy");
            dout.fill_bytes(0xA7).expect("poison");
            dscales.fill_bytes(0xA7).expect("poison");
        }
        compare_launch(
            gpu,
            &call,
            variant,
            &inputs,
            &want,
            [&dx, &dres, &dw, &db, &dg, &dout, &dscales],
            with_residual,
        );
    }
}

/// Launches `variant` on the uploaded inputs (x, residual, weight, bias, gate, out, scales) and
/// asserts its outputs equal the reference's `want`.
#[allow(clippy::too_many_arguments)]
fn compare_launch(
    gpu: &Gpu,
    call: &NormCall,
    variant: NormVariant,
    inputs: &NormInputs<'_>,
    want: &kiln_core::ops::norm::NormResult,
    [dx, dres, dw, db, dg, dout, dscales]: [&DeviceMemory; 7],
    with_residual: bool,
) {
    let (s, xt) = (call.spec, FloatType::of(call.x_type, "test").unwrap());
    let (_, _, _, scale_bytes) = call.buffer_bytes().unwrap();
    let buffers = NormBuffers {
        x: dx,
        residual: with_residual.then_some(dres),
        weight: inputs.weight.map(|_| dw),
        bias: inputs.bias.map(|_| db),
        gate: inputs.gate.map(|_| dg),
        out: dout,
        scales: (scale_bytes > 0).then_some(dscales),
    };
    let label = format!("{call:?} {variant:?} residual={with_residual}");
    norm(gpu, call, buffers, Some(variant)).unwrap_or_else(|e| panic!("{label}: {e}"));
    gpu.synchronize().unwrap_or_else(|e| panic!("{label}: {e}"));

    let got_out = dout.to_host_bytes().unwrap();
    let out_type = match s.out {
        NormOutput::Float(dtype) => Some(FloatType::of(dtype, "test").unwrap()),
        _ => None,
    };
    let (want_out, want_scales) = match (&s.out, &want.quantized) {
        (NormOutput::Float(dtype), _) => {
            (encode(&want.y, FloatType::of(*dtype, "test").unwrap()), Vec::new())
        }
        (_, Some(Quantized::Int8 { codes, scales })) => {
            (codes.iter().map(|&c| c as u8).collect(), scales.iter().flat_map(|s| s.to_le_bytes()).collect())
        }
        (_, Some(Quantized::Nvfp4 { packed, scales })) => (packed.clone(), scales.clone()),
        (_, Some(Quantized::Fp8E4m3 { codes })) => (codes.clone(), Vec::new()),
        (_, None) => panic!("{label}: the reference returned no quantized output"),
    };
    let differs = match out_type {
        Some(ty) => first_float_difference(&want_out, &got_out[..want_out.len()], ty),
        None => first_difference(&want_out, &got_out[..want_out.len()]),
    };
    if let Some(i) = differs {
        panic!("{label}: output byte {i} differs: want {:#04x}, got {:#04x}", want_out[i], got_out[i]);
    }
    if scale_bytes > 0 {
        let got = dscales.to_host_bytes().unwrap();
        if let Some(i) = first_difference(&want_scales, &got[..want_scales.len()]) {
            panic!("{label}: scale byte {i} differs: want {:#04x}, got {:#04x}", want_scales[i], got[i]);
        }
    }
    if let Some(res) = &want.residual {
        let got = dres.to_host_bytes().unwrap();
        let want = encode(res, xt);
        if let Some(i) = first_float_difference(&want, &got, xt) {
            panic!("{label}: residual byte {i} differs: want {:#04x}, got {:#04x}", want[i], got[i]);
        }
    }
}

fn gpu() -> std::sync::Arc<Gpu> {
    Gpu::open(0).expect("these tests need a CUDA GPU (device 0)")
}

/// Compiles the kernel of every one of these launches (a call, its variant, and whether it adds
/// the residual) on every host thread (`ops::norm::warm`) before the checks that launch them one
/// after another: those then load each from the disk cache instead of waiting for NVRTC. The
/// checks are the same.
fn warm(gpu: &Gpu, launches: &[(NormCall, NormVariant, bool)]) {
    let started = std::time::Instant::now();
    match kiln_cuda::ops::norm::warm(gpu, launches) {
        Ok(compiled) => eprintln!(
            "warm-up: {compiled} of {} kernels compiled in {:.1} s",
            launches.len(),
            started.elapsed().as_secs_f64()
        ),
        Err(e) => panic!("compiling the norm kernels ahead: {e}"),
    }
}

/// Ragged shapes: rows 1 to 8192, hidden sizes that are and are not multiples of 256, up to 16384;
/// the last two have more groups of rows than a persistent grid has blocks (each block loops,
/// loading its next group early; 3001 rows leave the last group of two rows half empty).
const SHAPES: &[(usize, usize)] = &[
    (1, 4096),
    (3, 1000),
    (7, 16),
    (64, 2056),
    (5, 16_384),
    (8192, 256),
    (129, 4104),
    (2, 8192),
    (1500, 4104),
    (3001, 1000),
];

#[test]
fn every_variant_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let spec: NormSpec = RmsNorm::llama(1e-5, DType::BF16).into();
    let mut launches = Vec::new();
    for &variant in NORM_VARIANTS {
        for &(rows, hidden) in SHAPES {
            let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
            if call.validate(variant).is_ok() {
                launches.push((call, variant));
            }
        }
    }
    let served = launches.len();
    assert!(served >= NORM_VARIANTS.len() * 3, "only {served} variant/shape pairs served");

    // Every variant once more with fp32 and fp16 x (fp32 x holds two 16-byte vectors per unit):
    // LayerNorm with a bias (the weight and bias loaded early where the variant does) and INT8
    // RMSNorm outputs.
    let layer: NormSpec = LayerNorm {
        eps: 1e-5,
        weight: WeightMode::Plain,
        bias: true,
        groups: 1,
        out: NormOutput::Float(DType::F16),
    }
    .into();
    let int8: NormSpec =
        RmsNorm { out: NormOutput::Quantized(Quantizer::Int8), ..RmsNorm::llama(1e-6, DType::F16) }.into();
    for &variant in NORM_VARIANTS {
        for (spec, x_type, weight_type) in [(layer, DType::F32, DType::F16), (int8, DType::F16, DType::F32)] {
            let call = NormCall { spec, rows: 17, hidden: 2064, x_type, weight_type };
            call.validate(variant).unwrap_or_else(|e| panic!("{variant:?} serves 2064: {e}"));
            launches.push((call, variant));
        }
    }
    let launches = with_random_residuals(&mut rng, &launches);
    warm(&gpu, &launches);
    for &(call, variant, with_residual) in &launches {
        check_with(&gpu, &mut rng, call, variant, with_residual);
    }
}

/// Rows whose every block of 16 is one of two multisets of dyadic values with squares summing to
/// 16, shuffled, with random signs: the mean square is exactly 1, so with eps = 1e-30 (absorbed
/// by the 1) r is exactly 1 and y = x. Blocks {2, 1 x 11, 0.5 x 4} put INT8 codes at 63.5 times
/// the reference's rounded scale (within 1e-6 of a tie); blocks {3, 1.75, 1.25, 0.875, 0.625,
/// 0.375, 0.125, 1, 0.25, 0 x 7} with the NVFP4 global scale 2 (scale code 1.0, inverse 2
/// exactly) put E2M1 inputs exactly on every rounding tie (0.25, 0.75, ... 5).
fn tie_rows(rng: &mut Rng, rows: usize, hidden: usize) -> Vec<f32> {
    const INT8_TIES: [f32; 16] =
        [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5];
    const NVFP4_TIES: [f32; 16] =
        [3.0, 1.75, 1.25, 0.875, 0.625, 0.375, 0.125, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let mut x = Vec::with_capacity(rows * hidden);
    for _ in 0..rows * hidden / 16 {
        let mut block = if rng.next().is_multiple_of(2) { INT8_TIES } else { NVFP4_TIES };
        for i in (1..16).rev() {
            block.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        x.extend(block.iter().map(|&v| if rng.next().is_multiple_of(2) { -v } else { v }));
    }
    x
}

#[test]
fn quantized_outputs_on_rounding_ties_match_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let mut checked = 0;
    for out in [Quantizer::Int8, Quantizer::Nvfp4 { global_scale: 2.0 }] {
        for rounding in [RmsNormRounding::HuggingFace, RmsNormRounding::Single] {
            let spec: NormSpec = RmsNorm {
                weight: WeightMode::None,
                rounding,
                out: NormOutput::Quantized(out),
                ..RmsNorm::llama(1e-30, DType::BF16)
            }
            .into();
            for &(rows, hidden) in &[(37usize, 1024usize), (300, 4096), (3, 8192)] {
                let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
                let x = tie_rows(&mut rng, rows, hidden);
                // The premise: r is exactly 1 on the CPU (the same norm into fp32 returns x), so
                // the codes sit on the ties.
                let fp32: NormSpec = RmsNorm {
                    weight: WeightMode::None,
                    rounding,
                    out: NormOutput::Float(DType::F32),
                    ..RmsNorm::llama(1e-30, DType::BF16)
                }
                .into();
                let y = fp32
                    .run(
                        hidden,
                        &NormInputs {
                            x: &x,
                            x_type: DType::BF16,
                            residual: None,
                            weight: None,
                            bias: None,
                            gate: None,
                        },
                    )
                    .expect("CPU reference")
                    .y;
                assert_eq!(y, x, "y = x on tie rows");
                for &variant in NORM_VARIANTS.iter().filter(|v| call.validate(**v).is_ok()) {
                    check_on(&gpu, &mut rng, call, variant, &x, false);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= NORM_VARIANTS.len() * 4, "only {checked} variant/shape pairs served");
}

/// Weights with NaN, infinities and zeros here and there: blocks of 16 with a NaN value (whose
/// block maximum the reference takes without it, and whose code is -127 for INT8), infinite
/// values (an infinite maximum), all-zero blocks, and blocks of values near 1e-35 and 1e35
/// (maxima outside the range of the kernel's fast division), for the quantized outputs, every
/// variant.
#[test]
fn quantized_outputs_of_nan_and_infinite_values_match_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    for out in [Quantizer::Int8, Quantizer::Nvfp4 { global_scale: 448.0 }] {
        let spec: NormSpec =
            RmsNorm { out: NormOutput::Quantized(out), ..RmsNorm::llama(1e-5, DType::BF16) }.into();
        let (rows, hidden) = (70usize, 4096usize);
        let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
        let mut weight = rng.values(hidden, 0.25, 1.75, FloatType::BF16);
        for (i, w) in weight.iter_mut().enumerate() {
            match (i / 16) % 8 {
                1 if i % 16 == 5 => *w = f32::NAN,
                2 => *w *= 1e-35,
                3 if i % 16 == 0 => *w = -f32::NAN,
                4 if i % 16 == 9 => *w = f32::INFINITY,
                5 => *w *= 1e35,
                6 => *w = 0.0,
                _ => {}
            }
            *w = FloatType::BF16.round(*w);
        }
        let x = rng.values(rows * hidden, -2.0, 2.0, FloatType::BF16);
        for &variant in NORM_VARIANTS.iter().filter(|v| call.validate(**v).is_ok()) {
            check_on_weight(&gpu, &mut rng, call, variant, &x, false, Some(&weight));
        }
    }
}

/// NVFP4 outputs with global scales outside the fast path's range (2^-80 to 2^80: the kernel
/// then takes the reference's way for every block), and at its two ends, on every variant.
#[test]
fn nvfp4_outputs_of_extreme_global_scales_match_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let (rows, hidden) = (70usize, 4096usize);
    let mut checked = 0;
    // (global scale, weight factor): the weight scaled so that the blocks' scaled maxima stay in
    // range where the global scale alone is out of it (or just in it).
    for (global_scale, factor) in [
        (1e30f32, 1.0f32),
        (1e-30, 1.0),
        (2f32.powi(80), 2f32.powi(-82)),
        (2f32.powi(81), 2f32.powi(-82)),
        (2f32.powi(-80), 2f32.powi(82)),
        (2f32.powi(-81), 2f32.powi(82)),
    ] {
        let spec: NormSpec = RmsNorm {
            out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale }),
            ..RmsNorm::llama(1e-5, DType::BF16)
        }
        .into();
        let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
        let x = rng.values(rows * hidden, -2.0, 2.0, FloatType::BF16);
        let weight: Vec<f32> = rng
            .values(hidden, 0.25, 1.75, FloatType::BF16)
            .iter()
            .map(|w| FloatType::BF16.round(w * factor))
            .collect();
        for &variant in NORM_VARIANTS.iter().filter(|v| call.validate(**v).is_ok()) {
            check_on_weight(&gpu, &mut rng, call, variant, &x, checked % 2 == 1, Some(&weight));
            checked += 1;
        }
    }
    assert!(checked >= 60, "only {checked} checks served");
}

/// bf16 outputs of Hugging Face's rounding (the kernel's packed `fma.rn.bf16x2` product) with
/// weights over bf16's whole range: subnormal, tiny and huge magnitudes, so that round(x_r * w)
/// underflows to subnormals and zero and overflows to infinity, every variant, with and without
/// the residual.
#[test]
fn bf16_outputs_of_extreme_weights_match_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let spec: NormSpec = RmsNorm::llama(1e-5, DType::BF16).into();
    let (rows, hidden) = (40usize, 4096usize);
    let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
    let mut weight = Vec::with_capacity(hidden);
    for i in 0..hidden {
        // bf16 bits with every exponent (0: subnormals and zero; 0xFE: up to the largest finite).
        let exponent = (rng.next() % 255) as u32;
        let bits =
            (u32::from(i % 2 == 1) << 31) | (exponent << 23) | (((rng.next() >> 20) as u32 & 0x7F) << 16);
        weight.push(f32::from_bits(bits));
    }
    let x = rng.values(rows * hidden, -2.0, 2.0, FloatType::BF16);
    let mut checked = 0;
    for &variant in NORM_VARIANTS.iter().filter(|v| call.validate(**v).is_ok()) {
        check_on_weight(&gpu, &mut rng, call, variant, &x, checked % 2 == 1, Some(&weight));
        checked += 1;
    }
    assert!(checked >= NORM_VARIANTS.len() / 2, "only {checked} variants served");
}

fn flavors() -> Vec<NormSpec> {
    let rms = RmsNorm::llama(1e-6, DType::BF16);
    let single = RmsNorm { rounding: RmsNormRounding::Single, ..rms };
    let layer = LayerNorm {
        eps: 1e-5,
        weight: WeightMode::Plain,
        bias: true,
        groups: 1,
        out: NormOutput::Float(DType::BF16),
    };
    vec![
        rms.into(),
        RmsNorm { weight: WeightMode::OnePlus, ..single }.into(),
        RmsNorm { weight: WeightMode::None, ..single }.into(),
        RmsNorm { bias: true, ..single }.into(),
        RmsNorm { gate: Some(Gate::Before), groups: 4, ..rms }.into(),
        RmsNorm { gate: Some(Gate::After), ..single }.into(),
        RmsNorm { groups: 8, ..rms }.into(),
        RmsNorm { out: NormOutput::Quantized(Quantizer::Int8), ..rms }.into(),
        RmsNorm { out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 448.0 * 6.0 / 3.0 }), ..rms }
            .into(),
        RmsNorm { out: NormOutput::Quantized(Quantizer::Fp8E4m3 { scale: 1.0 / 64.0 }), ..single }.into(),
        layer.into(),
        LayerNorm { weight: WeightMode::OnePlus, bias: false, ..layer }.into(),
        LayerNorm { out: NormOutput::Quantized(Quantizer::Int8), ..layer }.into(),
    ]
}

#[test]
fn every_flavor_and_dtype_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let types = [DType::BF16, DType::F16, DType::F32];
    let mut launches = Vec::new();
    for spec in flavors() {
        for (i, &x_type) in types.iter().enumerate() {
            let weight_type = types[(i + 1) % 3];
            let mut spec = spec;
            if let NormOutput::Float(_) = spec.out {
                spec.out = NormOutput::Float(types[(i + 2) % 3]);
            }
            for &(rows, hidden) in &[(3usize, 1024usize), (17, 4352), (2, 16_384), (700, 4352)] {
                let call = NormCall { spec, rows, hidden, x_type, weight_type };
                let variant = NormVariant::default_for(&call);
                launches.push((call, variant));
                let other = NORM_VARIANTS.iter().rev().find(|v| **v != variant && call.validate(**v).is_ok());
                if let Some(&other) = other {
                    launches.push((call, other));
                }
                // 700 rows (2800 segments with 4 groups): every persistent variant loops, with the
                // weight reloaded per segment when there are groups.
                if rows == 700 {
                    for &p in NORM_VARIANTS.iter().filter(|v| v.persistent && call.validate(**v).is_ok()) {
                        launches.push((call, p));
                    }
                }
            }
        }
    }
    let launches = with_random_residuals(&mut rng, &launches);
    warm(&gpu, &launches);
    for &(call, variant, with_residual) in &launches {
        check_with(&gpu, &mut rng, call, variant, with_residual);
    }
    assert!(launches.len() >= flavors().len() * 3 * 4, "only {} checks", launches.len());
}

/// The staged variants alone (a quick check of them: `cargo test ... --test gpu_norm staged`):
/// every flavor and dtype (plain, residual, gate, groups, bias, LayerNorm, INT8, NVFP4, FP8) over
/// ragged shapes, with the grid much smaller than the row count (each block walks many groups,
/// stages wrapping around) and with fewer groups than stages, with and without the residual.
#[test]
fn staged_variants_match_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let staged: Vec<NormVariant> = NORM_VARIANTS.iter().copied().filter(|v| v.stages > 0).collect();
    assert!(staged.len() >= 4, "{staged:?}");
    let mut checked = 0;
    let types = [DType::BF16, DType::F16, DType::F32];
    for (f, spec) in flavors().into_iter().enumerate() {
        // Each flavor in one x type (all three over the flavors), the weight in the next.
        let (x_type, weight_type) = (types[f % 3], types[(f + 1) % 3]);
        let mut spec = spec;
        if let NormOutput::Float(_) = spec.out {
            spec.out = NormOutput::Float(types[(f + 2) % 3]);
        }
        // 3 rows of 1040: fewer groups than stages; 3001 rows: a block walks 11 or more.
        for &(rows, hidden) in &[(3usize, 1040usize), (3001, 1056), (9, 8192)] {
            let call = NormCall { spec, rows, hidden, x_type, weight_type };
            for &variant in staged.iter().filter(|v| call.validate(**v).is_ok()) {
                let xt = FloatType::of(x_type, "test").unwrap();
                let x = rng.values(rows * hidden, -2.0, 2.0, xt);
                check_on(&gpu, &mut rng, call, variant, &x, checked % 2 == 1);
                checked += 1;
            }
        }
    }
    // The benchmark's bf16 cases at 2048 x 4096 (plain, INT8, NVFP4, LayerNorm; the residual at
    // random), and NVFP4 at 8192 x 8192, on every staged variant.
    let flavor = flavors();
    let bench =
        [(flavor[0], 2048, 4096), (flavor[7], 2048, 4096), (flavor[8], 2048, 4096), (flavor[10], 2048, 4096)];
    for (spec, rows, hidden) in bench.into_iter().chain([(flavor[8], 8192usize, 8192usize)]) {
        let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
        for &variant in staged.iter().filter(|v| call.validate(**v).is_ok()) {
            check(&gpu, &mut rng, call, variant);
            checked += 1;
        }
    }
    assert!(checked >= 100, "only {checked} staged checks served");
}

/// The one-lane-a-block variants alone (`NormVariant::block_lane`, labels `+b`; a quick check:
/// `cargo test ... --test gpu_norm block_lane`), over the cases of
/// [`check_variants_over_flavors_and_edges`].
#[test]
fn block_lane_variants_match_the_reference() {
    let lanes: Vec<NormVariant> = NORM_VARIANTS.iter().copied().filter(|v| v.block_lane).collect();
    assert!(lanes.len() >= 4, "{lanes:?}");
    let checked = check_variants_over_flavors_and_edges(&lanes);
    assert!(checked >= 200, "only {checked} block-lane checks served");
}

/// The variants that load the weight a unit ahead (`NormVariant::weight_ahead`, labels `+w`) and
/// the block-lane ones that load it with x (`+e+b`) alone (a quick check: `cargo test ...
/// --test gpu_norm weight_ahead`): the cases of [`block_lane_variants_match_the_reference`].
#[test]
fn weight_ahead_and_early_block_lane_variants_match_the_reference() {
    let listed: Vec<NormVariant> = NORM_VARIANTS
        .iter()
        .copied()
        .filter(|v| v.weight_ahead || (v.block_lane && v.early_weight))
        .collect();
    assert!(listed.len() >= 8, "{listed:?}");
    let checked = check_variants_over_flavors_and_edges(&listed);
    assert!(checked >= 200, "only {checked} checks served");
}

/// LayerNorm of 2-byte x at 8 units a warp (the kernel's own launch bounds there: 1024 threads a
/// multiprocessor for weight, bias and a 2-byte output without a residual, one block a
/// multiprocessor for the rest): the benchmark's defaults at 4096 and 8192 (2w1r+n, 4w1r+n) and
/// the `+t` forms of their shapes, with and without the bias, the residual and a 2-byte output (a
/// quick check: `cargo test ... --test gpu_norm layer_norm_at`).
#[test]
fn layer_norm_at_8_units_a_warp_matches_the_reference() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let layer = LayerNorm {
        eps: 1e-5,
        weight: WeightMode::Plain,
        bias: true,
        groups: 1,
        out: NormOutput::Float(DType::BF16),
    };
    let mut checked = 0;
    for (spec, x_type, weight_type) in [
        (layer, DType::BF16, DType::BF16),
        (LayerNorm { bias: false, out: NormOutput::Float(DType::F32), ..layer }, DType::BF16, DType::BF16),
        (
            LayerNorm { weight: WeightMode::OnePlus, out: NormOutput::Float(DType::F16), ..layer },
            DType::F16,
            DType::F32,
        ),
    ] {
        for (rows, hidden) in [(300usize, 4096usize), (100, 8192)] {
            let call = NormCall { spec: spec.into(), rows, hidden, x_type, weight_type };
            let default = NormVariant::default_for(&call);
            assert_eq!(default.units_per_warp(hidden), Some(8), "{call:?}");
            // The default has its length compiled in (+n); its +t form is listed without it.
            let total = NormVariant { row_total: true, fixed_n: false, ..default };
            assert!(NORM_VARIANTS.contains(&total), "{total:?}");
            let xt = FloatType::of(x_type, "test").unwrap();
            let x = rng.values(rows * hidden, -2.0, 2.0, xt);
            for with_residual in [false, true] {
                check_variants_on_weight(&gpu, &mut rng, call, &[default, total], &x, with_residual, None);
                checked += 2;
            }
        }
    }
    assert_eq!(checked, 24);
}

/// The variants whose row's first warp alone finishes the row's total (`NormVariant::row_total`,
/// labels `+t`) alone (a quick check: `cargo test ... --test gpu_norm row_total`): the cases of
/// [`block_lane_variants_match_the_reference`], LayerNorm's two totals among them.
#[test]
fn row_total_variants_match_the_reference() {
    let listed: Vec<NormVariant> = NORM_VARIANTS.iter().copied().filter(|v| v.row_total).collect();
    assert!(listed.len() >= 4 && listed.iter().any(|v| v.block_lane), "{listed:?}");
    let checked = check_variants_over_flavors_and_edges(&listed);
    assert!(checked >= 200, "only {checked} checks served");
}

/// The variants with the segment length compiled in (`NormVariant::fixed_n`, labels `+n`) alone
/// (a quick check: `cargo test ... --test gpu_norm fixed_n`): the cases of
/// [`block_lane_variants_match_the_reference`], every one a kernel of its own length.
#[test]
fn fixed_n_variants_match_the_reference() {
    let listed: Vec<NormVariant> = NORM_VARIANTS.iter().copied().filter(|v| v.fixed_n).collect();
    assert!(listed.len() >= 4 && listed.iter().any(|v| v.block_lane) && listed.iter().any(|v| !v.block_lane));
    let checked = check_variants_over_flavors_and_edges(&listed);
    assert!(checked >= 200, "only {checked} checks served");
}

/// Every flavor (INT8 and NVFP4 outputs among them, and LayerNorm into INT8; those in every x
/// dtype) over ragged shapes (one block, rows of a unit and a block, fewer units than a warp's
/// pair, rows that leave lanes past the end), with and without the residual; the benchmark's INT8
/// and NVFP4 cases; rounding ties and NaN, infinite, tiny and huge blocks: on each of `variants`
/// that serves the call. Returns the checks run.
fn check_variants_over_flavors_and_edges(lanes: &[NormVariant]) -> usize {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let mut checked = 0;
    let types = [DType::BF16, DType::F16, DType::F32];
    let mut edges = Vec::new();
    for (f, spec) in flavors().into_iter().enumerate() {
        // Each flavor in one x type (all three over the flavors, and the quantized outputs in
        // two more below), the weight in the next.
        let (x_type, weight_type) = (types[f % 3], types[(f + 1) % 3]);
        let mut spec = spec;
        if let NormOutput::Float(_) = spec.out {
            spec.out = NormOutput::Float(types[(f + 2) % 3]);
        }
        let blocked = matches!(spec.out, NormOutput::Quantized(Quantizer::Int8 | Quantizer::Nvfp4 { .. }));
        let x_types: &[DType] = if blocked { &types } else { std::slice::from_ref(&x_type) };
        for &x_type in x_types {
            for &(rows, hidden) in &[(3usize, 1040usize), (7, 16), (65, 4112), (2, 16_384), (301, 2080)] {
                let call = NormCall { spec, rows, hidden, x_type, weight_type };
                for &variant in lanes.iter().filter(|v| call.validate(**v).is_ok()) {
                    edges.push((call, variant));
                }
            }
        }
    }
    let flavor = flavors();
    let large = [
        (flavor[7], 2048usize, 4096usize),
        (flavor[8], 2048, 4096),
        (flavor[7], 8192, 8192),
        (flavor[8], 8192, 8192),
    ]
    .map(|(spec, rows, hidden)| NormCall {
        spec,
        rows,
        hidden,
        x_type: DType::BF16,
        weight_type: DType::BF16,
    });
    let tie_calls: Vec<NormCall> = [Quantizer::Int8, Quantizer::Nvfp4 { global_scale: 2.0 }]
        .into_iter()
        .flat_map(|out| {
            let tie: NormSpec = RmsNorm {
                weight: WeightMode::None,
                out: NormOutput::Quantized(out),
                ..RmsNorm::llama(1e-30, DType::BF16)
            }
            .into();
            let special: NormSpec =
                RmsNorm { out: NormOutput::Quantized(out), ..RmsNorm::llama(1e-5, DType::BF16) }.into();
            [(tie, 300), (special, 70)].map(|(spec, rows)| NormCall {
                spec,
                rows,
                hidden: 4096,
                x_type: DType::BF16,
                weight_type: DType::BF16,
            })
        })
        .collect();
    // The edges alternate without and with the residual; the large calls and the ties have none,
    // the special values have it (below).
    let edges: Vec<(NormCall, NormVariant, bool)> =
        edges.into_iter().enumerate().map(|(i, (call, variant))| (call, variant, i % 2 == 1)).collect();
    let mut launches = edges.clone();
    for (i, call) in large.iter().chain(&tie_calls).enumerate() {
        let with_residual = i >= large.len() && (i - large.len()) % 2 == 1;
        launches
            .extend(lanes.iter().filter(|v| call.validate(**v).is_ok()).map(|&v| (*call, v, with_residual)));
    }
    warm(&gpu, &launches);
    for &(call, variant, with_residual) in &edges {
        let xt = FloatType::of(call.x_type, "test").unwrap();
        let x = rng.values(call.rows * call.hidden, -2.0, 2.0, xt);
        check_on(&gpu, &mut rng, call, variant, &x, with_residual);
        checked += 1;
    }
    for call in large {
        let (rows, hidden) = (call.rows, call.hidden);
        let x = rng.values(rows * hidden, -2.0, 2.0, FloatType::BF16);
        // One reference run for every variant (the CPU's norm of 8192 x 8192 takes seconds).
        let served: Vec<NormVariant> = lanes.iter().copied().filter(|v| call.validate(*v).is_ok()).collect();
        check_variants_on_weight(&gpu, &mut rng, call, &served, &x, false, None);
        checked += served.len();
    }
    // Ties (y = x, see tie_rows) and blocks with NaN, infinite, zero, tiny and huge values.
    for pair in tie_calls.chunks(2) {
        let (call, hidden) = (pair[0], pair[0].hidden);
        let x = tie_rows(&mut rng, call.rows, hidden);
        let served: Vec<NormVariant> = lanes.iter().copied().filter(|v| call.validate(*v).is_ok()).collect();
        check_variants_on_weight(&gpu, &mut rng, call, &served, &x, false, None);
        checked += served.len();
        let call = pair[1];
        let mut weight = rng.values(hidden, 0.25, 1.75, FloatType::BF16);
        for (i, w) in weight.iter_mut().enumerate() {
            match (i / 16) % 8 {
                1 if i % 16 == 11 => *w = f32::NAN,
                2 => *w *= 1e-35,
                4 if i % 16 == 3 => *w = f32::NEG_INFINITY,
                5 => *w *= 1e35,
                6 => *w = 0.0,
                _ => {}
            }
            *w = FloatType::BF16.round(*w);
        }
        let x = rng.values(70 * hidden, -2.0, 2.0, FloatType::BF16);
        let served: Vec<NormVariant> = lanes.iter().copied().filter(|v| call.validate(*v).is_ok()).collect();
        check_variants_on_weight(&gpu, &mut rng, call, &served, &x, true, Some(&weight));
        checked += served.len();
    }
    checked
}

/// The kernel's E2M1 encoder on its own, one code per input float.
static E2M1_PROBE: KernelSource = KernelSource {
    name: "e2m1_probe",
    source: concat!(
        include_str!("../kernels/deterministic.cuh"),
        "extern \"C\" __global__ void e2m1_probe(const unsigned int* in, unsigned char* out, long long n) {\n",
        "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n",
        "    if (i < n) out[i] = (unsigned char)kiln_f32_to_e2m1(__uint_as_float(in[i]));\n",
        "}\n"
    ),
    define_sets: &[&[]],
    fmad: false,
};

#[test]
fn e2m1_matches_the_reference_around_every_threshold_and_on_random_floats() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let mut bits: Vec<u32> =
        vec![0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFC0_0000, 0x7F7F_FFFF, 0x0000_0001];
    for t in [0.0f32, 0.25, 0.5, 0.75, 1.0, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0] {
        for signed in [t, -t] {
            let b = signed.to_bits() as i64;
            bits.extend((-4096..=4096).map(|d| (b + d).clamp(0, u32::MAX as i64) as u32));
        }
    }
    bits.extend((0..1 << 22).map(|_| (rng.next() >> 32) as u32));
    let want: Vec<u8> =
        bits.iter().map(|&b| kiln_core::ops::quantize::f32_to_e2m1(f32::from_bits(b))).collect();

    let input = upload(&gpu, &bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>());
    let out = poisoned(&gpu, bits.len());
    let function = gpu.function(&E2M1_PROBE, "e2m1_probe", &[]).expect("compile the probe");
    let n = bits.len() as i64;
    let (pin, pout) = (input.device_ptr(), out.device_ptr());
    let config = LaunchConfig {
        grid_dim: (bits.len().div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = gpu.stream();
    let mut launch = stream.launch_builder(&function);
    launch.arg(&pin).arg(&pout).arg(&n);
    // SAFETY: two device pointers and an i64 as the probe declares; `input` holds n u32 and `out`
    // n bytes.
    unsafe { launch.launch(config) }.expect("launch the probe");
    gpu.synchronize().expect("run the probe");
    let got = out.to_host_bytes().unwrap();
    for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w, g, "E2M1 of {:#010x} ({}): want {w:#x}, got {g:#x}", bits[i], f32::from_bits(bits[i]));
    }
}

/// The kernels' packed hardware conversions on their own: per input float, its bf16 and fp16
/// bits (`kiln_pack2`) and its E4M3 code (`kiln_e4m3x2`), and the value of every E4M3 code
/// (`kiln_e4m3_value`).
static CONVERT_PROBE: KernelSource = KernelSource {
    name: "convert_probe",
    source: concat!(
        include_str!("../kernels/deterministic.cuh"),
        "extern \"C\" __global__ void convert_probe(const unsigned int* in, unsigned int* halves,\n",
        "                                          unsigned char* e4m3, float* e4m3_values, long long n) {\n",
        "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n",
        "    if (i < n) {\n",
        "        float v = __uint_as_float(in[i]);\n",
        "        unsigned int b = kiln_pack2<KILN_BF16>(v, 1.0f), h = kiln_pack2<KILN_F16>(1.0f, v);\n",
        "        halves[i] = (b & 0xFFFFu) | (h & 0xFFFF0000u);\n",
        "        e4m3[i] = (unsigned char)(kiln_e4m3x2(v, 1.0f) & 0xFFu);\n",
        "    }\n",
        "    if (i < 256) e4m3_values[i] = kiln_e4m3_value((unsigned int)i);\n",
        "}\n"
    ),
    define_sets: &[&[]],
    fmad: false,
};

#[test]
fn packed_conversions_match_the_reference() {
    use kiln_core::ops::primitives::{f32_to_bf16_bits, f32_to_f16_bits};
    use kiln_core::ops::quantize::{e4m3_to_f32, f32_to_e4m3};
    let gpu = gpu();
    let mut rng = Rng::fresh();
    // Specials, subnormals of every format, and the neighbourhood of every fp16 / bf16 / E4M3
    // rounding boundary near 1, the largest finite values and the overflow thresholds.
    let mut bits: Vec<u32> = vec![
        0x0000_0000,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000,
    ];
    for v in
        [1.0f32, 1.5, 448.0, 464.0, 480.0, 65504.0, 65520.0, 2f32.powi(-9), 2f32.powi(-10), 2f32.powi(-14)]
    {
        for signed in [v, -v] {
            let b = signed.to_bits() as i64;
            bits.extend((-70_000..=70_000).step_by(7).map(|d| (b + d).clamp(0, u32::MAX as i64) as u32));
        }
    }
    bits.extend((0..1 << 22).map(|_| (rng.next() >> 32) as u32));
    let n = bits.len();

    let input = upload(&gpu, &bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>());
    let halves = poisoned(&gpu, 4 * n);
    let e4m3 = poisoned(&gpu, n);
    let values = poisoned(&gpu, 4 * 256);
    let function = gpu.function(&CONVERT_PROBE, "convert_probe", &[]).expect("compile the probe");
    let (pin, phalves, pe4m3, pvalues, count) =
        (input.device_ptr(), halves.device_ptr(), e4m3.device_ptr(), values.device_ptr(), n as i64);
    let config = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = gpu.stream();
    let mut launch = stream.launch_builder(&function);
    launch.arg(&pin).arg(&phalves).arg(&pe4m3).arg(&pvalues).arg(&count);
    // SAFETY: four device pointers and an i64 as the probe declares; `input` holds n u32,
    // `halves` n u32, `e4m3` n bytes, `values` 256 f32 (n > 256).
    unsafe { launch.launch(config) }.expect("launch the probe");
    gpu.synchronize().expect("run the probe");

    let got_halves = halves.to_host_bytes().unwrap();
    let got_e4m3 = e4m3.to_host_bytes().unwrap();
    for (i, &b) in bits.iter().enumerate() {
        let v = f32::from_bits(b);
        let word = u32::from_le_bytes(got_halves[4 * i..4 * i + 4].try_into().unwrap());
        let (bf16, f16) = ((word & 0xFFFF) as u16, (word >> 16) as u16);
        if v.is_nan() {
            // The hardware returns the canonical NaN, as every GPU operation does; only NaN-ness counts.
            assert!(bf16 & 0x7F80 == 0x7F80 && bf16 & 0x7F != 0, "bf16 of NaN {b:#010x}: {bf16:#06x}");
            assert!(f16 & 0x7C00 == 0x7C00 && f16 & 0x3FF != 0, "fp16 of NaN {b:#010x}: {f16:#06x}");
            assert_eq!(got_e4m3[i] & 0x7F, 0x7F, "E4M3 of NaN {b:#010x}");
            continue;
        }
        assert_eq!(bf16, f32_to_bf16_bits(v), "bf16 of {b:#010x} ({v})");
        assert_eq!(f16, f32_to_f16_bits(v), "fp16 of {b:#010x} ({v})");
        assert_eq!(got_e4m3[i], f32_to_e4m3(v), "E4M3 of {b:#010x} ({v})");
    }
    let got_values = values.to_host_bytes().unwrap();
    for code in 0..=255u8 {
        let c = usize::from(code);
        let got = f32::from_le_bytes(got_values[4 * c..4 * c + 4].try_into().unwrap());
        let want = e4m3_to_f32(code);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "value of E4M3 {code:#04x}: want {want}, got {got}"
        );
    }
}

/// The default and the listed one-lane-a-block variants with the length compiled in (`+b+n`,
/// the quantized outputs' defaults) on rows of special x: one infinity or one NaN among plain
/// values, values so large that the sum of squares overflows, subnormals with signed zeros, and
/// rows of zeros; with and without the residual, for the quantized and bf16 outputs.
#[test]
fn special_x_rows_match_the_reference_on_the_block_lane_variants() {
    let gpu = gpu();
    let mut rng = Rng::fresh();
    let lane_blocks: Vec<NormVariant> =
        NORM_VARIANTS.iter().copied().filter(|v| v.block_lane && v.fixed_n && v.stages == 0).collect();
    assert!(!lane_blocks.is_empty(), "no +b+n variant is listed");
    let mut checked = 0usize;
    for out in [
        NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 448.0 }),
        NormOutput::Quantized(Quantizer::Int8),
        NormOutput::Float(DType::BF16),
    ] {
        for hidden in [4096usize, 8192] {
            let spec: NormSpec = RmsNorm { out, ..RmsNorm::llama(1e-5, DType::BF16) }.into();
            let rows = 40usize;
            let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
            let mut x = rng.values(rows * hidden, -2.0, 2.0, FloatType::BF16);
            for (r, row) in x.chunks_mut(hidden).enumerate() {
                let at = (rng.next() % hidden as u64) as usize;
                match r % 8 {
                    1 => row[at] = f32::INFINITY,
                    2 => row[at] = f32::NAN,
                    3 => row[at] = f32::NEG_INFINITY,
                    4 => row.iter_mut().for_each(|v| *v *= 1e30),
                    5 => row.iter_mut().enumerate().for_each(|(i, v)| {
                        *v = if i % 5 == 0 { -0.0 } else { *v * 4e-39 };
                    }),
                    6 => row.iter_mut().for_each(|v| *v = 0.0),
                    _ => {}
                }
                row.iter_mut().for_each(|v| *v = FloatType::BF16.round(*v));
            }
            let served: Vec<NormVariant> = lane_blocks
                .iter()
                .copied()
                .chain([NormVariant::default_for(&call)])
                .filter(|v| call.validate(*v).is_ok())
                .collect();
            assert!(served.len() > 1, "no +b+n variant serves {hidden}");
            for with_residual in [false, true] {
                check_variants_on_weight(&gpu, &mut rng, call, &served, &x, with_residual, None);
                checked += served.len();
            }
        }
    }
    println!("{checked} launches checked");
}
