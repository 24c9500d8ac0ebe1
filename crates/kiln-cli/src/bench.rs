//! `kiln bench`: benchmarks timed with CUDA events, reported against the hardware ceiling and a
//! peer measured in the same run.
//!
//! `kiln bench copy` measures that ceiling: device-to-device copy bandwidth, counting the bytes
//! read plus the bytes written, the median of many copies after a warm-up. With `--peer` it runs
//! `bench/peers/copy_bandwidth.py` (PyTorch's `Tensor.copy_`) on the same GPU and prints the ratio.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kiln_core::{Error, Result};
use kiln_cuda::cudarc::driver::sys::CUevent_flags;
use kiln_cuda::cudarc::driver::LaunchConfig;
use kiln_cuda::runtime::driver_error;
use kiln_cuda::{kernels, DeviceFile, DeviceMemory, Gpu};
use serde::Serialize;

use crate::output;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Device-to-device copy bandwidth: the ceiling of every memory-bound kernel.
    Copy(CopyArgs),
    /// Attention prefill (TFLOP/s) and decode (% of the copy ceiling) against PyTorch.
    Attention(crate::bench_attention::BenchAttentionArgs),
    /// The norm kernels against the copy ceiling and PyTorch.
    ///
    /// Each case (RMSNorm plain, with a residual, with INT8 and NVFP4 outputs; LayerNorm) at each
    /// shape gives a line of the table for its certified, default and fastest variant. Columns:
    /// `time_us` the median time a launch (CUDA graph replays by default); `GB/s` the bytes read
    /// and written over that time; `%copy` that against the device-to-device copy ceiling
    /// measured in the same run; `%size` against a copy of the same bytes; `%floor` the
    /// streaming floor's time over the case's (a kernel that only reads and writes the case's
    /// bytes, timed the same way; its own line gives its percent of the ceiling); `torch_us` and
    /// `speedup` PyTorch's time from `--peer` and its ratio to Kiln's.
    Norm(crate::bench_norm::BenchNormArgs),
    /// The LM head at 151936 x 4096 bf16 against the copy ceiling and `torch.matmul`.
    LmHead(crate::bench_lm_head::BenchLmHeadArgs),
    /// The sampler in each mode against PyTorch's sort-based sampling.
    Sample(crate::bench_sample::BenchSampleArgs),
    /// Generation on the GPU: prompt and decode tokens/s against the memory floor and llama.cpp.
    Generate(crate::bench_generate::BenchGenerateArgs),
}

pub fn run(command: &BenchCommand) -> Result<ExitCode> {
    match command {
        BenchCommand::Copy(args) => copy(args),
        BenchCommand::Attention(args) => crate::bench_attention::run(args).map(|()| ExitCode::SUCCESS),
        BenchCommand::Norm(args) => crate::bench_norm::run(args).map(|()| ExitCode::SUCCESS),
        BenchCommand::LmHead(args) => crate::bench_lm_head::run(args).map(|()| ExitCode::SUCCESS),
        BenchCommand::Sample(args) => crate::bench_sample::run(args).map(|()| ExitCode::SUCCESS),
        BenchCommand::Generate(args) => crate::bench_generate::run(args).map(|()| ExitCode::SUCCESS),
    }
}

