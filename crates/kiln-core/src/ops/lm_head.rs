//! The LM head's CPU reference: `logits = h W^T` for 1 to [`MAX_ROWS`] rows, the specification
//! the CUDA kernel (`kernels/lm_head.cu`) matches bit for bit.
//!
//! `h` is `rows x hidden` fp32; `W` is `vocab x hidden`, row-major, in bf16, fp16, Q8_0, Q4_0 or
//! Q4_1 (GGML blocks of 32 along `hidden`). For each row `r` and token `v`:
//!
//! ```text
//! w_j   = weight element j of row v in fp32:
//!           bf16 / fp16: the exact value;   Q8_0: d * q;   Q4_0: d * (q - 8);   Q4_1: fma(d, q, m)
//!         (d and m are the block's fp16 scale and minimum, q its integer code as fp32)
//! dot   = unit_dot_fma(h[r], w)                     (Kiln's fused fixed-order dot product, below)
//! y     = dot * row_scale[r]                        (with a deferred per-row scale, e.g. RMSNorm's r)
//! y     = y * logit_scale
//! y     = cap * tanh_poly(y / cap)                  (with soft-capping, Gemma)
//! ```
//!
//! The dot product ([`unit_dot_fma`]) runs in units of 256 elements, `hidden` padded with
//! `(0, 0)` pairs to whole units. In unit `u`, lane `l` (0..32) owns elements `e = 256u + 8l + k`
//! for `k = 0 .. 8` and computes
//!
//! ```text
//! acc_l = h[e0] * w[e0]                             (rounded; e0 = 256u + 8l)
//! acc_l = fma(h[e0 + k], w[e0 + k], acc_l)          for k = 1 .. 7 in order (each rounded once)
//! ```
//!
//! then the 32 lane values fold by the warp's xor butterfly (`acc_l += acc_{l + d}` for
//! `d = 16, 8, 4, 2, 1`; lane 0's value is the unit's sum), and the unit sums are added left to
//! right to `+0.0`. The order depends only on `hidden`: not on the kernel variant, the split of
//! the units over warps, the tile or the grid.
//!
//! Every other operation is rounded once, no fused multiply-add except where written (`fma`).
//! [`tanh_poly`] is Kiln's tanh, written with the same operations in CUDA.
//!
//! With block statistics, the head also writes, for each block of `stats_block` consecutive
//! tokens of a row, the largest logit and its lowest index packed in one `u64` by [`pack_argmax`],
//! so the greedy token of a row is the largest packed value over its blocks, with no pass over
//! the logits.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::primitives::{bf16_bits_to_f32, exp_poly, f16_bits_to_f32, unit_dot_fma};
use crate::ops::sample::order_key;

/// The most rows one LM head call serves.
pub const MAX_ROWS: usize = 8;

/// Elements per GGML quantization block.
pub const QUANT_BLOCK: usize = 32;

/// An LM head call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LmHead {
    /// Elements per row of `h` and of `W`.
    pub hidden: usize,
    /// Rows of `W` (tokens).
    pub vocab: usize,
    /// `W`'s dtype: BF16, F16, Q8_0, Q4_0 or Q4_1.
    pub weight: DType,
    /// Multiplies every logit (1 for none).
    pub logit_scale: f32,
    /// Gemma's final soft-capping `cap * tanh(y / cap)`.
    pub soft_cap: Option<f32>,
    /// Tokens per block of the argmax statistics; `None` writes none.
    pub stats_block: Option<usize>,
}

/// The outputs of an LM head call.
#[derive(Debug, Clone, PartialEq)]
pub struct LmHeadOutput {
    /// `rows x vocab` logits.
    pub logits: Vec<f32>,
    /// `rows x ceil(vocab / stats_block)` packed block maxima ([`pack_argmax`]), or empty.
    pub stats: Vec<u64>,
}

/// Packs a logit's order key and its index so that the larger packed value is the larger logit,
/// ties to the lower index: `key << 32 | (u32::MAX - index)`. A block of NaNs packs key 0.
pub fn pack_argmax(logit: f32, index: u32) -> u64 {
    (u64::from(order_key(logit)) << 32) | u64::from(u32::MAX - index)
}

/// The token of the largest packed value, `None` if every logit is NaN (key 0) or `stats` is
/// empty.
pub fn greedy_from_stats(stats: &[u64]) -> Option<u32> {
    let best = stats.iter().copied().max()?;
    (best >> 32 != 0).then(|| u32::MAX - best as u32)
}

