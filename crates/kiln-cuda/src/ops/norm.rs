//! Launcher of `kernels/norm.cu`: the norm family of `kiln_core::ops::norm` on the GPU, equal to
//! the CPU reference bit for bit for every [`NormVariant`].
//!
//! Buffers are device memory blocks ([`DeviceMemory`]) laid out as the reference's: rows of `hidden`
//! elements, row-major; the INT8 output is one byte per value plus one fp32 scale per 16, the
//! NVFP4 output two codes per byte (even element low) plus one E4M3 byte per 16, the FP8 output
//! one byte per value. The residual, when given, is read and overwritten with `x + residual`.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;
use kiln_core::ops::norm::{Gate, NormKind, NormOutput, NormSpec, RmsNormRounding, WeightMode};
use kiln_core::ops::primitives::{FloatType, UNIT};
use kiln_core::ops::quantize::{Quantizer, QUANT_BLOCK};
use kiln_core::{DType, Error, Result};

use crate::kernels::NORM;
use crate::memory::{DeviceMemory, DeviceView};
use crate::runtime::{driver_error, Gpu};

/// One shape of the norm kernel: warps that share a segment (a row or a group), segments per
/// thread block, whether the weight and bias are loaded with x, before the reduction (more
/// loads in flight, more registers), and whether the grid is persistent: a few blocks per
/// multiprocessor, each looping over groups of segments with the next group's loads issued
/// before the current group's reductions and stores (twice the registers for x), and the
/// number of cp.async stages of a staged grid (0: none; see [`NormVariant::stages`]). Every
/// variant computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NormVariant {
    pub warps_per_row: u32,
    pub rows_per_block: u32,
    pub early_weight: bool,
    pub persistent: bool,
    /// 0, or 2 or more: a persistent grid of [`STAGED_WARPS_PER_MULTIPROCESSOR`] warps a
    /// multiprocessor whose blocks walk the groups of segments r, r + G, ... with the loads of
    /// the next `stages - 1` groups in flight by cp.async into shared memory (registers hold only
    /// the current group), so that reads and writes overlap over the whole launch (the kernel's
    /// `STAGES`). Excludes `persistent`.
    pub stages: u32,
    /// One lane a block of 16 consecutive elements (the kernel's `BLOCK_LANE`; label `+b`): the
    /// INT8 and NVFP4 outputs take each block's maximum, scale and checks once for 16 values, in
    /// one lane, and store 16 INT8 codes at once; units go to the warps in pairs (at least 2 a
    /// warp). Serves every flavor, staged or not; not the int8 planes.
    pub block_lane: bool,
    /// Without `early_weight`: the output loop loads the weight and bias of a warp's next unit
    /// before it computes the current one (the kernel's `WEIGHT_AHEAD`; label `+w`), so that the
    /// units' weight loads overlap the work instead of waiting one after the other. One unit of
    /// weight and bias in registers.
    pub weight_ahead: bool,
    /// With several warps a row: only the row's first warp adds the unit sums from shared memory
    /// and finishes the total (the mean, 1 / the root mean square), and the row's other warps read
    /// the result after a second barrier (the kernel's `ROW_TOTAL_WARP`; label `+t`): the same
    /// operations in the same order, issued once a row instead of once a warp.
    pub row_total: bool,
    /// The segment length compiled in as a constant (the kernel's `SEGMENT_N`; label `+n`): one
    /// kernel per length, without the bound checks and the partial-row loops a length known only
    /// at run time needs. The same operations on the same values.
    pub fixed_n: bool,
}

const fn variant(warps_per_row: u32, rows_per_block: u32, early_weight: bool) -> NormVariant {
    NormVariant {
        warps_per_row,
        rows_per_block,
        early_weight,
        persistent: false,
        stages: 0,
        block_lane: false,
        weight_ahead: false,
        row_total: false,
        fixed_n: false,
    }
}

/// A [`NormVariant::block_lane`] variant.
const fn block_lane(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant {
        warps_per_row,
        rows_per_block,
        early_weight: false,
        persistent: false,
        stages: 0,
        block_lane: true,
        weight_ahead: false,
        row_total: false,
        fixed_n: false,
    }
}

/// A [`NormVariant::block_lane`] variant that loads the weight with x (label `+e+b`): the output
/// loop then waits on no weight load between its blocks (without it, each pair of units loads its
/// weight after the reduction, inside the unit's branch, so those loads run one after the other).
const fn block_lane_early(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant { early_weight: true, ..block_lane(warps_per_row, rows_per_block) }
}

/// A variant that loads the weight one unit ahead ([`NormVariant::weight_ahead`], label `+w`).
const fn ahead(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant { weight_ahead: true, ..variant(warps_per_row, rows_per_block, false) }
}

/// A variant whose row's first warp alone finishes the row's total ([`NormVariant::row_total`],
/// label `+t`).
const fn row_total(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant { row_total: true, ..variant(warps_per_row, rows_per_block, false) }
}

/// A [`NormVariant::block_lane`] variant whose row's first warp alone finishes the row's total
/// (label `+b+t`).
const fn block_lane_total(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant { row_total: true, ..block_lane(warps_per_row, rows_per_block) }
}

/// A [`NormVariant::block_lane`] variant that loads the weight one unit ahead (label `+b+w`).
const fn block_lane_ahead(warps_per_row: u32, rows_per_block: u32) -> NormVariant {
    NormVariant { weight_ahead: true, ..block_lane(warps_per_row, rows_per_block) }
}

/// `v` with the segment length compiled in ([`NormVariant::fixed_n`], label `+n`).
const fn fixed(v: NormVariant) -> NormVariant {
    NormVariant { fixed_n: true, ..v }
}

const fn persistent(warps_per_row: u32, rows_per_block: u32, early_weight: bool) -> NormVariant {
    NormVariant {
        warps_per_row,
        rows_per_block,
        early_weight,
        persistent: true,
        stages: 0,
        block_lane: false,
        weight_ahead: false,
        row_total: false,
        fixed_n: false,
    }
}

const fn staged(warps_per_row: u32, rows_per_block: u32, early_weight: bool, stages: u32) -> NormVariant {
    NormVariant {
        warps_per_row,
        rows_per_block,
        early_weight,
        persistent: false,
        stages,
        block_lane: false,
        weight_ahead: false,
        row_total: false,
        fixed_n: false,
    }
}

/// A staged [`NormVariant::block_lane`] variant with the segment length compiled in (label
/// `+s2+b+n` and the like): the quantized outputs' one-lane blocks with the loads of the next
/// groups in flight, so that at 2048 x 4096 the reads of later rows overlap the issue-bound
/// quantization of earlier ones instead of a wave of reads, then a wave of quantization.
const fn staged_block_lane(warps_per_row: u32, stages: u32) -> NormVariant {
    NormVariant { block_lane: true, fixed_n: true, ..staged(warps_per_row, 1, false, stages) }
}

/// Warps a multiprocessor a staged grid ([`NormVariant::stages`]) aims for: its blocks a
/// multiprocessor are this over the warps of a block (at least one, at most the resident ones).
/// With the stage count this sets the bytes in flight: at 2048 x 4096 bf16, 16 warps a row and 2
/// stages keep 2 rows (32 KiB) loading a multiprocessor, 8 warps and 3 stages 8 rows.
pub const STAGED_WARPS_PER_MULTIPROCESSOR: usize = 32;

/// The environment variable that replaces [`STAGED_WARPS_PER_MULTIPROCESSOR`] (a count of warps
/// from 1 to 64), for measurement: `KILN_NORM_STAGED_WARPS=16 kiln bench norm --variants staged`.
pub const STAGED_WARPS_ENV: &str = "KILN_NORM_STAGED_WARPS";

