//! `kiln bench attention`: the attention kernels against the hardware and PyTorch.
//!
//! - Prefill: one sequence of 1k, 4k and 16k tokens, head dim 128, causal, 32 query heads over 8
//!   KV heads, as TFLOP/s (4 * heads * head_dim * L(L+1)/2 operations: QK^T and PV over the causal
//!   triangle) for every prefill variant.
//! - Decode: batch 1, 8 and 64 at contexts 1k to 128k, as the fraction of the device-to-device copy
//!   ceiling measured in the same run (bytes: every sequence's K and V read once, q read and out
//!   written once), with the splits of [`decode_splits`](kiln_cuda::ops::attention::decode_splits).
//!
//! Each case runs the certified configuration (the tuning store's winner for its key: the prefill
//! key, or the decode key of the batch's class and of the context's class, `certified short` up
//! to [`DECODE_SHORT_MAX`] positions and `certified long` past it, see
//! [`DecodeClass`]; else the declared default; with
//! `KILN_TUNING=strict` an uncertified key fails by name before anything is timed). The shapes are
//! Llama-3-8B's, so `kiln tune certify --shapes llama3-8b` certifies every key this benchmark asks
//! for. Prefill also times each prefill variant; decode also times the declared default (the
//! splits of [`decode_splits`](kiln_cuda::ops::attention::decode_splits)) when the certificate chose otherwise,
//! the tiled kernel's decode at those splits (`tiled`, the decode default before the streaming
//! kernel; its configuration name is the streaming default's), and the tiled kernel's wide decode
//! variant (128 keys a tile, one block a multiprocessor) at the splits that fill the
//! multiprocessors once (`wide`, unless it is the certified configuration), both of these three
//! K/V tiles deep instead of two at the same splits (`deep`, `wide deep`; their configuration
//! names are the two-deep ones'), and the hybrid kernel at the default splits (`hybrid`: the
//! streaming path where a split holds at most
//! [`HYBRID_STREAM_CHUNK`](kiln_cuda::ops::attention::HYBRID_STREAM_CHUNK) keys, the deep tiled
//! one past that; its name is the default's); at batch 1 and 8 also
//! the streaming default compiled to read K/V under the default L2 policy instead of evict-first
//! (`default, no L2 hint`: `KILN_DECODE_L2_HINT=none` around that row only); last, the streaming
//! kernel one block a multiprocessor, 8 warps (`stream wide`, `stream3-1x8x16.sN`) or six steps
//! in flight a warp (`stream deep`, `stream6-1x4x16.sN`), at the splits of
//! [`kiln_cuda::ops::attention::decode_stream_splits_for`] (one wave),
//! and at batch 1 and 8 both at twice those (`stream wide, two waves`, `stream deep, two waves`).
//!
//! Both as a ratio to PyTorch's `scaled_dot_product_attention` (flash backend) on the same shapes
//! (unpaged), read from the JSON of `bench/peers/attention.py` (`--peer`). Timing: CUDA events,
//! warm-up first, the median; decode rotates among page sets that together exceed the L2 cache
//! twice, so no run reads the cache the previous one left in L2. Decode is timed two ways, both
//! printed and labelled: `graph_us`, launches over every page set captured once in a CUDA graph and
//! replayed between two events, divided by the launches (the engine replays its decode step as a
//! graph; the host's launch cost stays out), from which GB/s and % copy are computed; and
//! `events_us`, events around one launch (the host's launch cost of a few microseconds is in it,
//! which dominates at short contexts). The peer's figures are taken the same two ways. Inputs are
//! random bf16 (a random block tiled over the cache), never zeros.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use kiln_core::ops::attention::{AttentionSequence, AttentionShape};
use kiln_core::ops::primitives::f32_to_bf16_bits;
use kiln_core::{Error, Result};
use kiln_cuda::certify::{
    attention_config, graph_replay_us, AttentionConfig, AttentionPhase, AttentionTask, DecodeClass,
    DECODE_SHORT_MAX,
};
use kiln_cuda::ops::attention::{
    attention, decode_splits_resident, decode_stream_splits_for, scratch_bytes, serves_fp8_kv,
    AttentionVariant, KvBuffers, KvScales, PagedBatch, DECODE_L2_HINT_ENV,
};
use kiln_cuda::{DeviceMemory, Gpu};

