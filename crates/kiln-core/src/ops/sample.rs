//! The sampler's CPU reference: the specification the CUDA sampler (`kernels/sample.cu`) matches
//! token for token.
//!
//! The token depends only on the logits, the [`SamplingParams`], the history, and the counter
//! `(seed, step, stream)`: never on a summation order, a grid, a batch or a device. Every step
//! below is either an integer computation (exact in any order) or one correctly rounded fp32
//! operation written the same way on both sides.
//!
//! # The algorithm
//!
//! Notation: `V` logits `l[0..V]`; `key(x)` is the order key of a float (below).
//!
//! 1. **Penalties** (Hugging Face / llama.cpp semantics). For each token `t` occurring `c >= 1`
//!    times in the history, in fp32, each operation rounded once:
//!    `x = l[t] > 0 ? l[t] / repetition : l[t] * repetition`, then
//!    `x = x - ((c as f32 * frequency) + presence)`. Other tokens keep `x = l[t]`. With the
//!    default parameters (1, 0, 0) this is the identity.
//! 2. **Order.** Tokens are ranked by `key(x)` descending, ties by index ascending. `key` maps
//!    the float bits to `u32` monotonically: NaN to 0 (below `-inf`), `-0.0` to the key of
//!    `+0.0`, otherwise `bits ^ 0x8000_0000` for a clear sign bit and `!bits` for a set one.
//!    NaN tokens are never candidates. If every logit is NaN there is no token
//!    ([`Error::InvalidArgument`] here, [`NO_TOKEN`] on the GPU).
//! 3. **Greedy** (`temperature == 0`): the first token in this order (argmax, ties to the lowest
//!    index). Top-k, top-p, min-p and the seed are ignored.
//! 4. **Weights** (`temperature > 0`): `z = clamp(x / T)` where the division is correctly
//!    rounded and `clamp` maps `+-inf` to `+-f32::MAX`; `m = clamp(x[g] / T)` for the greedy
//!    token `g`, the largest `z`; `w = trunc(exp_poly(z - m) * 2^31)` as `u32`, with
//!    [`exp_poly`] the shared FMA polynomial. The greedy token has weight exactly `2^31`.
//! 5. **Top-k** (`top_k > 0`): the cutoff is the `k`-th token of the order (none if fewer than
//!    `k` candidates). A cutoff is a pair `(key, index)`: token `i` is within it when
//!    `key(x_i) > key`, or `key(x_i) == key` and `i <= index`.
//! 6. **Top-p** (`top_p < 1`): `M` is the sum (`u64`) of the weights within the top-k cutoff,
//!    `p_units = round(top_p * 2^24)`, `target = max(1, ceil(M * p_units / 2^24))` (exact, in
//!    128 bits). The cutoff becomes the first token of the order whose inclusive cumulative
//!    weight reaches `target`: every token whose exclusive cumulative weight is below `target`
//!    is kept, the tail is not.
//! 7. **Min-p** (`min_p > 0`): `min_units = round(min_p * 2^24)`; a token is dropped when
//!    `w < min_units * 2^7`, which is `w / 2^31 < min_units / 2^24` in exact arithmetic.
//! 8. **Draw.** The kept tokens' weights sum to `M'` (`u64`, at least `2^31`). A 64-bit uniform
//!    `u` comes from Philox4x32-10 with key `(seed_lo, seed_hi)` and counter
//!    `(step_lo, step_hi, stream_lo, stream_hi)`: `u = out[0] | out[1] << 32`. Then
//!    `r = (u * M') >> 64` (128-bit product), and the token is the first kept index `i`, in
//!    *index* order, whose inclusive prefix sum of kept weights exceeds `r`.
//!
//! Top-k and top-p cutoffs are found by radix selection on the order keys, 8 bits per pass,
//! counting tokens (top-k) or summing weights (top-p) per digit; the tie at the final key is
//! resolved by index. Nothing sorts the vocabulary.
//!
//! `stream` distinguishes several samples drawn with one seed at one step (sequence 0, 1, ... of
//! a request); Kiln passes a sequence's own stream number, not its slot in a batch, so a
//! sequence draws the same tokens in any batch.

