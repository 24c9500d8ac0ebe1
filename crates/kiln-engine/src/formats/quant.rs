//! GGML block formats: dequantization, and the quantized-by-float dot product the CPU model uses.
//!
//! Each block format is decoded exactly as ggml's reference (`dequantize_row_*` in
//! `ggml-quants.c`), with the same float operations in the same order, so the values equal those
//! of llama.cpp's `gguf` Python package bit for bit (checked by the fixtures in
//! `tests/fixtures/`).
//!
//! [`dot_row`] never writes a row out in floats: it walks the row block by block, scaling each
//! block's integer-by-float products by the block's scale, and accumulates in 16 or 32 independent
//! lanes (fixed-size arrays) so the compiler turns the lanes into SIMD registers. The whole
//! function is compiled twice, once for the baseline target and once with AVX2 and FMA enabled,
//! and the second is chosen at run time when the CPU has them; with AVX2 every block format but
//! Q8_K takes a hand-written kernel (`avx2`); Q8_K decodes a block at a time into a buffer.
//!
//! On CPUs with AVX-512 VNNI, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL and IQ4_XS rows take
//! the integer kernels of `int_dot` instead: x is prepared once per vector ([`DotX`]) as 23-bit
//! fixed point per block of 32 in three int8 planes, each block's products are exact 32-bit sums
//! (`vpdpbusd`), scaled once per block in fp32; the error stays at fp32's level
//! (`sum |w| * amax * 2^-23` per block, `amax` the block's largest |x|). [`dot_rows_many`]
//! unpacks each row once for four vectors (a prompt's tokens). A single vector's Q8_0 rows keep
//! the float kernel: there the integer one read a 49152 x 576 matrix (SmolLM2's output layer)
//! from memory at half the float kernel's speed, while over four vectors it takes 0.56x the float
//! kernel's time a vector (`matvec_bench`).
//! `KILN_CPU_NO_VNNI=1` (or `KILN_CPU_NO_AVX512=1`) keeps the float kernels throughout.

use half::{bf16, f16};
use kiln_core::{DType, Error, Result};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::float_dot;
use super::int_dot::{self, IntX};

/// Elements per super-block of the K formats.
pub const QK_K: usize = 256;

const Q4_0_BYTES: usize = 18;
const Q4_1_BYTES: usize = 20;
const Q5_0_BYTES: usize = 22;
const Q5_1_BYTES: usize = 24;
const Q8_0_BYTES: usize = 34;
const Q2_K_BYTES: usize = 84;
const Q3_K_BYTES: usize = 110;
const Q4_K_BYTES: usize = 144;
const Q5_K_BYTES: usize = 176;
const Q6_K_BYTES: usize = 210;
const Q8_K_BYTES: usize = 292;
const IQ4_NL_BYTES: usize = 18;
const IQ4_XS_BYTES: usize = 136;

/// The dtypes [`dequantize_row`] and [`dot_row`] serve.
pub const SERVED: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q8_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

/// f16 bits to f32, exactly (normals, subnormals, infinities, NaN payloads), without branches
/// or a table so that it vectorizes: the 15 bits of exponent and mantissa shifted into an f32
/// and rescaled by 2^112, the exponent forced to all ones for Inf/NaN, the sign put back. A NaN
/// keeps its payload unquieted, as numpy converts it.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let magnitude = h & 0x7fff;
    let scaled = (f32::from_bits(magnitude << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let special = if magnitude >= 0x7c00 { 0x7f80_0000 } else { 0 };
    f32::from_bits(scaled | special | ((h & 0x8000) << 16))
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Splits `bytes` into blocks of `N` bytes (the caller checked the length is a multiple).
#[inline(always)]
fn blocks<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = &[u8; N]> {
    bytes.chunks_exact(N).filter_map(|c| c.first_chunk::<N>())
}

/// Checks that `bytes` holds exactly `elements` elements of `dtype`, and that it is served.
fn check_row(op: &'static str, dtype: DType, bytes: &[u8], elements: usize) -> Result<()> {
    if !SERVED.contains(&dtype) {
        return Err(Error::DTypeNotServed { dtype: dtype.name(), op });
    }
    let expected = dtype.bytes_for(elements as u64)?;
    if expected != bytes.len() as u64 {
        return Err(Error::ByteLength {
            what: format!("{op}: {elements} elements of {dtype}"),
            expected,
            got: bytes.len() as u64,
        });
    }
    Ok(())
}

// ---- block decoders, following ggml-quants.c ------------------------------------------------

#[inline(always)]
fn dequant_q4_0(b: &[u8; Q4_0_BYTES], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        y[j] = d * ((b[2 + j] & 0x0F) as i32 - 8) as f32;
        y[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
    }
}

#[inline(always)]
fn dequant_q4_1(b: &[u8; Q4_1_BYTES], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        y[j] = d * (b[4 + j] & 0x0F) as f32 + m;
        y[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
    }
}

#[inline(always)]
fn dequant_q5_0(b: &[u8; Q5_0_BYTES], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = d * (((b[6 + j] & 0x0F) | h0) as i32 - 16) as f32;
        y[j + 16] = d * (((b[6 + j] >> 4) | h1) as i32 - 16) as f32;
    }
}

#[inline(always)]
fn dequant_q5_1(b: &[u8; Q5_1_BYTES], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = d * ((b[8 + j] & 0x0F) | h0) as f32 + m;
        y[j + 16] = d * ((b[8 + j] >> 4) | h1) as f32 + m;
    }
}

#[inline(always)]
fn dequant_q8_0(b: &[u8; Q8_0_BYTES], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 16 values of IQ4_NL's (and IQ4_XS's) 4-bit codes: a non-linear grid of signed bytes.
pub(crate) const IQ4_VALUES: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// 32 values of IQ4 codes: `qs` 16 bytes, low nibbles values 0-15, high nibbles 16-31, each
/// `scale` times the code's value in IQ4_VALUES.
#[inline(always)]
fn iq4_values(scale: f32, qs: &[u8], y: &mut [f32]) {
    for j in 0..16 {
        y[j] = scale * f32::from(IQ4_VALUES[usize::from(qs[j] & 0x0F)]);
        y[j + 16] = scale * f32::from(IQ4_VALUES[usize::from(qs[j] >> 4)]);
    }
}

#[inline(always)]
fn dequant_iq4_nl(b: &[u8; IQ4_NL_BYTES], y: &mut [f32]) {
    // d f16 | qs[16]
    iq4_values(f16_at(b, 0), &b[2..], y);
}

