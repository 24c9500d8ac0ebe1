//! Weight file formats: GGUF and safetensors, and the GGML block formats.
//!
//! - [`gguf`]: the GGUF reader (metadata, tensor infos, memory-mapped data);
//! - [`quant`]: dequantization of the GGML block formats and the quantized-by-float dot product;
//! - [`WeightSource`]: one view of a file's tensors, so a model loads from either format the same
//!   way.

#[cfg(target_arch = "x86_64")]
mod float_dot;
pub mod gguf;
mod int_dot;
pub mod quant;
pub mod safetensors;

pub use self::safetensors::{HfConfig, SafetensorsFile, SafetensorsWeights};
pub use gguf::{GgufArray, GgufFile, GgufTensorInfo, GgufValue};
pub use quant::{dequantize_row, dot_row, dot_rows, dot_rows_many, dot_rows_x, matvec, DotX};

use kiln_core::{DType, Result, Tensor};

/// A tensor's description, the same for every format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightInfo {
    pub name: String,
    /// Row-major shape, outermost first (for GGUF: the GGML dims reversed).
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// The tensors of a weight file (or a set of shards), by name.
pub trait WeightSource {
    /// Every tensor name.
    fn tensor_names(&self) -> Vec<String>;
    /// The description of tensor `name`, if present.
    fn weight_info(&self, name: &str) -> Option<WeightInfo>;
    /// The raw bytes of tensor `name` (row-major; GGML blocks for quantized types), borrowed from
    /// the file's mapping. The slice may be unaligned: copy it, never cast it in place.
    fn tensor_bytes(&self, name: &str) -> Result<&[u8]>;
    /// A host copy of tensor `name`.
    fn tensor(&self, name: &str) -> Result<Tensor>;
}

impl WeightSource for GgufFile {
    fn tensor_names(&self) -> Vec<String> {
        GgufFile::tensor_names(self).map(str::to_string).collect()
    }
    fn weight_info(&self, name: &str) -> Option<WeightInfo> {
        let info = self.tensor_info(name)?;
        Some(WeightInfo {
            name: info.name.clone(),
            shape: info.dims.iter().rev().map(|&d| d as usize).collect(),
            dtype: info.dtype,
        })
    }
    fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        GgufFile::tensor_bytes(self, name)
    }
    fn tensor(&self, name: &str) -> Result<Tensor> {
        GgufFile::tensor(self, name)
    }
}
