//! The float64 reference of causal grouped-query attention over a paged KV cache: the oracle of
//! the prefill and decode kernels.
//!
//! Layouts (row-major, every index in elements):
//!
//! ```text
//! q, out   [query_token][q_head][d]       query_token in [0, sum of query_tokens): the
//!                                         sequences' query tokens one after another
//! K, V     [page][kv_head][slot][d]       as kiln_engine::kv::KvLayout: one layer's buffer
//! ```
//!
//! Sequence `b` holds `context_tokens` positions in its pages (`pages[i]` holds positions
//! `[i * page_tokens, (i + 1) * page_tokens)`); its last `query_tokens` positions are the queries
//! (the chunk being prefilled, or the one token being decoded), so query `i` sits at position
//! `context_tokens - query_tokens + i` and attends causally to positions `0..=` that. A fresh
//! prefill has `query_tokens == context_tokens`; a chunk after `c` cached positions has
//! `context_tokens = c + query_tokens`; decode has `query_tokens == 1`. Query head `h` reads KV head
//! `h / (q_heads / kv_heads)`.

use crate::{Error, Result};

/// Heads, head size and softmax scale of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions per KV page.
    pub page_tokens: usize,
    /// Multiplies q·k before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl AttentionShape {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// Checks the shape: heads nonzero, `q_heads` a multiple of `kv_heads`, a power-of-two page.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: usize, reason: &str| {
            Err(Error::InvalidArgument { name, value: value.to_string(), reason: reason.into() })
        };
        if self.kv_heads == 0 || self.head_dim == 0 {
            return bad("kv_heads", self.kv_heads, "attention needs heads of nonzero size");
        }
        if self.q_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad("q_heads", self.q_heads, "must be a nonzero multiple of kv_heads");
        }
        if !self.page_tokens.is_power_of_two() {
            return bad("page_tokens", self.page_tokens, "must be a power of two");
        }
        Ok(())
    }
}

/// One sequence of an attention call (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSequence<'a> {
    pub query_tokens: usize,
    pub context_tokens: usize,
    /// The sequence's page table: at least `context_tokens.div_ceil(page_tokens)` pages.
    pub pages: &'a [u32],
}

