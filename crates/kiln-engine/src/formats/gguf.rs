//! The GGUF reader (versions 2 and 3).
//!
//! Layout of a GGUF file, all integers little-endian:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type u32, value)
//! tensor_count × (name: string, n_dims u32, dims: n_dims × u64 (innermost first), ggml_type u32,
//!                 offset u64 (from the start of the data section))
//! padding to `general.alignment` (default 32)
//! data section: each tensor at its offset, every offset a multiple of the alignment
//! ```
//!
//! A string is a u64 byte length followed by that many UTF-8 bytes. An array value is an element
//! type u32, a u64 count, then the elements.
//!
//! Every count, length and offset is checked against the bytes that remain before it is used, so
//! a hostile file costs at most a small multiple of its own size in memory and never panics: each
//! rule it breaks is a [`GgufErrorKind`] with the byte offset where reading stopped.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kiln_core::{DType, Error, GgufErrorKind, Result, Tensor};

/// The magic bytes that open every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The largest `general.alignment` Kiln accepts; real files use 32.
pub const MAX_ALIGNMENT: u64 = 1 << 16;
/// How deep arrays of arrays may nest.
pub const MAX_ARRAY_NESTING: u32 = 4;
/// GGML tensors have at most four dimensions.
pub const MAX_DIMS: u32 = 4;

// The smallest encoding of each record, used to refuse counts the remaining bytes cannot hold
// before anything is allocated for them.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // empty key, type, a one-byte value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8; // empty name, n_dims = 0, type, offset

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

/// An array value, stored by element type so that memory stays proportional to the file.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Arrays of arrays, nested at most [`MAX_ARRAY_NESTING`] deep.
    Array(Vec<GgufArray>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::F64(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type's name, as GGUF writes it.
    pub fn element_type_name(&self) -> &'static str {
        match self {
            GgufArray::U8(_) => "u8",
            GgufArray::I8(_) => "i8",
            GgufArray::U16(_) => "u16",
            GgufArray::I16(_) => "i16",
            GgufArray::U32(_) => "u32",
            GgufArray::I32(_) => "i32",
            GgufArray::U64(_) => "u64",
            GgufArray::I64(_) => "i64",
            GgufArray::F32(_) => "f32",
            GgufArray::F64(_) => "f64",
            GgufArray::Bool(_) => "bool",
            GgufArray::String(_) => "string",
            GgufArray::Array(_) => "array",
        }
    }
}

impl GgufValue {
    /// The type's name, with the element type for arrays (`array<string>`).
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::U8(_) => "u8".into(),
            GgufValue::I8(_) => "i8".into(),
            GgufValue::U16(_) => "u16".into(),
            GgufValue::I16(_) => "i16".into(),
            GgufValue::U32(_) => "u32".into(),
            GgufValue::I32(_) => "i32".into(),
            GgufValue::U64(_) => "u64".into(),
            GgufValue::I64(_) => "i64".into(),
            GgufValue::F32(_) => "f32".into(),
            GgufValue::F64(_) => "f64".into(),
            GgufValue::Bool(_) => "bool".into(),
            GgufValue::String(_) => "string".into(),
            GgufValue::Array(a) => format!("array<{}>", a.element_type_name()),
        }
    }

    /// The value as a signed 128-bit integer, for integer types.
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(v) => write!(f, "{v:?}"),
            GgufValue::Array(a) => write!(f, "[{} × {}]", a.len(), a.element_type_name()),
        }
    }
}

/// A metadata entry: its value and where it starts in the file.
#[derive(Debug, Clone)]
struct Entry {
    value: GgufValue,
    offset: u64,
}

/// A tensor's description from the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGML order: innermost (contiguous) first.
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Offset of the data from the start of the file, in bytes.
    pub offset: u64,
    /// Length of the data in bytes.
    pub bytes: u64,
}