use crate::error::{Error, Result};
use crate::ops::primitives::exp_poly;

/// The token the GPU sampler writes when a row has no candidate (every logit NaN).
pub const NO_TOKEN: u32 = u32::MAX;

/// Fixed-point scale of a weight: the greedy token weighs `2^WEIGHT_BITS`.
pub const WEIGHT_BITS: u32 = 31;

/// Fixed-point scale of `top_p` and `min_p`: `2^PROBABILITY_BITS` units.
pub const PROBABILITY_BITS: u32 = 24;

/// How one row is sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy; otherwise the logits are divided by it. Finite, `>= 0`.
    pub temperature: f32,
    /// Keep the `top_k` best tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the smallest prefix of the order holding this share of the mass; in `(0, 1]`.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the best one's; in `[0, 1]`.
    pub min_p: f32,
    /// Divides positive and multiplies negative logits of tokens in the history; finite, `> 0`.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token in the history; finite.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the history; finite.
    pub frequency_penalty: f32,
    /// The generator's key.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Plain sampling at temperature 1 with every filter and penalty off.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, no penalties.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Whether the token is the argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether any penalty changes a logit.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// `round(top_p * 2^24)`, in `[0, 2^24]` for a valid `top_p`.
    pub fn top_p_units(&self) -> u64 {
        probability_units(self.top_p)
    }

    /// `round(min_p * 2^24)`, in `[0, 2^24]` for a valid `min_p`.
    pub fn min_p_units(&self) -> u64 {
        probability_units(self.min_p)
    }

    /// Checks every field's range; the error names the field and its value.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, value: f32, reason: &str| Error::InvalidArgument {
            name,
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(bad("temperature", self.temperature, "must be finite and >= 0 (0 is greedy)"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "must be in (0, 1] (1 keeps every token)"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(bad("min_p", self.min_p, "must be in [0, 1] (0 keeps every token)"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be finite and > 0 (1 is off)",
            ));
        }
        if !self.presence_penalty.is_finite() {
            return Err(bad("presence_penalty", self.presence_penalty, "must be finite (0 is off)"));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(bad("frequency_penalty", self.frequency_penalty, "must be finite (0 is off)"));
        }
        Ok(())
    }
}

fn probability_units(p: f32) -> u64 {
    // Exact: scaling by a power of two, then rounding to an integer in [0, 2^24].
    (p * (1u32 << PROBABILITY_BITS) as f32).round() as u64
}

/// The order key of a float: monotone in the value, NaN lowest (0), `-0.0` equal to `+0.0`.
pub fn order_key(x: f32) -> u32 {
    if x.is_nan() {
        return 0;
    }
    let bits = if x == 0.0 { 0 } else { x.to_bits() };
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// The logit of a token after the penalties, for a token seen `count >= 1` times.
pub fn penalized(logit: f32, count: u32, params: &SamplingParams) -> f32 {
    let x = if logit > 0.0 { logit / params.repetition_penalty } else { logit * params.repetition_penalty };
    x - ((count as f32 * params.frequency_penalty) + params.presence_penalty)
}

/// Applies the penalties of step 1 to a copy of `logits`.
///
/// Fails with `InvalidArgument` on a history token outside the vocabulary.
pub fn apply_penalties(logits: &[f32], params: &SamplingParams, history: &[u32]) -> Result<Vec<f32>> {
    let mut x = logits.to_vec();
    if history.is_empty() || !params.has_penalties() {
        if let Some(&t) = history.iter().find(|&&t| t as usize >= logits.len()) {
            return Err(history_token_error(t, logits.len()));
        }
        return Ok(x);
    }
    let mut sorted = history.to_vec();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        let t = run[0] as usize;
        if t >= logits.len() {
            return Err(history_token_error(run[0], logits.len()));
        }
        let count = u32::try_from(run.len()).unwrap_or(u32::MAX);
        x[t] = penalized(logits[t], count, params);
    }
    Ok(x)
}

