//! Launcher of `kernels/embedding.cu`: the embedding lookup of `kiln_core::ops::embedding` on the
//! GPU, equal to the CPU reference bit for bit for every [`EmbeddingVariant`].
//!
//! Buffers: `ids` holds one u32 per row; the table is `vocab` rows as stored (bf16, fp16, fp32, or
//! Q8_0 blocks of an fp16 scale and 32 int8 codes); `out` is `rows x hidden` values of the output
//! type; `sum_squares`, when asked for, one fp32 per row (the fixed-order unit sum of the row's
//! squared output values, the norm's units); `flag` is one u32 that the kernel sets to 1 when an
//! id is outside the vocabulary (that row is zero). The kernel never clears the flag: clear it
//! with `fill_bytes(0)` and read it with [`read_flag`].

use cudarc::driver::LaunchConfig;
use kiln_core::ops::primitives::{FloatType, UNIT};
use kiln_core::{DType, Error, Result};

use crate::kernels::EMBEDDING;
use crate::memory::DeviceMemory;
use crate::runtime::{driver_error, Gpu};

/// Bytes of one Q8_0 block (an fp16 scale, 32 int8 codes) and its values.
const Q8_0_BLOCK_BYTES: usize = 34;
const Q8_0_BLOCK: usize = 32;

/// Most dynamic shared memory a block may use without raising its limit.
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// One shape of the embedding kernel: warps that share a row, and rows per thread block. Every
/// variant computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EmbeddingVariant {
    pub warps_per_row: u32,
    pub rows_per_block: u32,
}

/// The variants, as data; the tests run every one.
pub const EMBEDDING_VARIANTS: &[EmbeddingVariant] = &[
    EmbeddingVariant { warps_per_row: 1, rows_per_block: 1 },
    EmbeddingVariant { warps_per_row: 1, rows_per_block: 4 },
    EmbeddingVariant { warps_per_row: 2, rows_per_block: 2 },
    EmbeddingVariant { warps_per_row: 4, rows_per_block: 1 },
    EmbeddingVariant { warps_per_row: 4, rows_per_block: 2 },
    EmbeddingVariant { warps_per_row: 8, rows_per_block: 1 },
    EmbeddingVariant { warps_per_row: 16, rows_per_block: 1 },
];

impl EmbeddingVariant {
    /// The default variant for rows of `hidden` elements: about two units per warp, at most 8
    /// warps per row, 4 warps per block or more.
    pub fn default_for(hidden: usize) -> EmbeddingVariant {
        let warps = hidden.div_ceil(UNIT).div_ceil(2).next_power_of_two().clamp(1, 8) as u32;
        EmbeddingVariant { warps_per_row: warps, rows_per_block: (4 / warps).max(1) }
    }
}

/// The shape and types of an embedding lookup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbeddingCall {
    pub rows: usize,
    pub vocab: usize,
    pub hidden: usize,
    /// F32, F16, BF16 or Q8_0.
    pub table_type: DType,
    /// F32, F16 or BF16.
    pub out_type: DType,
    /// Whether to write each row's sum of squares.
    pub sum_squares: bool,
}

/// Device buffers of one lookup (see the module docs for their layouts).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingBuffers<'a> {
    pub ids: &'a DeviceMemory,
    pub table: &'a DeviceMemory,
    pub out: &'a DeviceMemory,
    pub sum_squares: Option<&'a DeviceMemory>,
    pub flag: &'a DeviceMemory,
}

fn not_served(reason: String) -> Error {
    Error::NotServed { op: "embedding kernel", reason }
}

