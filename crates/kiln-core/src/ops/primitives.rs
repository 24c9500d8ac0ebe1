//! Determinism primitives shared by the CPU references and the CUDA kernels.
//!
//! Each function here has a twin in the CUDA sources (`kernels/norm.cu` and friends) written
//! with the same operations in the same order, so both sides produce the same bits:
//!
//! - [`unit_sum`]: sums over a row in fp32, in units of [`UNIT`] consecutive elements, each unit
//!   reduced by one fixed tree, units combined left to right. The tree is the one a warp computes
//!   when lane `l` holds elements `8l .. 8l + 8` of the unit: each lane adds its eight in pairs,
//!   then the warp folds with `shfl_xor` 16, 8, 4, 2, 1. The result does not depend on the warp
//!   count, the block shape or the row length.
//! - [`unit_dot_fma`]: the LM head's dot product, in the same units and lanes as [`unit_sum`],
//!   but each lane runs one chain of fused multiply-adds over its eight elements instead of
//!   rounding every product and adding them in pairs: `acc = x0 * w0` (rounded), then
//!   `acc = fma(x_k, w_k, acc)` for `k = 1 .. 8` in order, each rounded once; then the warp's xor
//!   butterfly 16, 8, 4, 2, 1 over the 32 lane values, units combined left to right. A GPU lane
//!   does one FFMA per element and row, half the instructions of a rounded product and an add.
//! - [`exp_poly`] and [`silu`]: `exp` as one polynomial with explicit fused multiply-adds, since
//!   neither side's library `exp` is specified to the bit.
//! - [`FloatType`]: rounding to bf16 / fp16 to nearest even, as the `half` crate and the CUDA
//!   prelude (`kernels/prelude.cuh`) do for every finite value and infinity.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Elements per unit of a fixed-order sum.
pub const UNIT: usize = 256;

/// Sums `len` values given by `value(i)` in Kiln's fixed order (see the module docs).
///
/// Elements past `len` in the last unit count as `+0.0`.
pub fn unit_sum(len: usize, value: impl Fn(usize) -> f32) -> f32 {
    let mut total = 0.0f32;
    let mut start = 0;
    while start < len {
        total += unit_tree(|j| if start + j < len { value(start + j) } else { 0.0 });
        start += UNIT;
    }
    total
}

/// Reduces one unit of 256 values: `lane_sum` per group of eight, then the warp's xor butterfly.
fn unit_tree(value: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (lane, slot) in lanes.iter_mut().enumerate() {
        let v: [f32; 8] = std::array::from_fn(|k| value(8 * lane + k));
        *slot = lane_sum8(&v);
    }
    warp_butterfly(&mut lanes)
}