use crate::bench::{copy_ceiling, time_us};
use crate::tune::open_store;

/// Arguments of `kiln bench attention`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchAttentionArgs {
    /// JSON written by `bench/peers/attention.py` (`{"prefill": {"1024": us}, "decode": {"8x4096": us},
    /// "decode_graph": {"8x4096": us}}`).
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Timed runs per case (the median is reported).
    #[arg(long, default_value_t = 30)]
    pub iterations: usize,
    /// Largest KV cache a decode case may allocate, GiB.
    #[arg(long, default_value_t = 48)]
    pub max_cache_gib: usize,
    /// Also write the table (markdown) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only the decode rows whose tag or configuration name contains one of these
    /// comma-separated words (the certified row always), and no prefill table: `--decode-only
    /// stream` times the one-block streaming variants beside the certified configuration.
    #[arg(long, value_delimiter = ',')]
    pub decode_only: Vec<String>,
    /// More decode configurations to time, by label (comma-separated, as the tuning reports
    /// name them: `hybrid-1x4x16.s16,1x4x32.s8`), each a row tagged `extra` at every batch and
    /// context: splits beyond the defaults' one wave, for measurement.
    #[arg(long, value_delimiter = ',')]
    pub decode_configs: Vec<String>,
    /// Only these decode batches (comma-separated; default all of 1, 8, 64).
    #[arg(long, value_delimiter = ',')]
    pub decode_batches: Vec<usize>,
    /// Only these decode contexts (comma-separated; default all of 1024 to 131072).
    #[arg(long, value_delimiter = ',')]
    pub decode_contexts: Vec<usize>,
    /// Tokens a KV cache page holds (a power of two from 16 to 4096): the page a head's K or V
    /// rows stay contiguous in. The shipped certificates are for 64; at another size each case
    /// runs its kernel's default configuration unless certified for that size.
    #[arg(long, default_value_t = DEFAULT_PAGE_TOKENS)]
    pub page_tokens: usize,
    /// Decode over FP8 E4M3 K/V pages (one fp32 scale a row) instead of bf16 ones: only the
    /// configurations that read them (the tiled kernel's, two stages or more), the certified
    /// one's splits on the tiled wide and three-deep variants; bandwidth counts the codes and the
    /// scales. PyTorch's figures stay its bf16 SDPA's.
    #[arg(long)]
    pub kv_fp8: bool,
}

/// The tag of the decode row whose streaming kernel reads K/V without the evict-first hint.
const NO_L2_HINT: &str = "default, no L2 hint";
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const DEFAULT_PAGE_TOKENS: usize = 64;
pub const PREFILL_LENGTHS: [usize; 3] = [1024, 4096, 16384];
pub const DECODE_BATCHES: [usize; 3] = [1, 8, 64];
pub const DECODE_CONTEXTS: [usize; 5] = [1024, 4096, 16384, 32768, 131072];

fn shape(page_tokens: usize) -> AttentionShape {
    AttentionShape {
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        page_tokens,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
    }
}

/// A device buffer of `bytes` random bf16 in [-1, 1): a random block of at most 64 MiB, tiled.
fn random_device(gpu: &Gpu, bytes: usize, seed: &mut u64) -> Result<DeviceMemory> {
    let block_len = bytes.min(64 << 20);
    let mut block = Vec::with_capacity(block_len);
    while block.len() < block_len {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let v = ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        block.extend_from_slice(&f32_to_bf16_bits(v).to_le_bytes());
    }
    block.truncate(block_len);
    tiled_upload(gpu, bytes, &block)
}

/// `len` random FP8 E4M3 codes on the device (a random block tiled over it), NaN codes left out.
fn random_fp8(gpu: &Gpu, len: usize, seed: &mut u64) -> Result<DeviceMemory> {
    let block_len = len.min(64 << 20);
    let block: Vec<u8> = (0..block_len)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let code = (*seed >> 56) as u8;
            if code & 0x7F == 0x7F {
                code ^ 1
            } else {
                code
            }
        })
        .collect();
    tiled_upload(gpu, len, &block)
}