impl GgufTensorInfo {
    /// The shape in row-major order (outermost first): the GGML dims reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The bytes of a GGUF file: mapped from disk or owned.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed, checked GGUF file whose tensor data stays mapped.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Entry)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and checks a GGUF file; the tensor data is memory-mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only. Kiln does not write to model files; another process
        // truncating or rewriting the file while it is mapped is outside what any reader can
        // guard against (the same contract as every mmap-based model loader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        GgufFile::parse(path.to_path_buf(), Bytes::Mapped(map))
    }

    /// Parses a GGUF file held in memory; `name` stands for the path in errors.
    pub fn from_bytes(bytes: Vec<u8>, name: impl Into<PathBuf>) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<GgufFile> {
        let header = Header::parse(bytes.as_slice()).map_err(|(offset, kind)| Error::Gguf {
            path: path.clone(),
            offset,
            kind,
        })?;
        Ok(GgufFile {
            path,
            bytes,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata_index: header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect(),
            metadata: header.metadata,
            tensor_index: header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect(),
            tensors: header.tensors,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment (`general.alignment`, or 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The offset of the data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Length of the file in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    fn error(&self, offset: u64, kind: GgufErrorKind) -> Error {
        Error::Gguf { path: self.path.clone(), offset, kind }
    }

    // ---- metadata ------------------------------------------------------------------------

    /// The metadata keys and values, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, e)| (k.as_str(), &e.value))
    }

    /// The number of metadata entries.
    pub fn metadata_len(&self) -> usize {
        self.metadata.len()
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entry(key).map(|e| &e.value)
    }

    fn entry(&self, key: &str) -> Option<&Entry> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn required(&self, key: &str) -> Result<&Entry> {
        self.entry(key).ok_or_else(|| self.error(0, GgufErrorKind::MissingKey { key: key.to_string() }))
    }

    fn wrong_type(&self, key: &str, entry: &Entry, expected: &'static str) -> Error {
        self.error(
            entry.offset,
            GgufErrorKind::WrongType { key: key.to_string(), expected, found: entry.value.type_name() },
        )
    }

    fn integer<T: TryFrom<i128>>(&self, key: &str, entry: &Entry, expected: &'static str) -> Result<T> {
        let Some(v) = entry.value.as_integer() else {
            return Err(self.wrong_type(key, entry, expected));
        };
        T::try_from(v).map_err(|_| {
            self.error(
                entry.offset,
                GgufErrorKind::ValueOutOfRange { key: key.to_string(), value: v.to_string(), expected },
            )
        })
    }

    /// An unsigned 32-bit value; any integer type is accepted when the value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.integer(key, self.required(key)?, "u32")
    }

    /// [`GgufFile::get_u32`], or `None` when the key is absent.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.entry(key).map(|e| self.integer(key, e, "u32")).transpose()
    }

    /// An unsigned 64-bit value; any integer type is accepted when the value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.integer(key, self.required(key)?, "u64")
    }

    /// [`GgufFile::get_u64`], or `None` when the key is absent.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.entry(key).map(|e| self.integer(key, e, "u64")).transpose()
    }

    /// A signed 32-bit value; any integer type is accepted when the value fits.
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.integer(key, self.required(key)?, "i32")
    }

    /// [`GgufFile::get_i32`], or `None` when the key is absent.
    pub fn opt_i32(&self, key: &str) -> Result<Option<i32>> {
        self.entry(key).map(|e| self.integer(key, e, "i32")).transpose()
    }

    fn float(&self, key: &str, entry: &Entry) -> Result<f32> {
        match entry.value {
            GgufValue::F32(v) => Ok(v),
            // Some writers store hyperparameters as f64; narrowing is what the model computes in.
            GgufValue::F64(v) => Ok(v as f32),
            _ => Err(self.wrong_type(key, entry, "f32")),
        }
    }

    /// A float value (f32, or f64 narrowed to f32).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.float(key, self.required(key)?)
    }

    /// [`GgufFile::get_f32`], or `None` when the key is absent.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.entry(key).map(|e| self.float(key, e)).transpose()
    }

    fn boolean(&self, key: &str, entry: &Entry) -> Result<bool> {
        match entry.value {
            GgufValue::Bool(v) => Ok(v),
            _ => Err(self.wrong_type(key, entry, "bool")),
        }
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.boolean(key, self.required(key)?)
    }

    /// [`GgufFile::get_bool`], or `None` when the key is absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.entry(key).map(|e| self.boolean(key, e)).transpose()
    }

    fn string<'a>(&self, key: &str, entry: &'a Entry) -> Result<&'a str> {
        match &entry.value {
            GgufValue::String(v) => Ok(v),
            _ => Err(self.wrong_type(key, entry, "string")),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.string(key, self.required(key)?)
    }

    /// [`GgufFile::get_str`], or `None` when the key is absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.entry(key).map(|e| self.string(key, e)).transpose()
    }

    fn array<'a, T>(
        &self,
        key: &str,
        entry: &'a Entry,
        expected: &'static str,
        pick: impl Fn(&'a GgufArray) -> Option<&'a [T]>,
    ) -> Result<&'a [T]> {
        match &entry.value {
            GgufValue::Array(a) => pick(a),
            _ => None,
        }
        .ok_or_else(|| self.wrong_type(key, entry, expected))
    }

    /// An array of strings.
    pub fn get_string_array(&self, key: &str) -> Result<&[String]> {
        self.array(key, self.required(key)?, "array<string>", string_array)
    }

    /// [`GgufFile::get_string_array`], or `None` when the key is absent.
    pub fn opt_string_array(&self, key: &str) -> Result<Option<&[String]>> {
        self.entry(key).map(|e| self.array(key, e, "array<string>", string_array)).transpose()
    }

    /// An array of f32.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        self.array(key, self.required(key)?, "array<f32>", f32_array)
    }

    /// [`GgufFile::get_f32_array`], or `None` when the key is absent.
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<&[f32]>> {
        self.entry(key).map(|e| self.array(key, e, "array<f32>", f32_array)).transpose()
    }

    /// An array of i32.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        self.array(key, self.required(key)?, "array<i32>", i32_array)
    }

    /// [`GgufFile::get_i32_array`], or `None` when the key is absent.
    pub fn opt_i32_array(&self, key: &str) -> Result<Option<&[i32]>> {
        self.entry(key).map(|e| self.array(key, e, "array<i32>", i32_array)).transpose()
    }

    /// An array of u32.
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32]> {
        self.array(key, self.required(key)?, "array<u32>", u32_array)
    }

    /// [`GgufFile::get_u32_array`], or `None` when the key is absent.
    pub fn opt_u32_array(&self, key: &str) -> Result<Option<&[u32]>> {
        self.entry(key).map(|e| self.array(key, e, "array<u32>", u32_array)).transpose()
    }

    // ---- tensors -------------------------------------------------------------------------

    /// The tensor names, in header order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    /// Every tensor info, in header order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The description of tensor `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            model: self.path.display().to_string(),
            tensor: name.to_string(),
        })
    }

    /// The raw bytes of tensor `name`, borrowed from the mapping.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.require_tensor(name)?;
        // Offsets and lengths were checked against the file length when the header was parsed.
        let start = info.offset as usize;
        let end = start + info.bytes as usize;
        self.bytes.as_slice().get(start..end).ok_or_else(|| {
            self.error(
                info.offset,
                GgufErrorKind::BadOffset {
                    name: name.to_string(),
                    start: info.offset,
                    end: end as u64,
                    reason: "runs past the end of the file",
                },
            )
        })
    }

    /// A host copy of tensor `name`, shaped row-major (the GGML dims reversed).
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.require_tensor(name)?;
        let shape = info
            .shape()
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| Error::SizeOverflow { shape: info.shape(), dtype: info.dtype.name() })?;
        Tensor::from_bytes(self.tensor_bytes(name)?, info.dtype, &shape)
    }
}