/// The warp's xor butterfly over 32 lane values (distances 16, 8, 4, 2, 1): lane 0's result.
#[inline(always)]
fn warp_butterfly(lanes: &mut [f32; 32]) -> f32 {
    let mut width = 16;
    while width > 0 {
        for lane in 0..width {
            lanes[lane] += lanes[lane + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// The dot product of `x` and `w` (over the shorter length) in Kiln's fused order: units of
/// [`UNIT`] elements; in each, lane `l` (0..32) runs `acc = x[8l] * w[8l]` (rounded), then
/// `acc = fma(x[8l + k], w[8l + k], acc)` for `k = 1 .. 8` in order, each fused operation rounded
/// once; the 32 lane values go through the warp's xor butterfly (as [`unit_sum`]); the units'
/// results are added left to right to `+0.0`. Elements past the end of the last unit count as
/// the pair `(+0.0, +0.0)`.
///
/// The result does not depend on the CPU: `f32::mul_add` is correctly rounded everywhere, and on
/// x86-64 CPUs with FMA the same operations run as FMA instructions.
pub fn unit_dot_fma(x: &[f32], w: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the running CPU has the FMA extension (checked just above).
        return unsafe { unit_dot_fma_x86_fma(x, w) };
    }
    unit_dot_fma_portable(x, w)
}

/// [`unit_dot_fma`] through `f32::mul_add` alone, whatever the CPU (a library call where the
/// target has no fused multiply-add instruction).
pub fn unit_dot_fma_portable(x: &[f32], w: &[f32]) -> f32 {
    unit_dot_fma_body(x, w)
}

/// [`unit_dot_fma`] compiled for x86-64 CPUs with the FMA extension.
///
/// # Safety
///
/// The running CPU must have FMA (`is_x86_feature_detected!("fma")`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn unit_dot_fma_x86_fma(x: &[f32], w: &[f32]) -> f32 {
    unit_dot_fma_body(x, w)
}

/// Whether the running CPU has FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn has_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("fma"))
}

#[inline(always)]
fn unit_dot_fma_body(x: &[f32], w: &[f32]) -> f32 {
    let len = x.len().min(w.len());
    let mut total = 0.0f32;
    let mut start = 0;
    while start < len {
        let n = (len - start).min(UNIT);
        let mut lanes = [0.0f32; 32];
        if n == UNIT {
            fma_lanes(&x[start..start + UNIT], &w[start..start + UNIT], &mut lanes);
        } else {
            // The partial last unit, padded with (+0.0, +0.0) pairs.
            let (mut xs, mut ws) = ([0.0f32; UNIT], [0.0f32; UNIT]);
            xs[..n].copy_from_slice(&x[start..start + n]);
            ws[..n].copy_from_slice(&w[start..start + n]);
            fma_lanes(&xs, &ws, &mut lanes);
        }
        total += warp_butterfly(&mut lanes);
        start += UNIT;
    }
    total
}

/// Each lane's chain over one full unit: `x` and `w` hold [`UNIT`] elements.
#[inline(always)]
fn fma_lanes(x: &[f32], w: &[f32], lanes: &mut [f32; 32]) {
    for (lane, (xs, ws)) in lanes.iter_mut().zip(x.chunks_exact(8).zip(w.chunks_exact(8))) {
        let mut acc = xs[0] * ws[0];
        for k in 1..8 {
            acc = xs[k].mul_add(ws[k], acc);
        }
        *lane = acc;
    }
}

/// The sum of eight values in a lane: `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`.
pub fn lane_sum8(v: &[f32; 8]) -> f32 {
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// `exp(x)` in fp32 by range reduction and one degree-6 polynomial, every fused operation
/// explicit. Relative error about 2 ulp. Above 88.72 the result is `+inf`, below -87.33 it is 0.
#[inline]
pub fn exp_poly(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.722_84 {
        return f32::INFINITY;
    }
    if x < -87.336_55 {
        return 0.0;
    }
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_HI, x);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let r2 = r * r;
    let y = p.mul_add(r2, r) + 1.0;
    // 2^k split in two factors so that k = 128 and k = -126 stay representable.
    let k = k as i32;
    let half = k / 2;
    y * pow2(half) * pow2(k - half)
}

const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// 2^e for e in [-126, 127], built from the exponent bits.
#[inline]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// SiLU, `z / (1 + exp(-z))`, with [`exp_poly`] and a correctly rounded division.
#[inline]
pub fn silu(z: f32) -> f32 {
    z / (1.0 + exp_poly(-z))
}

/// The floating-point element types an activation can have: values are computed in fp32 and
/// rounded to the type once, to nearest even.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatType {
    F32,
    F16,
    BF16,
}

impl FloatType {
    /// The float type of a dtype, or `DTypeNotServed` naming `op`.
    pub fn of(dtype: DType, op: &'static str) -> Result<FloatType> {
        match dtype {
            DType::F32 => Ok(FloatType::F32),
            DType::F16 => Ok(FloatType::F16),
            DType::BF16 => Ok(FloatType::BF16),
            other => Err(Error::DTypeNotServed { dtype: other.name(), op }),
        }
    }

