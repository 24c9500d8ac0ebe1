//! `kiln bench norm`: the norm kernel's achieved bandwidth against the device-to-device copy
//! ceiling measured in the same run, and against PyTorch (`bench/peers/norm.py`, whose JSON
//! output `--peer` reads).
//!
//! Timing: by default each batch of launches is captured once into a CUDA graph and the graph is
//! replayed between CUDA events (`kiln_cuda::certify::median_graph_launch_us`), as Kiln's engine
//! replays a decode step: the host's cost per launch (several microseconds, more than a 1 x 4096
//! norm takes on the GPU) stays out of the figures. `--plain-launches` times the launches
//! themselves between events instead (`median_launch_us`), the host's cost included wherever it
//! exceeds the kernel's. The header line says which. Warm-up first, the median of the batches;
//! the launches of a batch read different input sets, rotated so that the sets together exceed
//! the L2 cache twice over (a graph holds `--launches` of them). Bytes counted: every input read
//! once (x, residual, weight), every output written once (out, scales, the updated residual).
//! Every variant of `NORM_VARIANTS` that serves a case is timed (each on its own line on stderr);
//! the table shows the certified variant (the tuning store's winner for the case's key, else the
//! declared default; with `KILN_TUNING=strict` an uncertified key fails by name before anything is
//! timed), the declared default and the best. A line before the table names each certificate of
//! the cases that was made for other kernel source than this build's (`kiln tune show` marks it
//! `stale`): its winner is still the certified variant, but its timings are of other code.
//!
//! `%size`: the case's GB/s against a device-to-device copy of the same bytes (half the bytes
//! moved read, half written), timed the same way (graph replays of copies over rotated buffers):
//! at 2048 x 4096 the fixed cost of a launch (its first reads' latency, its last writes' drain) is
//! a large part of the time, and the copy pays it too.
//!
//! `%floor`: the case's time against the streaming floor of its bytes: the fastest of twelve
//! grids (24 where the case writes fewer bytes than it reads: the stores in the first chunks, or
//! spread over all) of a kernel that only reads the bytes the case reads and writes the bytes it
//! writes (`stream_floor`, 16-byte accesses, the same launch mode and rotation): what a kernel of that
//! traffic reaches with nothing to compute. A line before each case gives the floor's time and
//! its percent of the copy ceiling. It is measured, not proven: a norm above 100% moves its bytes
//! faster than every grid of the streaming kernel did.
//!
//! The cases are the table below, or with `--model` / `--shapes` the norm calls that model makes
//! (the keys `kiln tune certify` certifies for it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_core::ops::norm::{LayerNorm, NormOutput, NormSpec, RmsNorm, WeightMode};
use kiln_core::ops::primitives::f32_to_bf16_bits;
use kiln_core::ops::quantize::Quantizer;
use kiln_core::tuning::store::load_certificates;
use kiln_core::{DType, Error, Result};
use kiln_cuda::certify::{
    median_graph_launch_us, median_launch_us, norm_label, norm_variant, rotation_sets, tasks, Family,
    NormTask, Task,
};
use kiln_cuda::cudarc::driver::LaunchConfig;
use kiln_cuda::ops::norm::{norm, NormBuffers, NormCall, NormVariant, NORM_VARIANTS};
use kiln_cuda::runtime::driver_error;
use kiln_cuda::{kernels, DeviceMemory, Gpu};

use crate::bench_lm_head::copy_ceiling_gbs;
use crate::tune::{model_shapes, open_store, staleness, store_dirs, ShapeArgs};

