//! Kiln's one error type.
//!
//! Every variant names the thing that is wrong and the value it had, so a message read without
//! the code still says where to look. Library code never panics on input from outside (files,
//! user arguments, the driver): it returns one of these.

use std::path::PathBuf;

/// Result with Kiln's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure Kiln reports, grouped by the layer that finds it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- element types -------------------------------------------------------------------
    /// A dtype code read from a file that the dtype table does not list.
    #[error("unknown {format} dtype code {code}")]
    UnknownDTypeCode { format: &'static str, code: String },
    /// A dtype name that the dtype table does not list.
    #[error("unknown dtype name `{name}`")]
    UnknownDTypeName { name: String },
    /// A dtype Kiln recognises but an operation does not serve.
    #[error("dtype {dtype} is not served by {op}")]
    DTypeNotServed { dtype: &'static str, op: &'static str },
    /// The built-in dtype table is inconsistent with the `DType` enum.
    #[error("dtype table: {reason}")]
    DTypeTable { reason: String },

    // ---- shapes and tensors --------------------------------------------------------------
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch, expected {expected:?}, got {got:?}")]
    ShapeMismatch { op: &'static str, expected: Vec<usize>, got: Vec<usize> },
    /// A shape whose element count or byte size does not fit in 64 bits.
    #[error("shape {shape:?} of {dtype}: element count or byte size overflows")]
    SizeOverflow { shape: Vec<u64>, dtype: &'static str },
    /// A block-quantized row whose length is not a multiple of the block size.
    #[error("{dtype}: {elements} elements is not a multiple of the block size {block_size}")]
    NotBlockAligned { dtype: &'static str, elements: u64, block_size: u64 },
    /// A view or operation that needs contiguous memory was given strided memory.
    #[error("{op}: tensor of shape {shape:?} with strides {strides:?} is not contiguous")]
    NotContiguous { op: &'static str, shape: Vec<usize>, strides: Vec<usize> },
    /// A view or index out of the tensor's bounds.
    #[error("{op}: {what} {value} is out of bounds (limit {limit})")]
    OutOfBounds { op: &'static str, what: &'static str, value: u64, limit: u64 },
    /// A byte buffer whose length does not match its shape and dtype.
    #[error("{what}: {got} bytes, expected {expected}")]
    ByteLength { what: String, expected: u64, got: u64 },
    /// An operation that is not served for the given arguments ("not served" is an answer).
    #[error("{op} is not served: {reason}")]
    NotServed { op: &'static str, reason: String },
    /// An argument outside its valid range.
    #[error("invalid argument {name} = {value}: {reason}")]
    InvalidArgument { name: &'static str, value: String, reason: String },

    // ---- files and formats ---------------------------------------------------------------
    /// An I/O error on a named path.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A malformed GGUF file: the path, the byte offset where reading stopped, and the rule.
    #[error("{path}: GGUF at byte {offset}: {kind}")]
    Gguf { path: PathBuf, offset: u64, kind: GgufErrorKind },
    /// A malformed safetensors file.
    #[error("{path}: safetensors: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    /// A model whose metadata or configuration is missing a field or disagrees with its tensors.
    #[error("model {model}: {reason}")]
    Model { model: String, reason: String },
    /// A tensor that a model needs and the file does not hold.
    #[error("model {model}: tensor `{tensor}` is missing")]
    MissingTensor { model: String, tensor: String },
    /// A tokenizer that cannot be built or used.
    #[error("tokenizer: {reason}")]
    Tokenizer { reason: String },
    /// A chat template that cannot be rendered.
    #[error("chat template: {reason}")]
    ChatTemplate { reason: String },
    /// A model fetch that failed (package, cache, checksum).
    #[error("fetching {what}: {reason}")]
    Fetch { what: String, reason: String },
    /// A value read from a configuration or environment variable that is not one of its allowed values.
    #[error("{name}={value} is not allowed; expected one of: {allowed}")]
    BadSetting { name: &'static str, value: String, allowed: &'static str },

    // ---- CUDA ----------------------------------------------------------------------------
    /// A CUDA library that could not be found or loaded, with what to install.
    #[error("{library} was not found ({detail}); {fix}")]
    CudaLibraryMissing { library: &'static str, detail: String, fix: &'static str },
    /// A CUDA driver call that failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
    /// An NVRTC compile that failed, with its log and options.
    #[error("NVRTC could not compile {kernel} with {options:?}:\n{log}")]
    Compile { kernel: String, options: Vec<String>, log: String },
    /// A device fact that the device file of an architecture does not list.
    #[error("device fact `{fact}` is missing for architecture {arch}")]
    MissingDeviceFact { fact: &'static str, arch: String },
    /// A device allocation larger than the card can give.
    #[error(
        "out of device memory: requested {requested_bytes} bytes; {live_bytes} bytes live, \
         {pooled_bytes} bytes pooled, {driver_free_bytes} bytes free in the driver"
    )]
    OutOfMemory { requested_bytes: u64, live_bytes: u64, pooled_bytes: u64, driver_free_bytes: u64 },
    /// A kernel whose arguments the launcher refuses.
    #[error("kernel {kernel}: {reason}")]
    Launch { kernel: &'static str, reason: String },

    // ---- tuning --------------------------------------------------------------------------
    /// In strict tuning mode, a key with no certificate.
    #[error("kernel {kernel} has no certificate for key {key}")]
    KeyNotCertified { kernel: String, key: String },
    /// A certificate or certificate index that is malformed.
    #[error("tuning store {path}: {reason}")]
    TuningStore { path: PathBuf, reason: String },
    /// A tuning run in which no candidate gave a correct result, so none may be chosen.
    #[error("no correct candidate for key {key}: {candidates} tried, each wrong or failed")]
    NoCorrectCandidate { key: String, candidates: usize },
    /// A certified winner that names a configuration its kernel family does not have.
    #[error("the certificate for {key} names configuration `{config}`, which kernel {kernel} does not have")]
    UnknownTuningConfig { kernel: String, key: String, config: String },

    // ---- memory planning and KV cache ----------------------------------------------------
    /// The KV page pool has too few free pages.
    #[error("KV page pool exhausted: {requested_pages} pages asked for, {free_pages} free")]
    PagePoolExhausted { requested_pages: u64, free_pages: u64 },

    /// An error with the context it happened in (the path, the op, the tensor).
    #[error("{context}")]
    Context {
        context: String,
        #[source]
        source: Box<Error>,
    },
}

/// The rules a GGUF file can break; each names the values it found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GgufErrorKind {
    #[error("bad magic {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported version {version} (Kiln reads 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error("file ends after {available} bytes while reading {what} ({needed} more bytes needed)")]
    Truncated { what: String, needed: u64, available: u64 },
    #[error("{what} count {count} cannot fit in the file's {file_bytes} bytes")]
    AbsurdCount { what: &'static str, count: u64, file_bytes: u64 },
    #[error("string is not UTF-8 ({what})")]
    NotUtf8 { what: String },
    #[error("unknown metadata value type {code} for key `{key}`")]
    UnknownValueType { key: String, code: u32 },
    #[error("arrays nested deeper than {limit} levels at key `{key}`")]
    NestingTooDeep { key: String, limit: u32 },
    #[error("duplicate metadata key `{key}`")]
    DuplicateKey { key: String },
    #[error("duplicate tensor name `{name}`")]
    DuplicateTensor { name: String },
    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: String },
    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },
    #[error("general.alignment {value} is invalid: {reason}")]
    BadAlignment { value: u64, reason: &'static str },
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("tensor `{name}`: unknown GGML type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor `{name}`: data [{start}, {end}) {reason}")]
    BadOffset { name: String, start: u64, end: u64, reason: &'static str },
    #[error("metadata key `{key}` = {value} does not fit in {expected}")]
    ValueOutOfRange { key: String, value: String, expected: &'static str },
    #[error("metadata key `{key}`: bool byte {value} is neither 0 nor 1")]
    BadBool { key: String, value: u8 },
    #[error("{bytes} bytes after the last tensor, more than the alignment {alignment} pads")]
    TrailingBytes { bytes: u64, alignment: u64 },
}

impl Error {
    /// Wraps this error with a line of context (an op, a path, a tensor name).
    pub fn context(self, context: impl Into<String>) -> Error {
        Error::Context { context: context.into(), source: Box::new(self) }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source }
    }

    /// The innermost error, past every [`Error::Context`] layer.
    pub fn root(&self) -> &Error {
        match self {
            Error::Context { source, .. } => source.root(),
            other => other,
        }
    }
}

/// Adds context to any `Result<_, Error>`.
pub trait ResultExt<T> {
    /// Wraps the error, if any, with a line of context computed only on failure.
    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T>;
}

impl<T> ResultExt<T> for Result<T> {
    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| e.context(context()))
    }
}