impl EmbeddingCall {
    /// Bytes of one table row.
    pub fn row_bytes(&self) -> Result<usize> {
        match self.table_type {
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

    /// Checks what the kernel serves; returns the dynamic shared memory bytes of `variant`.
    pub fn validate(&self, variant: EmbeddingVariant) -> Result<usize> {
        self.row_bytes()?;
        FloatType::of(self.out_type, "embedding output")?;
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return Err(not_served(format!("rows of {} elements (needs a multiple of 8)", self.hidden)));
        }
        if i32::try_from(self.hidden).is_err() || u32::try_from(self.vocab).is_err() {
            return Err(not_served(format!("a {} x {} table", self.vocab, self.hidden)));
        }
        let shared = if self.sum_squares && variant.warps_per_row > 1 {
            variant.rows_per_block as usize * self.hidden.div_ceil(UNIT) * 4
        } else {
            0
        };
        if shared > MAX_SHARED_BYTES {
            return Err(not_served(format!(
                "{} rows per block of {} elements need {shared} bytes of shared memory",
                variant.rows_per_block, self.hidden
            )));
        }
        Ok(shared)
    }

    /// The compile-time constants of this call on `variant`.
    pub fn defines(&self, variant: EmbeddingVariant) -> Result<Vec<(&'static str, String)>> {
        self.validate(variant)?;
        let table = match self.table_type {
            DType::Q8_0 => 3,
            other => float_code(FloatType::of(other, "embedding table")?),
        };
        Ok(vec![
            ("TABLE_T", table.to_string()),
            ("OUT_T", float_code(FloatType::of(self.out_type, "embedding output")?).to_string()),
            ("SUM_SQUARES", if self.sum_squares { "1" } else { "0" }.to_owned()),
            ("WARPS_PER_ROW", variant.warps_per_row.to_string()),
            ("ROWS_PER_BLOCK", variant.rows_per_block.to_string()),
        ])
    }

    /// Bytes of the table, of the output and of the sums.
    pub fn buffer_bytes(&self) -> Result<(usize, usize, usize)> {
        let out = self.rows * self.hidden * FloatType::of(self.out_type, "embedding output")?.bytes();
        Ok((self.vocab * self.row_bytes()?, out, if self.sum_squares { 4 * self.rows } else { 0 }))
    }
}

fn float_code(t: FloatType) -> u32 {
    match t {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 2,
    }
}

/// Whether a kernel has set the u32 `flag` (out of vocabulary, position outside the RoPE table);
/// waits for the work queued before it.
pub fn read_flag(flag: &DeviceMemory) -> Result<bool> {
    let mut word = [0u8; 4];
    flag.copy_to_host(0, &mut word)?;
    Ok(u32::from_le_bytes(word) != 0)
}

/// Runs the lookup `call` on `gpu`'s stream with `variant` (or the default for the row length).
pub fn embedding(
    gpu: &Gpu,
    call: &EmbeddingCall,
    buffers: EmbeddingBuffers<'_>,
    variant: Option<EmbeddingVariant>,
) -> Result<()> {
    let variant = variant.unwrap_or_else(|| EmbeddingVariant::default_for(call.hidden));
    let defines = call.defines(variant)?;
    let shared = call.validate(variant)?;
    let (table_bytes, out_bytes, sum_bytes) = call.buffer_bytes()?;
    super::check_buffer("embedding", "ids", buffers.ids.len_bytes(), 4 * call.rows)?;
    super::check_buffer("embedding", "table", buffers.table.len_bytes(), table_bytes)?;
    super::check_buffer("embedding", "out", buffers.out.len_bytes(), out_bytes)?;
    super::check_buffer("embedding", "flag", buffers.flag.len_bytes(), 4)?;
    if buffers.sum_squares.is_some() != call.sum_squares {
        return Err(Error::InvalidArgument {
            name: "sum_squares",
            value: if buffers.sum_squares.is_some() { "given" } else { "missing" }.to_owned(),
            reason: format!("the call {} it", if call.sum_squares { "needs" } else { "does not use" }),
        });
    }
    super::check_buffer(
        "embedding",
        "sum_squares",
        buffers.sum_squares.map_or(0, DeviceMemory::len_bytes),
        sum_bytes,
    )?;

    let define_refs: Vec<(&str, &str)> = defines.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let function = gpu.function(&EMBEDDING, "kiln_embedding", &define_refs)?;
    if call.rows == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(call.rows.div_ceil(variant.rows_per_block as usize))
        .map_err(|_| not_served(format!("{} rows", call.rows)))?;
    let threads = 32 * variant.warps_per_row * variant.rows_per_block;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    // In range: validate checked both.
    let (hidden, vocab) = (call.hidden as i32, call.vocab as u32);
    let (rows, row_bytes) = (call.rows as i64, call.row_bytes()? as i64);

    let (ids, table, out) = (buffers.ids.device_ptr(), buffers.table.device_ptr(), buffers.out.device_ptr());
    let sums = buffers.sum_squares.map_or(0u64, DeviceMemory::device_ptr);
    let flag = buffers.flag.device_ptr();
    let mut launch = gpu.launch_builder(&function);
    launch
        .arg(&ids)
        .arg(&table)
        .arg(&out)
        .arg(&sums)
        .arg(&flag)
        .arg(&rows)
        .arg(&hidden)
        .arg(&vocab)
        .arg(&row_bytes);
    // SAFETY: the argument list matches `kiln_embedding`'s signature (5 pointers, i64, i32, u32,
    // i64); `sum_squares` is null only when SUM_SQUARES is 0; every buffer was checked above to
    // hold what the kernel touches for `rows` rows (table rows are read only for ids below
    // `vocab`); the dynamic shared memory is what the kernel indexes (`rows_per_block x units`
    // floats, within the default 48 KiB); the blocks come from this device's pool, which reuses
    // memory only in this stream's order.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_embedding)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_variants_are_listed_and_every_variant_serves_16384() {
        for hidden in (8..=16_384).step_by(8) {
            assert!(EMBEDDING_VARIANTS.contains(&EmbeddingVariant::default_for(hidden)), "{hidden}");
        }
        let call = EmbeddingCall {
            rows: 5,
            vocab: 100,
            hidden: 16_384,
            table_type: DType::Q8_0,
            out_type: DType::F32,
            sum_squares: true,
        };
        for &v in EMBEDDING_VARIANTS {
            assert!(call.validate(v).is_ok(), "{v:?}");
        }
        assert_eq!(call.row_bytes().unwrap(), 16_384 / 32 * 34);
    }

    #[test]
    fn unserved_calls_are_named() {
        let v = EMBEDDING_VARIANTS[0];
        let call = EmbeddingCall {
            rows: 1,
            vocab: 10,
            hidden: 100,
            table_type: DType::BF16,
            out_type: DType::BF16,
            sum_squares: false,
        };
        assert!(matches!(call.validate(v), Err(Error::NotServed { op: "embedding kernel", .. })));
        let call = EmbeddingCall { hidden: 48, table_type: DType::Q8_0, ..call };
        assert!(matches!(call.validate(v), Err(Error::NotBlockAligned { .. })));
        let call = EmbeddingCall { table_type: DType::Q4_0, hidden: 64, ..call };
        assert!(matches!(call.validate(v), Err(Error::DTypeNotServed { .. })));
    }
}