/// Arguments of `kiln bench norm`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchNormArgs {
    /// JSON written by `bench/peers/norm.py` (case -> shape -> microseconds), for the ratio column.
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Batches timed per case (the median is reported).
    #[arg(long, default_value_t = 30)]
    pub batches: usize,
    /// Launches per batch.
    #[arg(long, default_value_t = 20)]
    pub launches: usize,
    /// Time only the certified and the declared default variant of each case.
    #[arg(long)]
    pub default_only: bool,
    /// Time only the certified and the declared default variant and these (labels such as
    /// `8w1r+s3`, comma-separated; `staged` for every staged variant, `lanes` for every variant with
    /// one lane a quantization block, `+b`, `ahead` for every variant that loads the weight a unit
    /// ahead, `+w`; `total` for every variant whose row's first warp alone finishes the total,
    /// `+t`), each with a row of its
    /// own in the table (tagged `listed`).
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Time plain launches between CUDA events (the host's launch cost included) instead of
    /// replays of a CUDA graph holding a batch's launches.
    #[arg(long)]
    pub plain_launches: bool,
    /// Only these built-in cases (comma-separated: rms_norm, rms_norm_residual, rms_norm_int8,
    /// rms_norm_nvfp4, layer_norm); all of them when absent.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["model", "shapes"])]
    pub cases: Vec<String>,
    /// Only these built-in shapes (comma-separated `ROWSxHIDDEN`: 1x4096, 2048x4096, 8192x8192);
    /// all of them when absent.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["model", "shapes"])]
    pub sizes: Vec<String>,
    /// The norm calls of this model (or shape set) instead of the built-in cases.
    #[command(flatten)]
    pub shapes: ShapeArgs,
}

/// The benchmarked cases: name, spec, whether the residual is added.
fn cases() -> Vec<(&'static str, NormSpec, bool)> {
    let rms = RmsNorm::llama(1e-5, DType::BF16);
    let layer = LayerNorm {
        eps: 1e-5,
        weight: WeightMode::Plain,
        bias: true,
        groups: 1,
        out: NormOutput::Float(DType::BF16),
    };
    vec![
        ("rms_norm", rms.into(), false),
        ("rms_norm_residual", rms.into(), true),
        ("rms_norm_int8", RmsNorm { out: NormOutput::Quantized(Quantizer::Int8), ..rms }.into(), false),
        (
            "rms_norm_nvfp4",
            RmsNorm { out: NormOutput::Quantized(Quantizer::Nvfp4 { global_scale: 448.0 }), ..rms }.into(),
            false,
        ),
        ("layer_norm", layer.into(), false),
    ]
}

/// The shapes of the table (rows, hidden), bf16.
pub const SHAPES: &[(usize, usize)] = &[(1, 4096), (2048, 4096), (8192, 8192)];

/// Random bf16 bytes in [-2, 2) (never zeros: they can run faster than real data).
fn random_bf16(bytes: usize, seed: &mut u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let v = ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
        out.extend_from_slice(&f32_to_bf16_bits(v).to_le_bytes());
    }
    out.truncate(bytes);
    out
}

