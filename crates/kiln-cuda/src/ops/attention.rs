//! Launcher of `kernels/attention.cu`: causal grouped-query attention over the paged KV cache
//! (prefill, chunked prefill, split decode), the combine of the splits, and the K/V append.
//!
//! Buffers ([`DeviceMemory`], bf16 unless said), as `kiln_core::ops::attention` lays them out:
//! - `q`, `out`: `[query_token][q_head][head_dim]`, the sequences' query tokens one after another;
//! - `k_cache`, `v_cache`: one layer's `[page][kv_head][slot][head_dim]` (`kiln_engine::kv`);
//! - [`PagedBatch`]: the sequences' metadata on the device, as CSR arrays (`i32` offsets, `u32`
//!   page ids), built once per step and shared by every layer;
//! - the scratch of a split call: [`scratch_bytes`] of f32 partial outputs and their log-sums.
//!
//! A call with `splits > 1` writes partials and combines them in split order in the same launch
//! (the last split block of each group to finish, by a ticket counter that every launch leaves at
//! zero; the tiled kernel's decode at 2 to [`MAX_CLUSTER_SPLITS`] splits on sm_90 launches each
//! group's splits as one thread block cluster instead, and its split 0 combines them from the
//! others' shared memory with the same arithmetic, [`cluster_combines`]); `splits` is chosen from the batch and the heads only ([`decode_splits`]), never from the context length,
//! so the grid of a decode step is the same at every step.
//!
//! Two kernels ([`AttentionKernel`]): the tiled kernel serves every call (prefill, chunked
//! prefill, decode); the streaming kernel serves decode (one query token per sequence) and is
//! the default there ([`AttentionVariant::DECODE`]); [`AttentionVariant::DECODE_TILED`] keeps the
//! tiled kernel's decode of the same shape selectable, [`AttentionVariant::DECODE_DEEP`] and
//! [`AttentionVariant::DECODE_WIDE_DEEP`] its decode shapes three K/V tiles deep, and
//! [`AttentionVariant::DECODE_HYBRID`] both decode kernels in one launch (each sequence's blocks
//! take the streaming path or the deep tiled one by its context over the splits, read on the
//! device). [`AttentionVariant::DECODE_STREAM_WIDE`] (8 warps) and
//! [`AttentionVariant::DECODE_STREAM_DEEP`] (six steps in flight a warp) are the streaming kernel
//! one block a multiprocessor, for a few sequences at long contexts ([`decode_stream_splits_for`]).
//! On sm_90, a third kernel
//! (`kernels/attention_prefill.cu`, Hopper's warpgroup MMA) serves prefill at head dim 128
//! without splits: [`AttentionVariant::PREFILL_WGMMA`] (every thread copies and computes) and
//! [`AttentionVariant::PREFILL_WGMMA_PINGPONG`] (a copying warpgroup, two computing ones taking
//! turns), chosen explicitly or by [`PREFILL_KERNEL_ENV`] for calls that leave the variant to the
//! default.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::LaunchConfig;
use kiln_core::ops::attention::{validate_sequences, AttentionSequence, AttentionShape};
use kiln_core::{Error, Result};

use crate::compile::Arch;
use crate::kernels::{ATTENTION, ATTENTION_PREFILL};
use crate::memory::{DeviceMemory, DeviceView};
use crate::runtime::{driver_error, Gpu};

/// The kernel of `kernels/attention.cu` a variant runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// `kiln_attention`: block-wide K/V tiles, `STAGES` deep, shared by the block's warps; any
    /// number of query tokens. Its decode variants (`warps_m` = 1: one row tile of 16 rows)
    /// combine the splits as the streaming kernel does (every split's log-sum gathered first, then
    /// the partials 24 in flight a thread), the others in one online pass, 8 in flight.
    Tiled,
    /// `kiln_attention_decode`: one query token per sequence; each warp streams its own steps of
    /// 16 keys through its own three-stage pipeline (no block barrier until the end), Q in
    /// registers, the splits combined by the last block with every partial in flight at once.
    Streaming,
    /// `kiln_attention_prefill` (`kernels/attention_prefill.cu`): two warpgroups of 64 rows on
    /// Hopper's wgmma (sm_90 only), 128 keys a tile, two tiles in flight; prefill and chunked
    /// prefill without splits, head dim 128.
    Warpgroup,
    /// `kiln_attention_prefill_pingpong` (same file, same function): a third warpgroup copies the
    /// K/V tiles, three stages deep, while the two others only compute, taking turns to issue
    /// their products so one's softmax overlaps the other's matrix work.
    WarpgroupPingpong,
}

/// The work split of one thread block: `warps_m` warps of 16 rows each, and `warps_n` warps that
/// share each tile of `warps_n * warp_keys` keys (the streaming kernel: `warps_n` warps that take
/// turns over steps of `warp_keys` = 16 keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionVariant {
    pub warps_m: u32,
    pub warps_n: u32,
    pub warp_keys: u32,
    pub kernel: AttentionKernel,
    /// K/V tiles in flight: the tiled kernel's `STAGES` (2, or 3 for the deep decode variants),
    /// the streaming kernel's steps per warp (3), the wgmma kernels' stages (2, ping-pong 3).
    pub stages: u32,
    /// The hybrid decode kernel ([`AttentionVariant::DECODE_HYBRID`]): the streaming kernel's path
    /// where a split holds at most [`HYBRID_STREAM_CHUNK`] keys, the tiled kernel's (this shape,
    /// these stages) past that. Only with `kernel` = [`AttentionKernel::Tiled`].
    pub hybrid: bool,
}

impl AttentionVariant {
    /// Prefill: 64 rows by 4 warps, 64 keys a tile.
    pub const PREFILL: AttentionVariant = AttentionVariant {
        warps_m: 4,
        warps_n: 1,
        warp_keys: 64,
        kernel: AttentionKernel::Tiled,
        stages: STAGES,
        hybrid: false,
    };
    /// Prefill: 128 rows by 8 warps, 64 keys a tile.
    pub const PREFILL_WIDE: AttentionVariant = AttentionVariant {
        warps_m: 8,
        warps_n: 1,
        warp_keys: 64,
        kernel: AttentionKernel::Tiled,
        stages: STAGES,
        hybrid: false,
    };
    /// Decode (the default): the streaming kernel, 16 rows (the query heads of a group), 4 warps
    /// each streaming its own steps of 16 keys, three in flight.
    pub const DECODE: AttentionVariant = AttentionVariant {
        warps_m: 1,
        warps_n: 4,
        warp_keys: 16,
        kernel: AttentionKernel::Streaming,
        stages: STREAM_STAGES,
        hybrid: false,
    };
    /// Decode on the tiled kernel: 16 rows, 4 warps sharing 64 keys a tile (the decode default
    /// before the streaming kernel). Not in [`AttentionVariant::ALL`]: its name
    /// (`warps_m x warps_n x warp_keys`) is [`AttentionVariant::DECODE`]'s.
    pub const DECODE_TILED: AttentionVariant = AttentionVariant {
        warps_m: 1,
        warps_n: 4,
        warp_keys: 16,
        kernel: AttentionKernel::Tiled,
        stages: STAGES,
        hybrid: false,
    };
    /// Decode on the tiled kernel: 16 rows, 4 warps sharing 128 keys a tile.
    pub const DECODE_WIDE: AttentionVariant = AttentionVariant {
        warps_m: 1,
        warps_n: 4,
        warp_keys: 32,
        kernel: AttentionKernel::Tiled,
        stages: STAGES,
        hybrid: false,
    };
    /// [`AttentionVariant::DECODE_TILED`] three tiles deep: two 64-key tiles in flight while one
    /// is computed (106 KiB of shared memory at head dim 128: two blocks a multiprocessor on
    /// sm_90, up to 192 KiB of K/V in flight there, against 128 KiB two deep). Not in
    /// [`AttentionVariant::ALL`]: its name is [`AttentionVariant::DECODE`]'s (the bench tags it
    /// `deep`).
    pub const DECODE_DEEP: AttentionVariant = AttentionVariant { stages: DEEP_STAGES, ..Self::DECODE_TILED };
    /// [`AttentionVariant::DECODE_WIDE`] three tiles deep: two 128-key tiles in flight while one
    /// is computed (208 KiB of shared memory at head dim 128: one block a multiprocessor, as the
    /// two-deep one). Not in [`AttentionVariant::ALL`] (its name is `DECODE_WIDE`'s; the bench
    /// tags it `wide deep`).
    pub const DECODE_WIDE_DEEP: AttentionVariant =
        AttentionVariant { stages: DEEP_STAGES, ..Self::DECODE_WIDE };
    /// Decode on the hybrid kernel (`kiln_attention_decode_hybrid`, one launch, one grid): each
    /// sequence whose splits hold at most [`HYBRID_STREAM_CHUNK`] keys (its context over the
    /// splits, rounded up) runs [`AttentionVariant::DECODE`]'s streaming path, the others
    /// [`AttentionVariant::DECODE_DEEP`]'s tiled one, with the same splits, so its output is one
    /// of theirs, bit for bit. The choice is made on the device from the context of each step, so
    /// a captured decode step takes the short path at short contexts and the long one as the cache
    /// grows. One query token a sequence, at most 64 splits (the streaming path's combine); shared
    /// memory the larger of the two paths'. Not in [`AttentionVariant::ALL`] (its name is
    /// `DECODE`'s; the bench tags it `hybrid`).
    pub const DECODE_HYBRID: AttentionVariant = AttentionVariant { hybrid: true, ..Self::DECODE_DEEP };
    /// Decode on the tiled kernel with one stage: one K and one V buffer of 64 keys, each
    /// refilled as soon as every warp is done with it, so a tile's V flies while its K is waited
    /// for and S = Q K^T computed, and the next tile's K while the V is waited for and O += P V
    /// made (two tiles in flight a block in 37 KiB of shared memory at head dim 128). Not in
    /// [`AttentionVariant::ALL`] (named `alt-1x4x16.sN`).
    pub const DECODE_ALT: AttentionVariant = AttentionVariant { stages: 1, ..Self::DECODE_TILED };
    /// [`AttentionVariant::DECODE_ALT`] with 128-key tiles (32 KiB K and V tiles, 72 KiB of
    /// shared memory at head dim 128: two blocks a multiprocessor). Not in
    /// [`AttentionVariant::ALL`] (named `alt-1x4x32.sN`).
    pub const DECODE_ALT_WIDE: AttentionVariant = AttentionVariant { stages: 1, ..Self::DECODE_WIDE };
    /// Decode on the streaming kernel, 8 warps a block (each its own pipeline of 16-key steps,
    /// three in flight): 192 KiB of shared memory at head dim 128, one block a multiprocessor, so
    /// a batch of a few sequences (GQA 32/8: batch 8 at 2 splits, 128 blocks on sm_90's 132
    /// multiprocessors) streams with 8 warps on each multiprocessor it covers, where
    /// [`AttentionVariant::DECODE`] runs 4 there. Splits: [`decode_stream_splits_for`]. Not in
    /// [`AttentionVariant::ALL`] (the certifier and the bench name it `stream3-1x8x16.sN`).
    pub const DECODE_STREAM_WIDE: AttentionVariant = AttentionVariant { warps_n: 8, ..Self::DECODE };
    /// Decode on the streaming kernel, 4 warps a block each with six 16-key steps in flight
    /// (192 KiB of shared memory at head dim 128, one block a multiprocessor): twice
    /// [`AttentionVariant::DECODE`]'s K/V in flight a warp. Splits: [`decode_stream_splits_for`].
    /// Not in [`AttentionVariant::ALL`] (named `stream6-1x4x16.sN`).
    pub const DECODE_STREAM_DEEP: AttentionVariant =
        AttentionVariant { stages: STREAM_DEEP_STAGES, ..Self::DECODE };

