//! Launcher of `kernels/lm_head.cu`: `kiln_core::ops::lm_head` on the GPU, equal to the CPU
//! reference bit for bit for every [`LmHeadVariant`].
//!
//! Buffers: `h` is `rows x hidden` fp32 (16-byte aligned rows: `hidden` a multiple of 8), the
//! weights `vocab` rows of `row_bytes(dtype, hidden)` bytes, `row_scale` `rows` fp32, `logits`
//! `rows x vocab` fp32, `stats` `rows x ceil(vocab / tile)` packed `u64` (row-major), where the
//! tile is the spec's `stats_block` when it asks for statistics.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;
use kiln_core::ops::lm_head::{row_bytes, LmHead, MAX_ROWS};
use kiln_core::{DType, Error, Result};

use crate::kernels::LM_HEAD;
use crate::memory::DeviceMemory;
use crate::runtime::{driver_error, Gpu};

/// One shape of the kernel: warps per block (splitting `hidden` in units of 256), vocabulary
/// rows each warp loads per step (a power of two up to 16; reduced `32 / rows.next_power_of_two()`
/// at a time when the step holds more sums than a warp's 32 lanes), vocabulary rows per tile,
/// whether the lanes hold permuted slots (a reduction with no selects: `XSLOT`), whether each
/// step's loads are issued one step ahead in registers (`PIPE`), the depth of the shared-memory
/// ring that cp.async fills ahead of the products across tiles, on a persistent grid (`STAGES`,
/// 0 for none), the blocks a multiprocessor the compile keeps registers for (`MIN_BLOCKS`:
/// 1, 2 or 4), and whether the lanes copy each ring step cooperatively (`COOP`: one source
/// address a lane and constant ring slots, the step loop unrolled by `stages`, so `tile /
/// vocab_rows` must be a multiple of `stages`), and whether 2-byte weights are decoded by the
/// matrix units (`TCDEC`: two `mma` for a lane's eight weights instead of eight shifts; a logit
/// that comes out NaN, which a non-finite weight can make of its neighbours, is computed again
/// the reference's way), and at most how many vocabulary rows' sums one reduction takes
/// (`VSUB_MAX`, 0 for as many as 32 lanes hold: fewer sums held at once, more reductions).
/// Every variant computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LmHeadVariant {
    pub warps: u32,
    pub vocab_rows: u32,
    pub tile: u32,
    pub permuted: bool,
    pub pipelined: bool,
    pub stages: u32,
    pub blocks: u32,
    pub coop: bool,
    pub matrix_decode: bool,
    pub reduce_rows: u32,
}

impl LmHeadVariant {
    const fn plain(warps: u32, vocab_rows: u32, tile: u32) -> LmHeadVariant {
        LmHeadVariant {
            warps,
            vocab_rows,
            tile,
            permuted: false,
            pipelined: false,
            stages: 0,
            blocks: 1,
            coop: false,
            matrix_decode: false,
            reduce_rows: 0,
        }
    }

    const fn fast(warps: u32, vocab_rows: u32, tile: u32) -> LmHeadVariant {
        LmHeadVariant {
            warps,
            vocab_rows,
            tile,
            permuted: true,
            pipelined: true,
            stages: 0,
            blocks: 1,
            coop: false,
            matrix_decode: false,
            reduce_rows: 0,
        }
    }

    const fn ring(warps: u32, vocab_rows: u32, tile: u32, stages: u32) -> LmHeadVariant {
        LmHeadVariant::ring_blocks(warps, vocab_rows, tile, stages, 1)
    }

    /// A ring variant compiled for `blocks` resident blocks a multiprocessor (at most 65536 /
    /// (`blocks` x threads) registers a thread), so that small blocks keep as many warps
    /// resident as one large block while each adds up its tiles apart.
    const fn ring_blocks(warps: u32, vocab_rows: u32, tile: u32, stages: u32, blocks: u32) -> LmHeadVariant {
        LmHeadVariant {
            warps,
            vocab_rows,
            tile,
            permuted: true,
            pipelined: false,
            stages,
            blocks,
            coop: false,
            matrix_decode: false,
            reduce_rows: 0,
        }
    }

    /// A ring variant whose lanes copy each step cooperatively (`COOP`), for `blocks` resident
    /// blocks a multiprocessor.
    const fn coop(warps: u32, vocab_rows: u32, tile: u32, stages: u32, blocks: u32) -> LmHeadVariant {
        LmHeadVariant { coop: true, ..LmHeadVariant::ring_blocks(warps, vocab_rows, tile, stages, blocks) }
    }

