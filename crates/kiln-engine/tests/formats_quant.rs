//! Dequantization against llama.cpp's `gguf` Python package, and the block-wise dot product
//! against a float64 dot of those same values.
//!
//! The fixtures in `tests/fixtures/quant/` were written by `fixtures/make_quant_fixtures.py`:
//! raw blocks (`<TYPE>.bin`) and the f32 values the package dequantizes them to (`<TYPE>.f32`).

use std::path::PathBuf;

use kiln_core::{DType, Error};
use kiln_engine::formats::quant::{dequantize_row, dot_row, matvec, SERVED};

const TYPES: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "Q8_K", "IQ4_NL", "IQ4_XS",
];

fn fixture(name: &str) -> (DType, Vec<u8>, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant");
    let raw = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
    let expected = std::fs::read(dir.join(format!("{name}.f32"))).unwrap();
    let expected = expected.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    (DType::from_name(name).unwrap(), raw, expected)
}

#[test]
fn every_served_type_has_a_fixture() {
    let mut served: Vec<&str> = SERVED.iter().map(|d| d.name()).collect();
    let mut listed = TYPES.to_vec();
    served.sort();
    listed.sort();
    assert_eq!(served, listed);
}

#[test]
fn dequantization_equals_the_gguf_package_bit_for_bit() {
    for name in TYPES {
        let (dtype, raw, expected) = fixture(name);
        assert_eq!(expected.len(), 512, "{name}");
        let mut out = vec![f32::from_bits(0x7fc0_dead); expected.len()];
        dequantize_row(dtype, &raw, &mut out).unwrap();
        for (i, (&got, &want)) in out.iter().zip(&expected).enumerate() {
            let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
            assert!(
                same,
                "{name} element {i}: got {got:e} ({:#x}), gguf gives {want:e} ({:#x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    }
}

/// A fresh pseudo-random vector (xorshift seeded by the clock), never all zeros.
fn random_x(n: usize) -> Vec<f32> {
    let mut rng = Rng::from_clock();
    (0..n).map(|_| rng.unit()).collect()
}

#[test]
fn dot_row_matches_a_float64_dot_of_the_dequantized_values() {
    for name in TYPES {
        let (dtype, raw, expected) = fixture(name);
        if expected.iter().any(|v| !v.is_finite()) {
            // The float fixtures carry Inf and NaN on purpose; dot them over the finite part.
            continue;
        }
        let x = random_x(expected.len());
        let reference: f64 = expected.iter().zip(&x).map(|(&w, &v)| f64::from(w) * f64::from(v)).sum();
        let magnitude: f64 =
            expected.iter().zip(&x).map(|(&w, &v)| (f64::from(w) * f64::from(v)).abs()).sum();
        let got = f64::from(dot_row(dtype, &raw, &x).unwrap());
        assert!(
            (got - reference).abs() <= 1e-5 * magnitude + 1e-30,
            "{name}: dot_row {got} vs float64 {reference} (sum of |terms| {magnitude})"
        );
    }
}

#[test]
fn dot_row_of_float_rows_handles_tails_and_specials() {
    // 37 elements: two 16-lane chunks and a tail of 5.
    let w: Vec<f32> = random_x(37);
    let x: Vec<f32> = random_x(37);
    let reference: f64 = w.iter().zip(&x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let got = dot_row(DType::F32, &bytes, &x).unwrap();
    assert!((f64::from(got) - reference).abs() < 1e-5, "{got} vs {reference}");

    // f16 and bf16 rows of finite values, widened exactly, against float64.
    let f16_bytes: Vec<u8> = w.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let bf16_bytes: Vec<u8> = w.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let f16_ref: f64 =
        w.iter().zip(&x).map(|(&a, &b)| f64::from(half::f16::from_f32(a).to_f32()) * f64::from(b)).sum();
    let bf16_ref: f64 =
        w.iter().zip(&x).map(|(&a, &b)| f64::from(half::bf16::from_f32(a).to_f32()) * f64::from(b)).sum();
    let got = dot_row(DType::F16, &f16_bytes, &x).unwrap();
    assert!((f64::from(got) - f16_ref).abs() < 1e-5, "f16: {got} vs {f16_ref}");
    let got = dot_row(DType::BF16, &bf16_bytes, &x).unwrap();
    assert!((f64::from(got) - bf16_ref).abs() < 1e-5, "bf16: {got} vs {bf16_ref}");

    let (_, raw, _) = fixture("F16");
    let got = dot_row(DType::F16, &raw, &vec![1.0; 512]).unwrap();
    assert!(got.is_nan(), "Inf - Inf + NaN must stay NaN, got {got}");
}

#[test]
fn matvec_equals_dot_row_for_every_row() {
    for name in ["Q4_1", "Q8_0", "Q6_K", "F16"] {
        let (dtype, raw, _) = fixture(name);
        // The 512-element fixture as 2 rows of 256.
        let x = random_x(256);
        let mut out = vec![f32::NAN; 2];
        matvec(dtype, &raw, 2, 256, &x, &mut out).unwrap();
        let half = raw.len() / 2;
        for (r, &o) in out.iter().enumerate() {
            let want = dot_row(dtype, &raw[r * half..(r + 1) * half], &x).unwrap();
            assert_eq!(o.to_bits(), want.to_bits(), "{name} row {r}");
        }
    }
}

#[test]
fn wrong_lengths_and_unserved_types_are_named_errors() {
    let (_, raw, _) = fixture("Q4_1");
    let mut out = vec![0f32; 511];
    assert!(matches!(
        dequantize_row(DType::Q4_1, &raw, &mut out),
        Err(Error::NotBlockAligned { elements: 511, .. })
    ));
    let mut out = vec![0f32; 480];
    assert!(matches!(
        dequantize_row(DType::Q4_1, &raw, &mut out),
        Err(Error::ByteLength { expected: 300, got: 320, .. })
    ));
    assert!(matches!(dot_row(DType::Q4_1, &raw[..319], &[0.0; 512]), Err(Error::ByteLength { .. })));
    assert!(matches!(dot_row(DType::IQ2_XXS, &[], &[]), Err(Error::DTypeNotServed { dtype: "IQ2_XXS", .. })));
    let mut out = vec![0f32; 3];
    assert!(matches!(
        matvec(DType::Q4_1, &raw, 3, 256, &[0.0; 256], &mut out),
        Err(Error::ByteLength { .. })
    ));
    assert!(matches!(
        matvec(DType::Q4_1, &raw, 2, 256, &[0.0; 255], &mut out[..2]),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// `dot_rows` (Q4_1's AVX-512 float kernel, or the integer one) equals the float64 dot of each dequantized row,
/// for even and odd row counts.
#[test]
fn dot_rows_matches_float64_for_every_row() {
    use kiln_core::DType;
    use kiln_engine::formats::{dequantize_row, dot_rows};
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let cols = 576;
    for rows in [1usize, 2, 7, 64] {
        // Q4_1 blocks: f16 d and m in (0.001, 0.1) and random nibbles.
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            let d = half::f16::from_f32(0.001 + (next() % 1000) as f32 / 10_000.0);
            let m = half::f16::from_f32(-((next() % 1000) as f32) / 10_000.0);
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&m.to_le_bytes());
            bytes.extend((0..16).map(|_| next() as u8));
        }
        let x: Vec<f32> = (0..cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let mut out = vec![f32::NAN; rows];
        dot_rows(DType::Q4_1, &bytes, &x, &mut out).unwrap();
        let row_bytes = cols / 32 * 20;
        for r in 0..rows {
            let mut w = vec![0f32; cols];
            dequantize_row(DType::Q4_1, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
            let want: f64 = w.iter().zip(&x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            let scale: f64 = w.iter().zip(&x).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
            assert!(
                (f64::from(out[r]) - want).abs() <= 1e-5 * scale.max(1.0),
                "row {r} of {rows}: {} vs {want}",
                out[r]
            );
        }
    }
    let mut out = vec![0f32; 3];
    assert!(dot_rows(DType::Q4_1, &[0u8; 40], &[0f32; 32], &mut out).is_err());
}

/// A generator of test data, seeded from the clock (each run new inputs; the seed is printed).
struct Rng(u64);

impl Rng {
    fn from_clock() -> Rng {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
        println!("seed {seed:#x}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random blocks of `dtype` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K-Q6_K, IQ4_XS): finite f16 scales,
/// and with `extreme` every quant at an end of its range (Q8_0's -128, Q4's 0, Q5's and the K
/// formats' largest), the largest sums the integer kernels meet.
fn random_blocks(rng: &mut Rng, dtype: DType, blocks: usize, extreme: bool) -> Vec<u8> {
    let mut bytes = Vec::new();
    if dtype == DType::IQ4_XS {
        // A super-block a 8 blocks: d small, random scales and codes (with `extreme`, every scale
        // 0 and every code 0: d (0 - 32) times the grid's -127, the largest products).
        for _ in 0..blocks / 8 {
            let d = half::f16::from_f32(0.0005 + (rng.next() % 1000) as f32 / 100_000.0);
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend((0..134).map(|_| if extreme { 0x00 } else { rng.next() as u8 }));
        }
        return bytes;
    }
    if dtype == DType::Q2_K {
        // A super-block a 8 blocks: random scales, mins and quants (with `extreme`, every scale,
        // min and quant at its largest), d and dmin small.
        for _ in 0..blocks / 8 {
            bytes.extend((0..80).map(|_| if extreme { 0xFF } else { rng.next() as u8 }));
            for _ in 0..2 {
                let v = half::f16::from_f32(0.0005 + (rng.next() % 1000) as f32 / 100_000.0);
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        return bytes;
    }
    if dtype == DType::Q3_K {
        // A super-block a 8 blocks: random bits, quants and scales (with `extreme`, every quant 7
        // and every scale 63: the largest products), d small.
        for _ in 0..blocks / 8 {
            bytes.extend((0..108).map(|_| if extreme { 0xFF } else { rng.next() as u8 }));
            let d = half::f16::from_f32(0.0005 + (rng.next() % 1000) as f32 / 100_000.0);
            bytes.extend_from_slice(&d.to_le_bytes());
        }
        return bytes;
    }
    if dtype == DType::Q6_K {
        // A super-block a 8 blocks: random quant bits and signed scales (with `extreme`, every
        // quant 63 and every scale 127), d small.
        for _ in 0..blocks / 8 {
            bytes.extend((0..208).map(|i| {
                if extreme {
                    if i < 192 {
                        0xFF
                    } else {
                        127
                    }
                } else {
                    rng.next() as u8
                }
            }));
            let d = half::f16::from_f32(0.0005 + (rng.next() % 1000) as f32 / 100_000.0);
            bytes.extend_from_slice(&d.to_le_bytes());
        }
        return bytes;
    }
    if matches!(dtype, DType::Q4_K | DType::Q5_K) {
        // A super-block a 8 blocks: d and dmin small, random 6-bit scales and mins (with
        // `extreme`, all 63 and every quant at its largest), random quants (Q5_K: and fifth bits).
        let rest = if dtype == DType::Q4_K { 12 + 128 } else { 12 + 32 + 128 };
        for _ in 0..blocks / 8 {
            for _ in 0..2 {
                let v = half::f16::from_f32(0.0005 + (rng.next() % 1000) as f32 / 100_000.0);
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            bytes.extend((0..rest).map(|_| if extreme { 0xFF } else { rng.next() as u8 }));
        }
        return bytes;
    }
    for _ in 0..blocks {
        let d = half::f16::from_f32(0.001 + (rng.next() % 1000) as f32 / 10_000.0);
        bytes.extend_from_slice(&d.to_le_bytes());
        let quants = match dtype {
            DType::Q4_1 | DType::Q5_1 => {
                let m = half::f16::from_f32(-((rng.next() % 1000) as f32) / 10_000.0);
                bytes.extend_from_slice(&m.to_le_bytes());
                if dtype == DType::Q4_1 {
                    16
                } else {
                    4 + 16
                }
            }
            DType::Q4_0 | DType::IQ4_NL => 16,
            // qh (the fifth bits), then the nibbles.
            DType::Q5_0 => 4 + 16,
            _ => 32,
        };
        // Q5's largest quants (31), Q8_0's most negative (-128), Q4's smallest (0), IQ4_NL's code
        // 0 (-127).
        let fill = match dtype {
            DType::Q8_0 => 0x80,
            DType::Q5_0 | DType::Q5_1 => 0xFF,
            _ => 0x00,
        };
        bytes.extend((0..quants).map(|_| if extreme { fill } else { rng.next() as u8 }));
    }
    bytes
}

/// x of `blocks` blocks of 32, each block drawn from a different kind: uniform, one large value
/// among tiny ones (the fixed point's worst case), all equal to its largest (every lane at the
/// top of its range), zero, and magnitudes below 2^-100 (the scalar preparation).
fn adversarial_x(rng: &mut Rng, blocks: usize) -> Vec<f32> {
    let mut x = Vec::new();
    for b in 0..blocks {
        let kind = (b + (rng.next() % 5) as usize) % 5;
        let scale = 2f32.powi((rng.next() % 40) as i32 - 20);
        for j in 0..32 {
            x.push(match kind {
                0 => rng.unit() * scale,
                1 => {
                    if j == (b * 7) % 32 {
                        scale
                    } else {
                        rng.unit() * scale * 1e-6
                    }
                }
                2 => -scale,
                3 => 0.0,
                _ => rng.unit() * 1e-31,
            });
        }
    }
    x
}

/// Every block format the dot products serve: blocks of 32, then super-blocks of 256.
const BLOCK_FORMATS: [DType; 12] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::IQ4_NL,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_XS,
];

/// Whether `dtype` comes in super-blocks of 256 (rows of whole super-blocks).
fn super_blocks(dtype: DType) -> bool {
    dtype.block_size() == 256
}

/// `dot_rows_x` of one vector and `dot_rows_many` of four (each x prepared by `prepare`) over
/// `rows` rows of `dtype` in `bytes`, each result within `bound(w, x, terms)` of the float64 dot
/// of the dequantized row `w` with x (`terms`: the sum of |w x|).
fn check_against_float64(
    dtype: DType,
    bytes: &[u8],
    rows: usize,
    x: &[f32],
    prepare: impl Fn(&[f32]) -> kiln_engine::formats::quant::DotX,
    bound: impl Fn(&[f32], &[f32], f64) -> f64,
) {
    use kiln_engine::formats::quant::{dot_rows_many, dot_rows_x};
    let mut out = vec![f32::NAN; rows];
    dot_rows_x(dtype, bytes, &prepare(x), &mut out).unwrap();
    let four: Vec<_> = (0..4).map(|_| prepare(x)).collect();
    let mut out4 = vec![f32::NAN; 4 * rows];
    dot_rows_many(dtype, bytes, &four, &mut out4).unwrap();
    let row_bytes = bytes.len() / rows;
    for (r, &got) in out.iter().chain(&out4).enumerate() {
        let r = r % rows;
        let mut w = vec![0f32; x.len()];
        dequantize_row(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
        let want: f64 = w.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
        let terms: f64 = w.iter().zip(x).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
        let bound = bound(&w, x, terms);
        assert!(
            (f64::from(got) - want).abs() <= bound,
            "{dtype}, {} blocks, row {r} of {rows}: {got} vs float64 {want} (bound {bound:e})",
            x.len() / 32
        );
    }
}

/// `dot_rows_x` and `dot_rows_many` (four vectors) over every block format (the integer kernels
/// where the CPU has AVX-512 VNNI, but for one vector's Q8_0 rows; the float ones elsewhere), odd
/// and even block counts and row counts, against the float64 dot of the dequantized rows: within
/// the fixed point's bound, `sum |w| * amax * 2^-23` per block, plus fp32 rounding (1e-6 of the
/// sum of |terms|).
#[test]
fn integer_dot_products_are_within_the_fixed_point_bound_of_float64() {
    use kiln_engine::formats::quant::DotX;
    let mut rng = Rng::from_clock();
    for dtype in BLOCK_FORMATS {
        let shapes: &[(usize, usize, bool)] = if super_blocks(dtype) {
            &[(8, 1, false), (24, 5, false), (48, 64, false), (16, 3, true)]
        } else {
            &[(1, 1, false), (3, 5, false), (18, 64, false), (48, 7, true), (5, 2, true)]
        };
        for &(blocks, rows, extreme) in shapes {
            let bytes = random_blocks(&mut rng, dtype, blocks * rows, extreme);
            let x = if extreme { vec![-0.75f32; blocks * 32] } else { adversarial_x(&mut rng, blocks) };
            println!("{dtype} {blocks} blocks: integer kernel {}", DotX::new(&x).uses_integer_kernel(dtype));
            // Four vectors at once: the integer kernels for Q8_0 too.
            check_against_float64(dtype, &bytes, rows, &x, DotX::new, |w, x, terms| {
                let fixed: f64 = w
                    .chunks(32)
                    .zip(x.chunks(32))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
                        wb.iter().map(|&v| f64::from(v).abs()).sum::<f64>() * amax * 2f64.powi(-23)
                    })
                    .sum();
                fixed + 1e-6 * terms + 1e-35
            });
        }
    }
}

/// The float kernels (the CPUs without AVX-512 VNNI; on x86-64 with AVX2 the hand-written ones
/// of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS) against the float64 dot
/// of the dequantized rows, on random blocks of every block format, one and four vectors: within
/// fp32's rounding of the sum of |terms|.
#[test]
fn float_kernels_match_float64_on_every_block_format() {
    use kiln_engine::formats::quant::DotX;
    let mut rng = Rng::from_clock();
    for dtype in BLOCK_FORMATS {
        for &(blocks, rows, extreme) in &[(8, 3, false), (24, 5, false), (16, 2, true)] {
            let bytes = random_blocks(&mut rng, dtype, blocks * rows, extreme);
            let x: Vec<f32> = (0..blocks * 32).map(|_| rng.unit()).collect();
            check_against_float64(dtype, &bytes, rows, &x, DotX::float, |_, _, terms| 1e-5 * terms + 1e-30);
        }
    }
}

/// x with a value that is not finite is not written in fixed point: a NaN gives NaN, an infinity
/// never a finite result (Q4_1's `d q x + m x` may meet Inf - Inf and give NaN, as the float
/// kernels always have).
#[test]
fn integer_dot_products_keep_infinities_and_nan() {
    let mut rng = Rng::from_clock();
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::IQ4_NL] {
        let bytes = random_blocks(&mut rng, dtype, 4, false);
        let mut x: Vec<f32> = (0..128).map(|_| rng.unit()).collect();
        x[77] = f32::NAN;
        assert!(dot_row(dtype, &bytes, &x).unwrap().is_nan(), "{dtype} with a NaN in x");
        x[77] = f32::INFINITY;
        let got = dot_row(dtype, &bytes, &x).unwrap();
        assert!(!got.is_finite(), "{dtype}: {got} with an infinity in x");
    }
}

/// `dot_rows_many` (four vectors a row unpack on the integer kernels) gives each vector the bits
/// `dot_rows_x` gives it alone, over odd and even block counts and a partial group of vectors
/// (Q8_0, whose single vectors take the float kernel, is checked against float64 above).
#[test]
fn many_vectors_at_once_give_the_bits_of_one_at_a_time() {
    use kiln_engine::formats::quant::{dot_rows_many, DotX};
    let mut rng = Rng::from_clock();
    for dtype in
        BLOCK_FORMATS.into_iter().filter(|&d| d != DType::Q8_0).chain([DType::F32, DType::F16, DType::BF16])
    {
        for (cols, rows, tokens) in [(96, 5, 7), (576, 9, 4), (256, 3, 9), (1536, 2, 1)] {
            let float = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
            if !float && super_blocks(dtype) && cols % 256 != 0 {
                continue; // K formats hold whole super-blocks of 256
            }
            let row_bytes = dtype.bytes_for(cols as u64).unwrap() as usize;
            let width = row_bytes / cols;
            let bytes: Vec<u8> = if !float {
                random_blocks(&mut rng, dtype, rows * cols / 32, false)
            } else {
                // Small finite values: the top byte of each value bounded.
                (0..rows * row_bytes)
                    .map(
                        |i| if i % width == width - 1 { (rng.next() % 0x2c) as u8 } else { rng.next() as u8 },
                    )
                    .collect()
            };
            let xs: Vec<DotX> = (0..tokens).map(|_| DotX::new(&adversarial_x(&mut rng, cols / 32))).collect();
            many_equal_one_at_a_time(dtype, &bytes, &xs, rows, &format!("{cols} cols"));
        }
    }
    let mut out = vec![0f32; 5];
    let xs = [DotX::new(&[0.0; 32]), DotX::new(&[0.0; 64])];
    assert!(matches!(
        dot_rows_many(DType::Q4_1, &[0u8; 40], &xs, &mut out),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// F32, F16 and BF16 rows (the AVX-512 float kernels where the CPU has them) over lengths around
/// the kernels' 16-value lanes and 32-value steps, against the float64 dot of the widened
/// values: within fp32's rounding of a fused multiply-add chain a lane plus the lanes' tree
/// (`(steps + 8) 2^-24` of the sum of |terms|); six vectors at once give each the bits it gets
/// alone. Row 1 of F16 is all subnormals: a widening that flushed them to zero would miss the
/// float64 dot by the whole of it.
#[test]
fn float_rows_match_float64_one_vector_or_many() {
    use kiln_engine::formats::quant::DotX;
    let mut rng = Rng::from_clock();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for cols in [1usize, 5, 16, 63, 64, 65, 130, 576, 1000] {
            let rows = 3;
            let encode = |v: f32| -> Vec<u8> {
                match dtype {
                    DType::F32 => v.to_le_bytes().to_vec(),
                    DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                    _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                }
            };
            // Row 1 of F16 holds subnormals (|v| < 2^-14).
            let values: Vec<f32> =
                (0..rows * cols)
                    .map(|i| {
                        if dtype == DType::F16 && i / cols == 1 {
                            rng.unit() * 6e-5
                        } else {
                            rng.unit() * 4.0
                        }
                    })
                    .collect();
            let bytes: Vec<u8> = values.iter().flat_map(|&v| encode(v)).collect();
            let xs: Vec<DotX> =
                (0..6).map(|_| DotX::new(&(0..cols).map(|_| rng.unit()).collect::<Vec<_>>())).collect();
            let ones = many_equal_one_at_a_time(dtype, &bytes, &xs, rows, &format!("{cols} cols"));
            let row_bytes = bytes.len() / rows;
            for (x, one) in xs.iter().zip(&ones) {
                for r in 0..rows {
                    let mut w = vec![0f32; cols];
                    dequantize_row(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut w).unwrap();
                    let terms = w.iter().zip(x.values()).map(|(&a, &b)| f64::from(a) * f64::from(b));
                    let want: f64 = terms.clone().sum();
                    let size: f64 = terms.map(f64::abs).sum();
                    let bound = (cols.div_ceil(32) + 8) as f64 * 2f64.powi(-24) * size + 1e-40;
                    assert!(
                        (f64::from(one[r]) - want).abs() <= bound,
                        "{dtype} {cols} cols, row {r}: {} vs float64 {want} (bound {bound:e})",
                        one[r]
                    );
                }
            }
        }
    }
}

/// Vectors prepared for the float kernels alone (`DotX::float`: what CPUs without AVX-512 VNNI
/// run): `dot_rows_many` of five of them (Q4_0, Q4_1 and Q8_0 unpack each block once for four on
/// AVX2) gives each the bits `dot_rows_x` gives it alone, over odd and even block counts.
#[test]
fn many_float_vectors_give_the_bits_of_one_at_a_time() {
    use kiln_engine::formats::quant::DotX;
    let mut rng = Rng::from_clock();
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        for (blocks, rows) in [(1, 3), (18, 5), (7, 2)] {
            let bytes = random_blocks(&mut rng, dtype, blocks * rows, false);
            let xs: Vec<DotX> = (0..5).map(|_| DotX::float(&adversarial_x(&mut rng, blocks))).collect();
            many_equal_one_at_a_time(dtype, &bytes, &xs, rows, &format!("{blocks} blocks"));
        }
    }
}

/// `dot_rows_many` of `xs` against `rows` rows of `dtype`, asserted bit for bit equal to
/// `dot_rows_x` of each vector alone (`what` names the case); returns each vector's results.
fn many_equal_one_at_a_time(
    dtype: DType,
    bytes: &[u8],
    xs: &[kiln_engine::formats::quant::DotX],
    rows: usize,
    what: &str,
) -> Vec<Vec<f32>> {
    use kiln_engine::formats::quant::{dot_rows_many, dot_rows_x};
    let mut many = vec![f32::NAN; xs.len() * rows];
    dot_rows_many(dtype, bytes, xs, &mut many).unwrap();
    xs.iter()
        .enumerate()
        .map(|(t, x)| {
            let mut one = vec![f32::NAN; rows];
            dot_rows_x(dtype, bytes, x, &mut one).unwrap();
            for r in 0..rows {
                assert_eq!(
                    many[t * rows + r].to_bits(),
                    one[r].to_bits(),
                    "{dtype} {what}, vector {t} of {}, row {r}: {} vs {}",
                    xs.len(),
                    many[t * rows + r],
                    one[r]
                );
            }
            one
        })
        .collect()
}
