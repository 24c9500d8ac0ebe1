//! The norm family: RMSNorm and LayerNorm, with an optional residual add before the norm, the
//! weight as given / as `1 + w` / absent, an optional bias, an optional SiLU gate, groups, and
//! float or quantized outputs. This is the specification the CUDA kernels (`kernels/norm.cu`)
//! match bit for bit.
//!
//! Values are handled as fp32 numbers; an input of type bf16 or fp16 is given as the fp32
//! values it holds. Per group of a row (the whole row when `groups` is 1):
//!
//! ```text
//! h   = x + residual, rounded to x's type       (with a residual; h is written back as the residual)
//! g   = h * silu(z)   when the gate comes before the norm, else h        (fp32, not rounded)
//! RMS:   r = 1 / sqrt(sum(g*g) / n + eps);                      p = g * r
//! Layer: m = sum(g) / n;  d = g - m;  r = 1 / sqrt(sum(d*d) / n + eps);  p = d * r
//! p   = round_to_x_type(p)                      only with RmsNormRounding::HuggingFace
//! v   = p * w  (w, or 1 + w, or nothing);  v = v + b  (with a bias);  v = v * silu(z) (gate after)
//! out = v rounded once to the output type, or quantized from q (see `ops::quantize`), where
//!       q = round_to_x_type(v) with RmsNormRounding::HuggingFace, else q = v
//! ```
//!
//! With Hugging Face's rounding a quantized output quantizes exactly the values its float output
//! in x's type would hold (`round(round(x * r) * w)`, what the model hands the next layer's
//! quantizer), so the fused norm and quantizer equals the norm followed by the quantizer.
//!
//! Every product and sum is rounded on its own (no fused multiply-add), the sums are the
//! fixed-order [`unit_sum`] over the group, and `sqrt` and `/` are correctly rounded.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::primitives::{silu, unit_sum, FloatType};
use crate::ops::quantize::{Quantized, Quantizer};

/// How the weight enters the norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightMode {
    /// `p * w`.
    Plain,
    /// `p * (1 + w)`, `1 + w` computed in fp32 (Gemma, Qwen3-Next, LayerNorm1P).
    OnePlus,
    /// No weight.
    None,
}

/// Where the rounding to the activation type happens in an RMSNorm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RmsNormRounding {
    /// Hugging Face's Llama / Qwen order: `round(round(x * r) * w)`.
    HuggingFace,
    /// One rounding at the end: `round(x * r * w)` (Gemma, biases, gates).
    Single,
}

/// Where a SiLU gate `silu(z)` multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gate {
    /// `norm(x * silu(z))` (Mamba-2 with `norm_before_gate = false`).
    Before,
    /// `norm(x) * silu(z)` (Qwen3-Next, Nemotron-H).
    After,
}

/// What a norm writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NormOutput {
    /// Values rounded to a float dtype (F32, F16 or BF16).
    Float(DType),
    /// Values quantized from the same `v` (rounded to x's type first with Hugging Face's
    /// rounding, as its float output in that type would be).
    Quantized(Quantizer),
}

/// An RMSNorm call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNorm {
    pub eps: f32,
    pub weight: WeightMode,
    pub bias: bool,
    pub rounding: RmsNormRounding,
    pub gate: Option<Gate>,
    /// Norms per row, each over `hidden / groups` consecutive elements (1: the whole row).
    pub groups: usize,
    pub out: NormOutput,
}

impl RmsNorm {
    /// Llama / Qwen's RMSNorm: plain weight, Hugging Face rounding, output in `dtype`.
    pub fn llama(eps: f32, dtype: DType) -> RmsNorm {
        RmsNorm {
            eps,
            weight: WeightMode::Plain,
            bias: false,
            rounding: RmsNormRounding::HuggingFace,
            gate: None,
            groups: 1,
            out: NormOutput::Float(dtype),
        }
    }
}

/// A LayerNorm call (always one rounding at the end).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNorm {
    pub eps: f32,
    pub weight: WeightMode,
    pub bias: bool,
    pub groups: usize,
    pub out: NormOutput,
}

/// Which statistic a norm divides by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NormKind {
    Rms,
    Layer,
}

/// Any norm of the family, as the kernels see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormSpec {
    pub kind: NormKind,
    pub eps: f32,
    pub weight: WeightMode,
    pub bias: bool,
    pub rounding: RmsNormRounding,
    pub gate: Option<Gate>,
    pub groups: usize,
    pub out: NormOutput,
}

