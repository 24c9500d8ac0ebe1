//! Tokenizers: text to token ids and back, from GGUF metadata or a `tokenizer.json`.
//!
//! Two vocabulary kinds come from GGUF files:
//! - **byte-level BPE** (`tokenizer.ggml.model = "gpt2"`: GPT-2, Llama 3, Qwen 2, SmolLM): the text
//!   is split by the regexes of the pre-tokenizer named in `tokenizer.ggml.pre`, each piece's bytes
//!   are written as GPT-2's printable characters, and the merge list is applied in rank order. The
//!   `tokenizers` crate runs this, built from the GGUF vocabulary and merges.
//! - **SentencePiece-style BPE** (`"llama"`: Llama 2, Mistral): score-ordered merges over
//!   characters, spaces written as `▁`, bytes without a token as `<0xNN>` (see `spm`).
//!
//! A `tokenizer.json` (next to safetensors weights) loads through the `tokenizers` crate as is.
//!
//! Special tokens (control and user-defined tokens; the added tokens of a `tokenizer.json`) are
//! matched whole in the text, so `<|im_start|>` is one token. `add_special` only decides whether
//! the model's BOS/EOS are added around the text.
//!
//! Decoding goes through each token's bytes, so a [`TokenStream`] can hold back a UTF-8 sequence
//! split across byte tokens until it is complete.
//!
//! ```
//! use kiln_engine::tokenizer::{Tokenizer, TokenizerModel, TokenizerSpec};
//! let mut spec = TokenizerSpec::new(TokenizerModel::Gpt2, ["a", "b", "ab"].map(String::from).to_vec());
//! spec.merges = Some(vec!["a b".to_string()]);
//! spec.pre = Some("gpt-2".to_string());
//! let tokenizer = Tokenizer::from_spec(spec)?;
//! assert_eq!(tokenizer.encode("abba", false)?, vec![2, 1, 0]);
//! assert_eq!(tokenizer.decode(&[2, 1, 0])?, "abba");
//! # Ok::<(), kiln_core::Error>(())
//! ```

mod gguf;
mod json;
pub mod pretokenize;
mod spm;

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, MatchKind};
use kiln_core::{Error, Result};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use spm::{parse_byte_token, SentencePiece};

/// The vocabulary kinds of GGUF files (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerModel {
    /// Byte-level BPE with a merge list (`"gpt2"`).
    Gpt2,
    /// SentencePiece-style BPE with scores and `<0xNN>` byte tokens (`"llama"`).
    Llama,
}

impl TokenizerModel {
    /// The model named by `tokenizer.ggml.model`.
    pub fn from_gguf_name(name: &str) -> Result<TokenizerModel> {
        match name {
            "gpt2" => Ok(TokenizerModel::Gpt2),
            "llama" => Ok(TokenizerModel::Llama),
            other => Err(Error::Tokenizer {
                reason: format!(
                    "tokenizer model `{other}` (tokenizer.ggml.model) is not served; Kiln serves \
                     \"gpt2\" and \"llama\""
                ),
            }),
        }
    }
}

/// The GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    fn from_code(id: usize, code: i32) -> Result<TokenType> {
        Ok(match code {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => {
                return Err(Error::Tokenizer {
                    reason: format!("token {id} has token type {code}; known types are 0 to 6"),
                })
            }
        })
    }
}