/// The scale of sub-block `ib` (of 32 values) of an IQ4_XS block, still offset by 32: its low
/// four bits from `scales_l`, its high two from `scales_h`.
#[inline(always)]
pub(crate) fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    i32::from(low) | (i32::from((high >> (2 * ib)) & 3) << 4)
}

#[inline(always)]
fn dequant_iq4_xs(b: &[u8; IQ4_XS_BYTES], y: &mut [f32]) {
    // d f16 | scales_h u16 | scales_l[4] | qs[128]: eight sub-blocks of 32, each IQ4_NL's layout
    // with its own scale d (ls - 32), rounded once in f32 before the code's value multiplies it.
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let dl = d * (iq4_xs_scale(b, ib) - 32) as f32;
        iq4_values(dl, &b[8 + 16 * ib..], &mut y[32 * ib..]);
    }
}

#[inline(always)]
fn dequant_q2_k(b: &[u8; Q2_K_BYTES], y: &mut [f32]) {
    // scales[16] | qs[64] | d f16 | dmin f16
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut out = 0;
    let mut is = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = b[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
                for l in 0..16 {
                    y[out + l] = dl * ((q[16 * part + l] >> shift) & 3) as f32 - ml;
                }
                out += 16;
            }
        }
    }
}

/// The 16 six-bit scales of a Q3_K block (its 12 bytes of scales), each still offset by 32.
#[inline(always)]
pub(crate) fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (a0, a1, tmp) = (word(0), word(4), word(8));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut scales = [0i8; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        *s = aux[i / 4].to_le_bytes()[i % 4] as i8;
    }
    scales
}

#[inline(always)]
fn dequant_q3_k(b: &[u8; Q3_K_BYTES], y: &mut [f32]) {
    // hmask[32] | qs[64] | scales[12] | d f16
    let d_all = f16_at(b, 108);
    let scales = q3_k_scales(&b[96..108]);
    let hm = &b[0..32];
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let k = 16 * part + l;
                    let low = ((q[k] >> shift) & 3) as i32;
                    let high = if hm[k] & m != 0 { 0 } else { 4 };
                    y[out + l] = dl * (low - high) as f32;
                }
                out += 16;
            }
            m <<= 1;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[inline(always)]
fn dequant_q4_k(b: &[u8; Q4_K_BYTES], y: &mut [f32]) {
    // d f16 | dmin f16 | scales[12] | qs[128]
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for chunk in 0..4 {
        let q = &b[16 + 32 * chunk..16 + 32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - min1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

#[inline(always)]
fn dequant_q5_k(b: &[u8; Q5_K_BYTES], y: &mut [f32]) {
    // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for chunk in 0..4 {
        let ql = &b[48 + 32 * chunk..48 + 32 * chunk + 32];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let y = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - min1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - min2;
        }
    }
}

#[inline(always)]
fn dequant_q6_k(b: &[u8; Q6_K_BYTES], y: &mut [f32]) {
    // ql[128] | qh[64] | scales[16] (i8) | d f16
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[inline(always)]
fn dequant_q8_k(b: &[u8; Q8_K_BYTES], y: &mut [f32]) {
    // d f32 | qs[256] (i8) | bsums[16] (i16)
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..QK_K {
        y[j] = d * (b[4 + j] as i8) as f32;
    }
}

/// Decodes one row of `dtype` from `bytes` into `out` (as many elements as `out` holds).
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_row("dequantize_row", dtype, bytes, out.len())?;
    macro_rules! each_block {
        ($n:expr, $size:expr, $f:ident) => {
            for (b, y) in blocks::<$n>(bytes).zip(out.chunks_exact_mut($size)) {
                $f(b, y);
            }
        };
    }
    match dtype {
        DType::F32 => {
            for (c, y) in bytes.chunks_exact(4).zip(out.iter_mut()) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (c, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (c, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::Q4_0 => each_block!(Q4_0_BYTES, 32, dequant_q4_0),
        DType::Q4_1 => each_block!(Q4_1_BYTES, 32, dequant_q4_1),
        DType::Q5_0 => each_block!(Q5_0_BYTES, 32, dequant_q5_0),
        DType::Q5_1 => each_block!(Q5_1_BYTES, 32, dequant_q5_1),
        DType::Q8_0 => each_block!(Q8_0_BYTES, 32, dequant_q8_0),
        DType::Q2_K => each_block!(Q2_K_BYTES, QK_K, dequant_q2_k),
        DType::Q3_K => each_block!(Q3_K_BYTES, QK_K, dequant_q3_k),
        DType::Q4_K => each_block!(Q4_K_BYTES, QK_K, dequant_q4_k),
        DType::Q5_K => each_block!(Q5_K_BYTES, QK_K, dequant_q5_k),
        DType::Q6_K => each_block!(Q6_K_BYTES, QK_K, dequant_q6_k),
        DType::Q8_K => each_block!(Q8_K_BYTES, QK_K, dequant_q8_k),
        DType::IQ4_NL => each_block!(IQ4_NL_BYTES, 32, dequant_iq4_nl),
        DType::IQ4_XS => each_block!(IQ4_XS_BYTES, QK_K, dequant_iq4_xs),
        other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "dequantize_row" }),
    }
    Ok(())
}

// ---- the dot product -------------------------------------------------------------------------

/// Lanes of the running sums: two AVX2 registers, or one AVX-512 register.
const LANES: usize = 16;

#[inline(always)]
pub(crate) fn lane_sum(acc: &[f32; LANES]) -> f32 {
    // A fixed pairwise tree, so the result does not depend on the SIMD width chosen.
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            v[i] += v[i + width];
        }
        width /= 2;
    }
    v[0]
}

#[inline(always)]
fn x_block<const N: usize>(x: &[f32], block: usize) -> &[f32; N] {
    // The caller checked x.len() == blocks * N; `first_chunk` on the exact sub-slice cannot fail,
    // and the fallback only keeps the function total.
    x[block * N..].first_chunk::<N>().unwrap_or(&[0.0; N])
}

#[inline(always)]
fn dot_q4_0(bytes: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (i, b) in blocks::<Q4_0_BYTES>(bytes).enumerate() {
        let xb = x_block::<32>(x, i);
        let d = f16_at(b, 0);
        let qs: &[u8; 16] = b[2..].first_chunk().unwrap_or(&[0; 16]);
        for j in 0..16 {
            let lo = ((qs[j] & 0x0F) as i32 - 8) as f32;
            let hi = ((qs[j] >> 4) as i32 - 8) as f32;
            acc[j] += d * (lo * xb[j] + hi * xb[j + 16]);
        }
    }
    lane_sum(&acc)
}