fn device(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceMemory> {
    let m = gpu.alloc(bytes.len().max(1))?;
    m.copy_from_host(0, bytes)?;
    Ok(m)
}

/// The built-in cases that `--cases` and `--sizes` select (all of them when both are empty);
/// an unknown name or shape is a named error.
fn builtin_cases(args: &BenchNormArgs) -> Result<Vec<(String, NormTask)>> {
    let names: Vec<&str> = cases().iter().map(|c| c.0).collect();
    if let Some(unknown) = args.cases.iter().find(|c| !names.contains(&c.as_str())) {
        return Err(Error::InvalidArgument {
            name: "--cases",
            value: unknown.clone(),
            reason: format!("not a case of the benchmark ({})", names.join(", ")),
        });
    }
    let sizes: Vec<String> = SHAPES.iter().map(|(r, h)| format!("{r}x{h}")).collect();
    if let Some(unknown) = args.sizes.iter().find(|s| !sizes.contains(s)) {
        return Err(Error::InvalidArgument {
            name: "--sizes",
            value: unknown.clone(),
            reason: format!("not a shape of the benchmark ({})", sizes.join(", ")),
        });
    }
    Ok(SHAPES
        .iter()
        .filter(|(rows, hidden)| args.sizes.is_empty() || args.sizes.contains(&format!("{rows}x{hidden}")))
        .flat_map(|&(rows, hidden)| {
            cases()
                .into_iter()
                .filter(|(name, _, _)| args.cases.is_empty() || args.cases.iter().any(|c| c == name))
                .map(move |(name, spec, residual)| {
                    let call = NormCall { spec, rows, hidden, x_type: DType::BF16, weight_type: DType::BF16 };
                    (name.to_owned(), NormTask { call, residual })
                })
        })
        .collect())
}

/// Runs the benchmark and prints the table.
pub fn run(args: &BenchNormArgs) -> Result<()> {
    // The built-in cases (`--cases`, `--sizes`) are checked before the GPU is touched.
    let builtin = if args.shapes.model.is_some() || args.shapes.shapes.is_some() {
        None
    } else {
        Some(builtin_cases(args)?)
    };
    // The arguments first: a wrong label is named without a GPU.
    for l in &args.variants {
        if !["staged", "lanes", "ahead", "total"].contains(&l.as_str())
            && !NORM_VARIANTS.iter().any(|v| label(*v) == *l)
        {
            return Err(Error::InvalidArgument {
                name: "--variants",
                value: l.clone(),
                reason: "not the label of a listed norm variant (nor `staged`, `lanes`, `ahead` or `total`)"
                    .into(),
            });
        }
    }
    let gpu = Gpu::open(0)?;
    let peer: BTreeMap<String, BTreeMap<String, f64>> = match &args.peer {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
            serde_json::from_str(&text).map_err(|e| Error::InvalidArgument {
                name: "--peer",
                value: path.display().to_string(),
                reason: format!("not the JSON of bench/peers/norm.py: {e}"),
            })?
        }
        None => BTreeMap::new(),
    };
    let l2 = gpu.facts().l2_cache_bytes;

    // The copy ceiling: a large device-to-device copy, bytes read plus bytes written.
    let ceiling_gbs = copy_ceiling_gbs(&gpu, args.batches)?;
    println!("device: {} ({}), copy ceiling {:.0} GB/s", gpu.facts().name, gpu.arch(), ceiling_gbs);
    println!(
        "timing: {}",
        if args.plain_launches {
            "plain launches between CUDA events (host launch cost included)"
        } else {
            "CUDA graph replays of each batch of launches between CUDA events (--plain-launches: launches)"
        }
    );
    println!(
        "{:<20} {:>12} {:<32} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9}",
        "case", "shape", "variant", "time_us", "GB/s", "%copy", "%size", "%floor", "torch_us", "speedup"
    );
    // Same-size copies, by bytes moved (graph replays, buffers rotated past the L2 cache).
    let mut same_size: BTreeMap<usize, f64> = BTreeMap::new();
    // Streaming floors, by bytes read and written.
    let mut floors: BTreeMap<(usize, usize), f64> = BTreeMap::new();

    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    let arch = gpu.arch();
    let cases: Vec<(String, NormTask)> = match builtin {
        Some(cases) => cases,
        None => {
            let model = model_shapes(&args.shapes)?;
            let mut cases = Vec::new();
            for task in tasks(&model, &[Family::Norm], arch)? {
                if let Task::Norm(t) = task {
                    cases.push((t.key(arch)?.shape_class, t));
                }
            }
            cases
        }
    };
    // Every case's configuration is looked up before anything runs, so that a strict-mode miss
    // fails at once, naming the key.
    let store = open_store()?;
    let certified = cases
        .iter()
        .map(|(_, task)| norm_variant(&store, task, arch))
        .collect::<Result<Vec<NormVariant>>>()?;
    // A certificate of older kernel source still decides the certified variant: say so.
    let keys = cases.iter().map(|(_, task)| task.key(arch)).collect::<Result<Vec<_>>>()?;
    for c in load_certificates(&store_dirs()?)?.into_iter().filter(|c| keys.contains(&c.key)) {
        if let Some(stale) = staleness(&c) {
            println!("certificate {} (winner {}): {stale}", c.key, c.winner);
        }
    }
    for ((name, task), certified) in cases.iter().zip(certified) {
        let name = name.as_str();
        let (call, residual) = (task.call, task.residual);
        let (rows, hidden, spec) = (call.rows, call.hidden, call.spec);
        let (x_bytes, w_bytes, out_bytes, scale_bytes) = call.buffer_bytes()?;
        let set_bytes = x_bytes * if residual { 3 } else { 1 } + out_bytes + scale_bytes;
        let sets = input_sets(set_bytes, l2);
        let xs =
            (0..sets).map(|_| device(&gpu, &random_bf16(x_bytes, &mut seed))).collect::<Result<Vec<_>>>()?;
        let residuals = if residual {
            (0..sets).map(|_| device(&gpu, &random_bf16(x_bytes, &mut seed))).collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let outs = (0..sets).map(|_| gpu.alloc(out_bytes)).collect::<Result<Vec<_>>>()?;
        let scales = (0..sets).map(|_| gpu.alloc(scale_bytes.max(1))).collect::<Result<Vec<_>>>()?;
        let weight = device(&gpu, &random_bf16(w_bytes, &mut seed))?;
        let bias = device(&gpu, &random_bf16(w_bytes, &mut seed))?;
        let moved = x_bytes
            + w_bytes * if spec.bias { 2 } else { 1 }
            + out_bytes
            + scale_bytes
            + if residual { 2 * x_bytes } else { 0 };
        let shape = format!("{rows}x{hidden}");
        let half = (moved / 2).next_multiple_of(16);
        let size_gbs = match same_size.get(&half) {
            Some(&gbs) => gbs,
            None => {
                let copies = input_sets(2 * half, l2);
                let pairs = (0..copies)
                    .map(|_| Ok((gpu.alloc(half)?, gpu.alloc(half)?)))
                    .collect::<Result<Vec<(DeviceMemory, DeviceMemory)>>>()?;
                let us = time_launches(&gpu, args, &mut |i: usize| {
                    let (src, dst) = &pairs[i % copies];
                    dst.copy_from_device(src)
                })?;
                let gbs = 2.0 * half as f64 / us / 1e3;
                println!(
                    "same-size copy {shape} ({} + {} bytes): {us:.2} us, {gbs:.0} GB/s, {:.1}% of the ceiling",
                    half,
                    half,
                    100.0 * gbs / ceiling_gbs
                );
                same_size.insert(half, gbs);
                gbs
            }
        };
        let read = x_bytes + w_bytes * if spec.bias { 2 } else { 1 } + if residual { x_bytes } else { 0 };
        let written = out_bytes + scale_bytes + if residual { x_bytes } else { 0 };
        let floor = match floors.get(&(read, written)) {
            Some(&us) => us,
            None => {
                let us = stream_floor_us(&gpu, read, written, args)?;
                println!(
                    "streaming floor {shape} ({read} bytes read, {written} written): {us:.2} us, {:.1}% of the ceiling",
                    100.0 * moved as f64 / us / 1e3 / ceiling_gbs
                );
                floors.insert((read, written), us);
                us
            }
        };
        let default = NormVariant::default_for(&call);
        let mut candidates: Vec<NormVariant> = vec![certified];
        let listed: Vec<NormVariant> = NORM_VARIANTS
            .iter()
            .copied()
            .filter(|v| {
                args.variants.iter().any(|l| {
                    *l == label(*v)
                        || (l == "staged" && v.stages > 0)
                        || (l == "lanes" && v.block_lane)
                        || (l == "ahead" && v.weight_ahead)
                        || (l == "total" && v.row_total)
                })
            })
            .collect();
        let others: Vec<NormVariant> = if args.default_only {
            vec![default]
        } else if !args.variants.is_empty() {
            std::iter::once(default).chain(listed.iter().copied()).collect()
        } else {
            std::iter::once(default).chain(NORM_VARIANTS.iter().copied()).collect()
        };
        for v in others {
            if !candidates.contains(&v) && call.validate(v).is_ok() {
                candidates.push(v);
            }
        }
        let mut results: Vec<(NormVariant, f64)> = Vec::with_capacity(candidates.len());
        for variant in candidates {
            let us = time_launches(&gpu, args, &mut |i: usize| {
                let k = i % sets;
                let buffers = NormBuffers {
                    x: &xs[k],
                    residual: residuals.get(k),
                    weight: Some(&weight),
                    bias: spec.bias.then_some(&bias),
                    gate: None,
                    out: &outs[k],
                    scales: (scale_bytes > 0).then_some(&scales[k]),
                };
                norm(&gpu, &call, buffers, Some(variant))
            })?;
            eprintln!(
                "{name} {shape} {}: {us:.2} us, {:.1}% copy",
                label(variant),
                100.0 * moved as f64 / us / 1e3 / ceiling_gbs
            );
            results.push((variant, us));
        }
        let best = results.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1)).map(|r| r.0);
        let torch = peer.get(name).and_then(|m| m.get(&shape)).copied();
        let mut rows_to_print = tagged_rows(&results, certified, default, best);
        for &(v, us) in results.iter().filter(|(v, _)| listed.contains(v)) {
            if !rows_to_print.iter().any(|(_, (p, _))| *p == v) {
                rows_to_print.push(("listed".to_owned(), (v, us)));
            }
        }
        for (which, (variant, us)) in rows_to_print {
            let gbs = moved as f64 / us / 1e3;
            println!(
                "{:<20} {:>12} {:<32} {:>10.2} {:>9.0} {:>8.1}% {:>8.1}% {:>8.1}% {:>10} {:>9}",
                name,
                shape,
                format!("{which} {}", label(variant)),
                us,
                gbs,
                100.0 * gbs / ceiling_gbs,
                100.0 * gbs / size_gbs,
                100.0 * floor / us,
                torch.map_or("-".to_owned(), |t| format!("{t:.2}")),
                torch.map_or("-".to_owned(), |t| format!("{:.2}x", t / us)),
            );
        }
    }
    Ok(())
}