fn string_array(a: &GgufArray) -> Option<&[String]> {
    match a {
        GgufArray::String(v) => Some(v),
        _ => None,
    }
}
fn f32_array(a: &GgufArray) -> Option<&[f32]> {
    match a {
        GgufArray::F32(v) => Some(v),
        _ => None,
    }
}
fn i32_array(a: &GgufArray) -> Option<&[i32]> {
    match a {
        GgufArray::I32(v) => Some(v),
        _ => None,
    }
}
fn u32_array(a: &GgufArray) -> Option<&[u32]> {
    match a {
        GgufArray::U32(v) => Some(v),
        _ => None,
    }
}

// ---- parsing -----------------------------------------------------------------------------

type ParseError = (u64, GgufErrorKind);
type Parse<T> = std::result::Result<T, ParseError>;

/// The parsed header, before it is joined with its bytes.
struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Entry)>,
    tensors: Vec<GgufTensorInfo>,
}

/// A cursor over the file's bytes that checks every read.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn fail<T>(&self, kind: GgufErrorKind) -> Parse<T> {
        Err((self.offset(), kind))
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Parse<&'a [u8]> {
        if n > self.remaining() {
            return self.fail(GgufErrorKind::Truncated {
                what: what(),
                needed: n - self.remaining(),
                available: self.bytes.len() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Parse<[u8; N]> {
        let bytes = self.take(N as u64, || what.to_string())?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of records whose smallest encoding is `min_bytes`: refused if the remaining bytes
    /// cannot hold that many.
    fn count(&mut self, what: &'static str, min_bytes: u64) -> Parse<u64> {
        let start = self.pos;
        let count = self.u64(what)?;
        if count.checked_mul(min_bytes).is_none_or(|need| need > self.remaining()) {
            return Err((
                start as u64,
                GgufErrorKind::AbsurdCount { what, count, file_bytes: self.bytes.len() as u64 },
            ));
        }
        Ok(count)
    }

    fn string(&mut self, what: impl Fn() -> String) -> Parse<String> {
        let start = self.pos;
        let len = self.u64(&what())?;
        let bytes = self.take(len, || format!("{} ({len} bytes)", what()))?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err((start as u64, GgufErrorKind::NotUtf8 { what: what() })),
        }
    }
}

// Metadata value type codes.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// The smallest encoding of one value of type `code`.
fn min_value_bytes(code: u32) -> Option<u64> {
    Some(match code {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 4 + 8,
        _ => return None,
    })
}

impl Header {
    fn parse(bytes: &[u8]) -> Parse<Header> {
        let mut r = Reader { bytes, pos: 0 };
        let magic: [u8; 4] = r.array("magic")?;
        if magic != GGUF_MAGIC {
            return Err((0, GgufErrorKind::BadMagic { found: magic }));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err((4, GgufErrorKind::UnsupportedVersion { version }));
        }
        let tensor_count = r.count("tensor", MIN_TENSOR_INFO_BYTES)?;
        let kv_count = r.count("metadata", MIN_KV_BYTES)?;

        // The counts were checked against the remaining bytes, so these allocations are bounded.
        let mut metadata: Vec<(String, Entry)> = Vec::with_capacity(kv_count as usize);
        let mut seen: HashMap<String, ()> = HashMap::with_capacity(kv_count as usize);
        for _ in 0..kv_count {
            let offset = r.offset();
            let key = r.string(|| "metadata key".to_string())?;
            if seen.insert(key.clone(), ()).is_some() {
                return Err((offset, GgufErrorKind::DuplicateKey { key }));
            }
            let code = r.u32(&format!("value type of `{key}`"))?;
            let value = read_value(&mut r, &key, code, 0)?;
            metadata.push((key, Entry { value, offset }));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((key, entry)) => {
                let value = match entry.value {
                    GgufValue::U32(v) => u64::from(v),
                    GgufValue::U64(v) => v,
                    ref other => {
                        return Err((
                            entry.offset,
                            GgufErrorKind::WrongType {
                                key: key.clone(),
                                expected: "u32",
                                found: other.type_name(),
                            },
                        ))
                    }
                };
                let reason = if value == 0 {
                    Some("zero")
                } else if !value.is_power_of_two() {
                    Some("not a power of two")
                } else if value > MAX_ALIGNMENT {
                    Some("larger than 65536")
                } else {
                    None
                };
                if let Some(reason) = reason {
                    return Err((entry.offset, GgufErrorKind::BadAlignment { value, reason }));
                }
                value
            }
        };

        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut names: HashMap<String, ()> = HashMap::with_capacity(tensor_count as usize);
        let mut relative_offsets = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let offset = r.offset();
            let name = r.string(|| "tensor name".to_string())?;
            if names.insert(name.clone(), ()).is_some() {
                return Err((offset, GgufErrorKind::DuplicateTensor { name }));
            }
            let bad = |reason: String| (offset, GgufErrorKind::BadTensor { name: name.clone(), reason });
            let n_dims = r.u32(&format!("dimension count of `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad(format!("{n_dims} dimensions (GGML allows 1 to {MAX_DIMS})")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for i in 0..n_dims {
                let d = r.u64(&format!("dimension {i} of `{name}`"))?;
                if d == 0 || d > i64::MAX as u64 {
                    return Err(bad(format!("dimension {i} is {}", d as i64)));
                }
                dims.push(d);
            }
            let type_id = r.u32(&format!("type of `{name}`"))?;
            let dtype = DType::from_gguf(type_id)
                .map_err(|_| (offset, GgufErrorKind::UnknownTensorType { name: name.clone(), type_id }))?;
            let relative = r.u64(&format!("offset of `{name}`"))?;
            let Some(elements) = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)) else {
                return Err(bad(format!("element count of dims {dims:?} overflows")));
            };
            if dims[0] % dtype.block_size() != 0 {
                return Err(bad(format!(
                    "first dimension {} is not a multiple of the {dtype} block size {}",
                    dims[0],
                    dtype.block_size()
                )));
            }
            let Some(bytes) = (elements / dtype.block_size()).checked_mul(dtype.block_bytes()) else {
                return Err(bad(format!("byte size of {elements} {dtype} elements overflows")));
            };
            if relative % alignment != 0 {
                return Err((
                    offset,
                    GgufErrorKind::BadOffset {
                        name,
                        start: relative,
                        end: relative.saturating_add(bytes),
                        reason: "is not aligned to general.alignment",
                    },
                ));
            }
            relative_offsets.push(offset);
            tensors.push(GgufTensorInfo { name, dims, dtype, offset: relative, bytes });
        }

        let header_end = r.offset();
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        if tensors.is_empty() {
            return Ok(Header { version, alignment, data_offset, metadata, tensors });
        }

        // Walk the tensors in data order: each must start where the previous ended (rounded up to
        // the alignment), and the last must end within the file, followed by padding at most.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        let mut expected_start = 0u64;
        for &i in &order {
            let t = &tensors[i];
            let at = relative_offsets[i];
            let end = t.offset.checked_add(t.bytes);
            let bad_offset = |end: u64, reason| GgufErrorKind::BadOffset {
                name: t.name.clone(),
                start: t.offset,
                end,
                reason,
            };
            let Some(end) = end else {
                return Err((at, bad_offset(u64::MAX, "overflows")));
            };
            if t.offset < expected_start {
                return Err((at, bad_offset(end, "overlaps the previous tensor")));
            }
            if t.offset > expected_start {
                return Err((at, bad_offset(end, "leaves a gap after the previous tensor")));
            }
            let absolute_end = data_offset.checked_add(end).filter(|&e| e <= file_len);
            if absolute_end.is_none() {
                return Err((at, bad_offset(end, "runs past the end of the file")));
            }
            expected_start = end.div_ceil(alignment) * alignment;
        }
        let data_end = data_offset + order.last().map_or(0, |&i| tensors[i].offset + tensors[i].bytes);
        if file_len - data_end >= alignment {
            return Err((data_end, GgufErrorKind::TrailingBytes { bytes: file_len - data_end, alignment }));
        }
        for t in &mut tensors {
            // Cannot overflow: checked above against the file length.
            t.offset += data_offset;
        }
        Ok(Header { version, alignment, data_offset, metadata, tensors })
    }
}

