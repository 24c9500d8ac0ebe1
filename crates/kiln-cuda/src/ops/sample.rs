//! Launcher of `kernels/sample.cu`: `kiln_core::ops::sample::sample` on the GPU, the same token
//! for the same logits, parameters, history, seed, step and stream.
//!
//! Buffers (all device memory):
//! - `logits`: `rows` rows of `vocab` fp32, `row_stride` elements apart;
//! - `params`: `rows` [`DeviceSamplingParams`] (48 bytes each, from [`encode_params`]);
//! - `steps`: `rows` `u64` step counters, read by the kernel (a captured graph replays with the
//!   counters advanced on the device);
//! - `history_offsets`: `rows + 1` `u32`, row `r`'s history is `history[offsets[r]..offsets[r+1]]`;
//! - `penalty`: a `counts` block of `rows x vocab` `u32` that is all zero (the kernel leaves it
//!   zero) and a `scratch` block of `rows x vocab` fp32; without it the penalties are not applied;
//! - `stats`: the LM head's packed block maxima, `stats_per_row` per row, for greedy rows
//!   without penalties;
//! - `tokens`: `rows` `u32` outputs ([`NO_TOKEN`] for a row whose logits are all NaN);
//! - `scratch`: the multi-block path's [`SampleScratch`] (allocated per launch when absent, which
//!   a captured graph cannot do: allocate it once with [`SampleScratch::new`]).
//!
//! Three paths, chosen per row on the device (the parameters live in device memory), on a grid
//! of [`slices`] x rows fixed for a given (rows, vocab, device), so the launches can be captured:
//! - greedy rows and rows with `1 <= top_k <=` [`FAST_KMAX`] run on many blocks per row, each
//!   listing its slice's local top-k (`kiln_sample`);
//! - rows at temperature > 0 with top-k off (temperature, top-p, min-p, penalties) run on many
//!   blocks per row in three kernels (`kiln_sample`, `kiln_sample_mass`,
//!   `kiln_sample_mass_pick`): slice maxima, then slice masses and a histogram of the weights
//!   by distance from the maximum, then the top-p cutoff within one bin and the draw
//!   (`kiln_sample_mass_fallback` samples a row whose bin holds too many tokens on one block);
//! - the others (top-k above [`FAST_KMAX`] at temperature > 0, greedy rows read from the LM
//!   head's statistics, and greedy rows without penalties once the rows fill a quarter of the
//!   device) run on one block per row.
//!
//! The fused path ([`SamplePath::Auto`], [`SamplePath::Fused`]) serves greedy rows and rows with
//! `1 <= top_k <=` [`FUSED_KMAX`] in one launch (`kiln_sample_fused`, blocks of
//! [`FUSED_THREADS`] on a grid of [`fused_slices`]): each block lists its slice's top-k in the
//! order, found from one histogram of the distance below the slice maximum, and the last block of
//! the row stages the lists' first entries in one round trip, bounds the row's k-th token by
//! them, reads the lists down to that bound and finishes on the top-k.
//!
//! The greedy path ([`SamplePath::Greedy`]) serves greedy rows without penalties in one launch
//! (`kiln_sample_greedy`, blocks of [`FUSED_THREADS`] on a grid of [`greedy_slices`], every block
//! resident at once): each block streams its slice once and keeps its best (key, index) in
//! registers, and the last block of the row takes the best of the blocks'.
//!
//! The top-k merge path ([`SamplePath::TopKMerge`]) serves greedy rows and rows with
//! `1 <= top_k <=` [`TOPK_MERGE_KMAX`] without penalties in one launch
//! (`kiln_sample_topk_merge`, blocks of [`TOPK_MERGE_THREADS`] on a grid of
//! [`topk_merge_slices`]): each block holds its slice in registers, selects its local top-k from
//! per-warp histograms and writes it sorted; the last block of the row merges the lists above a
//! bound from their first entries and finishes on the top-k.
//!
//! The top-k bound path ([`SamplePath::TopKBound`]) serves the same rows as the top-k merge path
//! in one launch (`kiln_sample_topk_bound`, blocks of [`TOPK_BOUND_THREADS`] on a grid of
//! [`topk_bound_slices`]) with no selection in the blocks that read the logits: each block
//! writes the maximum of every group of 32 logits, and the last block of the row bounds the
//! row's k-th token from below by the k-th largest group maximum (k groups hold k distinct
//! tokens at or above it: a binary search over bins of the maxima's distance below the row
//! maximum finds it), reads again only the groups that reach the bound and finishes on the few
//! candidates. Compiled with `SAMPLE_PROFILE=1` ([`sample_with_path_profiled`]) it and the top-k
//! merge kernel write time stamps of their phases.
//! [`SamplePath::TopKWide`] launches it compiled for blocks of [`TOPK_WIDE_THREADS`] (a grid of
//! [`topk_wide_slices`], one block a multiprocessor), so that each thread of the row's last block
//! holds half the group maxima and 16 warps hide each other's latency.
//! [`SamplePath::TopKHeads`] launches that compile with `TKB_HEADS=8`: each block also lists its
//! slice's largest tokens, and the row's last block bounds the top-k from the lists alone (one
//! histogram of the listed tokens) and finishes on the listed tokens, with no search loop and no
//! second read of the logits (a row with a saturated list takes the wide path's last block).
//!
//! Every path gives the reference's token; [`SamplePath`] chooses among them. The default,
//! [`SamplePath::Auto`], runs the fused path and the mass path's three launches after it (which
//! return at once when no row needs them); a caller that knows its rows' parameters on the host
//! saves those three launches with [`SamplePath::for_rows`].

use cudarc::driver::LaunchConfig;
use kiln_core::ops::sample::{SamplingParams, NO_TOKEN, PROBABILITY_BITS, WEIGHT_BITS};
use kiln_core::{Error, Result};

use crate::kernels::SAMPLE;
use crate::launch::Launch;
use crate::memory::DeviceMemory;
use crate::runtime::{driver_error, Gpu};

/// The most rows one launch samples.
pub const MAX_SAMPLE_ROWS: usize = 256;

/// Bytes of one [`DeviceSamplingParams`].
pub const PARAMS_BYTES: usize = 48;

/// One row's parameters as the kernel reads them (`KilnSampleParams` in `sample.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSamplingParams {
    pub temperature: f32,
    pub top_k: u32,
    /// `round(top_p * 2^24)`; `2^24` is off.
    pub top_p_units: u32,
    /// `round(min_p * 2^24) << 7`, the smallest weight min-p keeps.
    pub min_weight: u32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
    pub reserved: u32,
    pub seed: u64,
    pub stream: u64,
}

impl DeviceSamplingParams {
    /// The device form of `params` (validated) for sample stream `stream`.
    pub fn new(params: &SamplingParams, stream: u64) -> Result<DeviceSamplingParams> {
        params.validate()?;
        let top_p_units = if params.top_p < 1.0 { params.top_p_units() } else { 1 << PROBABILITY_BITS };
        Ok(DeviceSamplingParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p_units: top_p_units as u32,
            min_weight: (params.min_p_units() << (WEIGHT_BITS - PROBABILITY_BITS)) as u32,
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            reserved: 0,
            seed: params.seed,
            stream,
        })
    }

    /// The 48 little-endian bytes the kernel reads.
    pub fn to_bytes(&self) -> [u8; PARAMS_BYTES] {
        let mut out = [0u8; PARAMS_BYTES];
        let words = [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p_units,
            self.min_weight,
            self.repetition.to_bits(),
            self.presence.to_bits(),
            self.frequency.to_bits(),
            self.reserved,
        ];
        for (i, w) in words.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        out[32..40].copy_from_slice(&self.seed.to_le_bytes());
        out[40..48].copy_from_slice(&self.stream.to_le_bytes());
        out
    }
}

/// The `params` bytes of rows given as (parameters, stream).
pub fn encode_params(rows: &[(SamplingParams, u64)]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(rows.len() * PARAMS_BYTES);
    for (params, stream) in rows {
        out.extend_from_slice(&DeviceSamplingParams::new(params, *stream)?.to_bytes());
    }
    Ok(out)
}

/// The `history_offsets` and `history` words of per-row histories, each token checked against
/// the vocabulary.
pub fn encode_histories(histories: &[&[u32]], vocab: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut offsets = Vec::with_capacity(histories.len() + 1);
    let mut tokens = Vec::new();
    offsets.push(0u32);
    for history in histories {
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument {
                name: "history",
                value: t.to_string(),
                reason: format!("token id is outside the vocabulary of {vocab}"),
            });
        }
        tokens.extend_from_slice(history);
        offsets.push(u32::try_from(tokens.len()).map_err(|_| Error::InvalidArgument {
            name: "history",
            value: tokens.len().to_string(),
            reason: "more than 2^32 tokens of history in one launch".into(),
        })?);
    }
    Ok((offsets, tokens))
}

/// The penalty scratch of a launch (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct PenaltyScratch<'a> {
    /// `rows x vocab` `u32`, all zero.
    pub counts: &'a DeviceMemory,
    /// `rows x vocab` fp32.
    pub scratch: &'a DeviceMemory,
}