/// `rows` random positive fp32 scales on the device, in [1/128, 1/64).
fn random_scales(gpu: &Gpu, rows: usize, seed: &mut u64) -> Result<DeviceMemory> {
    let block: Vec<u8> = (0..rows.min(1 << 20))
        .flat_map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let u = (*seed >> 40) as f32 / (1u64 << 24) as f32;
            ((1.0 + u) / 128.0).to_le_bytes()
        })
        .collect();
    tiled_upload(gpu, rows * 4, &block)
}

/// `bytes` on the device, `block` repeated over them.
fn tiled_upload(gpu: &Gpu, bytes: usize, block: &[u8]) -> Result<DeviceMemory> {
    let memory = gpu.alloc(bytes.max(16))?;
    let mut offset = 0;
    while offset < bytes {
        let n = block.len().min(bytes - offset);
        memory.copy_from_host(offset, &block[..n])?;
        offset += n;
    }
    Ok(memory)
}

type Peer = BTreeMap<String, BTreeMap<String, f64>>;

fn read_peer(args: &BenchAttentionArgs) -> Result<Peer> {
    let Some(path) = &args.peer else { return Ok(Peer::new()) };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::InvalidArgument {
        name: "--peer",
        value: path.display().to_string(),
        reason: format!("not the JSON of bench/peers/attention.py: {e}"),
    })
}

fn ratio(peer: &Peer, table: &str, key: &str, kiln_us: f64) -> String {
    peer.get(table)
        .and_then(|t| t.get(key))
        .map_or("-".into(), |us| format!("{us:.1} / {:.2}x", us / kiln_us))
}

/// A row saying how far a wgmma prefill's output is from the tiled kernel's on the benchmark's
/// own inputs (both against float64 are in the GPU tests, at lengths a CPU reference can reach).
#[allow(clippy::too_many_arguments)]
fn prefill_agreement(
    gpu: &Gpu,
    shape: &AttentionShape,
    batch: &PagedBatch,
    q: &DeviceMemory,
    cache: KvBuffers<'_>,
    len: usize,
    wgmma: AttentionVariant,
) -> Result<String> {
    let mut outputs = Vec::new();
    for variant in [AttentionVariant::PREFILL, wgmma] {
        let out = gpu.alloc(len * Q_HEADS * HEAD_DIM * 2)?;
        out.fill_bytes(0xFF)?; // bf16 NaN
        attention(gpu, shape, batch, q, cache, &out, None, 1, Some(variant))?;
        gpu.synchronize()?;
        outputs.push(out.to_host_bytes()?);
    }
    let value = |b: &[u8]| kiln_core::ops::primitives::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let (mut worst, mut unwritten) = (0f32, 0usize);
    for (a, b) in outputs[0].chunks_exact(2).zip(outputs[1].chunks_exact(2)).take(len * Q_HEADS * HEAD_DIM) {
        let (a, b) = (value(a), value(b));
        if !b.is_finite() {
            unwritten += 1;
        }
        worst = worst.max((a - b).abs());
    }
    Ok(format!(
        "| {len} | {} vs 4x1x64.s1: max abs difference {worst:.2e}, {unwritten} non-finite elements | | | |",
        AttentionConfig { variant: wgmma, splits: 1 }.label()
    ))
}

