//! Rotary position embedding (RoPE): the CPU reference of `kernels/rope.cu`.
//!
//! The angles come from one function, [`RopeSpec::cos_sin`], computed in f64 and rounded to fp32
//! once; the GPU reads the same numbers from a table built by [`RopeTable::new`], so no `sin` or
//! `cos` of either side's library enters the bit-exact path. A pair `(a, b)` rotates as
//! `a' = a * cos - b * sin`, `b' = b * cos + a * sin`, each product and sum rounded on its own,
//! and the result rounded once to the activation type.

use crate::error::{Error, Result};
use crate::ops::norm::{NormInputs, RmsNorm};
use crate::ops::primitives::FloatType;

/// Which elements of a head form a rotating pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    /// `(i, i + rotary_dim / 2)`: GPT-NeoX, Llama in Hugging Face's layout, Qwen.
    HalfSplit,
    /// `(2i, 2i + 1)`: GPT-J, Llama in Meta's original layout, GGUF's `rope_type = norm`.
    Interleaved,
}

/// Frequency scaling for contexts past the training length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        factor: f64,
    },
    /// Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, a smooth ramp
    /// between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    /// YaRN: a ramp between interpolated and extrapolated frequencies, and cos/sin multiplied by
    /// `attention_factor` (see [`RopeScaling::yarn_attention_factor`]).
    Yarn {
        factor: f64,
        original_max_position: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN's default attention factor, `0.1 * ln(factor) + 1` (1 for a factor up to 1).
    pub fn yarn_attention_factor(factor: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        }
    }
}

/// A RoPE call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub layout: RopeLayout,
    /// Elements of each head that rotate (the first `rotary_dim`; the rest pass through). Even.
    pub rotary_dim: usize,
    /// The base of the frequencies, `theta^(-2i / rotary_dim)`.
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// Checks the spec against a head size.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > head_dim {
            return Err(Error::InvalidArgument {
                name: "rotary_dim",
                value: self.rotary_dim.to_string(),
                reason: format!("must be even, positive and at most the head size {head_dim}"),
            });
        }
        if !(self.theta > 1.0 && self.theta.is_finite()) {
            return Err(Error::InvalidArgument {
                name: "rope theta",
                value: self.theta.to_string(),
                reason: "must be finite and above 1".into(),
            });
        }
        Ok(())
    }

    /// The inverse frequency of pair `i` (f64), after scaling.
    pub fn inv_freq(&self, i: usize) -> f64 {
        let dim = self.rotary_dim as f64;
        let base = 1.0 / self.theta.powf(2.0 * i as f64 / dim);
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base / factor,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let wavelen = 2.0 * std::f64::consts::PI / base;
                let low_freq_wavelen = original_max_position / low_freq_factor;
                let high_freq_wavelen = original_max_position / high_freq_factor;
                if wavelen < high_freq_wavelen {
                    base
                } else if wavelen > low_freq_wavelen {
                    base / factor
                } else {
                    let smooth = (original_max_position / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * base / factor + smooth * base
                }
            }
            RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, truncate, .. } => {
                let correction = |rotations: f64| {
                    dim * (original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                base / factor * (1.0 - extrapolation) + base * extrapolation
            }
        }
    }

    /// `(cos, sin)` of pair `i` at `position`, in fp32 (YaRN's attention factor included).
    pub fn cos_sin(&self, position: u64, i: usize) -> (f32, f32) {
        let angle = position as f64 * self.inv_freq(i);
        let scale = match self.scaling {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        };
        ((angle.cos() * scale) as f32, (angle.sin() * scale) as f32)
    }

    /// The element indices of pair `i` within a head.
    pub fn pair(&self, i: usize) -> (usize, usize) {
        match self.layout {
            RopeLayout::HalfSplit => (i, i + self.rotary_dim / 2),
            RopeLayout::Interleaved => (2 * i, 2 * i + 1),
        }
    }
}

/// Rotates one pair: `(a cos - b sin, b cos + a sin)`, each operation rounded, then rounded to `ty`.
pub fn rotate(a: f32, b: f32, cos: f32, sin: f32, ty: FloatType) -> (f32, f32) {
    (ty.round(a * cos - b * sin), ty.round(b * cos + a * sin))
}

/// Applies RoPE in place to `heads` heads of `head_dim` fp32 values at `position`.
pub fn apply_rope(
    q_or_k: &mut [f32],
    head_dim: usize,
    heads: usize,
    position: u64,
    spec: &RopeSpec,
) -> Result<()> {
    apply_rope_typed(q_or_k, head_dim, heads, position, spec, FloatType::F32)
}

