//! Dot products of F32, F16 and BF16 rows on CPUs with AVX-512F (and F16C, FMA), or with AVX2 on
//! 8 lanes ([`avx2`]): rows against `T` vectors at a time, each row's values widened once for all
//! `T` and, on AVX-512 with several vectors, each 16 values of x loaded once for two rows.
//!
//! A row is read 32 values a step into two 16-lane accumulators a vector (values `32 s + 16 c +
//! l` go to accumulator `c`, lane `l`), each a fused multiply-add chain in the row's order. A row whose length is not
//! a multiple of 32 ends with one step over its last values and zeros. The two accumulators are
//! added and the 16 lanes summed in a fixed tree. A vector's result therefore depends only on the
//! row and the vector: the same bits whether it is computed alone (`T` = 1, a decode step) or
//! beside three others (a prompt), paired with another row or not, by whichever thread.
//!
//! Widening is exact: F16 by the hardware conversion (`vcvtph2ps`), BF16 by a 16-bit shift. The
//! error against a float64 dot is fp32's: each product rounds once with its sum.

use std::arch::x86_64::*;

use kiln_core::DType;

use super::quant::has_avx2;

/// Values a step: two 16-lane registers.
const STEP: usize = 32;

/// The float formats this module serves, as its kernels' `W` parameter.
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// Whether the running CPU has AVX-512F, F16C and FMA, and `KILN_CPU_NO_AVX512` is unset (checked
/// once): the 16-lane kernels.
fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
            && std::env::var_os("KILN_CPU_NO_AVX512").is_none()
    })
}

/// Whether this module's kernels run here: AVX-512F or AVX2, with F16C and FMA.
pub(crate) fn available() -> bool {
    has_avx512() || has_avx2()
}

/// The kernel parameter of `dtype`, or `None` for a format this module does not serve.
pub(crate) fn kind(dtype: DType) -> Option<u8> {
    match dtype {
        DType::F32 => Some(F32),
        DType::F16 => Some(F16),
        DType::BF16 => Some(BF16),
        _ => None,
    }
}

/// Bytes of one value of format `W`.
const fn width(w: u8) -> usize {
    if w == F32 {
        4
    } else {
        2
    }
}

/// 16 values of format `W` at `p`, widened to f32.
#[inline(always)]
unsafe fn load16<const W: u8>(p: *const u8) -> __m512 {
    match W {
        F32 => _mm512_loadu_ps(p.cast()),
        F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        _ => {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
        }
    }
}

/// The last `values.len() % 32` values of a row (at most 31, of format `W`, at `tail`) widened
/// into `out`, zeros after them. F16 goes through the same table-free conversion as the reference
/// (`quant::f16_to_f32`), exact like the hardware's.
#[inline(always)]
fn widen_tail<const W: u8>(tail: &[u8], out: &mut [f32; STEP]) {
    *out = [0.0; STEP];
    for (o, c) in out.iter_mut().zip(tail.chunks_exact(width(W))) {
        *o = match W {
            F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            F16 => super::quant::f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            _ => f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16),
        };
    }
}

/// [`rows`] (AVX-512) or [`avx2::rows`] for the format `dtype` (F32, F16 or BF16; other formats
/// leave `out` as it is).
///
/// # Safety
/// [`available`] is true; the rest as [`rows`].
pub(crate) unsafe fn rows_of<const T: usize>(
    dtype: DType,
    bytes: &[u8],
    xs: [&[f32]; T],
    out: [&mut [f32]; T],
) {
    let wide = has_avx512();
    match (kind(dtype), wide) {
        (Some(F32), true) => rows::<F32, T>(bytes, xs, out),
        (Some(F16), true) => rows::<F16, T>(bytes, xs, out),
        (Some(_), true) => rows::<BF16, T>(bytes, xs, out),
        (Some(F32), false) => avx2::rows::<F32, T>(bytes, xs, out),
        (Some(F16), false) => avx2::rows::<F16, T>(bytes, xs, out),
        (Some(_), false) => avx2::rows::<BF16, T>(bytes, xs, out),
        (None, _) => {}
    }
}