#[inline(always)]
fn dot_q4_1(bytes: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (i, b) in blocks::<Q4_1_BYTES>(bytes).enumerate() {
        let xb = x_block::<32>(x, i);
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let qs: &[u8; 16] = b[4..].first_chunk().unwrap_or(&[0; 16]);
        for j in 0..16 {
            let lo = (qs[j] & 0x0F) as f32;
            let hi = (qs[j] >> 4) as f32;
            acc[j] += d * (lo * xb[j] + hi * xb[j + 16]) + m * (xb[j] + xb[j + 16]);
        }
    }
    lane_sum(&acc)
}

#[inline(always)]
fn dot_q8_0(bytes: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    for (i, b) in blocks::<Q8_0_BYTES>(bytes).enumerate() {
        let xb = x_block::<32>(x, i);
        let d = f16_at(b, 0);
        let qs: &[u8; 32] = b[2..].first_chunk().unwrap_or(&[0; 32]);
        for j in 0..16 {
            acc[j] += d * ((qs[j] as i8) as f32 * xb[j] + (qs[j + 16] as i8) as f32 * xb[j + 16]);
        }
    }
    lane_sum(&acc)
}

/// The dot product of a row of blocks decoded one at a time into a stack buffer (the formats
/// whose layout does not pay for a fused kernel yet).
#[inline(always)]
fn dot_decoded<const N: usize, const B: usize>(
    bytes: &[u8],
    x: &[f32],
    decode: impl Fn(&[u8; N], &mut [f32]),
) -> f32 {
    let mut acc = [0f32; LANES];
    let mut y = [0f32; B];
    for (i, b) in blocks::<N>(bytes).enumerate() {
        let xb = x_block::<B>(x, i);
        decode(b, &mut y);
        for k in 0..B / LANES {
            for l in 0..LANES {
                acc[l] += y[k * LANES + l] * xb[k * LANES + l];
            }
        }
    }
    lane_sum(&acc)
}

#[inline(always)]
fn dot_plain(bytes: &[u8], x: &[f32], width: usize, convert: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let row = bytes.chunks_exact(width * LANES);
    let tail_bytes = row.remainder();
    let x_chunks = x.chunks_exact(LANES);
    let tail_x = x_chunks.remainder();
    for (b, xs) in row.zip(x_chunks) {
        for l in 0..LANES {
            acc[l] += convert(&b[l * width..l * width + width]) * xs[l];
        }
    }
    for (l, (b, &xv)) in tail_bytes.chunks_exact(width).zip(tail_x).enumerate() {
        acc[l] += convert(b) * xv;
    }
    lane_sum(&acc)
}

#[inline(always)]
fn dot_row_unchecked(dtype: DType, bytes: &[u8], x: &[f32]) -> f32 {
    match dtype {
        DType::F32 => dot_plain(bytes, x, 4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::F16 => dot_plain(bytes, x, 2, |c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
        // bf16 is the top half of an f32: a shift, no table.
        DType::BF16 => {
            dot_plain(bytes, x, 2, |c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
        }
        DType::Q4_0 => dot_q4_0(bytes, x),
        DType::Q4_1 => dot_q4_1(bytes, x),
        DType::Q8_0 => dot_q8_0(bytes, x),
        DType::Q5_0 => dot_decoded::<Q5_0_BYTES, 32>(bytes, x, dequant_q5_0),
        DType::Q5_1 => dot_decoded::<Q5_1_BYTES, 32>(bytes, x, dequant_q5_1),
        DType::Q2_K => dot_decoded::<Q2_K_BYTES, QK_K>(bytes, x, dequant_q2_k),
        DType::Q3_K => dot_decoded::<Q3_K_BYTES, QK_K>(bytes, x, dequant_q3_k),
        DType::Q4_K => dot_decoded::<Q4_K_BYTES, QK_K>(bytes, x, dequant_q4_k),
        DType::Q5_K => dot_decoded::<Q5_K_BYTES, QK_K>(bytes, x, dequant_q5_k),
        DType::Q6_K => dot_decoded::<Q6_K_BYTES, QK_K>(bytes, x, dequant_q6_k),
        DType::Q8_K => dot_decoded::<Q8_K_BYTES, QK_K>(bytes, x, dequant_q8_k),
        DType::IQ4_NL => dot_decoded::<IQ4_NL_BYTES, 32>(bytes, x, dequant_iq4_nl),
        DType::IQ4_XS => dot_decoded::<IQ4_XS_BYTES, QK_K>(bytes, x, dequant_iq4_xs),
        // check_row() refused every other dtype.
        _ => f32::NAN,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_row_avx2(dtype: DType, bytes: &[u8], x: &[f32]) -> f32 {
    dot_row_unchecked(dtype, bytes, x)
}

/// Whether the running CPU has AVX2, FMA and F16C (checked once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Whether the running CPU has AVX-512F, AVX-512BW and F16C (checked once).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("f16c")
            && std::env::var_os("KILN_CPU_NO_AVX512").is_none()
    })
}

#[inline]
fn dot_row_dispatch(dtype: DType, bytes: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if dtype == DType::Q4_1 && has_avx512() {
        // SAFETY: the CPU was checked at run time for AVX-512F/BW and F16C, and the caller
        // checked that `bytes` holds exactly `x.len()` elements of Q4_1.
        return unsafe { avx512::dot_q4_1(bytes, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was checked at run time for every feature these functions enable, and
        // the caller checked that `bytes` holds exactly `x.len()` elements of `dtype`.
        return unsafe {
            match dtype {
                DType::Q8_0 => avx2::dot_q8_0(bytes, x),
                DType::Q4_1 => avx2::dot_q4_1(bytes, x),
                DType::Q4_0 => avx2::dot_q4_0(bytes, x),
                DType::Q5_0 => avx2::dot_q5_0(bytes, x),
                DType::Q5_1 => avx2::dot_q5_1(bytes, x),
                DType::Q2_K => avx2::dot_q2_k(bytes, x),
                DType::Q3_K => avx2::dot_q3_k(bytes, x),
                DType::Q4_K => avx2::dot_q4_k(bytes, x),
                DType::Q5_K => avx2::dot_q5_k(bytes, x),
                DType::Q6_K => avx2::dot_q6_k(bytes, x),
                DType::IQ4_NL => avx2::dot_iq4_nl(bytes, x),
                DType::IQ4_XS => avx2::dot_iq4_xs(bytes, x),
                _ => dot_row_avx2(dtype, bytes, x),
            }
        };
    }
    dot_row_unchecked(dtype, bytes, x)
}

/// AVX-512 kernel for Q4_1, the default model's format (on this path about 1.5x the AVX2
/// kernel; Q8_0 measured slower with AVX-512 and stays on AVX2): a block's 16 bytes widen to 16 i32
/// lanes in one instruction, so a 32-element block is two 16-lane FMAs against `x`. The block
/// scales are read as one 32-bit word and widened with F16C. The loop is bound by its vector
/// operations (the weights come from cache), so each one saved counts: a table permutation
/// turns a nibble into its float (1.15x over mask-and-convert on 576 × 1536). One row at a time:
/// two rows side by side (two streams a thread) read 16384 × 1536 from memory in 1.6-2.3x the
/// time, and were level from L2.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Q4_1_BYTES;

    /// `(d, m)` of a block whose first four bytes are two f16 values, widened and broadcast: the
    /// 32-bit word is broadcast straight from memory, every (d, m) pair widened at once, and the
    /// even and odd lanes duplicated (four ALU operations, one fewer than widening one pair).
    #[inline(always)]
    unsafe fn scales(b: &[u8]) -> (__m512, __m512) {
        let word = b.as_ptr().cast::<i32>().read_unaligned();
        let pairs = _mm512_cvtph_ps(_mm256_set1_epi32(word));
        (_mm512_moveldup_ps(pairs), _mm512_movehdup_ps(pairs))
    }

    /// The block's 32 quants as floats: lanes j of `lo` and `hi` hold quants j and j + 16 (the
    /// low and high nibbles of byte j). A nibble becomes its float by a lane permutation of the
    /// table 0.0..=15.0, which reads only an index's low four bits: no mask, no conversion.
    #[inline(always)]
    unsafe fn quants(b: &[u8]) -> (__m512, __m512) {
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.as_ptr().add(4).cast()));
        (_mm512_permutexvar_ps(q, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table))
    }

    /// # Safety
    /// AVX-512F/BW and F16C are present; `bytes.len() == x.len() / 32 * 20`.
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    pub unsafe fn dot_q4_1(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let mut acc_min = _mm512_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q4_1_BYTES).enumerate() {
            let (d, m) = scales(b);
            let (lo, hi) = quants(b);
            let xp = x.as_ptr().add(32 * i);
            let (x0, x1) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            let block = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
            acc = _mm512_fmadd_ps(d, block, acc);
            acc_min = _mm512_fmadd_ps(m, _mm512_add_ps(x0, x1), acc_min);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc, acc_min))
    }
}