/// Checks `sequences` against the shape and a cache of `cache_elements` per buffer; returns the
/// total query tokens.
pub fn validate_sequences(
    shape: &AttentionShape,
    sequences: &[AttentionSequence<'_>],
    cache_elements: usize,
) -> Result<usize> {
    shape.validate()?;
    let page_elements = shape.kv_heads * shape.page_tokens * shape.head_dim;
    let cache_pages = cache_elements / page_elements;
    let mut total = 0;
    for (b, s) in sequences.iter().enumerate() {
        if s.query_tokens > s.context_tokens {
            return Err(Error::InvalidArgument {
                name: "query_tokens",
                value: s.query_tokens.to_string(),
                reason: format!("sequence {b} holds only {} positions", s.context_tokens),
            });
        }
        let needed = s.context_tokens.div_ceil(shape.page_tokens);
        if s.pages.len() < needed {
            return Err(Error::OutOfBounds {
                op: "attention",
                what: "page table entries needed",
                value: needed as u64,
                limit: s.pages.len() as u64,
            });
        }
        if let Some(&page) = s.pages[..needed].iter().find(|&&p| p as usize >= cache_pages) {
            return Err(Error::OutOfBounds {
                op: "attention",
                what: "page id",
                value: u64::from(page),
                limit: cache_pages as u64,
            });
        }
        total += s.query_tokens;
    }
    Ok(total)
}

/// Causal GQA attention in float64 over the paged cache; `k_cache` and `v_cache` hold the values
/// (already rounded to the cache's type). Returns `out` in the layout of `q`.
pub fn paged_attention(
    shape: &AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    sequences: &[AttentionSequence<'_>],
) -> Result<Vec<f64>> {
    let total = validate_sequences(shape, sequences, k_cache.len().min(v_cache.len()))?;
    let (hq, dim) = (shape.q_heads, shape.head_dim);
    if q.len() != total * hq * dim {
        return Err(Error::ShapeMismatch {
            op: "attention q",
            expected: vec![total, hq, dim],
            got: vec![q.len()],
        });
    }
    let p = shape.page_tokens;
    let offset = |pages: &[u32], kv_head: usize, position: usize| {
        ((pages[position / p] as usize * shape.kv_heads + kv_head) * p + position % p) * dim
    };
    let mut out = vec![0f64; q.len()];
    let mut scores = Vec::new();
    let mut row = 0;
    for s in sequences {
        for i in 0..s.query_tokens {
            let position = s.context_tokens - s.query_tokens + i;
            for h in 0..hq {
                let kv_head = h / shape.group();
                let qv = &q[(row * hq + h) * dim..][..dim];
                scores.clear();
                for j in 0..=position {
                    let k = &k_cache[offset(s.pages, kv_head, j)..][..dim];
                    let dot: f64 = qv.iter().zip(k).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                    scores.push(dot * f64::from(shape.scale));
                }
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let mut total_weight = 0.0;
                let o = &mut out[(row * hq + h) * dim..][..dim];
                for (j, &score) in scores.iter().enumerate() {
                    let w = (score - max).exp();
                    total_weight += w;
                    let v = &v_cache[offset(s.pages, kv_head, j)..][..dim];
                    for (o, &v) in o.iter_mut().zip(v) {
                        *o += w * f64::from(v);
                    }
                }
                o.iter_mut().for_each(|o| *o /= total_weight);
            }
            row += 1;
        }
    }
    Ok(out)
}

/// KV cache rows in FP8 E4M3 with a scale per row: each (page, kv head, slot) row of `head_dim`
/// values is stored as E4M3 codes of `x / scale` (to nearest even, saturating, as
/// [`f32_to_e4m3`](crate::ops::quantize::f32_to_e4m3)) beside one fp32 `scale = amax / 448`
/// (`amax` the row's largest `|x|`, NaN ignored), half the bytes of bf16 rows plus 4 bytes a row.
/// A row of zeros has scale 0 and zero codes (the codes of `x` itself, with its signs). Appending
/// a token writes its own rows only, so no earlier row is ever quantized again.
pub fn kv_fp8_row(row: &[f32], codes: &mut [u8]) -> Result<f32> {
    if codes.len() != row.len() {
        return Err(Error::ShapeMismatch {
            op: "kv_fp8_row codes",
            expected: vec![row.len()],
            got: vec![codes.len()],
        });
    }
    let scale = crate::ops::quantize::block_amax(row) / crate::ops::quantize::E4M3_MAX;
    for (code, &x) in codes.iter_mut().zip(row) {
        *code = crate::ops::quantize::f32_to_e4m3(if scale > 0.0 { x / scale } else { x });
    }
    Ok(scale)
}

/// The value of an FP8 KV code with its row's scale, as the attention reference reads it: the
/// exact E4M3 value times the scale, rounded once to fp32.
pub fn kv_fp8_value(code: u8, scale: f32) -> f32 {
    crate::ops::quantize::e4m3_to_f32(code) * scale
}

/// A whole cache in FP8 rows (`[page][kv_head][slot][head_dim]` values in, codes of the same
/// layout and one scale per row out, `[page][kv_head][slot]`), and the values the reference reads
/// back ([`kv_fp8_value`]).
pub fn kv_fp8_cache(values: &[f32], head_dim: usize) -> Result<(Vec<u8>, Vec<f32>, Vec<f32>)> {
    if head_dim == 0 || !values.len().is_multiple_of(head_dim) {
        return Err(Error::InvalidArgument {
            name: "head_dim",
            value: head_dim.to_string(),
            reason: format!("does not divide the cache's {} values", values.len()),
        });
    }
    let mut codes = vec![0u8; values.len()];
    let mut scales = Vec::with_capacity(values.len() / head_dim);
    let mut read_back = Vec::with_capacity(values.len());
    for (row, out) in values.chunks_exact(head_dim).zip(codes.chunks_exact_mut(head_dim)) {
        let scale = kv_fp8_row(row, out)?;
        scales.push(scale);
        read_back.extend(out.iter().map(|&c| kv_fp8_value(c, scale)));
    }
    Ok((codes, scales, read_back))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(q_heads: usize, kv_heads: usize, head_dim: usize, page_tokens: usize) -> AttentionShape {
        AttentionShape { q_heads, kv_heads, head_dim, page_tokens, scale: 0.5 }
    }

    #[test]
    fn one_position_returns_its_value_and_equal_keys_average() {
        // One KV head, dim 2, page of 2; positions 0 and 1 in page 1, page 0 unused.
        let s = shape(2, 1, 2, 2);
        let k = [9.0, 9.0, 9.0, 9.0, 1.0, 0.0, 1.0, 0.0];
        let v = [7.0, 7.0, 7.0, 7.0, 2.0, 4.0, 6.0, -4.0];
        let pages = [1u32];
        let q = [1.0, 1.0, -3.0, 0.5, 1.0, 1.0, -3.0, 0.5];
        let seqs = [AttentionSequence { query_tokens: 2, context_tokens: 2, pages: &pages }];
        let out = paged_attention(&s, &q, &k, &v, &seqs).unwrap();
        // Query 0 sees position 0 only; query 1 sees two equal keys: the mean of the values.
        assert_eq!(&out[..4], &[2.0, 4.0, 2.0, 4.0]);
        assert_eq!(&out[4..], &[4.0, 0.0, 4.0, 0.0]);
    }

    #[test]
    fn softmax_weights_follow_the_scores() {
        let s = shape(1, 1, 1, 4);
        let (k, v) = ([0.0, 2.0, 0.0, 0.0], [1.0, 3.0, 0.0, 0.0]);
        let pages = [0u32];
        // Decode at position 1 with q = 1: scores 0 and 1 (scale 0.5 * 2).
        let seqs = [AttentionSequence { query_tokens: 1, context_tokens: 2, pages: &pages }];
        let out = paged_attention(&s, &[1.0], &k, &v, &seqs).unwrap();
        let w = 1f64.exp();
        assert!((out[0] - (1.0 + 3.0 * w) / (1.0 + w)).abs() < 1e-15);
    }

    #[test]
    fn fp8_rows_keep_the_largest_value_and_round_the_rest_to_e4m3() {
        let row = [0.0f32, -3.0, 1.5, 0.001, 2.9, -0.0, 0.75, 100.0];
        let mut codes = [0u8; 8];
        let scale = kv_fp8_row(&row, &mut codes).unwrap();
        assert_eq!(scale, 100.0 / 448.0);
        // The largest value is 448 times the scale: its code is E4M3's largest.
        assert_eq!(codes[7], 0x7E);
        for (&x, &c) in row.iter().zip(&codes) {
            let back = kv_fp8_value(c, scale);
            // E4M3 keeps 3 bits: within 1/16 relative, or the subnormal step 2^-9 times the scale.
            assert!((back - x).abs() <= x.abs() / 16.0 + scale / 512.0, "{x} came back as {back}");
            assert_eq!(back.is_sign_negative(), x.is_sign_negative(), "{x} lost its sign");
        }
        // A row of zeros: scale 0, codes of the values themselves (signed zeros).
        let zeros = [0.0f32, -0.0, 0.0];
        let mut codes = [9u8; 3];
        assert_eq!(kv_fp8_row(&zeros, &mut codes).unwrap(), 0.0);
        assert_eq!(codes, [0x00, 0x80, 0x00]);
        // NaN is ignored by the maximum and stays NaN.
        let mut codes = [0u8; 2];
        let scale = kv_fp8_row(&[f32::NAN, 2.0], &mut codes).unwrap();
        assert_eq!(scale, 2.0 / 448.0);
        assert!(kv_fp8_value(codes[0], scale).is_nan());
        assert_eq!(kv_fp8_value(codes[1], scale), 2.0);
        assert!(matches!(kv_fp8_row(&[1.0], &mut [0u8; 2]), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(kv_fp8_cache(&[1.0; 6], 4), Err(Error::InvalidArgument { .. })));
    }

    #[test]
    fn fp8_cache_rows_are_quantized_one_by_one() {
        let values: Vec<f32> = (0..24).map(|i| ((i * 7919) % 23) as f32 - 11.0).collect();
        let (codes, scales, back) = kv_fp8_cache(&values, 8).unwrap();
        assert_eq!((codes.len(), scales.len(), back.len()), (24, 3, 24));
        for r in 0..3 {
            let mut row_codes = [0u8; 8];
            let scale = kv_fp8_row(&values[r * 8..][..8], &mut row_codes).unwrap();
            assert_eq!(scales[r], scale);
            assert_eq!(&codes[r * 8..][..8], &row_codes);
        }
    }

    #[test]
    fn bad_calls_are_named() {
        let pages = [0u32, 5];
        let seqs = [AttentionSequence { query_tokens: 1, context_tokens: 5, pages: &pages }];
        let cache = vec![0.0; 4 * 2 * 4];
        let err = paged_attention(&shape(2, 1, 2, 4), &[0.0; 4], &cache, &cache, &seqs).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { what: "page id", value: 5, limit: 4, .. }), "{err}");
        assert!(matches!(shape(3, 2, 2, 4).validate(), Err(Error::InvalidArgument { name: "q_heads", .. })));
        let seqs = [AttentionSequence { query_tokens: 3, context_tokens: 2, pages: &pages }];
        assert!(paged_attention(&shape(1, 1, 2, 4), &[0.0; 6], &cache, &cache, &seqs).is_err());
    }
}