/// The staged grids' warps a multiprocessor: [`STAGED_WARPS_ENV`] when set, else
/// [`STAGED_WARPS_PER_MULTIPROCESSOR`].
pub fn staged_warps_per_multiprocessor() -> Result<usize> {
    match std::env::var(STAGED_WARPS_ENV) {
        Err(_) => Ok(STAGED_WARPS_PER_MULTIPROCESSOR),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(w) if (1..=64).contains(&w) => Ok(w),
            _ => Err(Error::InvalidArgument {
                name: STAGED_WARPS_ENV,
                value: v,
                reason: "a count of warps a multiprocessor from 1 to 64".into(),
            }),
        },
    }
}

/// Most shared memory (bytes) of a staged variant's stages, with a residual (the largest of the
/// launches of a call): what every supported GPU gives a block (sm_86 and sm_89: 99 KiB).
pub const STAGED_SHARED_LIMIT: usize = 96 * 1024;

/// Bytes of x (with the residual and the gate) a persistent grid aims to have loading on each
/// multiprocessor at once: the next group of every resident block. About 4.2 TB/s times the
/// DRAM latency (under 1 us), over 132 multiprocessors, is 25-32 KB; twice that covers the
/// time the loads of a block's next group wait behind its current group's stores.
const PERSISTENT_BYTES_IN_FLIGHT: usize = 64 * 1024;

/// The variants, as data; the tests run every one that serves a shape.
pub const NORM_VARIANTS: &[NormVariant] = &[
    variant(1, 1, false),
    variant(1, 2, false),
    variant(1, 4, false),
    variant(2, 1, false),
    variant(2, 2, false),
    variant(4, 1, false),
    variant(8, 1, false),
    variant(16, 1, false),
    variant(2, 2, true),
    variant(4, 1, true),
    variant(4, 2, false),
    variant(4, 2, true),
    variant(8, 1, true),
    variant(8, 2, false),
    variant(8, 2, true),
    variant(16, 1, true),
    persistent(2, 1, false),
    persistent(4, 1, false),
    persistent(4, 1, true),
    persistent(8, 1, false),
    persistent(8, 1, true),
    persistent(16, 1, false),
    persistent(16, 1, true),
    persistent(4, 2, false),
    staged(4, 1, false, 2),
    staged(4, 1, false, 3),
    staged(8, 1, false, 2),
    staged(8, 1, false, 3),
    staged(16, 1, false, 2),
    staged(16, 1, false, 3),
    staged(4, 1, true, 2),
    staged(8, 1, true, 2),
    block_lane(1, 4),
    block_lane(2, 1),
    block_lane(4, 1),
    block_lane(8, 1),
    block_lane(16, 1),
    block_lane_early(2, 1),
    block_lane_early(4, 1),
    block_lane_early(8, 1),
    block_lane_early(16, 1),
    ahead(2, 1),
    ahead(4, 1),
    ahead(8, 1),
    block_lane_ahead(2, 1),
    block_lane_ahead(4, 1),
    block_lane_ahead(8, 1),
    row_total(2, 1),
    row_total(4, 1),
    block_lane_total(4, 1),
    block_lane_total(8, 1),
    fixed(variant(2, 1, false)),
    fixed(variant(4, 1, false)),
    // 2 warps a row at 2048 x 4096 (8 units a warp): 62 registers on sm_90 for NVFP4 and INT8
    // since KILN_NORM_EXACT_GRID, so 16 blocks of 64 threads fit a multiprocessor and the 2048
    // rows are one wave on 132. NVFP4 took 72 before (14 blocks: a second wave of 200 rows, and
    // 10.2 us against the 4-warp default's 8.9 in 2026-12-01-h200-g/g1); INT8 64.
    fixed(block_lane(2, 1)),
    fixed(block_lane(4, 1)),
    fixed(block_lane(8, 1)),
    fixed(block_lane_total(4, 1)),
    staged_block_lane(4, 2),
    staged_block_lane(4, 3),
    staged_block_lane(8, 2),
];

/// Most units of 256 elements one warp holds in registers (16: 128 fp32 values per lane).
pub const MAX_UNITS_PER_WARP: usize = 16;

/// Most units per warp of a variant that loads the weight early (it holds the weight's units too).
pub const MAX_UNITS_PER_WARP_EARLY: usize = 8;

impl NormVariant {
    /// Units each warp holds for segments of `n` elements (a power of two), or `None` when the
    /// variant needs more than [`MAX_UNITS_PER_WARP`] ([`MAX_UNITS_PER_WARP_EARLY`] when it loads
    /// the weight early).
    pub fn units_per_warp(&self, n: usize) -> Option<usize> {
        let per_warp = n
            .div_ceil(UNIT)
            .div_ceil(self.warps_per_row as usize)
            .max(if self.block_lane { 2 } else { 1 })
            .next_power_of_two();
        (per_warp <= self.max_units_per_warp()).then_some(per_warp)
    }

    /// Bytes of shared memory of a staged variant's stages for `call` with or without the
    /// residual (0 for other variants): every thread's 16-byte pieces of x, residual and gate
    /// before the norm, for every stage.
    pub fn staged_shared_bytes(&self, call: &NormCall, residual: bool) -> Result<usize> {
        if self.stages == 0 {
            return Ok(0);
        }
        let units = self.units_per_warp(call.segment_len()).unwrap_or(self.max_units_per_warp());
        let pieces = FloatType::of(call.x_type, "norm input")?.bytes() / 2;
        let streams = 1 + usize::from(residual) + usize::from(call.spec.gate == Some(Gate::Before));
        let threads = 32 * self.warps_per_row as usize * self.rows_per_block as usize;
        Ok(self.stages as usize * units * streams * pieces.max(1) * threads * 16)
    }

    /// Most units of 256 elements each warp of this variant holds.
    pub fn max_units_per_warp(&self) -> usize {
        if self.early_weight || self.persistent {
            MAX_UNITS_PER_WARP_EARLY
        } else {
            MAX_UNITS_PER_WARP
        }
    }

