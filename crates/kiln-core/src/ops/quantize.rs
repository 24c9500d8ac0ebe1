//! Output quantizers and the FP8 E4M3 / FP4 E2M1 conversions.
//!
//! A norm kernel can write its output `y` (fp32, before any rounding to an output dtype) as:
//! - INT8: one fp32 scale per [`QUANT_BLOCK`] values, `scale = amax / 127`, and with
//!   `inverse = 1 / scale` (rounded) `q = clamp(rint(y * inverse), -127, 127)`, the exact product
//!   rounded once to the nearest integer (ties to even; y and the scale both times 2^64 where
//!   `1 / scale` overflows), or 0 where the block's `amax` is 0 (see [`int8_code`]);
//! - NVFP4: E2M1 codes (two per byte, the even element in the low nibble), one E4M3 scale per
//!   [`QUANT_BLOCK`] values, `s = e4m3((amax / 6) * global_scale)`, and with
//!   `inverse = global_scale / f32(s)` (rounded once) `q = e2m1(y * inverse)`, the E2M1 value
//!   nearest the exact product (not the product rounded to fp32 first), or 0 where `inverse` is
//!   not finite (a zero scale; see [`nvfp4_inverse`] and [`e2m1_of_product`]);
//! - FP8 E4M3 with one per-tensor scale: `q = e4m3(y / scale)`.
//!
//! `amax` is the largest `|y|` of the block, NaN ignored (`fmaxf`). The conversions round to
//! nearest even and saturate to the largest finite value (infinities too); a NaN becomes
//! the NaN code `S.1111.111` in E4M3 (as the CUDA prelude's `kiln_f32_to_e4m3`) and `0` in E2M1,
//! which has no NaN. They are written with a few exact fp32
//! operations so the CUDA kernels compute them identically; the tests check them against the
//! plain definition ("the nearest representable value") for all 2^32 fp32 inputs.

use crate::error::{Error, Result};

/// Values per scale of the INT8 and NVFP4 outputs.
pub const QUANT_BLOCK: usize = 16;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;

/// fp32 to FP8 E4M3 (the OCP "fn" variant: bias 7, no infinities, NaN `0x7F`/`0xFF`),
/// to nearest even, saturating.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    let magnitude = if a >= E4M3_MAX {
        0x7E
    } else if a < 0.015_625 {
        // Subnormals (and the first normal): multiples of 2^-9, and a * 512 is exact.
        rint_small(a * 512.0) as u8
    } else {
        // Round the fp32 significand to 3 bits; a carry moves into the exponent, as it should.
        let bits = a.to_bits();
        let rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20;
        (rounded - ((127 - 7) << 3)) as u8
    };
    sign | magnitude
}

/// FP8 E4M3 to fp32 (exact).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exponent = i32::from((code >> 3) & 0xF);
    let mantissa = f32::from(code & 7);
    if code & 0x7F == 0x7F {
        return f32::NAN;
    }
    if exponent == 0 {
        sign * mantissa / 512.0
    } else {
        sign * (1.0 + mantissa / 8.0) * 2.0f32.powi(exponent - 7)
    }
}

/// fp32 to FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; the sign in bit 3),
/// to nearest even, saturating; NaN gives 0.
pub fn f32_to_e2m1(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sign = ((x.to_bits() >> 28) & 0x8) as u8;
    let a = x.abs();
    // Each branch's subtraction is exact (Sterbenz), so rint sees the exact offset.
    let magnitude = if a >= E2M1_MAX {
        7.0
    } else if a < 1.0 {
        rint_small(a * 2.0)
    } else if a < 2.0 {
        2.0 + rint_small((a - 1.0) * 2.0)
    } else if a < 4.0 {
        4.0 + rint_small(a - 2.0)
    } else {
        6.0 + rint_small((a - 4.0) * 0.5)
    };
    sign | magnitude as u8
}

/// Rounds `0 <= v < 2^23` to an integer, ties to even (`rintf`): adding and removing 2^23
/// leaves no fraction bits, and the addition rounds to nearest even.
fn rint_small(v: f32) -> f32 {
    (v + 8_388_608.0) - 8_388_608.0
}