fn history_token_error(token: u32, vocab: usize) -> Error {
    Error::InvalidArgument {
        name: "history",
        value: token.to_string(),
        reason: format!("token id is outside the vocabulary of {vocab}"),
    }
}

/// The greedy token: the largest order key, ties to the lowest index; `None` if all are NaN.
pub fn argmax(x: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, usize)> = None;
    for (i, &v) in x.iter().enumerate() {
        let k = order_key(v);
        if k != 0 && best.is_none_or(|(bk, _)| k > bk) {
            best = Some((k, i));
        }
    }
    best.map(|(_, i)| i as u32)
}

/// `x / temperature` with infinities clamped to `+-f32::MAX` (`x` not NaN).
pub fn scaled_logit(x: f32, temperature: f32) -> f32 {
    (x / temperature).clamp(-f32::MAX, f32::MAX)
}

/// The fixed-point weight of a scaled logit `z` below the maximum `m`: `trunc(exp(z - m) * 2^31)`.
pub fn weight(z: f32, m: f32) -> u32 {
    (exp_poly(z - m) * (1u64 << WEIGHT_BITS) as f32) as u32
}

/// A prefix of the order: token `i` is within it when `key_i > key`, or `key_i == key` and
/// `i <= index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cutoff {
    /// The order key of the last token within the prefix.
    pub key: u32,
    /// The index of the last token within the prefix.
    pub index: u32,
}

impl Cutoff {
    /// Whether a token of order key `key` and index `index` is within the prefix.
    pub fn admits(&self, key: u32, index: u32) -> bool {
        key > self.key || (key == self.key && index <= self.index)
    }
}

/// What the filters leave of a row: the specification's intermediate state, compared field by
/// field with the GPU in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidates {
    /// Weight of each token; 0 for a token outside the candidates.
    pub weights: Vec<u32>,
    /// The top-k / top-p cutoff, if either filter removed anything.
    pub cutoff: Option<Cutoff>,
    /// The smallest weight min-p keeps (0 when min-p is off).
    pub min_weight: u32,
    /// The sum of `weights`.
    pub mass: u64,
}

/// Applies steps 4 to 7 to penalized logits `x` (sampling mode, `temperature > 0`).
pub fn candidates(x: &[f32], params: &SamplingParams) -> Result<Candidates> {
    let g = argmax(x).ok_or_else(all_nan_error)? as usize;
    let t = params.temperature;
    let m = scaled_logit(x[g], t);
    let keys: Vec<u32> = x.iter().map(|&v| order_key(v)).collect();
    let full_weight = |i: usize| if keys[i] == 0 { 0 } else { weight(scaled_logit(x[i], t), m) };

    let candidates_count = keys.iter().filter(|&&k| k != 0).count() as u64;
    let mut cutoff = None;
    if params.top_k > 0 && u64::from(params.top_k) < candidates_count {
        cutoff = radix_select(&keys, |_| true, |_| 1, u64::from(params.top_k));
    }
    let within = |c: Option<Cutoff>, i: usize| keys[i] != 0 && c.is_none_or(|c| c.admits(keys[i], i as u32));

    if params.top_p < 1.0 {
        let mass: u64 = (0..x.len()).filter(|&i| within(cutoff, i)).map(|i| u64::from(full_weight(i))).sum();
        let target = top_p_target(mass, params.top_p_units());
        let top_k = cutoff;
        cutoff = radix_select(&keys, |i| within(top_k, i), |i| u64::from(full_weight(i)), target);
    }

    let min_weight =
        u32::try_from(params.min_p_units() << (WEIGHT_BITS - PROBABILITY_BITS)).unwrap_or(u32::MAX);
    let mut weights = vec![0u32; x.len()];
    let mut mass = 0u64;
    for (i, w) in weights.iter_mut().enumerate() {
        if within(cutoff, i) {
            let full = full_weight(i);
            if full >= min_weight {
                *w = full;
                mass += u64::from(full);
            }
        }
    }
    Ok(Candidates { weights, cutoff, min_weight, mass })
}