/// [`apply_rope`] for values of type `ty` (bf16 / fp16 given as fp32): results rounded to `ty`.
pub fn apply_rope_typed(
    q_or_k: &mut [f32],
    head_dim: usize,
    heads: usize,
    position: u64,
    spec: &RopeSpec,
    ty: FloatType,
) -> Result<()> {
    spec.validate(head_dim)?;
    if q_or_k.len() != head_dim * heads {
        return Err(Error::ShapeMismatch {
            op: "rope",
            expected: vec![heads, head_dim],
            got: vec![q_or_k.len()],
        });
    }
    for head in q_or_k.chunks_mut(head_dim) {
        for i in 0..spec.rotary_dim / 2 {
            let (cos, sin) = spec.cos_sin(position, i);
            let (ia, ib) = spec.pair(i);
            let (a, b) = rotate(head[ia], head[ib], cos, sin, ty);
            head[ia] = a;
            head[ib] = b;
        }
    }
    Ok(())
}

/// Qwen3's per-head q/k RMSNorm followed by RoPE, in place: each head of `head_dim` values is
/// normalised by [`RmsNorm::llama`] (Hugging Face rounding to `ty`, the fixed-order unit sum) with
/// the `head_dim` weights `norm_weight`, then rotated by [`apply_rope_typed`]. The composition is the
/// specification of the fused kernel (`kernels/rope.cu` with its q/k norm on).
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_typed(
    q_or_k: &mut [f32],
    head_dim: usize,
    heads: usize,
    position: u64,
    norm_weight: &[f32],
    eps: f32,
    spec: &RopeSpec,
    ty: FloatType,
) -> Result<()> {
    spec.validate(head_dim)?;
    if q_or_k.len() != head_dim * heads {
        return Err(Error::ShapeMismatch {
            op: "q/k norm and rope",
            expected: vec![heads, head_dim],
            got: vec![q_or_k.len()],
        });
    }
    let inputs = NormInputs {
        x: q_or_k,
        x_type: ty.dtype(),
        residual: None,
        weight: Some(norm_weight),
        bias: None,
        gate: None,
    };
    let normed = RmsNorm::llama(eps, ty.dtype()).run(head_dim, &inputs)?;
    q_or_k.copy_from_slice(&normed.y);
    apply_rope_typed(q_or_k, head_dim, heads, position, spec, ty)
}

