//! Models: configuration, loading from GGUF or safetensors, and the CPU forward pass.

pub mod config;
pub mod llama;

use std::path::Path;

use kiln_core::{Error, Result};

use crate::formats::GgufFile;
pub use config::{Architecture, ModelConfig};
pub use llama::{hf_tensor_name, KvCache, LlamaModel};

/// Loads a GGUF model of the Llama family.
pub fn load_gguf(file: GgufFile) -> Result<LlamaModel> {
    let config = ModelConfig::from_gguf(&file)?;
    LlamaModel::load(config, Box::new(file), |name| name.to_string())
}

/// Loads a model from a path: a `.gguf` file (a safetensors folder comes with its loader).
pub fn load_path(path: &Path) -> Result<LlamaModel> {
    if path.extension().is_some_and(|e| e == "gguf") || path.is_file() {
        return load_gguf(GgufFile::open(path)?);
    }
    Err(Error::NotServed { op: "model loading", reason: format!("{}: not a GGUF file", path.display()) })
}