fn read_value(r: &mut Reader<'_>, key: &str, code: u32, depth: u32) -> Parse<GgufValue> {
    let what = || format!("value of `{key}`");
    Ok(match code {
        T_U8 => GgufValue::U8(r.array::<1>(&what())?[0]),
        T_I8 => GgufValue::I8(r.array::<1>(&what())?[0] as i8),
        T_U16 => GgufValue::U16(u16::from_le_bytes(r.array(&what())?)),
        T_I16 => GgufValue::I16(i16::from_le_bytes(r.array(&what())?)),
        T_U32 => GgufValue::U32(u32::from_le_bytes(r.array(&what())?)),
        T_I32 => GgufValue::I32(i32::from_le_bytes(r.array(&what())?)),
        T_F32 => GgufValue::F32(f32::from_le_bytes(r.array(&what())?)),
        T_U64 => GgufValue::U64(u64::from_le_bytes(r.array(&what())?)),
        T_I64 => GgufValue::I64(i64::from_le_bytes(r.array(&what())?)),
        T_F64 => GgufValue::F64(f64::from_le_bytes(r.array(&what())?)),
        T_BOOL => GgufValue::Bool(read_bool(r, key)?),
        T_STRING => GgufValue::String(r.string(what)?),
        T_ARRAY => GgufValue::Array(read_array(r, key, depth + 1)?),
        _ => return r.fail(GgufErrorKind::UnknownValueType { key: key.to_string(), code }),
    })
}