/// `out[t][r]` = the dot of row `r` of `rows` (consecutive rows of `xs[0].len()` values of format
/// `W`) with `xs[t]`, for every row of `out[0]`. Several vectors take two rows at a time, so that
/// each 16 values of x loaded serve both (a prompt's rows come from L2: 1.3x on 576 x 1536); one
/// vector takes one row at a time (a decode step's rows stream from memory, and two streams a
/// thread read SmolLM2's 49152 x 576 output layer at 2.5x the time).
///
/// # Safety
/// [`available`] is true; every `xs[t]` has the same length `cols`, every `out[t]` the same
/// length `n`, and `rows.len() == n * cols * width(W)`.
#[target_feature(enable = "avx512f,f16c,fma")]
pub(crate) unsafe fn rows<const W: u8, const T: usize>(rows: &[u8], xs: [&[f32]; T], out: [&mut [f32]; T]) {
    let cols = xs[0].len();
    let row_bytes = cols * width(W);
    let n = out[0].len();
    if row_bytes == 0 || rows.len() < n * row_bytes {
        return;
    }
    // The vectors' last values, zero-padded to a step (once for all rows).
    let steps = cols / STEP;
    let mut x_tail = [[0f32; STEP]; T];
    for t in 0..T {
        x_tail[t][..cols % STEP].copy_from_slice(&xs[t][steps * STEP..]);
    }
    let mut r = 0;
    while T > 1 && r + 2 <= n {
        let sums = block::<W, T, 2>(&rows[r * row_bytes..(r + 2) * row_bytes], &xs, &x_tail);
        for t in 0..T {
            out[t][r] = sums[0][t];
            out[t][r + 1] = sums[1][t];
        }
        r += 2;
    }
    while r < n {
        let sums = block::<W, T, 1>(&rows[r * row_bytes..(r + 1) * row_bytes], &xs, &x_tail);
        for t in 0..T {
            out[t][r] = sums[0][t];
        }
        r += 1;
    }
}

/// The dots of `R` consecutive rows (`rows`, `R` rows of `xs[0].len()` values) with each of `xs`:
/// per row and vector two accumulators (values `32 s + 16 c + l` go to accumulator `c`, lane
/// `l`), each a fused multiply-add chain in the row's order, the last step over the zero-padded
/// tails (`x_tail`); then `a0 + a1` and the lanes' tree. Each row's sums are the same whatever
/// `R` and `T`.
#[inline(always)]
unsafe fn block<const W: u8, const T: usize, const R: usize>(
    rows: &[u8],
    xs: &[&[f32]; T],
    x_tail: &[[f32; STEP]; T],
) -> [[f32; T]; R] {
    let cols = xs[0].len();
    let row_bytes = cols * width(W);
    let steps = cols / STEP;
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    for s in 0..steps {
        let w: [[__m512; 2]; R] = std::array::from_fn(|i| {
            let at = rows.as_ptr().add(i * row_bytes + s * STEP * width(W));
            [load16::<W>(at), load16::<W>(at.add(16 * width(W)))]
        });
        for t in 0..T {
            let x = xs[t].as_ptr().add(s * STEP);
            for c in 0..2 {
                let xv = _mm512_loadu_ps(x.add(16 * c));
                for i in 0..R {
                    acc[i][t][c] = _mm512_fmadd_ps(w[i][c], xv, acc[i][t][c]);
                }
            }
        }
    }
    if !cols.is_multiple_of(STEP) {
        let mut w_tail = [0f32; STEP];
        for i in 0..R {
            widen_tail::<W>(&rows[i * row_bytes + steps * STEP * width(W)..(i + 1) * row_bytes], &mut w_tail);
            let w = [_mm512_loadu_ps(w_tail.as_ptr()), _mm512_loadu_ps(w_tail.as_ptr().add(16))];
            for t in 0..T {
                for c in 0..2 {
                    let xv = _mm512_loadu_ps(x_tail[t].as_ptr().add(16 * c));
                    acc[i][t][c] = _mm512_fmadd_ps(w[c], xv, acc[i][t][c]);
                }
            }
        }
    }
    let mut sums = [[0f32; T]; R];
    for i in 0..R {
        for t in 0..T {
            sums[i][t] = lanes_sum(_mm512_add_ps(acc[i][t][0], acc[i][t][1]));
        }
    }
    sums
}

/// The 16 lanes of `v` in a fixed tree: halves added, then halves of the halves.
#[inline(always)]
unsafe fn lanes_sum(v: __m512) -> f32 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let v8 = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
}

