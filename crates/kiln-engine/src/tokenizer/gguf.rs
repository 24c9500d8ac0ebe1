//! The tokenizer of a GGUF file, from its `tokenizer.*` metadata.

use kiln_core::{Error, Result};

use super::{pretokenize, Tokenizer, TokenizerModel, TokenizerSpec};
use crate::formats::gguf::GgufFile;

/// A GGUF reader error (a missing key, a wrong type) as a tokenizer error, keeping its message.
fn tokenizer_field(error: Error) -> Error {
    Error::Tokenizer { reason: error.to_string() }
}

impl TokenizerSpec {
    /// Reads the tokenizer metadata of `file`. A missing required key or a key of the wrong type
    /// is an [`Error::Tokenizer`] carrying the reader's message (the key, the types, the offset).
    pub fn from_gguf(file: &GgufFile) -> Result<TokenizerSpec> {
        let model_name = file.get_str("tokenizer.ggml.model").map_err(tokenizer_field)?;
        let model = TokenizerModel::from_gguf_name(model_name)?;
        let tokens = file.get_string_array("tokenizer.ggml.tokens").map_err(tokenizer_field)?.to_vec();
        let mut spec = TokenizerSpec::new(model, tokens);
        spec.pre = file.opt_str("tokenizer.ggml.pre").map_err(tokenizer_field)?.map(str::to_string);
        spec.scores =
            file.opt_f32_array("tokenizer.ggml.scores").map_err(tokenizer_field)?.map(<[f32]>::to_vec);
        spec.token_types =
            file.opt_i32_array("tokenizer.ggml.token_type").map_err(tokenizer_field)?.map(<[i32]>::to_vec);
        spec.merges =
            file.opt_string_array("tokenizer.ggml.merges").map_err(tokenizer_field)?.map(<[String]>::to_vec);
        let id = |key: &str| file.opt_u32(key).map_err(tokenizer_field);
        spec.bos_id = id("tokenizer.ggml.bos_token_id")?;
        spec.eos_id = id("tokenizer.ggml.eos_token_id")?;
        spec.eot_id = id("tokenizer.ggml.eot_token_id")?;
        spec.eom_id = id("tokenizer.ggml.eom_token_id")?;
        spec.unk_id = id("tokenizer.ggml.unknown_token_id")?;
        spec.pad_id = id("tokenizer.ggml.padding_token_id")?;
        // llama.cpp's defaults when the flags are absent: Llama 3's pre-tokenizers add BOS.
        if model == TokenizerModel::Gpt2 && spec.pre.as_deref().is_some_and(pretokenize::ignores_merges) {
            spec.add_bos = true;
        }
        let flag = |key: &str, default: bool| {
            file.opt_bool(key).map(|v| v.unwrap_or(default)).map_err(tokenizer_field)
        };
        spec.add_bos = flag("tokenizer.ggml.add_bos_token", spec.add_bos)?;
        spec.add_eos = flag("tokenizer.ggml.add_eos_token", spec.add_eos)?;
        spec.add_space_prefix = flag("tokenizer.ggml.add_space_prefix", spec.add_space_prefix)?;
        spec.chat_template =
            file.opt_str("tokenizer.chat_template").map_err(tokenizer_field)?.map(str::to_string);
        Ok(spec)
    }
}

impl Tokenizer {
    /// The tokenizer of a GGUF file: [`TokenizerSpec::from_gguf`], then [`Tokenizer::from_spec`].
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        Tokenizer::from_spec(TokenizerSpec::from_gguf(file)?)
    }
}
