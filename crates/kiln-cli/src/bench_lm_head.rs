//! `kiln bench lm-head`: the LM head at 151936 x 4096 bf16 for 1, 2, 4 and 8 rows, as a share of
//! the device-to-device copy ceiling measured in the same run and as a ratio to `torch.matmul`
//! (`bench/peers/lm_head.py`, whose JSON output `--peer` reads).
//!
//! Bytes counted: the weights once (the floor: every row shares one pass over W), h, and the
//! logits written. Timing: CUDA events around batches of launches after a warm-up, the median of
//! the batches. W (1.24 GB) is far larger than L2, so every launch reads it from memory; h and
//! the logits rotate over several buffers (and W over copies when it is smaller than twice the
//! L2 cache). Every variant that serves the row count is timed, and the table shows the certified
//! variant (the tuning store's winner for the case's key, else the declared default; with
//! `KILN_TUNING=strict` an uncertified key fails by name before anything is timed), the declared
//! default and the best. With `--model` / `--shapes` the cases are the LM head calls that model
//! makes (its vocabulary, hidden size and output weight type).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::ops::lm_head::row_bytes;
use kiln_core::ops::lm_head::{LmHead, MAX_ROWS};
use kiln_core::{DType, Error, Result};
use kiln_cuda::certify::{
    lm_head_variant, median_launch_us, random_lm_head_weights, rotation_sets, tasks, Family, LmHeadTask, Task,
};
use kiln_cuda::ops::lm_head::{lm_head, plan, LmHeadBuffers, LmHeadVariant, LM_HEAD_VARIANTS};
use kiln_cuda::{DeviceMemory, Gpu};

use crate::bench_norm::tagged_rows;
use crate::tune::{model_shapes, open_store, ShapeArgs};

/// Arguments of `kiln bench lm-head`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchLmHeadArgs {
    /// JSON written by `bench/peers/lm_head.py` ({"ROWS": microseconds}), for the ratio column.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Vocabulary rows of W.
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    pub hidden: usize,
    /// Row counts timed at `--vocab` x `--hidden` (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8])]
    pub rows: Vec<usize>,
    /// Batches timed per case (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub batches: usize,
    /// Launches per batch.
    #[arg(long, default_value_t = 10)]
    pub launches: usize,
    /// Time only these variants (labels as the table prints them, e.g. `16w/4v/64txs4c`;
    /// comma-separated) beside the certified and default ones; all of them when absent.
    #[arg(long, value_delimiter = ',')]
    pub variants: Option<Vec<String>>,
    /// Also write the table (markdown) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The LM head calls of this model (or shape set) instead of rows 1, 2, 4, 8 of `--vocab` x `--hidden`.
    #[command(flatten)]
    pub shapes: ShapeArgs,
}

/// The peer's JSON: a map from a case name to microseconds (or to a map of them).
pub(crate) fn read_peer<T: serde::de::DeserializeOwned + Default>(
    path: Option<&Path>,
    script: &str,
) -> Result<T> {
    let Some(path) = path else { return Ok(T::default()) };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::InvalidArgument {
        name: "--peer",
        value: path.display().to_string(),
        reason: format!("not the JSON of {script}: {e}"),
    })
}

/// The copy ceiling in GB/s (bytes read plus written over the median time of a 1 GiB copy).
pub(crate) fn copy_ceiling_gbs(gpu: &Gpu, batches: usize) -> Result<f64> {
    let bytes = 1 << 30;
    let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    src.fill_bytes(0x3C)?;
    let us = median_launch_us(gpu, batches, 3, |_| dst.copy_from_device(&src))?;
    Ok(2.0 * bytes as f64 / us / 1e3)
}

pub(crate) fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceMemory> {
    let m = gpu.alloc(bytes.len().max(1))?;
    m.copy_from_host(0, bytes)?;
    Ok(m)
}

/// A xorshift stream of values in [-1, 1) (never zeros: they can run faster than real data).
pub(crate) struct Values(pub u64);