    /// The same variant with 2-byte weights decoded by the matrix units (`TCDEC`).
    const fn matrix(self) -> LmHeadVariant {
        LmHeadVariant { matrix_decode: true, ..self }
    }

    /// The same variant reducing the sums of at most `rows` vocabulary rows at a time (`VSUB_MAX`).
    const fn reduce(self, rows: u32) -> LmHeadVariant {
        LmHeadVariant { reduce_rows: rows, ..self }
    }

    /// A short label: `8w/4v/64t`, with `x` for permuted slots, `p` for pipelined loads, `s4`
    /// for a ring of 4 stages, `c` for cooperative ring copies, `b2` for two blocks a
    /// multiprocessor, `m` for the matrix-unit decode and `r2` for reductions of 2 rows' sums.
    pub fn label(&self) -> String {
        format!(
            "{}w/{}v/{}t{}{}{}{}{}{}{}",
            self.warps,
            self.vocab_rows,
            self.tile,
            if self.permuted { "x" } else { "" },
            if self.pipelined { "p" } else { "" },
            if self.stages > 0 { format!("s{}", self.stages) } else { String::new() },
            if self.coop { "c" } else { "" },
            if self.blocks > 1 { format!("b{}", self.blocks) } else { String::new() },
            if self.matrix_decode { "m" } else { "" },
            if self.reduce_rows > 0 { format!("r{}", self.reduce_rows) } else { String::new() }
        )
    }

    /// Bytes of the ring in shared memory: per warp, `stages` steps of `vocab_rows` rows of 32
    /// lanes' 16 bytes (2-byte weights; quantized weights take no ring).
    fn ring_bytes(&self, weight: DType) -> usize {
        if self.stages == 0 || !matches!(weight, DType::BF16 | DType::F16) {
            return 0;
        }
        (self.warps * self.stages * self.vocab_rows) as usize * 512
    }
}

