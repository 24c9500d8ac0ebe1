//! Element types and their table.
//!
//! The facts about each type (bits, block size, bytes per block, its code in safetensors and in
//! GGUF, whether Kiln serves it) live in `dtypes.toml`, read once and checked against the
//! [`DType`] enum. A code that the table does not list is a named error, never a guess.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde::Deserialize;

use crate::error::{Error, Result};

macro_rules! dtypes {
    ($($variant:ident),* $(,)?) => {
        /// An element type: a plain number format or a GGML block-quantized format.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[allow(non_camel_case_types)]
        pub enum DType { $($variant),* }

        impl DType {
            /// Every dtype, in declaration order.
            pub const ALL: &'static [DType] = &[$(DType::$variant),*];

            /// The dtype's name as written in `dtypes.toml`.
            pub const fn name(self) -> &'static str {
                match self { $(DType::$variant => stringify!($variant)),* }
            }
        }
    };
}

dtypes!(
    F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I8, I16, I32, I64, U8, U16, U32, U64, BOOL, Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S,
    IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0, MXFP4,
);

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One row of `dtypes.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DTypeInfo {
    /// The name, equal to the [`DType`] variant.
    pub name: String,
    /// Storage bits per element, for plain (non-block) types.
    #[serde(default)]
    pub bits: Option<u32>,
    /// Elements per block (1 for plain types).
    pub block_size: u32,
    /// Bytes per block.
    pub block_bytes: u32,
    /// The dtype string in a safetensors header, if it has one.
    #[serde(default)]
    pub safetensors: Option<String>,
    /// The GGML type id in a GGUF tensor info, if it has one.
    #[serde(default)]
    pub gguf: Option<u32>,
    /// Whether Kiln computes with this type; `false` means "recognised, not served".
    pub served: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    dtype: Vec<DTypeInfo>,
}

/// The parsed, checked dtype table.
struct Table {
    info: Vec<DTypeInfo>,
    by_safetensors: HashMap<String, DType>,
    by_gguf: HashMap<u32, DType>,
    by_name: HashMap<String, DType>,
}

const TABLE_SOURCE: &str = include_str!("dtypes.toml");

fn build_table(source: &str) -> Result<Table> {
    let file: TableFile = toml::from_str(source).map_err(|e| Error::DTypeTable { reason: e.to_string() })?;
    if file.dtype.len() != DType::ALL.len() {
        return Err(Error::DTypeTable {
            reason: format!("{} rows for {} dtypes", file.dtype.len(), DType::ALL.len()),
        });
    }
    let mut by_safetensors = HashMap::new();
    let mut by_gguf = HashMap::new();
    let mut by_name = HashMap::new();
    for (row, &dtype) in file.dtype.iter().zip(DType::ALL) {
        if row.name != dtype.name() {
            return Err(Error::DTypeTable {
                reason: format!("row `{}` where `{}` was expected", row.name, dtype.name()),
            });
        }
        if row.block_size == 0 || row.block_bytes == 0 {
            return Err(Error::DTypeTable { reason: format!("{}: empty block", row.name) });
        }
        if row.block_size == 1 && row.bits != Some(row.block_bytes * 8) {
            return Err(Error::DTypeTable {
                reason: format!("{}: bits disagree with block_bytes", row.name),
            });
        }
        if let Some(code) = &row.safetensors {
            if by_safetensors.insert(code.clone(), dtype).is_some() {
                return Err(Error::DTypeTable { reason: format!("safetensors code {code} twice") });
            }
        }
        if let Some(code) = row.gguf {
            if by_gguf.insert(code, dtype).is_some() {
                return Err(Error::DTypeTable { reason: format!("GGUF code {code} twice") });
            }
        }
        by_name.insert(row.name.clone(), dtype);
    }
    Ok(Table { info: file.dtype, by_safetensors, by_gguf, by_name })
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| match build_table(TABLE_SOURCE) {
        Ok(table) => table,
        // The table is compiled into the binary and checked by a unit test; a failure here is a
        // build defect, not bad input.
        Err(e) => panic!("built-in dtypes.toml is inconsistent: {e}"),
    })
}

impl DType {
    /// The row of the dtype table for this type.
    pub fn info(self) -> &'static DTypeInfo {
        &table().info[self as usize]
    }

    /// Elements per block: 1 for plain types, 32 or 256 for GGML quantized types.
    pub fn block_size(self) -> u64 {
        u64::from(self.info().block_size)
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        u64::from(self.info().block_bytes)
    }

    /// Whether the type is block-quantized (more than one element per block).
    pub fn is_quantized(self) -> bool {
        self.info().block_size > 1
    }

    /// Whether Kiln computes with this type.
    pub fn is_served(self) -> bool {
        self.info().served
    }

    /// Bytes per element of a plain type (`None` for block types).
    pub fn size_in_bytes(self) -> Option<usize> {
        (self.info().block_size == 1).then_some(self.info().block_bytes as usize)
    }

    /// Whether the type is a floating-point type with one element per block.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8_E4M3 | DType::F8_E5M2)
    }

    /// The bytes that `elements` elements occupy, checking block alignment and overflow.
    pub fn bytes_for(self, elements: u64) -> Result<u64> {
        let block = self.block_size();
        if !elements.is_multiple_of(block) {
            return Err(Error::NotBlockAligned { dtype: self.name(), elements, block_size: block });
        }
        (elements / block)
            .checked_mul(self.block_bytes())
            .ok_or(Error::SizeOverflow { shape: vec![elements], dtype: self.name() })
    }

    /// The dtype of a safetensors header string (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn from_safetensors(code: &str) -> Result<DType> {
        table()
            .by_safetensors
            .get(code)
            .copied()
            .ok_or_else(|| Error::UnknownDTypeCode { format: "safetensors", code: code.to_string() })
    }

    /// The dtype of a GGML type id in a GGUF tensor info.
    pub fn from_gguf(code: u32) -> Result<DType> {
        table()
            .by_gguf
            .get(&code)
            .copied()
            .ok_or_else(|| Error::UnknownDTypeCode { format: "GGUF", code: code.to_string() })
    }

    /// The dtype of a name as written in `dtypes.toml` (case-insensitive).
    pub fn from_name(name: &str) -> Result<DType> {
        table()
            .by_name
            .get(&name.to_ascii_uppercase())
            .copied()
            .ok_or_else(|| Error::UnknownDTypeName { name: name.to_string() })
    }

    /// The GGML type id, if the type has one.
    pub fn gguf_code(self) -> Option<u32> {
        self.info().gguf
    }

    /// The safetensors header string, if the type has one.
    pub fn safetensors_code(self) -> Option<&'static str> {
        self.info().safetensors.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent_with_enum() {
        let table = build_table(TABLE_SOURCE).expect("table");
        assert_eq!(table.info.len(), DType::ALL.len());
        for &d in DType::ALL {
            assert_eq!(d.info().name, d.name());
        }
    }

    #[test]
    fn ggml_block_sizes_match_their_layouts() {
        // Bytes per block from the block structs of ggml-common.h, computed independently of
        // the table: scales (f16 = 2 bytes) plus packed quants.
        let expected: &[(DType, u64, u64)] = &[
            (DType::Q4_0, 32, 2 + 16),
            (DType::Q4_1, 32, 2 + 2 + 16),
            (DType::Q5_0, 32, 2 + 4 + 16),
            (DType::Q5_1, 32, 2 + 2 + 4 + 16),
            (DType::Q8_0, 32, 2 + 32),
            (DType::Q8_1, 32, 2 + 2 + 32),
            (DType::Q2_K, 256, 16 + 64 + 2 + 2),
            (DType::Q3_K, 256, 32 + 64 + 12 + 2),
            (DType::Q4_K, 256, 2 + 2 + 12 + 128),
            (DType::Q5_K, 256, 2 + 2 + 12 + 32 + 128),
            (DType::Q6_K, 256, 128 + 64 + 16 + 2),
            (DType::Q8_K, 256, 4 + 256 + 32),
            (DType::IQ4_NL, 32, 2 + 16),
            (DType::IQ4_XS, 256, 2 + 2 + 4 + 128),
        ];
        for &(d, block, bytes) in expected {
            assert_eq!((d.block_size(), d.block_bytes()), (block, bytes), "{d}");
            assert!(d.is_served());
        }
    }

    #[test]
    fn codes_round_trip() {
        for &d in DType::ALL {
            if let Some(code) = d.gguf_code() {
                assert_eq!(DType::from_gguf(code).unwrap(), d);
            }
            if let Some(code) = d.safetensors_code() {
                assert_eq!(DType::from_safetensors(code).unwrap(), d);
            }
            assert_eq!(DType::from_name(d.name()).unwrap(), d);
        }
    }

    #[test]
    fn unknown_codes_are_named_errors() {
        match DType::from_gguf(31) {
            Err(Error::UnknownDTypeCode { format: "GGUF", code }) => assert_eq!(code, "31"),
            other => panic!("expected UnknownDTypeCode, got {other:?}"),
        }
        match DType::from_safetensors("F4") {
            Err(Error::UnknownDTypeCode { format: "safetensors", code }) => assert_eq!(code, "F4"),
            other => panic!("expected UnknownDTypeCode, got {other:?}"),
        }
        assert!(matches!(DType::from_name("Q9_9"), Err(Error::UnknownDTypeName { .. })));
    }

    #[test]
    fn iq_types_are_listed_not_served() {
        for d in [DType::IQ2_XXS, DType::IQ2_S, DType::IQ1_M, DType::TQ2_0] {
            assert!(!d.is_served(), "{d}");
        }
    }

    #[test]
    fn bytes_for_checks_alignment_and_overflow() {
        assert_eq!(DType::Q4_1.bytes_for(64).unwrap(), 40);
        assert!(matches!(DType::Q4_1.bytes_for(33), Err(Error::NotBlockAligned { .. })));
        assert!(matches!(DType::F64.bytes_for(u64::MAX), Err(Error::SizeOverflow { .. })));
    }
}