impl From<RmsNorm> for NormSpec {
    fn from(n: RmsNorm) -> NormSpec {
        NormSpec {
            kind: NormKind::Rms,
            eps: n.eps,
            weight: n.weight,
            bias: n.bias,
            rounding: n.rounding,
            gate: n.gate,
            groups: n.groups,
            out: n.out,
        }
    }
}

impl From<LayerNorm> for NormSpec {
    fn from(n: LayerNorm) -> NormSpec {
        NormSpec {
            kind: NormKind::Layer,
            eps: n.eps,
            weight: n.weight,
            bias: n.bias,
            rounding: RmsNormRounding::Single,
            gate: None,
            groups: n.groups,
            out: n.out,
        }
    }
}

/// The inputs of a norm over `rows x hidden` values; bf16 / fp16 values given as fp32.
#[derive(Debug, Clone, Copy)]
pub struct NormInputs<'a> {
    /// `rows * hidden` values of type `x_type`.
    pub x: &'a [f32],
    /// The type of `x` and of the residual stream (the Hugging Face intermediate rounding too).
    pub x_type: DType,
    /// The residual stream, added to `x` before the norm.
    pub residual: Option<&'a [f32]>,
    /// `hidden` weights (any float type; its values only matter).
    pub weight: Option<&'a [f32]>,
    /// `hidden` biases.
    pub bias: Option<&'a [f32]>,
    /// `rows * hidden` gate inputs `z`.
    pub gate: Option<&'a [f32]>,
}

/// A norm's results.
#[derive(Debug, Clone, PartialEq)]
pub struct NormResult {
    /// Float outputs (values of the output type, as fp32), or empty for a quantized output.
    pub y: Vec<f32>,
    /// Quantized outputs, for a quantized output.
    pub quantized: Option<Quantized>,
    /// The updated residual stream `x + residual` (values of `x_type`), with a residual.
    pub residual: Option<Vec<f32>>,
}

impl NormSpec {
    /// Checks the spec and the inputs' sizes for `hidden` elements per row; returns the row count.
    pub fn validate(&self, hidden: usize, inputs: &NormInputs<'_>) -> Result<usize> {
        const OP: &str = "norm";
        FloatType::of(inputs.x_type, OP)?;
        if let NormOutput::Float(dtype) = self.out {
            FloatType::of(dtype, OP)?;
        }
        if hidden == 0 || self.groups == 0 || !hidden.is_multiple_of(self.groups) {
            return Err(Error::InvalidArgument {
                name: "groups",
                value: self.groups.to_string(),
                reason: format!("must divide the row length {hidden} (and neither may be 0)"),
            });
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return Err(Error::InvalidArgument {
                name: "eps",
                value: self.eps.to_string(),
                reason: "must be finite and non-negative".into(),
            });
        }
        if !inputs.x.len().is_multiple_of(hidden) {
            return Err(Error::ShapeMismatch {
                op: OP,
                expected: vec![inputs.x.len() / hidden, hidden],
                got: vec![inputs.x.len()],
            });
        }
        let rows = inputs.x.len() / hidden;
        let check = |what: Option<&[f32]>, want: Option<usize>| -> Result<()> {
            match (what, want) {
                (None, None) => Ok(()),
                (Some(v), Some(n)) if v.len() == n => Ok(()),
                (v, n) => Err(Error::ShapeMismatch {
                    op: OP,
                    expected: n.into_iter().collect(),
                    got: v.map(|v| v.len()).into_iter().collect(),
                }),
            }
        };
        check(inputs.weight, (self.weight != WeightMode::None).then_some(hidden))?;
        check(inputs.bias, self.bias.then_some(hidden))?;
        check(inputs.gate, self.gate.map(|_| rows * hidden))?;
        if let Some(residual) = inputs.residual {
            check(Some(residual), Some(rows * hidden))?;
        }
        if self.kind == NormKind::Layer && (self.gate.is_some() || self.rounding != RmsNormRounding::Single) {
            return Err(Error::NotServed {
                op: "layer norm",
                reason: "LayerNorm has one rounding and no gate".into(),
            });
        }
        if let NormOutput::Quantized(q) = self.out {
            q.validate(hidden)?;
        }
        Ok(rows)
    }