/// Device buffers of one sampler launch (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct SampleBuffers<'a> {
    pub logits: &'a DeviceMemory,
    /// Elements between the starts of two rows of `logits`.
    pub row_stride: usize,
    pub params: &'a DeviceMemory,
    pub steps: &'a DeviceMemory,
    pub history_offsets: &'a DeviceMemory,
    pub history: &'a DeviceMemory,
    pub penalty: Option<PenaltyScratch<'a>>,
    /// The LM head's statistics and how many there are per row.
    pub stats: Option<(&'a DeviceMemory, usize)>,
    pub tokens: &'a DeviceMemory,
    /// The multi-block path's workspace; allocated (and zeroed) for this launch when `None`.
    pub scratch: Option<&'a SampleScratch>,
}

/// The largest `top_k` the multi-block path serves (`FAST_KMAX` in `sample.cu`).
pub const FAST_KMAX: u32 = 256;
/// Logits one block of the multi-block path holds (`FAST_SLICE_MAX`).
const FAST_SLICE_MAX: usize = 8192;
/// Candidates one block may list (`FAST_BLOCK_CAP`).
const FAST_BLOCK_CAP: usize = 512;
/// The shortest slice worth a block of its own: bounds the slices per row, hence the scratch.
const MIN_SLICE: usize = 2048;

/// Which rows may take a multi-block path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SamplePath {
    /// The fused path for greedy and top-k rows, the mass path for rows at temperature > 0 with
    /// top-k off (four launches: the mass path's three follow the fused one, and return at once
    /// when no row needs them).
    Auto,
    /// Every row runs on one block (the reference path of the GPU tests and benchmarks).
    SingleBlock,
    /// Only greedy and top-k rows run on many blocks (the top-k lists).
    TopKBlocks,
    /// Only rows at temperature > 0 with top-k off run on many blocks (the mass path).
    MassBlocks,
    /// One launch: greedy rows and rows with `1 <= top_k <=` [`FUSED_KMAX`] on the fused path,
    /// every other row on one block. The fastest path for a batch whose every row has a top-k
    /// or is greedy ([`SamplePath::for_rows`] picks it then).
    Fused,
    /// The top-k lists for greedy and top-k rows (greedy rows on one block each once the batch
    /// fills a quarter of the device) and the mass path for the others: the default before the
    /// fused path, kept for comparison.
    Lists,
    /// One launch of a kernel for greedy rows without penalties (`kiln_sample_greedy`): the row's
    /// argmax over blocks that read the logits once, all resident together (grid of
    /// [`greedy_slices`]); every other row on one block. The fastest path for a batch of plain
    /// greedy rows ([`SamplePath::for_rows`] picks it then).
    Greedy,
    /// One launch of a kernel for greedy rows and rows with `1 <= top_k <=` [`TOPK_MERGE_KMAX`]
    /// without penalties (`kiln_sample_topk_merge`, blocks of [`TOPK_MERGE_THREADS`] on a grid of
    /// [`topk_merge_slices`]), designed for latency: each block holds its slice in registers,
    /// selects its local top-k from per-warp histograms (no atomics) and writes it sorted; the
    /// last block of the row merges the lists above a bound from their first entries and
    /// finishes on the top-k (top-p, min-p, the draw). Every other row on one block. Not chosen
    /// by [`SamplePath::for_rows`]: a candidate to measure against [`SamplePath::Fused`].
    TopKMerge,
    /// One launch of a kernel for the rows of [`SamplePath::TopKMerge`] (`kiln_sample_topk_bound`,
    /// blocks of [`TOPK_BOUND_THREADS`] on a grid of [`topk_bound_slices`]): the blocks write the
    /// maxima of groups of 32 logits, the last block of the row selects a bound among them (the
    /// k-th largest group maximum is at most the row's k-th largest logit), ranks the tokens at
    /// or above it and finishes on the top-k. Every other row on one block. Not chosen by
    /// [`SamplePath::for_rows`]: a candidate to measure against [`SamplePath::Fused`].
    TopKBound,
    /// [`SamplePath::TopKBound`] on blocks of [`TOPK_WIDE_THREADS`] (`kiln_sample_topk_bound`
    /// compiled with `THREADS=512`, `TKB_PER=16`, `TKB_GROUP_PER=16`, `TKB_MIN_BLOCKS=1`) on a
    /// grid of [`topk_wide_slices`], one block a multiprocessor, for the latency of a batch of
    /// one: the row's last block has 16 warps and each of its threads half the group maxima, so
    /// its serial phases (maxima, bound search, candidate lists, ranking) take about half the
    /// steps. The same candidates, hence the same token. [`SamplePath::for_rows`] takes it for a
    /// single top-k row past [`TOPK_HEADS_KMAX`]: top-k + top-p at vocabulary 151936 in 14.2 us on
    /// the H200 against [`SamplePath::TopKBound`]'s 15.7
    /// (`bench/results/2026-11-30-h200-afternoon/r19`).
    TopKWide,
    /// [`SamplePath::TopKWide`] with the bound search moved into the slice blocks
    /// (`kiln_sample_topk_bound` compiled as it with `TKB_HEADS=8`): each block also lists its
    /// slice's [`TOPK_HEADS`] largest tokens (key and index: the tokens whose key reaches the
    /// 8th largest of its warps' maxima, ranked among themselves), and the row's last block reads the
    /// lists (one round trip), picks the bin of the distance below the row maximum at which
    /// their count reaches k (one histogram, one warp), and finishes on the listed tokens up to
    /// that bin: no search loop, no second read of the logits. A row where a slice holds more
    /// than its list's worth of tokens up to that bin takes [`SamplePath::TopKWide`]'s last
    /// block. The row's top-k are among the candidates, hence the reference's token.
    /// [`SamplePath::for_rows`] takes it for a single top-k row up to [`TOPK_HEADS_KMAX`]: top-k
    /// and top-p at vocabulary 151936 in 8.9 us on the H200 against [`SamplePath::TopKWide`]'s
    /// 14.2 (`bench/results/2026-11-30-h200-night/d3`).
    TopKHeads,
}

impl SamplePath {
    /// Every path, for tests that compare each with the reference.
    pub const ALL: [SamplePath; 11] = [
        SamplePath::Auto,
        SamplePath::SingleBlock,
        SamplePath::TopKBlocks,
        SamplePath::MassBlocks,
        SamplePath::Fused,
        SamplePath::Lists,
        SamplePath::Greedy,
        SamplePath::TopKMerge,
        SamplePath::TopKBound,
        SamplePath::TopKWide,
        SamplePath::TopKHeads,
    ];

    /// The path for a batch of rows with these parameters, known on the host, by the H200's
    /// figures (`bench/results/`, `kiln bench sample`):
    /// - every row greedy without penalties: [`SamplePath::Greedy`] (one launch that reads the
    ///   logits once);
    /// - one row at temperature > 0 with `1 <= top_k <=` [`TOPK_BOUND_KMAX`] and no penalties:
    ///   [`SamplePath::TopKHeads`] up to [`TOPK_HEADS_KMAX`] (one launch, the row's last block
    ///   finishing from the slices' lists; top-k + top-p at vocabulary 151936 in 8.9 us,
    ///   `bench/results/2026-11-30-h200-night/d3`), [`SamplePath::TopKWide`] past it (the row's
    ///   last block 16 warps wide; 14.2 us against [`SamplePath::TopKBound`]'s 15.7);
    /// - several such rows: [`SamplePath::TopKBound`] (one launch; at vocabulary 151936 top-k +
    ///   top-p 44.8 us at batch 64 against the fused path's 123.6,
    ///   `bench/results/2026-11-30-h200-kernels/step5`);
    /// - no row needs the mass path (every row is greedy or has `1 <= top_k <=` [`FUSED_KMAX`]):
    ///   [`SamplePath::Fused`] (one launch);
    /// - a single row at temperature > 0 without top-k (temperature, top-p, min-p, penalties):
    ///   [`SamplePath::Lists`], whose first launch runs the mass path's first step on 1024-thread
    ///   blocks (faster than the fused launch's 256-thread blocks for one row; slower at 64);
    /// - [`SamplePath::Auto`] otherwise.
    ///
    /// A captured graph holds the launches of one path: capture again when the batch's
    /// parameters change the answer.
    pub fn for_rows<'a>(rows: impl IntoIterator<Item = &'a SamplingParams>) -> SamplePath {
        let rows: Vec<&SamplingParams> = rows.into_iter().collect();
        let fused = |p: &SamplingParams| p.is_greedy() || (1..=FUSED_KMAX).contains(&p.top_k);
        let mass = |p: &SamplingParams| !p.is_greedy() && p.top_k == 0;
        let top_k = |p: &SamplingParams| {
            !p.is_greedy() && !p.has_penalties() && (1..=TOPK_BOUND_KMAX).contains(&p.top_k)
        };
        if rows.iter().all(|p| p.is_greedy() && !p.has_penalties()) {
            SamplePath::Greedy
        } else if rows.len() == 1 && top_k(rows[0]) {
            if rows[0].top_k <= TOPK_HEADS_KMAX {
                SamplePath::TopKHeads
            } else {
                SamplePath::TopKWide
            }
        } else if !rows.is_empty() && rows.iter().all(|p| top_k(p)) {
            SamplePath::TopKBound
        } else if rows.iter().all(|p| fused(p)) {
            SamplePath::Fused
        } else if rows.len() == 1 && mass(rows[0]) {
            SamplePath::Lists
        } else {
            SamplePath::Auto
        }
    }

    fn top_k_blocks(self) -> bool {
        matches!(self, SamplePath::Lists | SamplePath::TopKBlocks)
    }

    fn mass_blocks(self) -> bool {
        matches!(self, SamplePath::Auto | SamplePath::MassBlocks | SamplePath::Lists)
    }

    fn fused(self) -> bool {
        matches!(self, SamplePath::Fused | SamplePath::Auto)
    }

    /// The paths that launch `kiln_sample_topk_bound`.
    fn top_k_bound(self) -> bool {
        matches!(self, SamplePath::TopKBound | SamplePath::TopKWide | SamplePath::TopKHeads)
    }
}