/// cos and sin for positions `0..positions`: `cos[p * rotary_dim / 2 + i]`, the table the GPU reads.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub spec: RopeSpec,
    pub positions: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for `positions` positions.
    pub fn new(spec: RopeSpec, head_dim: usize, positions: usize) -> Result<RopeTable> {
        spec.validate(head_dim)?;
        let half = spec.rotary_dim / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let (c, s) = spec.cos_sin(p as u64, i);
                cos.push(c);
                sin.push(s);
            }
        }
        Ok(RopeTable { spec, positions, cos, sin })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(layout: RopeLayout, rotary_dim: usize) -> RopeSpec {
        RopeSpec { layout, rotary_dim, theta: 10_000.0, scaling: RopeScaling::None }
    }

    #[test]
    fn position_zero_is_the_identity() {
        let mut v: Vec<f32> = (0..128).map(|i| i as f32 * 0.1 - 3.0).collect();
        let orig = v.clone();
        apply_rope(&mut v, 64, 2, 0, &spec(RopeLayout::HalfSplit, 64)).unwrap();
        assert_eq!(v, orig);
    }

    #[test]
    fn layouts_pair_the_documented_elements() {
        let s = spec(RopeLayout::HalfSplit, 8);
        let mut v = [0.0f32; 8];
        v[1] = 1.0;
        apply_rope(&mut v, 8, 1, 5, &s).unwrap();
        let (c, sn) = s.cos_sin(5, 1);
        assert_eq!(v, [0.0, c, 0.0, 0.0, 0.0, sn, 0.0, 0.0]);
        let s = spec(RopeLayout::Interleaved, 8);
        let mut v = [0.0f32; 8];
        v[2] = 1.0;
        apply_rope(&mut v, 8, 1, 5, &s).unwrap();
        let (c, sn) = s.cos_sin(5, 1);
        assert_eq!(v, [0.0, 0.0, c, sn, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn partial_rotary_leaves_the_tail_alone_and_uses_rotary_dim_in_the_frequencies() {
        let s = spec(RopeLayout::HalfSplit, 32);
        let mut v: Vec<f32> = (0..64).map(|i| i as f32).collect();
        apply_rope(&mut v, 64, 1, 17, &s).unwrap();
        assert_eq!(&v[32..], &(32..64).map(|i| i as f32).collect::<Vec<_>>()[..]);
        assert_eq!(s.inv_freq(1), 1.0 / 10_000f64.powf(2.0 / 32.0));
    }

    #[test]
    fn rotation_preserves_norms_and_composes() {
        let s = spec(RopeLayout::HalfSplit, 64);
        let mut v: Vec<f32> = (0..64).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let n0: f64 = v.iter().map(|&x| f64::from(x).powi(2)).sum();
        apply_rope(&mut v, 64, 1, 1234, &s).unwrap();
        let n1: f64 = v.iter().map(|&x| f64::from(x).powi(2)).sum();
        assert!((n0 - n1).abs() < 1e-5 * n0);
    }

    #[test]
    fn scalings_follow_their_published_formulas() {
        let base = spec(RopeLayout::HalfSplit, 128);
        let lin = RopeSpec { scaling: RopeScaling::Linear { factor: 4.0 }, ..base };
        assert_eq!(lin.inv_freq(10), base.inv_freq(10) / 4.0);
        // Llama 3.1 8B: factor 8, low 1, high 4, original 8192.
        let l3 = RopeSpec {
            theta: 500_000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192.0,
            },
            ..base
        };
        let plain = RopeSpec { theta: 500_000.0, ..base };
        assert_eq!(l3.inv_freq(0), plain.inv_freq(0), "the highest frequency is kept");
        assert_eq!(l3.inv_freq(63), plain.inv_freq(63) / 8.0, "the lowest is divided by the factor");
        let yarn = RopeSpec {
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: RopeScaling::yarn_attention_factor(4.0),
                truncate: true,
            },
            ..base
        };
        assert_eq!(yarn.inv_freq(0), base.inv_freq(0));
        assert!((yarn.inv_freq(63) - base.inv_freq(63) / 4.0).abs() < 1e-15);
        let (c, _) = yarn.cos_sin(0, 3);
        assert_eq!(c, (0.1 * 4f64.ln() + 1.0) as f32);
    }

    #[test]
    fn qk_norm_rope_is_the_hugging_face_norm_then_the_rotation() {
        let ty = FloatType::BF16;
        let s = spec(RopeLayout::HalfSplit, 64);
        let x: Vec<f32> = (0..128).map(|i| ty.round(((i * 53 % 29) as f32 - 14.0) * 0.21)).collect();
        let w: Vec<f32> = (0..64).map(|i| ty.round(0.6 + i as f32 * 0.013)).collect();
        let mut fused = x.clone();
        qk_norm_rope_typed(&mut fused, 64, 2, 301, &w, 1e-6, &s, ty).unwrap();
        for head in 0..2 {
            let h = &x[head * 64..(head + 1) * 64];
            let ms = h.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / 64.0;
            let r = (1.0 / (ms + 1e-6).sqrt()) as f32;
            let mut want: Vec<f32> = (0..64).map(|j| ty.round(ty.round(h[j] * r) * w[j])).collect();
            apply_rope_typed(&mut want, 64, 1, 301, &s, ty).unwrap();
            let got = &fused[head * 64..(head + 1) * 64];
            for j in 0..64 {
                // r from f64 may differ from the fixed-order fp32 r in its last bit: one bf16 step.
                assert!((got[j] - want[j]).abs() <= want[j].abs() / 64.0 + 1e-6, "head {head} j {j}");
            }
        }
        let mut bad = x.clone();
        assert!(matches!(
            qk_norm_rope_typed(&mut bad, 64, 3, 0, &w, 1e-6, &s, ty),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(qk_norm_rope_typed(&mut bad, 64, 2, 0, &w[..32], 1e-6, &s, ty).is_err());
    }

    #[test]
    fn bad_specs_are_refused() {
        let mut v = [0.0f32; 8];
        assert!(matches!(
            apply_rope(&mut v, 8, 1, 0, &spec(RopeLayout::HalfSplit, 7)),
            Err(Error::InvalidArgument { name: "rotary_dim", .. })
        ));
        assert!(matches!(
            apply_rope(&mut v, 8, 2, 0, &spec(RopeLayout::HalfSplit, 8)),
            Err(Error::ShapeMismatch { .. })
        ));
    }
}