/// The variants the tests check and the benchmark sweeps.
pub const LM_HEAD_VARIANTS: &[LmHeadVariant] = &[
    LmHeadVariant::plain(4, 4, 64),
    LmHeadVariant::plain(8, 4, 64),
    LmHeadVariant::plain(8, 2, 96),
    LmHeadVariant::plain(16, 4, 32),
    LmHeadVariant::plain(16, 2, 64),
    LmHeadVariant::plain(8, 8, 128),
    LmHeadVariant::plain(4, 1, 16),
    LmHeadVariant::fast(16, 4, 32),
    LmHeadVariant::fast(8, 4, 64),
    LmHeadVariant::fast(4, 4, 64),
    LmHeadVariant::fast(8, 8, 128),
    LmHeadVariant::fast(8, 2, 64),
    LmHeadVariant::fast(4, 2, 64),
    LmHeadVariant {
        warps: 16,
        vocab_rows: 4,
        tile: 32,
        permuted: false,
        pipelined: true,
        stages: 0,
        blocks: 1,
        coop: false,
        matrix_decode: false,
        reduce_rows: 0,
    },
    // The ring (cp.async ahead of the products, persistent grid), for 4 and 8 rows first. With
    // 16 warps each warp keeps one unit of 4096 for the whole launch (h loaded once).
    LmHeadVariant::ring(4, 4, 16, 4),
    LmHeadVariant::ring(4, 4, 32, 4),
    LmHeadVariant::ring(8, 4, 16, 2),
    LmHeadVariant::ring(16, 4, 32, 2),
    LmHeadVariant::ring(16, 4, 16, 4),
    LmHeadVariant::ring(16, 4, 64, 2),
    LmHeadVariant::ring(8, 4, 32, 4),
    LmHeadVariant::ring(8, 2, 16, 4),
    LmHeadVariant::ring(4, 8, 16, 4),
    LmHeadVariant::ring(4, 8, 32, 2),
    LmHeadVariant::ring(8, 8, 32, 2),
    LmHeadVariant::ring(16, 8, 32, 2),
    // With the fused chains (one FFMA per weight and row) and the ring's lean producer, for 4 and
    // 8 rows at the 151936 x 4096 shape: deeper rings, wider tiles, and 8 rows a step at 8 rows
    // (two reductions of 32 sums a step, half the loop and copy overhead per weight).
    LmHeadVariant::ring(16, 4, 64, 4),
    LmHeadVariant::ring(16, 4, 128, 2),
    LmHeadVariant::ring(8, 4, 64, 4),
    LmHeadVariant::ring(8, 8, 64, 2),
    LmHeadVariant::ring(8, 8, 64, 4),
    LmHeadVariant::ring(16, 8, 64, 2),
    LmHeadVariant::ring(4, 8, 64, 4),
    // 16 warps a multiprocessor in two or four blocks (128 registers a thread): while one block
    // adds up a tile at its barriers, the others stream and compute.
    LmHeadVariant::ring_blocks(8, 4, 64, 2, 2),
    LmHeadVariant::ring_blocks(8, 4, 64, 4, 2),
    LmHeadVariant::ring_blocks(8, 4, 32, 4, 2),
    LmHeadVariant::ring_blocks(4, 4, 32, 4, 4),
    LmHeadVariant::ring_blocks(8, 8, 64, 2, 2),
    // Cooperative ring copies (COOP): 385.5 (s2) or 382 (s4) instead of 400 SASS instructions a
    // step of 8 rows, 227 instead of 242 at 4 rows; 8 warps of 8 rows a step: 372 instead of 386 (sm_90).
    LmHeadVariant::coop(16, 4, 64, 2, 1),
    LmHeadVariant::coop(16, 4, 64, 4, 1),
    LmHeadVariant::coop(16, 4, 32, 2, 1),
    LmHeadVariant::coop(8, 4, 64, 2, 2),
    LmHeadVariant::coop(8, 4, 64, 4, 2),
    LmHeadVariant::coop(8, 8, 64, 2, 1),
    // The matrix-unit decode (TCDEC): 8 mma.m16n8k8 instead of 32 shifts and masks a step of 4
    // rows of bf16. SASS of the split loop a step at 8 rows (sm_90): 2 stages 373.5 without, 361
    // with it (the registers it frees go to the NaN check's way back), 351.5 with it and
    // reductions of 2 rows (16 sums: 32 SHFL a step, not 31, and 16 sums fewer held); 4 stages
    // 371.5 without, 348.75 with it. Measured slower all the same (8 rows on the H200,
    // `bench/results/2026-12-05-h200/a-lm-head`): 64txs4cm 324.4-349.2 us and 64txs2cmr2
    // 338.5-361.1 against the default 64txs4c's 295.4-304.4, 64txs2cr2 317.0-330.9.
    LmHeadVariant::coop(16, 4, 64, 2, 1).matrix(),
    LmHeadVariant::coop(16, 4, 64, 2, 1).matrix().reduce(2),
    LmHeadVariant::coop(16, 4, 64, 2, 1).reduce(2),
    LmHeadVariant::coop(16, 4, 64, 4, 1).matrix(),
    LmHeadVariant::plain(16, 4, 32).matrix(),
];

impl LmHeadVariant {
    /// The default variant for `rows`, the fastest measured on the H200 at 151936 x 4096 bf16
    /// (`bench/results/2026-11-30-h200-kernels/step3`, measured again in
    /// `bench/results/2026-12-04-h200` and `2026-12-05-h200`): 16 warps of 4 rows a step, tiles
    /// of 32, for 1 row (279.0 us); the cooperative ring of 16 warps, 4 rows a step, tiles of 64,
    /// 4 stages for 2 to 8 rows (278.6 and 283.9 us at 2 and 4 rows; at 8 rows 4 stages ran
    /// ahead of 2 in every process of `2026-12-05-h200`, though from one process to the next its
    /// time varies more). A call the ring does not serve (a statistics block that is not a
    /// multiple of its steps) runs [`LmHeadVariant::fallback_for`]: see
    /// [`LmHeadVariant::default_for_call`].
    pub fn default_for(rows: usize) -> LmHeadVariant {
        match rows {
            0 | 1 => LmHeadVariant::plain(16, 4, 32),
            _ => LmHeadVariant::coop(16, 4, 64, 4, 1),
        }
    }

    /// The default before the cooperative ring, which serves every call the kernel serves: the
    /// permuted, pipelined kernel with as many rows a step as the 32 sums allow (at most 4), and
    /// for 1 or 2 rows 16 warps of 4 rows a step, tiles of 32.
    pub fn fallback_for(rows: usize) -> LmHeadVariant {
        if rows <= 2 {
            return LmHeadVariant::plain(16, 4, 32);
        }
        let per_step = (32 / rows.next_power_of_two()).min(4) as u32;
        LmHeadVariant::fast(8, per_step, 64)
    }