/// Everything a tokenizer is built from, as GGUF metadata holds it (plain data, no validation:
/// [`Tokenizer::from_spec`] checks it).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`.
    pub model: TokenizerModel,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a byte-level BPE vocabulary; `None` means
    /// llama.cpp's "default" regexes.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the text of each token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: one per token (SentencePiece merge priority).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: one [`TokenType`] code per token.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs in rank order (byte-level BPE only).
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// End of turn (`tokenizer.ggml.eot_token_id`); ends generation like EOS.
    pub eot_id: Option<u32>,
    /// End of message (`tokenizer.ggml.eom_token_id`); ends generation like EOS.
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// Whether `encode(_, true)` puts BOS first.
    pub add_bos: bool,
    /// Whether `encode(_, true)` puts EOS last.
    pub add_eos: bool,
    /// SentencePiece: a space before the text and after each special token.
    pub add_space_prefix: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl TokenizerSpec {
    /// A spec with the given tokens and the defaults llama.cpp uses for `model` (a SentencePiece
    /// vocabulary adds BOS and a space prefix; a byte-level one adds neither).
    pub fn new(model: TokenizerModel, tokens: Vec<String>) -> TokenizerSpec {
        let sentencepiece = model == TokenizerModel::Llama;
        TokenizerSpec {
            model,
            pre: None,
            tokens,
            scores: None,
            token_types: None,
            merges: None,
            bos_id: None,
            eos_id: None,
            eot_id: None,
            eom_id: None,
            unk_id: None,
            pad_id: None,
            add_bos: sentencepiece,
            add_eos: false,
            add_space_prefix: sentencepiece,
            chat_template: None,
        }
    }
}

/// Texts of control tokens that end a turn in the chat formats Kiln knows; such a token ends
/// generation even when the metadata names another EOS (llama.cpp does the same).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
];

/// How ids are turned into text, and text into ids.
enum Encoder {
    /// Byte-level BPE built from a spec; BOS/EOS are added here, not by the crate.
    Bpe(Box<tokenizers::Tokenizer>),
    /// A `tokenizer.json`; its post-processor adds BOS/EOS.
    Json(Box<tokenizers::Tokenizer>),
    /// SentencePiece-style BPE, with the special tokens matched before it runs.
    SentencePiece {
        model: Box<SentencePiece>,
        specials: Option<(AhoCorasick, Vec<u32>)>,
        add_space_prefix: bool,
    },
}

/// A tokenizer: encodes text to token ids and decodes ids to text.
pub struct Tokenizer {
    encoder: Encoder,
    /// The bytes each token id decodes to.
    pieces: Vec<Vec<u8>>,
    /// Whether each id is a special token (matched whole in text; decoded as its text).
    special: Vec<bool>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// SentencePiece decoding drops the space the encoder put before the text.
    strip_first_space: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.pieces.len())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish_non_exhaustive()
    }
}

fn tokenizer_error(reason: impl Into<String>) -> Error {
    Error::Tokenizer { reason: reason.into() }
}