    /// Prefill on Hopper's warpgroup MMA: 128 rows by two warpgroups (eight warps), 128 keys a
    /// tile. sm_90 only, head dim 128, one split. Not in [`AttentionVariant::ALL`] (it serves
    /// fewer shapes and devices).
    pub const PREFILL_WGMMA: AttentionVariant = AttentionVariant {
        warps_m: 8,
        warps_n: 1,
        warp_keys: 128,
        kernel: AttentionKernel::Warpgroup,
        stages: STAGES,
        hybrid: false,
    };
    /// [`AttentionVariant::PREFILL_WGMMA`]'s work on the ping-pong kernel (a third warpgroup
    /// copies).
    pub const PREFILL_WGMMA_PINGPONG: AttentionVariant = AttentionVariant {
        kernel: AttentionKernel::WarpgroupPingpong,
        stages: PINGPONG_STAGES,
        ..Self::PREFILL_WGMMA
    };

    /// Every named variant (distinct names); the tests run each, and
    /// [`AttentionVariant::DECODE_TILED`] beside them.
    pub const ALL: [AttentionVariant; 4] =
        [Self::PREFILL, Self::PREFILL_WIDE, Self::DECODE, Self::DECODE_WIDE];

    fn threads(&self) -> u32 {
        let copying_warps = match self.kernel {
            AttentionKernel::WarpgroupPingpong => 4,
            _ => 0,
        };
        32 * (self.warps_m * self.warps_n + copying_warps)
    }

    /// Whether the variant runs a kernel of `kernels/attention_prefill.cu` (wgmma, sm_90).
    pub fn is_wgmma(&self) -> bool {
        matches!(self.kernel, AttentionKernel::Warpgroup | AttentionKernel::WarpgroupPingpong)
    }

    fn rows(&self) -> u32 {
        16 * self.warps_m
    }

    fn keys(&self) -> u32 {
        self.warps_n * self.warp_keys
    }

    /// K/V tiles in flight (the kernel's `STAGES`; the streaming kernel's `STREAM_STAGES` per warp).
    pub fn stages(&self) -> u32 {
        self.stages
    }

    /// Dynamic shared memory. Tiled: Q rows, then [`AttentionVariant::stages`] stages of K and V
    /// tiles, rows padded by 16 bytes. Streaming: per warp, [`AttentionVariant::stages`] steps of
    /// K and V rows (unpadded, swizzled).
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        if self.hybrid {
            let tiled = AttentionVariant { hybrid: false, ..*self }.shared_bytes(head_dim);
            return tiled.max(AttentionVariant::DECODE.shared_bytes(head_dim));
        }
        match self.kernel {
            AttentionKernel::Tiled => {
                let row = (head_dim + 8) * 2;
                (self.rows() as usize + 2 * self.stages() as usize * self.keys() as usize) * row
            }
            AttentionKernel::Streaming => {
                self.warps_n as usize * self.stages() as usize * 2 * self.warp_keys as usize * head_dim * 2
            }
            // 1 KiB to align the swizzled arrays to their 1024-byte pattern, then Q rows and the
            // stages of K and V tiles, unpadded.
            AttentionKernel::Warpgroup | AttentionKernel::WarpgroupPingpong => {
                1024 + (self.rows() as usize + 2 * self.stages() as usize * self.keys() as usize)
                    * head_dim
                    * 2
            }
        }
    }

    /// The default for a call whose sequences have at most `max_query_tokens` queries.
    /// [`PREFILL_KERNEL_ENV`] may make prefill's default a wgmma variant.
    pub fn default_for(max_query_tokens: usize) -> AttentionVariant {
        if max_query_tokens <= 1 {
            AttentionVariant::DECODE
        } else {
            prefill_requested().unwrap_or(AttentionVariant::PREFILL)
        }
    }

    fn validate(&self, head_dim: usize) -> Result<()> {
        let served = match self.kernel {
            AttentionKernel::Tiled if self.hybrid => *self == AttentionVariant::DECODE_HYBRID,
            AttentionKernel::Tiled => {
                (self.stages == STAGES
                    || ((self.stages == DEEP_STAGES || self.stages == 1) && self.warps_m == 1))
                    && self.warps_m * self.warps_n <= 8
                    && self.warp_keys.is_multiple_of(16)
                    && self.warp_keys > 0
                    && (self.keys() as usize * head_dim / 8).is_multiple_of(self.threads() as usize)
                    && (self.rows() as usize * head_dim / 8).is_multiple_of(self.threads() as usize)
            }
            AttentionKernel::Streaming => {
                // The block shapes the kernel's registers (two blocks a multiprocessor for
                // DECODE, one for the wide and deep ones) and the compile check are made for.
                [
                    AttentionVariant::DECODE,
                    AttentionVariant::DECODE_STREAM_WIDE,
                    AttentionVariant::DECODE_STREAM_DEEP,
                ]
                .contains(self)
                    && head_dim.is_multiple_of(64)
            }
            AttentionKernel::Warpgroup => *self == AttentionVariant::PREFILL_WGMMA && head_dim == 128,
            AttentionKernel::WarpgroupPingpong => {
                *self == AttentionVariant::PREFILL_WGMMA_PINGPONG && head_dim == 128
            }
        };
        if !served {
            return Err(Error::NotServed { op: "attention kernel", reason: format!("variant {self:?}") });
        }
        Ok(())
    }
}

/// The environment variable that selects prefill's default kernel: `wgmma` for
/// [`AttentionVariant::PREFILL_WGMMA`], `wgmma-pingpong` for
/// [`AttentionVariant::PREFILL_WGMMA_PINGPONG`] (sm_90 only); unset or `tiled` for
/// [`AttentionVariant::PREFILL`] (another value is reported and counts as unset). Read once per
/// process.
pub const PREFILL_KERNEL_ENV: &str = "KILN_PREFILL_ATTENTION";