/// The 8-lane kernels of CPUs with AVX2 but not AVX-512: a row is read 16 values a step into two
/// 8-lane accumulators a vector (values `16 s + 8 c + l` go to accumulator `c`, lane `l`), one
/// row at a time (16 registers hold four vectors' accumulators, not eight rows' worth), the tail
/// as a last step over zeros, then `a0 + a1` and the 8 lanes in a fixed tree. A vector's result
/// is the same bits alone or among many here too; it differs from the AVX-512 kernels' in the
/// order of the additions (each within fp32's rounding of the float64 dot).
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{widen_tail, width, F16, F32, STEP};

    /// Values a step: two 8-lane registers.
    const STEP8: usize = 16;

    /// 8 values of format `W` at `p`, widened to f32.
    #[inline(always)]
    unsafe fn load8<const W: u8>(p: *const u8) -> __m256 {
        match W {
            F32 => _mm256_loadu_ps(p.cast()),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
            }
        }
    }

    /// As [`super::rows`], on 8 lanes.
    ///
    /// # Safety
    /// AVX2, F16C and FMA are present; the rest as [`super::rows`].
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(crate) unsafe fn rows<const W: u8, const T: usize>(
        rows: &[u8],
        xs: [&[f32]; T],
        out: [&mut [f32]; T],
    ) {
        let cols = xs[0].len();
        let row_bytes = cols * width(W);
        let n = out[0].len();
        if row_bytes == 0 || rows.len() < n * row_bytes {
            return;
        }
        let steps = cols / STEP8;
        let rest = cols % STEP8;
        let mut x_tail = [[0f32; STEP8]; T];
        for t in 0..T {
            x_tail[t][..rest].copy_from_slice(&xs[t][steps * STEP8..]);
        }
        // widen_tail fills a step of the 16-lane kernels; the first STEP8 values are this one's.
        let mut w_tail = [0f32; STEP];
        for r in 0..n {
            let row = &rows[r * row_bytes..(r + 1) * row_bytes];
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            for s in 0..steps {
                let at = row.as_ptr().add(s * STEP8 * width(W));
                let w = [load8::<W>(at), load8::<W>(at.add(8 * width(W)))];
                for t in 0..T {
                    let x = xs[t].as_ptr().add(s * STEP8);
                    for c in 0..2 {
                        acc[t][c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x.add(8 * c)), acc[t][c]);
                    }
                }
            }
            if rest > 0 {
                widen_tail::<W>(&row[steps * STEP8 * width(W)..], &mut w_tail);
                let w = [_mm256_loadu_ps(w_tail.as_ptr()), _mm256_loadu_ps(w_tail.as_ptr().add(8))];
                for t in 0..T {
                    for c in 0..2 {
                        let xv = _mm256_loadu_ps(x_tail[t].as_ptr().add(8 * c));
                        acc[t][c] = _mm256_fmadd_ps(w[c], xv, acc[t][c]);
                    }
                }
            }
            for t in 0..T {
                let v = _mm256_add_ps(acc[t][0], acc[t][1]);
                let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
                out[t][r] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel against `T` vectors.
    type Kernel<const T: usize> = unsafe fn(&[u8], [&[f32]; T], [&mut [f32]; T]);

    /// Random values of format `W`'s bytes and their exact f32 values.
    fn random_row(state: &mut u64, n: usize, w: u8) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut values = Vec::new();
        for _ in 0..n {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            let v = (*state >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            match w {
                F32 => {
                    bytes.extend_from_slice(&v.to_le_bytes());
                    values.push(v);
                }
                F16 => {
                    let h = half::f16::from_f32(v);
                    bytes.extend_from_slice(&h.to_le_bytes());
                    values.push(h.to_f32());
                }
                _ => {
                    let h = half::bf16::from_f32(v);
                    bytes.extend_from_slice(&h.to_le_bytes());
                    values.push(h.to_f32());
                }
            }
        }
        (bytes, values)
    }

    fn check<const W: u8>(state: &mut u64, cols: usize, kernel: Kernel<4>, one: Kernel<1>) {
        let rows = 3;
        let (bytes, values) = random_row(state, rows * cols, W);
        let xs: Vec<Vec<f32>> = (0..4).map(|_| random_row(state, cols, F32).1).collect();
        let mut many = vec![vec![f32::NAN; rows]; 4];
        {
            let [a, b, c, d] = &mut many[..] else { unreachable!() };
            // SAFETY: the caller checked the CPU; the shapes match.
            unsafe { kernel(&bytes, [&xs[0], &xs[1], &xs[2], &xs[3]], [a, b, c, d]) };
        }
        for t in 0..4 {
            let mut alone = vec![f32::NAN; rows];
            // SAFETY: as above.
            unsafe { one(&bytes, [&xs[t]], [&mut alone]) };
            for r in 0..rows {
                assert_eq!(
                    many[t][r].to_bits(),
                    alone[r].to_bits(),
                    "W {W}, {cols} cols, vector {t}, row {r}"
                );
                let terms = values[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&xs[t])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b));
                let want: f64 = terms.clone().sum();
                let size: f64 = terms.map(f64::abs).sum();
                let bound = (cols.div_ceil(16) + 8) as f64 * 2f64.powi(-24) * size + 1e-40;
                assert!(
                    (f64::from(alone[r]) - want).abs() <= bound,
                    "W {W}, {cols} cols, row {r}: {} vs {want}",
                    alone[r]
                );
            }
        }
    }

    /// The AVX2 kernels (what CPUs without AVX-512 run), called directly whatever this CPU's
    /// widest: four vectors give each the bits of one alone, within fp32's rounding of float64.
    #[test]
    fn the_avx2_kernels_match_float64_one_vector_or_four() {
        assert!(has_avx2(), "this check needs AVX2, F16C and FMA (x86-64 CPUs since 2013 have them)");
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for cols in [1, 7, 8, 15, 16, 17, 33, 576, 1000] {
            check::<F32>(&mut state, cols, avx2::rows::<F32, 4>, avx2::rows::<F32, 1>);
            check::<F16>(&mut state, cols, avx2::rows::<F16, 4>, avx2::rows::<F16, 1>);
            check::<BF16>(&mut state, cols, avx2::rows::<BF16, 4>, avx2::rows::<BF16, 1>);
        }
    }
}