    /// The default variant for `call`, from the H200's graph-timed figures (bf16, 1 x 4096,
    /// 2048 x 4096, 8192 x 8192; `kiln bench norm`), never a persistent one (the persistent grid
    /// trailed the plain one at every large shape: 82% against 90% of the copy ceiling for
    /// RMSNorm at 8192 x 8192, 65% against 87% for LayerNorm):
    /// - at most [`SMALL_SEGMENTS`] segments (decode, small batches) of 3 units or more: one
    ///   unit of 256 elements a warp, 4 to 16 warps a row, the weight loaded early (16 warps:
    ///   1.6-2.1 us at 1 x 4096 in every case, against 2.6-3.5 us for the former persistent 4
    ///   warps): each segment has a multiprocessor to itself and its time is one row's chain of
    ///   loads, sums and stores;
    /// - INT8, NVFP4 and FP8 outputs, or fp32 x: 4 units a warp (8 warps at 8192: 64% and 41% of
    ///   the copy ceiling for INT8 and NVFP4 against 62% and 31% with 4 warps), except NVFP4 of
    ///   2-byte x from 32 units (8192: 8 units a warp, 4 warps; 49.5 us against 52.0 with 8
    ///   warps);
    /// - float outputs of 2-byte x: 8 units a warp (2 warps at 4096, 4 at 8192: 78-90% for
    ///   RMSNorm, 66-87% for LayerNorm, whose two reductions cost more with more warps);
    /// - float, INT8 and NVFP4 outputs of 2-byte x with the segment length compiled in
    ///   ([`NormVariant::fixed_n`]) where that variant is listed (2048 x 4096: RMSNorm with the
    ///   residual 18.3 us against 19.8, LayerNorm 10.6-10.7 against 13.4-13.5; NVFP4 at 8192
    ///   50.1 against 51.8; `bench/results/2026-12-01-h200`, f3 and f4).
    pub fn default_for(call: &NormCall) -> NormVariant {
        let n = call.segment_len();
        let units = n.div_ceil(UNIT).max(1);
        let segments = call.rows * call.spec.groups.max(1);
        if segments <= SMALL_SEGMENTS && units >= 3 {
            let warps = units.next_power_of_two().clamp(4, 16) as u32;
            return NormVariant {
                warps_per_row: warps,
                rows_per_block: 1,
                early_weight: true,
                persistent: false,
                stages: 0,
                block_lane: false,
                weight_ahead: false,
                row_total: false,
                fixed_n: false,
            };
        }
        let two_byte_x = matches!(call.x_type, DType::BF16 | DType::F16);
        let per_warp = match call.spec.out {
            NormOutput::Float(_) if two_byte_x => 8,
            NormOutput::Quantized(Quantizer::Nvfp4 { .. }) if two_byte_x && units >= 32 => 8,
            _ => 4,
        };
        let warps = units.div_ceil(per_warp).next_power_of_two().clamp(1, 16) as u32;
        // One warp a row: 4 rows a block; more: one (2w1r ran 1-3% ahead of 2w2r in all five
        // cases at 2048 x 4096).
        let rows_per_block = if warps == 1 { 4 } else { 1 };
        // INT8 and NVFP4 outputs: one lane a block of 16 (on the H200, 2048 x 4096 INT8 9.96 us
        // against 10.91 two lanes a block, 8192 x 8192 59.5 against 64.1; NVFP4 12.98 against
        // 13.42 and 77.8 against 83.2).
        let block_lane =
            matches!(call.spec.out, NormOutput::Quantized(Quantizer::Int8 | Quantizer::Nvfp4 { .. }));
        let plain = NormVariant {
            warps_per_row: warps,
            rows_per_block,
            early_weight: false,
            persistent: false,
            stages: 0,
            block_lane,
            weight_ahead: false,
            row_total: false,
            fixed_n: false,
        };
        let fixed = NormVariant { fixed_n: true, ..plain };
        let wants_fixed = two_byte_x && (block_lane || matches!(call.spec.out, NormOutput::Float(_)));
        if wants_fixed && NORM_VARIANTS.contains(&fixed) {
            fixed
        } else {
            plain
        }
    }
}

/// Segments (rows times groups) up to which [`NormVariant::default_for`] spreads each segment over
/// as many warps as it has units: a decode step or a small batch, fewer segments than the GPU has
/// multiprocessors.
pub const SMALL_SEGMENTS: usize = 64;

/// Device buffers of one norm call (see the module docs for their layouts).
#[derive(Debug, Clone, Copy)]
pub struct NormBuffers<'a> {
    pub x: &'a DeviceMemory,
    /// Read, then overwritten with `x + residual`.
    pub residual: Option<&'a DeviceMemory>,
    pub weight: Option<&'a DeviceMemory>,
    pub bias: Option<&'a DeviceMemory>,
    pub gate: Option<&'a DeviceMemory>,
    pub out: &'a DeviceMemory,
    /// Per-16 scales of the INT8 (fp32) and NVFP4 (E4M3) outputs.
    pub scales: Option<&'a DeviceMemory>,
}

/// The shape and types of a norm call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormCall {
    pub spec: NormSpec,
    pub rows: usize,
    pub hidden: usize,
    /// Type of x, the residual and the gate.
    pub x_type: DType,
    /// Type of the weight and the bias.
    pub weight_type: DType,
}

fn out_code(out: NormOutput) -> Result<(u32, f32)> {
    Ok(match out {
        NormOutput::Float(dtype) => (float_code(FloatType::of(dtype, "norm output")?), 0.0),
        NormOutput::Quantized(Quantizer::Int8) => (3, 0.0),
        NormOutput::Quantized(Quantizer::Nvfp4 { global_scale }) => (4, global_scale),
        NormOutput::Quantized(Quantizer::Fp8E4m3 { scale }) => (5, scale),
    })
}

fn float_code(t: FloatType) -> u32 {
    match t {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 2,
    }
}

impl NormCall {
    /// Elements per segment.
    pub fn segment_len(&self) -> usize {
        self.hidden / self.spec.groups.max(1)
    }

    /// Bytes each buffer must hold: x (and residual, gate), weight (and bias), out, scales.
    pub fn buffer_bytes(&self) -> Result<(usize, usize, usize, usize)> {
        let x = FloatType::of(self.x_type, "norm input")?.bytes();
        let w = FloatType::of(self.weight_type, "norm weight")?.bytes();
        let elements = self.rows * self.hidden;
        let (out, scales) = match self.spec.out {
            NormOutput::Float(dtype) => (elements * FloatType::of(dtype, "norm output")?.bytes(), 0),
            NormOutput::Quantized(Quantizer::Int8) => (elements, elements / QUANT_BLOCK * 4),
            NormOutput::Quantized(Quantizer::Nvfp4 { .. }) => (elements / 2, elements / QUANT_BLOCK),
            NormOutput::Quantized(Quantizer::Fp8E4m3 { .. }) => (elements, 0),
        };
        Ok((elements * x, self.hidden * w, out, scales))
    }

    /// Checks what the kernel serves beyond the reference's own rules.
    pub fn validate(&self, variant: NormVariant) -> Result<usize> {
        let n = self.segment_len();
        if self.spec.groups == 0 || !self.hidden.is_multiple_of(self.spec.groups) || !n.is_multiple_of(8) {
            return Err(Error::NotServed {
                op: "norm kernel",
                reason: format!(
                    "segments of {} elements ({} / {} groups): the kernel needs a multiple of 8",
                    n, self.hidden, self.spec.groups
                ),
            });
        }
        if matches!(self.spec.out, NormOutput::Quantized(Quantizer::Int8 | Quantizer::Nvfp4 { .. }))
            && !n.is_multiple_of(QUANT_BLOCK)
        {
            return Err(Error::NotServed {
                op: "norm kernel",
                reason: format!(
                    "block-quantized output of segments of {n} elements (needs a multiple of 16)"
                ),
            });
        }
        if let NormOutput::Quantized(q) = self.spec.out {
            q.validate(self.hidden)?;
        }
        if self.spec.kind == NormKind::Layer
            && (self.spec.gate.is_some() || self.spec.rounding != RmsNormRounding::Single)
        {
            return Err(Error::NotServed {
                op: "layer norm",
                reason: "LayerNorm has one rounding and no gate".into(),
            });
        }
        let units = variant.units_per_warp(n).ok_or_else(|| Error::NotServed {
            op: "norm kernel",
            reason: format!(
                "{} warps per row hold at most {} elements, segments have {n}",
                variant.warps_per_row,
                variant.warps_per_row as usize * variant.max_units_per_warp() * UNIT
            ),
        })?;
        if variant.stages == 1 || (variant.stages > 0 && variant.persistent) {
            return Err(Error::InvalidArgument {
                name: "norm variant",
                value: format!("{variant:?}"),
                reason: "stages are 0 or at least 2, and exclude `persistent`".into(),
            });
        }
        if variant.row_total && variant.warps_per_row < 2 {
            return Err(Error::InvalidArgument {
                name: "norm variant",
                value: format!("{variant:?}"),
                reason: "`row_total` shares the total of several warps of a row".into(),
            });
        }
        if variant.weight_ahead && variant.early_weight {
            return Err(Error::InvalidArgument {
                name: "norm variant",
                value: format!("{variant:?}"),
                reason: "`weight_ahead` loads the weight a unit ahead, `early_weight` all of it at once: one or the other"
                    .into(),
            });
        }
        let shared = variant.staged_shared_bytes(self, true)?;
        if shared > STAGED_SHARED_LIMIT {
            return Err(Error::NotServed {
                op: "norm kernel",
                reason: format!(
                    "{} stages of segments of {n} elements need {shared} bytes of shared memory (at most {})",
                    variant.stages, STAGED_SHARED_LIMIT
                ),
            });
        }
        Ok(units)
    }