/// The largest `top_k` the fused path serves (`FUSED_KMAX` in `sample.cu`).
pub const FUSED_KMAX: u32 = 256;
/// Threads per block of the fused kernel (`THREADS` of its compile; at least [`FUSED_KMAX`]):
/// a quarter of [`SAMPLE_THREADS`], so that several of its blocks share a multiprocessor at
/// large batches and its barriers wait on 8 warps, not 32. Its last block owns one list per
/// thread: at most this many slices.
pub const FUSED_THREADS: u32 = 256;
/// Logits one block of the fused path holds (`FUSED_SLICE_MAX`).
const FUSED_SLICE_MAX: usize = 8192;
/// The shortest slice of the fused path: bounds its slices per row, hence the scratch.
const FUSED_MIN_SLICE: usize = 1024;

/// Slices per row the fused path's scratch is laid out for: an upper bound of [`fused_slices`]
/// and of [`slices`] (the fused launch also runs the mass path's first step on the latter).
fn fused_slots(vocab: usize) -> usize {
    vocab.div_ceil(FUSED_MIN_SLICE).max(slots(vocab)).clamp(1, SAMPLE_THREADS as usize)
}

/// The fused path's grid for `rows` rows of `vocab` logits on a device of `multiprocessors`:
/// (slices per row, logits per slice). About one block (of [`FUSED_THREADS`]) per
/// multiprocessor in all, so that at batch 1 every block reads a short slice and the row's lists
/// come together in one wave; each slice between `FUSED_MIN_SLICE` and `FUSED_SLICE_MAX` logits
/// (fewer when the vocabulary is small). `None` when the vocabulary needs more slices than the
/// last block can combine.
pub fn fused_slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    if rows == 0 || vocab == 0 {
        return None;
    }
    let fewest = vocab.div_ceil(FUSED_SLICE_MAX);
    let wanted = multiprocessors.max(1).div_ceil(rows);
    let count = wanted.clamp(fewest, vocab.div_ceil(FUSED_MIN_SLICE).max(fewest));
    if count > FUSED_THREADS as usize {
        return None;
    }
    let slice_len = vocab.div_ceil(count);
    Some((vocab.div_ceil(slice_len), slice_len))
}

/// Threads per block of the greedy kernel (`THREADS` of its compile, that of the fused kernel).
const GREEDY_THREADS: u32 = FUSED_THREADS;
/// Blocks of the greedy kernel a multiprocessor keeps resident (`GREEDY_MIN_BLOCKS`).
const GREEDY_BLOCKS_PER_SM: usize = 2;
/// The shortest slice of the greedy path (its slices then stay within [`fused_slots`]).
const GREEDY_MIN_SLICE: usize = FUSED_MIN_SLICE;

/// The greedy path's grid for `rows` rows of `vocab` logits on a device of `multiprocessors`:
/// (slices per row, logits per slice, a multiple of 4). As many blocks as the device keeps
/// resident at once (`GREEDY_BLOCKS_PER_SM` a multiprocessor), so the whole batch streams in
/// one wave; at least one slice a row, at most `GREEDY_THREADS` (the last block reads one
/// slot a thread) and one per `GREEDY_MIN_SLICE` logits.
pub fn greedy_slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    if rows == 0 || vocab == 0 {
        return None;
    }
    let resident = GREEDY_BLOCKS_PER_SM * multiprocessors.max(1);
    let most = vocab.div_ceil(GREEDY_MIN_SLICE).min(GREEDY_THREADS as usize);
    let count = (resident / rows).clamp(1, most);
    let slice_len = vocab.div_ceil(count).next_multiple_of(4);
    Some((vocab.div_ceil(slice_len), slice_len))
}

/// The largest `top_k` the top-k merge path serves (`TKM_KMAX` in `sample.cu`).
pub const TOPK_MERGE_KMAX: u32 = 256;
/// Threads per block of the top-k merge kernel (`THREADS` of its compile, that of the fused
/// kernel; at least [`TOPK_MERGE_KMAX`]: its last block owns one list per thread).
pub const TOPK_MERGE_THREADS: u32 = FUSED_THREADS;
// The lists of the top-k merge path are those of the fused path (FUSED_KMAX entries a slot).
const _: () = assert!(TOPK_MERGE_KMAX == FUSED_KMAX && TOPK_MERGE_THREADS >= TOPK_MERGE_KMAX);
/// Logits a thread of the top-k merge kernel holds in registers (`TKM_PER`).
const TOPK_MERGE_PER_THREAD: usize = 32;
/// Blocks of the top-k merge kernel a multiprocessor keeps resident (`TKM_MIN_BLOCKS`).
const TOPK_MERGE_BLOCKS_PER_SM: usize = 2;

/// The top-k merge path's grid for `rows` rows of `vocab` logits on a device of
/// `multiprocessors`: (slices per row, logits per slice). As many blocks as the device keeps
/// resident at once where the slices allow: each slice at most `TKM_PER * THREADS` logits (the
/// registers of a block) and at least `FUSED_MIN_SLICE` (so the slices stay within
/// `fused_slots`, whose lists the path uses); at most [`TOPK_MERGE_THREADS`] slices (the last
/// block owns one list per thread). 149 slices of 1020 at batch 1 and vocab 151936 on 132
/// multiprocessors, 19 of 7997 at batch 64. `None` when the vocabulary needs more slices.
pub fn topk_merge_slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    if rows == 0 || vocab == 0 {
        return None;
    }
    let fewest = vocab.div_ceil(TOPK_MERGE_PER_THREAD * TOPK_MERGE_THREADS as usize);
    let most = vocab.div_ceil(FUSED_MIN_SLICE).max(fewest);
    let resident = TOPK_MERGE_BLOCKS_PER_SM * multiprocessors.max(1);
    let count = (resident / rows).clamp(fewest, most).min(TOPK_MERGE_THREADS as usize);
    if count < fewest {
        return None;
    }
    let slice_len = vocab.div_ceil(count);
    Some((vocab.div_ceil(slice_len), slice_len))
}

/// The largest `top_k` the top-k bound path serves (`TKB_KMAX` in `sample.cu`).
pub const TOPK_BOUND_KMAX: u32 = 256;
/// Threads per block of the top-k bound kernel (`THREADS` of its compile, that of the fused
/// kernel; at least [`TOPK_BOUND_KMAX`]: one thread per top-k token).
pub const TOPK_BOUND_THREADS: u32 = FUSED_THREADS;
const _: () = assert!(TOPK_BOUND_THREADS >= TOPK_BOUND_KMAX);
/// Order keys a thread of the top-k bound kernel holds (`TKB_PER`).
const TOPK_BOUND_PER_THREAD: usize = 32;
/// Group maxima a thread of its last block holds (`TKB_GROUP_PER`): at most this many times
/// [`TOPK_BOUND_THREADS`] groups of 32 logits a row.
const TOPK_BOUND_GROUPS_PER_THREAD: usize = 32;
/// Logits of a group of the top-k bound path (one warp-wide maximum).
const TOPK_BOUND_GROUP: usize = 32;
/// The shortest slice of the top-k bound path (as the greedy path's: fewer tickets a row).
const TOPK_BOUND_MIN_SLICE: usize = FUSED_MIN_SLICE;
/// Blocks of the top-k bound kernel a multiprocessor keeps resident (`TKB_MIN_BLOCKS`).
const TOPK_BOUND_BLOCKS_PER_SM: usize = 2;
/// The largest `top_k` [`SamplePath::for_rows`] sends a single row with to
/// [`SamplePath::TopKHeads`] (larger ones to [`SamplePath::TopKWide`]): at vocabulary 151936 the
/// 132 slices' lists of 8 hold a row's top 128 unless one slice holds 8 of them (such a row
/// takes the wide path's last block, the same token); for independent logits that is about one
/// row in a hundred at k = 128 and almost never at k = 50.
pub const TOPK_HEADS_KMAX: u32 = 128;
const _: () = assert!(TOPK_HEADS_KMAX < TOPK_BOUND_KMAX);