/// For measurement: `none` compiles the streaming decode kernel to read K and V under the default
/// L2 policy instead of evict-first (`kiln bench attention` times both at batch 1).
pub const DECODE_L2_HINT_ENV: &str = "KILN_DECODE_L2_HINT";

fn prefill_requested() -> Option<AttentionVariant> {
    static REQUESTED: std::sync::OnceLock<Option<AttentionVariant>> = std::sync::OnceLock::new();
    *REQUESTED.get_or_init(|| match std::env::var(PREFILL_KERNEL_ENV).as_deref().map(str::trim) {
        Ok("wgmma") => Some(AttentionVariant::PREFILL_WGMMA),
        Ok("wgmma-pingpong") => Some(AttentionVariant::PREFILL_WGMMA_PINGPONG),
        Ok("tiled") | Ok("") | Err(_) => None,
        Ok(other) => {
            tracing::warn!(
                "{PREFILL_KERNEL_ENV}={other:?} is not wgmma, wgmma-pingpong or tiled: tiled prefill"
            );
            None
        }
    })
}

/// K/V stages of the tiled variants but the deep ones (the kernel's default `STAGES`).
const STAGES: u32 = 2;

/// Most keys a split of [`AttentionVariant::DECODE_HYBRID`] holds on its streaming path (the
/// kernel's `HYBRID_STREAM_CHUNK`): `ceil(context / splits) <= HYBRID_STREAM_CHUNK`. Where the
/// two kernels were measured on an H200 (GQA 32/8, head dim 128), the streaming one was ahead up
/// to about 500 keys a split (batch 1 at 16k over 33 splits, batch 8 at 1k over 4) and the tiled
/// one past about 1000 (batch 1 at 32k, batch 8 at 16k, batch 64 at 4k).
pub const HYBRID_STREAM_CHUNK: usize = 512;

/// K/V stages of the deep tiled decode variants ([`AttentionVariant::DECODE_DEEP`],
/// [`AttentionVariant::DECODE_WIDE_DEEP`]).
const DEEP_STAGES: u32 = 3;

/// K/V stages of the ping-pong wgmma kernel (its `PINGPONG_STAGES`).
const PINGPONG_STAGES: u32 = 3;

/// Steps in flight per warp of the streaming kernel (its `STREAM_STAGES`).
const STREAM_STAGES: u32 = 3;

/// Steps in flight per warp of [`AttentionVariant::DECODE_STREAM_DEEP`] (the kernel's
/// `STREAM_STAGES` define).
const STREAM_DEEP_STAGES: u32 = 6;

/// Most splits the streaming kernel combines (its `MAX_COMBINE_SPLITS`: the log-sums it gathers
/// in shared memory); [`decode_splits`] gives at most 64.
const MAX_STREAMING_SPLITS: u32 = 64;

/// Ticket counters of the combine (`KILN_ATTENTION_TICKETS` in the kernel): one per
/// (sequence, row tile, kv head) of a split launch. [`decode_splits`] gives 1 split long before
/// a batch has this many groups.
const TICKETS: usize = 65_536;

/// Decode blocks of the default variant resident on one multiprocessor: its 96 KiB of shared
/// memory at head dim 128 (and 194 registers a thread) fit twice on sm_90.
const DECODE_BLOCKS_PER_MULTIPROCESSOR: usize = 2;

/// Head sizes the kernel is compiled for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// The sequences of one attention call on the device (see the module docs).
#[derive(Debug)]
pub struct PagedBatch {
    /// `i32 [batch + 1]`: sequence `b`'s query tokens are `[offsets[b], offsets[b + 1])`.
    pub query_offsets: DeviceView,
    /// `i32 [batch]`: positions each sequence holds (cached plus its queries).
    pub context_lens: DeviceView,
    /// `i32 [batch + 1]`: sequence `b`'s pages are `page_ids[offsets[b]..offsets[b + 1]]`.
    pub page_offsets: DeviceView,
    /// `u32`: the page tables, one after another.
    pub page_ids: DeviceView,
    pub batch: usize,
    pub total_queries: usize,
    pub max_query_tokens: usize,
    /// The memory behind the views when [`PagedBatch::upload`] made them.
    _owned: Vec<DeviceMemory>,
}

impl PagedBatch {
    /// Checks `sequences` against `shape` and a cache of `cache_pages` pages, and uploads them.
    pub fn upload(
        gpu: &Gpu,
        shape: &AttentionShape,
        sequences: &[AttentionSequence<'_>],
        cache_pages: usize,
    ) -> Result<PagedBatch> {
        let page_elements = shape.kv_heads * shape.page_tokens * shape.head_dim;
        let total_queries = validate_sequences(shape, sequences, cache_pages * page_elements)?;
        let too_big = |what: &'static str, value: usize| Error::NotServed {
            op: "attention kernel",
            reason: format!("{what} {value} does not fit in 31 bits"),
        };
        let i32_of = |what, value: usize| i32::try_from(value).map_err(|_| too_big(what, value));
        let (mut query_offsets, mut page_offsets) = (vec![0i32], vec![0i32]);
        let (mut context_lens, mut page_ids) = (Vec::new(), Vec::new());
        let mut max_query_tokens = 0;
        for s in sequences {
            let pages = s.context_tokens.div_ceil(shape.page_tokens);
            page_ids.extend_from_slice(&s.pages[..pages]);
            query_offsets
                .push(i32_of("query offset", *query_offsets.last().unwrap_or(&0) as usize + s.query_tokens)?);
            page_offsets.push(i32_of("page offset", page_ids.len())?);
            context_lens.push(i32_of("context", s.context_tokens)?);
            max_query_tokens = max_query_tokens.max(s.query_tokens);
        }
        i32_of("query rows", total_queries * shape.q_heads)?;
        let bytes = |words: &[i32]| words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        let page_bytes: Vec<u8> = page_ids.iter().flat_map(|w| w.to_le_bytes()).collect();
        let device = |host: &[u8]| -> Result<DeviceMemory> {
            let memory = gpu.alloc(host.len().max(4))?;
            memory.copy_from_host(0, host)?;
            Ok(memory)
        };
        let owned = vec![
            device(&bytes(&query_offsets))?,
            device(&bytes(&context_lens))?,
            device(&bytes(&page_offsets))?,
            device(&page_bytes)?,
        ];
        Ok(PagedBatch {
            query_offsets: owned[0].view(),
            context_lens: owned[1].view(),
            page_offsets: owned[2].view(),
            page_ids: owned[3].view(),
            batch: sequences.len(),
            total_queries,
            max_query_tokens,
            _owned: owned,
        })
    }

    /// A batch over metadata the caller keeps on the device (a decode step whose positions and
    /// pages are rewritten in place between replays of a captured graph).
    ///
    /// The views must hold the layouts of the fields' docs for `batch` sequences, every offset and
    /// page id in bounds for the caches the call passes, and `max_query_tokens` must bound every
    /// sequence's queries: the kernel reads them as they are on the device at launch time and
    /// does not check them ([`PagedBatch::upload`] is the checked way).
    pub fn from_views(
        query_offsets: DeviceView,
        context_lens: DeviceView,
        page_offsets: DeviceView,
        page_ids: DeviceView,
        batch: usize,
        total_queries: usize,
        max_query_tokens: usize,
    ) -> Result<PagedBatch> {
        check_len("attention query_offsets", query_offsets.len_bytes, (batch + 1) * 4)?;
        check_len("attention context_lens", context_lens.len_bytes, batch * 4)?;
        check_len("attention page_offsets", page_offsets.len_bytes, (batch + 1) * 4)?;
        Ok(PagedBatch {
            query_offsets,
            context_lens,
            page_offsets,
            page_ids,
            batch,
            total_queries,
            max_query_tokens,
            _owned: Vec::new(),
        })
    }
}

/// One layer's K and V page buffers, `pages` pages each: bf16 rows, or with `scales` FP8 E4M3
/// rows (`kiln_core::ops::attention::kv_fp8_row`: one byte a value) and their scales.
#[derive(Debug, Clone, Copy)]
pub struct KvBuffers<'a> {
    pub k: &'a DeviceMemory,
    pub v: &'a DeviceMemory,
    pub pages: usize,
    pub scales: Option<KvScales<'a>>,
}

/// The fp32 scales of FP8 K and V rows, `[page][kv_head][slot]` each.
#[derive(Debug, Clone, Copy)]
pub struct KvScales<'a> {
    pub k: &'a DeviceMemory,
    pub v: &'a DeviceMemory,
}