    /// The dtype.
    pub fn dtype(self) -> DType {
        match self {
            FloatType::F32 => DType::F32,
            FloatType::F16 => DType::F16,
            FloatType::BF16 => DType::BF16,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::BF16 => 2,
        }
    }

    /// `v` rounded to this type and widened back to fp32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            FloatType::F32 => v,
            FloatType::F16 => f16_bits_to_f32(f32_to_f16_bits(v)),
            FloatType::BF16 => bf16_bits_to_f32(f32_to_bf16_bits(v)),
        }
    }

    /// Encodes `v` (rounded to nearest even) as little-endian bytes of this type.
    pub fn encode(self, v: f32, out: &mut Vec<u8>) {
        match self {
            FloatType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            FloatType::F16 => out.extend_from_slice(&f32_to_f16_bits(v).to_le_bytes()),
            FloatType::BF16 => out.extend_from_slice(&f32_to_bf16_bits(v).to_le_bytes()),
        }
    }

    /// Decodes element `i` of little-endian `bytes` of this type.
    pub fn decode(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            FloatType::F32 => {
                f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]])
            }
            FloatType::F16 => f16_bits_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
            FloatType::BF16 => bf16_bits_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        }
    }
}

/// fp32 to bf16 bits, to nearest even (a NaN stays a NaN, sign and top payload kept, as the
/// `half` crate and the CUDA prelude do).
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// bf16 bits to fp32 (exact).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// fp32 to fp16 bits, to nearest even.
pub fn f32_to_f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// fp16 bits to fp32 (exact).
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_sum_of_ones_counts_the_elements() {
        for len in [0, 1, 7, 255, 256, 257, 1000, 4096] {
            assert_eq!(unit_sum(len, |_| 1.0), len as f32);
        }
    }

    #[test]
    fn unit_sum_follows_the_tree_not_the_sequence() {
        // Left to right, ((1 + 2^24) + 1) - 2^24 is 0; the lane tree computes
        // (1 + 2^24) + (1 - 2^24) = 1.
        let big = 16_777_216.0f32;
        let vals = [1.0, big, 1.0, -big, 0.0, 0.0, 0.0, 0.0];
        let lane = lane_sum8(&vals);
        assert_eq!(lane, 1.0);
        assert_eq!(unit_sum(8, |i| vals[i]), lane);
        // Units combine left to right: unit 1 is added after unit 0 is complete.
        let sum = unit_sum(512, |i| {
            if i == 0 {
                big
            } else if i == 256 {
                1.0
            } else {
                0.0
            }
        });
        assert_eq!(sum, big + 1.0);
    }

    #[test]
    fn unit_dot_fma_fuses_each_lane_chain() {
        // a * a = 1 + 2^-11 + 2^-24 is not an fp32: a rounded product loses 2^-24, a fused
        // multiply-add keeps it. The first product of a lane is rounded, the rest are fused.
        let a = 1.0 + 2.0f32.powi(-12);
        let x = [1.0, a, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let w = [-(1.0 + 2.0f32.powi(-11)), a, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(unit_dot_fma(&x, &w), 2.0f32.powi(-24));
        assert_eq!(unit_sum(8, |i| x[i] * w[i]), 0.0);
        // Swapped: the rounded first product is a * a, and the fused one adds exactly -1 - 2^-11.
        let (x2, w2) = ([a, 1.0], [a, -(1.0 + 2.0f32.powi(-11))]);
        assert_eq!(unit_dot_fma(&x2, &w2), 0.0);
        // A chain runs in sequence: ((2^24 + 0) + 1) + 1 stays 2^24 (each + 1 a tie to even),
        // where lane_sum8's pairs give (2^24 + 0) + (1 + 1) = 2^24 + 2.
        let big = 16_777_216.0f32;
        let (x3, ones) = ([big, 0.0, 1.0, 1.0], [1.0f32; 4]);
        assert_eq!(unit_dot_fma(&x3, &ones), big);
        assert_eq!(unit_sum(4, |i| x3[i]), big + 2.0);
        // Lanes meet in the butterfly: lane 0 + lane 16 first, then + (lane 8 + lane 24).
        let mut xs = vec![0.0f32; 256];
        xs[0] = big;
        xs[16 * 8] = 1.0;
        xs[8 * 8] = 1.0;
        xs[24 * 8] = -big;
        // (2^24 + 1) + (1 - 2^24) = 2^24 + (1 - 2^24) = 1; left to right it would be 0.
        assert_eq!(unit_dot_fma(&xs, &[1.0; 256]), 1.0);
        // Units add left to right.
        let mut long = vec![0.0f32; 513];
        long[0] = big;
        long[256] = 1.0;
        long[512] = 1.0;
        assert_eq!(unit_dot_fma(&long, &[1.0; 513]), big);
        assert_eq!(unit_dot_fma(&[], &[]), 0.0);
    }

    #[test]
    fn unit_dot_fma_is_the_same_on_every_path() {
        // Values over many binades, subnormals and signed zeros; the portable path (mul_add)
        // and the path this CPU takes (FMA instructions where it has them) give the same bits.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for len in [1usize, 8, 9, 255, 256, 257, 576, 896, 4096] {
            for _ in 0..20 {
                let mut value = || {
                    let r = next();
                    match r % 16 {
                        0 => f32::from_bits((r >> 32) as u32 & 0x807F_FFFF), // subnormal or zero
                        1 => 0.0,
                        2 => -0.0,
                        _ => f32::from_bits(
                            ((r >> 32) as u32 & 0x807F_FFFF) | ((100 + (r >> 8) % 56) as u32) << 23,
                        ),
                    }
                };
                let x: Vec<f32> = (0..len).map(|_| value()).collect();
                let w: Vec<f32> = (0..len).map(|_| value()).collect();
                let portable = unit_dot_fma_portable(&x, &w);
                assert_eq!(unit_dot_fma(&x, &w).to_bits(), portable.to_bits(), "len {len}");
                #[cfg(target_arch = "x86_64")]
                if is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has FMA (checked just above).
                    let fused = unsafe { unit_dot_fma_x86_fma(&x, &w) };
                    assert_eq!(fused.to_bits(), portable.to_bits(), "len {len}");
                }
            }
        }
    }

    #[test]
    fn exp_poly_is_close_to_exp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_poly(x) as f64;
            assert!(((got - want) / want).abs() < 4e-7, "exp({x}) = {got}, want {want}");
            x += 0.0137;
        }
        assert_eq!(exp_poly(0.0), 1.0);
        assert_eq!(exp_poly(100.0), f32::INFINITY);
        assert_eq!(exp_poly(-100.0), 0.0);
        assert!(exp_poly(f32::NAN).is_nan());
    }

    #[test]
    fn silu_matches_its_definition() {
        for z in [-20.0f32, -3.5, -1.0, 0.0, 0.25, 1.0, 7.0, 30.0] {
            let want = z as f64 / (1.0 + (-z as f64).exp());
            assert!((silu(z) as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30), "silu({z})");
        }
        assert_eq!(silu(-200.0), -0.0);
    }

    #[test]
    fn bf16_and_f16_round_to_nearest_even() {
        assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3F80); // tie to even (down)
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3F82); // tie to even (up)
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::from_bits(0x7F80_0001))).is_nan());
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80); // rounds up to infinity
        assert_eq!(f32_to_bf16_bits(f32::from_bits(1)), 0x0000); // subnormal rounds to zero
        assert_eq!(f32_to_f16_bits(65520.0), 0x7C00);
        assert_eq!(f32_to_f16_bits(2.0f32.powi(-25)), 0x0000); // tie between 0 and 2^-24
        assert_eq!(f32_to_f16_bits(3.0 * 2.0f32.powi(-25)), 0x0002);
        assert_eq!(FloatType::F16.round(1.0 + 1.0 / 2048.0), 1.0);
        assert_eq!(FloatType::BF16.round(-3.0), -3.0);
    }
}
