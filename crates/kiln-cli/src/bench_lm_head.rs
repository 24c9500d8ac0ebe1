//! `kiln bench lm-head`: the LM head at 151936 x 4096 bf16 for 1, 2, 4 and 8 rows, as a share of
//! the device-to-device copy ceiling measured in the same run and as a ratio to `torch.matmul`
//! (`bench/peers/lm_head.py`, whose JSON output `--peer` reads).
//!
//! Bytes counted: the weights once (the floor: every row shares one pass over W), h, and the
//! logits written. Timing: CUDA events around batches of launches after a warm-up, the median of
//! the batches. W (1.24 GB) is far larger than L2, so every launch reads it from memory; h and
//! the logits rotate over several buffers. Every variant that serves the row count is timed, and
//! the table shows the default and the best.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::ops::lm_head::LmHead;
use kiln_core::ops::primitives::f32_to_bf16_bits;
use kiln_core::{DType, Error, Result};
use kiln_cuda::cudarc::driver::sys::CUevent_flags;
use kiln_cuda::ops::lm_head::{lm_head, plan, LmHeadBuffers, LmHeadVariant, LM_HEAD_VARIANTS};
use kiln_cuda::runtime::driver_error;
use kiln_cuda::{DeviceMemory, Gpu};

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
    /// Batches timed per case (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub batches: usize,
    /// Launches per batch.
    #[arg(long, default_value_t = 10)]
    pub launches: usize,
    /// Also write the table (markdown) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The median time per launch, microseconds, of batches of `launches` calls of `launch(i)`
/// between CUDA events, after a warm-up of `launches` calls.
pub(crate) fn timed(
    gpu: &Gpu,
    batches: usize,
    launches: usize,
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let ctx = gpu.context();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let launches = launches.max(1);
    for i in 0..launches.max(3) {
        launch(i)?;
    }
    let start = ctx.new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let end = ctx.new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let mut per_launch_us = Vec::with_capacity(batches.max(1));
    let mut counter = 0;
    for _ in 0..batches.max(1) {
        start.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        for _ in 0..launches {
            launch(counter)?;
            counter += 1;
        }
        end.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        end.synchronize().map_err(|e| driver_error("cuEventSynchronize", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
        per_launch_us.push(f64::from(ms) * 1000.0 / launches as f64);
    }
    per_launch_us.sort_by(f64::total_cmp);
    Ok(per_launch_us[per_launch_us.len() / 2])
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
    let us = timed(gpu, batches, 3, |_| dst.copy_from_device(&src))?;
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
    let gpu = Gpu::open(0)?;
    let peer: BTreeMap<String, f64> = read_peer(args.peer.as_deref(), "bench/peers/lm_head.py")?;
    let ceiling_gbs = copy_ceiling_gbs(&gpu, args.batches)?;
    let (vocab, hidden) = (args.vocab, args.hidden);
    let mut table = format!(
        "LM head {vocab} x {hidden} bf16 on {} ({}); copy ceiling {ceiling_gbs:.0} GB/s\n\n\
         | rows | variant | time_us | GB/s | % copy | torch_us | torch / kiln |\n\
         | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n",
        gpu.facts().name,
        gpu.arch()
    );
    let mut values = Values::fresh();
    let w: Vec<u8> =
        (0..vocab * hidden).flat_map(|_| f32_to_bf16_bits(values.next()).to_le_bytes()).collect();
    let w_dev = upload(&gpu, &w)?;
    drop(w);
    for rows in [1usize, 2, 4, 8] {
        let head = LmHead {
            hidden,
            vocab,
            weight: DType::BF16,
            logit_scale: 1.0,
            soft_cap: None,
            stats_block: None,
        };
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
        let bytes = (vocab * hidden * 2 + rows * hidden * 4 + rows * vocab * 4) as f64;
        let default = LmHeadVariant::default_for(rows);
        let mut results: Vec<(LmHeadVariant, f64)> = Vec::new();
        for &variant in LM_HEAD_VARIANTS.iter().chain(std::iter::once(&default)) {
            if plan(&head, rows, variant).is_err() || results.iter().any(|(v, _)| *v == variant) {
                continue;
            }
            let us = timed(&gpu, args.batches, args.launches, |i| {
                let k = i % sets;
                let buffers = LmHeadBuffers {
                    h: &hs[k],
                    weights: &w_dev,
                    row_scale: None,
                    logits: &outs[k],
                    stats: None,
                };
                lm_head(&gpu, &head, rows, buffers, Some(variant))
            })?;
            eprintln!("rows {rows} {}: {us:.1} us", variant.label());
            results.push((variant, us));
        }
        let best = results.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
        let default_time = results.iter().find(|(v, _)| *v == default).map(|r| r.1);
        let torch = peer.get(&rows.to_string()).copied();
        for (label, entry) in [("default", default_time.map(|t| (default, t))), ("best", best)] {
            let Some((variant, us)) = entry else { continue };
            let gbs = bytes / us / 1e3;
            table.push_str(&format!(
                "| {rows} | {label} {} | {us:.1} | {gbs:.0} | {:.1}% | {} | {} |\n",
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
