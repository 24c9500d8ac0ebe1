//! The pre-tokenizer regexes of byte-level BPE vocabularies, by the name GGUF files give them in
//! `tokenizer.ggml.pre`.
//!
//! Each name maps to a list of regexes applied in turn, as llama.cpp's `llama-vocab.cpp` defines
//! them: every regex splits each piece so far into its matches and the text between them, both
//! kept (the `tokenizers` crate's `Split` with `Isolated` behaviour). The regexes need look-ahead
//! (`\s+(?!\S)`), which is why the `tokenizers` crate is built with `fancy-regex`.

use kiln_core::{Error, Result};

/// GPT-2's split: contractions, letters, numbers, other symbols, whitespace runs.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split: case-insensitive contractions, numbers in groups of at most three digits.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split: as Llama 3's, with every digit on its own.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regexes for the pre-tokenizer `name`, or [`Error::Tokenizer`] naming an unknown one.
pub fn regexes_for(name: &str) -> Result<Vec<&'static str>> {
    let regexes: Vec<&'static str> = match name {
        "default" => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => vec![LLAMA3],
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" | "stablelm2" | "hunyuan" | "grok-2" => {
            vec![QWEN2]
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0"
        | "mellum" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "exaone4"
        | "trillion" | "granite-docling" => vec![GPT2],
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2]
        }
        "falcon" => vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
        "deepseek-coder" => vec!["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
        "poro-chat" | "bloom" | "gpt3-finnish" => vec![r" ?[^(\s|.,!?…。，、।۔،)]+"],
        "viking" => vec![r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"],
        "seed-coder" => vec![
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        other => {
            return Err(Error::Tokenizer {
                reason: format!(
                    "pre-tokenizer `{other}` (tokenizer.ggml.pre) is not one Kiln knows; known: {}",
                    KNOWN.join(", ")
                ),
            })
        }
    };
    Ok(regexes)
}

/// The names [`regexes_for`] serves, for error messages.
const KNOWN: &[&str] = &[
    "default",
    "llama3",
    "llama-bpe",
    "dbrx",
    "smaug-bpe",
    "qwen2",
    "stablelm2",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "falcon",
    "deepseek-coder",
    "bloom",
    "viking",
    "seed-coder",
];

/// Whether the pre-tokenizer `name` asks for merges to be skipped when a whole word is already a
/// token (Llama 3's tokenizer does this).
pub fn ignores_merges(name: &str) -> bool {
    matches!(
        name,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
    )
}