/// Kiln's tanh in fp32: an odd Taylor polynomial in `x^2` below 0.25 in magnitude, otherwise
/// `1 - 2 / (exp_poly(2|x|) + 1)` with the sign of `x`. Relative error below 1e-6.
pub fn tanh_poly(x: f32) -> f32 {
    let a = x.abs();
    if a < 0.25 {
        let x2 = x * x;
        // The Taylor coefficients -1382/155925, 62/2835, -17/315, 2/15, -1/3 rounded to fp32,
        // written as bits so that CUDA uses the very same constants.
        let mut p = f32::from_bits(0xbc11_371b);
        p = p.mul_add(x2, f32::from_bits(0x3cb3_27a4));
        p = p.mul_add(x2, f32::from_bits(0xbd5d_0dd1));
        p = p.mul_add(x2, f32::from_bits(0x3e08_8889));
        p = p.mul_add(x2, f32::from_bits(0xbeaa_aaab));
        (x * x2).mul_add(p, x)
    } else {
        let t = 1.0 - 2.0 / (exp_poly(a + a) + 1.0);
        if x < 0.0 {
            -t
        } else {
            t
        }
    }
}

/// `cap * tanh_poly(y / cap)`.
pub fn soft_cap(y: f32, cap: f32) -> f32 {
    cap * tanh_poly(y / cap)
}

/// Bytes of one row of `hidden` elements of `dtype` as the head reads it.
pub fn row_bytes(dtype: DType, hidden: usize) -> Result<usize> {
    let blocks = hidden / QUANT_BLOCK;
    match dtype {
        DType::BF16 | DType::F16 => Ok(hidden * 2),
        DType::Q8_0 => Ok(blocks * 34),
        DType::Q4_0 => Ok(blocks * 18),
        DType::Q4_1 => Ok(blocks * 20),
        other => Err(Error::DTypeNotServed { dtype: other.name(), op: "lm_head" }),
    }
}

/// Element `j` of one weight row in fp32 (see the module docs).
pub fn weight_element(dtype: DType, row: &[u8], j: usize) -> f32 {
    let f16_at = |o: usize| f16_bits_to_f32(u16::from_le_bytes([row[o], row[o + 1]]));
    let (block, k) = (j / QUANT_BLOCK, j % QUANT_BLOCK);
    match dtype {
        DType::BF16 => bf16_bits_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]])),
        DType::F16 => f16_at(2 * j),
        DType::Q8_0 => {
            let base = block * 34;
            f16_at(base) * f32::from(row[base + 2 + k] as i8)
        }
        DType::Q4_0 => {
            let base = block * 18;
            let byte = row[base + 2 + k % 16];
            let q = if k < 16 { byte & 0x0F } else { byte >> 4 };
            f16_at(base) * (f32::from(q) - 8.0)
        }
        DType::Q4_1 => {
            let base = block * 20;
            let byte = row[base + 4 + k % 16];
            let q = if k < 16 { byte & 0x0F } else { byte >> 4 };
            f16_at(base).mul_add(f32::from(q), f16_at(base + 2))
        }
        _ => f32::NAN,
    }
}