    /// The default for a call on a device whose blocks may opt in to `shared_limit` bytes of
    /// shared memory: [`LmHeadVariant::default_for`] where [`plan`] serves it within that limit
    /// (the ring's stages take up to ~130 KiB at 4 rows), otherwise
    /// [`LmHeadVariant::fallback_for`].
    pub fn default_for_call(head: &LmHead, rows: usize, shared_limit: u64) -> LmHeadVariant {
        let preferred = LmHeadVariant::default_for(rows);
        match plan(head, rows, preferred) {
            Ok(p) if p.shared_bytes as u64 + 64 <= shared_limit => preferred,
            _ => LmHeadVariant::fallback_for(rows),
        }
    }
}

/// Device buffers of one LM head call (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct LmHeadBuffers<'a> {
    pub h: &'a DeviceMemory,
    pub weights: &'a DeviceMemory,
    pub row_scale: Option<&'a DeviceMemory>,
    pub logits: &'a DeviceMemory,
    pub stats: Option<&'a DeviceMemory>,
}

fn weight_code(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::BF16 => 0,
        DType::F16 => 1,
        DType::Q8_0 => 2,
        DType::Q4_0 => 3,
        DType::Q4_1 => 4,
        other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "lm_head kernel" }),
    })
}

fn not_served(reason: String) -> Error {
    Error::NotServed { op: "lm_head kernel", reason }
}

/// The launch plan of a call: its defines, tile, tiles and shared bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmHeadPlan {
    pub defines: Vec<(&'static str, String)>,
    pub tile: usize,
    pub tiles: usize,
    pub shared_bytes: usize,
    pub threads: u32,
    /// One block per resident slot, each looping over tiles (the ring runs on across them).
    pub persistent: bool,
    /// Bytes of one buffer of unit sums (`shared_bytes` holds one, or two after
    /// [`LmHeadPlan::two_buffers`]).
    pub sums_bytes: usize,
}

impl LmHeadPlan {
    /// On a persistent grid, two buffers of unit sums (the kernel's `PBUF`: one barrier a tile
    /// instead of two) where they fit in `max_shared` bytes of shared memory a block; otherwise
    /// the plan as it is. The logits are the same bits either way.
    pub fn two_buffers(mut self, max_shared: usize) -> LmHeadPlan {
        if self.persistent && self.shared_bytes + self.sums_bytes + 64 <= max_shared {
            self.shared_bytes += self.sums_bytes;
            self.defines.iter_mut().filter(|(k, _)| *k == "PBUF").for_each(|(_, v)| *v = "2".to_owned());
        }
        self
    }
}

