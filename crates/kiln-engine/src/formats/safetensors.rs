//! safetensors files (single or sharded) and the Hugging Face `config.json` beside them.
//!
//! The `safetensors` crate parses and validates the header (size limit, UTF-8, JSON, offsets
//! contiguous from zero, byte ranges matching shape × dtype, the data covering the file exactly).
//! Kiln adds what it lets through: duplicate tensor names (JSON objects keep the last duplicate
//! silently), dtypes Kiln's table does not list, and shard file names that would leave the model
//! directory. Data is memory-mapped and handed out as byte slices that may be unaligned for their
//! dtype (the data section starts at `8 + header length`): [`WeightSource::tensor`] copies them
//! into aligned host memory, and nothing here casts a mapped slice in place.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use kiln_core::{DType, Error, Result, Tensor};
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{WeightInfo, WeightSource};

/// The name of the index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Safetensors { path: path.to_path_buf(), reason: reason.into() }
}

/// One tensor of a safetensors file: its description and absolute byte range in the file.
#[derive(Debug, Clone)]
struct Entry {
    info: WeightInfo,
    start: usize,
    end: usize,
}

/// One memory-mapped safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: memmap2::Mmap,
    tensors: Vec<Entry>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Refuses a header whose top-level object names a key twice.
struct UniqueKeys(Option<String>);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct KeysVisitor;
        impl<'de> Visitor<'de> for KeysVisitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<UniqueKeys, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    map.next_value::<IgnoredAny>()?;
                    if !seen.insert(key.clone()) {
                        return Ok(UniqueKeys(Some(key)));
                    }
                }
                Ok(UniqueKeys(None))
            }
        }
        deserializer.deserialize_map(KeysVisitor)
    }
}

impl SafetensorsFile {
    /// Opens, maps and checks one safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; Kiln never writes model files, and a file changed by
        // another process while mapped is outside what any mmap-based loader can guard against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (tensors, metadata) = parse(path, &map)?;
        let index = tensors.iter().enumerate().map(|(i, e)| (e.info.name.clone(), i)).collect();
        Ok(SafetensorsFile { path: path.to_path_buf(), map, tensors, index, metadata })
    }

    /// Checks a safetensors file held in memory, as [`SafetensorsFile::open`] does, and returns
    /// its tensor descriptions (the entry point of the fuzz target).
    pub fn check_bytes(bytes: &[u8]) -> Result<Vec<WeightInfo>> {
        Ok(parse(Path::new("<memory>"), bytes)?.0.into_iter().map(|e| e.info).collect())
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The free-form `__metadata__` of the header.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.index.get(name).map(|&i| &self.tensors[i]).ok_or_else(|| Error::MissingTensor {
            model: self.path.display().to_string(),
            tensor: name.to_string(),
        })
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<(Vec<Entry>, BTreeMap<String, String>)> {
    let (header_len, metadata) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(path, e.to_string()))?;
    // read_metadata() checked that 8 + header_len lies within the file.
    let header = &bytes[8..8 + header_len];
    match serde_json::from_slice::<UniqueKeys>(header) {
        Ok(UniqueKeys(None)) => {}
        Ok(UniqueKeys(Some(name))) => {
            return Err(bad(path, format!("tensor name `{name}` appears twice in the header")))
        }
        Err(e) => return Err(bad(path, format!("header: {e}"))),
    }
    let data_start = 8 + header_len;
    let mut tensors = Vec::with_capacity(metadata.tensors().len());
    for name in metadata.offset_keys() {
        let Some(info) = metadata.info(&name) else { continue };
        let dtype = DType::from_safetensors(&info.dtype.to_string()).map_err(|_| {
            bad(path, format!("tensor `{name}`: dtype {} is not in Kiln's table", info.dtype))
        })?;
        let (start, end) = info.data_offsets;
        // The crate checked the ranges are contiguous from zero and end at the file's end.
        tensors.push(Entry {
            info: WeightInfo { name, shape: info.shape.clone(), dtype },
            start: data_start + start,
            end: data_start + end,
        });
    }
    let extra = metadata.metadata().clone().unwrap_or_default().into_iter().collect();
    Ok((tensors, extra))
}

impl WeightSource for SafetensorsFile {
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|e| e.info.name.clone()).collect()
    }
    fn weight_info(&self, name: &str) -> Option<WeightInfo> {
        self.index.get(name).map(|&i| self.tensors[i].info.clone())
    }
    fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let e = self.entry(name)?;
        self.map
            .get(e.start..e.end)
            .ok_or_else(|| bad(&self.path, format!("tensor `{name}` lies past the end")))
    }
    fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = &self.entry(name)?.info;
        // A copy into Kiln's aligned host buffer: the mapped slice may be unaligned for the dtype.
        Tensor::from_bytes(self.tensor_bytes(name)?, info.dtype, &info.shape)
    }
}

