//! Embedding lookup: the CPU reference of `kernels/embedding.cu`.
//!
//! Rows of token ids pick rows of a table in bf16, fp16, fp32 or Q8_0. A Q8_0 value is
//! `f32(d) * q` (the block's fp16 scale times the int8 code, one fp32 rounding). The result is
//! widened to fp32 or rounded once to the output type. An id outside the vocabulary gives a
//! zero row and sets [`Embedded::out_of_vocabulary`]. Optionally each row's sum of squares is
//! computed in the norm's fixed order ([`unit_sum`]), so the first RMSNorm need not reduce again.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::primitives::{f16_bits_to_f32, unit_sum, FloatType};

/// Bytes of one Q8_0 block: an fp16 scale and 32 int8 codes.
const Q8_0_BLOCK_BYTES: usize = 34;
const Q8_0_BLOCK: usize = 32;

/// An embedding table: `vocab` rows of `hidden` values, row-major, as stored.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingTable<'a> {
    pub bytes: &'a [u8],
    pub dtype: DType,
    pub vocab: usize,
    pub hidden: usize,
}

/// The lookup's results.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedded {
    /// `ids.len() * hidden` values of the output type, as fp32.
    pub values: Vec<f32>,
    /// Each row's sum of squares in the norm's units, when asked for.
    pub sum_squares: Option<Vec<f32>>,
    /// Whether some id was outside the vocabulary (its row is zero).
    pub out_of_vocabulary: bool,
}

impl EmbeddingTable<'_> {
    fn row_bytes(&self) -> Result<usize> {
        match self.dtype {
            DType::F32 => Ok(4 * self.hidden),
            DType::F16 | DType::BF16 => Ok(2 * self.hidden),
            DType::Q8_0 if self.hidden.is_multiple_of(Q8_0_BLOCK) => {
                Ok(self.hidden / Q8_0_BLOCK * Q8_0_BLOCK_BYTES)
            }
            DType::Q8_0 => Err(Error::NotBlockAligned {
                dtype: "Q8_0",
                elements: self.hidden as u64,
                block_size: Q8_0_BLOCK as u64,
            }),
            other => Err(Error::DTypeNotServed { dtype: other.name(), op: "embedding" }),
        }
    }

    /// Value `j` of row `id` (in range), widened to fp32.
    fn value(&self, row: &[u8], j: usize) -> f32 {
        match self.dtype {
            DType::Q8_0 => {
                let block = &row[(j / Q8_0_BLOCK) * Q8_0_BLOCK_BYTES..];
                let d = f16_bits_to_f32(u16::from_le_bytes([block[0], block[1]]));
                d * f32::from(block[2 + j % Q8_0_BLOCK] as i8)
            }
            DType::F32 => FloatType::F32.decode(row, j),
            DType::F16 => FloatType::F16.decode(row, j),
            _ => FloatType::BF16.decode(row, j),
        }
    }

    /// Looks up `ids`; the output is rounded to `out` (F32, F16 or BF16).
    pub fn lookup(&self, ids: &[u32], out: DType, sum_squares: bool) -> Result<Embedded> {
        let out = FloatType::of(out, "embedding output")?;
        let row_bytes = self.row_bytes()?;
        let expected = row_bytes as u64 * self.vocab as u64;
        if self.bytes.len() as u64 != expected {
            return Err(Error::ByteLength {
                what: "embedding table".into(),
                expected,
                got: self.bytes.len() as u64,
            });
        }
        let mut values = vec![0.0f32; ids.len() * self.hidden];
        let mut sums = sum_squares.then(|| vec![0.0f32; ids.len()]);
        let mut out_of_vocabulary = false;
        for (r, &id) in ids.iter().enumerate() {
            let dst = &mut values[r * self.hidden..(r + 1) * self.hidden];
            if id as usize >= self.vocab {
                out_of_vocabulary = true;
            } else {
                let row = &self.bytes[id as usize * row_bytes..(id as usize + 1) * row_bytes];
                for (j, v) in dst.iter_mut().enumerate() {
                    *v = out.round(self.value(row, j));
                }
            }
            if let Some(s) = sums.as_mut() {
                s[r] = unit_sum(self.hidden, |j| dst[j] * dst[j]);
            }
        }
        Ok(Embedded { values, sum_squares: sums, out_of_vocabulary })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_picked_and_unknown_ids_give_zero_rows() {
        let table: Vec<f32> = (0..3 * 4).map(|i| i as f32 * 0.5 - 1.0).collect();
        let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = EmbeddingTable { bytes: &bytes, dtype: DType::F32, vocab: 3, hidden: 4 };
        let e = t.lookup(&[2, 0, 7], DType::F32, true).unwrap();
        assert_eq!(&e.values[..4], &table[8..12]);
        assert_eq!(&e.values[4..8], &table[0..4]);
        assert_eq!(&e.values[8..], &[0.0; 4]);
        assert!(e.out_of_vocabulary);
        let sums = e.sum_squares.unwrap();
        assert_eq!(sums[0], table[8..12].iter().map(|v| v * v).sum::<f32>());
        assert_eq!(sums[2], 0.0);
        assert!(!t.lookup(&[1], DType::F32, false).unwrap().out_of_vocabulary);
    }

    #[test]
    fn q8_0_values_are_scale_times_code() {
        let mut bytes = Vec::new();
        for row in 0..2u8 {
            bytes.extend_from_slice(&half::f16::from_f32(0.25 + f32::from(row)).to_bits().to_le_bytes());
            bytes.extend((0..32).map(|j| (j as i8 - 16) as u8));
        }
        let t = EmbeddingTable { bytes: &bytes, dtype: DType::Q8_0, vocab: 2, hidden: 32 };
        let e = t.lookup(&[1], DType::BF16, false).unwrap();
        for j in 0..32 {
            assert_eq!(e.values[j], FloatType::BF16.round(1.25 * (j as f32 - 16.0)));
        }
    }

    #[test]
    fn malformed_tables_are_named_errors() {
        let t = EmbeddingTable { bytes: &[0; 10], dtype: DType::F32, vocab: 3, hidden: 4 };
        assert!(matches!(t.lookup(&[0], DType::F32, false), Err(Error::ByteLength { .. })));
        let t = EmbeddingTable { bytes: &[0; 34], dtype: DType::Q8_0, vocab: 1, hidden: 31 };
        assert!(matches!(t.lookup(&[0], DType::F32, false), Err(Error::NotBlockAligned { .. })));
        let t = EmbeddingTable { bytes: &[0; 4], dtype: DType::Q4_0, vocab: 1, hidden: 4 };
        assert!(matches!(t.lookup(&[0], DType::F32, false), Err(Error::DTypeNotServed { .. })));
    }
}