    /// Runs the norm on the CPU: the reference.
    pub fn run(&self, hidden: usize, inputs: &NormInputs<'_>) -> Result<NormResult> {
        let rows = self.validate(hidden, inputs)?;
        let x_type = FloatType::of(inputs.x_type, "norm")?;
        let n = hidden / self.groups;
        let mut v = vec![0.0f32; rows * hidden];
        let mut residual_out = inputs.residual.map(|_| vec![0.0f32; rows * hidden]);
        let mut h = vec![0.0f32; n];
        let mut g = vec![0.0f32; n];
        for row in 0..rows {
            for group in 0..self.groups {
                let start = row * hidden + group * n;
                let cols = group * n..(group + 1) * n;
                for j in 0..n {
                    let mut value = inputs.x[start + j];
                    if let (Some(res), Some(out)) = (inputs.residual, residual_out.as_mut()) {
                        value = x_type.round(value + res[start + j]);
                        out[start + j] = value;
                    }
                    h[j] = value;
                }
                for j in 0..n {
                    g[j] = match (self.gate, inputs.gate) {
                        (Some(Gate::Before), Some(z)) => h[j] * silu(z[start + j]),
                        _ => h[j],
                    };
                }
                let (shift, r) = match self.kind {
                    NormKind::Rms => (0.0, inv_root(unit_sum(n, |j| g[j] * g[j]), n, self.eps)),
                    NormKind::Layer => {
                        let mean = unit_sum(n, |j| g[j]) / n as f32;
                        let r = inv_root(unit_sum(n, |j| (g[j] - mean) * (g[j] - mean)), n, self.eps);
                        (mean, r)
                    }
                };
                for (j, col) in cols.enumerate() {
                    let centred = if self.kind == NormKind::Layer { g[j] - shift } else { g[j] };
                    let mut p = centred * r;
                    if self.rounding == RmsNormRounding::HuggingFace {
                        p = x_type.round(p);
                    }
                    let w = inputs.weight.map(|w| w[col]);
                    p = match (self.weight, w) {
                        (WeightMode::Plain, Some(w)) => p * w,
                        (WeightMode::OnePlus, Some(w)) => p * (1.0 + w),
                        _ => p,
                    };
                    if let Some(b) = inputs.bias {
                        p += b[col];
                    }
                    if let (Some(Gate::After), Some(z)) = (self.gate, inputs.gate) {
                        p *= silu(z[start + j]);
                    }
                    v[start + j] = p;
                }
            }
        }
        let (y, quantized) = match self.out {
            NormOutput::Float(dtype) => {
                let out = FloatType::of(dtype, "norm")?;
                (v.iter().map(|&p| out.round(p)).collect(), None)
            }
            NormOutput::Quantized(q) => {
                if self.rounding == RmsNormRounding::HuggingFace {
                    for value in v.iter_mut() {
                        *value = x_type.round(*value);
                    }
                }
                (Vec::new(), Some(q.quantize(&v, hidden)?))
            }
        };
        Ok(NormResult { y, quantized, residual: residual_out })
    }
}

/// `1 / sqrt(sum / n + eps)`, each step correctly rounded.
fn inv_root(sum: f32, n: usize, eps: f32) -> f32 {
    1.0 / (sum / n as f32 + eps).sqrt()
}

impl RmsNorm {
    /// Runs this RMSNorm on the CPU (see [`NormSpec::run`]).
    pub fn run(&self, hidden: usize, inputs: &NormInputs<'_>) -> Result<NormResult> {
        NormSpec::from(*self).run(hidden, inputs)
    }
}

impl LayerNorm {
    /// Runs this LayerNorm on the CPU (see [`NormSpec::run`]).
    pub fn run(&self, hidden: usize, inputs: &NormInputs<'_>) -> Result<NormResult> {
        NormSpec::from(*self).run(hidden, inputs)
    }
}

