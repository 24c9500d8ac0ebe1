//! Launcher of `kernels/rope.cu`: RoPE on q and k in place, optionally after Qwen3's per-head q/k
//! RMSNorm, equal to `kiln_core::ops::rope` (`apply_rope_typed`, `qk_norm_rope_typed`) bit for bit
//! for every [`RopeVariant`].
//!
//! Buffers: q is `tokens x q_heads x head_dim` and k `tokens x k_heads x head_dim` values of the
//! activation type, row-major, rewritten in place; `positions` holds one u32 per token; the cos /
//! sin table is the CPU's [`RopeTable`] uploaded as it is ([`DeviceRopeTable`]), so the frequency
//! scaling (linear, Llama 3, YaRN) is whatever the table was built with; the q and k norm weights
//! are `head_dim` values each; `flag` is one u32 that the kernel sets to 1 when a position is not
//! in the table (that token's heads become zero). The kernel never clears the flag: clear it with
//! `fill_bytes(0)` and read it with [`read_flag`](crate::ops::embedding::read_flag).

use cudarc::driver::LaunchConfig;
use kiln_core::ops::primitives::{FloatType, UNIT};
use kiln_core::ops::rope::{RopeLayout, RopeSpec, RopeTable};
use kiln_core::{DType, Error, Result};

use crate::kernels::ROPE;
use crate::memory::DeviceMemory;
use crate::runtime::{driver_error, Gpu};

/// One shape of the RoPE kernel: lanes that share a head (8, 16 or 32, the first two for heads of
/// at most 64 and 128 elements), and heads per thread block. Every variant computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RopeVariant {
    pub lanes_per_head: u32,
    pub heads_per_block: u32,
}

/// The variants, as data; the tests run every one that serves a shape.
pub const ROPE_VARIANTS: &[RopeVariant] = &[
    RopeVariant { lanes_per_head: 8, heads_per_block: 8 },
    RopeVariant { lanes_per_head: 8, heads_per_block: 16 },
    RopeVariant { lanes_per_head: 16, heads_per_block: 4 },
    RopeVariant { lanes_per_head: 16, heads_per_block: 8 },
    RopeVariant { lanes_per_head: 32, heads_per_block: 1 },
    RopeVariant { lanes_per_head: 32, heads_per_block: 2 },
    RopeVariant { lanes_per_head: 32, heads_per_block: 4 },
    RopeVariant { lanes_per_head: 32, heads_per_block: 8 },
];

/// Most units of 256 elements a head may have (heads of up to 1024 elements).
pub const MAX_ROPE_UNITS: usize = 4;

impl RopeVariant {
    /// Units of 256 each group holds for heads of `head_dim` elements, or `None` when the variant
    /// does not serve that head size.
    pub fn units(&self, head_dim: usize) -> Option<usize> {
        let units = head_dim.div_ceil(UNIT).max(1);
        let fits = match self.lanes_per_head {
            32 => units <= MAX_ROPE_UNITS,
            lanes @ (8 | 16) => head_dim <= 8 * lanes as usize,
            _ => false,
        };
        fits.then_some(units)
    }

    /// The default variant for heads of `head_dim` elements: the fewest lanes that hold a head,
    /// 128 threads per block.
    pub fn default_for(head_dim: usize) -> RopeVariant {
        let lanes = match head_dim {
            0..=64 => 8,
            65..=128 => 16,
            _ => 32,
        };
        RopeVariant { lanes_per_head: lanes, heads_per_block: 128 / lanes }
    }
}

/// Qwen3's per-head RMSNorm before the rotation: its eps and the type of its two weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkNorm {
    pub eps: f32,
    pub weight_type: DType,
}

/// The shape and types of a RoPE call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeCall {
    /// The layout and rotary dimension (the table must have been built from this spec).
    pub spec: RopeSpec,
    pub tokens: usize,
    pub q_heads: usize,
    /// 0 to rotate q alone.
    pub k_heads: usize,
    pub head_dim: usize,
    /// The type of q and k (F32, F16 or BF16); results are rounded to it.
    pub x_type: DType,
    pub qk_norm: Option<QkNorm>,
}

/// A [`RopeTable`] in device memory.
#[derive(Debug)]
pub struct DeviceRopeTable {
    pub spec: RopeSpec,
    pub positions: usize,
    /// `positions x rotary_dim / 2` fp32 values each.
    pub cos: DeviceMemory,
    pub sin: DeviceMemory,
}

impl DeviceRopeTable {
    /// Uploads `table` to `gpu`.
    pub fn upload(gpu: &Gpu, table: &RopeTable) -> Result<DeviceRopeTable> {
        let bytes = |values: &[f32]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let (cos, sin) = (bytes(&table.cos), bytes(&table.sin));
        let cos_memory = gpu.alloc(cos.len().max(4))?;
        cos_memory.copy_from_host(0, &cos)?;
        let sin_memory = gpu.alloc(sin.len().max(4))?;
        sin_memory.copy_from_host(0, &sin)?;
        Ok(DeviceRopeTable { spec: table.spec, positions: table.positions, cos: cos_memory, sin: sin_memory })
    }
}

