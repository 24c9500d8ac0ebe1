//! The integer dot products of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL
//! and IQ4_XS rows on CPUs with AVX-512 VNNI.
//!
//! x is written once per vector as 23-bit fixed point per block of 32 values ([`IntX`]): a block
//! whose largest magnitude is `amax` takes the smallest power of two `s` with `amax / s` at most
//! `Q_MAX = 8355711` (just under 2^23), and each value becomes the integer `q = round(x / s)`, so
//! `x` is at most `s / 2 <= amax * 2^-23` off (fp32 itself keeps 24 bits). `q` is stored as three signed bytes,
//! `q = 65536 p1 + 256 p2 + p3`, and each plane meets the weights' bytes in `vpdpbusd`, which adds
//! four exact byte products into a 32-bit lane: a row's products are exact integers per block,
//! scaled once per block by `d s` in fp32. Against the float kernels this is 16 values a vector
//! operation where they do 2 to 3 operations for 16 values, and the error stays at fp32's level:
//! `sum |w| * amax * 2^-23` per block beside fp32's rounding of the block sums.
//!
//! Q5_0 and Q5_1 are Q4_0 and Q4_1 with a fifth bit a quant (16 added to the nibble's byte, and
//! Q5_0's `-16` off each lane). Q4_K is Q4_1 per sub-block of 32 (`(d sc) q - dmin m`, the scales
//! unpacked once a super-block of 256), and Q5_K is Q5_1 per sub-block. Q3_K's quants go in as
//! `q + 4` (0..7, whose `4 x` comes off each lane) and Q6_K's as `q` (not `q - 32`, whose `32 x`
//! comes off each lane), each with `d sc` a lane of its sub-block of 16. Q2_K's quants go in as
//! they are (0..3), with `d sc` a lane of its sub-block of 16, and its `-dmin m` term takes each
//! lane's sum of the fixed-point x (`offset8 / 8`, exact integers): a sub-block of 16 is four
//! lanes of a pair, so `sum((d sc q - dmin m) x)` is `s (d sc P - dmin m Q)` lane by lane, P the
//! lane's products and Q its sum of x's integers. IQ4_NL's and IQ4_XS's 4-bit codes become their
//! grid's signed bytes by a byte shuffle and go in as Q8_0's do (`+128`, made unsigned), with
//! IQ4_XS's `d (ls - 32)` a lane of its sub-block of 32. Q4_1's `m` term takes
//! `m * sum(x)`, the block's sum of the exact x; Q4_0's `-8` and Q8_0's `+128` (its signed bytes
//! made unsigned for `vpdpbusd`) come off each lane as integers, so nothing cancels in floating
//! point.
//!
//! A row's result depends only on the row and x: the same bits whichever thread computes it and
//! however the rows are split.

/// Lanes of 4 bytes in a 64-byte vector.
const LANES: usize = 16;

/// Two blocks of 32 values (64 values) of x in the kernels' order: bytes 0-15 hold values 0-15 of
/// the first block, 16-31 values 0-15 of the second, 32-47 values 16-31 of the first and 48-63
/// values 16-31 of the second, the order in which a Q4 pair's nibbles unpack. Lane `l` (bytes
/// `4l..4l + 4`) belongs to the first block when `l / 4` is even.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct XPair {
    /// p1, p2, p3 of each value.
    planes: [[i8; 64]; 3],
    /// `s` of the lane's block.
    scale: [f32; LANES],
    /// `8 q` summed over the lane's four values (Q4_0's offset).
    offset8: [i32; LANES],
    /// `128 p1` and `128 (256 p2 + p3)` summed over the lane's four values (Q8_0's offset).
    offset128_hi: [i32; LANES],
    offset128_lo: [i32; LANES],
    /// `[0, sum of the first block's x, 0, sum of the second's]` (Q4_1's `m` term).
    sums: [f32; 4],
}

const ZERO_PAIR: XPair = XPair {
    planes: [[0; 64]; 3],
    scale: [0.0; LANES],
    offset8: [0; LANES],
    offset128_hi: [0; LANES],
    offset128_lo: [0; LANES],
    sums: [0.0; 4],
};

/// x in fixed point for the integer kernels: one [`XPair`] per two blocks (the last pair of an odd
/// block count has a zero second block).
pub(crate) struct IntX {
    pairs: Vec<XPair>,
    blocks: usize,
}

impl IntX {
    /// x in fixed point, or `None` when x cannot be written so: a length that is not a multiple
    /// of 32, or a value that is not finite (the float kernels then keep IEEE's Inf and NaN).
    pub(crate) fn new(x: &[f32]) -> Option<IntX> {
        if !x.len().is_multiple_of(32) || !x.iter().fold(true, |ok, v| ok & v.is_finite()) {
            return None;
        }
        let blocks = x.len() / 32;
        let mut pairs = vec![ZERO_PAIR; blocks.div_ceil(2)];
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let pair = &mut pairs[b / 2];
            #[cfg(target_arch = "x86_64")]
            if available() {
                // SAFETY: available() checked the CPU's features; xb holds 32 values.
                if unsafe { kernels::prepare_block(xb, b % 2, pair) } {
                    continue;
                }
            }
            prepare_block(xb, b % 2, pair);
        }
        #[cfg(target_arch = "x86_64")]
        if available() {
            for pair in &mut pairs {
                // SAFETY: as above.
                unsafe { kernels::finish_pair(pair) };
            }
            return Some(IntX { pairs, blocks });
        }
        for pair in &mut pairs {
            finish_pair(pair);
        }
        Some(IntX { pairs, blocks })
    }
}

/// The largest integer three balanced signed bytes hold: `127 (65536 + 256 + 1)`.
const Q_MAX: i32 = 8_355_711;