impl KvBuffers<'_> {
    /// Bytes of one value in the pages: 2 (bf16) or 1 (FP8).
    pub fn value_bytes(&self) -> usize {
        if self.scales.is_some() {
            1
        } else {
            2
        }
    }

    /// Checks the buffers hold `pages` pages of `shape` (and their scales); `names` name the K and
    /// V buffers in the error.
    fn check(&self, names: [&'static str; 2], shape: &AttentionShape) -> Result<()> {
        let rows = self.pages * shape.kv_heads * shape.page_tokens;
        let bytes = rows * shape.head_dim * self.value_bytes();
        check_len(names[0], self.k.len_bytes(), bytes)?;
        check_len(names[1], self.v.len_bytes(), bytes)?;
        if let Some(scales) = self.scales {
            check_len("kv k_scales", scales.k.len_bytes(), rows * 4)?;
            check_len("kv v_scales", scales.v.len_bytes(), rows * 4)?;
        }
        Ok(())
    }
}

/// Whether `variant` reads FP8 K/V rows: the tiled kernel (not the hybrid one), two stages or more.
pub fn serves_fp8_kv(variant: AttentionVariant) -> bool {
    variant.kernel == AttentionKernel::Tiled && !variant.hybrid && variant.stages() >= 2
}

/// Tiles of FP8 codes in the tiled kernel's pipeline (`FP8_STAGES` in `kernels/attention.cu`).
pub const FP8_STAGES: usize = 4;

/// Shared memory of `variant` at `head_dim` over FP8 pages: Q's rows, one bf16 stage of K and V
/// (the tile being computed, widened from its codes), and [`FP8_STAGES`] stages of codes and
/// scales.
pub fn fp8_shared_bytes(variant: AttentionVariant, head_dim: usize) -> usize {
    let row = (head_dim + 8) * 2;
    let keys = variant.keys() as usize;
    (variant.rows() as usize + 2 * keys) * row + FP8_STAGES * keys * (2 * head_dim + 8)
}

/// Splits of the context for a call over `batch` sequences, from the batch and the heads alone
/// (never the context length), at most 64: the most that fit the device's resident slots (two
/// decode blocks per multiprocessor) in one wave when that fills it to 95%, else the fewest whose
/// waves are filled to 95%, else the best filling. A partial last wave costs long contexts
/// bandwidth: 320 blocks on 264 slots run as two waves filled to 61%, 256 blocks as one filled
/// to 97%.
pub fn decode_splits(gpu: &Gpu, batch: usize, kv_heads: usize) -> u32 {
    decode_splits_for(gpu.facts().multiprocessors, batch, kv_heads)
}

/// [`decode_splits`] on a device of `multiprocessors` (no device needed).
pub fn decode_splits_for(multiprocessors: u32, batch: usize, kv_heads: usize) -> u32 {
    decode_splits_resident(multiprocessors, DECODE_BLOCKS_PER_MULTIPROCESSOR, batch, kv_heads)
}

/// [`decode_splits_for`] for a variant of which `blocks_per_multiprocessor` blocks are resident
/// on one multiprocessor (1 for [`AttentionVariant::DECODE_WIDE`], whose 140 KiB of shared memory
/// at head dim 128 fit once on sm_90).
pub fn decode_splits_resident(
    multiprocessors: u32,
    blocks_per_multiprocessor: usize,
    batch: usize,
    kv_heads: usize,
) -> u32 {
    let groups = (batch * kv_heads).max(1);
    let slots = (multiprocessors as usize * blocks_per_multiprocessor).max(1);
    // How full the waves of `splits` splits are, in thousandths.
    let filling = |splits: usize| {
        let blocks = groups * splits;
        blocks * 1000 / (blocks.div_ceil(slots) * slots)
    };
    let one_wave = (slots / groups).clamp(1, 64);
    if filling(one_wave) >= 950 {
        return one_wave as u32;
    }
    let mut best = 1;
    for splits in 1..=64 {
        if filling(splits) >= 950 {
            return splits as u32;
        }
        if filling(splits) > filling(best) {
            best = splits;
        }
    }
    best as u32
}

/// Splits for [`AttentionVariant::DECODE_STREAM_WIDE`] and [`AttentionVariant::DECODE_STREAM_DEEP`]
/// on a device of `multiprocessors`: one block of theirs is resident a multiprocessor, so the
/// splits fill one wave of `multiprocessors` blocks (batch 8 x 8 kv heads on 132: 2 splits, 128
/// blocks; batch 1: 16 splits), from the batch and the heads alone, as [`decode_splits`].
pub fn decode_stream_splits_for(multiprocessors: u32, batch: usize, kv_heads: usize) -> u32 {
    decode_splits_resident(multiprocessors, 1, batch, kv_heads)
}

/// Bytes of scratch a call with `splits > 1` needs: f32 partial outputs and log-sums per split.
pub fn scratch_bytes(shape: &AttentionShape, total_queries: usize, splits: u32) -> usize {
    if splits <= 1 {
        return 0;
    }
    splits as usize * total_queries * shape.q_heads * (shape.head_dim + 1) * 4
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got < expected {
        return Err(Error::ByteLength { what: what.to_owned(), expected: expected as u64, got: got as u64 });
    }
    Ok(())
}

fn check_shape(shape: &AttentionShape) -> Result<u32> {
    shape.validate()?;
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!("head_dim {}", shape.head_dim),
        });
    }
    Ok(shape.page_tokens.trailing_zeros())
}

/// The defines of a variant, in the order of `kernels::ATTENTION`'s define sets (`STREAMING`
/// only for the streaming kernel, so the tiled kernel's modules keep their names).
fn defines(head_dim: usize, variant: AttentionVariant, fp8: bool) -> Vec<(&'static str, String)> {
    let mut defines = plain_defines(head_dim, variant);
    if fp8 {
        defines.push(("KV_FP8", "1".to_owned()));
    }
    defines
}

fn plain_defines(head_dim: usize, variant: AttentionVariant) -> Vec<(&'static str, String)> {
    if variant.is_wgmma() {
        return vec![("HEAD_DIM", head_dim.to_string())];
    }
    let mut defines = vec![
        ("HEAD_DIM", head_dim.to_string()),
        ("WARPS_M", variant.warps_m.to_string()),
        ("WARPS_N", variant.warps_n.to_string()),
        ("WARP_KEYS", variant.warp_keys.to_string()),
    ];
    if variant.kernel == AttentionKernel::Tiled && variant.stages != STAGES {
        defines.push(("STAGES", variant.stages.to_string()));
    }
    if variant.hybrid {
        defines.push(("HYBRID", "1".to_owned()));
    }
    if variant.kernel == AttentionKernel::Streaming {
        defines.push(("STREAMING", "1".to_owned()));
        if variant.stages != STREAM_STAGES {
            defines.push(("STREAM_STAGES", variant.stages.to_string()));
        }
        if std::env::var(DECODE_L2_HINT_ENV).is_ok_and(|v| v.trim() == "none") {
            defines.push(("STREAM_L2_EVICT_FIRST", "0".to_owned()));
        }
    }
    defines
}

fn function(
    gpu: &Gpu,
    head_dim: usize,
    variant: AttentionVariant,
    fp8: bool,
    entry: &str,
) -> Result<cudarc::driver::CudaFunction> {
    let defines = defines(head_dim, variant, fp8);
    let refs: Vec<(&str, &str)> = defines.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let source = if variant.is_wgmma() { &ATTENTION_PREFILL } else { &ATTENTION };
    gpu.function(source, entry, &refs)
}

/// Raises `kernel`'s dynamic shared memory to what `variant` takes at `head_dim` (a named error
/// when the device gives less); `call` names the driver call in its error. Returns the bytes.
fn raise_shared_memory(
    gpu: &Gpu,
    kernel: &cudarc::driver::CudaFunction,
    head_dim: usize,
    variant: AttentionVariant,
    fp8: bool,
    call: &'static str,
) -> Result<usize> {
    let shared = if fp8 { fp8_shared_bytes(variant, head_dim) } else { variant.shared_bytes(head_dim) };
    let optin = gpu.facts().shared_memory_per_block_optin_bytes as usize;
    if shared > optin {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!("{variant:?} needs {shared} bytes of shared memory, the device gives {optin}"),
        });
    }
    kernel
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(|e| driver_error(call, e))?;
    Ok(shared)
}

fn as_i32(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::NotServed {
        op: "attention kernel",
        reason: format!("{what} {value} does not fit in 31 bits"),
    })
}