/// The median time per launch of `launch(i)`, microseconds: graph replays of each batch, or plain
/// launches with `--plain-launches` (`median_graph_launch_us` / `median_launch_us`).
fn time_launches(
    gpu: &Gpu,
    args: &BenchNormArgs,
    launch: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<f64> {
    if args.plain_launches {
        median_launch_us(gpu, args.batches, args.launches, launch)
    } else {
        median_graph_launch_us(gpu, args.batches, args.launches, launch)
    }
}

/// How many sets of `set_bytes` each timing rotates over: together past twice the L2 cache
/// ([`rotation_sets`]), at least 2 and at most 64 (a graph's launches cycle through them).
fn input_sets(set_bytes: usize, l2: u64) -> usize {
    rotation_sets(set_bytes, l2).clamp(2, 64)
}

/// The streaming floor of a case that reads `read` bytes and writes `written`: `stream_floor`
/// (kiln-cuda's copy.cu) over buffer sets rotated past twice the L2 cache, timed like the norm,
/// the fastest of its grids: 4 or 8 words a thread in flight (`UNROLL`), each on blocks of 64,
/// 128 or 256 threads covering the words in one pass, and on 4, 8 or 16 blocks of 256 threads a
/// multiprocessor looping over them; with fewer bytes written than read, each of those with the
/// stores in the first chunks and spread over every chunk (`SPREAD`); microseconds a launch.
fn stream_floor_us(gpu: &Gpu, read: usize, written: usize, args: &BenchNormArgs) -> Result<f64> {
    let (read16, write16) = (read.div_ceil(16) as u64, written.div_ceil(16) as u64);
    let sets = input_sets(read + written, gpu.facts().l2_cache_bytes);
    let buffers = (0..sets)
        .map(|_| Ok((gpu.alloc(read16 as usize * 16)?, gpu.alloc(write16 as usize * 16)?)))
        .collect::<Result<Vec<(DeviceMemory, DeviceMemory)>>>()?;
    for (src, _) in &buffers {
        // Non-zero words: the floor moves data like the norm's, not a page of zeros.
        src.fill_bytes(0x3c)?;
    }
    let sms = gpu.facts().multiprocessors;
    let words = read16.max(write16);
    // The value stream_floor expects: its stores then carry the loaded words unchanged.
    let never = 0x9e37_79b9_u32;
    let mut best = f64::INFINITY;
    // With fewer words written than read, the stores either come from the first chunks or are
    // spread over all of them (SPREAD), each layout timed.
    let spreads: &[&str] = if write16 < read16 { &["0", "1"] } else { &["0"] };
    let layouts = spreads.iter().flat_map(|&spread| [(4u64, "4", spread), (8, "8", spread)]);
    for (unroll, unroll_define, spread) in layouts {
        let defines = [("UNROLL", unroll_define), ("SPREAD", spread)];
        let function = gpu.function(&kernels::COPY, "stream_floor", &defines)?;
        let one_pass =
            [64u32, 128, 256].map(|threads| (threads, words.div_ceil(threads as u64 * unroll).max(1) as u32));
        let looping = [4, 8, 16].map(|per_sm| (256u32, sms * per_sm));
        for (threads, blocks) in one_pass.into_iter().chain(looping) {
            let config =
                LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
            let us = time_launches(gpu, args, &mut |i: usize| {
                let (src, dst) = &buffers[i % sets];
                let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
                let mut launch = gpu.launch_builder(&function);
                launch.arg(&src_ptr).arg(&read16).arg(&dst_ptr).arg(&write16).arg(&never);
                // SAFETY: stream_floor(const vec16* src, u64 read16, vec16* dst, u64 write16, u32)
                // reads read16 16-byte words of src and writes at most write16 of dst, and the
                // buffers hold that many; they outlive the timing, which synchronizes.
                unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernelEx", e))
            })?;
            best = best.min(us);
        }
    }
    Ok(best)
}

/// A variant as `4w1r` (warps per row, rows per block), `+e` when it loads the weight early.
fn label(v: NormVariant) -> String {
    norm_label(v)
}

/// The certified, default and best variants' rows, each variant once, tagged with every role it
/// has (`certified=default`, `best`).
pub(crate) fn tagged_rows<V: PartialEq + Copy>(
    results: &[(V, f64)],
    certified: V,
    default: V,
    best: Option<V>,
) -> Vec<(String, (V, f64))> {
    let mut rows: Vec<(String, (V, f64))> = Vec::new();
    for (role, variant) in [("certified", Some(certified)), ("default", Some(default)), ("best", best)] {
        let Some(variant) = variant else { continue };
        let Some(&result) = results.iter().find(|(v, _)| *v == variant) else { continue };
        match rows.iter_mut().find(|(_, (v, _))| *v == variant) {
            Some((tags, _)) => {
                tags.push('=');
                tags.push_str(role);
            }
            None => rows.push((role.to_owned(), result)),
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_variant_is_printed_once_with_all_its_roles() {
        let results = [(1, 5.0), (2, 4.0), (3, 3.0)];
        let tags =
            |rows: Vec<(String, (i32, f64))>| rows.into_iter().map(|(t, (v, _))| (t, v)).collect::<Vec<_>>();
        assert_eq!(
            tags(tagged_rows(&results, 3, 1, Some(3))),
            [("certified=best".to_owned(), 3), ("default".to_owned(), 1)]
        );
        assert_eq!(
            tags(tagged_rows(&results, 2, 2, Some(3))),
            [("certified=default".to_owned(), 2), ("best".to_owned(), 3)]
        );
        assert_eq!(tags(tagged_rows(&results, 1, 1, Some(1))), [("certified=default=best".to_owned(), 1)]);
    }
}