    /// The compile-time constants of this call on `variant`.
    pub fn defines(&self, variant: NormVariant) -> Result<Vec<(&'static str, String)>> {
        let units = self.validate(variant)?;
        let s = &self.spec;
        let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
        let mut defines = vec![
            ("KIND", if s.kind == NormKind::Rms { "0" } else { "1" }.to_owned()),
            ("X_T", float_code(FloatType::of(self.x_type, "norm input")?).to_string()),
            ("W_T", float_code(FloatType::of(self.weight_type, "norm weight")?).to_string()),
            ("OUT_T", out_code(s.out)?.0.to_string()),
            (
                "WEIGHT",
                match s.weight {
                    WeightMode::Plain => "0",
                    WeightMode::OnePlus => "1",
                    WeightMode::None => "2",
                }
                .to_owned(),
            ),
            ("HAS_BIAS", flag(s.bias)),
            ("HAS_RESIDUAL", "0".to_owned()),
            ("HF_ROUNDING", flag(s.rounding == RmsNormRounding::HuggingFace)),
            (
                "GATE",
                match s.gate {
                    None => "0",
                    Some(Gate::Before) => "1",
                    Some(Gate::After) => "2",
                }
                .to_owned(),
            ),
            ("WARPS_PER_ROW", variant.warps_per_row.to_string()),
            ("ROWS_PER_BLOCK", variant.rows_per_block.to_string()),
            ("UNITS_PER_WARP", units.to_string()),
            ("EARLY_WEIGHT", flag(variant.early_weight)),
            ("PERSISTENT", flag(variant.persistent)),
        ];
        if variant.block_lane {
            defines.push(("BLOCK_LANE", "1".to_owned()));
        }
        if variant.weight_ahead {
            defines.push(("WEIGHT_AHEAD", "1".to_owned()));
        }
        if variant.row_total {
            defines.push(("ROW_TOTAL_WARP", "1".to_owned()));
        }
        if variant.fixed_n {
            defines.push(("SEGMENT_N", self.segment_len().to_string()));
        }
        Ok(defines)
    }
}

/// Runs the norm `call` on `gpu`'s stream with `variant` (or the default for the shape).
pub fn norm(
    gpu: &Gpu,
    call: &NormCall,
    buffers: NormBuffers<'_>,
    variant: Option<NormVariant>,
) -> Result<()> {
    norm_launch(gpu, call, buffers, variant, None)
}

/// [`norm`] whose fp32 output is also written, into `planes`, as the integer-path matrix
/// products take their x ([`crate::ops::linear`]'s scratch layout: two int8 planes and the block
/// scales, the very bytes of the products' own rounding launch), so that the product after it
/// needs no rounding launch ([`crate::ops::linear::linear_prequantized`]). `weight` is that
/// product's weight format (Q4_0 keeps an integer block sum, Q8_0 and Q4_1 a float one). Serves
/// RMSNorm and LayerNorm with an fp32 output, one group, rows of a multiple of 128 values.
pub fn norm_with_int8_planes(
    gpu: &Gpu,
    call: &NormCall,
    buffers: NormBuffers<'_>,
    variant: Option<NormVariant>,
    planes: DeviceView,
    weight: DType,
) -> Result<()> {
    let second_int = int8_planes_served(call, weight)?;
    let needed = crate::ops::linear::int8_scratch_bytes(call.rows, call.hidden);
    super::check_buffer("norm", "planes", planes.len_bytes, needed)?;
    if !planes.ptr.is_multiple_of(16) {
        return Err(Error::InvalidArgument {
            name: "planes",
            value: format!("{:#x}", planes.ptr),
            reason: "must be 16-byte aligned".into(),
        });
    }
    norm_launch(gpu, call, buffers, variant, Some((planes.ptr, second_int)))
}

/// Whether [`norm_with_int8_planes`] serves `call` for products on `weight`, and then whether the
/// planes keep an integer block sum (Q4_0) rather than a float one.
pub fn int8_planes_served(call: &NormCall, weight: DType) -> Result<bool> {
    let not_served = |reason: String| Error::NotServed { op: "norm with int8 planes", reason };
    if call.spec.out != NormOutput::Float(DType::F32) || call.spec.groups != 1 {
        return Err(not_served(format!(
            "output {:?} in {} groups (fp32, one group)",
            call.spec.out, call.spec.groups
        )));
    }
    if call.hidden == 0 || !call.hidden.is_multiple_of(crate::ops::linear::INT8_UNIT) {
        return Err(not_served(format!("rows of {} values (a multiple of 128)", call.hidden)));
    }
    match weight {
        DType::Q4_0 => Ok(true),
        DType::Q8_0 | DType::Q4_1 => Ok(false),
        other => Err(not_served(format!("{other} weights (Q8_0, Q4_0, Q4_1)"))),
    }
}

/// The kernel's defines for `call` on `variant` as a launch compiles them: `call.defines`, then
/// the INT8 planes' (`planes`: whether the second operand is Q4_0's integers), the residual add
/// when there is a residual stream, and the staged grid's stage count.
fn launch_defines(
    call: &NormCall,
    variant: NormVariant,
    residual: bool,
    planes: Option<bool>,
) -> Result<Vec<(&'static str, String)>> {
    let mut defines = call.defines(variant)?;
    if let Some(second_int) = planes {
        defines.push(("I8_PLANES", "1".to_owned()));
        defines.push(("I8_SECOND_INT", if second_int { "1" } else { "0" }.to_owned()));
    }
    if residual {
        defines.iter_mut().filter(|(k, _)| *k == "HAS_RESIDUAL").for_each(|(_, v)| *v = "1".to_owned());
    }
    if variant.stages > 0 {
        defines.push(("STAGES", variant.stages.to_string()));
    }
    Ok(defines)
}

/// Compiles the kernels of these norm launches (each a call, its variant, and whether it adds a
/// residual stream) for `gpu` into the disk cache on every host thread ([`Gpu::warm`]), so that
/// the launches that follow load them instead of compiling one after another. Returns how many
/// were compiled (those already cached are not).
pub fn warm(gpu: &Gpu, launches: &[(NormCall, NormVariant, bool)]) -> Result<usize> {
    gpu.warm(&NORM, &specializations(launches)?)
}