impl Tokenizer {
    /// Builds a tokenizer from a spec, checking every field: array lengths that disagree, ids out
    /// of range, duplicate tokens, merges of unknown tokens, malformed byte tokens, unknown
    /// pre-tokenizers are each an [`Error::Tokenizer`] naming the value.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(tokenizer_error("the vocabulary (tokenizer.ggml.tokens) is empty"));
        }
        if u32::try_from(n).is_err() {
            return Err(tokenizer_error(format!(
                "the vocabulary has {n} tokens, more than u32 ids can name"
            )));
        }
        if let Some(scores) = &spec.scores {
            if scores.len() != n {
                return Err(tokenizer_error(format!(
                    "tokenizer.ggml.scores has {} entries but there are {n} tokens",
                    scores.len()
                )));
            }
        }
        let types: Vec<TokenType> = match &spec.token_types {
            Some(codes) if codes.len() != n => {
                return Err(tokenizer_error(format!(
                    "tokenizer.ggml.token_type has {} entries but there are {n} tokens",
                    codes.len()
                )))
            }
            Some(codes) => {
                codes.iter().enumerate().map(|(i, &c)| TokenType::from_code(i, c)).collect::<Result<_>>()?
            }
            None => vec![TokenType::Normal; n],
        };
        for (name, id) in [
            ("bos", spec.bos_id),
            ("eos", spec.eos_id),
            ("eot", spec.eot_id),
            ("eom", spec.eom_id),
            ("unknown", spec.unk_id),
            ("padding", spec.pad_id),
        ] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(tokenizer_error(format!(
                        "{name} token id {id} is out of range: the vocabulary has {n} tokens"
                    )));
                }
            }
        }

        let mut tokens = spec.tokens;
        for (i, token) in tokens.iter_mut().enumerate() {
            if token.is_empty() {
                // llama.cpp's name for an empty token, which some converters write.
                tracing::warn!(id = i, "empty token in the vocabulary; naming it [EMPTY_{i}]");
                *token = format!("[EMPTY_{i}]");
            }
        }
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
        for (i, token) in tokens.iter().enumerate() {
            if let Some(first) = token_to_id.insert(token.clone(), i as u32) {
                return Err(tokenizer_error(format!(
                    "token `{token}` appears twice, at ids {first} and {i}"
                )));
            }
        }

        let special: Vec<bool> =
            types.iter().map(|t| matches!(t, TokenType::Control | TokenType::UserDefined)).collect();
        let special_ids: Vec<u32> = (0..n as u32).filter(|&i| special[i as usize]).collect();

        let (encoder, pieces, strip_first_space) = match spec.model {
            TokenizerModel::Gpt2 => {
                let merges = spec.merges.as_deref().ok_or_else(|| {
                    tokenizer_error(
                        "a byte-level BPE vocabulary needs tokenizer.ggml.merges, which is missing",
                    )
                })?;
                let pre = match spec.pre.as_deref() {
                    Some(pre) => pre,
                    None => {
                        tracing::warn!(
                            "tokenizer.ggml.pre is missing; using llama.cpp's \"default\" regexes"
                        );
                        "default"
                    }
                };
                let merges = parse_merges(merges, &token_to_id)?;
                let hf = build_bpe(&tokens, token_to_id, merges, pre, &special_ids)?;
                let pieces = tokens
                    .iter()
                    .zip(&types)
                    .map(|(text, kind)| match kind {
                        TokenType::Normal | TokenType::Undefined | TokenType::Byte => byte_level_decode(text),
                        _ => text.as_bytes().to_vec(),
                    })
                    .collect();
                (Encoder::Bpe(Box::new(hf)), pieces, false)
            }
            TokenizerModel::Llama => {
                let mut byte_ids = [None; 256];
                let mut pieces = Vec::with_capacity(n);
                for (i, (text, kind)) in tokens.iter().zip(&types).enumerate() {
                    let looks_like_byte = spec.token_types.is_none() && text.starts_with("<0x");
                    let piece = if *kind == TokenType::Byte || looks_like_byte {
                        let byte = parse_byte_token(text).ok_or_else(|| {
                            tokenizer_error(format!("byte token {i} is `{text}`, not of the form <0xNN>"))
                        })?;
                        byte_ids[byte as usize].get_or_insert(i as u32);
                        vec![byte]
                    } else if matches!(kind, TokenType::Normal | TokenType::Undefined) {
                        text.replace('\u{2581}', " ").into_bytes()
                    } else {
                        text.as_bytes().to_vec()
                    };
                    pieces.push(piece);
                }
                let scores = spec.scores.clone().unwrap_or_else(|| vec![0.0; n]);
                let specials = if special_ids.is_empty() {
                    None
                } else {
                    let texts: Vec<&str> = special_ids.iter().map(|&i| tokens[i as usize].as_str()).collect();
                    let matcher = AhoCorasick::builder()
                        .match_kind(MatchKind::LeftmostLongest)
                        .build(&texts)
                        .map_err(|e| tokenizer_error(format!("special tokens cannot be matched: {e}")))?;
                    Some((matcher, special_ids.clone()))
                };
                let model = Box::new(SentencePiece::new(token_to_id, scores, byte_ids, spec.unk_id));
                let encoder =
                    Encoder::SentencePiece { model, specials, add_space_prefix: spec.add_space_prefix };
                (encoder, pieces, spec.add_space_prefix)
            }
        };

        let mut eos_ids: Vec<u32> = [spec.eos_id, spec.eot_id, spec.eom_id].into_iter().flatten().collect();
        for &id in &special_ids {
            if types[id as usize] == TokenType::Control
                && END_OF_GENERATION_TEXTS.contains(&tokens[id as usize].as_str())
            {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        Ok(Tokenizer {
            encoder,
            pieces,
            special,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            eos_ids,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            strip_first_space,
            chat_template: spec.chat_template,
        })
    }

    /// The number of token ids.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The model's end-of-sequence token (the one chat templates call `eos_token`).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Every token that ends generation: EOS, end of turn, end of message, sorted.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` is a special token (control or user-defined, or an added special token).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The chat template the model carries, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The text of a special token such as BOS or EOS, for chat templates.
    pub fn special_text(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).and_then(|p| std::str::from_utf8(p).ok())
    }

    /// The bytes token `id` decodes to.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice).ok_or_else(|| {
            tokenizer_error(format!(
                "token id {id} is out of range: the vocabulary has {} tokens",
                self.pieces.len()
            ))
        })
    }

    /// Encodes `text`. Special tokens written in the text are matched as single tokens; with
    /// `add_special`, the model's BOS and EOS are added as its metadata asks.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        match &self.encoder {
            Encoder::Json(hf) => {
                let encoding = hf
                    .encode(text, add_special)
                    .map_err(|e| tokenizer_error(format!("encoding {} bytes of text: {e}", text.len())))?;
                return Ok(encoding.get_ids().to_vec());
            }
            Encoder::Bpe(hf) => {
                if add_special && self.add_bos {
                    ids.extend(self.bos_id);
                }
                let start = ids.len();
                let encoding = hf
                    .encode(text, false)
                    .map_err(|e| tokenizer_error(format!("encoding {} bytes of text: {e}", text.len())))?;
                ids.extend_from_slice(encoding.get_ids());
                // The BPE model silently drops a byte whose character has no token: refuse that.
                let covered: usize = ids[start..].iter().map(|&id| self.pieces[id as usize].len()).sum();
                if covered != text.len() {
                    return Err(tokenizer_error(format!(
                        "the text has {} bytes but its tokens cover {covered}: the vocabulary lacks a \
                         token for some of its bytes",
                        text.len()
                    )));
                }
            }
            Encoder::SentencePiece { model, specials, add_space_prefix } => {
                if add_special && self.add_bos {
                    ids.extend(self.bos_id);
                }
                let mut previous_was_special = true;
                let encode_raw = |raw: &str, previous_was_special: bool, ids: &mut Vec<u32>| {
                    let mut escaped = String::with_capacity(raw.len() + 3);
                    if *add_space_prefix && previous_was_special {
                        escaped.push('\u{2581}');
                    }
                    escaped.extend(raw.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
                    model.encode_into(&escaped, ids)
                };
                let mut at = 0;
                if let Some((matcher, special_ids)) = specials {
                    for found in matcher.find_iter(text) {
                        if found.start() > at {
                            encode_raw(&text[at..found.start()], previous_was_special, &mut ids)?;
                        }
                        ids.push(special_ids[found.pattern().as_usize()]);
                        previous_was_special = true;
                        at = found.end();
                    }
                }
                if at < text.len() {
                    encode_raw(&text[at..], previous_was_special, &mut ids)?;
                }
            }
        }
        if add_special && self.add_eos {
            ids.extend(self.eos_id);
        }
        Ok(ids)
    }

    /// Decodes `ids` to text; special tokens appear as their text. An id out of range, or ids
    /// whose bytes are not UTF-8, are [`Error::Tokenizer`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id)?;
            bytes.extend_from_slice(if i == 0 { self.strip_space(piece) } else { piece });
        }
        String::from_utf8(bytes).map_err(|e| {
            tokenizer_error(format!(
                "{} ids decode to bytes that are not UTF-8 (invalid from byte {})",
                ids.len(),
                e.utf8_error().valid_up_to()
            ))
        })
    }

    fn strip_space<'a>(&self, piece: &'a [u8]) -> &'a [u8] {
        match piece {
            [b' ', rest @ ..] if self.strip_first_space => rest,
            _ => piece,
        }
    }

    /// A decoder that turns ids into text as they arrive.
    pub fn stream(&self) -> TokenStream<'_> {
        TokenStream { tokenizer: self, pending: Vec::new(), first: true }
    }
}