/// The power of two `s` of a block whose largest magnitude is `amax > 0`: the smallest with
/// `amax / s <= Q_MAX`, so `amax / s` is in `(Q_MAX / 2, Q_MAX]` (23 bits: `s <= amax 2^-22`),
/// as `(s in f32, 1 / s in f64)`. `s` is exact down to 2^-149 and zero below (such a block adds
/// under 2^-120 to a product).
fn block_scale(amax: f32) -> (f32, f64) {
    // amax = f 2^e2 with f in [1, 2) (f64 holds f32's subnormals as normals).
    let e2 = ((f64::from(amax).to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let e = if f64::from(amax) * 2f64.powi(22 - e2) <= f64::from(Q_MAX) { e2 - 22 } else { e2 - 21 };
    (2f64.powi(e) as f32, 2f64.powi(-e))
}

/// The sum of a block's 32 values in a fixed tree: `v[i] = x[i] + x[i + 16]`, then the 16 lanes
/// in `quant::lane_sum`'s halving tree (`v[i] += v[i + 8]`, 4, 2, 1), as the SIMD preparation
/// adds them.
fn block_sum(xb: &[f32]) -> f32 {
    let mut v = [0f32; 16];
    for (i, o) in v.iter_mut().enumerate() {
        *o = xb[i] + xb[i + 16];
    }
    super::quant::lane_sum(&v)
}

/// One block of x into `pair` (`second`: whether it is the pair's second block): the planes,
/// the scale lanes and the block's sum; [`finish_pair`] then sums the lanes' offsets.
fn prepare_block(xb: &[f32], second: usize, pair: &mut XPair) {
    pair.sums[2 * second + 1] = block_sum(xb);
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return;
    }
    let (s, inverse) = block_scale(amax);
    for lane in 0..LANES {
        if (lane / 4) % 2 == second {
            pair.scale[lane] = s;
        }
    }
    for (j, &v) in xb.iter().enumerate() {
        // |q| <= Q_MAX: the product is exact in f64 and rounds once.
        let q = (f64::from(v) * inverse).round_ties_even() as i32;
        let p3 = ((q + 128) & 255) - 128;
        let r = (q - p3) >> 8;
        let p2 = ((r + 128) & 255) - 128;
        let p1 = (r - p2) >> 8;
        let k = ((j / 16) * 2 + second) * 16 + j % 16;
        pair.planes[0][k] = p1 as i8;
        pair.planes[1][k] = p2 as i8;
        pair.planes[2][k] = p3 as i8;
    }
}

/// The lanes' offsets of a pair from its planes: each lane's four values summed.
fn finish_pair(pair: &mut XPair) {
    for lane in 0..LANES {
        let sum = |plane: usize| -> i32 {
            pair.planes[plane][4 * lane..4 * lane + 4].iter().map(|&p| i32::from(p)).sum()
        };
        let (s1, s2, s3) = (sum(0), sum(1), sum(2));
        pair.offset8[lane] = 8 * (65536 * s1 + 256 * s2 + s3);
        pair.offset128_hi[lane] = 128 * s1;
        pair.offset128_lo[lane] = 128 * (256 * s2 + s3);
    }
}

/// Whether the running CPU has AVX-512F/BW/VNNI and F16C, and `KILN_CPU_NO_VNNI` (or
/// `KILN_CPU_NO_AVX512`) is unset (checked once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
            && std::env::var_os("KILN_CPU_NO_VNNI").is_none()
            && std::env::var_os("KILN_CPU_NO_AVX512").is_none()
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn available() -> bool {
    false
}

/// The formats with an integer kernel: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (blocks of 32) and
/// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (super-blocks of 256).
pub(crate) fn served(dtype: kiln_core::DType) -> bool {
    use kiln_core::DType;
    matches!(
        dtype,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::IQ4_NL
            | DType::IQ4_XS
    )
}

/// Whether a single vector's rows of `dtype` take the integer kernel (all but Q8_0): Q8_0's read
/// SmolLM2's 49152 x 576 output layer from memory at half the float kernel's speed, so one
/// vector's Q8_0 rows keep the float kernel and only [`dot_rows4`] takes them.
pub(crate) fn single_vector(dtype: kiln_core::DType) -> bool {
    use kiln_core::DType;
    served(dtype) && dtype != DType::Q8_0
}

/// `out[r]` = the dot product of row `r` of `rows` (consecutive rows of `dtype`, each `x.blocks()`
/// blocks) with x.
///
/// # Safety
/// [`available`] is true; `dtype` is [`served`]; `rows` holds exactly `out.len()` rows of
/// `32 * x.blocks()` values of `dtype` (a whole number of its blocks).
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn dot_rows(dtype: kiln_core::DType, rows: &[u8], x: &IntX, out: &mut [f32]) {
    use kiln_core::DType;
    match dtype {
        DType::Q4_1 => kernels::rows::<20, { kernels::Q4_1 }>(rows, x, out),
        DType::Q4_0 => kernels::rows::<18, { kernels::Q4_0 }>(rows, x, out),
        DType::Q8_0 => kernels::rows::<34, { kernels::Q8_0 }>(rows, x, out),
        DType::Q5_1 => kernels::rows::<24, { kernels::Q5_1 }>(rows, x, out),
        DType::Q5_0 => kernels::rows::<22, { kernels::Q5_0 }>(rows, x, out),
        DType::Q4_K => kernels::rows_k::<{ kernels::Q4_K }, { kernels::Q4_K_BYTES }, 1>(rows, [x], [out]),
        DType::Q5_K => kernels::rows_k::<{ kernels::Q5_K }, { kernels::Q5_K_BYTES }, 1>(rows, [x], [out]),
        DType::Q6_K => kernels::rows_k::<{ kernels::Q6_K }, { kernels::Q6_K_BYTES }, 1>(rows, [x], [out]),
        DType::Q3_K => kernels::rows_k::<{ kernels::Q3_K }, { kernels::Q3_K_BYTES }, 1>(rows, [x], [out]),
        DType::Q2_K => kernels::rows_k::<{ kernels::Q2_K }, { kernels::Q2_K_BYTES }, 1>(rows, [x], [out]),
        DType::IQ4_NL => kernels::rows::<18, { kernels::IQ4_NL }>(rows, x, out),
        DType::IQ4_XS => {
            kernels::rows_k::<{ kernels::IQ4_XS }, { kernels::IQ4_XS_BYTES }, 1>(rows, [x], [out])
        }
        _ => out.fill(f32::NAN),
    }
}

/// [`dot_rows`] for four vectors at once (`xs`, each of the same block count): `out[t][r]` is
/// `dot(row r, xs[t])`, the same bits as [`dot_rows`] gives for each vector alone. A row's
/// blocks are unpacked once for the four.
///
/// # Safety
/// As [`dot_rows`], for each of `xs`; every `out[t].len()` is the row count.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn dot_rows4(dtype: kiln_core::DType, rows: &[u8], xs: [&IntX; 4], out: [&mut [f32]; 4]) {
    use kiln_core::DType;
    match dtype {
        DType::Q4_1 => kernels::rows4::<20, { kernels::Q4_1 }>(rows, xs, out),
        DType::Q4_0 => kernels::rows4::<18, { kernels::Q4_0 }>(rows, xs, out),
        DType::Q8_0 => kernels::rows4::<34, { kernels::Q8_0 }>(rows, xs, out),
        DType::Q5_1 => kernels::rows4::<24, { kernels::Q5_1 }>(rows, xs, out),
        DType::Q5_0 => kernels::rows4::<22, { kernels::Q5_0 }>(rows, xs, out),
        DType::Q4_K => kernels::rows_k::<{ kernels::Q4_K }, { kernels::Q4_K_BYTES }, 4>(rows, xs, out),
        DType::Q5_K => kernels::rows_k::<{ kernels::Q5_K }, { kernels::Q5_K_BYTES }, 4>(rows, xs, out),
        DType::Q6_K => kernels::rows_k::<{ kernels::Q6_K }, { kernels::Q6_K_BYTES }, 4>(rows, xs, out),
        DType::Q3_K => kernels::rows_k::<{ kernels::Q3_K }, { kernels::Q3_K_BYTES }, 4>(rows, xs, out),
        DType::Q2_K => kernels::rows_k::<{ kernels::Q2_K }, { kernels::Q2_K_BYTES }, 4>(rows, xs, out),
        DType::IQ4_NL => kernels::rows4::<18, { kernels::IQ4_NL }>(rows, xs, out),
        DType::IQ4_XS => kernels::rows_k::<{ kernels::IQ4_XS }, { kernels::IQ4_XS_BYTES }, 4>(rows, xs, out),
        _ => out.into_iter().for_each(|o| o.fill(f32::NAN)),
    }
}