/// Tokens each slice block of [`SamplePath::TopKHeads`] lists (`TKB_HEADS` of its compile): 8
/// keeps a list from saturating (more of the row's top-k candidates in one slice than it holds,
/// which sends the row to [`SamplePath::TopKWide`]'s last block) but in rare rows at k = 50 over
/// 132 slices of random logits.
pub const TOPK_HEADS: usize = 8;
/// u64 slots of the profile buffer of [`sample_with_path_profiled`].
pub const PROFILE_SLOTS: usize = 64;

/// The top-k bound path's grid for `rows` rows of `vocab` logits on a device of
/// `multiprocessors`: (slices per row, logits per slice, a multiple of 32). As many blocks as the
/// device keeps resident at once where the slices allow, each slice at least
/// `FUSED_MIN_SLICE` logits and at most `TKB_PER * THREADS` (the registers of a block); the
/// row's groups of 32 (group g: logits `[32 g, 32 g + 32)`) at most `TKB_GROUP_PER * THREADS`
/// (the registers of the last block).
/// 149 slices of 1024 at batch 1 and vocab 151936 on 132 multiprocessors, 19 of 8000 at batch
/// 64. `None` beyond 262144 logits.
pub fn topk_bound_slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    bound_slices(rows, vocab, multiprocessors, TOPK_BOUND_SHAPE)
}

/// Threads per block of the wide top-k bound kernel ([`SamplePath::TopKWide`]; `THREADS` of its
/// compile). 512, not 1024: at 1024 threads a thread has 64 registers, and the kernel (its last
/// block and the single-block path inlined for the rows it does not serve) spills a few bytes
/// there whatever the unrolling; at 512 it has 128.
pub const TOPK_WIDE_THREADS: u32 = 512;
const _: () = assert!(TOPK_WIDE_THREADS >= TOPK_BOUND_KMAX);

/// The shape of a compile of the top-k bound kernel: threads a block, order keys a thread
/// (`TKB_PER`), group maxima a thread of the last block (`TKB_GROUP_PER`), blocks a
/// multiprocessor keeps resident (`TKB_MIN_BLOCKS`).
#[derive(Clone, Copy)]
struct BoundShape {
    threads: usize,
    per_thread: usize,
    groups_per_thread: usize,
    blocks_per_sm: usize,
}

const TOPK_BOUND_SHAPE: BoundShape = BoundShape {
    threads: TOPK_BOUND_THREADS as usize,
    per_thread: TOPK_BOUND_PER_THREAD,
    groups_per_thread: TOPK_BOUND_GROUPS_PER_THREAD,
    blocks_per_sm: TOPK_BOUND_BLOCKS_PER_SM,
};

/// [`SamplePath::TopKWide`]'s compile: 512 threads, 16 keys and 16 group maxima a thread (at
/// most 8192 logits a slice and 8192 groups a row, as the 256-thread compile), one block a
/// multiprocessor (128 registers a thread).
const TOPK_WIDE_SHAPE: BoundShape = BoundShape {
    threads: TOPK_WIDE_THREADS as usize,
    per_thread: 16,
    groups_per_thread: 16,
    blocks_per_sm: 1,
};

/// The wide top-k bound path's grid ([`SamplePath::TopKWide`]), as [`topk_bound_slices`] for
/// blocks of [`TOPK_WIDE_THREADS`], one a multiprocessor: each slice at most `TKB_PER * THREADS`
/// = 8192 logits, the row's groups at most `TKB_GROUP_PER * THREADS` = 8192.
/// 132 slices of 1152 at batch 1 and vocab 151936 on 132 multiprocessors, 19 of 8000 at batch
/// 64. `None` beyond 262144 logits.
pub fn topk_wide_slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    bound_slices(rows, vocab, multiprocessors, TOPK_WIDE_SHAPE)
}

fn bound_slices(
    rows: usize,
    vocab: usize,
    multiprocessors: usize,
    shape: BoundShape,
) -> Option<(usize, usize)> {
    if rows == 0 || vocab == 0 {
        return None;
    }
    let slice_max = shape.per_thread * shape.threads;
    let fewest = vocab.div_ceil(slice_max);
    let most = vocab.div_ceil(TOPK_BOUND_MIN_SLICE).max(fewest);
    let resident = shape.blocks_per_sm * multiprocessors.max(1);
    let count = (resident / rows).clamp(fewest, most);
    let slice_len = vocab.div_ceil(count).next_multiple_of(TOPK_BOUND_GROUP);
    let count = vocab.div_ceil(slice_len);
    // The last block holds the groups that hold logits (those of the last slice past the row's
    // end are not read).
    let groups = vocab.div_ceil(TOPK_BOUND_GROUP);
    (slice_len <= slice_max && groups <= shape.groups_per_thread * shape.threads)
        .then_some((count, slice_len))
}

/// u32 group maxima a row of the top-k bound path may write (they lie in the fused lists'
/// region: `fused_slots` lists of [`FUSED_KMAX`] u64 a row).
fn topk_bound_group_stride(vocab: usize) -> usize {
    fused_slots(vocab) * FUSED_KMAX as usize * 2
}

/// Bins of the mass path's histogram per row (`MASS_BINS` in `sample.cu`).
const MASS_BINS: usize = 4096;

/// Slices per row the scratch is laid out for: an upper bound of [`slices`].
fn slots(vocab: usize) -> usize {
    vocab.div_ceil(MIN_SLICE).max(1)
}

/// The multi-block grid for `rows` rows of `vocab` logits on a device of `multiprocessors`:
/// (slices per row, logits per slice). About two blocks per multiprocessor in all, each slice
/// between `MIN_SLICE` and `FAST_SLICE_MAX` logits (fewer when the vocabulary is small);
/// `None` when the vocabulary needs more slices than a block of the kernel can combine.
pub fn slices(rows: usize, vocab: usize, multiprocessors: usize) -> Option<(usize, usize)> {
    if rows == 0 || vocab == 0 {
        return None;
    }
    let fewest = vocab.div_ceil(FAST_SLICE_MAX);
    let wanted = (2 * multiprocessors.max(1)).div_ceil(rows);
    let count = wanted.clamp(fewest, slots(vocab).max(fewest));
    if count > SAMPLE_THREADS as usize {
        return None;
    }
    let slice_len = vocab.div_ceil(count);
    Some((vocab.div_ceil(slice_len), slice_len))
}

/// Byte offsets of the regions of a [`SampleScratch`] for (rows, vocab), and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ScratchLayout {
    slots: usize,
    tickets: usize,
    counts: usize,
    cuts: usize,
    values: usize,
    indices: usize,
    overflow_values: usize,
    overflow_indices: usize,
    maxima: usize,
    histogram: usize,
    row_state: usize,
    fused_slots: usize,
    fused_counts: usize,
    fused_lists: usize,
    bytes: usize,
}

impl ScratchLayout {
    fn new(rows: usize, vocab: usize) -> ScratchLayout {
        let slots = slots(vocab);
        let align = |n: usize| n.next_multiple_of(256);
        let lists = rows * slots * FAST_BLOCK_CAP * 4;
        let tickets = 0;
        let counts = align(tickets + rows * 4);
        let cuts = align(counts + rows * slots * 4);
        let values = align(cuts + rows * slots * 8);
        let indices = align(values + lists);
        let overflow_values = align(indices + lists);
        let overflow_indices = align(overflow_values + lists);
        let maxima = align(overflow_indices + lists);
        let histogram = align(maxima + rows * slots * 8);
        let row_state = align(histogram + rows * MASS_BINS * 8);
        let fused_slots = fused_slots(vocab);
        let fused_counts = align(row_state + rows * 4 * 8);
        let fused_lists = align(fused_counts + rows * fused_slots * 4);
        let bytes = align(fused_lists + rows * fused_slots * FUSED_KMAX as usize * 8);
        ScratchLayout {
            slots,
            tickets,
            counts,
            cuts,
            values,
            indices,
            overflow_values,
            overflow_indices,
            maxima,
            histogram,
            row_state,
            fused_slots,
            fused_counts,
            fused_lists,
            bytes,
        }
    }
}

/// Bytes of the [`SampleScratch`] of `rows` rows of `vocab` logits
/// (`rows * (ceil(vocab / 2048) * 8 KiB + ceil(vocab / 1024) * 2 KiB + 32 KiB)` and a little).
pub fn scratch_bytes(rows: usize, vocab: usize) -> usize {
    ScratchLayout::new(rows, vocab).bytes
}

/// The multi-block paths' workspace for up to `rows` rows of `vocab` logits: per-row tickets and
/// mass histograms (zero between launches: the kernels leave them zero), the blocks' candidate
/// lists, slice maxima and masses.
/// Allocate it once (outside a graph capture) and pass it to every launch.
#[derive(Debug)]
pub struct SampleScratch {
    memory: DeviceMemory,
    rows: usize,
    vocab: usize,
}

impl SampleScratch {
    /// Allocates and zeroes the scratch on `gpu`'s stream.
    pub fn new(gpu: &Gpu, rows: usize, vocab: usize) -> Result<SampleScratch> {
        let memory = gpu.alloc(scratch_bytes(rows, vocab))?;
        memory.fill_bytes(0)?;
        Ok(SampleScratch { memory, rows, vocab })
    }