/// Decodes tokens one at a time, emitting text as soon as it is complete UTF-8: bytes of a
/// character split across byte tokens wait for the rest.
///
/// The ids come from a model, not from a user, so a byte sequence that can never be UTF-8 is
/// emitted as U+FFFD rather than stopping generation.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    first: bool,
}

impl TokenStream<'_> {
    /// Adds token `id` and returns the text that is now complete (possibly empty).
    pub fn step(&mut self, id: u32) -> Result<String> {
        let piece = self.tokenizer.token_bytes(id)?;
        let piece = if self.first { self.tokenizer.strip_space(piece) } else { piece };
        self.first = false;
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid_up_to` is UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Ends the stream: bytes still waiting for the rest of a character come out as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// Splits each `"left right"` merge and checks that both sides and their concatenation are tokens.
fn parse_merges(merges: &[String], token_to_id: &HashMap<String, u32>) -> Result<Vec<(String, String)>> {
    merges
        .iter()
        .enumerate()
        .map(|(rank, merge)| {
            // As llama.cpp: the separator is the first space after the first character.
            let split = merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
            let Some(split) = split else {
                return Err(tokenizer_error(format!(
                    "merge {rank} `{merge}` is not two tokens separated by a space"
                )));
            };
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            for side in [left, right] {
                if !token_to_id.contains_key(side) {
                    return Err(tokenizer_error(format!(
                        "merge {rank} `{merge}` names `{side}`, which is not a token"
                    )));
                }
            }
            let merged = format!("{left}{right}");
            if !token_to_id.contains_key(&merged) {
                return Err(tokenizer_error(format!(
                    "merge {rank} `{merge}` makes `{merged}`, which is not a token"
                )));
            }
            Ok((left.to_string(), right.to_string()))
        })
        .collect()
}

/// The `tokenizers` crate's byte-level BPE for a GGUF vocabulary.
fn build_bpe(
    tokens: &[String],
    token_to_id: HashMap<String, u32>,
    merges: Vec<(String, String)>,
    pre: &str,
    special_ids: &[u32],
) -> Result<tokenizers::Tokenizer> {
    let bpe = BPE::builder()
        .vocab_and_merges(token_to_id.into_iter().collect::<tokenizers::models::bpe::Vocab>(), merges)
        .ignore_merges(pretokenize::ignores_merges(pre))
        .build()
        .map_err(|e| tokenizer_error(format!("building the BPE model: {e}")))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for regex in pretokenize::regexes_for(pre)? {
        let split =
            Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| tokenizer_error(format!("pre-tokenizer `{pre}` regex `{regex}`: {e}")))?;
        steps.push(split.into());
    }
    // Bytes to GPT-2's printable characters; the regexes above already split the text.
    steps.push(ByteLevel::new(false, false, false).into());
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(Sequence::new(steps)));
    let added: Vec<AddedToken> =
        special_ids.iter().map(|&id| AddedToken::from(tokens[id as usize].clone(), true)).collect();
    hf.add_special_tokens(&added);
    Ok(hf)
}

/// GPT-2's map from bytes to printable characters: printable Latin-1 bytes are themselves, the
/// others are shifted to U+0100 and up, in byte order.
fn byte_level_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut shifted = 0u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        chars[byte as usize] = if printable {
            char::from(byte)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    chars
}

/// The bytes of a byte-level token; a character outside GPT-2's map stands for its own UTF-8
/// bytes (as llama.cpp decodes it).
fn byte_level_decode(text: &str) -> Vec<u8> {
    static TABLE: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    let table =
        TABLE.get_or_init(|| byte_level_chars().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect());
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        match table.get(&c) {
            Some(&b) => bytes.push(b),
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

#[cfg(test)]
mod tests;