/// Row-wise RMSNorm in fp32 with a plain weight: `out = x * r * w` for each row of
/// `w.len()` values, with Kiln's fixed-order sum (equal to the general op for fp32 tensors).
pub fn rms_norm_f32(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let hidden = w.len();
    if hidden == 0 || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return Err(Error::ShapeMismatch {
            op: "rms_norm_f32",
            expected: vec![x.len(), hidden],
            got: vec![out.len()],
        });
    }
    for (row, dst) in x.chunks(hidden).zip(out.chunks_mut(hidden)) {
        let r = inv_root(unit_sum(hidden, |j| row[j] * row[j]), hidden, eps);
        for ((d, &v), &wj) in dst.iter_mut().zip(row).zip(w) {
            *d = (v * r) * wj;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        }
    }

    fn inputs<'a>(x: &'a [f32], w: &'a [f32]) -> NormInputs<'a> {
        NormInputs { x, x_type: DType::F32, residual: None, weight: Some(w), bias: None, gate: None }
    }

    #[test]
    fn rms_norm_is_close_to_the_f64_definition() {
        let mut r = lcg(1);
        let hidden = 1000;
        let x: Vec<f32> = (0..3 * hidden).map(|_| r()).collect();
        let w: Vec<f32> = (0..hidden).map(|_| r()).collect();
        let mut out = vec![0.0; x.len()];
        rms_norm_f32(&x, &w, 1e-5, &mut out).unwrap();
        let general = RmsNorm::llama(1e-5, DType::F32).run(hidden, &inputs(&x, &w)).unwrap();
        assert_eq!(general.y, out, "the row-wise helper equals the general op in fp32");
        for row in 0..3 {
            let xs = &x[row * hidden..(row + 1) * hidden];
            let ms = xs.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / hidden as f64;
            let r = 1.0 / (ms + 1e-5).sqrt();
            for j in 0..hidden {
                let want = f64::from(xs[j]) * r * f64::from(w[j]);
                let got = f64::from(out[row * hidden + j]);
                assert!((got - want).abs() <= 1e-5 * want.abs().max(1e-3), "row {row} col {j}");
            }
        }
    }

    #[test]
    fn hugging_face_rounding_rounds_before_the_weight() {
        let x: Vec<f32> = (0..64).map(|i| FloatType::BF16.round((i as f32 - 31.3) * 0.173)).collect();
        let w: Vec<f32> = (0..64).map(|i| FloatType::BF16.round(0.5 + i as f32 * 0.0371)).collect();
        let mut spec = RmsNorm::llama(1e-6, DType::BF16);
        let ins = NormInputs { x_type: DType::BF16, ..inputs(&x, &w) };
        let hf = spec.run(64, &ins).unwrap().y;
        spec.rounding = RmsNormRounding::Single;
        let single = spec.run(64, &ins).unwrap().y;
        let r = inv_root(unit_sum(64, |j| x[j] * x[j]), 64, 1e-6);
        for j in 0..64 {
            assert_eq!(hf[j], FloatType::BF16.round(FloatType::BF16.round(x[j] * r) * w[j]));
            assert_eq!(single[j], FloatType::BF16.round(x[j] * r * w[j]));
        }
        assert_ne!(hf, single, "the two orders differ somewhere on this input");
    }

    #[test]
    fn quantized_outputs_quantize_the_float_output_of_x_type() {
        use crate::ops::quantize::Quantizer;
        let mut r = lcg(7);
        let hidden = 256;
        let x: Vec<f32> = (0..2 * hidden).map(|_| FloatType::BF16.round(r() * 3.0)).collect();
        let w: Vec<f32> = (0..hidden).map(|_| FloatType::BF16.round(r())).collect();
        let ins = NormInputs { x_type: DType::BF16, ..inputs(&x, &w) };
        for q in
            [Quantizer::Int8, Quantizer::Nvfp4 { global_scale: 448.0 }, Quantizer::Fp8E4m3 { scale: 0.01 }]
        {
            for rounding in [RmsNormRounding::HuggingFace, RmsNormRounding::Single] {
                let float = RmsNorm {
                    rounding,
                    out: NormOutput::Float(DType::F32),
                    ..RmsNorm::llama(1e-6, DType::BF16)
                };
                let v = float.run(hidden, &ins).unwrap().y;
                let quantized = RmsNorm { rounding, out: NormOutput::Quantized(q), ..float };
                let got = quantized.run(hidden, &ins).unwrap().quantized.unwrap();
                let from: Vec<f32> = match rounding {
                    RmsNormRounding::HuggingFace => v.iter().map(|&t| FloatType::BF16.round(t)).collect(),
                    RmsNormRounding::Single => v.clone(),
                };
                assert_eq!(got, q.quantize(&from, hidden).unwrap(), "{q:?} {rounding:?}");
                if rounding == RmsNormRounding::HuggingFace {
                    assert_ne!(from, v, "the rounding to bf16 changes some value of this input");
                }
            }
        }
    }

    #[test]
    fn residual_is_added_rounded_and_returned() {
        let mut r = lcg(2);
        let x: Vec<f32> = (0..512).map(|_| FloatType::F16.round(r())).collect();
        let res: Vec<f32> = (0..512).map(|_| FloatType::F16.round(r())).collect();
        let w: Vec<f32> = (0..256).map(|_| r()).collect();
        let ins = NormInputs { x_type: DType::F16, residual: Some(&res), ..inputs(&x, &w) };
        let out = RmsNorm::llama(1e-5, DType::F16).run(256, &ins).unwrap();
        let sum: Vec<f32> = x.iter().zip(&res).map(|(a, b)| FloatType::F16.round(a + b)).collect();
        assert_eq!(out.residual.as_deref(), Some(&sum[..]));
        let plain =
            RmsNorm::llama(1e-5, DType::F16).run(256, &NormInputs { x_type: DType::F16, ..inputs(&sum, &w) });
        assert_eq!(out.y, plain.unwrap().y);
    }

    #[test]
    fn groups_normalise_each_group_alone() {
        let mut r = lcg(3);
        let x: Vec<f32> = (0..2 * 96).map(|_| r()).collect();
        let w: Vec<f32> = (0..96).map(|_| r()).collect();
        let mut spec = RmsNorm::llama(1e-5, DType::F32);
        spec.groups = 3;
        let grouped = spec.run(96, &inputs(&x, &w)).unwrap().y;
        for row in 0..2 {
            for g in 0..3 {
                let s = row * 96 + g * 32;
                let mut want = vec![0.0; 32];
                rms_norm_f32(&x[s..s + 32], &w[g * 32..g * 32 + 32], 1e-5, &mut want).unwrap();
                assert_eq!(&grouped[s..s + 32], &want[..]);
            }
        }
    }

    #[test]
    fn gates_weights_and_layer_norm_follow_their_formulas() {
        let mut r = lcg(4);
        let x: Vec<f32> = (0..300).map(|_| r()).collect();
        let z: Vec<f32> = (0..300).map(|_| r() * 3.0).collect();
        let w: Vec<f32> = (0..300).map(|_| r()).collect();
        let b: Vec<f32> = (0..300).map(|_| r()).collect();
        let base = RmsNorm {
            gate: Some(Gate::After),
            rounding: RmsNormRounding::Single,
            ..RmsNorm::llama(1e-5, DType::F32)
        };
        let ins = NormInputs { gate: Some(&z), ..inputs(&x, &w) };
        let after = base.run(300, &ins).unwrap().y;
        let mut plain = vec![0.0; 300];
        rms_norm_f32(&x, &w, 1e-5, &mut plain).unwrap();
        for j in 0..300 {
            assert_eq!(after[j], plain[j] * silu(z[j]));
        }
        let before = RmsNorm { gate: Some(Gate::Before), ..base }.run(300, &ins).unwrap().y;
        let gx: Vec<f32> = x.iter().zip(&z).map(|(a, b)| a * silu(*b)).collect();
        rms_norm_f32(&gx, &w, 1e-5, &mut plain).unwrap();
        assert_eq!(before, plain);

        let ln = LayerNorm {
            eps: 1e-5,
            weight: WeightMode::OnePlus,
            bias: true,
            groups: 1,
            out: NormOutput::Float(DType::F32),
        };
        let y = ln.run(300, &NormInputs { bias: Some(&b), ..inputs(&x, &w) }).unwrap().y;
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / 300.0;
        let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / 300.0;
        for j in 0..300 {
            let want =
                (f64::from(x[j]) - mean) / (var + 1e-5).sqrt() * (1.0 + f64::from(w[j])) + f64::from(b[j]);
            assert!((f64::from(y[j]) - want).abs() < 1e-5 * want.abs().max(1.0), "col {j}");
        }
    }

    #[test]
    fn bad_arguments_are_named_errors() {
        let x = [1.0f32; 32];
        let w = [1.0f32; 32];
        let mut spec = RmsNorm::llama(1e-5, DType::F32);
        spec.groups = 5;
        assert!(matches!(spec.run(32, &inputs(&x, &w)), Err(Error::InvalidArgument { name: "groups", .. })));
        let spec = RmsNorm::llama(1e-5, DType::Q8_0);
        assert!(matches!(spec.run(32, &inputs(&x, &w)), Err(Error::DTypeNotServed { dtype: "Q8_0", .. })));
        let spec = RmsNorm::llama(1e-5, DType::F32);
        assert!(matches!(spec.run(16, &inputs(&x, &w)), Err(Error::ShapeMismatch { .. })));
        let mut out = [0.0f32; 31];
        assert!(rms_norm_f32(&x, &w, 1e-5, &mut out).is_err());
    }
}