#[cfg(target_arch = "x86_64")]
mod kernels {
    use std::arch::x86_64::*;

    use super::{IntX, XPair};

    pub(super) const Q4_0: u8 = 0;
    pub(super) const Q4_1: u8 = 1;
    pub(super) const Q8_0: u8 = 2;
    pub(super) const Q6_K: u8 = 3;
    pub(super) const Q4_K: u8 = 4;
    pub(super) const Q5_0: u8 = 5;
    pub(super) const Q5_1: u8 = 6;
    pub(super) const Q5_K: u8 = 7;
    pub(super) const Q3_K: u8 = 8;
    pub(super) const Q2_K: u8 = 9;
    pub(super) const IQ4_NL: u8 = 10;
    pub(super) const IQ4_XS: u8 = 11;

    /// A block of zero bytes: the partner of an odd row's last block (scale 0, quants 0; its x
    /// values are zero).
    static ZERO_BLOCK: [u8; 34] = [0; 34];

    /// One block of 32 values of x into `pair`, as `super::prepare_block` does it (the same
    /// bytes), for a block whose largest magnitude is 0 or at least 2^-100; false, with `pair`
    /// untouched, for the others.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn prepare_block(xb: &[f32], second: usize, pair: &mut XPair) -> bool {
        let x0 = _mm512_loadu_ps(xb.as_ptr());
        let x1 = _mm512_loadu_ps(xb.as_ptr().add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        let e2 = ((amax.to_bits() >> 23) & 0xff) as i32 - 127;
        if amax != 0.0 && e2 < -100 {
            return false;
        }
        // The sum in super::block_sum's tree.
        let v = _mm512_add_ps(x0, x1);
        let v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        pair.sums[2 * second + 1] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
        if amax == 0.0 {
            return true;
        }
        // s = 2^(e2 - 22) where amax / s <= Q_MAX (amax's fraction at most 1 + 8322814 / 2^23),
        // else 2^(e2 - 21): s and 1 / s are normal f32 for e2 in [-100, 127].
        let e = if amax.to_bits() & 0x7f_ffff <= 8_322_814 { e2 - 22 } else { e2 - 21 };
        let s = f32::from_bits(((e + 127) as u32) << 23);
        let inverse = _mm512_set1_ps(f32::from_bits(((127 - e) as u32) << 23));
        let lanes: __mmask16 = if second == 0 { 0x0F0F } else { 0xF0F0 };
        let scale = _mm512_mask_blend_ps(lanes, _mm512_load_ps(pair.scale.as_ptr()), _mm512_set1_ps(s));
        _mm512_store_ps(pair.scale.as_mut_ptr(), scale);
        let c128 = _mm512_set1_epi32(128);
        let c255 = _mm512_set1_epi32(255);
        for (half, v) in [x0, x1].into_iter().enumerate() {
            // Exact scaling by a power of two, one rounding to the nearest even integer.
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
            let p3 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, c128), c255), c128);
            let r = _mm512_srai_epi32::<8>(_mm512_sub_epi32(q, p3));
            let p2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
            let p1 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r, p2));
            let at = (half * 2 + second) * 16;
            for (plane, p) in [p1, p2, p3].into_iter().enumerate() {
                _mm_storeu_si128(pair.planes[plane].as_mut_ptr().add(at).cast(), _mm512_cvtepi32_epi8(p));
            }
        }
        true
    }

    /// The lanes' offsets of a pair from its planes, as `super::finish_pair` sums them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn finish_pair(pair: &mut XPair) {
        let p = pair.planes.as_ptr().cast::<__m512i>();
        let ones = _mm512_set1_epi8(1);
        let zero = _mm512_setzero_si512();
        let s1 = _mm512_dpbusd_epi32(zero, ones, _mm512_load_si512(p));
        let s2 = _mm512_dpbusd_epi32(zero, ones, _mm512_load_si512(p.add(1)));
        let s3 = _mm512_dpbusd_epi32(zero, ones, _mm512_load_si512(p.add(2)));
        let lo = _mm512_add_epi32(_mm512_slli_epi32::<8>(s2), s3);
        let all = _mm512_add_epi32(_mm512_slli_epi32::<16>(s1), lo);
        _mm512_store_si512(pair.offset8.as_mut_ptr().cast(), _mm512_slli_epi32::<3>(all));
        _mm512_store_si512(pair.offset128_hi.as_mut_ptr().cast(), _mm512_slli_epi32::<7>(s1));
        _mm512_store_si512(pair.offset128_lo.as_mut_ptr().cast(), _mm512_slli_epi32::<7>(lo));
    }

    /// The pair's three planes against 64 unsigned weight bytes: each lane's sum of
    /// `w * q` (q = 65536 p1 + 256 p2 + p3), exact when it fits in 32 bits (Q4: at most
    /// 4 * 15 * Q_MAX < 2^29).
    #[inline(always)]
    unsafe fn planes_q4(w: __m512i, x: &XPair) -> __m512i {
        let p = x.planes.as_ptr().cast::<__m512i>();
        let t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(p));
        let t = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(t), w, _mm512_load_si512(p.add(1)));
        _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(t), w, _mm512_load_si512(p.add(2)))
    }

    /// The 64 nibbles of two Q4 blocks' 16 quant bytes each (at `a` and `b`) in the pair's order:
    /// low nibbles of a, of b, then high nibbles of a, of b.
    #[inline(always)]
    unsafe fn nibbles(a: *const u8, b: *const u8) -> __m512i {
        let ab = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a.cast())),
            _mm_loadu_si128(b.cast()),
        );
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ab), _mm256_srli_epi16::<4>(ab));
        _mm512_and_si512(both, _mm512_set1_epi8(0x0F))
    }

    /// The fifth bits of two Q5 blocks' quants (each block's 32-bit `qh` at `a` and `b`, bit `i`
    /// that of value `i`) as 16 on the pair's bytes: a's values 0-15, b's 0-15, a's 16-31, b's 16-31.
    #[inline(always)]
    unsafe fn fifth_bits(a: *const u8, b: *const u8) -> __m512i {
        let qa = u64::from(a.cast::<u32>().read_unaligned().to_le());
        let qb = u64::from(b.cast::<u32>().read_unaligned().to_le());
        let mask = (qa & 0xFFFF) | (qb & 0xFFFF) << 16 | (qa >> 16) << 32 | (qb >> 16) << 48;
        _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(0x10))
    }

    /// 64 four-bit IQ4 codes (one a byte) as their grid's values plus 128 (unsigned bytes 1..241).
    #[inline(always)]
    unsafe fn iq4_grid(codes: __m512i) -> __m512i {
        let v = crate::formats::quant::IQ4_VALUES.map(|c| (i16::from(c) + 128) as u8 as i8);
        let table = _mm512_broadcast_i32x4(_mm_setr_epi8(
            v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14],
            v[15],
        ));
        _mm512_shuffle_epi8(table, codes)
    }

    /// 64 bytes whose 128-bit lanes are `a`, `b`, `a`, `b`: one value for the pair's bytes of
    /// block a (0-15 and 32-47), another for block b's.
    #[inline(always)]
    unsafe fn alternate(a: __m128i, b: __m128i) -> __m512i {
        let ab = _mm256_setr_m128i(a, b);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ab), ab)
    }

    /// The 32 bytes at `p` as `0-15 | 0-15 | 16-31 | 16-31`: byte `l` under the pair's bytes of
    /// value `l` of both blocks (a super-block's bytes shared by two groups of 32).
    #[inline(always)]
    unsafe fn shared_bytes(p: *const u8) -> __m512i {
        let v = _mm512_castsi256_si512(_mm256_loadu_si256(p.cast()));
        _mm512_shuffle_i64x2::<0b01_01_00_00>(v, v)
    }

    /// `value` on each of the pair's bytes whose bit is set in the 32 bytes at `bits`
    /// ([`shared_bytes`]), bit `bit_a` for block a's bytes and `bit_b` for block b's; 0 elsewhere.
    #[inline(always)]
    unsafe fn bit_bytes(bits: *const u8, bit_a: u32, bit_b: u32, value: i8) -> __m512i {
        let v = shared_bytes(bits);
        let select = alternate(_mm_set1_epi8((1u8 << bit_a) as i8), _mm_set1_epi8((1u8 << bit_b) as i8));
        _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, select), _mm512_set1_epi8(value))
    }

    /// Four floats spread over 16 lanes, four lanes each: `[v0 x4, v1 x4, v2 x4, v3 x4]` (each
    /// lane's `d` when a pair's four sub-blocks of 16 have their own scales).
    #[inline(always)]
    unsafe fn four_lanes_each(v: __m128) -> __m512 {
        let index = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v))
    }

    /// The f16 values at `a` and `b` (their 16-bit words, and with `pairs` the word after each
    /// too), as f32 lanes `[a, b]` or `[a, a', b, b']`.
    #[inline(always)]
    unsafe fn halves<const PAIRS: bool>(a: *const u8, b: *const u8) -> __m128 {
        if PAIRS {
            let wa = a.cast::<i32>().read_unaligned();
            let wb = b.cast::<i32>().read_unaligned();
            _mm_cvtph_ps(_mm_set_epi32(0, 0, wb, wa))
        } else {
            let wa = a.cast::<i16>().read_unaligned();
            let wb = b.cast::<i16>().read_unaligned();
            _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, 0, 0, wb, wa))
        }
    }

    /// Lane `l` of 16 takes element 0 of `v` when `l / 4` is even, element `second` when odd.
    #[inline(always)]
    unsafe fn per_lane(v: __m128, second: i32) -> __m512 {
        let s = second;
        let index = _mm512_setr_epi32(0, 0, 0, 0, s, s, s, s, 0, 0, 0, 0, s, s, s, s);
        _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v))
    }

    /// A pair of blocks (at `a` and `b`) of one row of format `KIND`, unpacked: the 64 weight
    /// bytes in the pair's order (unsigned), and the blocks' f16 scales as f32 (`[d_a, m_a, d_b,
    /// m_b]` for Q4_1, `[d_a, d_b]` for the others).
    ///
    /// Q4_1: `d q + m` per value, `d` at byte 0, `m` at 2, quants at 4. Q4_0: `d (q - 8)`, `d`
    /// at 0, quants at 2. Q5_1: Q4_1's with the fifth bits (`qh`) at 4 and the nibbles at 8.
    /// Q5_0: `d (q - 16)`, `d` at 0, `qh` at 2, nibbles at 6. IQ4_NL: `d v` for v the grid's
    /// value of each nibble (nibbles at 2), in as `v + 128` as Q8_0's. Q8_0: `d q` for signed bytes q,
    /// `d` at 0, quants at 2: the bytes go in as `q + 128` (unsigned) and each lane's `128 x`
    /// sums come off again.
    #[inline(always)]
    unsafe fn weights<const KIND: u8>(a: *const u8, b: *const u8) -> (__m512i, __m128) {
        match KIND {
            Q4_1 => (nibbles(a.add(4), b.add(4)), halves::<true>(a, b)),
            Q4_0 => (nibbles(a.add(2), b.add(2)), halves::<false>(a, b)),
            Q5_1 => (
                _mm512_or_si512(nibbles(a.add(8), b.add(8)), fifth_bits(a.add(4), b.add(4))),
                halves::<true>(a, b),
            ),
            Q5_0 => (
                _mm512_or_si512(nibbles(a.add(6), b.add(6)), fifth_bits(a.add(2), b.add(2))),
                halves::<false>(a, b),
            ),
            IQ4_NL => (iq4_grid(nibbles(a.add(2), b.add(2))), halves::<false>(a, b)),
            _ => {
                let ab = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(a.add(2).cast())),
                    _mm256_loadu_si256(b.add(2).cast()),
                );
                // 128-bit lanes (a 0-15, a 16-31, b 0-15, b 16-31) to the pair's order (0, 2, 1, 3).
                let w =
                    _mm512_xor_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(ab, ab), _mm512_set1_epi8(-128));
                (w, halves::<false>(a, b))
            }
        }
    }

    /// The per-lane `d` of an unpacked pair's scales.
    #[inline(always)]
    unsafe fn lane_scales<const KIND: u8>(scales: __m128) -> __m512 {
        per_lane(scales, if has_min(KIND) { 2 } else { 1 })
    }

    /// Whether format `KIND`'s values are `d q + m` (Q4_1, Q5_1; Q4_K, Q5_K per sub-block): its
    /// `m` term is `m * sum(x)`, added into the side sums.
    const fn has_min(kind: u8) -> bool {
        matches!(kind, Q4_1 | Q4_K | Q5_1 | Q5_K)
    }

    /// An unpacked pair against x's pair: adds the products, scaled to floats, into `acc`, and
    /// the `m` term of the formats with one into `side`. Q8_0 keeps `p1`'s products apart from
    /// the others' so that no lane passes 32 bits.
    #[inline(always)]
    unsafe fn apply<const KIND: u8>(
        w: __m512i,
        scales: __m128,
        d: __m512,
        x: &XPair,
        acc: &mut __m512,
        side: &mut __m128,
    ) {
        let scale = _mm512_load_ps(x.scale.as_ptr());
        let sums = match KIND {
            // Q4_K's (Q5_K's) sub-blocks are Q4_1 (Q5_1) blocks (`d sc`, `-dmin m`); five-bit
            // quants: at most 4 * 31 * Q_MAX < 2^30 a lane. Q2_K's quants as they are.
            Q4_1 | Q4_K | Q5_1 | Q5_K | Q2_K => _mm512_cvtepi32_ps(planes_q4(w, x)),
            Q4_0 => _mm512_cvtepi32_ps(_mm512_sub_epi32(
                planes_q4(w, x),
                _mm512_load_si512(x.offset8.as_ptr().cast()),
            )),
            // q - 16: 16 x = 2 (8 x).
            Q5_0 => _mm512_cvtepi32_ps(_mm512_sub_epi32(
                planes_q4(w, x),
                _mm512_slli_epi32::<1>(_mm512_load_si512(x.offset8.as_ptr().cast())),
            )),
            // Q3_K's 3-bit quants q - 4: 4 x = (8 x) / 2 (8 x a multiple of 8).
            Q3_K => _mm512_cvtepi32_ps(_mm512_sub_epi32(
                planes_q4(w, x),
                _mm512_srai_epi32::<1>(_mm512_load_si512(x.offset8.as_ptr().cast())),
            )),
            // 6-bit quants q - 32: 32 x = 4 (8 x), at most 4 * 63 * Q_MAX < 2^31 before it.
            Q6_K => _mm512_cvtepi32_ps(_mm512_sub_epi32(
                planes_q4(w, x),
                _mm512_slli_epi32::<2>(_mm512_load_si512(x.offset8.as_ptr().cast())),
            )),
            // Q8_0's bytes and the IQ4 grids' values, both `v + 128`: at most 4 * 255 * 127 a lane
            // for p1, and the lower planes apart.
            _ => {
                let p = x.planes.as_ptr().cast::<__m512i>();
                let hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(p));
                let hi = _mm512_sub_epi32(hi, _mm512_load_si512(x.offset128_hi.as_ptr().cast()));
                let lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(p.add(1)));
                let lo = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(lo), w, _mm512_load_si512(p.add(2)));
                let lo = _mm512_sub_epi32(lo, _mm512_load_si512(x.offset128_lo.as_ptr().cast()));
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0), _mm512_cvtepi32_ps(lo))
            }
        };
        *acc = _mm512_fmadd_ps(_mm512_mul_ps(sums, scale), d, *acc);
        if KIND == Q2_K {
            // `-dmin m` of each lane's sub-block (`scales`: `-dmin m / 8` of the pair's four
            // sub-blocks in lane order) times the lane's x: `8 Q` as integers, exact in 32 bits.
            let q8 = _mm512_cvtepi32_ps(_mm512_load_si512(x.offset8.as_ptr().cast()));
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(q8, scale), four_lanes_each(scales), *acc);
        }
        if has_min(KIND) {
            *side = _mm_fmadd_ps(scales, _mm_loadu_ps(x.sums.as_ptr()), *side);
        }
    }

    /// One pair of blocks (at `a` and `b`) of one row of format `KIND` against x's pair.
    #[inline(always)]
    unsafe fn pair<const KIND: u8>(
        a: *const u8,
        b: *const u8,
        x: &XPair,
        acc: &mut __m512,
        side: &mut __m128,
    ) {
        let (w, scales) = weights::<KIND>(a, b);
        apply::<KIND>(w, scales, lane_scales::<KIND>(scales), x, acc, side);
    }

    /// Bytes of a Q4_K super-block: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of
    /// quants (32 bytes per two sub-blocks: low nibbles the first, high nibbles the second).
    pub(super) const Q4_K_BYTES: usize = 144;

    /// The f16 value at byte `offset` of `p`, as f32.
    #[inline(always)]
    unsafe fn f16_at(p: *const u8, offset: usize) -> f32 {
        crate::formats::quant::f16_to_f32(p.add(offset).cast::<u16>().read_unaligned().to_le())
    }

    /// The two-bit quants of pair `j` of a Q2_K or Q3_K super-block's groups of 32 (`2j`, `2j +
    /// 1`: half `j / 2` of the 64 bytes at `qs`, at bit shifts `2 s` and `2 s + 2`, `s = 2 (j %
    /// 2)`) in the pair's order: bytes 0-15 and 16-31 of the half under both groups' values
    /// ([`shared_bytes`]), group 2j's at shift 2s, 2j + 1's at 2s + 2.
    #[inline(always)]
    unsafe fn two_bit_quants(qs: *const u8, j: usize) -> __m512i {
        let (h, s) = (j / 2, 2 * (j % 2));
        let q = shared_bytes(qs.add(32 * h));
        let counts = alternate(_mm_set1_epi16(2 * s as i16), _mm_set1_epi16(2 * s as i16 + 2));
        _mm512_and_si512(_mm512_srlv_epi16(q, counts), _mm512_set1_epi8(3))
    }

    /// A Q4_K super-block's `(d, dmin)`.
    #[inline(always)]
    unsafe fn q4_k_scales(sb: *const u8) -> (f32, f32) {
        let d = f16_at(sb, 0);
        let dmin = f16_at(sb, 2);
        (d, dmin)
    }

    /// Pair `j` of a Q4_K super-block's sub-blocks (`2j`, `2j + 1`), unpacked: the 64 nibbles in
    /// the pair's order, and `[d sc_a, -dmin m_a, d sc_b, -dmin m_b]` (a value is
    /// `(d sc) q - dmin m`: Q4_1's `d q + m`, with the reference's roundings of the two products).
    /// The nibbles start at byte `quants` of the super-block (Q4_K's 16, Q5_K's 48).
    #[inline(always)]
    unsafe fn q4_k_pair(sb: *const u8, quants: usize, j: usize, d: f32, dmin: f32) -> (__m512i, __m128) {
        let scales = std::slice::from_raw_parts(sb.add(4), 12);
        let (sc1, m1) = crate::formats::quant::scale_min_k4(2 * j, scales);
        let (sc2, m2) = crate::formats::quant::scale_min_k4(2 * j + 1, scales);
        let values = _mm_setr_ps(
            d * f32::from(sc1),
            -(dmin * f32::from(m1)),
            d * f32::from(sc2),
            -(dmin * f32::from(m2)),
        );
        let y = _mm256_loadu_si256(sb.add(quants + 32 * j).cast());
        // (bytes 0-15, 16-31, their high nibbles 0-15, 16-31) to (0, 2, 1, 3): low nibbles of
        // bytes 0-15 (sub-block a, values 0-15), high (b 0-15), then a 16-31, b 16-31.
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), _mm256_srli_epi16::<4>(y));
        let w = _mm512_and_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(both, both), _mm512_set1_epi8(0x0F));
        (w, values)
    }

    /// Bytes of a Q5_K super-block: Q4_K's d, dmin and scales, then qh[32] (the fifth bits: bit
    /// `k` of byte `l` for value `l` of sub-block `k`), then Q4_K's 128 bytes of nibbles.
    pub(super) const Q5_K_BYTES: usize = 176;

    /// Pair `j` of a Q5_K super-block's sub-blocks, as [`q4_k_pair`] gives Q4_K's, the fifth bits
    /// (16 each) added to the nibbles.
    #[inline(always)]
    unsafe fn q5_k_pair(sb: *const u8, j: usize, d: f32, dmin: f32) -> (__m512i, __m128) {
        let (nibbles, values) = q4_k_pair(sb, 48, j, d, dmin);
        let j = j as u32;
        (_mm512_or_si512(nibbles, bit_bytes(sb.add(16), 2 * j, 2 * j + 1, 0x10)), values)
    }

    /// Bytes of a Q6_K super-block: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 signed scales
    /// (one a sub-block of 16), d (f16).
    pub(super) const Q6_K_BYTES: usize = 210;

    /// Half `h` of a Q6_K super-block (values `128h..128h + 128`) as its two pairs of blocks: the
    /// 64 six-bit quants of each in the pair's order, and each lane's `d sc` (its sub-block of
    /// 16). Pair 0 holds values 0-63 of the half (ql bytes 0-63 low nibbles, qh bits 0-1 and
    /// 2-3), pair 1 values 64-127 (high nibbles, qh bits 4-5 and 6-7).
    #[inline(always)]
    unsafe fn q6_k_half(sb: *const u8, h: usize, d: f32) -> (__m512i, __m512, __m512i, __m512) {
        // ql 0-15 | 16-31 | 32-47 | 48-63 to (0, 2, 1, 3): the pair's order of values 0-15 of
        // block a (ql 0-15), of b (ql 32-47), then a 16-31, b 16-31.
        let ql = _mm512_loadu_si512(sb.add(64 * h).cast());
        let ql = _mm512_shuffle_i64x2::<0b11_01_10_00>(ql, ql);
        // qh 0-15 | 16-31 | (qh >> 2) 0-15 | 16-31 to (0, 2, 1, 3): a's bits 0-1, b's bits 2-3.
        let qh = _mm256_loadu_si256(sb.add(128 + 32 * h).cast());
        let qh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
        let qh = _mm512_shuffle_i64x2::<0b11_01_10_00>(qh, qh);
        let (low4, low2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x03));
        let w0 =
            _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16::<4>(_mm512_and_si512(qh, low2)));
        let w1 = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4),
            _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<4>(qh), low2)),
        );
        let sc = sb.add(192 + 8 * h).cast::<i8>();
        let s = |k: usize| d * f32::from(sc.add(k).read());
        // Lanes: a 0-15 (sub-block 0 of the pair), b 0-15 (2), a 16-31 (1), b 16-31 (3).
        let d0 = four_lanes_each(_mm_setr_ps(s(0), s(2), s(1), s(3)));
        let d1 = four_lanes_each(_mm_setr_ps(s(4), s(6), s(5), s(7)));
        (w0, d0, w1, d1)
    }

    /// Pair `j` of a Q4_K or Q5_K super-block (a function, not a closure: a closure does not take
    /// its caller's target features, and its intrinsics would not be inlined).
    #[inline(always)]
    unsafe fn k_pair<const KIND: u8>(sb: *const u8, j: usize, d: f32, dmin: f32) -> (__m512i, __m128) {
        if KIND == Q4_K {
            q4_k_pair(sb, 16, j, d, dmin)
        } else {
            q5_k_pair(sb, j, d, dmin)
        }
    }

    /// Bytes of a Q3_K super-block: hmask[32] (the third bits: bit `k` of byte `l` for value `l`
    /// of the 32-value group `k`), qs[64] (the low two bits, four groups a byte), 12 bytes of
    /// 6-bit scales (one a sub-block of 16, offset by 32), d (f16).
    pub(super) const Q3_K_BYTES: usize = 110;

    /// Pair `j` of a Q3_K super-block's groups of 32 (`2j`, `2j + 1`), unpacked: the 64 quants in
    /// the pair's order as `q + 4` (0..7: the two low bits, [`two_bit_quants`], and 4 where the
    /// third bit is set), and each lane's `d (sc - 32)` (its sub-block of 16).
    #[inline(always)]
    unsafe fn q3_k_pair(sb: *const u8, j: usize, d: f32, scales: &[i8; 16]) -> (__m512i, __m512) {
        let low = two_bit_quants(sb.add(32), j);
        // Group g's third bits are bit g of the hmask bytes.
        let third_bit = 2 * j as u32;
        let third = bit_bytes(sb, third_bit, third_bit + 1, 4);
        // Sub-blocks of 16: group g's are 2g and 2g + 1 (values 0-15, 16-31 of the group).
        let (ga, gb) = (2 * j, 2 * j + 1);
        let dl = |k: usize| d * f32::from(i16::from(scales[k]) - 32);
        let lanes = four_lanes_each(_mm_setr_ps(dl(2 * ga), dl(2 * gb), dl(2 * ga + 1), dl(2 * gb + 1)));
        (_mm512_or_si512(low, third), lanes)
    }

    /// Bytes of a Q2_K super-block: 16 scales (a sub-block of 16: `sc` the low nibble, `m` the
    /// high), qs[64] (two bits a quant, four groups of 32 a byte as in Q3_K), d, dmin (f16).
    pub(super) const Q2_K_BYTES: usize = 84;

    /// Pair `j` of a Q2_K super-block's groups of 32 (`2j`, `2j + 1`, laid out as Q3_K's low
    /// bits), unpacked: the 64 quants (0..3) in the pair's order, `-dmin m / 8` of the pair's
    /// four sub-blocks of 16 in lane order (a 0-15, b 0-15, a 16-31, b 16-31) and each lane's
    /// `d sc`. `d sc` and `dmin m` are exact in f32 (11 by 4 bits), as the reference's.
    #[inline(always)]
    unsafe fn q2_k_pair(sb: *const u8, j: usize, d: f32, dmin: f32) -> (__m512i, __m128, __m512) {
        let w = two_bit_quants(sb.add(16), j);
        // Sub-blocks 4j, 4j + 2 (values 0-15 of groups 2j, 2j + 1), then 4j + 1, 4j + 3.
        let order = [4 * j, 4 * j + 2, 4 * j + 1, 4 * j + 3];
        let sc = |k: usize| sb.add(order[k]).read();
        let dl = |k: usize| d * f32::from(sc(k) & 0x0F);
        let ml = |k: usize| dmin * f32::from(sc(k) >> 4) * -0.125;
        let mins = _mm_setr_ps(ml(0), ml(1), ml(2), ml(3));
        (w, mins, four_lanes_each(_mm_setr_ps(dl(0), dl(1), dl(2), dl(3))))
    }

    /// Bytes of an IQ4_XS super-block: d (f16), scales_h (u16: two high bits a sub-block of 32),
    /// scales_l[4] (four low bits a sub-block), qs[128] (IQ4_NL's nibbles, 16 bytes a sub-block).
    pub(super) const IQ4_XS_BYTES: usize = 136;

    /// Pair `j` of an IQ4_XS super-block's sub-blocks (`2j`, `2j + 1`), unpacked as an IQ4_NL
    /// pair: the 64 grid values plus 128 in the pair's order, and each lane's `d (ls - 32)`
    /// (exact in f32: 11 by 6 bits, as the reference's).
    #[inline(always)]
    unsafe fn iq4_xs_pair(sb: *const u8, j: usize, d: f32) -> (__m512i, __m128, __m512) {
        let block = std::slice::from_raw_parts(sb, IQ4_XS_BYTES);
        let dl = |ib: usize| d * (crate::formats::quant::iq4_xs_scale(block, ib) - 32) as f32;
        let w = iq4_grid(nibbles(sb.add(8 + 32 * j), sb.add(8 + 32 * j + 16)));
        (w, _mm_setzero_ps(), per_lane(_mm_setr_ps(dl(2 * j), dl(2 * j + 1), 0.0, 0.0), 1))
    }

    /// A super-block of format `KIND` (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) as its four pairs of sub-blocks,
    /// unpacked: each pair's weight bytes, its scales as [`apply`] takes them (Q4_K's and Q5_K's `[d sc_a,
    /// -dmin m_a, d sc_b, -dmin m_b]`, Q2_K's `-dmin m / 8` of its four sub-blocks; unused for Q3_K,
    /// Q6_K and IQ4_XS) and each lane's `d`.
    #[inline(always)]
    unsafe fn super_pairs<const KIND: u8>(sb: *const u8) -> [(__m512i, __m128, __m512); 4] {
        if KIND == Q4_K || KIND == Q5_K {
            let (d, dmin) = q4_k_scales(sb);
            let (w0, v0) = k_pair::<KIND>(sb, 0, d, dmin);
            let (w1, v1) = k_pair::<KIND>(sb, 1, d, dmin);
            let (w2, v2) = k_pair::<KIND>(sb, 2, d, dmin);
            let (w3, v3) = k_pair::<KIND>(sb, 3, d, dmin);
            [
                (w0, v0, per_lane(v0, 2)),
                (w1, v1, per_lane(v1, 2)),
                (w2, v2, per_lane(v2, 2)),
                (w3, v3, per_lane(v3, 2)),
            ]
        } else if KIND == IQ4_XS {
            let d = f16_at(sb, 0);
            [iq4_xs_pair(sb, 0, d), iq4_xs_pair(sb, 1, d), iq4_xs_pair(sb, 2, d), iq4_xs_pair(sb, 3, d)]
        } else if KIND == Q2_K {
            let d = f16_at(sb, 80);
            let dmin = f16_at(sb, 82);
            [
                q2_k_pair(sb, 0, d, dmin),
                q2_k_pair(sb, 1, d, dmin),
                q2_k_pair(sb, 2, d, dmin),
                q2_k_pair(sb, 3, d, dmin),
            ]
        } else if KIND == Q3_K {
            let d = f16_at(sb, 108);
            let scales = crate::formats::quant::q3_k_scales(std::slice::from_raw_parts(sb.add(96), 12));
            let unused = _mm_setzero_ps();
            let (w0, d0) = q3_k_pair(sb, 0, d, &scales);
            let (w1, d1) = q3_k_pair(sb, 1, d, &scales);
            let (w2, d2) = q3_k_pair(sb, 2, d, &scales);
            let (w3, d3) = q3_k_pair(sb, 3, d, &scales);
            [(w0, unused, d0), (w1, unused, d1), (w2, unused, d2), (w3, unused, d3)]
        } else {
            let d = f16_at(sb, 208);
            let (w0, d0, w1, d1) = q6_k_half(sb, 0, d);
            let (w2, d2, w3, d3) = q6_k_half(sb, 1, d);
            let unused = _mm_setzero_ps();
            [(w0, unused, d0), (w1, unused, d1), (w2, unused, d2), (w3, unused, d3)]
        }
    }

    /// Every row of `rows` of a super-block format `KIND` (Q2_K-Q6_K, IQ4_XS; `BYTES` a super-block,
    /// each row `x.blocks / 8` of them) against `T` vectors of x: `out[t][r]`. Each super-block
    /// is unpacked once for the `T` vectors, and each vector's sums are those it gets alone.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows_k<const KIND: u8, const BYTES: usize, const T: usize>(
        rows: &[u8],
        xs: [&IntX; T],
        out: [&mut [f32]; T],
    ) {
        let supers = xs[0].blocks / 8;
        for r in 0..out[0].len() {
            let row = rows.as_ptr().add(r * supers * BYTES);
            let mut acc = [_mm512_setzero_ps(); T];
            let mut side = [_mm_setzero_ps(); T];
            for s in 0..supers {
                let pairs = super_pairs::<KIND>(row.add(s * BYTES));
                for (j, &(w, scales, d)) in pairs.iter().enumerate() {
                    for t in 0..T {
                        apply::<KIND>(w, scales, d, &xs[t].pairs[4 * s + j], &mut acc[t], &mut side[t]);
                    }
                }
            }
            for t in 0..T {
                out[t][r] = finish(acc[t], side[t]);
            }
        }
    }

    /// A row's result from its accumulators: the 16 lanes summed (a fixed tree) and Q4_1's side
    /// term (lanes 1 and 3) added.
    #[inline(always)]
    unsafe fn finish(acc: __m512, side: __m128) -> f32 {
        let mut s = [0f32; 4];
        _mm_storeu_ps(s.as_mut_ptr(), side);
        _mm512_reduce_add_ps(acc) + (s[1] + s[3])
    }

    /// Every row of `rows` against four vectors of x: each pair of blocks unpacked once, then
    /// applied to each vector as `rows` applies it (the same bits).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows4<const N: usize, const KIND: u8>(
        rows: &[u8],
        xs: [&IntX; 4],
        out: [&mut [f32]; 4],
    ) {
        let blocks = xs[0].blocks;
        let row_bytes = blocks * N;
        let full = blocks / 2;
        let base = rows.as_ptr();
        for r in 0..out[0].len() {
            let ra = base.add(r * row_bytes);
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut side = [_mm_setzero_ps(); 4];
            for i in 0..blocks.div_ceil(2) {
                let a = ra.add(2 * i * N);
                let b = if i < full { a.add(N) } else { ZERO_BLOCK.as_ptr() };
                let (w, scales) = weights::<KIND>(a, b);
                let d = lane_scales::<KIND>(scales);
                for t in 0..4 {
                    apply::<KIND>(w, scales, d, &xs[t].pairs[i], &mut acc[t], &mut side[t]);
                }
            }
            for t in 0..4 {
                out[t][r] = finish(acc[t], side[t]);
            }
        }
    }

    /// Every row of `rows` (each `x.blocks` blocks of `N` bytes, format `KIND`) into `out`, one row
    /// at a time: a single vector's rows stream from memory, and two rows read side by side (two
    /// streams a thread) took 2.4x the time of one for Q4_1 at 16384 x 1536, where from L2 they
    /// were level.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    pub(super) unsafe fn rows<const N: usize, const KIND: u8>(rows: &[u8], x: &IntX, out: &mut [f32]) {
        let row_bytes = x.blocks * N;
        let full = x.blocks / 2;
        let base = rows.as_ptr();
        for (r, o) in out.iter_mut().enumerate() {
            let ra = base.add(r * row_bytes);
            let mut acc = _mm512_setzero_ps();
            let mut side = _mm_setzero_ps();
            for (i, xp) in x.pairs[..full].iter().enumerate() {
                let a = ra.add(2 * i * N);
                pair::<KIND>(a, a.add(N), xp, &mut acc, &mut side);
            }
            if x.blocks % 2 == 1 {
                pair::<KIND>(ra.add(2 * full * N), ZERO_BLOCK.as_ptr(), &x.pairs[full], &mut acc, &mut side);
            }
            *o = finish(acc, side);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(p: &XPair) -> Vec<u8> {
        let mut v: Vec<u8> = p.planes.iter().flatten().map(|&b| b as u8).collect();
        v.extend(p.scale.iter().flat_map(|f| f.to_bits().to_le_bytes()));
        for lanes in [&p.offset8, &p.offset128_hi, &p.offset128_lo] {
            v.extend(lanes.iter().flat_map(|i| i.to_le_bytes()));
        }
        v.extend(p.sums.iter().flat_map(|f| f.to_bits().to_le_bytes()));
        v
    }

    /// The AVX-512 preparation writes the same bytes as the scalar one, which it leaves to the
    /// blocks below 2^-100, and the planes put each value back: `65536 p1 + 256 p2 + p3` is
    /// within half a step of `x / s`.
    #[test]
    fn the_vector_preparation_equals_the_scalar_one() {
        let mut rng = crate::models::test_models::Values::from_clock();
        let mut vector_blocks = 0;
        for case in 0..2000 {
            let exponent = (rng.next_u64() % 200) as i32 - 100;
            let xb: Vec<f32> = (0..32)
                .map(|j| {
                    let v = rng.next() * 2f32.powi(exponent);
                    if case % 7 == 0 && j % 3 == 0 {
                        0.0
                    } else {
                        v
                    }
                })
                .collect();
            let second = case % 2;
            let mut scalar = ZERO_PAIR;
            prepare_block(&xb, second, &mut scalar);
            finish_pair(&mut scalar);
            let (amax, s) = (xb.iter().fold(0f32, |m, v| m.max(v.abs())), scalar.scale[4 * second]);
            for (j, &v) in xb.iter().enumerate() {
                let k = ((j / 16) * 2 + second) * 16 + j % 16;
                let q = 65536 * i64::from(scalar.planes[0][k])
                    + 256 * i64::from(scalar.planes[1][k])
                    + i64::from(scalar.planes[2][k]);
                if s > 0.0 {
                    assert!(
                        (q as f64 - f64::from(v) / f64::from(s)).abs() <= 0.5,
                        "{v} at {j}: q {q}, s {s}"
                    );
                    let steps = f64::from(amax) / f64::from(s);
                    assert!(q.abs() <= i64::from(Q_MAX) && steps <= f64::from(Q_MAX) && steps > 4_177_000.0);
                }
            }
            #[cfg(target_arch = "x86_64")]
            if available() {
                let mut vector = ZERO_PAIR;
                // SAFETY: available() checked the CPU's features.
                if unsafe { kernels::prepare_block(&xb, second, &mut vector) } {
                    unsafe { kernels::finish_pair(&mut vector) };
                    assert_eq!(bytes(&vector), bytes(&scalar), "block {case}: {xb:?}");
                    vector_blocks += 1;
                } else {
                    assert!(amax < 2f32.powi(-99), "block {case} of amax {amax} left to the scalar path");
                }
            }
        }
        println!("{vector_blocks} blocks compared with the vector preparation");
    }
}