/// FP4 E2M1 (the low 4 bits of `code`) to fp32.
pub fn e2m1_to_f32(code: u8) -> f32 {
    const VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let magnitude = VALUES[usize::from(code & 7)];
    if code & 8 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// The largest `|v|` of a block, NaN ignored.
pub fn block_amax(block: &[f32]) -> f32 {
    block.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// INT8 codes and their per-block scale.
pub fn int8_block(block: &[f32], codes: &mut [i8]) -> f32 {
    let scale = block_amax(block) / 127.0;
    let (factor, inverse) = int8_inverse(scale);
    for (q, &y) in codes.iter_mut().zip(block) {
        *q = int8_code(y, scale, factor, inverse);
    }
    scale
}

/// 1.5 * 2^23: for |t| < 2^22, `t + ROUND_MAGIC` rounds t to an integer (ties to even) and adds
/// the magic, exactly.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// 2^64: the factor of an INT8 block whose `1 / scale` overflows.
pub const INT8_TINY_FACTOR: f32 = 18_446_744_073_709_551_616.0;

/// The factor and reciprocal of an INT8 block's codes ([`int8_code`]): `(1, 1 / scale)`, or
/// where `1 / scale` overflows (a scale under 2^-128) `(2^64, 1 / (scale * 2^64))`; the scalings
/// are exact.
pub fn int8_inverse(scale: f32) -> (f32, f32) {
    let inverse = 1.0 / scale;
    if inverse.is_finite() {
        (1.0, inverse)
    } else {
        (INT8_TINY_FACTOR, 1.0 / (scale * INT8_TINY_FACTOR))
    }
}

/// The INT8 code of `y` in a block of `scale`, with [`int8_inverse`]'s `(factor, inverse)`: 0 for
/// a scale that is not positive; else `rint(y * factor * inverse)`, the exact product rounded
/// once to the nearest integer, ties to even (one fused multiply-add with the rounding magic),
/// clamped to +-127. A product by the block's rounded reciprocal is one instruction a value on a
/// GPU where the quotient `y / scale` needs a division, and as exact: the nearest integer to a
/// well-defined real number. With `|y| <= amax` the product is at most 127 (1 + 2^-20) for a
/// normal scale (a subnormal one can push it to 254: the clamp), so the magic's range is never
/// left but for `y` infinite (`inf * 0` is NaN for an infinite scale) or NaN, which give -127.
// `max` then `min` rather than `clamp`: a NaN becomes -127 here as with CUDA's fmaxf / fminf,
// where `clamp` would keep the NaN.
#[allow(clippy::manual_clamp)]
pub fn int8_code(y: f32, scale: f32, factor: f32, inverse: f32) -> i8 {
    if scale.is_nan() || scale <= 0.0 {
        return 0;
    }
    let t = (y * factor).mul_add(inverse, ROUND_MAGIC) - ROUND_MAGIC;
    t.max(-127.0).min(127.0) as i8
}

/// NVFP4 codes (one per byte, low nibble) and the block's E4M3 scale.
pub fn nvfp4_block(block: &[f32], global_scale: f32, codes: &mut [u8]) -> u8 {
    let scale = f32_to_e4m3((block_amax(block) / 6.0) * global_scale);
    let inverse = nvfp4_inverse(scale, global_scale);
    for (q, &y) in codes.iter_mut().zip(block) {
        *q = e2m1_of_product(y, inverse);
    }
    scale
}

/// The factor of an NVFP4 block's codes: `global_scale / f32(scale)`, one division rounded once
/// (infinite for a zero scale). A product by it is one instruction a value on a GPU where the
/// quotient `y / (f32(scale) / global_scale)` needs a division a value, and as exact: the codes
/// are those of a well-defined real number ([`e2m1_of_product`]).
pub fn nvfp4_inverse(scale: u8, global_scale: f32) -> f32 {
    global_scale / e4m3_to_f32(scale)
}

/// The E2M1 code (sign in bit 3) of the exact product `y * inverse`: the nearest E2M1 value,
/// ties to the even code, saturating at 6, with the product's sign; 0 where `inverse` is not
/// finite or the product is NaN (a NaN `y`, or an infinite one times 0). The product of two fp32
/// values is exact in f64 (48 significant bits at most, and within its exponent range).
///
/// With `a = |y * inverse|`, `g(a) = min(2a, a + 2, a / 2 + 4)` is a continuous, increasing map,
/// linear between consecutive E2M1 values (its breaks, 2 and 4, are E2M1 values), that takes the
/// values 0, 0.5, 1, 1.5, 2, 3, 4, 6 to the codes 0 .. 7 and so each midpoint between two of them
/// to the half-integer between their codes; the code of `a` is therefore `rint(g(a))` (ties to
/// even: the even code has the even mantissa), clamped to 7, and since rint is monotonic that is
/// `min(rint(2a), rint(a) + 2, rint(a / 2) + 4, 7)`: exact f64 operations here; the CUDA
/// kernels take the least of two fused multiply-adds in fp32 whose sums straddle powers of two
/// (`kiln_e2m1_product` in `kernels/norm.cu`).
pub fn e2m1_of_product(y: f32, inverse: f32) -> u8 {
    if !inverse.is_finite() {
        return 0;
    }
    let p = f64::from(y) * f64::from(inverse);
    if p.is_nan() {
        return 0;
    }
    let sign = if p.is_sign_negative() { 0x8 } else { 0 };
    let a = p.abs();
    let code = (2.0 * a)
        .round_ties_even()
        .min(a.round_ties_even() + 2.0)
        .min((0.5 * a).round_ties_even() + 4.0)
        .min(7.0);
    sign | code as u8
}

/// Quantized rows.
#[derive(Debug, Clone, PartialEq)]
pub enum Quantized {
    /// INT8 codes and one fp32 scale per 16 values.
    Int8 { codes: Vec<i8>, scales: Vec<f32> },
    /// E2M1 codes packed two per byte (even element low) and one E4M3 scale per 16 values.
    Nvfp4 { packed: Vec<u8>, scales: Vec<u8> },
    /// E4M3 codes with the per-tensor scale given by the caller.
    Fp8E4m3 { codes: Vec<u8> },
}

/// An output quantizer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantizer {
    Int8,
    Nvfp4 { global_scale: f32 },
    Fp8E4m3 { scale: f32 },
}

impl Quantizer {
    /// Checks the quantizer's arguments against a row length.
    pub fn validate(&self, row_len: usize) -> Result<()> {
        let blocked = matches!(self, Quantizer::Int8 | Quantizer::Nvfp4 { .. });
        if blocked && !row_len.is_multiple_of(QUANT_BLOCK) {
            return Err(Error::InvalidArgument {
                name: "row length",
                value: row_len.to_string(),
                reason: format!("block-quantized outputs need a multiple of {QUANT_BLOCK}"),
            });
        }
        let scale = match *self {
            Quantizer::Int8 => return Ok(()),
            Quantizer::Nvfp4 { global_scale } => global_scale,
            Quantizer::Fp8E4m3 { scale } => scale,
        };
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::InvalidArgument {
                name: "quantizer scale",
                value: scale.to_string(),
                reason: "must be finite and positive".into(),
            });
        }
        Ok(())
    }

    /// Quantizes `y` (whole rows, each `row_len` long).
    pub fn quantize(&self, y: &[f32], row_len: usize) -> Result<Quantized> {
        self.validate(row_len)?;
        Ok(match *self {
            Quantizer::Int8 => {
                let mut codes = vec![0i8; y.len()];
                let scales = y
                    .chunks(QUANT_BLOCK)
                    .zip(codes.chunks_mut(QUANT_BLOCK))
                    .map(|(block, q)| int8_block(block, q))
                    .collect();
                Quantized::Int8 { codes, scales }
            }
            Quantizer::Nvfp4 { global_scale } => {
                let mut codes = vec![0u8; y.len()];
                let scales = y
                    .chunks(QUANT_BLOCK)
                    .zip(codes.chunks_mut(QUANT_BLOCK))
                    .map(|(block, q)| nvfp4_block(block, global_scale, q))
                    .collect();
                let packed = codes.chunks(2).map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4)).collect();
                Quantized::Nvfp4 { packed, scales }
            }
            Quantizer::Fp8E4m3 { scale } => {
                Quantized::Fp8E4m3 { codes: y.iter().map(|&v| f32_to_e4m3(v / scale)).collect() }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// The plain definition: the nearest of the sorted non-negative finite `values` (codes
    /// `0..values.len()`), ties to the even code, saturating at the last; the sign copied.
    fn nearest(x: f32, values: &[f32], sign_bit: u8, nan: u8) -> u8 {
        let sign = if x.is_sign_negative() { sign_bit } else { 0 };
        if x.is_nan() {
            return if nan == 0 { 0 } else { sign | nan };
        }
        sign | nearest_code(f64::from(x.abs()), values)
    }

    /// The code of the nearest of the sorted `values` to the magnitude `a` (ties to the even
    /// code, saturating at the last).
    fn nearest_code(a: f64, values: &[f32]) -> u8 {
        let last = values.len() - 1;
        let mut code = last;
        for i in 0..last {
            let (lo, hi) = (f64::from(values[i]), f64::from(values[i + 1]));
            if a <= hi {
                let mid = (lo + hi) / 2.0;
                code = if a < mid || (a == mid && i % 2 == 0) { i } else { i + 1 };
                break;
            }
        }
        code as u8
    }

    /// A xorshift64 stream for test inputs (fixed seeds: the same cases every run).
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    fn e4m3_values() -> Vec<f32> {
        (0u8..0x7F).map(e4m3_to_f32).collect()
    }

    fn e2m1_values() -> Vec<f32> {
        (0u8..8).map(e2m1_to_f32).collect()
    }

    #[test]
    fn e4m3_decoding_follows_the_format() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2.0f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2.0f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0xFF).is_nan());
        assert_eq!(f32_to_e4m3(f32::from_bits(0xFFC0_0000)), 0xFF);
        let v = e4m3_values();
        assert!(v.windows(2).all(|w| w[0] < w[1]), "E4M3 codes 0..0x7E increase");
    }

    /// Checks `fast` against `reference` for every fp32 bit pattern. The reference is monotone
    /// in |x| between NaNs, so a chunk of consecutive patterns whose two ends agree maps to one
    /// code: the reference is evaluated at chunk ends (and at every element of the few chunks
    /// where the ends differ), and `fast` at every element.
    fn check_all_f32(fast: impl Fn(f32) -> u8 + Sync, reference: impl Fn(f32) -> u8 + Sync) {
        const CHUNK: u64 = 1 << 16;
        let mismatches: u64 = (0..(1u64 << 32) / CHUNK)
            .into_par_iter()
            .map(|chunk| {
                let first = (chunk * CHUNK) as u32;
                let last = first + (CHUNK as u32 - 1);
                let want = reference(f32::from_bits(first));
                let mut bad = 0u64;
                if want == reference(f32::from_bits(last)) {
                    for bits in first..=last {
                        bad += u64::from(fast(f32::from_bits(bits)) != want);
                    }
                } else {
                    for bits in first..=last {
                        let x = f32::from_bits(bits);
                        bad += u64::from(fast(x) != reference(x));
                    }
                }
                bad
            })
            .sum();
        assert_eq!(mismatches, 0);
    }

    #[test]
    fn e4m3_conversion_matches_the_definition_for_every_f32() {
        let values = e4m3_values();
        check_all_f32(f32_to_e4m3, |x| nearest(x, &values, 0x80, 0x7F));
    }

    #[test]
    fn e2m1_conversion_matches_the_definition_for_every_f32() {
        let values = e2m1_values();
        check_all_f32(f32_to_e2m1, |x| nearest(x, &values, 0x8, 0));
    }

    #[test]
    fn conversions_at_known_points() {
        assert_eq!(f32_to_e4m3(1.0), 0x38);
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(1.0625), 0x38); // tie between 1 and 1.125 goes to the even code
        assert_eq!(f32_to_e4m3(2.0f32.powi(-10)), 0x00); // tie between 0 and 2^-9
        assert_eq!(f32_to_e2m1(5.0), 0x6); // tie between 4 and 6
        assert_eq!(f32_to_e2m1(-0.75), 0xA);
        assert_eq!(f32_to_e2m1(f32::INFINITY), 0x7);
    }

    #[test]
    fn int8_blocks_scale_by_amax_over_127() {
        let y: Vec<f32> = (0..32).map(|i| (i as f32 - 10.0) * 0.37).collect();
        let Quantized::Int8 { codes, scales } = Quantizer::Int8.quantize(&y, 32).unwrap() else {
            panic!("int8 quantizer returned another format")
        };
        assert_eq!(scales[0], 10.0 * 0.37f32 / 127.0);
        assert_eq!(codes[0], -127);
        assert_eq!(codes[10], 0);
        for (i, &q) in codes.iter().enumerate() {
            let back = f32::from(q) * scales[i / 16];
            assert!((back - y[i]).abs() <= scales[i / 16] * 0.5001, "element {i}");
        }
        let zeros = Quantizer::Int8.quantize(&[0.0; 16], 16).unwrap();
        assert_eq!(zeros, Quantized::Int8 { codes: vec![0; 16], scales: vec![0.0] });
    }

    /// INT8 codes against their plain definition: the nearest integer (ties to even) to the exact
    /// product `y * (1 / scale)`, computed in f64 (48 significant bits: exact), clamped to +-127;
    /// for block maxima over every binade, values near every tie and spread over the block, and
    /// blocks whose products land exactly on ties (power-of-two scales).
    #[test]
    fn int8_codes_are_the_nearest_integer_to_the_product_by_the_rounded_inverse() {
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let (mut checked, mut exact_ties) = (0usize, 0usize);
        let powers = (-120..=120).map(|e| 127.0 * 2.0f32.powi(e));
        let random: Vec<f32> =
            (0..600).map(|_| f32::from_bits(0x0480_0000 + (next() % 0x7A80_0000) as u32)).collect();
        for amax in powers.chain(random) {
            let scale = amax / 127.0;
            let (factor, inverse) = int8_inverse(scale);
            assert_eq!(factor, 1.0, "{amax}");
            let mut block: Vec<f32> = vec![amax, -amax, 0.0, -0.0];
            for k in -128..=127 {
                let tie = (k as f32 + 0.5) * scale;
                let b = tie.to_bits() as i64;
                block.extend((-6..=6).map(|d| f32::from_bits((b + d) as u32)));
            }
            block.extend((0..200).map(|_| amax * ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)));
            for &y in block.iter().filter(|y| y.abs() <= amax) {
                let product = f64::from(y) * f64::from(inverse);
                let want = product.round_ties_even().clamp(-127.0, 127.0) as i8;
                exact_ties += usize::from(product.fract().abs() == 0.5);
                assert_eq!(
                    int8_code(y, scale, 1.0, inverse),
                    want,
                    "{y} ({:#010x}) in a block of {amax}",
                    y.to_bits()
                );
                checked += 1;
            }
        }
        assert!(checked > 1_000_000 && exact_ties > 10_000, "{checked} values, {exact_ties} exact ties");
        // The whole-block path: the block's maximum sets the scale, codes as above.
        let y: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.3).collect();
        let mut codes = [0i8; 16];
        let scale = int8_block(&y, &mut codes);
        assert_eq!(scale, 2.25 / 127.0);
        for (i, &q) in codes.iter().enumerate() {
            assert_eq!(q, int8_code(y[i], scale, 1.0, 1.0 / scale));
        }
        // A scale whose inverse overflows scales both sides by 2^64; an infinite scale gives 0
        // (and -127 for the infinite value itself, inf * 0 being NaN), a NaN value -127.
        let tiny = f32::from_bits(0x1000);
        let tiny_scale = tiny / 127.0;
        let (factor, inverse) = int8_inverse(tiny_scale);
        assert!((1.0 / tiny_scale).is_infinite() && factor == 2.0f32.powi(64) && inverse.is_finite());
        let product = f64::from(-tiny / 3.0) * 2.0f64.powi(64) * f64::from(inverse);
        assert_eq!(int8_code(-tiny / 3.0, tiny_scale, factor, inverse), product.round_ties_even() as i8);
        assert_eq!(int8_code(tiny, tiny_scale, factor, inverse), 127);
        assert_eq!(int8_code(3.0, f32::INFINITY, 1.0, 0.0), 0);
        assert_eq!(int8_code(f32::INFINITY, f32::INFINITY, 1.0, 0.0), -127);
        assert_eq!(int8_code(f32::NAN, 1.0, 1.0, 1.0), -127);
        assert_eq!(int8_code(1.0, 0.0, 1.0, f32::INFINITY), 0);
    }

    /// [`e2m1_of_product`] against the plain definition: the nearest E2M1 value (ties to the
    /// even code, saturating) to the exact product, found by [`nearest`] in f64; for inverses over
    /// many binades, values near every midpoint of the product's grid, spread over the block and
    /// past its end (saturation), signed zeros, infinities and NaN.
    #[test]
    fn e2m1_codes_are_the_nearest_to_the_exact_product() {
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let values = e2m1_values();
        // The plain definition on an f64 product (exact), as `nearest` does for an f32.
        let plain = |p: f64| -> u8 {
            let sign = if p.is_sign_negative() { 0x8 } else { 0 };
            sign | nearest_code(p.abs(), &values)
        };
        let (mut checked, mut exact_ties) = (0usize, 0usize);
        let random: Vec<f32> =
            (0..300).map(|_| f32::from_bits(0x0080_0000 + (next() % 0x7E00_0000) as u32)).collect();
        let powers = (-40..=40).flat_map(|e| [2.0f32.powi(e), 2.0f32.powi(e) * 3.0]);
        let inverses = powers.chain(random);
        let midpoints = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 7.0];
        for inverse in inverses {
            let mut block: Vec<f32> = vec![0.0, -0.0];
            for m in midpoints {
                // The floats nearest the value whose product is the midpoint.
                let b = (m / inverse).to_bits() as i64;
                for d in -40..=40 {
                    let y = f32::from_bits((b + d) as u32);
                    block.extend([y, -y]);
                }
            }
            block.extend(
                (0..400).map(|_| (8.0 / inverse) * ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)),
            );
            for &y in &block {
                let p = f64::from(y) * f64::from(inverse);
                exact_ties += usize::from(midpoints[..7].iter().any(|&m| p.abs() == f64::from(m)));
                assert_eq!(e2m1_of_product(y, inverse), plain(p), "{y} ({:#010x}) * {inverse}", y.to_bits());
                checked += 1;
            }
        }
        assert!(checked > 500_000 && exact_ties > 100, "{checked} values, {exact_ties} exact ties");
        // Where the product is an fp32 value, the code is f32_to_e2m1's.
        for bits in (0..=u32::MAX).step_by(7919) {
            let y = f32::from_bits(bits);
            assert_eq!(e2m1_of_product(y, 1.0), f32_to_e2m1(y), "{y}");
        }
        assert_eq!(e2m1_of_product(f32::NAN, 1.0), 0);
        assert_eq!(e2m1_of_product(f32::INFINITY, 0.0), 0);
        assert_eq!(e2m1_of_product(f32::NEG_INFINITY, 2.0), 0xF);
        assert_eq!(e2m1_of_product(-0.0, 2.0), 0x8);
        assert_eq!(e2m1_of_product(1.0, f32::INFINITY), 0);
        // A product just past a midpoint whose fp32 rounding lands on it ((2.5 - 2^-22)
        // (1 + 2^-23) = 2.5 + 2^-24 - 2^-45 rounds to 2.5): the exact product's code, not the
        // rounded one's.
        let y = 2.5f32 - 2.0f32.powi(-22);
        assert_eq!(e2m1_of_product(y, 1.0 + 2.0f32.powi(-23)), 5);
        assert_eq!(f32_to_e2m1(y * (1.0 + 2.0f32.powi(-23))), 4);
    }

    #[test]
    fn nvfp4_blocks_dequantize_close_to_y() {
        let y: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.9).collect();
        let global_scale = 448.0 * 6.0 / 6.75;
        let q = Quantizer::Nvfp4 { global_scale }.quantize(&y, 16).unwrap();
        let Quantized::Nvfp4 { packed, scales } = q else {
            panic!("nvfp4 quantizer returned another format")
        };
        assert_eq!(packed.len(), 8);
        let divisor = e4m3_to_f32(scales[0]) / global_scale;
        assert_eq!(nvfp4_inverse(scales[0], global_scale), global_scale / e4m3_to_f32(scales[0]));
        for (i, &v) in y.iter().enumerate() {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
            let back = e2m1_to_f32(code) * divisor;
            assert!((back - v).abs() <= 0.26 * v.abs().max(0.5), "element {i}: {back} vs {v}");
        }
    }

    #[test]
    fn quantizers_refuse_bad_arguments() {
        assert!(matches!(
            Quantizer::Int8.quantize(&[1.0; 8], 8),
            Err(Error::InvalidArgument { name: "row length", .. })
        ));
        assert!(matches!(
            Quantizer::Fp8E4m3 { scale: 0.0 }.quantize(&[1.0; 8], 8),
            Err(Error::InvalidArgument { name: "quantizer scale", .. })
        ));
    }
}
