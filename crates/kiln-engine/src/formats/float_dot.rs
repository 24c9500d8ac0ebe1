//! Dot products of F32, F16 and BF16 rows on CPUs with AVX-512F (and F16C, FMA): rows against `T`
//! vectors at a time, each row's values widened once for all `T` and, with several vectors, each
//! 16 values of x loaded once for two rows.
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

/// Values a step: two 16-lane registers.
const STEP: usize = 32;

/// The float formats this module serves, as its kernels' `W` parameter.
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// Whether the running CPU has AVX-512F, F16C and FMA, and `KILN_CPU_NO_AVX512` is unset (checked
/// once).
pub(crate) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
            && std::env::var_os("KILN_CPU_NO_AVX512").is_none()
    })
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

/// [`rows`] for the format `dtype` (F32, F16 or BF16; other formats leave `out` as it is).
///
/// # Safety
/// As [`rows`].
pub(crate) unsafe fn rows_of<const T: usize>(
    dtype: DType,
    bytes: &[u8],
    xs: [&[f32]; T],
    out: [&mut [f32]; T],
) {
    match kind(dtype) {
        Some(F32) => rows::<F32, T>(bytes, xs, out),
        Some(F16) => rows::<F16, T>(bytes, xs, out),
        Some(_) => rows::<BF16, T>(bytes, xs, out),
        None => {}
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
