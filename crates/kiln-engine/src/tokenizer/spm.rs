//! SentencePiece-style BPE over characters, as llama.cpp runs the `llama` vocabularies of GGUF
//! files (Llama 2, Mistral, TinyLlama): no merge list, only scores.
//!
//! The text (spaces already written as `▁`) starts as one symbol per character. Every adjacent
//! pair whose concatenation is a token is a candidate; the candidate whose token has the highest
//! score is merged first (ties: the leftmost), and the new neighbours become candidates. When no
//! candidate is left, each symbol is its token, or, when it is not one, its UTF-8 bytes as the
//! byte tokens `<0xNN>` (the unknown token where the vocabulary has no byte token).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use kiln_core::{Error, Result};

/// The vocabulary a [`SentencePiece`] encoder needs.
pub(crate) struct SentencePiece {
    token_to_id: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The token of each byte value, from the `<0xNN>` byte tokens.
    byte_ids: [Option<u32>; 256],
    unk_id: Option<u32>,
}

/// One symbol of the text being merged: a byte range, linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` (adjacent when it was made) into a token.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The greatest bigram is merged first: the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl SentencePiece {
    pub(crate) fn new(
        token_to_id: HashMap<String, u32>,
        scores: Vec<f32>,
        byte_ids: [Option<u32>; 256],
        unk_id: Option<u32>,
    ) -> SentencePiece {
        SentencePiece { token_to_id, scores, byte_ids, unk_id }
    }

    /// Appends the tokens of `text` (spaces already escaped as `▁`) to `out`.
    pub(crate) fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }

        let mut queue = BinaryHeap::new();
        for right in 1..symbols.len() {
            self.push_bigram(text, &symbols, Some(right - 1), Some(right), &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            // A bigram made before one of its symbols merged elsewhere is stale.
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.len {
                continue;
            }
            symbols[bigram.left].len += right.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = right.next;
            if let Some(next) = right.next {
                symbols[next].prev = Some(bigram.left);
            }
            self.push_bigram(text, &symbols, left.prev, Some(bigram.left), &mut queue);
            self.push_bigram(text, &symbols, Some(bigram.left), right.next, &mut queue);
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let symbol = symbols[i];
            let piece = &text[symbol.start..symbol.start + symbol.len];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece.as_bytes() {
                        out.push(self.byte_token(byte)?);
                    }
                }
            }
            at = symbol.next;
        }
        Ok(())
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: Option<usize>,
        right: Option<usize>,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (Some(left), Some(right)) = (left, right) else { return };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(&id) = self.token_to_id.get(piece) {
            let score = self.scores.get(id as usize).copied().unwrap_or(0.0);
            queue.push(Bigram { score, left, right, len: piece.len() });
        }
    }

    fn byte_token(&self, byte: u8) -> Result<u32> {
        self.byte_ids[byte as usize].or(self.unk_id).ok_or_else(|| Error::Tokenizer {
            reason: format!(
                "byte 0x{byte:02X} has no token: the vocabulary has no byte token <0x{byte:02X}> \
                 and no unknown token"
            ),
        })
    }
}

/// Parses the byte token text `<0xNN>` (two hex digits, either case) into its byte.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