/// `max(1, ceil(mass * p_units / 2^24))`, exact.
pub fn top_p_target(mass: u64, p_units: u64) -> u64 {
    let product = u128::from(mass) * u128::from(p_units);
    let target = (product + ((1u128 << PROBABILITY_BITS) - 1)) >> PROBABILITY_BITS;
    (target as u64).max(1)
}

/// Radix selection: the first token, in the order, at which the running sum of `amount` over
/// the `eligible` tokens reaches `target`; `None` if the total is below `target`.
///
/// Four passes over the keys' bytes, high to low, each a 256-bin histogram of `amount` over
/// the eligible tokens whose key matches the digits chosen so far; then the tie at the chosen
/// key is resolved by index.
fn radix_select(
    keys: &[u32],
    eligible: impl Fn(usize) -> bool,
    amount: impl Fn(usize) -> u64,
    target: u64,
) -> Option<Cutoff> {
    let mut prefix = 0u32;
    let mut above = 0u64; // amount of eligible tokens with a key above every candidate key
    for shift in [24u32, 16, 8, 0] {
        let high_mask = if shift == 24 { 0 } else { u32::MAX << (shift + 8) };
        let mut bins = [0u64; 256];
        for (i, &k) in keys.iter().enumerate() {
            if k != 0 && k & high_mask == prefix && eligible(i) {
                bins[((k >> shift) & 0xFF) as usize] += amount(i);
            }
        }
        let mut digit = None;
        for b in (0..256).rev() {
            if above + bins[b] >= target {
                digit = Some(b as u32);
                break;
            }
            above += bins[b];
        }
        prefix |= digit? << shift;
    }
    let mut running = above;
    for (i, &k) in keys.iter().enumerate() {
        if k == prefix && eligible(i) {
            running += amount(i);
            if running >= target {
                return Some(Cutoff { key: prefix, index: i as u32 });
            }
        }
    }
    None
}

/// Philox4x32-10 (Salmon et al., 2011), as in Random123.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The 64-bit uniform of `(seed, step, stream)` (step 8).
pub fn uniform_u64(seed: u64, step: u64, stream: u64) -> u64 {
    let out = philox4x32_10(
        [step as u32, (step >> 32) as u32, stream as u32, (stream >> 32) as u32],
        [seed as u32, (seed >> 32) as u32],
    );
    u64::from(out[0]) | (u64::from(out[1]) << 32)
}

/// Step 8: the first index whose inclusive prefix sum of `weights` exceeds `(u * mass) >> 64`.
pub fn draw(weights: &[u32], mass: u64, u: u64) -> Option<u32> {
    let r = ((u128::from(u) * u128::from(mass)) >> 64) as u64;
    let mut running = 0u64;
    for (i, &w) in weights.iter().enumerate() {
        running += u64::from(w);
        if running > r {
            return Some(i as u32);
        }
    }
    None
}

fn all_nan_error() -> Error {
    Error::InvalidArgument {
        name: "logits",
        value: "NaN".to_string(),
        reason: "every logit is NaN, no token can be chosen".to_string(),
    }
}