    /// The rows and vocabulary it was made for.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.vocab)
    }
}

/// Threads per block of the sampler.
pub const SAMPLE_THREADS: u32 = 1024;

/// The path [`sample`] takes: the fused path for greedy and top-k rows, the mass path for the
/// others. With 1024-thread fused blocks (`FusedMass` then) it measured at least as fast as the
/// lists in every mode at batch 1 and in every mode but greedy at batch 64 (58.5 against 35.2
/// us; `bench/results/2026-11-30-h200-overlap/bench-sample.txt`); the fused blocks now have
/// [`FUSED_THREADS`], so that several share a multiprocessor at large batches.
pub const DEFAULT_PATH: SamplePath = SamplePath::Auto;

/// The parameters every sampling kernel takes first, in their order: the logits, the vocabulary
/// and row stride, the rows' parameters and steps, the histories, the penalty scratch, the LM
/// head's statistics and the tokens out.
struct RowArgs {
    logits: u64,
    vocab: i64,
    row_stride: i64,
    params: u64,
    steps: u64,
    offsets: u64,
    history: u64,
    counts: u64,
    scratch: u64,
    stats: u64,
    stats_per_row: i32,
    tokens: u64,
}

impl RowArgs {
    /// Pushes the parameters onto `launch`, in the kernels' order.
    fn push<'a>(&'a self, launch: &mut Launch<'a>) {
        launch
            .arg(&self.logits)
            .arg(&self.vocab)
            .arg(&self.row_stride)
            .arg(&self.params)
            .arg(&self.steps)
            .arg(&self.offsets)
            .arg(&self.history)
            .arg(&self.counts)
            .arg(&self.scratch)
            .arg(&self.stats)
            .arg(&self.stats_per_row)
            .arg(&self.tokens);
    }
}

/// Samples one token for each of `rows` rows of `vocab` logits on `gpu`'s stream.
pub fn sample(gpu: &Gpu, rows: usize, vocab: usize, buffers: SampleBuffers<'_>) -> Result<()> {
    sample_with_path(gpu, rows, vocab, buffers, DEFAULT_PATH)
}

/// [`sample`], with the rows allowed on the multi-block path chosen by `path`.
pub fn sample_with_path(
    gpu: &Gpu,
    rows: usize,
    vocab: usize,
    buffers: SampleBuffers<'_>,
    path: SamplePath,
) -> Result<()> {
    sample_with_path_profiled(gpu, rows, vocab, buffers, path, None)
}

