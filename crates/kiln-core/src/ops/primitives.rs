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
    let mut width = 16;
    while width > 0 {
        for lane in 0..width {
            lanes[lane] += lanes[lane + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// The sum of eight values in a lane: `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`.
pub fn lane_sum8(v: &[f32; 8]) -> f32 {
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// `exp(x)` in fp32 by range reduction and one degree-6 polynomial, every fused operation
/// explicit. Relative error about 2 ulp. Above 88.72 the result is `+inf`, below -87.33 it is 0.
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
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// SiLU, `z / (1 + exp(-z))`, with [`exp_poly`] and a correctly rounded division.
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