/// Causal GQA attention of `batch` over the cache into `out` (bf16). With `splits > 1` the
/// context is split in that many parts whose partials go to `scratch` ([`scratch_bytes`]) and
/// are combined in split order in the same launch.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    shape: &AttentionShape,
    batch: &PagedBatch,
    q: &DeviceMemory,
    cache: KvBuffers<'_>,
    out: &DeviceMemory,
    scratch: Option<&DeviceMemory>,
    splits: u32,
    variant: Option<AttentionVariant>,
) -> Result<()> {
    let page_shift = check_shape(shape)?;
    let variant = variant.unwrap_or_else(|| AttentionVariant::default_for(batch.max_query_tokens));
    variant.validate(shape.head_dim)?;
    if !(1..=1024).contains(&splits) {
        return Err(Error::InvalidArgument {
            name: "splits",
            value: splits.to_string(),
            reason: "between 1 and 1024".into(),
        });
    }
    if variant.kernel == AttentionKernel::Streaming || variant.hybrid {
        if batch.max_query_tokens > 1 {
            return Err(Error::NotServed {
                op: "attention kernel",
                reason: format!(
                    "{variant:?} takes one query token a sequence, the batch has up to {}",
                    batch.max_query_tokens
                ),
            });
        }
        if splits > MAX_STREAMING_SPLITS {
            return Err(Error::NotServed {
                op: "attention kernel",
                reason: format!("{variant:?} combines at most {MAX_STREAMING_SPLITS} splits, not {splits}"),
            });
        }
    }
    let fp8 = cache.scales.is_some();
    if fp8 && !serves_fp8_kv(variant) {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!(
                "{variant:?} reads bf16 K/V pages only; FP8 pages take the tiled kernel's variants"
            ),
        });
    }
    let q_bytes = batch.total_queries * shape.q_heads * shape.head_dim * 2;
    check_len("attention q", q.len_bytes(), q_bytes)?;
    check_len("attention out", out.len_bytes(), q_bytes)?;
    cache.check(["attention k_cache", "attention v_cache"], shape)?;
    let scratch_needed = scratch_bytes(shape, batch.total_queries, splits);
    let (partial_out, partial_lse) = match scratch {
        Some(s) if splits > 1 => {
            check_len("attention scratch", s.len_bytes(), scratch_needed)?;
            let lse_offset = (scratch_needed / (shape.head_dim + 1) * shape.head_dim) as u64;
            (s.device_ptr(), s.device_ptr() + lse_offset)
        }
        None if splits > 1 => {
            return Err(Error::InvalidArgument {
                name: "scratch",
                value: "missing".into(),
                reason: format!("{splits} splits need {scratch_needed} bytes of scratch"),
            })
        }
        _ => (0, 0),
    };
    if variant.is_wgmma() {
        if splits != 1 {
            return Err(Error::NotServed {
                op: "attention kernel",
                reason: format!("{variant:?} does not split the context ({splits} splits asked)"),
            });
        }
        if gpu.arch() != Arch(90) {
            return Err(Error::NotServed {
                op: "attention kernel",
                reason: format!("{variant:?} needs sm_90 (wgmma), the device is {}", gpu.arch()),
            });
        }
    }
    if batch.batch == 0 || batch.total_queries == 0 {
        return Ok(());
    }
    if variant.is_wgmma() {
        return prefill_wgmma(gpu, shape, batch, q, cache, out, variant, page_shift);
    }
    let entry = match variant.kernel {
        AttentionKernel::Tiled if variant.hybrid => "kiln_attention_decode_hybrid",
        AttentionKernel::Tiled => "kiln_attention",
        AttentionKernel::Streaming => "kiln_attention_decode",
        AttentionKernel::Warpgroup => "kiln_attention_prefill",
        AttentionKernel::WarpgroupPingpong => "kiln_attention_prefill_pingpong",
    };
    let kernel = function(gpu, shape.head_dim, variant, fp8, entry)?;
    let shared =
        raise_shared_memory(gpu, &kernel, shape.head_dim, variant, fp8, "cuFuncSetAttribute(attention)")?;
    let group = shape.group();
    let row_tiles = (batch.max_query_tokens * group).div_ceil(variant.rows() as usize);
    let grid_y = shape.kv_heads * splits as usize;
    if row_tiles > i32::MAX as usize || grid_y > 65_535 || batch.batch > 65_535 {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!("grid of {row_tiles} x {grid_y} x {} blocks", batch.batch),
        });
    }
    let config = LaunchConfig {
        grid_dim: (row_tiles as u32, grid_y as u32, batch.batch as u32),
        block_dim: (variant.threads(), 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (q_heads, kv_heads) = (as_i32("q_heads", shape.q_heads)?, as_i32("kv_heads", shape.kv_heads)?);
    let page_shift = page_shift as i32;
    let scale_log2 = shape.scale * std::f32::consts::LOG2_E;
    let splits_arg = splits as i32;
    let groups = batch.batch * row_tiles * shape.kv_heads;
    if splits > 1 && groups > TICKETS {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!(
                "{splits} splits of {groups} (sequence, row tile, kv head) groups, over {TICKETS}"
            ),
        });
    }
    let pointers = [
        q.device_ptr(),
        cache.k.device_ptr(),
        cache.v.device_ptr(),
        batch.query_offsets.ptr,
        batch.context_lens.ptr,
        batch.page_offsets.ptr,
        batch.page_ids.ptr,
        out.device_ptr(),
        partial_out,
        partial_lse,
    ];
    let mut launch = gpu.launch_builder(&kernel);
    for pointer in &pointers {
        launch.arg(pointer);
    }
    let (k_scales, v_scales) = cache.scales.map_or((0, 0), |s| (s.k.device_ptr(), s.v.device_ptr()));
    launch.arg(&q_heads).arg(&kv_heads).arg(&page_shift).arg(&scale_log2).arg(&splits_arg);
    launch.arg(&k_scales).arg(&v_scales);
    if cluster_combines(gpu, variant, row_tiles, row_tiles * grid_y * batch.batch, splits) {
        launch.cluster((1, splits, 1));
    }
    // SAFETY: the arguments match the signature of `kiln_attention`, `kiln_attention_decode` and
    // `kiln_attention_decode_hybrid` (10 pointers, 3 i32, f32, i32, 2 pointers: the FP8 scales,
    // null and unread for bf16 pages; with FP8 pages the module is compiled with KV_FP8 and the
    // pages and scales were checked to hold `cache.pages` pages); the streaming and hybrid
    // kernels are given one query token a sequence and at most MAX_STREAMING_SPLITS splits
    // (checked above), and the hybrid kernel the larger shared memory of its two paths.
    // With splits > 1, the grid's (sequence, row tile, kv head) groups index the kernel's
    // `TICKETS` counters in bounds (checked above); launches of this module run in this stream's
    // order, so no two share a counter at once. A cluster launch (`cluster_combines`) has one row
    // tile and grid y = kv_heads * splits, so each cluster of (1, splits, 1) blocks is exactly the
    // splits of one (sequence, kv head): the blocks whose partials its split 0 reads; every block
    // of a cluster reaches its barriers (a sequence without query rows leaves them all early).
    // `batch` was validated against the shape and the cache's page count when uploaded, so every
    // page id and offset the kernel reads is in bounds; q, out, the caches and (for splits > 1)
    // the scratch were checked above to hold what the kernel touches; the dynamic shared memory
    // was raised to what the launch asks for. All buffers come from this device's pool, which
    // reuses memory only in this stream's order, so they outlive the kernel.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(attention)", e))?;

    Ok(())
}

/// Most splits the tiled kernel's decode combines through a thread block cluster (the portable
/// cluster size).
pub const MAX_CLUSTER_SPLITS: u32 = 8;

/// Whether a tiled split call launches as clusters of its splits, one cluster per (sequence, kv
/// head), so that the splits combine through distributed shared memory (`kernels/attention.cu`,
/// the cluster combine): the tiled kernel's decode variants (one row tile), 2 to
/// [`MAX_CLUSTER_SPLITS`] splits, a grid of at most one block a multiprocessor, on sm_90 and
/// later while [`Gpu::cluster_combine`] is on. Its arithmetic and order are the ticket combine's,
/// so the output is the same bits either way.
///
/// On the H200 (`bench/results/2026-11-30-h200-final/f6`) the clusters took 2-7 us off every
/// launch of one block a multiprocessor or fewer (batch 8 at 4096 positions, `1x4x32.s2`: 38.8
/// against 41.2 us; batch 1 at 1024, `1x4x32.s8`: 10.3 against 12.4) and made the grids of more
/// blocks than multiprocessors slower (batch 8, 4 splits: 60.9 against 49.6 us), where a cluster's
/// blocks wait for room on one GPC together.
pub fn cluster_combines(
    gpu: &Gpu,
    variant: AttentionVariant,
    row_tiles: usize,
    blocks: usize,
    splits: u32,
) -> bool {
    variant.kernel == AttentionKernel::Tiled
        && !variant.hybrid
        && variant.warps_m == 1
        && row_tiles == 1
        && (2..=MAX_CLUSTER_SPLITS).contains(&splits)
        && blocks <= gpu.facts().multiprocessors as usize
        && gpu.arch().0 >= 90
        && gpu.cluster_combine()
}

