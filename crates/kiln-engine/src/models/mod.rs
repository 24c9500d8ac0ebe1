//! Models: configuration, loading from GGUF or safetensors, and the CPU forward pass.

pub mod config;
pub mod gpu;
pub mod llama;
#[doc(hidden)]
pub mod test_models;

use std::path::Path;

use kiln_core::{Error, Result};

use crate::formats::safetensors::SafetensorsWeights;
use crate::formats::GgufFile;
use crate::tokenizer::Tokenizer;
pub use config::{Architecture, ModelConfig};
pub use llama::{hf_tensor_name, KvCache, LlamaModel};

/// Loads a GGUF model of the Llama family.
pub fn load_gguf(file: GgufFile) -> Result<LlamaModel> {
    let config = ModelConfig::from_gguf(&file)?;
    LlamaModel::load(config, Box::new(file), |name| name.to_string())
}

/// A Hugging Face folder's `config.json`: the parsed JSON (for fields Kiln does not model) and the
/// configuration, named after the folder.
pub fn read_hf_config(dir: &Path) -> Result<(serde_json::Value, ModelConfig)> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Model {
        model: dir.display().to_string(),
        reason: format!("config.json: {e}"),
    })?;
    let name =
        dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let config = ModelConfig::from_hf_json(&json, &name)?;
    Ok((json, config))
}

/// Loads a Hugging Face folder: `config.json`, `tokenizer.json` and safetensors weights (one
/// file or a sharded index).
pub fn load_hf_dir(dir: &Path) -> Result<(LlamaModel, Tokenizer)> {
    let (_, config) = read_hf_config(dir)?;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let weights = SafetensorsWeights::open(dir)?;
    let model = LlamaModel::load(config, Box::new(weights), hf_tensor_name)?;
    check_vocab(&model, &tokenizer)?;
    Ok((model, tokenizer))
}

fn check_vocab(model: &LlamaModel, tokenizer: &Tokenizer) -> Result<()> {
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
    Ok(())
}

/// Loads a model alone (no tokenizer) from a `.gguf` file or a Hugging Face folder whose
/// `tokenizer.json` may be missing: for tools that feed token ids.
pub fn load_model(path: &Path) -> Result<LlamaModel> {
    if path.is_dir() {
        let (_, config) = read_hf_config(path)?;
        return LlamaModel::load(config, Box::new(SafetensorsWeights::open(path)?), hf_tensor_name);
    }
    load_gguf(GgufFile::open(path)?)
}

/// Loads a model and its tokenizer from a path: a `.gguf` file (tokenizer from its metadata), or
/// a Hugging Face folder (`config.json`, `tokenizer.json`, safetensors).
pub fn load_path(path: &Path) -> Result<(LlamaModel, Tokenizer)> {
    if path.is_dir() {
        return load_hf_dir(path);
    }
    let file = GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = load_gguf(file)?;
    check_vocab(&model, &tokenizer)?;
    Ok((model, tokenizer))
}