/// Hand-written AVX2/FMA kernels for the formats of the default model and the common K and IQ4
/// formats (the float path of CPUs without AVX-512 VNNI): per block of 32 (of 16 for Q6_K's
/// scales), the integer quants widened to 8 f32 lanes at a time and multiplied into a block sum
/// with FMA, then the block sum scaled into the running accumulator; the `m` terms of Q4_1, Q5_1,
/// Q4_K and Q5_K take the block's sum of x. IQ4 codes become the grid's signed bytes by a byte
/// shuffle; Q5 fifth bits become 16 on their bytes by a compare.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{
        f16_at, iq4_xs_scale, q3_k_scales, scale_min_k4, DType, IQ4_NL_BYTES, IQ4_VALUES, IQ4_XS_BYTES,
        Q2_K_BYTES, Q3_K_BYTES, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q5_K_BYTES,
        Q6_K_BYTES, Q8_0_BYTES,
    };

    #[inline(always)]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
        _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)))
    }

    /// 16 signed bytes as two vectors of 8 f32.
    #[inline(always)]
    unsafe fn widen_i8(q: __m128i) -> (__m256, __m256) {
        (
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
        )
    }

    /// The sum over a 32-element block of `q[j] * x[j]`, with `lo` holding quants 0..16 and `hi`
    /// quants 16..32 as signed bytes.
    #[inline(always)]
    unsafe fn block_dot(lo: __m128i, hi: __m128i, x: *const f32) -> __m256 {
        let (q0, q1) = widen_i8(lo);
        let (q2, q3) = widen_i8(hi);
        let mut s = _mm256_mul_ps(q0, _mm256_loadu_ps(x));
        s = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x.add(8)), s);
        s = _mm256_fmadd_ps(q2, _mm256_loadu_ps(x.add(16)), s);
        _mm256_fmadd_ps(q3, _mm256_loadu_ps(x.add(24)), s)
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 34`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q8_0(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q8_0_BYTES).enumerate() {
            let d = _mm256_set1_ps(f16_at(b, 0));
            let q = b.as_ptr().add(2);
            let lo = _mm_loadu_si128(q.cast());
            let hi = _mm_loadu_si128(q.add(16).cast());
            acc = _mm256_fmadd_ps(d, block_dot(lo, hi, x.as_ptr().add(32 * i)), acc);
        }
        horizontal_sum(acc)
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 20`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_1(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut acc_min = _mm256_setzero_ps();
        let nibble = _mm_set1_epi8(0x0F);
        for (i, b) in bytes.chunks_exact(Q4_1_BYTES).enumerate() {
            let (d, m) = (_mm256_set1_ps(f16_at(b, 0)), _mm256_set1_ps(f16_at(b, 2)));
            let qs = _mm_loadu_si128(b.as_ptr().add(4).cast());
            let lo = _mm_and_si128(qs, nibble);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), nibble);
            let xp = x.as_ptr().add(32 * i);
            acc = _mm256_fmadd_ps(d, block_dot(lo, hi, xp), acc);
            let xs = _mm256_add_ps(
                _mm256_add_ps(_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8))),
                _mm256_add_ps(_mm256_loadu_ps(xp.add(16)), _mm256_loadu_ps(xp.add(24))),
            );
            acc_min = _mm256_fmadd_ps(m, xs, acc_min);
        }
        horizontal_sum(_mm256_add_ps(acc, acc_min))
    }

    /// The sum over 16 elements of `q[j] * x[j]` (`q` 16 signed bytes).
    #[inline(always)]
    unsafe fn half_dot(q: __m128i, x: *const f32) -> __m256 {
        let (q0, q1) = widen_i8(q);
        _mm256_fmadd_ps(q1, _mm256_loadu_ps(x.add(8)), _mm256_mul_ps(q0, _mm256_loadu_ps(x)))
    }

    /// The sum of 32 elements of x, as 8 lanes.
    #[inline(always)]
    unsafe fn block_sum(x: *const f32) -> __m256 {
        _mm256_add_ps(
            _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8))),
            _mm256_add_ps(_mm256_loadu_ps(x.add(16)), _mm256_loadu_ps(x.add(24))),
        )
    }

    /// IQ4 codes (16 bytes of nibbles at `q`: low nibbles values 0-15, high 16-31) as the grid's
    /// signed bytes `(lo, hi)`.
    #[inline(always)]
    unsafe fn iq4_codes(q: *const u8) -> (__m128i, __m128i) {
        let table = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
        let nibble = _mm_set1_epi8(0x0F);
        let qs = _mm_loadu_si128(q.cast());
        (
            _mm_shuffle_epi8(table, _mm_and_si128(qs, nibble)),
            _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), nibble)),
        )
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 18`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_iq4_nl(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(IQ4_NL_BYTES).enumerate() {
            let (lo, hi) = iq4_codes(b.as_ptr().add(2));
            acc =
                _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), block_dot(lo, hi, x.as_ptr().add(32 * i)), acc);
        }
        horizontal_sum(acc)
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 136`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_iq4_xs(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(IQ4_XS_BYTES).enumerate() {
            let d = f16_at(b, 0);
            for ib in 0..8 {
                let (lo, hi) = iq4_codes(b.as_ptr().add(8 + 16 * ib));
                let dl = _mm256_set1_ps(d * (iq4_xs_scale(b, ib) - 32) as f32);
                acc = _mm256_fmadd_ps(dl, block_dot(lo, hi, x.as_ptr().add(256 * i + 32 * ib)), acc);
            }
        }
        horizontal_sum(acc)
    }

    /// 16 bytes, 16 where bit `j` of `bits` is set (byte `j`), 0 elsewhere: a Q5 block's fifth bits.
    #[inline(always)]
    unsafe fn fifth_bits(bits: u16) -> __m128i {
        let spread = _mm_shuffle_epi8(
            _mm_set1_epi16(bits as i16),
            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        );
        let select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
        bit_bytes(spread, select, 0x10)
    }

    /// `value` on the bytes of `v` where the bit of `select` (on the same byte) is set, 0
    /// elsewhere.
    #[inline(always)]
    unsafe fn bit_bytes(v: __m128i, select: __m128i, value: i8) -> __m128i {
        _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, select), select), _mm_set1_epi8(value))
    }

    /// The sum of 16 elements of x, as 8 lanes.
    #[inline(always)]
    unsafe fn half_sum(x: *const f32) -> __m256 {
        _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)))
    }

    /// The two bits at `shift` (0, 2, 4 or 6) of each of 16 bytes.
    #[inline(always)]
    unsafe fn two_bits(q: __m128i, shift: i32) -> __m128i {
        _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3))
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 84`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q2_k(bytes: &[u8], x: &[f32]) -> f32 {
        // scales[16] (a sub-block of 16: `sc` the low nibble, `m` the high) | qs[64] | d | dmin:
        // group g of 32 (half g / 4 of the qs, shift 2 (g % 4)) holds sub-blocks 2g (qs bytes
        // 0-15) and 2g + 1 (16-31); a value is `d sc q - dmin m`.
        let mut acc = _mm256_setzero_ps();
        let mut acc_min = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q2_K_BYTES).enumerate() {
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for half in 0..2 {
                let q = b.as_ptr().add(16 + 32 * half);
                let (q0, q1) = (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast()));
                for k in 0..4 {
                    let g = 4 * half + k;
                    for (part, qs) in [q0, q1].into_iter().enumerate() {
                        let sc = b[2 * g + part];
                        let xp = x.as_ptr().add(256 * i + 32 * g + 16 * part);
                        let dl = _mm256_set1_ps(d * f32::from(sc & 0x0F));
                        acc = _mm256_fmadd_ps(dl, half_dot(two_bits(qs, 2 * k as i32), xp), acc);
                        acc_min =
                            _mm256_fmadd_ps(_mm256_set1_ps(dmin * f32::from(sc >> 4)), half_sum(xp), acc_min);
                    }
                }
            }
        }
        horizontal_sum(_mm256_sub_ps(acc, acc_min))
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 110`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q3_k(bytes: &[u8], x: &[f32]) -> f32 {
        // hmask[32] | qs[64] | scales[12] | d: group g of 32 as Q2_K's, a value `d (sc - 32) (q -
        // 4)` where q is the two bits plus 4 when bit g of hmask byte l (value l of the group) is
        // set.
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q3_K_BYTES).enumerate() {
            let d = f16_at(b, 108);
            let scales = q3_k_scales(&b[96..108]);
            let hm = [_mm_loadu_si128(b.as_ptr().cast()), _mm_loadu_si128(b.as_ptr().add(16).cast())];
            for half in 0..2 {
                let q = b.as_ptr().add(32 + 32 * half);
                let (q0, q1) = (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast()));
                for k in 0..4 {
                    let g = 4 * half + k;
                    let bit = _mm_set1_epi8((1u8 << g) as i8);
                    for (part, qs) in [q0, q1].into_iter().enumerate() {
                        let third = bit_bytes(hm[part], bit, 4);
                        let quants =
                            _mm_sub_epi8(_mm_or_si128(two_bits(qs, 2 * k as i32), third), _mm_set1_epi8(4));
                        let dl = _mm256_set1_ps(d * f32::from(i16::from(scales[2 * g + part]) - 32));
                        let xp = x.as_ptr().add(256 * i + 32 * g + 16 * part);
                        acc = _mm256_fmadd_ps(dl, half_dot(quants, xp), acc);
                    }
                }
            }
        }
        horizontal_sum(acc)
    }

    /// A Q5 block's 32 quants (nibbles at `qs`, fifth bits `qh`: bit `j` that of value `j`) as
    /// `(values 0-15, values 16-31)` in bytes, less `offset`.
    #[inline(always)]
    unsafe fn q5_quants(qs: *const u8, qh: u32, offset: i8) -> (__m128i, __m128i) {
        let nibble = _mm_set1_epi8(0x0F);
        let q = _mm_loadu_si128(qs.cast());
        let lo = _mm_or_si128(_mm_and_si128(q, nibble), fifth_bits(qh as u16));
        let hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), nibble), fifth_bits((qh >> 16) as u16));
        let offset = _mm_set1_epi8(offset);
        (_mm_sub_epi8(lo, offset), _mm_sub_epi8(hi, offset))
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 22`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q5_0(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q5_0_BYTES).enumerate() {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let (lo, hi) = q5_quants(b.as_ptr().add(6), qh, 16);
            acc =
                _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), block_dot(lo, hi, x.as_ptr().add(32 * i)), acc);
        }
        horizontal_sum(acc)
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 24`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q5_1(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut acc_min = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q5_1_BYTES).enumerate() {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let (lo, hi) = q5_quants(b.as_ptr().add(8), qh, 0);
            let xp = x.as_ptr().add(32 * i);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 0)), block_dot(lo, hi, xp), acc);
            acc_min = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b, 2)), block_sum(xp), acc_min);
        }
        horizontal_sum(_mm256_add_ps(acc, acc_min))
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 144`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_k(bytes: &[u8], x: &[f32]) -> f32 {
        dot_k::<false>(bytes, x)
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 176`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q5_k(bytes: &[u8], x: &[f32]) -> f32 {
        dot_k::<true>(bytes, x)
    }

    /// Q4_K (`FIFTH` false) and Q5_K (true): d, dmin, 12 bytes of 6-bit scales and mins, for Q5_K
    /// qh[32] (bit `k` of byte `l` the fifth bit of value `l` of sub-block `k`), then the nibbles,
    /// 32 bytes per two sub-blocks (low nibbles the first, high the second).
    #[inline(always)]
    unsafe fn dot_k<const FIFTH: bool>(bytes: &[u8], x: &[f32]) -> f32 {
        let (block_bytes, quants) = if FIFTH { (Q5_K_BYTES, 48) } else { (Q4_K_BYTES, 16) };
        let mut acc = _mm256_setzero_ps();
        let mut acc_min = _mm256_setzero_ps();
        let nibble = _mm_set1_epi8(0x0F);
        for (i, b) in bytes.chunks_exact(block_bytes).enumerate() {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (h0, h1) =
                (_mm_loadu_si128(b.as_ptr().add(16).cast()), _mm_loadu_si128(b.as_ptr().add(32).cast()));
            for chunk in 0..4 {
                let q = b.as_ptr().add(quants + 32 * chunk);
                let (q0, q1) = (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast()));
                for half in 0..2 {
                    let (l0, l1) =
                        if half == 0 { (q0, q1) } else { (_mm_srli_epi16(q0, 4), _mm_srli_epi16(q1, 4)) };
                    let (mut lo, mut hi) = (_mm_and_si128(l0, nibble), _mm_and_si128(l1, nibble));
                    if FIFTH {
                        let bit = _mm_set1_epi8((1u8 << (2 * chunk + half)) as i8);
                        lo = _mm_or_si128(lo, bit_bytes(h0, bit, 0x10));
                        hi = _mm_or_si128(hi, bit_bytes(h1, bit, 0x10));
                    }
                    let (sc, m) = scale_min_k4(2 * chunk + half, scales);
                    let xp = x.as_ptr().add(256 * i + 64 * chunk + 32 * half);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * f32::from(sc)), block_dot(lo, hi, xp), acc);
                    acc_min = _mm256_fmadd_ps(_mm256_set1_ps(dmin * f32::from(m)), block_sum(xp), acc_min);
                }
            }
        }
        horizontal_sum(_mm256_sub_ps(acc, acc_min))
    }

    /// 16 six-bit Q6_K quants less 32 as signed bytes: four bits of `l` from bit `shift_l` (0 or
    /// 4), two of `h` from bit `shift_h` (a function, not a closure: a closure does not take its
    /// caller's target features).
    #[inline(always)]
    unsafe fn q6_k_quants(l: __m128i, h: __m128i, shift_l: i32, shift_h: i32) -> __m128i {
        let low = _mm_and_si128(_mm_srl_epi16(l, _mm_cvtsi32_si128(shift_l)), _mm_set1_epi8(0x0F));
        let high = _mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(shift_h)), _mm_set1_epi8(0x03));
        _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32))
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 256 * 210`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q6_k(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (i, b) in bytes.chunks_exact(Q6_K_BYTES).enumerate() {
            let d = f16_at(b, 208);
            for half in 0..2 {
                // Groups of 32 of the half: ql[0..32] low nibbles with qh bits 0-1, ql[32..64]
                // low with bits 2-3, ql[0..32] high with bits 4-5, ql[32..64] high with 6-7.
                let ql = b.as_ptr().add(64 * half);
                let qh = b.as_ptr().add(128 + 32 * half);
                let sc = b.as_ptr().add(192 + 8 * half).cast::<i8>();
                for part in 0..2 {
                    // Values 16 part .. 16 part + 16 of each group.
                    let l0 = _mm_loadu_si128(ql.add(16 * part).cast());
                    let l1 = _mm_loadu_si128(ql.add(32 + 16 * part).cast());
                    let h = _mm_loadu_si128(qh.add(16 * part).cast());
                    let groups = [
                        q6_k_quants(l0, h, 0, 0),
                        q6_k_quants(l1, h, 0, 2),
                        q6_k_quants(l0, h, 4, 4),
                        q6_k_quants(l1, h, 4, 6),
                    ];
                    for (g, q) in groups.into_iter().enumerate() {
                        let scale = d * f32::from(sc.add(2 * g + part).read());
                        let xp = x.as_ptr().add(256 * i + 128 * half + 32 * g + 16 * part);
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), half_dot(q, xp), acc);
                    }
                }
            }
        }
        horizontal_sum(acc)
    }

    /// One block's 32 quants (`lo`: 0..16, `hi`: 16..32, signed bytes) as four vectors of 8 f32,
    /// as [`block_dot`] widens them.
    #[inline(always)]
    unsafe fn widen_block(lo: __m128i, hi: __m128i) -> [__m256; 4] {
        let (q0, q1) = widen_i8(lo);
        let (q2, q3) = widen_i8(hi);
        [q0, q1, q2, q3]
    }

    /// [`block_dot`] of quants already widened.
    #[inline(always)]
    unsafe fn widened_dot(q: &[__m256; 4], x: *const f32) -> __m256 {
        let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
        s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x.add(8)), s);
        s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x.add(16)), s);
        _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x.add(24)), s)
    }

    /// One row of Q4_0, Q4_1 or Q8_0 (`dtype`) against `T` vectors: each block unpacked and widened
    /// once for the `T`, and each vector's sum by the operations of [`dot_q4_0`], [`dot_q4_1`] or
    /// [`dot_q8_0`] alone, in their order (the same bits).
    ///
    /// # Safety
    /// AVX2 and FMA are present; `dtype` is Q4_0, Q4_1 or Q8_0 and `bytes` holds `xs[t].len()` of
    /// its values for every `t`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_many<const T: usize>(dtype: DType, bytes: &[u8], xs: [&[f32]; T]) -> [f32; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_min = [_mm256_setzero_ps(); T];
        let nibble = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        let block_bytes = match dtype {
            DType::Q4_0 => Q4_0_BYTES,
            DType::Q4_1 => Q4_1_BYTES,
            _ => Q8_0_BYTES,
        };
        for (i, b) in bytes.chunks_exact(block_bytes).enumerate() {
            let d = _mm256_set1_ps(f16_at(b, 0));
            let q = match dtype {
                DType::Q4_0 => {
                    let qs = _mm_loadu_si128(b.as_ptr().add(2).cast());
                    let lo = _mm_sub_epi8(_mm_and_si128(qs, nibble), eight);
                    widen_block(lo, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), eight))
                }
                DType::Q4_1 => {
                    let qs = _mm_loadu_si128(b.as_ptr().add(4).cast());
                    widen_block(_mm_and_si128(qs, nibble), _mm_and_si128(_mm_srli_epi16(qs, 4), nibble))
                }
                _ => {
                    let q = b.as_ptr().add(2);
                    widen_block(_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast()))
                }
            };
            for t in 0..T {
                let xp = xs[t].as_ptr().add(32 * i);
                acc[t] = _mm256_fmadd_ps(d, widened_dot(&q, xp), acc[t]);
                if dtype == DType::Q4_1 {
                    let m = _mm256_set1_ps(f16_at(b, 2));
                    let sum = _mm256_add_ps(
                        _mm256_add_ps(_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8))),
                        _mm256_add_ps(_mm256_loadu_ps(xp.add(16)), _mm256_loadu_ps(xp.add(24))),
                    );
                    acc_min[t] = _mm256_fmadd_ps(m, sum, acc_min[t]);
                }
            }
        }
        std::array::from_fn(|t| {
            if dtype == DType::Q4_1 {
                horizontal_sum(_mm256_add_ps(acc[t], acc_min[t]))
            } else {
                horizontal_sum(acc[t])
            }
        })
    }

    /// # Safety
    /// AVX2 and FMA are present; `bytes.len() == x.len() / 32 * 18`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_0(bytes: &[u8], x: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let nibble = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        for (i, b) in bytes.chunks_exact(Q4_0_BYTES).enumerate() {
            let d = _mm256_set1_ps(f16_at(b, 0));
            let qs = _mm_loadu_si128(b.as_ptr().add(2).cast());
            let lo = _mm_sub_epi8(_mm_and_si128(qs, nibble), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), eight);
            acc = _mm256_fmadd_ps(d, block_dot(lo, hi, x.as_ptr().add(32 * i)), acc);
        }
        horizontal_sum(acc)
    }
}

/// x prepared once for the dot products of many rows: the floats, and where the CPU has AVX-512
/// VNNI and x is finite with a length a multiple of 32, x in fixed point for the integer kernels
/// of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL and IQ4_XS (`int_dot`: 23 bits a value
/// against its block's largest magnitude).
pub struct DotX {
    x: Vec<f32>,
    int: Option<IntX>,
}

impl DotX {
    /// Prepares `x` (a copy of it, and its fixed-point form where the integer kernels run).
    pub fn new(x: &[f32]) -> DotX {
        let int = if int_dot::available() { IntX::new(x) } else { None };
        DotX { x: x.to_vec(), int }
    }

    /// `x` prepared for rows of `dtypes` only: its fixed-point form only where one of them has an
    /// integer kernel (F32, F16 and BF16 rows never read it). The same results as [`DotX::new`]
    /// for those rows.
    pub fn for_dtypes(x: &[f32], dtypes: impl IntoIterator<Item = DType>) -> DotX {
        if dtypes.into_iter().any(int_dot::served) {
            DotX::new(x)
        } else {
            DotX::float(x)
        }
    }

    /// `x` for the float kernels only, whatever the CPU (as `KILN_CPU_NO_VNNI=1` gives every
    /// vector): what the CPUs without AVX-512 VNNI run.
    pub fn float(x: &[f32]) -> DotX {
        DotX { x: x.to_vec(), int: None }
    }

    /// The floats.
    pub fn values(&self) -> &[f32] {
        &self.x
    }

    /// Whether the rows of `dtype` go through the integer kernels for this vector alone
    /// ([`dot_rows_x`]; [`dot_rows_many`] takes them for Q8_0 too).
    pub fn uses_integer_kernel(&self, dtype: DType) -> bool {
        self.int.is_some() && int_dot::single_vector(dtype)
    }
}

/// The dot product of one row of `dtype` (its raw bytes) with `x`, block by block, without
/// writing the row out in floats. `x.len()` is the row's element count.
pub fn dot_row(dtype: DType, row_bytes: &[u8], x: &[f32]) -> Result<f32> {
    check_row("dot_row", dtype, row_bytes, x.len())?;
    let mut out = [0f32];
    dot_rows_x(dtype, row_bytes, &DotX::new(x), &mut out)?;
    Ok(out[0])
}

/// `out[r] = dot(row r of `rows_bytes`, x)` for consecutive rows of `dtype`, checked once for
/// the whole run of rows (the per-row checks of [`dot_row`] cost as much as a short row's dot).
pub fn dot_rows(dtype: DType, rows_bytes: &[u8], x: &[f32], out: &mut [f32]) -> Result<()> {
    dot_rows_x(dtype, rows_bytes, &DotX::new(x), out)
}

/// `out[t * rows + r] = dot(row r of `rows_bytes`, xs[t])` for several vectors of the same
/// length: the same bits as [`dot_rows_x`] for each vector, with the integer kernels unpacking
/// each row once for four vectors, and the AVX-512 float kernels (F32, F16, BF16) widening it
/// once for four.
pub fn dot_rows_many(dtype: DType, rows_bytes: &[u8], xs: &[DotX], out: &mut [f32]) -> Result<()> {
    let Some(first) = xs.first() else {
        return Ok(());
    };
    let cols = first.x.len();
    if xs.iter().any(|x| x.x.len() != cols) || !out.len().is_multiple_of(xs.len()) {
        return Err(Error::ShapeMismatch {
            op: "dot_rows_many",
            expected: vec![xs.len(), cols],
            got: vec![out.len()],
        });
    }
    let rows = out.len() / xs.len();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if float_dot::kind(dtype).is_some()
        && float_dot::available()
        && (rows as u64).checked_mul(dtype.bytes_for(cols as u64)?) == Some(rows_bytes.len() as u64)
    {
        // Four vectors a pass over the rows; the rest one at a time (the same bits).
        for (group, outs) in xs.chunks_exact(4).zip(out.chunks_exact_mut(4 * rows)) {
            let (o0, rest) = outs.split_at_mut(rows);
            let (o1, rest) = rest.split_at_mut(rows);
            let (o2, o3) = rest.split_at_mut(rows);
            let x = [0, 1, 2, 3].map(|t| &group[t].x[..]);
            // SAFETY: the CPU was checked at run time; every vector holds `cols` values and the
            // rows `rows` rows of `cols` values of `dtype` (checked above).
            unsafe { float_dot::rows_of::<4>(dtype, rows_bytes, x, [o0, o1, o2, o3]) };
            done += 4;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if int_dot::served(dtype)
        && (rows as u64).checked_mul(dtype.bytes_for(cols as u64)?) == Some(rows_bytes.len() as u64)
    {
        for (group, outs) in xs.chunks_exact(4).zip(out.chunks_exact_mut(4 * rows)) {
            let [Some(a), Some(b), Some(c), Some(d)] = [0, 1, 2, 3].map(|t| group[t].int.as_ref()) else {
                break;
            };
            let (o0, rest) = outs.split_at_mut(rows);
            let (o1, rest) = rest.split_at_mut(rows);
            let (o2, o3) = rest.split_at_mut(rows);
            // SAFETY: an IntX exists only where int_dot::available() held, and holds `cols / 32`
            // blocks; the rows hold `rows` rows of `cols` values of `dtype` (checked above).
            unsafe { int_dot::dot_rows4(dtype, rows_bytes, [a, b, c, d], [o0, o1, o2, o3]) };
            done += 4;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
        && has_avx2()
        && !(dtype == DType::Q4_1 && has_avx512())
        && (rows as u64).checked_mul(dtype.bytes_for(cols as u64)?) == Some(rows_bytes.len() as u64)
        && cols.is_multiple_of(32)
    {
        // The AVX2 float kernels (CPUs without AVX-512 VNNI): four vectors a row unpack, for the
        // groups whose every vector takes those kernels alone in dot_rows_x.
        let row_bytes = rows_bytes.len() / rows.max(1);
        for (group, outs) in xs[done..].chunks_exact(4).zip(out[done * rows..].chunks_exact_mut(4 * rows)) {
            if group.iter().any(|x| x.int.is_some() && int_dot::single_vector(dtype)) {
                break;
            }
            let x = [0, 1, 2, 3].map(|t| &group[t].x[..]);
            for (r, row) in rows_bytes.chunks_exact(row_bytes).enumerate() {
                // SAFETY: AVX2 and FMA were checked; the row holds `cols` values of `dtype`, a
                // whole number of its blocks (checked above).
                let sums = unsafe { avx2::dot_many::<4>(dtype, row, x) };
                for (t, sum) in sums.into_iter().enumerate() {
                    outs[t * rows + r] = sum;
                }
            }
            done += 4;
        }
    }
    for (x, o) in xs.iter().zip(out.chunks_exact_mut(rows)).skip(done) {
        dot_rows_x(dtype, rows_bytes, x, o)?;
    }
    Ok(())
}

/// [`dot_rows`] with x prepared once ([`DotX`]) for many calls.
pub fn dot_rows_x(dtype: DType, rows_bytes: &[u8], x: &DotX, out: &mut [f32]) -> Result<()> {
    check_row("dot_rows", dtype, &[], 0)?;
    let cols = x.x.len();
    let row_bytes = usize::try_from(dtype.bytes_for(cols as u64)?)
        .map_err(|_| Error::SizeOverflow { shape: vec![cols as u64], dtype: dtype.name() })?;
    if (row_bytes as u64).checked_mul(out.len() as u64) != Some(rows_bytes.len() as u64) {
        return Err(Error::ByteLength {
            what: format!("dot_rows: {} rows of {} {dtype}", out.len(), cols),
            expected: (row_bytes as u64).saturating_mul(out.len() as u64),
            got: rows_bytes.len() as u64,
        });
    }
    if row_bytes == 0 {
        out.fill(0.0);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if float_dot::kind(dtype).is_some() && float_dot::available() {
        // SAFETY: the CPU was checked at run time; the rows hold `out.len()` rows of `x.len()`
        // values of `dtype` (checked above).
        unsafe { float_dot::rows_of::<1>(dtype, rows_bytes, [&x.x], [out]) };
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if let (Some(int), true) = (&x.int, int_dot::single_vector(dtype)) {
        // SAFETY: `int` exists only where int_dot::available() held and holds `cols / 32`
        // blocks; the rows hold `out.len()` rows of `cols` values of `dtype` (checked above:
        // `bytes_for` took whole blocks of it).
        unsafe { int_dot::dot_rows(dtype, rows_bytes, int, out) };
        return Ok(());
    }
    let x = &x.x[..];
    for (o, row) in out.iter_mut().zip(rows_bytes.chunks_exact(row_bytes)) {
        *o = dot_row_dispatch(dtype, row, x);
    }
    Ok(())
}

/// `out[r] = dot(matrix row r, x)` for a row-major `rows × cols` matrix of `dtype`, the rows
/// split across the rayon pool in one contiguous chunk per thread.
pub fn matvec(
    dtype: DType,
    matrix_bytes: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) -> Result<()> {
    if x.len() != cols {
        return Err(Error::ShapeMismatch { op: "matvec (x)", expected: vec![cols], got: vec![x.len()] });
    }
    if out.len() != rows {
        return Err(Error::ShapeMismatch { op: "matvec (out)", expected: vec![rows], got: vec![out.len()] });
    }
    check_row("matvec", dtype, &[], 0)?;
    let row_bytes = usize::try_from(dtype.bytes_for(cols as u64)?)
        .map_err(|_| Error::SizeOverflow { shape: vec![rows as u64, cols as u64], dtype: dtype.name() })?;
    let expected = (row_bytes as u64).checked_mul(rows as u64);
    if expected != Some(matrix_bytes.len() as u64) {
        return Err(Error::ByteLength {
            what: format!("matvec: {rows} × {cols} matrix of {dtype}"),
            expected: expected.unwrap_or(u64::MAX),
            got: matrix_bytes.len() as u64,
        });
    }
    if rows == 0 {
        return Ok(());
    }
    let threads = rayon::current_num_threads().max(1);
    let rows_per_chunk = rows.div_ceil(threads);
    let x = DotX::new(x);
    out.par_chunks_mut(rows_per_chunk).enumerate().try_for_each(|(chunk, out)| {
        let first = chunk * rows_per_chunk * row_bytes;
        dot_rows_x(dtype, &matrix_bytes[first..first + out.len() * row_bytes], &x, out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_to_f32_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got:e} ({:#x}) vs {want:e} ({:#x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    }
}
