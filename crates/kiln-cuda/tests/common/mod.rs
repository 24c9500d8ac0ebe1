//! What the GPU tests share: the random source of their fresh inputs.
// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::time::{SystemTime, UNIX_EPOCH};

/// xorshift64*, seeded from the clock so every run draws new inputs (the seed is printed).
/// `KILN_TEST_SEED=0x...` replays a printed seed instead (run the one test that printed it: the
/// draws of a test follow from its seed alone). A test file adds the draws it needs in its own
/// `impl Rng` block.
pub struct Rng(pub u64);

/// The environment variable that replays a printed seed.
pub const SEED_ENV: &str = "KILN_TEST_SEED";

impl Rng {
    pub fn fresh() -> Rng {
        let seed = match std::env::var(SEED_ENV) {
            Ok(text) => {
                let t = text.trim();
                let parsed = match t.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16),
                    None => t.parse(),
                };
                match parsed {
                    Ok(seed) if seed != 0 => seed,
                    _ => panic!("{SEED_ENV}={text:?} is not a nonzero seed (as printed: 0x...)"),
                }
            }
            Err(_) => {
                let nanos =
                    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
                nanos | 1
            }
        };
        println!("seed {seed:#x}");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [lo, hi), 24 bits of resolution.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}