/// The launch of `kiln_attention_prefill` or `kiln_attention_prefill_pingpong` (checked by
/// [`attention`]: one split, sm_90, the buffers' lengths).
#[allow(clippy::too_many_arguments)]
fn prefill_wgmma(
    gpu: &Gpu,
    shape: &AttentionShape,
    batch: &PagedBatch,
    q: &DeviceMemory,
    cache: KvBuffers<'_>,
    out: &DeviceMemory,
    variant: AttentionVariant,
    page_shift: u32,
) -> Result<()> {
    let entry = if variant.kernel == AttentionKernel::WarpgroupPingpong {
        "kiln_attention_prefill_pingpong"
    } else {
        "kiln_attention_prefill"
    };
    let kernel = function(gpu, shape.head_dim, variant, false, entry)?;
    let shared = raise_shared_memory(
        gpu,
        &kernel,
        shape.head_dim,
        variant,
        false,
        "cuFuncSetAttribute(attention_prefill)",
    )?;
    let row_tiles = (batch.max_query_tokens * shape.group()).div_ceil(variant.rows() as usize);
    if row_tiles > i32::MAX as usize || shape.kv_heads > 65_535 || batch.batch > 65_535 {
        return Err(Error::NotServed {
            op: "attention kernel",
            reason: format!("grid of {row_tiles} x {} x {} blocks", shape.kv_heads, batch.batch),
        });
    }
    let config = LaunchConfig {
        grid_dim: (row_tiles as u32, shape.kv_heads as u32, batch.batch as u32),
        block_dim: (variant.threads(), 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (q_heads, kv_heads) = (as_i32("q_heads", shape.q_heads)?, as_i32("kv_heads", shape.kv_heads)?);
    let page_shift = page_shift as i32;
    let scale_log2 = shape.scale * std::f32::consts::LOG2_E;
    let pointers = [
        q.device_ptr(),
        cache.k.device_ptr(),
        cache.v.device_ptr(),
        batch.query_offsets.ptr,
        batch.context_lens.ptr,
        batch.page_offsets.ptr,
        batch.page_ids.ptr,
        out.device_ptr(),
    ];
    let mut launch = gpu.launch_builder(&kernel);
    for pointer in &pointers {
        launch.arg(pointer);
    }
    launch.arg(&q_heads).arg(&kv_heads).arg(&page_shift).arg(&scale_log2);
    // SAFETY: the arguments match the signature of both entries (8 pointers, 3 i32, f32), and
    // the block has the entry's threads (`threads`: 256, or 384 with the copying warpgroup). `batch` was validated against the shape and the cache's page count when uploaded, so
    // every page id and offset the kernel reads is in bounds; [`attention`] checked q, out and
    // the caches to hold what the kernel touches; the dynamic shared memory was raised to what
    // the launch asks for. All buffers come from this device's pool, which reuses memory only in
    // this stream's order, so they outlive the kernel.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(attention_prefill)", e))?;
    Ok(())
}

/// Writes `tokens` new tokens' K and V (`[token][kv_head][head_dim]` bf16) into the cache at
/// `slots` (`u32 [tokens]`, `page * page_tokens + slot`, as `kiln_engine::kv::AppendPlan` gives
/// them). Slots must be below `cache.pages * page_tokens`; the kernel does not check them.
pub fn kv_append(
    gpu: &Gpu,
    shape: &AttentionShape,
    k_new: &DeviceMemory,
    v_new: &DeviceMemory,
    slots: &[u32],
    cache: KvBuffers<'_>,
) -> Result<()> {
    let page_shift = check_shape(shape)?;
    let tokens = slots.len();
    let limit = cache.pages * shape.page_tokens;
    if let Some(&slot) = slots.iter().find(|&&s| s as usize >= limit) {
        return Err(Error::OutOfBounds {
            op: "kv_append",
            what: "slot",
            value: u64::from(slot),
            limit: limit as u64,
        });
    }
    let new_bytes = tokens * shape.kv_heads * shape.head_dim * 2;
    check_len("kv_append k_new", k_new.len_bytes(), new_bytes)?;
    check_len("kv_append v_new", v_new.len_bytes(), new_bytes)?;
    cache.check(["kv_append k_cache", "kv_append v_cache"], shape)?;
    if tokens == 0 {
        return Ok(());
    }
    let slot_bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
    let device_slots = gpu.alloc(slot_bytes.len())?;
    device_slots.copy_from_host(0, &slot_bytes)?;
    if cache.scales.is_some() {
        return kv_append_fp8(gpu, shape, k_new.view(), v_new.view(), device_slots.view(), tokens, cache);
    }
    let kernel = function(gpu, shape.head_dim, AttentionVariant::PREFILL, false, "kiln_kv_append")?;
    let chunks = (new_bytes / 16) as u64;
    let blocks = chunks.div_ceil(256).min(65_536) as u32;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (tokens_arg, kv_heads, page_shift) =
        (tokens as u64, as_i32("kv_heads", shape.kv_heads)?, page_shift as i32);
    let pointers = [
        k_new.device_ptr(),
        v_new.device_ptr(),
        device_slots.device_ptr(),
        cache.k.device_ptr(),
        cache.v.device_ptr(),
    ];
    let mut launch = gpu.launch_builder(&kernel);
    for pointer in &pointers {
        launch.arg(pointer);
    }
    launch.arg(&tokens_arg).arg(&kv_heads).arg(&page_shift);
    // SAFETY: matches `kiln_kv_append` (5 pointers, u64, 2 i32); k_new and v_new hold `tokens`
    // rows, every slot was checked to lie inside the caches, which hold `cache.pages` pages; the
    // slot buffer is kept alive by the pool's stream-ordered reuse until the kernel has run.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_kv_append)", e))?;
    Ok(())
}

/// Writes `tokens` new tokens' K and V rows (bf16 `[token][kv_head][head_dim]` in `k_new`,
/// `v_new`) into FP8 pages at the slots in device memory (`u32` each, `page * page_tokens + slot`):
/// each row's codes and scale as `kiln_core::ops::attention::kv_fp8_row`. A slot past the caches
/// writes nothing. For a step whose slots already live on the device (the engine's); `kv_append`
/// with FP8 buffers comes here with its checked slots.
pub fn kv_append_fp8(
    gpu: &Gpu,
    shape: &AttentionShape,
    k_new: DeviceView,
    v_new: DeviceView,
    slots: DeviceView,
    tokens: usize,
    cache: KvBuffers<'_>,
) -> Result<()> {
    let page_shift = check_shape(shape)?;
    let Some(scales) = cache.scales else {
        return Err(Error::InvalidArgument {
            name: "cache",
            value: "bf16 pages".into(),
            reason: "kv_append_fp8 writes FP8 pages (buffers with scales)".into(),
        });
    };
    let new_bytes = tokens * shape.kv_heads * shape.head_dim * 2;
    check_len("kv_append k_new", k_new.len_bytes, new_bytes)?;
    check_len("kv_append v_new", v_new.len_bytes, new_bytes)?;
    check_len("kv_append slots", slots.len_bytes, tokens * 4)?;
    cache.check(["kv_append k_cache", "kv_append v_cache"], shape)?;
    if tokens == 0 {
        return Ok(());
    }
    // One warp a (token, kv head) row, 8 warps a block.
    let kernel = function(gpu, shape.head_dim, AttentionVariant::DECODE_TILED, true, "kiln_kv_append_fp8")?;
    let rows = (tokens * shape.kv_heads) as u64;
    let blocks = rows.div_ceil(8).min(65_536) as u32;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (tokens_arg, kv_heads, page_shift) =
        (tokens as u64, as_i32("kv_heads", shape.kv_heads)?, page_shift as i32);
    let slot_limit = (cache.pages * shape.page_tokens) as u64;
    let pointers = [
        k_new.ptr,
        v_new.ptr,
        slots.ptr,
        cache.k.device_ptr(),
        cache.v.device_ptr(),
        scales.k.device_ptr(),
        scales.v.device_ptr(),
    ];
    let mut launch = gpu.launch_builder(&kernel);
    for pointer in &pointers {
        launch.arg(pointer);
    }
    launch.arg(&tokens_arg).arg(&kv_heads).arg(&page_shift).arg(&slot_limit);
    // SAFETY: matches `kiln_kv_append_fp8` (7 pointers, u64, 2 i32, u64); k_new, v_new and slots
    // hold `tokens` rows and slots (checked above), the kernel skips a slot at or past
    // `slot_limit`, and the codes and scales hold `cache.pages` pages (checked above); the
    // buffers outlive the kernel in the pool's stream order.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_kv_append_fp8)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_fit_the_compiled_shapes() {
        for variant in AttentionVariant::ALL {
            for head_dim in HEAD_DIMS {
                variant.validate(head_dim).unwrap();
                assert!(variant.shared_bytes(head_dim) <= 227 * 1024, "{variant:?} {head_dim}");
            }
        }
        AttentionVariant::DECODE_TILED.validate(128).unwrap();
        // The deep decode variants: three stages of 64 (128) keys, K and V, beside 16 Q rows, rows
        // of 272 bytes; two blocks of DECODE_DEEP fit sm_90's 228 KiB a multiprocessor (beside
        // 1 KiB reserved a block), one of DECODE_WIDE_DEEP within its 227 KiB opt-in.
        for deep in [AttentionVariant::DECODE_DEEP, AttentionVariant::DECODE_WIDE_DEEP] {
            deep.validate(128).unwrap();
            assert_eq!((deep.stages(), deep.kernel), (3, AttentionKernel::Tiled));
        }
        assert_eq!(AttentionVariant::DECODE_DEEP.shared_bytes(128), (16 + 384) * 272);
        assert!(2 * (AttentionVariant::DECODE_DEEP.shared_bytes(128) + 1024 + 16) <= 228 * 1024);
        assert_eq!(AttentionVariant::DECODE_WIDE_DEEP.shared_bytes(128), (16 + 768) * 272);
        assert!(AttentionVariant::DECODE_WIDE_DEEP.shared_bytes(128) + 16 <= 227 * 1024);
        assert_eq!(
            plain_defines(128, AttentionVariant::DECODE_DEEP).last(),
            Some(&("STAGES", "3".to_owned()))
        );
        // The alternating decode variants: one stage of 64 (128) keys, K and V, beside 16 Q rows;
        // two blocks a multiprocessor even with 128-key tiles. One stage only for one row tile.
        for alt in [AttentionVariant::DECODE_ALT, AttentionVariant::DECODE_ALT_WIDE] {
            alt.validate(128).unwrap();
            alt.validate(64).unwrap();
            assert_eq!(plain_defines(128, alt).last(), Some(&("STAGES", "1".to_owned())));
        }
        assert_eq!(AttentionVariant::DECODE_ALT.shared_bytes(128), (16 + 128) * 272);
        assert_eq!(AttentionVariant::DECODE_ALT_WIDE.shared_bytes(128), (16 + 256) * 272);
        assert!(2 * (AttentionVariant::DECODE_ALT_WIDE.shared_bytes(128) + 1024 + 600) <= 228 * 1024);
        assert!(matches!(
            AttentionVariant { stages: 1, ..AttentionVariant::PREFILL }.validate(128),
            Err(Error::NotServed { .. })
        ));
        assert!(!plain_defines(128, AttentionVariant::DECODE_TILED).iter().any(|(k, _)| *k == "STAGES"));
        // The hybrid kernel: DECODE_DEEP's shape and stages, its shared memory the larger of the
        // tiled path's and the streaming one's, at both head dims; nothing else passes as hybrid.
        let hybrid = AttentionVariant::DECODE_HYBRID;
        hybrid.validate(128).unwrap();
        hybrid.validate(64).unwrap();
        assert_eq!(hybrid.shared_bytes(128), AttentionVariant::DECODE_DEEP.shared_bytes(128));
        assert_eq!(hybrid.shared_bytes(64), AttentionVariant::DECODE_DEEP.shared_bytes(64).max(48 * 1024));
        assert!(2 * (hybrid.shared_bytes(128) + 1024 + 600) <= 228 * 1024);
        assert_eq!(plain_defines(128, hybrid).last(), Some(&("HYBRID", "1".to_owned())));
        for bad in [
            AttentionVariant { hybrid: true, ..AttentionVariant::DECODE_WIDE_DEEP },
            AttentionVariant { hybrid: true, ..AttentionVariant::DECODE_TILED },
            AttentionVariant { hybrid: true, ..AttentionVariant::PREFILL },
        ] {
            assert!(matches!(bad.validate(128), Err(Error::NotServed { .. })), "{bad:?}");
        }
        // The launcher's threshold is the kernel's.
        let define = format!("#define HYBRID_STREAM_CHUNK {HYBRID_STREAM_CHUNK}\n");
        assert!(ATTENTION.source.contains(&define), "{define}");
        assert_eq!(AttentionVariant::PREFILL.shared_bytes(128), (64 + 256) * 272);
        assert_eq!(AttentionVariant::DECODE_TILED.shared_bytes(128), (16 + 256) * 272);
        // The streaming decode: 4 warps x 3 stages x (K + V) x 16 keys x 256 bytes, twice per
        // sm_90 multiprocessor and within sm_86's 99 KiB opt-in (beside its 516 static bytes).
        assert_eq!(AttentionVariant::DECODE.shared_bytes(128), 96 * 1024);
        assert_eq!(AttentionVariant::DECODE.shared_bytes(64), 48 * 1024);
        assert!(AttentionVariant::DECODE.shared_bytes(128) + 516 <= 99 * 1024);
        assert_eq!(AttentionVariant::default_for(1), AttentionVariant::DECODE);
        let bad = AttentionVariant { warp_keys: 8, warps_n: 1, ..AttentionVariant::DECODE_TILED };
        assert!(matches!(bad.validate(128), Err(Error::NotServed { .. })));
        for bad in [
            AttentionVariant { warps_m: 2, ..AttentionVariant::DECODE },
            AttentionVariant { warp_keys: 32, ..AttentionVariant::DECODE },
            AttentionVariant { warps_n: 16, ..AttentionVariant::DECODE },
            AttentionVariant { stages: 2, ..AttentionVariant::DECODE },
            // Three stages only for the tiled decode shapes (one row tile).
            AttentionVariant { stages: 3, ..AttentionVariant::PREFILL },
            AttentionVariant { stages: 4, ..AttentionVariant::DECODE_TILED },
        ] {
            assert!(matches!(bad.validate(128), Err(Error::NotServed { .. })), "{bad:?}");
        }
        // Names (warps_m x warps_n x warp_keys) are distinct within ALL.
        let names: std::collections::HashSet<(u32, u32, u32)> =
            AttentionVariant::ALL.iter().map(|v| (v.warps_m, v.warps_n, v.warp_keys)).collect();
        assert_eq!(names.len(), AttentionVariant::ALL.len());
    }

    #[test]
    fn defines_name_the_compiled_define_sets() {
        // The launcher's defines are one of kernels::ATTENTION's sets, so the compile check
        // covers every variant the launcher builds.
        let others = [
            AttentionVariant::DECODE_TILED,
            AttentionVariant::DECODE_DEEP,
            AttentionVariant::DECODE_WIDE_DEEP,
            AttentionVariant::DECODE_HYBRID,
            AttentionVariant::DECODE_STREAM_WIDE,
            AttentionVariant::DECODE_STREAM_DEEP,
            AttentionVariant::DECODE_ALT,
            AttentionVariant::DECODE_ALT_WIDE,
        ];
        for variant in AttentionVariant::ALL.into_iter().chain(others) {
            for head_dim in HEAD_DIMS {
                let defines = plain_defines(head_dim, variant);
                let declared = ATTENTION.define_sets.iter().any(|set| {
                    set.len() == defines.len()
                        && set.iter().zip(&defines).all(|((k, v), (dk, dv))| k == dk && v == dv)
                });
                let compiled_for_all_heads = ![
                    AttentionVariant::PREFILL_WIDE,
                    AttentionVariant::DECODE_WIDE,
                    AttentionVariant::DECODE_DEEP,
                    AttentionVariant::DECODE_WIDE_DEEP,
                    AttentionVariant::DECODE_HYBRID,
                    AttentionVariant::DECODE_ALT,
                    AttentionVariant::DECODE_ALT_WIDE,
                ]
                .contains(&variant);
                if compiled_for_all_heads || head_dim == 128 {
                    assert!(declared, "{variant:?} at head dim {head_dim}: {defines:?}");
                }
            }
        }
    }

    #[test]
    fn the_fp8_cache_variants_are_compiled_define_sets() {
        // Every tiled variant of two stages or more reads FP8 pages; its KV_FP8 module (and the
        // FP8 append's, DECODE_TILED's) is one of kernels::ATTENTION's sets.
        let tiled = [
            (AttentionVariant::PREFILL, &HEAD_DIMS[..]),
            (AttentionVariant::PREFILL_WIDE, &[128][..]),
            (AttentionVariant::DECODE_TILED, &HEAD_DIMS[..]),
            (AttentionVariant::DECODE_WIDE, &[128][..]),
            (AttentionVariant::DECODE_DEEP, &[128][..]),
            (AttentionVariant::DECODE_WIDE_DEEP, &[128][..]),
        ];
        for (variant, head_dims) in tiled {
            assert!(serves_fp8_kv(variant), "{variant:?}");
            for &head_dim in head_dims {
                let defines = defines(head_dim, variant, true);
                let declared = ATTENTION.define_sets.iter().any(|set| {
                    set.len() == defines.len()
                        && set.iter().zip(&defines).all(|((k, v), (dk, dv))| k == dk && v == dv)
                });
                assert!(declared, "{variant:?} at head dim {head_dim}: {defines:?}");
            }
        }
        for variant in [
            AttentionVariant::DECODE,
            AttentionVariant::DECODE_HYBRID,
            AttentionVariant::DECODE_ALT,
            AttentionVariant::DECODE_ALT_WIDE,
            AttentionVariant::PREFILL_WGMMA,
        ] {
            assert!(!serves_fp8_kv(variant), "{variant:?}");
        }
    }

    #[test]
    fn the_wgmma_prefill_variant_is_compiled_and_served_at_head_dim_128() {
        let variant = AttentionVariant::PREFILL_WGMMA;
        variant.validate(128).unwrap();
        assert!(matches!(variant.validate(64), Err(Error::NotServed { .. })));
        // 1 KiB of alignment, 128 Q rows and 2 stages of 128 K and 128 V rows, 256 bytes each.
        assert_eq!(variant.shared_bytes(128), 1024 + (128 + 512) * 256);
        assert!(variant.shared_bytes(128) <= 227 * 1024);
        assert_eq!((variant.threads(), variant.rows(), variant.keys()), (256, 128, 128));
        let defines = plain_defines(128, variant);
        assert!(ATTENTION_PREFILL.define_sets.iter().any(|set| {
            set.len() == defines.len()
                && set.iter().zip(&defines).all(|((k, v), (dk, dv))| k == dk && v == dv)
        }));
        // The tiled kernels' shapes do not pass as the wgmma one.
        let other = AttentionVariant { kernel: AttentionKernel::Warpgroup, ..AttentionVariant::PREFILL_WIDE };
        assert!(matches!(other.validate(128), Err(Error::NotServed { .. })));
        // The ping-pong kernel: a third warpgroup, three stages (230400 bytes, within sm_90's
        // 227 KiB beside its barriers, 1024 static bytes by ptxas's report), the same defines.
        let pingpong = AttentionVariant::PREFILL_WGMMA_PINGPONG;
        pingpong.validate(128).unwrap();
        assert!(matches!(pingpong.validate(64), Err(Error::NotServed { .. })));
        assert_eq!(pingpong.threads(), 384);
        assert_eq!(pingpong.shared_bytes(128), 1024 + (128 + 768) * 256);
        assert!(pingpong.shared_bytes(128) + 1024 <= 227 * 1024);
        assert_eq!(super::plain_defines(128, pingpong), super::plain_defines(128, variant));
        assert!(variant.is_wgmma() && pingpong.is_wgmma() && !AttentionVariant::PREFILL.is_wgmma());
        // Their configurations have names of their own, which the tuning store reads back.
        use crate::certify::AttentionConfig;
        for (variant, label) in [(variant, "wgmma-8x1x128.s1"), (pingpong, "wgmma-pingpong-8x1x128.s1")] {
            let config = AttentionConfig { variant, splits: 1 };
            assert_eq!(config.label(), label);
            assert_eq!(AttentionConfig::parse(label), Some(config));
        }
    }

    #[test]
    fn the_wide_and_deep_streaming_variants_fit_one_block_a_multiprocessor() {
        for variant in [AttentionVariant::DECODE_STREAM_WIDE, AttentionVariant::DECODE_STREAM_DEEP] {
            assert_eq!(variant.kernel, AttentionKernel::Streaming);
            assert!(!variant.hybrid);
            for head_dim in HEAD_DIMS {
                variant.validate(head_dim).unwrap();
            }
            // 24 warp-stages of K and V steps (16 keys x 256 bytes each): 192 KiB at head dim 128,
            // within sm_90's 227 KiB opt-in beside the static merge maxima and sums (1 KiB at 8
            // warps), more than half its 228 KiB a multiprocessor (the kernel's one-block bounds:
            // WARPS_N * STREAM_STAGES > 12).
            assert_eq!(variant.warps_n * variant.stages(), 24);
            assert_eq!(variant.shared_bytes(128), 192 * 1024);
            assert_eq!(variant.shared_bytes(64), 96 * 1024);
            assert!(variant.shared_bytes(128) + 1024 + 16 <= 227 * 1024);
            assert!(2 * variant.shared_bytes(128) > 228 * 1024);
            assert_ne!(variant, AttentionVariant::DECODE);
        }
        assert_eq!(AttentionVariant::DECODE.warps_n * AttentionVariant::DECODE.stages(), 12);
        assert_eq!(AttentionVariant::DECODE_STREAM_WIDE.threads(), 256);
        assert_eq!(AttentionVariant::DECODE_STREAM_DEEP.threads(), 128);
        // Their defines: WARPS_N 8, or STREAM_STAGES 6 after STREAMING; DECODE's are unchanged.
        let wide = plain_defines(128, AttentionVariant::DECODE_STREAM_WIDE);
        assert!(wide.contains(&("WARPS_N", "8".to_owned())));
        assert!(!wide.iter().any(|(k, _)| *k == "STREAM_STAGES"));
        let deep = plain_defines(128, AttentionVariant::DECODE_STREAM_DEEP);
        assert_eq!(&deep[4..], &[("STREAMING", "1".to_owned()), ("STREAM_STAGES", "6".to_owned())]);
        assert_eq!(
            plain_defines(128, AttentionVariant::DECODE).iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            ["HEAD_DIM", "WARPS_M", "WARPS_N", "WARP_KEYS", "STREAMING"]
        );
        // The kernel's default stages are the launcher's; the one-block threshold is 12.
        assert!(ATTENTION.source.contains(&format!("#define STREAM_STAGES {STREAM_STAGES}\n")));
        assert!(ATTENTION.source.contains("#if WARPS_N * STREAM_STAGES > 12\n#define STREAM_MIN_BLOCKS 1"));
        // Other streaming shapes are still refused.
        for bad in [
            AttentionVariant { warps_n: 8, stages: 6, ..AttentionVariant::DECODE },
            AttentionVariant { warps_n: 2, ..AttentionVariant::DECODE },
            AttentionVariant { stages: 4, ..AttentionVariant::DECODE },
            AttentionVariant { hybrid: true, ..AttentionVariant::DECODE_STREAM_WIDE },
        ] {
            assert!(matches!(bad.validate(128), Err(Error::NotServed { .. })), "{bad:?}");
        }
        // One wave of 132 one-block multiprocessors: batch 8 x 8 kv heads at 2 splits (128
        // blocks), batch 1 at 16, batch 2 at 8, batch 4 at 4; batch 64 at 1 (512 blocks, 97% of
        // four waves).
        assert_eq!(decode_stream_splits_for(132, 8, 8), 2);
        assert_eq!(decode_stream_splits_for(132, 1, 8), 16);
        assert_eq!(decode_stream_splits_for(132, 2, 8), 8);
        assert_eq!(decode_stream_splits_for(132, 4, 8), 4);
        assert_eq!(decode_stream_splits_for(132, 64, 8), 1);
        for batch in 1..200 {
            let splits = decode_stream_splits_for(132, batch, 8);
            assert!((1..=MAX_STREAMING_SPLITS).contains(&splits), "{batch}: {splits}");
        }
    }

    #[test]
    fn decode_splits_fill_whole_waves() {
        // 132 multiprocessors, 264 slots; Llama-3-8B's 8 KV heads.
        assert_eq!(decode_splits_for(132, 1, 8), 33); // 264 blocks
        assert_eq!(decode_splits_for(132, 100, 1), 13); // 1300 blocks, 98% of 5 waves
        assert_eq!(decode_splits_for(132, 8, 8), 4); // 256 blocks, not 5 (320: two waves)
        assert_eq!(decode_splits_for(132, 64, 8), 1); // 512 blocks, 97% of two waves
        for batch in 1..300 {
            for kv_heads in [1, 2, 3, 8] {
                let splits = decode_splits_for(132, batch, kv_heads);
                assert!((1..=64).contains(&splits), "{batch} {kv_heads}: {splits}");
            }
        }
        assert_eq!(decode_splits_for(0, 1, 8), 1);
        // One block a multiprocessor (DECODE_WIDE): 128 blocks at batch 1, 97% of 132.
        assert_eq!(decode_splits_resident(132, 1, 1, 8), 16);
        assert_eq!(decode_splits_resident(132, 1, 8, 8), 2);
        assert_eq!(decode_splits_resident(132, 1, 64, 8), 1);
    }

    #[test]
    fn scratch_holds_outputs_then_log_sums() {
        let shape = AttentionShape { q_heads: 8, kv_heads: 2, head_dim: 64, page_tokens: 16, scale: 0.125 };
        assert_eq!(scratch_bytes(&shape, 3, 1), 0);
        assert_eq!(scratch_bytes(&shape, 3, 4), 4 * 3 * 8 * 65 * 4);
    }
}