/// Device buffers of one RoPE call (see the module docs for their layouts).
#[derive(Debug, Clone, Copy)]
pub struct RopeBuffers<'a> {
    pub q: &'a DeviceMemory,
    /// Needed when `k_heads > 0`.
    pub k: Option<&'a DeviceMemory>,
    /// One u32 per token.
    pub positions: &'a DeviceMemory,
    pub table: &'a DeviceRopeTable,
    /// `head_dim` weights each, with the q/k norm.
    pub q_norm_weight: Option<&'a DeviceMemory>,
    pub k_norm_weight: Option<&'a DeviceMemory>,
    /// One u32, set to 1 when a position is outside the table.
    pub flag: &'a DeviceMemory,
}

fn float_code(t: FloatType) -> u32 {
    match t {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 2,
    }
}

fn not_served(reason: String) -> Error {
    Error::NotServed { op: "rope kernel", reason }
}

impl RopeCall {
    /// Checks what the kernel serves; returns the units per head of `variant`.
    pub fn validate(&self, variant: RopeVariant) -> Result<usize> {
        self.spec.validate(self.head_dim)?;
        FloatType::of(self.x_type, "rope")?;
        if let Some(norm) = self.qk_norm {
            FloatType::of(norm.weight_type, "q/k norm weight")?;
            if !(norm.eps >= 0.0 && norm.eps.is_finite()) {
                return Err(Error::InvalidArgument {
                    name: "eps",
                    value: norm.eps.to_string(),
                    reason: "must be finite and non-negative".into(),
                });
            }
        }
        if !self.head_dim.is_multiple_of(8) {
            return Err(not_served(format!("heads of {} elements (needs a multiple of 8)", self.head_dim)));
        }
        if i32::try_from(self.q_heads + self.k_heads).is_err() {
            return Err(not_served(format!("{} + {} heads", self.q_heads, self.k_heads)));
        }
        variant.units(self.head_dim).ok_or_else(|| {
            not_served(format!(
                "{} lanes per head do not hold heads of {} elements",
                variant.lanes_per_head, self.head_dim
            ))
        })
    }

    /// Bytes of q and of k.
    pub fn buffer_bytes(&self) -> Result<(usize, usize)> {
        let x = FloatType::of(self.x_type, "rope")?.bytes();
        let per_head = self.tokens * self.head_dim * x;
        Ok((per_head * self.q_heads, per_head * self.k_heads))
    }

    /// The compile-time constants of this call on `variant`.
    pub fn defines(&self, variant: RopeVariant) -> Result<Vec<(&'static str, String)>> {
        let units = self.validate(variant)?;
        let weight_type =
            self.qk_norm.map_or(Ok(FloatType::F32), |n| FloatType::of(n.weight_type, "rope"))?;
        Ok(vec![
            ("X_T", float_code(FloatType::of(self.x_type, "rope")?).to_string()),
            ("W_T", float_code(weight_type).to_string()),
            ("LAYOUT", if self.spec.layout == RopeLayout::HalfSplit { "0" } else { "1" }.to_owned()),
            ("QK_NORM", if self.qk_norm.is_some() { "1" } else { "0" }.to_owned()),
            ("LANES_PER_HEAD", variant.lanes_per_head.to_string()),
            ("HEADS_PER_BLOCK", variant.heads_per_block.to_string()),
            ("UNITS", units.to_string()),
        ])
    }
}