impl LmHead {
    /// Checks the call against its inputs; returns the row count.
    pub fn validate(&self, h: &[f32], weights: &[u8], row_scale: Option<&[f32]>) -> Result<usize> {
        const OP: &str = "lm_head";
        let row = row_bytes(self.weight, self.hidden)?;
        let quantized = !matches!(self.weight, DType::BF16 | DType::F16);
        if self.hidden == 0 || self.vocab == 0 {
            return Err(Error::InvalidArgument {
                name: "lm_head shape",
                value: format!("{} x {}", self.vocab, self.hidden),
                reason: "vocab and hidden must be positive".into(),
            });
        }
        if quantized && !self.hidden.is_multiple_of(QUANT_BLOCK) {
            return Err(Error::NotBlockAligned {
                dtype: self.weight.name(),
                elements: self.hidden as u64,
                block_size: QUANT_BLOCK as u64,
            });
        }
        if !quantized && !self.hidden.is_multiple_of(8) {
            return Err(Error::NotServed {
                op: OP,
                reason: format!("hidden {} is not a multiple of 8 (16-byte rows)", self.hidden),
            });
        }
        if self.vocab >= u32::MAX as usize {
            return Err(Error::OutOfBounds {
                op: OP,
                what: "vocab",
                value: self.vocab as u64,
                limit: u32::MAX as u64,
            });
        }
        if h.is_empty() || !h.len().is_multiple_of(self.hidden) || h.len() / self.hidden > MAX_ROWS {
            return Err(Error::ShapeMismatch {
                op: OP,
                expected: vec![MAX_ROWS, self.hidden],
                got: vec![h.len() / self.hidden, h.len() % self.hidden],
            });
        }
        let rows = h.len() / self.hidden;
        let want = self.vocab.checked_mul(row).ok_or(Error::SizeOverflow {
            shape: vec![self.vocab as u64, self.hidden as u64],
            dtype: self.weight.name(),
        })?;
        if weights.len() != want {
            return Err(Error::ByteLength {
                what: format!("lm_head weights {} x {} {}", self.vocab, self.hidden, self.weight),
                expected: want as u64,
                got: weights.len() as u64,
            });
        }
        if let Some(s) = row_scale {
            if s.len() != rows {
                return Err(Error::ShapeMismatch { op: OP, expected: vec![rows], got: vec![s.len()] });
            }
        }
        if !self.logit_scale.is_finite() {
            return Err(Error::InvalidArgument {
                name: "logit_scale",
                value: self.logit_scale.to_string(),
                reason: "must be finite".into(),
            });
        }
        if let Some(cap) = self.soft_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::InvalidArgument {
                    name: "soft_cap",
                    value: cap.to_string(),
                    reason: "must be finite and > 0".into(),
                });
            }
        }
        if self.stats_block == Some(0) {
            return Err(Error::InvalidArgument {
                name: "stats_block",
                value: "0".into(),
                reason: "a statistics block holds at least one token".into(),
            });
        }
        Ok(rows)
    }

    /// The epilogue applied to one dot product of row `r`.
    pub fn epilogue(&self, dot: f32, row_scale: Option<f32>) -> f32 {
        let mut y = dot;
        if let Some(s) = row_scale {
            y *= s;
        }
        y *= self.logit_scale;
        match self.soft_cap {
            Some(cap) => soft_cap(y, cap),
            None => y,
        }
    }

    /// Runs the head on the CPU: the reference.
    pub fn run(&self, h: &[f32], weights: &[u8], row_scale: Option<&[f32]>) -> Result<LmHeadOutput> {
        use rayon::prelude::*;
        let rows = self.validate(h, weights, row_scale)?;
        let row = row_bytes(self.weight, self.hidden)?;
        let hidden = self.hidden;
        let mut by_token = vec![0.0f32; self.vocab * rows];
        by_token.par_chunks_mut(rows).enumerate().for_each(|(v, out)| {
            let w_row = &weights[v * row..(v + 1) * row];
            let w: Vec<f32> = (0..hidden).map(|j| weight_element(self.weight, w_row, j)).collect();
            for (r, o) in out.iter_mut().enumerate() {
                let x = &h[r * hidden..(r + 1) * hidden];
                let dot = unit_dot_fma(x, &w);
                *o = self.epilogue(dot, row_scale.map(|s| s[r]));
            }
        });
        let mut logits = vec![0.0f32; rows * self.vocab];
        for (v, values) in by_token.chunks(rows).enumerate() {
            for (r, &y) in values.iter().enumerate() {
                logits[r * self.vocab + v] = y;
            }
        }
        let stats = match self.stats_block {
            Some(block) => logits.chunks(self.vocab).flat_map(|l| block_stats(l, block)).collect(),
            None => Vec::new(),
        };
        Ok(LmHeadOutput { logits, stats })
    }
}