/// Arguments of `kiln bench copy`.
#[derive(Debug, clap::Args)]
pub struct CopyArgs {
    /// Bytes per buffer (source and destination each), MiB.
    #[arg(long, default_value_t = 2048)]
    mib: usize,
    /// Timed copies (the median is reported).
    #[arg(long, default_value_t = 100)]
    iterations: usize,
    /// Untimed copies first.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Also run PyTorch's copy (`bench/peers/copy_bandwidth.py`) on the same GPU and print the ratio.
    #[arg(long)]
    peer: bool,
    /// The peer script; by default `bench/peers/copy_bandwidth.py` beside the `kiln` binary or under the
    /// current folder.
    #[arg(long)]
    peer_script: Option<PathBuf>,
    /// The Python that runs the peer.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Write the results here: JSON when the name ends in `.json`, else markdown.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One timed method.
#[derive(Debug, Clone, Serialize)]
pub struct CopyRow {
    pub method: String,
    pub median_us: f64,
    pub min_us: f64,
    /// (read + written) bytes / median time.
    pub gb_per_s: f64,
    /// Of the published peak, when the device file lists this product.
    pub fraction_of_peak: Option<f64>,
}

#[derive(Debug, Serialize)]
struct CopyReport {
    date: String,
    commit: String,
    gpu: String,
    arch: String,
    driver_cuda_version: String,
    buffer_bytes: u64,
    iterations: usize,
    peak_gb_per_s: Option<f64>,
    rows: Vec<CopyRow>,
    /// Kiln's driver copy bandwidth over PyTorch's, when the peer ran.
    kiln_over_peer: Option<f64>,
}

/// The median and minimum time, microseconds, of `iterations` runs of `work` after `warmup`,
/// each timed by CUDA events on the GPU's stream.
pub fn time_us(
    gpu: &Gpu,
    warmup: usize,
    iterations: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..warmup {
        work()?;
    }
    let event = || {
        gpu.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("cuEventCreate", e))
    };
    let (start, end) = (event()?, event()?);
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations.max(1) {
        start.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        work()?;
        end.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        end.synchronize().map_err(|e| driver_error("cuEventSynchronize", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
        times.push(f64::from(ms) * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[(times.len() - 1) / 2], times[0]))
}

/// Device-to-device copy bandwidth (`cuMemcpyDtoDAsync`), GB/s counting read plus written bytes.
pub fn copy_ceiling(gpu: &Gpu, bytes: usize, warmup: usize, iterations: usize) -> Result<CopyRow> {
    let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    src.fill_bytes(0x5A)?;
    let (median_us, min_us) = time_us(gpu, warmup, iterations, || dst.copy_from_device(&src))?;
    Ok(row(gpu, "driver copy (cuMemcpyDtoDAsync)", bytes, median_us, min_us))
}

fn row(gpu: &Gpu, method: &str, bytes: usize, median_us: f64, min_us: f64) -> CopyRow {
    let gb_per_s = 2.0 * bytes as f64 / (median_us * 1e3);
    let peak = peak_gb_per_s(gpu);
    CopyRow {
        method: method.into(),
        median_us,
        min_us,
        gb_per_s,
        fraction_of_peak: peak.map(|p| gb_per_s / p),
    }
}

fn peak_gb_per_s(gpu: &Gpu) -> Option<f64> {
    let facts = gpu.facts();
    DeviceFile::for_arch(facts.arch)
        .and_then(|f| f.peak_memory_bandwidth_bytes_per_s(&facts.name))
        .ok()
        .map(|b| b / 1e9)
}

/// Kiln's streaming copy kernel (16-byte accesses), for comparison with the driver's copy.
fn kernel_copy(
    gpu: &Gpu,
    src: &DeviceMemory,
    dst: &DeviceMemory,
    warmup: usize,
    iterations: usize,
) -> Result<CopyRow> {
    let function = gpu.function(&kernels::COPY, "copy_vec16", &[])?;
    let n16 = (src.len_bytes() / 16) as u64;
    let blocks = gpu.facts().multiprocessors * 8;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
    let (median_us, min_us) = time_us(gpu, warmup, iterations, || {
        let mut launch = gpu.launch_builder(&function);
        launch.arg(&src_ptr).arg(&dst_ptr).arg(&n16);
        // SAFETY: copy_vec16(const vec16* src, vec16* dst, u64 n16) touches n16 16-byte words of
        // each buffer, and both hold at least that many (pool blocks are 256-byte aligned).
        unsafe { launch.launch(config) }.map(|_| ()).map_err(|e| driver_error("cuLaunchKernel", e))
    })?;
    Ok(row(gpu, "kiln kernel copy_vec16", (n16 * 16) as usize, median_us, min_us))
}

fn copy(args: &CopyArgs) -> Result<ExitCode> {
    let bytes = args.mib.checked_mul(1 << 20).filter(|&b| b > 0).ok_or_else(|| Error::InvalidArgument {
        name: "--mib",
        value: args.mib.to_string(),
        reason: "must be positive and fit in memory".into(),
    })?;
    let gpu = Gpu::open(args.gpu)?;
    let facts = gpu.facts().clone();
    tracing::info!(
        "copy bandwidth on {} ({}), {} per buffer",
        facts.name,
        facts.arch,
        output::bytes(bytes as u64)
    );
    let mut rows = vec![copy_ceiling(&gpu, bytes, args.warmup, args.iterations)?];
    {
        let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
        src.fill_bytes(0x5A)?;
        rows.push(kernel_copy(&gpu, &src, &dst, args.warmup, args.iterations)?);
    }
    gpu.pool().release_pooled()?;
    let mut kiln_over_peer = None;
    if args.peer {
        let peer = run_peer(args, bytes)?;
        kiln_over_peer = Some(rows[0].gb_per_s / peer.gb_per_s);
        rows.push(CopyRow { fraction_of_peak: peak_gb_per_s(&gpu).map(|p| peer.gb_per_s / p), ..peer });
    }
    let report = CopyReport {
        date: output::today(),
        commit: output::commit(),
        gpu: facts.name.clone(),
        arch: facts.arch.to_string(),
        driver_cuda_version: facts.driver_cuda_version.clone(),
        buffer_bytes: bytes as u64,
        iterations: args.iterations,
        peak_gb_per_s: peak_gb_per_s(&gpu),
        rows,
        kiln_over_peer,
    };
    let table = markdown(&report);
    output::print(&table);
    if let Some(path) = &args.out {
        let text = if path.extension().is_some_and(|e| e == "json") {
            serde_json::to_string_pretty(&report).map_err(|e| Error::InvalidArgument {
                name: "--out",
                value: path.display().to_string(),
                reason: e.to_string(),
            })? + "\n"
        } else {
            table
        };
        std::fs::write(path, text).map_err(|e| Error::io(path, e))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn markdown(report: &CopyReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "# Device-to-device copy bandwidth\n");
    let _ = writeln!(
        s,
        "{} · {} ({}) · driver CUDA {} · commit {} · {} MiB per buffer, median of {} copies, \
         bytes counted = read + written\n",
        report.date,
        report.gpu,
        report.arch,
        report.driver_cuda_version,
        report.commit,
        report.buffer_bytes >> 20,
        report.iterations
    );
    let _ = writeln!(s, "| method | median µs | min µs | GB/s | of peak |");
    let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: |");
    for r in &report.rows {
        let peak = r.fraction_of_peak.map(|f| format!("{:.1}%", f * 100.0)).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "| {} | {:.1} | {:.1} | {:.1} | {peak} |",
            r.method, r.median_us, r.min_us, r.gb_per_s
        );
    }
    if let Some(p) = report.peak_gb_per_s {
        let _ = writeln!(s, "\nPublished peak: {p:.0} GB/s.");
    }
    if let Some(ratio) = report.kiln_over_peer {
        let _ = writeln!(s, "Kiln / PyTorch (driver copy vs `Tensor.copy_`): {ratio:.3}");
    }
    s
}

/// What `copy_bandwidth.py --json` prints.
#[derive(Debug, serde::Deserialize)]
struct PeerOutput {
    torch_version: String,
    median_us: f64,
    min_us: f64,
    gb_per_s: f64,
}

fn run_peer(args: &CopyArgs, bytes: usize) -> Result<CopyRow> {
    let script = match &args.peer_script {
        Some(path) => path.clone(),
        None => find_peer_script("copy_bandwidth.py")?,
    };
    tracing::info!("running the peer: {} {}", args.python, script.display());
    let output = std::process::Command::new(&args.python)
        .arg(&script)
        .args(["--bytes", &bytes.to_string()])
        .args(["--iterations", &args.iterations.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--device", &format!("cuda:{}", args.gpu)])
        .output()
        .map_err(|e| Error::io(&script, e))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(Error::NotServed {
            op: "bench copy --peer",
            reason: format!(
                "{} {} failed ({}):\n{}",
                args.python,
                script.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    let peer: PeerOutput = serde_json::from_str(stdout.trim()).map_err(|e| Error::NotServed {
        op: "bench copy --peer",
        reason: format!("{} printed no JSON result ({e}): {stdout}", script.display()),
    })?;
    Ok(CopyRow {
        method: format!("PyTorch {} Tensor.copy_", peer.torch_version),
        median_us: peer.median_us,
        min_us: peer.min_us,
        gb_per_s: peer.gb_per_s,
        fraction_of_peak: None,
    })
}

/// `bench/peers/NAME` beside the binary (the GPU bundle's layout), else under the current folder.
pub fn find_peer_script(name: &str) -> Result<PathBuf> {
    let relative = Path::new("bench/peers").join(name);
    let beside_binary = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join(&relative)));
    beside_binary.into_iter().chain([relative.clone()]).find(|p| p.is_file()).ok_or_else(|| {
        Error::InvalidArgument {
            name: "--peer-script",
            value: relative.display().to_string(),
            reason: "not found beside the kiln binary nor under the current folder; pass --peer-script"
                .into(),
        }
    })
}