/// Checks what the kernel serves for `rows` rows on `variant` and plans the launch.
pub fn plan(head: &LmHead, rows: usize, variant: LmHeadVariant) -> Result<LmHeadPlan> {
    if rows == 0 || rows > MAX_ROWS {
        return Err(not_served(format!("{rows} rows (1 to {MAX_ROWS})")));
    }
    let code = weight_code(head.weight)?;
    if head.hidden == 0 || !head.hidden.is_multiple_of(8) || (code >= 2 && !head.hidden.is_multiple_of(32)) {
        return Err(not_served(format!("hidden {} for {} weights", head.hidden, head.weight)));
    }
    if !variant.vocab_rows.is_power_of_two()
        || variant.vocab_rows > 16
        || ![1, 2, 4, 8, 16, 32].contains(&variant.warps)
        || ![0, 2, 4, 8].contains(&variant.stages)
        || ![1, 2, 4].contains(&variant.blocks)
        || (variant.stages > 0 && variant.pipelined)
        || (variant.coop && (variant.stages == 0 || !variant.permuted))
        || !(variant.reduce_rows == 0 || variant.reduce_rows.is_power_of_two() && variant.reduce_rows <= 16)
    {
        return Err(not_served(format!("variant {variant:?} for {rows} rows")));
    }
    if variant.ring_bytes(head.weight) > 0 && head.hidden > 1 << 24 {
        // The ring's producer steps VROWS rows of 2 * hidden bytes in 32 bits.
        return Err(not_served(format!("hidden {} on the ring variant {}", head.hidden, variant.label())));
    }
    let tile = head.stats_block.unwrap_or(variant.tile as usize);
    if tile == 0 || !tile.is_multiple_of(variant.vocab_rows as usize) || tile > 4096 {
        return Err(not_served(format!(
            "tile (statistics block) of {tile} tokens: needs a multiple of {} up to 4096",
            variant.vocab_rows
        )));
    }
    if variant.coop
        && variant.ring_bytes(head.weight) > 0
        && !(tile / variant.vocab_rows as usize).is_multiple_of(variant.stages as usize)
    {
        // The cooperative ring's step loop is unrolled by the stages: every (tile, unit) starts at slot 0.
        return Err(not_served(format!(
            "tile of {tile} tokens on {}: needs a multiple of {} x {}",
            variant.label(),
            variant.vocab_rows,
            variant.stages
        )));
    }
    let units = head.hidden.div_ceil(256);
    // The unit sums, then (16-byte aligned) the ring.
    let sums_bytes = (units * rows * (tile + 1)).next_multiple_of(4) * 4;
    let shared_bytes = sums_bytes + variant.ring_bytes(head.weight);
    let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
    let defines = vec![
        ("ROWS", rows.to_string()),
        ("W_T", code.to_string()),
        ("WARPS", variant.warps.to_string()),
        ("VROWS", variant.vocab_rows.to_string()),
        ("XSLOT", flag(variant.permuted)),
        ("PIPE", flag(variant.pipelined)),
        ("STAGES", variant.stages.to_string()),
        ("MIN_BLOCKS", variant.blocks.to_string()),
        ("COOP", flag(variant.coop)),
        ("ROW_SCALE", flag(false)),
        ("SOFT_CAP", flag(head.soft_cap.is_some())),
        ("STATS", flag(head.stats_block.is_some())),
        ("PBUF", "1".to_owned()),
        ("TCDEC", flag(variant.matrix_decode)),
        ("VSUB_MAX", if variant.reduce_rows == 0 { 16 } else { variant.reduce_rows }.to_string()),
    ];
    Ok(LmHeadPlan {
        defines,
        tile,
        tiles: head.vocab.div_ceil(tile),
        shared_bytes,
        threads: variant.warps * 32,
        persistent: variant.stages > 0,
        sums_bytes,
    })
}

/// The environment variable that, for measurement, turns off the kernel's split cooperative loop
/// (`SPLIT=0`) or its second buffer of unit sums (`PBUF=1`), comma-separated:
/// `KILN_LM_HEAD_OFF=SPLIT,PBUF kiln bench lm-head --rows 8`. The logits are the same bits.
pub const LM_HEAD_OFF_ENV: &str = "KILN_LM_HEAD_OFF";

/// Applies [`LM_HEAD_OFF_ENV`] to `plan`.
fn measurement_overrides(plan: &mut LmHeadPlan) -> Result<()> {
    let Ok(value) = std::env::var(LM_HEAD_OFF_ENV) else { return Ok(()) };
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "SPLIT" => plan.defines.push(("SPLIT", "0".to_owned())),
            "PBUF" => {
                if plan.defines.contains(&("PBUF", "2".to_owned())) {
                    plan.shared_bytes -= plan.sums_bytes;
                }
                plan.defines.iter_mut().filter(|(k, _)| *k == "PBUF").for_each(|(_, v)| *v = "1".to_owned());
            }
            other => {
                return Err(Error::InvalidArgument {
                    name: LM_HEAD_OFF_ENV,
                    value: value.clone(),
                    reason: format!("`{other}` is not SPLIT or PBUF"),
                })
            }
        }
    }
    Ok(())
}