/// Samples one token from `logits` (see the module docs for the exact algorithm).
///
/// `history` is the sequence's tokens so far (for the penalties), `step` its position counter
/// and `stream` its sample stream under `params.seed`.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    history: &[u32],
    step: u64,
    stream: u64,
) -> Result<u32> {
    params.validate()?;
    if logits.is_empty() || logits.len() >= NO_TOKEN as usize {
        return Err(Error::InvalidArgument {
            name: "logits",
            value: format!("{} tokens", logits.len()),
            reason: format!("the vocabulary must hold 1 to {} tokens", NO_TOKEN - 1),
        });
    }
    let x = apply_penalties(logits, params, history)?;
    if params.is_greedy() {
        return argmax(&x).ok_or_else(all_nan_error);
    }
    let c = candidates(&x, params)?;
    draw(&c.weights, c.mass, uniform_u64(params.seed, step, stream)).ok_or_else(all_nan_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// SplitMix64, for test inputs only.
    struct TestRng(u64);

    impl TestRng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
            lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
        }
    }

    #[test]
    fn philox_matches_random123_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn order_key_is_monotone_with_nan_lowest_and_one_zero() {
        let values = [
            f32::NEG_INFINITY,
            -f32::MAX,
            -1.5,
            -f32::MIN_POSITIVE,
            -f32::from_bits(1),
            0.0,
            f32::from_bits(1),
            f32::MIN_POSITIVE,
            1.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for pair in values.windows(2) {
            assert!(order_key(pair[0]) < order_key(pair[1]), "{} vs {}", pair[0], pair[1]);
        }
        assert_eq!(order_key(f32::NAN), 0);
        assert_eq!(order_key(f32::from_bits(0xFFFF_FFFF)), 0);
        assert!(order_key(f32::NEG_INFINITY) > 0);
        assert_eq!(order_key(-0.0), order_key(0.0));
    }

    #[test]
    fn weights_are_fixed_point_exponentials() {
        assert_eq!(weight(3.25, 3.25), 1 << 31);
        assert_eq!(weight(-f32::MAX, f32::MAX), 0);
        for d in [-0.001f32, -0.5, -1.0, -3.7, -10.0, -20.0] {
            let want = (d as f64).exp() * 2f64.powi(31);
            let got = weight(d, 0.0) as f64;
            assert!((got - want).abs() <= want * 1e-6 + 1.0, "d = {d}: {got} vs {want}");
        }
        assert_eq!(weight(-30.0, 0.0), 0);
    }

    #[test]
    fn penalties_follow_the_reference_semantics() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 1.0,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        };
        // token 0 seen 3 times, token 2 once, token 1 never.
        let x = apply_penalties(&[2.0, 5.0, -2.0, 0.0], &p, &[0, 2, 0, 0]).unwrap();
        assert_eq!(x, vec![2.0 / 2.0 - (3.0 * 0.5 + 1.0), 5.0, -2.0 * 2.0 - (0.5 + 1.0), 0.0]);
        let off = SamplingParams::default();
        assert_eq!(apply_penalties(&[1.0, -1.0], &off, &[0, 1, 1]).unwrap(), vec![1.0, -1.0]);
    }

    fn invalid_name(r: Result<u32>) -> &'static str {
        match r {
            Err(Error::InvalidArgument { name, .. }) => name,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_arguments_are_named_errors() {
        let l = [0.0f32, 1.0];
        let d = SamplingParams::default();
        let cases: [(SamplingParams, &str); 9] = [
            (SamplingParams { temperature: -1.0, ..d }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..d }, "temperature"),
            (SamplingParams { top_p: 0.0, ..d }, "top_p"),
            (SamplingParams { top_p: 1.5, ..d }, "top_p"),
            (SamplingParams { min_p: -0.1, ..d }, "min_p"),
            (SamplingParams { min_p: f32::NAN, ..d }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..d }, "repetition_penalty"),
            (SamplingParams { presence_penalty: f32::INFINITY, ..d }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::NAN, ..d }, "frequency_penalty"),
        ];
        for (p, name) in cases {
            assert_eq!(invalid_name(sample(&l, &p, &[], 0, 0)), name);
        }
        assert_eq!(invalid_name(sample(&[], &d, &[], 0, 0)), "logits");
        assert_eq!(invalid_name(sample(&[f32::NAN, f32::NAN], &d, &[], 0, 0)), "logits");
        assert_eq!(invalid_name(sample(&[f32::NAN], &SamplingParams::greedy(), &[], 0, 0)), "logits");
        assert_eq!(invalid_name(sample(&l, &d, &[2], 0, 0)), "history");
    }

    #[test]
    fn infinities_take_all_the_mass() {
        let l = [1.0, f32::INFINITY, 3.0, f32::INFINITY, f32::NAN];
        let mut seen = [0u32; 5];
        for step in 0..200 {
            seen[sample(&l, &SamplingParams::default(), &[], step, 0).unwrap() as usize] += 1;
        }
        assert_eq!(seen[0] + seen[2] + seen[4], 0);
        assert!(seen[1] > 50 && seen[3] > 50, "{seen:?}");
    }

    /// Argmax written independently: NaN never wins, ties go to the lowest index.
    fn reference_argmax(l: &[f32]) -> Option<u32> {
        let mut best: Option<usize> = None;
        for (i, &v) in l.iter().enumerate() {
            if !v.is_nan() && best.is_none_or(|b| v > l[b]) {
                best = Some(i);
            }
        }
        best.map(|i| i as u32)
    }

    /// Token indices sorted by value descending, ties by index; NaN left out.
    fn reference_order(x: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..x.len()).filter(|&i| !x[i].is_nan()).collect();
        order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
        order
    }

    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            8 => -20.0f32..20.0,
            4 => (-3i32..3).prop_map(|v| v as f32),
            1 => Just(f32::NAN),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(-0.0f32),
        ]
    }

    fn params() -> impl Strategy<Value = SamplingParams> {
        (
            prop_oneof![Just(0.0f32), 0.05f32..3.0],
            prop_oneof![Just(0u32), 1u32..40],
            prop_oneof![Just(1.0f32), 0.01f32..1.0],
            prop_oneof![Just(0.0f32), 0.0f32..1.0],
            prop_oneof![Just(1.0f32), 0.5f32..2.0],
            -1.0f32..1.0,
            -1.0f32..1.0,
            any::<u64>(),
        )
            .prop_map(|(temperature, top_k, top_p, min_p, rep, presence, frequency, seed)| {
                SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repetition_penalty: rep,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    seed,
                }
            })
    }

    proptest! {
        #[test]
        fn greedy_is_the_argmax(l in prop::collection::vec(logit(), 1..300)) {
            let want = reference_argmax(&l);
            let got = sample(&l, &SamplingParams::greedy(), &[], 7, 0).ok();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn top_k_one_is_greedy(
            l in prop::collection::vec(logit(), 1..300),
            p in params(),
            step in any::<u64>(),
        ) {
            prop_assume!(l.iter().any(|v| !v.is_nan()));
            let history: Vec<u32> = (0..l.len() as u32).step_by(3).collect();
            let one = SamplingParams { top_k: 1, temperature: p.temperature.max(0.05), ..p };
            let greedy = SamplingParams { temperature: 0.0, ..p };
            prop_assert_eq!(
                sample(&l, &one, &history, step, 0).unwrap(),
                sample(&l, &greedy, &history, step, 0).unwrap()
            );
        }

        #[test]
        fn top_k_keeps_exactly_the_k_best(
            l in prop::collection::vec(logit(), 1..300),
            k in 1u32..50,
            temperature in 0.05f32..3.0,
        ) {
            prop_assume!(l.iter().any(|v| !v.is_nan()));
            let p = SamplingParams { top_k: k, temperature, ..SamplingParams::default() };
            let c = candidates(&l, &p).unwrap();
            let order = reference_order(&l);
            let kept = order.len().min(k as usize);
            for (rank, &i) in order.iter().enumerate() {
                let within = c.cutoff.is_none_or(|cut| cut.admits(order_key(l[i]), i as u32));
                prop_assert_eq!(within, rank < kept, "token {} at rank {}", i, rank);
                if rank >= kept {
                    prop_assert_eq!(c.weights[i], 0);
                }
            }
        }

        #[test]
        fn top_p_excludes_exactly_the_tail(
            l in prop::collection::vec(logit(), 1..300),
            top_p in 0.01f32..1.0,
            temperature in 0.05f32..3.0,
        ) {
            prop_assume!(l.iter().any(|v| !v.is_nan()));
            let plain = SamplingParams { temperature, ..SamplingParams::default() };
            let full = candidates(&l, &plain).unwrap();
            let c = candidates(&l, &SamplingParams { top_p, ..plain }).unwrap();
            let target = top_p_target(full.mass, plain_units(top_p));
            let mut before = 0u64;
            for &i in &reference_order(&l) {
                let keep = before < target;
                let within = c.cutoff.is_none_or(|cut| cut.admits(order_key(l[i]), i as u32));
                prop_assert_eq!(within, keep, "token {} with {} before, target {}", i, before, target);
                prop_assert_eq!(c.weights[i], if keep { full.weights[i] } else { 0 });
                before += u64::from(full.weights[i]);
            }
        }

        #[test]
        fn min_p_drops_exactly_the_light_tokens(
            l in prop::collection::vec(logit(), 1..300),
            min_p in 0.0f32..1.0,
            temperature in 0.05f32..3.0,
        ) {
            prop_assume!(l.iter().any(|v| !v.is_nan()));
            let plain = SamplingParams { temperature, ..SamplingParams::default() };
            let full = candidates(&l, &plain).unwrap();
            let c = candidates(&l, &SamplingParams { min_p, ..plain }).unwrap();
            let units = (f64::from(min_p) * 16_777_216.0).round();
            for i in 0..l.len() {
                let keep = f64::from(full.weights[i]) / 2f64.powi(31) >= units / 16_777_216.0;
                prop_assert_eq!(c.weights[i], if keep { full.weights[i] } else { 0 });
            }
        }

        #[test]
        fn the_token_is_a_candidate_and_reproducible(
            l in prop::collection::vec(logit(), 1..300),
            p in params(),
            step in any::<u64>(),
            stream in any::<u64>(),
        ) {
            prop_assume!(l.iter().any(|v| !v.is_nan()));
            let history: Vec<u32> = (0..l.len() as u32).rev().step_by(2).collect();
            let token = sample(&l, &p, &history, step, stream).unwrap();
            prop_assert_eq!(sample(&l, &p, &history, step, stream).unwrap(), token);
            prop_assert!(!l[token as usize].is_nan());
            if !p.is_greedy() {
                let x = apply_penalties(&l, &p, &history).unwrap();
                let c = candidates(&x, &p).unwrap();
                prop_assert!(c.weights[token as usize] > 0);
                prop_assert!(c.weights[argmax(&x).unwrap() as usize] == 1 << 31);
                prop_assert_eq!(c.mass, c.weights.iter().map(|&w| u64::from(w)).sum::<u64>());
            }
        }
    }

    fn plain_units(p: f32) -> u64 {
        (f64::from(p) * 16_777_216.0).round() as u64
    }

    /// The exact distribution of a mode, computed in f64 from the definitions (sorting freely).
    fn exact_distribution(l: &[f32], p: &SamplingParams, history: &[u32]) -> Vec<f64> {
        let mut x: Vec<f64> = l.iter().map(|&v| f64::from(v)).collect();
        for (t, xt) in x.iter_mut().enumerate() {
            let c = history.iter().filter(|&&h| h as usize == t).count() as f64;
            if c > 0.0 {
                let rep = f64::from(p.repetition_penalty);
                *xt = if *xt > 0.0 { *xt / rep } else { *xt * rep };
                *xt -= c * f64::from(p.frequency_penalty) + f64::from(p.presence_penalty);
            }
        }
        let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
        let mut prob: Vec<f64> = x.iter().map(|&v| ((v - max) / f64::from(p.temperature)).exp()).collect();
        if p.top_k > 0 {
            for &i in order.iter().skip(p.top_k as usize) {
                prob[i] = 0.0;
            }
        }
        let total: f64 = prob.iter().sum();
        let mut before = 0.0;
        for &i in &order {
            let share = prob[i] / total;
            if before >= f64::from(p.top_p) {
                prob[i] = 0.0;
            } else {
                assert!(
                    (before - f64::from(p.top_p)).abs() > 1e-3,
                    "top-p boundary too close to call: {before}"
                );
            }
            before += share;
        }
        let best = prob[order[0]];
        for v in prob.iter_mut() {
            let ratio = *v / best;
            assert!(*v == 0.0 || (ratio - f64::from(p.min_p)).abs() > 1e-3, "min-p boundary too close");
            if ratio < f64::from(p.min_p) {
                *v = 0.0;
            }
        }
        let total: f64 = prob.iter().sum();
        prob.iter().map(|v| v / total).collect()
    }

    /// Chi-square critical values at significance 0.001, by degrees of freedom 1..=20.
    const CHI2_CRITICAL_0_001: [f64; 20] = [
        10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264, 32.909,
        34.528, 36.123, 37.697, 39.252, 40.790, 42.312, 43.820, 45.315,
    ];

    /// Each mode's token frequencies over 40,000 draws (steps 0.., a fixed seed) match the exact
    /// distribution: chi-square at significance 0.001, and no draw outside its support.
    /// Deterministic: the logits, seeds and steps are fixed.
    #[test]
    fn frequencies_match_the_exact_distribution() {
        let mut rng = TestRng(0x5eed);
        let l: Vec<f32> = (0..16).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let history = [3u32, 3, 7, 11, 0];
        let d = SamplingParams { seed: 0x1234_5678_9abc_def0, ..SamplingParams::default() };
        let modes: [(&str, SamplingParams); 7] = [
            ("temperature 1", d),
            ("temperature 0.6", SamplingParams { temperature: 0.6, ..d }),
            ("top-k 5", SamplingParams { top_k: 5, temperature: 0.9, ..d }),
            ("top-p 0.7", SamplingParams { top_p: 0.7, ..d }),
            ("min-p 0.3", SamplingParams { min_p: 0.3, temperature: 1.3, ..d }),
            ("top-k 8 + top-p 0.8", SamplingParams { top_k: 8, top_p: 0.8, temperature: 0.8, ..d }),
            (
                "penalties",
                SamplingParams {
                    repetition_penalty: 1.3,
                    presence_penalty: 0.4,
                    frequency_penalty: 0.2,
                    temperature: 0.8,
                    ..d
                },
            ),
        ];
        let draws = 40_000u64;
        for (name, p) in modes {
            let expected = exact_distribution(&l, &p, &history);
            let mut counts = vec![0u64; l.len()];
            for step in 0..draws {
                counts[sample(&l, &p, &history, step, 0).unwrap() as usize] += 1;
            }
            let mut chi2 = 0.0;
            let mut categories = 0;
            for (i, (&e, &c)) in expected.iter().zip(&counts).enumerate() {
                if e == 0.0 {
                    assert_eq!(c, 0, "{name}: token {i} is outside the support but was drawn");
                    continue;
                }
                let want = e * draws as f64;
                assert!(want >= 5.0, "{name}: expected count {want} too small for chi-square");
                chi2 += (c as f64 - want).powi(2) / want;
                categories += 1;
            }
            assert!(categories >= 2, "{name}: the mode must leave a choice to test");
            let critical = CHI2_CRITICAL_0_001[categories - 2];
            assert!(
                chi2 < critical,
                "{name}: chi-square {chi2:.2} >= {critical} with {} dof",
                categories - 1
            );
        }
    }
}