/// The packed maximum of each block of `block` consecutive logits of one row.
pub fn block_stats(logits: &[f32], block: usize) -> Vec<u64> {
    logits
        .chunks(block)
        .enumerate()
        .map(|(b, chunk)| {
            chunk.iter().enumerate().map(|(i, &y)| pack_argmax(y, (b * block + i) as u32)).max().unwrap_or(0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::primitives::{f32_to_bf16_bits, f32_to_f16_bits};
    use crate::ops::sample::argmax;

    struct TestRng(u64);

    impl TestRng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }

        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Random weights of `dtype` whose fp16 scales are small positive numbers.
    fn random_weights(rng: &mut TestRng, dtype: DType, vocab: usize, hidden: usize) -> Vec<u8> {
        match dtype {
            DType::BF16 => {
                (0..vocab * hidden).flat_map(|_| f32_to_bf16_bits(rng.uniform()).to_le_bytes()).collect()
            }
            DType::F16 => {
                (0..vocab * hidden).flat_map(|_| f32_to_f16_bits(rng.uniform()).to_le_bytes()).collect()
            }
            _ => {
                let (block_bytes, header) = match dtype {
                    DType::Q8_0 => (34, 2),
                    DType::Q4_0 => (18, 2),
                    _ => (20, 4),
                };
                let mut out = Vec::new();
                for _ in 0..vocab * hidden / QUANT_BLOCK {
                    out.extend_from_slice(&f32_to_f16_bits(0.01 + rng.uniform().abs() * 0.05).to_le_bytes());
                    if header == 4 {
                        out.extend_from_slice(&f32_to_f16_bits(rng.uniform() * 0.2).to_le_bytes());
                    }
                    out.extend(rng.bytes(block_bytes - header));
                }
                out
            }
        }
    }

    #[test]
    fn logits_are_close_to_a_float64_product_for_every_dtype() {
        let mut rng = TestRng(11);
        let (vocab, hidden, rows) = (37, 576, 3);
        for dtype in [DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let w = random_weights(&mut rng, dtype, vocab, hidden);
            let h: Vec<f32> = (0..rows * hidden).map(|_| rng.uniform()).collect();
            let head =
                LmHead { hidden, vocab, weight: dtype, logit_scale: 1.0, soft_cap: None, stats_block: None };
            let out = head.run(&h, &w, None).unwrap();
            let row = row_bytes(dtype, hidden).unwrap();
            for r in 0..rows {
                for v in 0..vocab {
                    let w_row = &w[v * row..(v + 1) * row];
                    let mut want = 0.0f64;
                    let mut scale = 0.0f64;
                    for j in 0..hidden {
                        let p = f64::from(h[r * hidden + j]) * f64::from(weight_element(dtype, w_row, j));
                        want += p;
                        scale += p.abs();
                    }
                    let got = f64::from(out.logits[r * vocab + v]);
                    assert!((got - want).abs() <= 1e-6 * scale, "{dtype} r{r} v{v}: {got} vs {want}");
                }
            }
        }
    }

    /// The fused order written out from its definition (module docs), independently of
    /// `unit_dot_fma`: every lane of every unit, the full xor butterfly on all 32 lanes.
    fn fused_dot_by_definition(x: &[f32], w: &[f32]) -> f32 {
        let at = |v: &[f32], j: usize| if j < v.len() { v[j] } else { 0.0 };
        let mut total = 0.0f32;
        for u in 0..x.len().div_ceil(256) {
            let mut lane: Vec<f32> = (0..32)
                .map(|l| {
                    let e0 = 256 * u + 8 * l;
                    (1..8).fold(at(x, e0) * at(w, e0), |acc, k| at(x, e0 + k).mul_add(at(w, e0 + k), acc))
                })
                .collect();
            for d in [16, 8, 4, 2, 1] {
                lane = (0..32).map(|l| lane[l] + lane[l ^ d]).collect();
            }
            total += lane[0];
        }
        total
    }

    #[test]
    fn logits_follow_the_fused_order_bit_for_bit() {
        // The reference (which takes the CPU's FMA instructions where it has them) against the
        // definition through `f32::mul_add`, for every dtype, ragged and partial units, 1..8 rows.
        let mut rng = TestRng(23);
        for (k, dtype) in
            [DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1].into_iter().enumerate()
        {
            for (hidden, rows) in [(576, 1 + k), (896, 8), (4096, 2), (32, 3)] {
                let vocab = 29;
                let w = random_weights(&mut rng, dtype, vocab, hidden);
                // Values over several binades, so that a different order or rounding shows.
                let h: Vec<f32> =
                    (0..rows * hidden).map(|_| rng.uniform() * (1 << (rng.next() % 12)) as f32).collect();
                let head = LmHead {
                    hidden,
                    vocab,
                    weight: dtype,
                    logit_scale: 1.0,
                    soft_cap: None,
                    stats_block: None,
                };
                let out = head.run(&h, &w, None).unwrap();
                let row = row_bytes(dtype, hidden).unwrap();
                for v in 0..vocab {
                    let wv: Vec<f32> =
                        (0..hidden).map(|j| weight_element(dtype, &w[v * row..(v + 1) * row], j)).collect();
                    for r in 0..rows {
                        let want = fused_dot_by_definition(&h[r * hidden..(r + 1) * hidden], &wv);
                        let got = out.logits[r * vocab + v];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{dtype} {hidden} r{r} v{v}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn dequantization_follows_ggml() {
        // Q4_0: d = 0.5, codes 0..16 in the low nibbles, 15 - k in the high ones.
        let mut q4 = f32_to_f16_bits(0.5).to_le_bytes().to_vec();
        q4.extend((0..16u8).map(|k| k | ((15 - k) << 4)));
        assert_eq!(weight_element(DType::Q4_0, &q4, 0), -4.0);
        assert_eq!(weight_element(DType::Q4_0, &q4, 15), 3.5);
        assert_eq!(weight_element(DType::Q4_0, &q4, 16), 3.5);
        assert_eq!(weight_element(DType::Q4_0, &q4, 31), -4.0);
        // Q4_1: d = 0.25, m = -1.
        let mut q41 = f32_to_f16_bits(0.25).to_le_bytes().to_vec();
        q41.extend(f32_to_f16_bits(-1.0).to_le_bytes());
        q41.extend((0..16u8).map(|k| k | ((15 - k) << 4)));
        assert_eq!(weight_element(DType::Q4_1, &q41, 3), -0.25);
        assert_eq!(weight_element(DType::Q4_1, &q41, 16), 2.75);
        // Q8_0: d = 2, codes -128..
        let mut q8 = f32_to_f16_bits(2.0).to_le_bytes().to_vec();
        q8.extend((0..32).map(|k| (k as i8 - 16) as u8));
        assert_eq!(weight_element(DType::Q8_0, &q8, 0), -32.0);
        assert_eq!(weight_element(DType::Q8_0, &q8, 31), 30.0);
    }

    #[test]
    fn epilogue_scales_and_caps() {
        let head = LmHead {
            hidden: 8,
            vocab: 1,
            weight: DType::BF16,
            logit_scale: 0.5,
            soft_cap: Some(30.0),
            stats_block: None,
        };
        let y = head.epilogue(100.0, Some(2.0));
        let want = 30.0 * (100.0f64 / 30.0).tanh();
        assert!((f64::from(y) - want).abs() < 1e-5, "{y} vs {want}");
    }

    #[test]
    fn tanh_poly_is_close_to_tanh() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let want = f64::from(x).tanh();
            let got = f64::from(tanh_poly(x));
            assert!((got - want).abs() <= 1e-6 * want.abs() + 1e-30, "tanh({x}) = {got}, want {want}");
            x += 0.00731;
        }
        assert_eq!(tanh_poly(0.0), 0.0);
        assert_eq!(tanh_poly(100.0), 1.0);
        assert_eq!(tanh_poly(-100.0), -1.0);
        assert_eq!(tanh_poly(f32::INFINITY), 1.0);
        assert!(tanh_poly(f32::NAN).is_nan());
    }

    #[test]
    fn block_stats_give_the_greedy_token() {
        let mut rng = TestRng(5);
        for len in [1usize, 7, 100, 513] {
            let mut l: Vec<f32> = (0..len).map(|_| (rng.uniform() * 4.0).round()).collect();
            if len > 5 {
                l[3] = f32::NAN;
            }
            for block in [1, 3, 64, 1000] {
                assert_eq!(greedy_from_stats(&block_stats(&l, block)), argmax(&l), "len {len} block {block}");
            }
        }
        assert_eq!(greedy_from_stats(&block_stats(&[f32::NAN, f32::NAN], 1)), None);
    }

    #[test]
    fn bad_calls_are_named_errors() {
        let head = LmHead {
            hidden: 64,
            vocab: 2,
            weight: DType::BF16,
            logit_scale: 1.0,
            soft_cap: None,
            stats_block: None,
        };
        let h = vec![0.5f32; 64];
        let w = vec![0u8; 2 * 64 * 2];
        assert!(head.run(&h, &w, None).is_ok());
        assert!(matches!(head.run(&h, &w[1..], None), Err(Error::ByteLength { .. })));
        assert!(matches!(head.run(&h[1..], &w, None), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(head.run(&vec![0.5; 64 * 9], &w, None), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(head.run(&h, &w, Some(&[1.0, 2.0])), Err(Error::ShapeMismatch { .. })));
        let f32_head = LmHead { weight: DType::F32, ..head };
        assert!(matches!(f32_head.run(&h, &w, None), Err(Error::DTypeNotServed { .. })));
        let q = LmHead { weight: DType::Q8_0, hidden: 48, ..head };
        assert!(matches!(q.run(&h[..48], &w, None), Err(Error::NotBlockAligned { .. })));
        let cap = LmHead { soft_cap: Some(0.0), ..head };
        assert!(matches!(cap.run(&h, &w, None), Err(Error::InvalidArgument { name: "soft_cap", .. })));
    }
}