/// Runs `head` over `rows` rows on `gpu`'s stream with `variant` (or the default).
pub fn lm_head(
    gpu: &Gpu,
    head: &LmHead,
    rows: usize,
    buffers: LmHeadBuffers<'_>,
    variant: Option<LmHeadVariant>,
) -> Result<()> {
    let variant = variant.unwrap_or_else(|| {
        LmHeadVariant::default_for_call(head, rows, gpu.facts().shared_memory_per_block_optin_bytes)
    });
    let max_shared = gpu.facts().shared_memory_per_block_optin_bytes as usize;
    let mut plan = plan(head, rows, variant)?.two_buffers(max_shared);
    measurement_overrides(&mut plan)?;
    let row = row_bytes(head.weight, head.hidden)?;
    super::check_buffer("lm_head", "h", buffers.h.len_bytes(), rows * head.hidden * 4)?;
    super::check_buffer("lm_head", "weights", buffers.weights.len_bytes(), head.vocab * row)?;
    super::check_buffer("lm_head", "logits", buffers.logits.len_bytes(), rows * head.vocab * 4)?;
    if let Some(scale) = buffers.row_scale {
        super::check_buffer("lm_head", "row_scale", scale.len_bytes(), rows * 4)?;
        plan.defines.iter_mut().filter(|(k, _)| *k == "ROW_SCALE").for_each(|(_, v)| *v = "1".to_owned());
    }
    match (head.stats_block.is_some(), buffers.stats) {
        (true, Some(stats)) => {
            super::check_buffer("lm_head", "stats", stats.len_bytes(), rows * plan.tiles * 8)?
        }
        (false, None) => {}
        (wanted, _) => {
            return Err(Error::InvalidArgument {
                name: "stats",
                value: if wanted { "missing" } else { "given" }.to_owned(),
                reason: format!("the head's stats_block is {:?}", head.stats_block),
            })
        }
    }
    if plan.shared_bytes + 64 > max_shared {
        return Err(not_served(format!(
            "{} bytes of shared memory for tile {} x {} rows x hidden {} (the device gives {max_shared})",
            plan.shared_bytes, plan.tile, rows, head.hidden
        )));
    }
    let define_refs: Vec<(&str, &str)> = plan.defines.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let function = gpu.function(&LM_HEAD, "kiln_lm_head", &define_refs)?;
    if plan.shared_bytes > 48 * 1024 {
        function
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                plan.shared_bytes as i32,
            )
            .map_err(|e| driver_error("cuFuncSetAttribute", e))?;
    }
    let mut grid = plan.tiles.min(1 << 20);
    if plan.persistent {
        let resident = function
            .occupancy_max_active_blocks_per_multiprocessor(plan.threads, plan.shared_bytes, None)
            .map_err(|e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor(kiln_lm_head)", e))?;
        let multiprocessors = gpu.facts().multiprocessors.max(1) as usize;
        grid = grid.min(resident.max(1) as usize * multiprocessors);
    }
    let blocks = u32::try_from(grid).map_err(|_| not_served(format!("{} tiles", plan.tiles)))?;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.shared_bytes as u32,
    };
    let ptr = |m: Option<&DeviceMemory>| m.map_or(0u64, DeviceMemory::device_ptr);
    let (h, weights, logits) =
        (buffers.h.device_ptr(), buffers.weights.device_ptr(), buffers.logits.device_ptr());
    let (row_scale, stats) = (ptr(buffers.row_scale), ptr(buffers.stats));
    let vocab = head.vocab as i64;
    let hidden = i32::try_from(head.hidden).map_err(|_| not_served(format!("hidden {}", head.hidden)))?;
    let row_bytes = row as i64;
    let tile = plan.tile as i32;
    let cap = head.soft_cap.unwrap_or(1.0);
    let mut launch = gpu.launch_builder(&function);
    launch
        .arg(&h)
        .arg(&weights)
        .arg(&row_scale)
        .arg(&logits)
        .arg(&stats)
        .arg(&vocab)
        .arg(&hidden)
        .arg(&row_bytes)
        .arg(&tile)
        .arg(&head.logit_scale)
        .arg(&cap);
    // SAFETY: the arguments match `kiln_lm_head`'s signature (5 pointers, i64, i32, i64, i32, 2
    // floats); `row_scale` and `stats` are null only when the defines make the kernel ignore
    // them; every buffer was checked above to hold what the kernel touches for `rows` rows,
    // `vocab` rows of `row_bytes` bytes and `tiles` statistics per row; the dynamic shared memory
    // is what the kernel indexes (units x rows x (tile + 1) floats); the blocks come from this
    // device's pool, which reuses memory only in this stream's order.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_lm_head)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(hidden: usize, weight: DType) -> LmHead {
        LmHead { hidden, vocab: 1000, weight, logit_scale: 1.0, soft_cap: None, stats_block: None }
    }

    #[test]
    fn every_default_variant_is_served() {
        for rows in 1..=MAX_ROWS {
            for dtype in [DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_1] {
                let planned = plan(&head(4096, dtype), rows, LmHeadVariant::default_for(rows)).unwrap();
                assert!(planned.shared_bytes as u64 + 64 <= H200_OPTIN, "{rows} rows: {planned:?}");
                // The fallback serves what the ring refuses (a statistics block of 8 tokens) and
                // what does not fit the device's shared memory (99 KiB on sm_86 / sm_89).
                let stats = LmHead { stats_block: Some(8), ..head(4096, dtype) };
                for limit in [H200_OPTIN, 99 * 1024] {
                    for call in [stats, head(4096, dtype)] {
                        let chosen = LmHeadVariant::default_for_call(&call, rows, limit);
                        let planned = plan(&call, rows, chosen).unwrap();
                        assert!(planned.shared_bytes as u64 + 64 <= limit, "{rows} rows: {}", chosen.label());
                    }
                }
            }
        }
        // Where the ring serves the call, the call's default is the measured one.
        let bf16 = head(4096, DType::BF16);
        assert_eq!(LmHeadVariant::default_for_call(&bf16, 8, H200_OPTIN).label(), "16w/4v/64txs4c");
        assert_eq!(LmHeadVariant::default_for_call(&bf16, 4, H200_OPTIN).label(), "16w/4v/64txs4c");
        assert_eq!(LmHeadVariant::default_for_call(&bf16, 4, 99 * 1024), LmHeadVariant::fallback_for(4));
        let stats8 = LmHead { stats_block: Some(8), ..bf16 };
        assert_eq!(LmHeadVariant::default_for_call(&stats8, 4, H200_OPTIN), LmHeadVariant::fallback_for(4));
    }

    /// The H200's opt-in shared memory per block.
    const H200_OPTIN: u64 = 232_448;

    #[test]
    fn persistent_plans_take_two_buffers_of_unit_sums_where_they_fit() {
        let bf16 = head(4096, DType::BF16);
        let one = plan(&bf16, 8, LmHeadVariant::default_for(8)).unwrap();
        assert!(one.defines.contains(&("PBUF", "1".to_owned())));
        let two = one.clone().two_buffers(H200_OPTIN as usize);
        assert_eq!(two.shared_bytes, one.shared_bytes + one.sums_bytes);
        assert_eq!(one.sums_bytes, (16 * 8 * 65usize).next_multiple_of(4) * 4);
        assert!(two.defines.contains(&("PBUF", "2".to_owned())));
        // Too little shared memory: one buffer, as planned.
        assert_eq!(one.clone().two_buffers(one.shared_bytes + 64), one);
        // No persistent grid: one buffer.
        let plain = plan(&bf16, 8, LmHeadVariant::plain(16, 4, 32)).unwrap();
        assert_eq!(plain.clone().two_buffers(H200_OPTIN as usize), plain);
    }

    #[test]
    fn ring_variants_plan_their_ring_and_a_persistent_grid() {
        let h200_optin = 227 * 1024;
        for variant in LM_HEAD_VARIANTS.iter().copied().filter(|v| v.stages > 0) {
            for rows in 1..=MAX_ROWS {
                let Ok(bf16) = plan(&head(4096, DType::BF16), rows, variant) else { continue };
                let sums = (16 * rows * (variant.tile as usize + 1)).next_multiple_of(4) * 4;
                let ring = (variant.warps * variant.stages * variant.vocab_rows) as usize * 512;
                assert_eq!(bf16.shared_bytes, sums + ring, "{} at {rows} rows", variant.label());
                assert!(bf16.shared_bytes + 64 <= h200_optin, "{} at {rows} rows", variant.label());
                assert!(bf16.persistent);
                assert!(bf16.defines.contains(&("STAGES", variant.stages.to_string())));
                // Quantized weights are decoded at the load: no ring.
                let q8 = plan(&head(4096, DType::Q8_0), rows, variant).unwrap();
                assert_eq!(q8.shared_bytes, sums, "{} at {rows} rows", variant.label());
            }
        }
        let both = LmHeadVariant { pipelined: true, ..LmHeadVariant::ring(4, 4, 16, 4) };
        assert!(matches!(plan(&head(4096, DType::BF16), 8, both), Err(Error::NotServed { .. })));
        let odd = LmHeadVariant::ring(4, 4, 16, 3);
        assert!(matches!(plan(&head(4096, DType::BF16), 8, odd), Err(Error::NotServed { .. })));
        assert_eq!(LmHeadVariant::ring(4, 8, 16, 4).label(), "4w/8v/16txs4");
        assert_eq!(LmHeadVariant::ring_blocks(8, 4, 64, 2, 2).label(), "8w/4v/64txs2b2");
        assert_eq!(LmHeadVariant::coop(16, 4, 64, 2, 1).label(), "16w/4v/64txs2c");
        assert_eq!(LmHeadVariant::coop(8, 4, 64, 2, 2).label(), "8w/4v/64txs2cb2");
        let coop = plan(&head(4096, DType::BF16), 8, LmHeadVariant::coop(16, 4, 64, 4, 1)).unwrap();
        assert!(coop.defines.contains(&("COOP", "1".to_owned())));
        let uneven = LmHead { stats_block: Some(8), ..head(4096, DType::BF16) };
        let coop4 = LmHeadVariant::coop(16, 4, 64, 4, 1);
        assert!(matches!(plan(&uneven, 8, coop4), Err(Error::NotServed { .. })));
        // Quantized weights take no ring: any tile of whole steps.
        assert!(plan(&LmHead { weight: DType::Q8_0, ..uneven }, 8, coop4).is_ok());
        let no_ring = LmHeadVariant { stages: 0, ..coop4 };
        assert!(matches!(plan(&head(4096, DType::BF16), 8, no_ring), Err(Error::NotServed { .. })));
        let three = LmHeadVariant::ring_blocks(8, 4, 64, 2, 3);
        assert!(matches!(plan(&head(4096, DType::BF16), 8, three), Err(Error::NotServed { .. })));
        let labels: std::collections::HashSet<String> = LM_HEAD_VARIANTS.iter().map(|v| v.label()).collect();
        assert_eq!(labels.len(), LM_HEAD_VARIANTS.len(), "two variants share a label");
    }

    #[test]
    fn unserved_calls_are_named() {
        let v = LmHeadVariant::default_for(1);
        assert!(matches!(plan(&head(4096, DType::F32), 1, v), Err(Error::DTypeNotServed { .. })));
        assert!(matches!(plan(&head(100, DType::BF16), 1, v), Err(Error::NotServed { .. })));
        assert!(matches!(plan(&head(4096, DType::BF16), 9, v), Err(Error::NotServed { .. })));
        let wide = LmHeadVariant::plain(8, 32, 64);
        assert!(matches!(plan(&head(4096, DType::BF16), 8, wide), Err(Error::NotServed { .. })));
        let odd = LmHeadVariant::plain(8, 3, 63);
        assert!(matches!(plan(&head(4096, DType::BF16), 1, odd), Err(Error::NotServed { .. })));
        // More sums a step than 32 lanes: reduced 32 at a time.
        let split = LmHeadVariant::ring(8, 8, 64, 4);
        assert!(plan(&head(4096, DType::BF16), 8, split).is_ok());
        let huge = LmHead { vocab: 2, ..head(1 << 25, DType::BF16) };
        assert!(matches!(plan(&huge, 8, split), Err(Error::NotServed { .. })));
        assert!(plan(&huge, 8, LmHeadVariant::plain(8, 4, 64)).is_ok());
        let odd_stats = LmHead { stats_block: Some(30), ..head(4096, DType::BF16) };
        assert!(matches!(plan(&odd_stats, 1, v), Err(Error::NotServed { .. })));
        let three = LmHeadVariant::coop(16, 4, 64, 2, 1).reduce(3);
        assert!(matches!(plan(&head(4096, DType::BF16), 8, three), Err(Error::NotServed { .. })));
    }

    #[test]
    fn the_matrix_decode_and_smaller_reductions_reach_the_kernel_and_the_label() {
        let base = LmHeadVariant::coop(16, 4, 64, 2, 1);
        let both = base.matrix().reduce(2);
        assert_eq!(both.label(), "16w/4v/64txs2cmr2");
        assert_eq!(base.label(), "16w/4v/64txs2c");
        let defines = plan(&head(4096, DType::BF16), 8, both).unwrap().defines;
        assert!(defines.contains(&("TCDEC", "1".to_owned())));
        assert!(defines.contains(&("VSUB_MAX", "2".to_owned())));
        let defines = plan(&head(4096, DType::BF16), 8, base).unwrap().defines;
        assert!(defines.contains(&("TCDEC", "0".to_owned())));
        assert!(defines.contains(&("VSUB_MAX", "16".to_owned())));
        // Every label names one variant, so `--variants` picks exactly what it says.
        let mut labels: Vec<String> = LM_HEAD_VARIANTS.iter().map(LmHeadVariant::label).collect();
        let listed = labels.len();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), listed);
    }
}
