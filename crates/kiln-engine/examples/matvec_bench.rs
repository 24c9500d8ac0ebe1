//! Times `dot_rows_x` (one thread, x prepared once as `DotX`), `dot_rows_many` over four vectors
//! (one thread, the time per vector) and `matvec` (the rayon pool, x
//! prepared per call) on random weights of each hot dtype, and prints the weight bytes read per
//! second, and the time to prepare x (`DotX::new`). `KILN_CPU_NO_VNNI=1` times the float kernels
//! in place of the integer ones.
//!
//! `cargo run --release -p kiln-engine --example matvec_bench [rows cols] [DTYPE ...]` (default
//! 576 × 1536, SmolLM2's FFN down projection; every hot dtype unless some are named).

use std::time::Instant;

use kiln_core::DType;
use kiln_engine::formats::{dot_rows_many, dot_rows_x, matvec, DotX};

fn main() -> kiln_core::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let named: Vec<String> = std::env::args().skip(1).filter(|a| a.parse::<usize>().is_err()).collect();
    let (rows, cols) = match args[..] {
        [r, c] => (r, c),
        _ => (576, 1536),
    };
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let x: Vec<f32> = (0..cols).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect();
    println!("{rows} x {cols}, {} threads", rayon::current_num_threads());
    for dtype in [
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q6_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::F32,
        DType::F16,
        DType::BF16,
    ] {
        if !named.is_empty() && !named.iter().any(|n| n.eq_ignore_ascii_case(dtype.name())) {
            continue;
        }
        let row_bytes = dtype.bytes_for(cols as u64)? as usize;
        let mut matrix: Vec<u8> = (0..rows * row_bytes).map(|_| next() as u8).collect();
        // Finite scales: set every f16 field that could be a scale to a small value by writing
        // random bytes whose f16 exponent is bounded (top byte 0x1c..0x2b is |v| < 0.25).
        for b in matrix.iter_mut().skip(1).step_by(2) {
            *b = 0x1c + (*b % 16);
        }
        let mut out = vec![0f32; rows];
        let reps = (200_000_000 / matrix.len()).max(3);
        let start = Instant::now();
        let mut sink = 0f32;
        for _ in 0..reps {
            sink += DotX::new(&x).values()[0];
        }
        let prepare = start.elapsed().as_secs_f64() / reps as f64;
        let prepared = DotX::new(&x);
        let start = Instant::now();
        for _ in 0..reps {
            dot_rows_x(dtype, &matrix, &prepared, &mut out)?;
            sink += out[0];
        }
        let single = start.elapsed().as_secs_f64() / reps as f64;
        // Four vectors at once (a prompt's tokens), per vector.
        let four: Vec<DotX> = (0..4).map(|_| DotX::new(&x)).collect();
        let mut out4 = vec![0f32; 4 * rows];
        let start = Instant::now();
        for _ in 0..reps {
            dot_rows_many(dtype, &matrix, &four, &mut out4)?;
            sink += out4[0];
        }
        let per_token = start.elapsed().as_secs_f64() / reps as f64 / 4.0;
        let start = Instant::now();
        for _ in 0..reps {
            matvec(dtype, &matrix, rows, cols, &x, &mut out)?;
            sink += out[0];
        }
        let parallel = start.elapsed().as_secs_f64() / reps as f64;
        let gb = matrix.len() as f64 / 1e9;
        println!(
            "{dtype:>5}: {:>8.1} us/matvec 1 thread ({:>5.1} GB/s), {:>8.1} a vector of four, {:>8.1} us pooled \
             ({:>5.1} GB/s), x prepared in {:.2} us{} [{}]",
            single * 1e6,
            gb / single,
            per_token * 1e6,
            parallel * 1e6,
            gb / parallel,
            prepare * 1e6,
            if prepared.uses_integer_kernel(dtype) { " (integer kernel)" } else { "" },
            sink.is_finite()
        );
    }
    Ok(())
}