fn read_bool(r: &mut Reader<'_>, key: &str) -> Parse<bool> {
    let at = r.offset();
    match r.array::<1>(&format!("value of `{key}`"))?[0] {
        0 => Ok(false),
        1 => Ok(true),
        other => Err((at, GgufErrorKind::BadBool { key: key.to_string(), value: other })),
    }
}

fn read_array(r: &mut Reader<'_>, key: &str, depth: u32) -> Parse<GgufArray> {
    if depth > MAX_ARRAY_NESTING {
        return r.fail(GgufErrorKind::NestingTooDeep { key: key.to_string(), limit: MAX_ARRAY_NESTING });
    }
    let code = r.u32(&format!("array element type of `{key}`"))?;
    let Some(min_bytes) = min_value_bytes(code) else {
        return r.fail(GgufErrorKind::UnknownValueType { key: key.to_string(), code });
    };
    let len = r.count("array element", min_bytes)? as usize;
    let what = format!("array `{key}`");

    macro_rules! numbers {
        ($variant:ident, $t:ty) => {{
            const SIZE: usize = std::mem::size_of::<$t>();
            let bytes = r.take((len * SIZE) as u64, || what.clone())?;
            GgufArray::$variant(
                bytes
                    .chunks_exact(SIZE)
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
            )
        }};
    }
    Ok(match code {
        T_U8 => GgufArray::U8(r.take(len as u64, || what.clone())?.to_vec()),
        T_I8 => GgufArray::I8(r.take(len as u64, || what.clone())?.iter().map(|&b| b as i8).collect()),
        T_U16 => numbers!(U16, u16),
        T_I16 => numbers!(I16, i16),
        T_U32 => numbers!(U32, u32),
        T_I32 => numbers!(I32, i32),
        T_F32 => numbers!(F32, f32),
        T_U64 => numbers!(U64, u64),
        T_I64 => numbers!(I64, i64),
        T_F64 => numbers!(F64, f64),
        T_BOOL => GgufArray::Bool((0..len).map(|_| read_bool(r, key)).collect::<Parse<_>>()?),
        T_STRING => GgufArray::String(
            (0..len).map(|i| r.string(|| format!("element {i} of `{key}`"))).collect::<Parse<_>>()?,
        ),
        T_ARRAY => GgufArray::Array((0..len).map(|_| read_array(r, key, depth + 1)).collect::<Parse<_>>()?),
        // min_value_bytes() accepted the code, so it is one of the above.
        _ => return r.fail(GgufErrorKind::UnknownValueType { key: key.to_string(), code }),
    })
}