/// Runs the benchmark and prints the tables.
pub fn run(args: &BenchAttentionArgs) -> Result<()> {
    if !(16..=4096).contains(&args.page_tokens) || !args.page_tokens.is_power_of_two() {
        return Err(Error::InvalidArgument {
            name: "--page-tokens",
            value: args.page_tokens.to_string(),
            reason: "a KV cache page holds a power of two of tokens from 16 to 4096".to_owned(),
        });
    }
    let gpu = Gpu::open(0)?;
    let peer = read_peer(args)?;
    let shape = shape(args.page_tokens);
    let page_tokens = args.page_tokens;
    // Every key's configuration is looked up before anything runs, so that a strict-mode miss
    // fails at once, naming the key.
    let (store, arch, multiprocessors) = (open_store()?, gpu.arch(), gpu.facts().multiprocessors);
    let prefill_task = AttentionTask { shape, phase: AttentionPhase::Prefill { tokens: PREFILL_LENGTHS[0] } };
    let prefill_config = attention_config(&store, &prefill_task, arch, multiprocessors)?;
    let decode_tasks: Vec<AttentionTask> = DECODE_BATCHES
        .iter()
        .map(|&batch| AttentionTask {
            shape,
            phase: AttentionPhase::Decode { batch, context: DECODE_CONTEXTS[0] },
        })
        .collect();
    // Each batch's certified configuration for each context class (short, long).
    let decode_configs = DECODE_BATCHES
        .iter()
        .map(|&batch| {
            let [short, long] = DecodeClass::ALL.map(|class| {
                attention_config(&store, &AttentionTask::decode(shape, batch, class), arch, multiprocessors)
            });
            Ok([short?, long?])
        })
        .collect::<Result<Vec<[AttentionConfig; 2]>>>()?;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    let mut report = String::new();
    let copy = copy_ceiling(&gpu, 1 << 30, 5, 20)?;
    let _ = writeln!(
        report,
        "device: {} ({}), copy ceiling {:.0} GB/s\n\n## Prefill (causal, GQA {Q_HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, page {page_tokens})\n",
        gpu.facts().name,
        gpu.arch(),
        copy.gb_per_s
    );
    let _ = writeln!(
        report,
        "| tokens | variant | time_us | TFLOP/s | torch_us / speedup |\n|---|---|---|---|---|"
    );
    print!("{report}");

    let mut tiled = vec![prefill_config];
    for variant in [AttentionVariant::PREFILL, AttentionVariant::PREFILL_WIDE] {
        if !tiled.iter().any(|c| c.variant == variant && c.splits == 1) {
            tiled.push(AttentionConfig { variant, splits: 1 });
        }
    }
    if args.decode_only.is_empty() {
        let mut prefill = PrefillRun { gpu: &gpu, args, peer: &peer, seed: &mut seed, report: &mut report };
        prefill.table(&tiled, Some(prefill_config), false)?;
    }

    let header = format!("\n## Decode (GQA 32/8, head dim 128, page {page_tokens}; % of the copy ceiling)\n\n\
                  graph_us: the time per launch of launches captured once in a CUDA graph and replayed \
                  (as the engine replays its decode step; GB/s and % copy from it). events_us: CUDA \
                  events around one launch (host launch cost included). torch the same two ways.\n\n\
                  | batch | context | configuration | graph_us | GB/s | % copy | events_us | torch graph_us / speedup | torch events_us / speedup |\n\
                  |---|---|---|---|---|---|---|---|---|");
    println!("{header}");
    let _ = writeln!(report, "{header}");
    let l2 = gpu.facts().l2_cache_bytes as usize;
    // K and V of one position: bf16 rows, or FP8 codes and one fp32 scale a row.
    let token_bytes = if args.kv_fp8 { KV_HEADS * (HEAD_DIM + 4) * 2 } else { KV_HEADS * HEAD_DIM * 2 * 2 };
    for (&batch_size, (task, &by_class)) in
        DECODE_BATCHES.iter().zip(decode_tasks.iter().zip(&decode_configs))
    {
        let default = task.default_config(multiprocessors);
        // The tiled kernel's decode at the default splits, beside the streaming default, and its
        // wide variant (128 keys a tile, one block a multiprocessor) at the splits that fill the
        // multiprocessors once.
        // The certified row is each context's class's, added at each context below (the default
        // and wide rows left out there when they are the certified configuration).
        let mut configs: Vec<(&str, AttentionConfig)> = vec![("default", default)];
        configs.push(("tiled", AttentionConfig { variant: AttentionVariant::DECODE_TILED, ..default }));
        let wide = AttentionConfig {
            variant: AttentionVariant::DECODE_WIDE,
            splits: decode_splits_resident(multiprocessors, 1, batch_size, KV_HEADS),
        };
        configs.push(("wide", wide));
        // Both tiled decode shapes three K/V tiles deep (two in flight while one is computed),
        // at the splits of their two-deep rows: candidates for the defaults, timed beside them.
        configs.push(("deep", AttentionConfig { variant: AttentionVariant::DECODE_DEEP, ..default }));
        configs.push(("wide deep", AttentionConfig { variant: AttentionVariant::DECODE_WIDE_DEEP, ..wide }));
        // The hybrid kernel at the default splits: the streaming path up to HYBRID_STREAM_CHUNK
        // keys a split, the deep tiled one past that.
        configs.push(("hybrid", AttentionConfig { variant: AttentionVariant::DECODE_HYBRID, ..default }));
        // At batch 1 and 8, the streaming default with K/V read under the default L2 policy
        // instead of evict-first (KILN_DECODE_L2_HINT=none), for measurement.
        if batch_size <= 8 && default.variant == AttentionVariant::DECODE {
            configs.push((NO_L2_HINT, default));
        }
        // The streaming kernel one block a multiprocessor, 8 warps (`stream wide`) or six steps in
        // flight a warp (`stream deep`), at the splits that fill the multiprocessors once; at
        // batch 1 and 8 both also at twice those (two waves).
        let stream = decode_stream_splits_for(multiprocessors, batch_size, KV_HEADS);
        configs.push((
            "stream wide",
            AttentionConfig { variant: AttentionVariant::DECODE_STREAM_WIDE, splits: stream },
        ));
        configs.push((
            "stream deep",
            AttentionConfig { variant: AttentionVariant::DECODE_STREAM_DEEP, splits: stream },
        ));
        if batch_size <= 8 && 2 * stream <= 64 {
            configs.push((
                "stream wide, two waves",
                AttentionConfig { variant: AttentionVariant::DECODE_STREAM_WIDE, splits: 2 * stream },
            ));
            configs.push((
                "stream deep, two waves",
                AttentionConfig { variant: AttentionVariant::DECODE_STREAM_DEEP, splits: 2 * stream },
            ));
        }
        for label in &args.decode_configs {
            let config = AttentionConfig::parse(label).ok_or_else(|| Error::InvalidArgument {
                name: "--decode-configs",
                value: label.clone(),
                reason: "names no attention configuration (e.g. hybrid-1x4x16.s16)".to_owned(),
            })?;
            configs.push(("extra", config));
        }
        if !args.decode_batches.is_empty() && !args.decode_batches.contains(&batch_size) {
            continue;
        }
        if !args.decode_only.is_empty() {
            configs.retain(|(tag, config)| {
                let label = config.label();
                tag.starts_with("certified")
                    || args.decode_only.iter().any(|w| tag.contains(w.as_str()) || label.contains(w.as_str()))
            });
        }
        for &context in &DECODE_CONTEXTS {
            if !args.decode_contexts.is_empty() && !args.decode_contexts.contains(&context) {
                continue;
            }
            let case_bytes = batch_size * context * token_bytes;
            let rotations = (2 * l2).div_ceil(case_bytes).clamp(1, 64);
            if case_bytes * rotations > args.max_cache_gib << 30 {
                println!("| {batch_size} | {context} | - | skipped: over --max-cache-gib | | | | | |");
                continue;
            }
            let pages_per_sequence = context.div_ceil(page_tokens);
            let total_pages = pages_per_sequence * batch_size * rotations;
            let rows = total_pages * KV_HEADS * page_tokens;
            let (k, v, scales) = if args.kv_fp8 {
                let (k, v) = (
                    random_fp8(&gpu, rows * HEAD_DIM, &mut seed)?,
                    random_fp8(&gpu, rows * HEAD_DIM, &mut seed)?,
                );
                let scale = |seed: &mut u64| random_scales(&gpu, rows, seed);
                (k, v, Some((scale(&mut seed)?, scale(&mut seed)?)))
            } else {
                let cache_bytes = rows * HEAD_DIM * 2;
                (
                    random_device(&gpu, cache_bytes, &mut seed)?,
                    random_device(&gpu, cache_bytes, &mut seed)?,
                    None,
                )
            };
            let scales = scales.as_ref().map(|(k, v)| KvScales { k, v });
            let cache = KvBuffers { k: &k, v: &v, pages: total_pages, scales };
            let tables: Vec<Vec<u32>> = (0..batch_size * rotations)
                .map(|s| {
                    let first = (s * pages_per_sequence) as u32;
                    (first..first + pages_per_sequence as u32).collect()
                })
                .collect();
            let batches = tables
                .chunks(batch_size)
                .map(|group| {
                    let sequences: Vec<AttentionSequence<'_>> = group
                        .iter()
                        .map(|pages| AttentionSequence { query_tokens: 1, context_tokens: context, pages })
                        .collect();
                    PagedBatch::upload(&gpu, &shape, &sequences, total_pages)
                })
                .collect::<Result<Vec<_>>>()?;
            let q = random_device(&gpu, batch_size * Q_HEADS * HEAD_DIM * 2, &mut seed)?;
            let out = gpu.alloc(batch_size * Q_HEADS * HEAD_DIM * 2)?;
            let key = format!("{batch_size}x{context}");
            let class = DecodeClass::of(context, DECODE_SHORT_MAX);
            let certified = by_class[if class == DecodeClass::Short { 0 } else { 1 }];
            let tag = match (certified == default, class) {
                (true, DecodeClass::Short) => "certified=default short",
                (true, DecodeClass::Long) => "certified=default long",
                (false, DecodeClass::Short) => "certified short",
                (false, DecodeClass::Long) => "certified long",
            };
            let mut rows: Vec<(&str, AttentionConfig)> =
                std::iter::once((tag, certified))
                    .chain(configs.iter().copied().filter(|&(row, config)| {
                        !(config == certified && (row == "default" || row == "wide"))
                    }))
                    .collect();
            if args.kv_fp8 {
                // The tiled wide and three-deep variants at the certified splits, then every
                // other row that reads FP8 pages.
                let at = |variant| AttentionConfig { variant, splits: certified.splits };
                let mut fp8 = vec![
                    ("fp8 wide", at(AttentionVariant::DECODE_WIDE)),
                    ("fp8 deep", at(AttentionVariant::DECODE_DEEP)),
                ];
                let others: Vec<(&str, AttentionConfig)> = rows
                    .iter()
                    .copied()
                    .filter(|&(_, c)| serves_fp8_kv(c.variant) && !fp8.iter().any(|f| f.1 == c))
                    .collect();
                fp8.extend(others);
                rows = fp8;
            }
            for &(tag, config) in &rows {
                let splits = config.splits;
                let scratch = gpu.alloc(scratch_bytes(&shape, batch_size, splits).max(16))?;
                let run = |turn: usize| {
                    let batch = &batches[turn % batches.len()];
                    let variant = Some(config.variant);
                    attention(&gpu, &shape, batch, &q, cache, &out, Some(&scratch), splits, variant)
                };
                let hint = std::env::var_os(DECODE_L2_HINT_ENV);
                if tag == NO_L2_HINT {
                    std::env::set_var(DECODE_L2_HINT_ENV, "none");
                }
                let mut turn = 0;
                let (events_us, _) = time_us(&gpu, 3, args.iterations, || {
                    turn += 1;
                    run(turn)
                })?;
                // Every page set once a replay (each read after the others have pushed it out of
                // L2), with launches for about 2 ms a replay (at most 16 a set, so the host's cost
                // of a replay is spread over many); replays within about a third of a second.
                let wanted = ((2000.0 / events_us).ceil() as usize).clamp(1, 16);
                let launches = batches.len() * wanted.div_ceil(batches.len());
                let replays =
                    ((3e5 / (events_us * launches as f64)) as usize).clamp(3, args.iterations.max(3));
                let us = graph_launch_us(&gpu, launches, replays, run)?;
                match hint {
                    Some(value) => std::env::set_var(DECODE_L2_HINT_ENV, value),
                    None => std::env::remove_var(DECODE_L2_HINT_ENV),
                }
                let bytes = case_bytes + 2 * batch_size * Q_HEADS * HEAD_DIM * 2;
                let gb_per_s = bytes as f64 / us / 1e3;
                let line = format!(
                    "| {batch_size} | {context} | {tag} {} | {us:.1} | {gb_per_s:.0} | {:.1} | {events_us:.1} | {} | {} |",
                    config.label(),
                    100.0 * gb_per_s / copy.gb_per_s,
                    ratio(&peer, "decode_graph", &key, us),
                    ratio(&peer, "decode", &key, events_us),
                );
                println!("{line}");
                let _ = writeln!(report, "{line}");
            }
        }
    }
    // The wgmma prefill kernels last, so that a fault or a hang there cannot cost the tables
    // above (they are printed as they come); a failure is a row, not the end of the run.
    if gpu.arch() == kiln_cuda::Arch(90) && args.decode_only.is_empty() {
        let header = format!(
            "\n## Prefill on wgmma (sm_90; causal, GQA {Q_HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, page {page_tokens})\n\n\
             | tokens | variant | time_us | TFLOP/s | torch_us / speedup |\n|---|---|---|---|---|"
        );
        println!("{header}");
        let _ = writeln!(report, "{header}");
        let wgmma = [AttentionVariant::PREFILL_WGMMA, AttentionVariant::PREFILL_WGMMA_PINGPONG]
            .map(|variant| AttentionConfig { variant, splits: 1 });
        let mut prefill = PrefillRun { gpu: &gpu, args, peer: &peer, seed: &mut seed, report: &mut report };
        if let Err(e) = prefill.table(&wgmma, None, true) {
            let line = format!("| - | wgmma failed: {e} | | | |");
            println!("{line}");
            let _ = writeln!(report, "{line}");
        }
    }
    if let Some(path) = &args.out {
        std::fs::write(path, report).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// The prefill rows of one table: every configuration at every length of [`PREFILL_LENGTHS`].
struct PrefillRun<'a> {
    gpu: &'a Gpu,
    args: &'a BenchAttentionArgs,
    peer: &'a Peer,
    seed: &'a mut u64,
    report: &'a mut String,
}

impl PrefillRun<'_> {
    /// Times `configs` at each length (`certified` tagged), and with `agreement` a row per
    /// configuration saying how far its output is from the tiled kernel's.
    fn table(
        &mut self,
        configs: &[AttentionConfig],
        certified: Option<AttentionConfig>,
        agreement: bool,
    ) -> Result<()> {
        let page_tokens = self.args.page_tokens;
        let (gpu, shape) = (self.gpu, shape(page_tokens));
        for &len in &PREFILL_LENGTHS {
            let pages: Vec<u32> = (0..len.div_ceil(page_tokens) as u32).collect();
            let sequence = [AttentionSequence { query_tokens: len, context_tokens: len, pages: &pages }];
            let batch = PagedBatch::upload(gpu, &shape, &sequence, pages.len())?;
            let cache_bytes = pages.len() * KV_HEADS * page_tokens * HEAD_DIM * 2;
            let q = random_device(gpu, len * Q_HEADS * HEAD_DIM * 2, self.seed)?;
            let (k, v) =
                (random_device(gpu, cache_bytes, self.seed)?, random_device(gpu, cache_bytes, self.seed)?);
            let out = gpu.alloc(len * Q_HEADS * HEAD_DIM * 2)?;
            let cache = KvBuffers { k: &k, v: &v, pages: pages.len(), scales: None };
            let flops = 4.0 * (Q_HEADS * HEAD_DIM) as f64 * (len * (len + 1) / 2) as f64;
            for &config in configs {
                let scratch = gpu.alloc(scratch_bytes(&shape, len, config.splits).max(16))?;
                let (us, _) = time_us(gpu, 3, self.args.iterations, || {
                    let splits = config.splits;
                    attention(
                        gpu,
                        &shape,
                        &batch,
                        &q,
                        cache,
                        &out,
                        Some(&scratch),
                        splits,
                        Some(config.variant),
                    )
                })?;
                let tag = if Some(config) == certified { "certified " } else { "" };
                let line = format!(
                    "| {len} | {tag}{} | {us:.1} | {:.1} | {} |",
                    config.label(),
                    flops / us / 1e6,
                    ratio(self.peer, "prefill", &len.to_string(), us)
                );
                println!("{line}");
                let _ = writeln!(self.report, "{line}");
            }
            if agreement {
                for config in configs {
                    let line = prefill_agreement(gpu, &shape, &batch, &q, cache, len, config.variant)?;
                    println!("{line}");
                    let _ = writeln!(self.report, "{line}");
                }
            }
        }
        Ok(())
    }
}

/// The median time per launch, microseconds, of `launches` calls of `launch(i)` captured once in
/// a CUDA graph and replayed `replays` times between CUDA events, after one replay of warm-up:
/// the GPU's time per launch without the host's launch cost between two launches, as the
/// engine's captured decode step runs them.
fn graph_launch_us(
    gpu: &Gpu,
    launches: usize,
    replays: usize,
    launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let per_launch_us = graph_replay_us(gpu, 0..launches.max(1), replays, launch)?;
    Ok(per_launch_us[(per_launch_us.len() - 1) / 2])
}