impl Values {
    pub(crate) fn fresh() -> Values {
        Values(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1,
        )
    }
    pub(crate) fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Runs the benchmark and prints the table.
pub fn run(args: &BenchLmHeadArgs) -> Result<()> {
    if let Some(&rows) = args.rows.iter().find(|&&r| r == 0 || r > MAX_ROWS) {
        return Err(Error::InvalidArgument {
            name: "--rows",
            value: rows.to_string(),
            reason: format!("the LM head serves 1 to {MAX_ROWS} rows"),
        });
    }
    if let Some(unknown) =
        args.variants.iter().flatten().find(|label| !LM_HEAD_VARIANTS.iter().any(|v| v.label() == **label))
    {
        return Err(Error::InvalidArgument {
            name: "--variants",
            value: unknown.clone(),
            reason: format!(
                "not a variant of the LM head; they are {}",
                LM_HEAD_VARIANTS.iter().map(LmHeadVariant::label).collect::<Vec<_>>().join(", ")
            ),
        });
    }
    let gpu = Gpu::open(0)?;
    let arch = gpu.arch();
    let peer: BTreeMap<String, f64> = read_peer(args.peer.as_deref(), "bench/peers/lm_head.py")?;
    let cases: Vec<LmHeadTask> = if args.shapes.model.is_some() || args.shapes.shapes.is_some() {
        let model = model_shapes(&args.shapes)?;
        tasks(&model, &[Family::LmHead], arch)?
            .into_iter()
            .filter_map(|t| if let Task::LmHead(t) = t { Some(t) } else { None })
            .collect()
    } else {
        let head = LmHead {
            hidden: args.hidden,
            vocab: args.vocab,
            weight: DType::BF16,
            logit_scale: 1.0,
            soft_cap: None,
            stats_block: None,
        };
        args.rows.iter().map(|&rows| LmHeadTask { head, rows }).collect()
    };
    // Every case's configuration is looked up before anything runs, so that a strict-mode miss
    // fails at once, naming the key.
    let store = open_store()?;
    let certified = cases
        .iter()
        .map(|t| lm_head_variant(&store, t, arch, gpu.facts().shared_memory_per_block_optin_bytes))
        .collect::<Result<Vec<LmHeadVariant>>>()?;
    let ceiling_gbs = copy_ceiling_gbs(&gpu, args.batches)?;
    let mut table = format!(
        "LM head on {} ({}); copy ceiling {ceiling_gbs:.0} GB/s\n\n\
         | vocab x hidden | rows | variant | time_us | GB/s | % copy | torch_us | torch / kiln |\n\
         | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n",
        gpu.facts().name,
        gpu.arch()
    );
    let mut values = Values::fresh();
    let mut weights: Option<(LmHead, Vec<DeviceMemory>)> = None;
    for (task, certified) in cases.iter().zip(certified) {
        let (head, rows) = (task.head, task.rows);
        let (vocab, hidden) = (head.vocab, head.hidden);
        if weights.as_ref().is_none_or(|(h, _)| (h.vocab, h.hidden, h.weight) != (vocab, hidden, head.weight))
        {
            drop(weights.take()); // the old copies go back to the pool first
            let w = random_lm_head_weights(values.0, head.weight, vocab, hidden)?;
            values.next();
            let first = upload(&gpu, &w)?;
            drop(w);
            // Copies at other addresses when W alone would stay in L2.
            let mut copies = vec![first];
            for _ in 1..rotation_sets(copies[0].len_bytes(), gpu.facts().l2_cache_bytes).min(8) {
                let copy = gpu.alloc(copies[0].len_bytes())?;
                copy.copy_from_device(&copies[0])?;
                copies.push(copy);
            }
            weights = Some((head, copies));
        }
        let Some((_, w_dev)) = &weights else { continue };
        let sets = 4;
        let hs = (0..sets)
            .map(|_| {
                upload(
                    &gpu,
                    &(0..rows * hidden).flat_map(|_| values.next().to_le_bytes()).collect::<Vec<u8>>(),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let outs = (0..sets).map(|_| gpu.alloc(rows * vocab * 4)).collect::<Result<Vec<_>>>()?;
        let bytes = (vocab * row_bytes(head.weight, hidden)? + rows * hidden * 4 + rows * vocab * 4) as f64;
        let default =
            LmHeadVariant::default_for_call(&head, rows, gpu.facts().shared_memory_per_block_optin_bytes);
        let mut results: Vec<(LmHeadVariant, f64)> = Vec::new();
        let chosen =
            |v: &&LmHeadVariant| args.variants.as_ref().is_none_or(|labels| labels.contains(&v.label()));
        for &variant in [certified, default].iter().chain(LM_HEAD_VARIANTS.iter().filter(chosen)) {
            if plan(&head, rows, variant).is_err() || results.iter().any(|(v, _)| *v == variant) {
                continue;
            }
            let us = median_launch_us(&gpu, args.batches, args.launches, |i| {
                let buffers = LmHeadBuffers {
                    h: &hs[i % sets],
                    weights: &w_dev[i % w_dev.len()],
                    row_scale: None,
                    logits: &outs[i % sets],
                    stats: None,
                };
                lm_head(&gpu, &head, rows, buffers, Some(variant))
            })?;
            eprintln!("rows {rows} {}: {us:.1} us", variant.label());
            results.push((variant, us));
        }
        let best = results.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)).map(|r| r.0);
        let torch = peer.get(&rows.to_string()).copied();
        for (label, (variant, us)) in tagged_rows(&results, certified, default, best) {
            let gbs = bytes / us / 1e3;
            table.push_str(&format!(
                "| {vocab} x {hidden} {} | {rows} | {label} {} | {us:.1} | {gbs:.0} | {:.1}% | {} | {} |\n",
                head.weight.name().to_ascii_lowercase(),
                variant.label(),
                100.0 * gbs / ceiling_gbs,
                torch.map_or("-".to_owned(), |t| format!("{t:.1}")),
                torch.map_or("-".to_owned(), |t| format!("{:.2}x", t / us)),
            ));
        }
    }
    print!("{table}");
    if let Some(path) = &args.out {
        std::fs::write(path, &table).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}
