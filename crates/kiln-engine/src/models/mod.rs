//! Models: configuration, loading from GGUF or safetensors, and the CPU forward pass.

pub mod config;
pub mod llama;

use std::path::Path;

use kiln_core::{Error, Result};

use crate::formats::GgufFile;
use crate::tokenizer::Tokenizer;
pub use config::{Architecture, ModelConfig};
pub use llama::{hf_tensor_name, KvCache, LlamaModel};

/// Loads a GGUF model of the Llama family.
pub fn load_gguf(file: GgufFile) -> Result<LlamaModel> {
    let config = ModelConfig::from_gguf(&file)?;
    LlamaModel::load(config, Box::new(file), |name| name.to_string())
}

/// Loads a model and its tokenizer from a path: a `.gguf` file (tokenizer from its metadata).
pub fn load_path(path: &Path) -> Result<(LlamaModel, Tokenizer)> {
    if path.is_file() {
        let file = GgufFile::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let model = load_gguf(file)?;
        if tokenizer.vocab_size() > model.config().vocab {
            return Err(Error::Model {
                model: model.config().name.clone(),
                reason: format!(
                    "the tokenizer has {} tokens, the output layer {}",
                    tokenizer.vocab_size(),
                    model.config().vocab
                ),
            });
        }
        return Ok((model, tokenizer));
    }
    Err(Error::NotServed { op: "model loading", reason: format!("{}: not a GGUF file", path.display()) })
}