/// The weights of a checkpoint: one safetensors file, or the shards named by an index file.
#[derive(Debug)]
pub struct SafetensorsWeights {
    shards: Vec<SafetensorsFile>,
    by_name: HashMap<String, usize>,
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl SafetensorsWeights {
    /// Opens `path`: a `.safetensors` file, a `model.safetensors.index.json`, or a directory
    /// holding one of [`INDEX_FILE`] or [`SINGLE_FILE`].
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsWeights> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join(INDEX_FILE);
            if index.is_file() {
                return SafetensorsWeights::open_index(&index);
            }
            return SafetensorsWeights::open_single(path.join(SINGLE_FILE));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return SafetensorsWeights::open_index(path);
        }
        SafetensorsWeights::open_single(path)
    }

    fn open_single(path: impl AsRef<Path>) -> Result<SafetensorsWeights> {
        let file = SafetensorsFile::open(path)?;
        let by_name = file.tensors.iter().map(|e| (e.info.name.clone(), 0)).collect();
        Ok(SafetensorsWeights { shards: vec![file], by_name })
    }

    /// Opens the shards named by an index file, checking that every tensor it maps is in the
    /// shard it names and that no tensor lives in two shards.
    pub fn open_index(index_path: &Path) -> Result<SafetensorsWeights> {
        let text = std::fs::read(index_path).map_err(|e| Error::io(index_path, e))?;
        // A tensor mapped twice keeps its last shard; the cross-shard check below catches a tensor
        // present in two shards.
        let index: IndexFile =
            serde_json::from_slice(&text).map_err(|e| bad(index_path, format!("index: {e}")))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shard_of_file: HashMap<&str, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut by_name = HashMap::new();
        for (tensor, file) in &index.weight_map {
            let shard = match shard_of_file.get(file.as_str()) {
                Some(&i) => i,
                None => {
                    let plain = Path::new(file).file_name().is_some_and(|f| f == file.as_str());
                    if !plain || file == ".." || file == "." {
                        return Err(bad(
                            index_path,
                            format!("shard `{file}` is not a file name in the model directory"),
                        ));
                    }
                    shards.push(SafetensorsFile::open(dir.join(file))?);
                    shard_of_file.insert(file, shards.len() - 1);
                    shards.len() - 1
                }
            };
            if !shards[shard].index.contains_key(tensor) {
                return Err(bad(
                    index_path,
                    format!("tensor `{tensor}` is mapped to shard `{file}`, which does not hold it"),
                ));
            }
            by_name.insert(tensor.clone(), shard);
        }
        for (i, shard) in shards.iter().enumerate() {
            for e in &shard.tensors {
                if let Some(&mapped) = by_name.get(&e.info.name) {
                    if mapped != i {
                        return Err(bad(
                            shard.path(),
                            format!(
                                "tensor `{}` is also in shard {}",
                                e.info.name,
                                shards[mapped].path().display()
                            ),
                        ));
                    }
                }
            }
        }
        if shards.is_empty() {
            return Err(bad(index_path, "weight_map is empty"));
        }
        Ok(SafetensorsWeights { shards, by_name })
    }

    /// The shard files, in the order they were opened.
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    fn shard(&self, name: &str) -> Result<&SafetensorsFile> {
        self.by_name.get(name).map(|&i| &self.shards[i]).ok_or_else(|| Error::MissingTensor {
            model: self.shards.first().map(|s| s.path().display().to_string()).unwrap_or_default(),
            tensor: name.to_string(),
        })
    }
}

impl WeightSource for SafetensorsWeights {
    fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_name.keys().cloned().collect();
        names.sort();
        names
    }
    fn weight_info(&self, name: &str) -> Option<WeightInfo> {
        self.shard(name).ok()?.weight_info(name)
    }
    fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        self.shard(name)?.tensor_bytes(name)
    }
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.shard(name)?.tensor(name)
    }
}

/// The fields of a Hugging Face `config.json` that the Llama family reads. Fields a model may
/// omit are `Option`s: the model code decides what an absence means, never this struct.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub vocab_size: usize,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<usize>,
    pub attention_bias: Option<bool>,
    /// `torch_dtype`, or `dtype` as newer transformers write it.
    #[serde(alias = "dtype")]
    pub torch_dtype: Option<String>,
    pub bos_token_id: Option<serde_json::Value>,
    pub eos_token_id: Option<serde_json::Value>,
}

impl HfConfig {
    /// Reads a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<HfConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        HfConfig::from_json(&text)
            .map_err(|e| Error::Model { model: path.display().to_string(), reason: e.to_string() })
    }

    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<HfConfig> {
        serde_json::from_str(text)
            .map_err(|e| Error::Model { model: "config.json".into(), reason: format!("config.json: {e}") })
    }

    /// The architecture the file names (`LlamaForCausalLM`, ...): the first of `architectures`.
    pub fn architecture(&self) -> Result<&str> {
        self.architectures.first().map(String::as_str).ok_or_else(|| Error::Model {
            model: "config.json".into(),
            reason: "`architectures` is missing or empty".into(),
        })
    }
}