/// [`sample_with_path`]; with `profile` (at least [`PROFILE_SLOTS`] u64, zeroed by the caller)
/// and [`SamplePath::TopKBound`], [`SamplePath::TopKWide`], [`SamplePath::TopKHeads`] or
/// [`SamplePath::TopKMerge`], the kernel is compiled with
/// `SAMPLE_PROFILE=1` and writes the time stamps and counts of its phases there (the slots are
/// listed in `sample.cu`; other paths leave it untouched).
pub fn sample_with_path_profiled(
    gpu: &Gpu,
    rows: usize,
    vocab: usize,
    buffers: SampleBuffers<'_>,
    path: SamplePath,
    profile: Option<&DeviceMemory>,
) -> Result<()> {
    if let Some(p) = profile {
        super::check_buffer("sample", "profile", p.len_bytes(), PROFILE_SLOTS * 8)?;
    }
    if rows == 0 || rows > MAX_SAMPLE_ROWS {
        return Err(Error::NotServed {
            op: "sample kernel",
            reason: format!("{rows} rows (1 to {MAX_SAMPLE_ROWS})"),
        });
    }
    if vocab == 0 || vocab >= NO_TOKEN as usize || buffers.row_stride < vocab {
        return Err(Error::NotServed {
            op: "sample kernel",
            reason: format!("vocab {vocab} with row stride {}", buffers.row_stride),
        });
    }
    super::check_buffer(
        "sample",
        "logits",
        buffers.logits.len_bytes(),
        ((rows - 1) * buffers.row_stride + vocab) * 4,
    )?;
    super::check_buffer("sample", "params", buffers.params.len_bytes(), rows * PARAMS_BYTES)?;
    super::check_buffer("sample", "steps", buffers.steps.len_bytes(), rows * 8)?;
    super::check_buffer("sample", "history_offsets", buffers.history_offsets.len_bytes(), (rows + 1) * 4)?;
    super::check_buffer("sample", "tokens", buffers.tokens.len_bytes(), rows * 4)?;
    if let Some(p) = buffers.penalty {
        super::check_buffer("sample", "counts", p.counts.len_bytes(), rows * vocab * 4)?;
        super::check_buffer("sample", "scratch", p.scratch.len_bytes(), rows * vocab * 4)?;
    }
    let (stats, stats_per_row) = match buffers.stats {
        Some((m, per_row)) => {
            super::check_buffer("sample", "stats", m.len_bytes(), rows * per_row * 8)?;
            (
                m.device_ptr(),
                i32::try_from(per_row).map_err(|_| Error::NotServed {
                    op: "sample kernel",
                    reason: format!("{per_row} statistics per row"),
                })?,
            )
        }
        None => (0u64, 0i32),
    };
    let multiprocessors = gpu.facts().multiprocessors as usize;
    let grid = match path {
        SamplePath::SingleBlock
        | SamplePath::Fused
        | SamplePath::Greedy
        | SamplePath::TopKMerge
        | SamplePath::TopKBound
        | SamplePath::TopKWide
        | SamplePath::TopKHeads => None,
        _ => slices(rows, vocab, multiprocessors),
    };
    // The fused launch also runs the mass path's first step on the mass path's slices: its grid
    // covers both, and its last block owns one list per thread.
    let fused_grid = if path.fused() { fused_slices(rows, vocab, multiprocessors) } else { None }
        .filter(|&(count, _)| count.max(grid.map_or(0, |(mass, _)| mass)) <= FUSED_THREADS as usize);
    let greedy_grid =
        if path == SamplePath::Greedy { greedy_slices(rows, vocab, multiprocessors) } else { None };
    let merge_grid =
        if path == SamplePath::TopKMerge { topk_merge_slices(rows, vocab, multiprocessors) } else { None };
    let bound_grid = match path {
        SamplePath::TopKWide | SamplePath::TopKHeads => topk_wide_slices(rows, vocab, multiprocessors),
        _ if path.top_k_bound() => topk_bound_slices(rows, vocab, multiprocessors),
        _ => None,
    };
    let group_stride = topk_bound_group_stride(vocab) as i32;
    let owned;
    let scratch = match (grid.or(fused_grid).or(greedy_grid).or(merge_grid).or(bound_grid), buffers.scratch) {
        (None, _) => None,
        (Some(_), Some(scratch)) => {
            if scratch.rows < rows || scratch.vocab != vocab {
                return Err(Error::NotServed {
                    op: "sample kernel",
                    reason: format!(
                        "a scratch made for {} rows of vocab {} used for {rows} rows of vocab {vocab}",
                        scratch.rows, scratch.vocab
                    ),
                });
            }
            Some(scratch)
        }
        (Some(_), None) => {
            owned = SampleScratch::new(gpu, rows, vocab)?;
            Some(&owned)
        }
    };
    let (slice_count, slice_len) = grid.unwrap_or((1, vocab));
    // Without a fused grid (a vocabulary beyond the fused path's slices), Auto's top-k rows take
    // the lists.
    let top_k_blocks = path.top_k_blocks() || (path == SamplePath::Auto && fused_grid.is_none());
    let fast_kmax: i32 = if scratch.is_some() && top_k_blocks { FAST_KMAX as i32 } else { 0 };
    let mass_path = i32::from(scratch.is_some() && grid.is_some() && path.mass_blocks());
    // Greedy rows without penalties stream on one block per row once the rows alone fill a
    // quarter of the device (33 rows on 132 multiprocessors): the blocks then read together at
    // close to the memory's rate, with no lists, no ticket and no waves of short blocks.
    let greedy_single = i32::from(4 * rows >= gpu.facts().multiprocessors as usize);
    let (layout, base) = match scratch {
        Some(s) => (ScratchLayout::new(s.rows, s.vocab), s.memory.device_ptr()),
        None => (ScratchLayout::new(0, 1), 0u64),
    };
    let at = |offset: usize| if base == 0 { 0u64 } else { base + offset as u64 };
    let (tickets, list_counts, list_cuts) = (at(layout.tickets), at(layout.counts), at(layout.cuts));
    let (list_values, list_indices) = (at(layout.values), at(layout.indices));
    let (overflow_values, overflow_indices) = (at(layout.overflow_values), at(layout.overflow_indices));
    let (maxima, histogram, row_state) = (at(layout.maxima), at(layout.histogram), at(layout.row_state));
    let slots = layout.slots as i32;
    let slice_len = slice_len as i64;
    let threads = SAMPLE_THREADS.to_string();
    let penalties = if buffers.penalty.is_some() { "1" } else { "0" };
    let config = LaunchConfig {
        grid_dim: (slice_count as u32, rows as u32, 1),
        block_dim: (SAMPLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (counts, scratch) =
        buffers.penalty.map_or((0u64, 0u64), |p| (p.counts.device_ptr(), p.scratch.device_ptr()));
    let (logits, params, steps) =
        (buffers.logits.device_ptr(), buffers.params.device_ptr(), buffers.steps.device_ptr());
    let (offsets, history, tokens) =
        (buffers.history_offsets.device_ptr(), buffers.history.device_ptr(), buffers.tokens.device_ptr());
    let (vocab, row_stride) = (vocab as i64, buffers.row_stride as i64);
    let defines = [("THREADS", threads.as_str()), ("PENALTIES", penalties)];
    let row_args = RowArgs {
        logits,
        vocab,
        row_stride,
        params,
        steps,
        offsets,
        history,
        counts,
        scratch,
        stats,
        stats_per_row,
        tokens,
    };
    if let (Some((greedy_count, greedy_len)), true) = (greedy_grid, base != 0) {
        let greedy_threads = GREEDY_THREADS.to_string();
        let greedy_defines = [("THREADS", greedy_threads.as_str()), ("PENALTIES", penalties)];
        let function = gpu.function(&SAMPLE, "kiln_sample_greedy", &greedy_defines)?;
        let greedy_config = LaunchConfig {
            grid_dim: (greedy_count as u32, rows as u32, 1),
            block_dim: (GREEDY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // The blocks' best entries, one slot of the fused lists' region a block.
        let partials = at(layout.fused_lists);
        let greedy_slots = layout.fused_slots as i32;
        let greedy_len = greedy_len as i64;
        let mut launch = gpu.launch_builder(&function);
        row_args.push(&mut launch);
        launch.arg(&tickets).arg(&partials).arg(&greedy_slots).arg(&greedy_len);
        // SAFETY: the arguments match `kiln_sample_greedy`'s signature (pointer, i64, i64, 7
        // pointers, i32, 3 pointers, i32, i64); every buffer was checked above to hold what
        // `rows` rows touch, `counts` and `scratch` are null only with PENALTIES=0 and `stats`
        // only with zero statistics per row. The scratch is laid out by `ScratchLayout` for at
        // least `rows` rows of this vocabulary (checked above): `greedy_slices` keeps the slices
        // within `fused_slots` (so `rows * fused_slots` u64 partials fit in the fused lists'
        // region) and within GREEDY_THREADS, the THREADS of this compile, as the last block
        // needs; the tickets are zero (zeroed at allocation, left zero by every launch).
        unsafe { launch.launch(greedy_config) }
            .map_err(|e| driver_error("cuLaunchKernel(kiln_sample_greedy)", e))?;
        return Ok(());
    }
    if let (Some((merge_count, merge_len)), true) = (merge_grid, base != 0) {
        let merge_threads = TOPK_MERGE_THREADS.to_string();
        let profiled = if profile.is_some() { "1" } else { "0" };
        let merge_defines =
            [("THREADS", merge_threads.as_str()), ("PENALTIES", penalties), ("SAMPLE_PROFILE", profiled)];
        let function = gpu.function(&SAMPLE, "kiln_sample_topk_merge", &merge_defines)?;
        let merge_config = LaunchConfig {
            grid_dim: (merge_count as u32, rows as u32, 1),
            block_dim: (TOPK_MERGE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (merge_counts, merge_lists) = (at(layout.fused_counts), at(layout.fused_lists));
        let merge_slots = layout.fused_slots as i32;
        let merge_len = merge_len as i64;
        let profile_ptr = profile.map_or(0u64, DeviceMemory::device_ptr);
        let mut launch = gpu.launch_builder(&function);
        row_args.push(&mut launch);
        launch
            .arg(&tickets)
            .arg(&merge_counts)
            .arg(&merge_lists)
            .arg(&merge_slots)
            .arg(&merge_len)
            .arg(&profile_ptr);
        // SAFETY: the arguments match `kiln_sample_topk_merge`'s signature (pointer, i64, i64, 7
        // pointers, i32, 4 pointers, i32, i64, pointer); every buffer was checked above to hold
        // what `rows` rows touch, `counts` and `scratch` are null only with PENALTIES=0, `stats`
        // only with zero statistics per row and `profile` null or PROFILE_SLOTS u64. The scratch is laid out by `ScratchLayout` for at
        // least `rows` rows of this vocabulary (checked above): `topk_merge_slices` keeps the
        // slices within `fused_slots` (the lists' counts and the lists of FUSED_KMAX =
        // TKM_KMAX entries a slot), within TOPK_MERGE_THREADS, the THREADS of this compile, as
        // the last block needs, and each slice within TKM_PER * THREADS logits; the tickets are
        // zero (zeroed at allocation, left zero by every launch).
        unsafe { launch.launch(merge_config) }
            .map_err(|e| driver_error("cuLaunchKernel(kiln_sample_topk_merge)", e))?;
        return Ok(());
    }
    if let (Some((bound_count, bound_len)), true) = (bound_grid, base != 0) {
        let wide_path = matches!(path, SamplePath::TopKWide | SamplePath::TopKHeads);
        let shape = if wide_path { TOPK_WIDE_SHAPE } else { TOPK_BOUND_SHAPE };
        let block_threads = shape.threads as u32;
        let bound_threads = block_threads.to_string();
        let profiled = if profile.is_some() { "1" } else { "0" };
        let mut bound_defines =
            vec![("THREADS", bound_threads.as_str()), ("PENALTIES", penalties), ("SAMPLE_PROFILE", profiled)];
        // The wide compile's shape (the 256-thread one takes the kernel's own constants).
        let wide = [shape.per_thread, shape.groups_per_thread, shape.blocks_per_sm].map(|v| v.to_string());
        let heads_define = TOPK_HEADS.to_string();
        if path == SamplePath::TopKHeads {
            bound_defines.push(("TKB_HEADS", heads_define.as_str()));
        }
        if wide_path {
            bound_defines.extend([
                ("TKB_PER", wide[0].as_str()),
                ("TKB_GROUP_PER", wide[1].as_str()),
                ("TKB_MIN_BLOCKS", wide[2].as_str()),
            ]);
        }
        let function = gpu.function(&SAMPLE, "kiln_sample_topk_bound", &bound_defines)?;
        let bound_config = LaunchConfig {
            grid_dim: (bound_count as u32, rows as u32, 1),
            block_dim: (block_threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let maxima_region = at(layout.fused_lists);
        let bound_len = bound_len as i64;
        let profile_ptr = profile.map_or(0u64, DeviceMemory::device_ptr);
        let mut launch = gpu.launch_builder(&function);
        row_args.push(&mut launch);
        // The slices' lists of the heads path (TKB_HEADS > 0) in the lists' values region:
        // `slots * FAST_BLOCK_CAP` u32 a row.
        let heads = at(layout.values);
        let heads_stride = (layout.slots * FAST_BLOCK_CAP / 2) as i32;
        launch
            .arg(&tickets)
            .arg(&maxima_region)
            .arg(&group_stride)
            .arg(&bound_len)
            .arg(&heads)
            .arg(&heads_stride)
            .arg(&profile_ptr);
        // SAFETY: the arguments match `kiln_sample_topk_bound`'s signature (pointer, i64, i64, 7
        // pointers, i32, 3 pointers, i32, i64, pointer, i32, pointer); every buffer was checked above to hold
        // what `rows` rows touch, `counts` and `scratch` are null only with PENALTIES=0, `stats`
        // only with zero statistics per row, `profile` null or PROFILE_SLOTS u64 (checked above).
        // The scratch is laid out by `ScratchLayout` for at least `rows` rows of this vocabulary
        // (checked above): the group maxima of a row (`topk_bound_slices` and `topk_wide_slices`,
        // each for the THREADS, TKB_PER and TKB_GROUP_PER of its compile, keep them within
        // TKB_GROUP_PER * THREADS and within the stride, tested) lie in the fused lists' region
        // (`fused_slots` * FUSED_KMAX u64 a row: the stride's bytes); each slice is a multiple of
        // 32 logits and at most TKB_PER * THREADS; the heads path's lists (`heads_stride` u64 a
        // row, the kernel lists only a grid that fits) lie in the lists' values region
        // (`slots * FAST_BLOCK_CAP` u32 a row); the tickets are zero (zeroed at allocation, left
        // zero by every launch).
        unsafe { launch.launch(bound_config) }
            .map_err(|e| driver_error("cuLaunchKernel(kiln_sample_topk_bound)", e))?;
        return Ok(());
    }
    match (fused_grid, base != 0) {
        (Some((fused_count, fused_len)), true) => {
            let fused_threads = FUSED_THREADS.to_string();
            let fused_defines = [("THREADS", fused_threads.as_str()), ("PENALTIES", penalties)];
            let function = gpu.function(&SAMPLE, "kiln_sample_fused", &fused_defines)?;
            // The mass path's first step runs in this launch on its own slices: the grid covers both.
            let blocks = if mass_path != 0 { fused_count.max(slice_count) } else { fused_count };
            let fused_config = LaunchConfig {
                grid_dim: (blocks as u32, rows as u32, 1),
                block_dim: (FUSED_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let (fused_counts, fused_lists) = (at(layout.fused_counts), at(layout.fused_lists));
            let fused_slots = layout.fused_slots as i32;
            let fused_len = fused_len as i64;
            let mut launch = gpu.launch_builder(&function);
            row_args.push(&mut launch);
            launch
                .arg(&tickets)
                .arg(&fused_counts)
                .arg(&fused_lists)
                .arg(&fused_slots)
                .arg(&fused_len)
                .arg(&mass_path)
                .arg(&maxima)
                .arg(&slots)
                .arg(&slice_len);
            // SAFETY: the arguments match `kiln_sample_fused`'s signature (pointer, i64, i64, 7
            // pointers, i32, 4 pointers, i32, i64, i32, pointer, i32, i64); every buffer was
            // checked above to hold what `rows` rows touch, `counts` and `scratch` are null only
            // with PENALTIES=0 and `stats` only with zero statistics per row. The scratch is laid
            // out by `ScratchLayout` for at least `rows` rows of this vocabulary (checked above):
            // `fused_slots` >= the grid's slices (`fused_slices` and `slices` stay within
            // `fused_slots`; the grid at most FUSED_THREADS blocks, the THREADS of this compile, as
            // the last block needs), each fused slice at most FUSED_SLICE_MAX
            // logits, each mass slice within `slots`; the tickets are zero (zeroed at allocation,
            // left zero by every launch).
            unsafe { launch.launch(fused_config) }
                .map_err(|e| driver_error("cuLaunchKernel(kiln_sample_fused)", e))?;
        }
        _ => {
            let function = gpu.function(&SAMPLE, "kiln_sample", &defines)?;
            let mut launch = gpu.launch_builder(&function);
            row_args.push(&mut launch);
            launch
                .arg(&fast_kmax)
                .arg(&greedy_single)
                .arg(&tickets)
                .arg(&list_counts)
                .arg(&list_cuts)
                .arg(&list_values)
                .arg(&list_indices)
                .arg(&overflow_values)
                .arg(&overflow_indices)
                .arg(&slots)
                .arg(&slice_len)
                .arg(&mass_path)
                .arg(&maxima);
            // SAFETY: the arguments match `kiln_sample`'s signature (pointer, i64, i64, 7 pointers, i32,
            // pointer, i32, i32, 7 pointers, i32, i64, i32, pointer); every buffer was checked above to hold what `rows`
            // rows touch; `counts` and `scratch` are null only with PENALTIES=0, `stats` only with zero
            // statistics per row; the history words are read within `history_offsets`' ranges, which the
            // caller built with `encode_histories` (the kernel also skips a token beyond the vocabulary).
            // The multi-block paths run only with `fast_kmax > 0` or `mass_path`, which need a scratch laid out by
            // `ScratchLayout` for at least `rows` rows of this vocabulary (checked above), whose tickets
            // are zero (zeroed at allocation, left zero by every launch), and a grid of `slices`: each
            // slice at most FAST_SLICE_MAX logits, at most `slots` and SAMPLE_THREADS slices per row. The
            // blocks come from this device's pool, which reuses memory only in this stream's order (an
            // internal scratch is freed after the launch is queued, in stream order).
            unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_sample)", e))?;
        }
    }
    if mass_path == 0 {
        return Ok(());
    }
    // The mass path's steps 2 and 3, on the same grid (every launch of the sequence has its
    // fixed grid, so the three can be captured together).
    let mass = gpu.function(&SAMPLE, "kiln_sample_mass", &defines)?;
    let mut launch = gpu.launch_builder(&mass);
    launch
        .arg(&logits)
        .arg(&vocab)
        .arg(&row_stride)
        .arg(&params)
        .arg(&steps)
        .arg(&offsets)
        .arg(&counts)
        .arg(&scratch)
        .arg(&tokens)
        .arg(&mass_path)
        .arg(&tickets)
        .arg(&maxima)
        .arg(&list_cuts)
        .arg(&histogram)
        .arg(&row_state)
        .arg(&slots)
        .arg(&slice_len);
    // SAFETY: the arguments match `kiln_sample_mass`'s signature (pointer, i64, i64, 6 pointers,
    // i32, 5 pointers, i32, i64); the buffers are those of the launch above, checked there, and
    // the scratch regions (tickets, maxima, slice masses in `cuts`, histogram, row state) are laid
    // out by `ScratchLayout` for at least `rows` rows of this vocabulary, with the tickets and the
    // histogram zero between launches (zeroed at allocation, left zero by the kernels).
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_sample_mass)", e))?;
    let pick = gpu.function(&SAMPLE, "kiln_sample_mass_pick", &defines)?;
    let mut launch = gpu.launch_builder(&pick);
    launch
        .arg(&logits)
        .arg(&vocab)
        .arg(&row_stride)
        .arg(&params)
        .arg(&steps)
        .arg(&offsets)
        .arg(&counts)
        .arg(&scratch)
        .arg(&tokens)
        .arg(&mass_path)
        .arg(&tickets)
        .arg(&maxima)
        .arg(&list_cuts)
        .arg(&row_state)
        .arg(&list_counts)
        .arg(&list_values)
        .arg(&list_indices)
        .arg(&slots)
        .arg(&slice_len);
    // SAFETY: the arguments match `kiln_sample_mass_pick`'s signature (pointer, i64, i64, 6
    // pointers, i32, 7 pointers, i32, i64); as above, and the lists (`counts`, `values`,
    // `indices`) hold FAST_BLOCK_CAP entries per slot.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_sample_mass_pick)", e))?;
    let fallback = gpu.function(&SAMPLE, "kiln_sample_mass_fallback", &defines)?;
    let mut launch = gpu.launch_builder(&fallback);
    launch
        .arg(&logits)
        .arg(&vocab)
        .arg(&row_stride)
        .arg(&params)
        .arg(&steps)
        .arg(&offsets)
        .arg(&history)
        .arg(&counts)
        .arg(&scratch)
        .arg(&tokens)
        .arg(&mass_path)
        .arg(&row_state);
    let one_block_per_row = LaunchConfig { grid_dim: (1, rows as u32, 1), ..config };
    // SAFETY: the arguments match `kiln_sample_mass_fallback`'s signature (pointer, i64, i64, 7
    // pointers, i32, pointer); it runs the single-block path of `kiln_sample` on the buffers
    // checked above, for the rows the pick flagged in the row state.
    unsafe { launch.launch(one_block_per_row) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_sample_mass_fallback)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_encode_as_the_kernel_reads_them() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            seed: 0xABCD,
            ..Default::default()
        };
        let d = DeviceSamplingParams::new(&p, 3).unwrap();
        assert_eq!(std::mem::size_of::<DeviceSamplingParams>(), PARAMS_BYTES);
        assert_eq!(d.top_p_units, (0.9f32 * 16_777_216.0).round() as u32);
        assert_eq!(d.min_weight, ((0.05f32 * 16_777_216.0).round() as u32) << 7);
        let bytes = d.to_bytes();
        assert_eq!(&bytes[0..4], &0.7f32.to_le_bytes());
        assert_eq!(&bytes[32..40], &0xABCDu64.to_le_bytes());
        assert_eq!(&bytes[40..48], &3u64.to_le_bytes());
        let off = DeviceSamplingParams::new(&SamplingParams::default(), 0).unwrap();
        assert_eq!(off.top_p_units, 1 << 24);
        assert!(DeviceSamplingParams::new(&SamplingParams { top_p: 2.0, ..p }, 0).is_err());
    }

    #[test]
    fn slices_fit_the_kernel_and_the_scratch() {
        for vocab in [1usize, 7, 1000, 2048, 2049, 8192, 32_000, 50_257, 128_256, 151_936, 262_144] {
            for rows in [1usize, 2, 8, 64, 256] {
                for sms in [1usize, 108, 132] {
                    let (count, len) = slices(rows, vocab, sms).unwrap();
                    assert!(len <= FAST_SLICE_MAX && count <= SAMPLE_THREADS as usize, "{vocab} {rows}");
                    assert!(count <= slots(vocab), "{vocab} {rows}: {count} slices");
                    // Every slice non-empty, together exactly the vocabulary.
                    assert!((count - 1) * len < vocab && count * len >= vocab, "{vocab} {rows}");
                }
            }
        }
        assert_eq!(slices(1, 151_936, 132), Some((75, 2026)));
        assert_eq!(slices(64, 151_936, 132), Some((19, 7997)));
        assert_eq!(slices(1, SAMPLE_THREADS as usize * FAST_SLICE_MAX + 1, 132), None);
        for vocab in [1usize, 7, 1000, 1025, 2048, 8192, 8193, 32_000, 151_936, 262_144, 1 << 21] {
            for rows in [1usize, 2, 8, 64, 256] {
                for sms in [1usize, 108, 132] {
                    let (count, len) = fused_slices(rows, vocab, sms).unwrap();
                    assert!(len <= FUSED_SLICE_MAX && count <= FUSED_THREADS as usize, "{vocab} {rows}");
                    assert!(count <= fused_slots(vocab), "{vocab} {rows}: {count} fused slices");
                    assert!((count - 1) * len < vocab && count * len >= vocab, "{vocab} {rows}");
                    // The fused launch also covers the mass path's slices.
                    if let Some((mass, _)) = slices(rows, vocab, sms) {
                        assert!(mass <= fused_slots(vocab), "{vocab} {rows}: {mass} mass slices");
                    }
                }
            }
        }
        assert_eq!(fused_slices(1, 151_936, 132), Some((132, 1152)));
        assert_eq!(fused_slices(64, 151_936, 132), Some((19, 7997)));
        assert_eq!(fused_slices(1, FUSED_THREADS as usize * FUSED_SLICE_MAX + 1, 132), None);
        for vocab in [1usize, 3, 7, 1000, 1025, 2048, 8193, 32_000, 151_937, 262_144, 1 << 22] {
            for rows in [1usize, 2, 8, 64, 256] {
                for sms in [1usize, 108, 132] {
                    let (count, len) = greedy_slices(rows, vocab, sms).unwrap();
                    assert!(len.is_multiple_of(4), "{vocab} {rows}: slice of {len}");
                    assert!(count >= 1 && count <= GREEDY_THREADS as usize, "{vocab} {rows}");
                    assert!(count <= fused_slots(vocab), "{vocab} {rows}: {count} greedy slices");
                    assert!((count - 1) * len < vocab && count * len >= vocab, "{vocab} {rows}");
                }
            }
        }
        // One wave of resident blocks: 149 slices of 1020 at batch 1, 4 of 37984 at batch 64.
        assert_eq!(greedy_slices(1, 151_936, 132), Some((149, 1020)));
        assert_eq!(greedy_slices(64, 151_936, 132), Some((4, 37_984)));
        assert_eq!(greedy_slices(256, 151_936, 132), Some((1, 151_936)));
        for vocab in [1usize, 3, 7, 1000, 1025, 2048, 8193, 32_000, 151_937, 262_144, 1 << 21] {
            for rows in [1usize, 2, 8, 64, 256] {
                for sms in [1usize, 108, 132] {
                    let (count, len) = topk_merge_slices(rows, vocab, sms).unwrap();
                    assert!(len <= TOPK_MERGE_PER_THREAD * TOPK_MERGE_THREADS as usize, "{vocab} {rows}");
                    assert!(count >= 1 && count <= TOPK_MERGE_THREADS as usize, "{vocab} {rows}");
                    assert!(count <= fused_slots(vocab), "{vocab} {rows}: {count} merge slices");
                    assert!((count - 1) * len < vocab && count * len >= vocab, "{vocab} {rows}");
                }
            }
        }
        assert_eq!(topk_merge_slices(1, 151_936, 132), Some((149, 1020)));
        assert_eq!(topk_merge_slices(64, 151_936, 132), Some((19, 7997)));
        assert_eq!(topk_merge_slices(1, 256 * 8192 + 1, 132), None);
        type Slices = fn(usize, usize, usize) -> Option<(usize, usize)>;
        let grids: [(Slices, u32, usize, usize); 2] = [
            (topk_bound_slices, TOPK_BOUND_THREADS, TOPK_BOUND_PER_THREAD, TOPK_BOUND_GROUPS_PER_THREAD),
            (topk_wide_slices, TOPK_WIDE_THREADS, 16, 16),
        ];
        for (slices, threads, per_thread, groups_per_thread) in grids {
            let threads = threads as usize;
            for vocab in [1usize, 3, 7, 31, 33, 1000, 1025, 2048, 8193, 32_000, 151_937, 262_144] {
                for rows in [1usize, 2, 8, 64, 256] {
                    for sms in [1usize, 108, 132] {
                        let (count, len) = slices(rows, vocab, sms).unwrap();
                        assert!(len.is_multiple_of(32), "{vocab} {rows}: slice of {len}");
                        assert!(len <= per_thread * threads, "{vocab} {rows}");
                        assert!(vocab.div_ceil(32) <= groups_per_thread * threads);
                        let written = count * len / 32;
                        assert!(
                            written <= topk_bound_group_stride(vocab),
                            "{vocab} {rows}: {written} groups"
                        );
                        assert!((count - 1) * len < vocab && count * len >= vocab, "{vocab} {rows}");
                    }
                }
            }
        }
        assert_eq!(topk_bound_slices(1, 151_936, 132), Some((149, 1024)));
        assert_eq!(topk_bound_slices(64, 151_936, 132), Some((19, 8000)));
        assert_eq!(topk_bound_slices(1, 262_145, 132), None);
        assert_eq!(topk_wide_slices(1, 151_936, 132), Some((132, 1152)));
        assert_eq!(topk_wide_slices(64, 151_936, 132), Some((19, 8000)));
        assert_eq!(topk_wide_slices(1, 262_145, 132), None);
        // The heads path's lists fit the last block's reads (TKB_HEAD_CAP = 2048 entries) and
        // the lists' values region (`slots * FAST_BLOCK_CAP / 2` u64 a row) at batch 1: else
        // every row would take the wide path's last block.
        for (vocab, sms) in [(151_936usize, 132usize), (32_000, 108), (128_256, 132), (262_144, 132)] {
            let (count, _) = topk_wide_slices(1, vocab, sms).unwrap();
            assert!(count * TOPK_HEADS <= 2048, "{vocab} {sms}: {count} slices");
            assert!(count * TOPK_HEADS <= slots(vocab) * FAST_BLOCK_CAP / 2, "{vocab} {sms}: {count} slices");
        }
        let layout = ScratchLayout::new(3, 151_936);
        let lists = 3 * 75 * FAST_BLOCK_CAP * 4;
        assert!(layout.counts >= 3 * 4 && layout.cuts >= layout.counts + 3 * 75 * 4);
        assert!(layout.values >= layout.cuts + 3 * 75 * 8 && layout.indices >= layout.values + lists);
        assert!(layout.overflow_values >= layout.indices + lists);
        assert!(layout.overflow_indices >= layout.overflow_values + lists);
        assert!(layout.maxima >= layout.overflow_indices + lists && layout.cuts.is_multiple_of(8));
        assert_eq!(layout.fused_slots, 149);
        assert!(layout.fused_counts >= layout.row_state + 3 * 4 * 8);
        assert!(
            layout.fused_lists >= layout.fused_counts + 3 * 149 * 4 && layout.fused_lists.is_multiple_of(8)
        );
        assert!(layout.bytes >= layout.fused_lists + 3 * 149 * FUSED_KMAX as usize * 8);
    }

    #[test]
    fn the_host_picks_one_launch_when_no_row_needs_the_mass_path() {
        let d = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
        let greedy = SamplingParams::greedy();
        let top_k = SamplingParams { top_k: 50, top_p: 0.9, ..d };
        let widest = SamplingParams { top_k: FUSED_KMAX, ..d };
        assert_eq!(SamplePath::for_rows([&top_k]), SamplePath::TopKHeads);
        let wide = SamplingParams { top_k: TOPK_HEADS_KMAX + 1, ..d };
        assert_eq!(SamplePath::for_rows([&wide]), SamplePath::TopKWide);
        assert_eq!(SamplePath::for_rows([&top_k; 64]), SamplePath::TopKBound);
        assert_eq!(SamplePath::for_rows([&greedy, &top_k, &widest]), SamplePath::Fused);
        assert_eq!(SamplePath::for_rows([&top_k, &d]), SamplePath::Auto);
        assert_eq!(SamplePath::for_rows([&SamplingParams { top_k: FUSED_KMAX + 1, ..d }]), SamplePath::Auto);
        assert_eq!(SamplePath::for_rows([&SamplingParams { top_p: 0.9, ..d }]), SamplePath::Lists);
        assert_eq!(SamplePath::for_rows([&d]), SamplePath::Lists);
        assert_eq!(SamplePath::for_rows([&d, &d]), SamplePath::Auto);
        assert_eq!(SamplePath::for_rows([&SamplingParams { top_p: 0.9, ..d }; 64]), SamplePath::Auto);
        // Plain greedy rows take the greedy kernel whatever their other parameters; a penalty
        // sends them to the fused path.
        assert_eq!(SamplePath::for_rows([&greedy; 64]), SamplePath::Greedy);
        assert_eq!(SamplePath::for_rows([&SamplingParams { top_p: 0.5, ..greedy }]), SamplePath::Greedy);
        let penalized = SamplingParams { repetition_penalty: 1.2, ..greedy };
        assert_eq!(SamplePath::for_rows([&greedy, &penalized]), SamplePath::Fused);
    }

    #[test]
    fn histories_are_checked_against_the_vocabulary() {
        let (offsets, tokens) = encode_histories(&[&[1, 2], &[], &[3]], 10).unwrap();
        assert_eq!(offsets, vec![0, 2, 2, 3]);
        assert_eq!(tokens, vec![1, 2, 3]);
        assert!(matches!(
            encode_histories(&[&[10]], 10),
            Err(Error::InvalidArgument { name: "history", .. })
        ));
    }
}