/// Runs the RoPE `call` on `gpu`'s stream with `variant` (or the default for the head size).
pub fn rope(
    gpu: &Gpu,
    call: &RopeCall,
    buffers: RopeBuffers<'_>,
    variant: Option<RopeVariant>,
) -> Result<()> {
    let variant = variant.unwrap_or_else(|| RopeVariant::default_for(call.head_dim));
    let defines = call.defines(variant)?;
    let table = buffers.table;
    if table.spec != call.spec {
        return Err(Error::InvalidArgument {
            name: "rope table",
            value: format!("{:?}", table.spec),
            reason: format!("was built for another spec than the call's {:?}", call.spec),
        });
    }
    let half = call.spec.rotary_dim / 2;
    super::check_buffer("rope", "cos", table.cos.len_bytes(), table.positions * half * 4)?;
    super::check_buffer("rope", "sin", table.sin.len_bytes(), table.positions * half * 4)?;
    let (q_bytes, k_bytes) = call.buffer_bytes()?;
    let w_bytes = match call.qk_norm {
        Some(n) => call.head_dim * FloatType::of(n.weight_type, "rope")?.bytes(),
        None => 0,
    };
    let len = |m: Option<&DeviceMemory>| m.map_or(0, DeviceMemory::len_bytes);
    super::check_buffer("rope", "q", buffers.q.len_bytes(), q_bytes)?;
    super::check_presence("rope call", "k", buffers.k.is_some(), call.k_heads > 0)?;
    super::check_buffer("rope", "k", len(buffers.k), k_bytes)?;
    super::check_buffer("rope", "positions", buffers.positions.len_bytes(), call.tokens * 4)?;
    super::check_presence(
        "rope call",
        "q norm weight",
        buffers.q_norm_weight.is_some(),
        call.qk_norm.is_some(),
    )?;
    super::check_presence(
        "rope call",
        "k norm weight",
        buffers.k_norm_weight.is_some(),
        call.qk_norm.is_some() && call.k_heads > 0,
    )?;
    super::check_buffer("rope", "q norm weight", len(buffers.q_norm_weight), w_bytes)?;
    super::check_buffer(
        "rope",
        "k norm weight",
        len(buffers.k_norm_weight),
        if call.k_heads > 0 { w_bytes } else { 0 },
    )?;
    super::check_buffer("rope", "flag", buffers.flag.len_bytes(), 4)?;
    let table_positions = u32::try_from(table.positions)
        .map_err(|_| not_served(format!("a table of {} positions", table.positions)))?;

    let define_refs: Vec<(&str, &str)> = defines.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let function = gpu.function(&ROPE, "kiln_rope", &define_refs)?;
    let tasks = call.tokens * (call.q_heads + call.k_heads);
    if tasks == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(tasks.div_ceil(variant.heads_per_block as usize))
        .map_err(|_| not_served(format!("{tasks} heads")))?;
    let threads = variant.lanes_per_head * variant.heads_per_block;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let to_i32 = |v: usize, what: &str| i32::try_from(v).map_err(|_| not_served(format!("{v} {what}")));
    let (q_heads, k_heads) = (to_i32(call.q_heads, "q heads")?, to_i32(call.k_heads, "k heads")?);
    let (head_dim, rotary_dim) =
        (to_i32(call.head_dim, "head size")?, to_i32(call.spec.rotary_dim, "rotary")?);
    let eps = call.qk_norm.map_or(0.0f32, |n| n.eps);
    let tasks = tasks as i64;

    let ptr = |m: Option<&DeviceMemory>| m.map_or(0u64, DeviceMemory::device_ptr);
    let (q, k, positions) = (buffers.q.device_ptr(), ptr(buffers.k), buffers.positions.device_ptr());
    let (cos, sin) = (table.cos.device_ptr(), table.sin.device_ptr());
    let (q_weight, k_weight) = (ptr(buffers.q_norm_weight), ptr(buffers.k_norm_weight));
    let flag = buffers.flag.device_ptr();
    let mut launch = gpu.launch_builder(&function);
    launch
        .arg(&q)
        .arg(&k)
        .arg(&positions)
        .arg(&cos)
        .arg(&sin)
        .arg(&q_weight)
        .arg(&k_weight)
        .arg(&flag)
        .arg(&eps)
        .arg(&tasks)
        .arg(&q_heads)
        .arg(&k_heads)
        .arg(&head_dim)
        .arg(&rotary_dim)
        .arg(&table_positions);
    // SAFETY: the argument list matches `kiln_rope`'s signature (8 pointers, f32, i64, 4 i32, u32);
    // a pointer is null only where the call makes the kernel ignore it (k with no k heads, the
    // norm weights without the norm); every buffer was checked above to hold what the kernel
    // touches for `tokens` tokens (the table is read only at positions below `table_positions`);
    // the blocks come from this device's pool, which reuses memory only in this stream's order.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_rope)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::ops::rope::RopeScaling;

    fn call(head_dim: usize, rotary_dim: usize) -> RopeCall {
        RopeCall {
            spec: RopeSpec {
                layout: RopeLayout::HalfSplit,
                rotary_dim,
                theta: 10_000.0,
                scaling: RopeScaling::None,
            },
            tokens: 3,
            q_heads: 4,
            k_heads: 2,
            head_dim,
            x_type: DType::BF16,
            qk_norm: Some(QkNorm { eps: 1e-6, weight_type: DType::BF16 }),
        }
    }

    #[test]
    fn default_variants_serve_every_head_size_and_are_listed() {
        for head_dim in (8..=1024).step_by(8) {
            let v = RopeVariant::default_for(head_dim);
            assert!(ROPE_VARIANTS.contains(&v), "{v:?}");
            assert!(call(head_dim, 8).validate(v).is_ok(), "head_dim {head_dim}");
        }
        assert_eq!(RopeVariant { lanes_per_head: 16, heads_per_block: 4 }.units(136), None);
        assert_eq!(RopeVariant { lanes_per_head: 32, heads_per_block: 1 }.units(1032), None);
        assert_eq!(RopeVariant { lanes_per_head: 32, heads_per_block: 1 }.units(512), Some(2));
    }

    #[test]
    fn unserved_calls_are_named() {
        let v = RopeVariant::default_for(128);
        assert!(matches!(call(100, 64).validate(v), Err(Error::NotServed { op: "rope kernel", .. })));
        assert!(matches!(call(128, 130).validate(v), Err(Error::InvalidArgument { name: "rotary_dim", .. })));
        let mut c = call(128, 64);
        c.x_type = DType::Q8_0;
        assert!(matches!(c.validate(v), Err(Error::DTypeNotServed { .. })));
    }
}
