//! The tokenizer of a safetensors model: `tokenizer.json` through the `tokenizers` crate, with
//! `tokenizer_config.json` (chat template, BOS/EOS) and `generation_config.json` (EOS ids) from
//! the same folder when present.

use std::path::Path;
use std::str::FromStr;

use kiln_core::{Error, Result};
use serde_json::Value;

use super::spm::parse_byte_token;
use super::{byte_level_decode, tokenizer_error, Encoder, Tokenizer, END_OF_GENERATION_TEXTS};

/// How the decoder of a `tokenizer.json` turns a token into bytes.
enum PieceDecoding {
    /// GPT-2's byte-to-character map (`ByteLevel`).
    ByteLevel,
    /// `▁` for spaces and `<0xNN>` byte tokens (`Metaspace`, `ByteFallback`, `Replace`).
    SentencePiece,
    /// Any other decoder: the crate's decoding of the token alone.
    Text,
}

fn decoder_types(decoder: &Value, out: &mut Vec<String>) {
    if let Some(kind) = decoder.get("type").and_then(Value::as_str) {
        out.push(kind.to_string());
    }
    if let Some(inner) = decoder.get("decoders").and_then(Value::as_array) {
        inner.iter().for_each(|d| decoder_types(d, out));
    }
}

/// A JSON value that is a token's text: a string, or an object with `content`.
fn token_content(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| value.get("content").and_then(Value::as_str))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| tokenizer_error(format!("{}: not valid JSON: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`, with the chat template and special tokens of the
    /// `tokenizer_config.json` and the EOS ids of the `generation_config.json` beside it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let hf = tokenizers::Tokenizer::from_str(&text)
            .map_err(|e| tokenizer_error(format!("{}: {e}", path.display())))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| tokenizer_error(format!("{}: not valid JSON: {e}", path.display())))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let config = read_json(&folder.join("tokenizer_config.json"))?;
        let generation = read_json(&folder.join("generation_config.json"))?;

        let mut kinds = Vec::new();
        if let Some(decoder) = json.get("decoder") {
            decoder_types(decoder, &mut kinds);
        }
        let has = |name: &str| kinds.iter().any(|k| k == name);
        let decoding = if has("ByteLevel") {
            PieceDecoding::ByteLevel
        } else if has("ByteFallback") || has("Metaspace") || has("Replace") {
            PieceDecoding::SentencePiece
        } else {
            PieceDecoding::Text
        };
        let strip_first_space = has("Strip") || has("Metaspace");

        let vocab = hf.get_vocab(true);
        let n = vocab.values().max().map_or(0, |&m| m as usize + 1);
        if n == 0 || n != vocab.len() {
            return Err(tokenizer_error(format!(
                "{}: {} tokens with ids up to {}; Kiln needs ids 0 to n-1 without gaps",
                path.display(),
                vocab.len(),
                n.saturating_sub(1)
            )));
        }
        let mut texts = vec![String::new(); n];
        for (token, &id) in &vocab {
            texts[id as usize] = token.clone();
        }
        let added = hf.get_added_tokens_decoder();
        let mut special = vec![false; n];
        let mut pieces = Vec::with_capacity(n);
        for (id, token) in texts.iter().enumerate() {
            if let Some(added) = added.get(&(id as u32)) {
                special[id] = added.special;
                pieces.push(added.content.as_bytes().to_vec());
                continue;
            }
            pieces.push(match decoding {
                PieceDecoding::ByteLevel => byte_level_decode(token),
                PieceDecoding::SentencePiece => match parse_byte_token(token) {
                    Some(byte) => vec![byte],
                    None => token.replace('\u{2581}', " ").into_bytes(),
                },
                PieceDecoding::Text => hf
                    .decode(&[id as u32], false)
                    .map_err(|e| tokenizer_error(format!("{}: decoding token {id}: {e}", path.display())))?
                    .into_bytes(),
            });
        }

        let id_of = |key: &str| -> Option<u32> {
            let text = config.as_ref()?.get(key).and_then(token_content)?;
            vocab.get(text).copied()
        };
        let bos_id = id_of("bos_token");
        let eos_id = id_of("eos_token");
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        match generation.as_ref().and_then(|g| g.get("eos_token_id")) {
            Some(Value::Number(id)) => eos_ids.extend(id.as_u64().and_then(|v| u32::try_from(v).ok())),
            Some(Value::Array(ids)) => {
                eos_ids.extend(ids.iter().filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok())))
            }
            _ => {}
        }
        for (id, text) in texts.iter().enumerate() {
            if special[id] && END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
                eos_ids.push(id as u32);
            }
        }
        if let Some(&bad) = eos_ids.iter().find(|&&id| id as usize >= n) {
            return Err(tokenizer_error(format!(
                "generation_config.json: eos_token_id {bad} is out of range: the vocabulary has {n} tokens"
            )));
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let chat_template = match config.as_ref().and_then(|c| c.get("chat_template")) {
            Some(Value::String(t)) => Some(t.clone()),
            // Several named templates: the one named "default".
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string),
            _ => None,
        };

        Ok(Tokenizer {
            encoder: Encoder::Json(Box::new(hf)),
            pieces,
            special,
            bos_id,
            eos_id,
            eos_ids,
            add_bos: false,
            add_eos: false,
            strip_first_space,
            chat_template,
        })
    }
}