/// The define lists that these norm launches (each a call, its variant, and whether it adds a
/// residual stream) compile the kernel with, as [`Gpu::function`] takes them; no GPU needed.
pub fn specializations(launches: &[(NormCall, NormVariant, bool)]) -> Result<Vec<Vec<(String, String)>>> {
    launches
        .iter()
        .map(|(call, variant, residual)| {
            let defines = launch_defines(call, *variant, *residual, None)?;
            Ok(defines.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
        })
        .collect()
}

fn norm_launch(
    gpu: &Gpu,
    call: &NormCall,
    buffers: NormBuffers<'_>,
    variant: Option<NormVariant>,
    planes: Option<(u64, bool)>,
) -> Result<()> {
    let variant = variant.unwrap_or_else(|| NormVariant::default_for(call));
    call.validate(variant)?;
    if planes.is_some() && variant.block_lane {
        return Err(Error::NotServed {
            op: "norm with int8 planes",
            reason: format!("{variant:?}: the planes take the 8-element lane layout"),
        });
    }
    let (x_bytes, w_bytes, out_bytes, scale_bytes) = call.buffer_bytes()?;
    let s = &call.spec;
    let len = |m: Option<&DeviceMemory>| m.map_or(0, DeviceMemory::len_bytes);
    super::check_buffer("norm", "x", buffers.x.len_bytes(), x_bytes)?;
    super::check_buffer("norm", "out", buffers.out.len_bytes(), out_bytes)?;
    super::check_presence("norm spec", "weight", buffers.weight.is_some(), s.weight != WeightMode::None)?;
    super::check_presence("norm spec", "bias", buffers.bias.is_some(), s.bias)?;
    super::check_presence("norm spec", "gate", buffers.gate.is_some(), s.gate.is_some())?;
    super::check_presence("norm spec", "scales", buffers.scales.is_some(), scale_bytes > 0)?;
    super::check_buffer(
        "norm",
        "weight",
        len(buffers.weight),
        if buffers.weight.is_some() { w_bytes } else { 0 },
    )?;
    super::check_buffer("norm", "bias", len(buffers.bias), if s.bias { w_bytes } else { 0 })?;
    super::check_buffer("norm", "gate", len(buffers.gate), if s.gate.is_some() { x_bytes } else { 0 })?;
    super::check_buffer("norm", "scales", len(buffers.scales), scale_bytes)?;
    if buffers.residual.is_some() {
        super::check_buffer("norm", "residual", len(buffers.residual), x_bytes)?;
    }
    let defines =
        launch_defines(call, variant, buffers.residual.is_some(), planes.map(|(_, second)| second))?;
    let define_refs: Vec<(&str, &str)> = defines.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let function = gpu.function(&NORM, "kiln_norm", &define_refs)?;
    let shared = variant.staged_shared_bytes(call, buffers.residual.is_some())?;
    if shared > 0 {
        let optin = gpu.facts().shared_memory_per_block_optin_bytes as usize;
        if shared > optin {
            return Err(Error::NotServed {
                op: "norm kernel",
                reason: format!(
                    "{variant:?} needs {shared} bytes of shared memory, the device gives {optin}"
                ),
            });
        }
        function
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .map_err(|e| driver_error("cuFuncSetAttribute(kiln_norm)", e))?;
    }

    let segments = call.rows * s.groups;
    if segments == 0 {
        return Ok(());
    }
    let n = i32::try_from(call.segment_len()).map_err(|_| Error::NotServed {
        op: "norm kernel",
        reason: format!("segments of {} elements", call.segment_len()),
    })?;
    let groups = i32::try_from(s.groups)
        .map_err(|_| Error::NotServed { op: "norm kernel", reason: format!("{} groups", s.groups) })?;
    let threads = 32 * variant.warps_per_row * variant.rows_per_block;
    let row_groups = segments.div_ceil(variant.rows_per_block as usize);
    let multiprocessors = gpu.facts().multiprocessors.max(1) as usize;
    let blocks = if variant.stages > 0 && row_groups > multiprocessors {
        let resident = function
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared, None)
            .map_err(|e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor(kiln_norm)", e))?;
        let warps = staged_warps_per_multiprocessor()?;
        row_groups.min(staged_blocks_per_multiprocessor(variant, warps, resident as usize) * multiprocessors)
    } else if variant.persistent && row_groups > multiprocessors {
        let resident = function
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(|e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor(kiln_norm)", e))?;
        let per_multiprocessor = persistent_blocks_per_multiprocessor(
            call,
            variant,
            buffers.residual.is_some(),
            resident as usize,
        )?;
        row_groups.min(per_multiprocessor * multiprocessors)
    } else {
        // One block a group of segments; with one segment a block, exactly one block a segment,
        // which the kernel relies on (KILN_NORM_EXACT_GRID: no check that the segment exists).
        row_groups
    };
    let blocks = u32::try_from(blocks)
        .map_err(|_| Error::NotServed { op: "norm kernel", reason: format!("{segments} segments") })?;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (_, qscale) = out_code(s.out)?;
    let segments = segments as i64;

    let ptr = |m: Option<&DeviceMemory>| m.map_or(0u64, DeviceMemory::device_ptr);
    let (x, out) = (buffers.x.device_ptr(), buffers.out.device_ptr());
    let (residual, weight, bias) = (ptr(buffers.residual), ptr(buffers.weight), ptr(buffers.bias));
    let gate = ptr(buffers.gate);
    // With planes the kernel's `scales` argument is the planes (an fp32 output has no scales).
    let scales = planes.map_or(ptr(buffers.scales), |(p, _)| p);
    let mut launch = gpu.launch_builder(&function);
    launch
        .arg(&x)
        .arg(&residual)
        .arg(&weight)
        .arg(&bias)
        .arg(&gate)
        .arg(&out)
        .arg(&scales)
        .arg(&s.eps)
        .arg(&qscale)
        .arg(&segments)
        .arg(&n)
        .arg(&groups);
    // SAFETY: the argument list matches `kiln_norm`'s signature (7 pointers, 2 floats, i64, 2
    // i32); every pointer is null only where the defines make the kernel ignore it, and every
    // buffer was checked above to hold the bytes the kernel touches for `segments` segments of
    // `n` elements; the blocks are from this device's pool, which reuses memory only in the
    // order of this stream, so they stay valid until the kernel has run.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_norm)", e))?;
    Ok(())
}

/// Blocks per multiprocessor of a staged grid: `warps` warps a multiprocessor
/// ([`staged_warps_per_multiprocessor`]), at least one block, at most the `resident` ones.
pub fn staged_blocks_per_multiprocessor(variant: NormVariant, warps: usize, resident: usize) -> usize {
    let per_block = (variant.warps_per_row * variant.rows_per_block).max(1) as usize;
    warps.div_ceil(per_block).clamp(1, resident.max(1))
}

/// Blocks per multiprocessor of a persistent grid: enough that the loads of their next groups
/// come to `PERSISTENT_BYTES_IN_FLIGHT`, at least one, at most the `resident` ones (a grid
/// larger than what stays resident would run in waves again).
pub fn persistent_blocks_per_multiprocessor(
    call: &NormCall,
    variant: NormVariant,
    has_residual: bool,
    resident: usize,
) -> Result<usize> {
    let x = FloatType::of(call.x_type, "norm input")?.bytes();
    let streams = 1 + usize::from(has_residual) + usize::from(call.spec.gate == Some(Gate::Before));
    let group_bytes = variant.rows_per_block as usize * call.segment_len() * x * streams;
    Ok(PERSISTENT_BYTES_IN_FLIGHT.div_ceil(group_bytes.max(1)).clamp(1, resident.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::ops::norm::{LayerNorm, RmsNorm};

    #[test]
    fn variants_cover_every_row_length_up_to_16384() {
        let rms: NormSpec = RmsNorm::llama(1e-5, DType::BF16).into();
        let int8 = NormSpec { out: NormOutput::Quantized(Quantizer::Int8), ..rms };
        for n in (8..=16_384).step_by(8) {
            for (spec, x_type) in [(rms, DType::BF16), (rms, DType::F32), (int8, DType::BF16)] {
                for rows in [1, SMALL_SEGMENTS, SMALL_SEGMENTS + 1, 8192] {
                    let call = NormCall { spec, rows, hidden: n, x_type, weight_type: DType::BF16 };
                    let default = NormVariant::default_for(&call);
                    assert!(default.units_per_warp(n).is_some(), "default variant for {n}");
                    assert!(NORM_VARIANTS.contains(&default), "default {default:?} is listed");
                    assert!(!default.persistent, "{default:?}");
                }
            }
        }
        // The figures the defaults come from: bf16 RMSNorm at 2048 x 4096 and 8192 x 8192, and
        // one row of 4096.
        let call = |spec, rows, hidden| NormCall {
            spec,
            rows,
            hidden,
            x_type: DType::BF16,
            weight_type: DType::BF16,
        };
        assert_eq!(NormVariant::default_for(&call(rms, 2048, 4096)), fixed(variant(2, 1, false)));
        assert_eq!(NormVariant::default_for(&call(rms, 8192, 8192)), fixed(variant(4, 1, false)));
        assert_eq!(NormVariant::default_for(&call(int8, 2048, 4096)), fixed(block_lane(4, 1)));
        assert_eq!(NormVariant::default_for(&call(int8, 8192, 8192)), fixed(block_lane(8, 1)));
        let nvfp4 = NormSpec { out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 1.0 }), ..rms };
        assert_eq!(NormVariant::default_for(&call(nvfp4, 2048, 4096)), fixed(block_lane(4, 1)));
        assert_eq!(NormVariant::default_for(&call(nvfp4, 8192, 8192)), fixed(block_lane(4, 1)));
        // Widths without a listed fixed-length variant keep the run-time length.
        assert_eq!(NormVariant::default_for(&call(rms, 8192, 16_384)), variant(8, 1, false));
        let fp8 = NormSpec { out: NormOutput::Quantized(Quantizer::Fp8E4m3 { scale: 1.0 }), ..rms };
        assert_eq!(NormVariant::default_for(&call(fp8, 8192, 8192)), variant(8, 1, false));
        assert_eq!(NormVariant::default_for(&call(rms, 1, 4096)), variant(16, 1, true));
        let layer: NormSpec = LayerNorm {
            eps: 1e-5,
            weight: WeightMode::Plain,
            bias: true,
            groups: 1,
            out: NormOutput::Float(DType::BF16),
        }
        .into();
        assert_eq!(NormVariant::default_for(&call(layer, 2048, 4096)), fixed(variant(2, 1, false)));
        assert_eq!(NormVariant::default_for(&call(layer, 8192, 8192)), fixed(variant(4, 1, false)));
        assert_eq!(NormVariant::default_for(&call(layer, 1, 4096)), variant(16, 1, true));
        assert_eq!(NormVariant::default_for(&call(layer, 8192, 16_384)), variant(8, 1, false));
        assert_eq!(NormVariant::default_for(&call(rms, 8192, 576)), variant(1, 4, false));
        assert_eq!(NormVariant::default_for(&call(rms, 1, 576)), variant(4, 1, true));
        // Per-head norms of 128 values: one warp a head, whatever the row count.
        let heads = NormSpec { groups: 32, ..rms };
        assert_eq!(NormVariant::default_for(&call(heads, 1, 4096)), variant(1, 4, false));
        let one = variant(1, 1, false);
        assert_eq!(one.units_per_warp(4096), Some(16));
        assert_eq!(one.units_per_warp(4097), None);
        assert_eq!(variant(4, 1, false).units_per_warp(1000), Some(1));
        assert_eq!(variant(4, 1, true).units_per_warp(8192), Some(8));
        assert_eq!(variant(4, 1, true).units_per_warp(8200), None);
        let unique: std::collections::HashSet<_> = NORM_VARIANTS.iter().collect();
        assert_eq!(unique.len(), NORM_VARIANTS.len(), "variants are listed once");
    }

    /// The launcher's defines of `call` on `variant` with or without the residual, as a set.
    fn launch_defines(call: &NormCall, variant: NormVariant, residual: bool) -> Vec<(String, String)> {
        let mut defines: Vec<(String, String)> = super::launch_defines(call, variant, residual, None)
            .unwrap_or_else(|e| panic!("{variant:?}: {e}"))
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        defines.sort();
        defines
    }

    #[test]
    fn launch_defines_add_the_residual_the_stages_and_the_planes() {
        let call = NormCall {
            spec: RmsNorm::llama(1e-5, DType::BF16).into(),
            rows: 2048,
            hidden: 4096,
            x_type: DType::BF16,
            weight_type: DType::BF16,
        };
        let value = |defines: &[(&str, String)], name: &str| {
            defines.iter().filter(|(k, _)| *k == name).map(|(_, v)| v.clone()).collect::<Vec<_>>()
        };
        let variant = NormVariant::default_for(&call);
        let plain = super::launch_defines(&call, variant, false, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plain, call.defines(variant).unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(value(&plain, "HAS_RESIDUAL"), ["0"]);
        let residual = super::launch_defines(&call, variant, true, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(value(&residual, "HAS_RESIDUAL"), ["1"]);
        assert_eq!(residual.len(), plain.len());
        let planes =
            super::launch_defines(&call, variant, false, Some(true)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (value(&planes, "I8_PLANES"), value(&planes, "I8_SECOND_INT")),
            (vec!["1".to_owned()], vec!["1".to_owned()])
        );
        let staged = NORM_VARIANTS.iter().copied().find(|v| v.stages > 0 && call.validate(*v).is_ok());
        let staged = staged.unwrap_or_else(|| panic!("no staged variant serves {call:?}"));
        let defines = super::launch_defines(&call, staged, false, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(value(&defines, "STAGES"), [staged.stages.to_string()]);
        // What `warm` compiles is what the launch compiles, as owned strings.
        let listed = specializations(&[(call, variant, true)]).unwrap_or_else(|e| panic!("{e}"));
        let owned: Vec<(String, String)> =
            residual.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        assert_eq!(listed, [owned]);
    }

    /// Whether `defines` is one of kernels::NORM's define sets (in any order).
    fn compiled(defines: &[(String, String)]) -> bool {
        NORM.define_sets.iter().any(|set| {
            let mut set: Vec<(String, String)> =
                set.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            set.sort();
            set == defines
        })
    }

    #[test]
    fn defines_of_the_benchmark_defaults_and_the_decode_winner_are_compiled_define_sets() {
        // The compile check compiles kernels::NORM's define sets: the declared defaults of the
        // benchmark's LayerNorm at 8192 x 8192 and of its RMSNorm after the residual add at
        // 2048 x 4096 (`kiln bench norm`), and the certified Llama-3-8B decode norm after the
        // residual add, are among them. (LayerNorm's 2w1r at 2048 x 4096 is not: it spills 12
        // bytes on sm_90 by choice, see KILN_NORM_BOUNDS in norm.cu.)
        let rms = RmsNorm::llama(1e-5, DType::BF16);
        let layer = LayerNorm {
            eps: 1e-5,
            weight: WeightMode::Plain,
            bias: true,
            groups: 1,
            out: NormOutput::Float(DType::BF16),
        };
        let call = |spec: NormSpec, rows, hidden| NormCall {
            spec,
            rows,
            hidden,
            x_type: DType::BF16,
            weight_type: DType::BF16,
        };
        for (call, residual) in
            [(call(layer.into(), 8192, 8192), false), (call(rms.into(), 2048, 4096), true)]
        {
            let defines = launch_defines(&call, NormVariant::default_for(&call), residual);
            assert!(compiled(&defines), "{call:?}: {defines:?}");
        }
        let winner = persistent(16, 1, true);
        assert!(compiled(&launch_defines(&call(rms.into(), 1, 4096), winner, true)));
        // The engine's fp32 prefill norm at 4096 with the planes of Q4_0 products.
        let engine = NormCall {
            spec: RmsNorm::llama(1e-5, DType::F32).into(),
            rows: 2048,
            hidden: 4096,
            x_type: DType::F32,
            weight_type: DType::F32,
        };
        let mut planes = launch_defines(&engine, NormVariant::default_for(&engine), false);
        planes
            .extend([("I8_PLANES".to_owned(), "1".to_owned()), ("I8_SECOND_INT".to_owned(), "1".to_owned())]);
        planes.sort();
        assert!(compiled(&planes), "{planes:?}");
        // The check itself: the residual changes the set.
        assert!(!compiled(&launch_defines(&call(rms.into(), 1, 4096), winner, false)));
        assert!(!compiled(&launch_defines(&call(layer.into(), 2048, 4096), row_total(2, 1), true)));
        assert!(!compiled(&launch_defines(
            &call(layer.into(), 2048, 4096),
            NormVariant::default_for(&call(layer.into(), 2048, 4096)),
            false
        )));
    }

    #[test]
    fn staged_variants_size_their_stages_and_grid() {
        let rms: NormSpec = RmsNorm::llama(1e-5, DType::BF16).into();
        let call =
            |spec, rows, hidden, x_type| NormCall { spec, rows, hidden, x_type, weight_type: DType::BF16 };
        let staged_list: Vec<NormVariant> = NORM_VARIANTS.iter().copied().filter(|v| v.stages > 0).collect();
        assert!(staged_list.len() >= 4);
        // Every staged variant serves the benchmark's bf16 shapes, with or without the residual.
        for v in &staged_list {
            assert!(v.stages >= 2 && !v.persistent, "{v:?}");
            for (rows, hidden) in [(2048, 4096), (8192, 8192)] {
                let c = call(rms, rows, hidden, DType::BF16);
                assert!(c.validate(*v).is_ok(), "{v:?} at {rows} x {hidden}");
                assert!(v.staged_shared_bytes(&c, true).unwrap() <= STAGED_SHARED_LIMIT);
            }
        }
        // 16 warps at 4096: one unit a warp, 512 threads, 16 bytes each a stage.
        let c = call(rms, 2048, 4096, DType::BF16);
        assert_eq!(staged(16, 1, false, 2).staged_shared_bytes(&c, false).unwrap(), 2 * 512 * 16);
        assert_eq!(staged(16, 1, false, 3).staged_shared_bytes(&c, true).unwrap(), 3 * 2 * 512 * 16);
        // fp32 x takes two pieces a unit; a gate before the norm a third stream.
        let gated = NormSpec { gate: Some(Gate::Before), ..rms };
        assert_eq!(
            staged(4, 1, false, 3).staged_shared_bytes(&call(gated, 2, 4096, DType::F32), true).unwrap(),
            3 * 4 * 3 * 2 * 128 * 16
        );
        assert!(call(gated, 2, 4096, DType::F32).validate(staged(4, 1, false, 3)).is_err());
        assert_eq!(variant(4, 1, false).staged_shared_bytes(&c, true).unwrap(), 0);
        // 32 warps a multiprocessor, within the resident blocks.
        let w = STAGED_WARPS_PER_MULTIPROCESSOR;
        assert_eq!(staged_blocks_per_multiprocessor(staged(16, 1, false, 2), w, 4), 2);
        assert_eq!(staged_blocks_per_multiprocessor(staged(8, 1, false, 2), w, 8), 4);
        assert_eq!(staged_blocks_per_multiprocessor(staged(4, 1, false, 2), w, 5), 5);
        assert_eq!(staged_blocks_per_multiprocessor(staged(4, 1, false, 2), w, 0), 1);
        assert_eq!(staged_blocks_per_multiprocessor(staged(4, 1, false, 2), 16, 8), 4);
        assert_eq!(staged_blocks_per_multiprocessor(staged(16, 1, false, 2), 8, 8), 1);
        // One lane a quantization block, staged: the same stages, the kernel's BLOCK_LANE with its
        // STAGES and the segment length.
        let nvfp4: NormSpec = RmsNorm {
            out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 448.0 }),
            ..RmsNorm::llama(1e-5, DType::BF16)
        }
        .into();
        let q = call(nvfp4, 2048, 4096, DType::BF16);
        let lane_blocks = staged_block_lane(4, 3);
        assert_eq!(lane_blocks.staged_shared_bytes(&q, false).unwrap(), 3 * 4 * 128 * 16);
        let defines = q.defines(lane_blocks).unwrap();
        for want in [("BLOCK_LANE", "1"), ("SEGMENT_N", "4096"), ("UNITS_PER_WARP", "4")] {
            assert!(defines.contains(&(want.0, want.1.to_owned())), "{want:?} in {defines:?}");
        }
        assert_eq!(
            launch_defines(&q, lane_blocks, false).iter().filter(|(k, v)| k == "STAGES" && v == "3").count(),
            1
        );
        // One stage, or stages with the register-pipelined grid, are refused.
        for bad in [staged(4, 1, false, 1), NormVariant { persistent: true, ..staged(4, 1, false, 2) }] {
            assert!(matches!(c.validate(bad), Err(Error::InvalidArgument { .. })), "{bad:?}");
        }
    }

    #[test]
    fn unserved_shapes_are_named() {
        let call = NormCall {
            spec: RmsNorm::llama(1e-5, DType::BF16).into(),
            rows: 3,
            hidden: 100,
            x_type: DType::BF16,
            weight_type: DType::BF16,
        };
        assert!(matches!(call.validate(NORM_VARIANTS[0]), Err(Error::NotServed { op: "norm kernel", .. })));
        let call = NormCall { hidden: 8192, ..call };
        assert!(call.validate(NORM_VARIANTS[0]).is_err());
        assert_eq!(call.validate(variant(2, 1, false)).unwrap(), 16);
        assert!(call.validate(variant(2, 2, true)).is_err());
    }

    /// `kernels/norm.cu`'s fast rounding of INT8 and NVFP4 codes, replayed with the same fp32
    /// operations: INT8's fused multiply-add; E2M1's two fused multiply-adds (|y| times 2 inverse
    /// plus 2^24 - 4, |y| times inverse plus 2^24), their least, and the packing of eight.
    const ROUND_MAGIC: f32 = 12_582_912.0;

    /// `KILN_E2M1_ZERO`: the bits of 2^24 - 4, those of E2M1 code 0 in `kiln_e2m1_product`.
    const E2M1_ZERO: u32 = 0x4B7F_FFFC;

    /// A xorshift64 stream for test inputs (fixed seeds: the same cases every run).
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// `kiln_int8_fast`: the bits of p * inverse + magic (the exact product rounded once).
    fn int8_fast(p: f32, inverse: f32) -> u32 {
        p.mul_add(inverse, ROUND_MAGIC).to_bits()
    }

    /// `kiln_e2m1_product`: the bits of the lesser of |y| 2 inverse + 2^24 - 4 and |y| inverse +
    /// 2^24, each rounded once (`E2M1_ZERO` + the code).
    fn e2m1_product_bits(y: f32, inverse: f32) -> u32 {
        let a = y.abs();
        let low = a.mul_add(inverse * 2.0, 16_777_212.0);
        let high = a.mul_add(inverse, 16_777_216.0);
        low.min(high).to_bits()
    }

    /// `kiln_e2m1_product`'s code with the sign `kiln_e2m1_signs` adds (bit 3 from y's sign bit).
    fn e2m1_product(y: f32, inverse: f32) -> u8 {
        let code = e2m1_product_bits(y, inverse).wrapping_sub(E2M1_ZERO);
        assert!(code < 8, "{y} * {inverse}: {code:#x}");
        (code | ((y.to_bits() >> 28) & 0x8)) as u8
    }

    /// `kiln_e2m1_pack8`: two Horner chains of the bits (modulo 2^32), joined, less the
    /// constant, with the signs (value k in nibble k, its sign in bit 4k + 3).
    fn e2m1_pack8(y: &[f32], inverse: f32) -> u32 {
        let c: Vec<u32> = y.iter().map(|&v| e2m1_product_bits(v, inverse)).collect();
        let chain = |c: &[u32]| c.iter().rev().fold(0u32, |w, &ck| w.wrapping_mul(16).wrapping_add(ck));
        let codes = chain(&c[4..8])
            .wrapping_mul(65536)
            .wrapping_add(chain(&c[0..4]))
            .wrapping_sub(E2M1_ZERO.wrapping_mul(0x1111_1111));
        let signs = y.iter().enumerate().fold(0u32, |s, (k, v)| s | ((v.to_bits() >> 31) << (4 * k + 3)));
        codes | signs
    }

    /// `kiln_nvfp4_inverse`: qscale / scale_value from the rounded reciprocal and Markstein's
    /// correction (`kiln_div_const`).
    fn nvfp4_inverse_fast(qscale: f32, scale_value: f32) -> f32 {
        let r = 1.0 / scale_value;
        let q = qscale * r;
        (-q).mul_add(scale_value, qscale).mul_add(r, q)
    }

    /// The NVFP4 fast path's inverse is the reference's division: for every fp32 mantissa of
    /// qscale and each of the 8 mantissas of a normal E4M3 scale, in the binade of 1 and at the
    /// ends of the range the kernel serves (qscale in [2^-80, 2^80], the scale in [2^-6, 448]):
    /// every operation scales by powers of two in between (the residual is a multiple of
    /// 2^(e(qscale) - 27), far from fp32's subnormals).
    #[test]
    fn nvfp4_inverse_from_the_rounded_reciprocal_is_the_division() {
        use kiln_core::ops::quantize::{e4m3_to_f32, nvfp4_inverse};
        let pairs = [(0x3F80_0000u32, 0x38u8), (0x1780_0000, 0x7E), (0x6780_0000, 0x08), (0x1780_0000, 0x08)];
        for (binade, top) in pairs {
            for code in (top & 0x78)..=(top | 0x07).min(0x7E) {
                let scale_value = e4m3_to_f32(code);
                for m in 0..(1u32 << 23) {
                    let qscale = f32::from_bits(binade | m);
                    let fast = nvfp4_inverse_fast(qscale, scale_value);
                    assert_eq!(
                        fast.to_bits(),
                        nvfp4_inverse(code, qscale).to_bits(),
                        "{qscale} / {scale_value}"
                    );
                }
            }
        }
    }

    /// The NVFP4 fast codes of `kernels/norm.cu` replayed: for inverses over the range the fast
    /// path serves ([2^-89, 2^86]), values whose products lie near every E2M1 midpoint, near 2
    /// and 4 and spread up to the bound 6.4 (1 + 3 * 2^-24) (here up to 6.99), signed zeros: the
    /// code is the reference's `e2m1_of_product`, with no clamp, exact ties included, and eight
    /// of them packed as the reference packs them.
    #[test]
    fn nvfp4_fast_codes_replayed_on_the_cpu_equal_the_reference() {
        use kiln_core::ops::quantize::e2m1_of_product;
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let (mut checked, mut ties) = (0usize, 0usize);
        let random: Vec<f32> =
            (0..300).map(|_| f32::from_bits(0x1300_0000 + (next() % 0x5780_0000) as u32)).collect();
        let powers = (-89..=85).flat_map(|e| [2.0f32.powi(e), 2.0f32.powi(e) * 1.75]);
        let midpoints = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.4, 6.99];
        for inverse in powers.chain(random) {
            let mut values: Vec<f32> = vec![0.0, -0.0];
            // The midpoints, and 2 and 4, where the kernel's sums cross a power of two.
            for m in midpoints.into_iter().chain([2.0, 4.0]) {
                let b = (m / inverse).to_bits() as i64;
                for d in -24..=24 {
                    let y = f32::from_bits((b + d) as u32);
                    values.extend([y, -y]);
                }
            }
            values.extend(
                (0..200).map(|_| (6.99 / inverse) * ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)),
            );
            values.retain(|y| f64::from(y.abs()) * f64::from(inverse) < 6.99);
            for &y in &values {
                let p = f64::from(y.abs()) * f64::from(inverse);
                ties += usize::from(midpoints[..7].iter().any(|&m| p == f64::from(m)));
                assert_eq!(
                    e2m1_product(y, inverse),
                    e2m1_of_product(y, inverse),
                    "{y} ({:#010x}) * {inverse}",
                    y.to_bits()
                );
                checked += 1;
            }
            // Eight at a time, as `kiln_e2m1_pack8` packs them (every window, so that each code
            // and sign takes every nibble).
            for eight in values.windows(8) {
                let expected = eight
                    .iter()
                    .enumerate()
                    .fold(0u32, |w, (k, &y)| w | (u32::from(e2m1_of_product(y, inverse)) << (4 * k)));
                assert_eq!(e2m1_pack8(eight, inverse), expected, "{eight:?} * {inverse}");
            }
        }
        assert!(checked > 200_000 && ties > 100, "{checked} values, {ties} exact ties");
    }

    /// The INT8 fast path of `kernels/norm.cu` replayed: for block maxima over the binades it
    /// serves (amax in [2^-100, 2^100], where `kiln_div_const` is amax / 127 and `kiln_rcp_rn`
    /// is 1 / scale rounded), values near every tie of the product and spread over the block, the
    /// low byte of one fused multiply-add is the reference's code with no clamp (|p * inverse| <=
    /// 127 (1 + 2^-23) rounds to at most 127), exact ties included.
    #[test]
    fn int8_fast_code_replayed_on_the_cpu_equals_the_reference() {
        use kiln_core::ops::quantize::{int8_code, int8_inverse};
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let mut checked = 0usize;
        // 2^-100 .. 2^100, and powers of two times 127 (exact ties).
        let random: Vec<f32> =
            (0..400).map(|_| f32::from_bits(0x0D80_0000 + (next() % 0x6400_0000) as u32)).collect();
        for amax in random.into_iter().chain((-90..=90).map(|e| 127.0 * 2.0f32.powi(e))) {
            let scale = amax / 127.0;
            let (factor, inverse) = int8_inverse(scale);
            assert_eq!(factor, 1.0);
            let mut values: Vec<f32> = vec![amax, -amax, 0.0, -0.0];
            for k in -128..=127 {
                let tie = (k as f32 + 0.5) * scale;
                let b = tie.to_bits() as i64;
                values.extend((-8..=8).map(|d| f32::from_bits((b + d) as u32)));
            }
            values.extend((0..500).map(|_| amax * ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)));
            for p in values.into_iter().filter(|p| p.abs() <= amax) {
                let code = (int8_fast(p, inverse) & 0xFF) as u8 as i8;
                assert_eq!(
                    code,
                    int8_code(p, scale, 1.0, inverse),
                    "{p} ({:#010x}) over {scale}",
                    p.to_bits()
                );
                checked += 1;
            }
        }
        assert!(checked > 1_000_000, "{checked}");
    }

    /// `kiln_div_const` of `kernels/norm.cu` (a / b from the rounded reciprocal and one fused
    /// correction) replayed: it equals the division for every fp32 mantissa, in the binades of 1
    /// and of 2^-100 and 2^100 (the ends of the range the kernel uses it in: every operation scales
    /// by the power of two in between, nothing under- or overflows), for the divisors 127 (INT8)
    /// and 6 (NVFP4); the reciprocals are the constants the kernel spells out.
    #[test]
    fn division_by_a_constant_from_its_reciprocal_is_exact_over_the_kernels_range() {
        for (b, inverse_bits) in [(127.0f32, 0x3C01_0204u32), (6.0, 0x3E2A_AAAB)] {
            let inverse = f32::from_bits(inverse_bits);
            assert_eq!(inverse, 1.0 / b);
            for binade in [0x3F80_0000u32, 0x0D80_0000, 0x7180_0000] {
                for m in 0..(1u32 << 23) {
                    let a = f32::from_bits(binade | m);
                    let q = a * inverse;
                    let r = (-q).mul_add(b, a);
                    let fast = r.mul_add(inverse, q);
                    assert_eq!(fast.to_bits(), (a / b).to_bits(), "{a} / {b}");
                }
            }
        }
    }

    #[test]
    fn int8_planes_serve_fp32_rows_of_whole_units_for_the_integer_formats() {
        let call = NormCall {
            spec: RmsNorm::llama(1e-5, DType::F32).into(),
            rows: 2,
            hidden: 4096,
            x_type: DType::F32,
            weight_type: DType::F32,
        };
        assert!(int8_planes_served(&call, DType::Q4_0).unwrap());
        assert!(!int8_planes_served(&call, DType::Q8_0).unwrap());
        assert!(!int8_planes_served(&call, DType::Q4_1).unwrap());
        let named = |r: Result<bool>| matches!(r, Err(Error::NotServed { op: "norm with int8 planes", .. }));
        assert!(named(int8_planes_served(&call, DType::BF16)));
        assert!(named(int8_planes_served(&NormCall { hidden: 576, ..call }, DType::Q4_0)));
        let bf16_out = NormCall { spec: RmsNorm::llama(1e-5, DType::BF16).into(), ..call };
        assert!(named(int8_planes_served(&bf16_out, DType::Q4_0)));
    }
}
