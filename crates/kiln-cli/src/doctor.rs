//! `kiln doctor`: what Kiln found of CUDA here, and a live check that compiles and runs a kernel.
//!
//! Exit 0 when CUDA works end to end; exit 1 with each problem and its fix named.

use std::process::ExitCode;
use std::time::Instant;

use kiln_core::Result;
use kiln_cuda::compile::CacheSummary;
use kiln_cuda::cudarc::driver::LaunchConfig;
use kiln_cuda::runtime::driver_error;
use kiln_cuda::{kernels, CompileOptions, DeviceFacts, DeviceFile, Gpu, KernelCache, Probe};
use serde::Serialize;

use crate::output::{self, bytes};

/// Arguments of `kiln doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Print the report as JSON (for scripts).
    #[arg(long)]
    json: bool,
}

/// One GPU as the report shows it.
#[derive(Debug, Serialize)]
struct GpuReport {
    #[serde(flatten)]
    facts: DeviceFacts,
    /// From the device file; `None` when the product is not listed.
    peak_memory_bandwidth_gb_per_s: Option<f64>,
    /// Kernels launched to start as the one before them finishes (sm_90 and later, unless
    /// `KILN_OVERLAP_LAUNCHES=0`).
    overlapped_launches: bool,
}

/// The live check on GPU 0: compile, load from the cache, run, verify.
#[derive(Debug, Default, Serialize)]
struct LiveCheck {
    ok: bool,
    compile_ms: Option<f64>,
    cache_hit_ms: Option<f64>,
    run_ms: Option<f64>,
    registers: Option<u32>,
    error: Option<String>,
}

/// A problem and what to do about it.
#[derive(Debug, Serialize)]
struct Problem {
    problem: String,
    fix: String,
}

#[derive(Debug, Serialize)]
struct Report {
    kiln_version: &'static str,
    ok: bool,
    probe: Probe,
    /// Whether libcublas loads: the GPU engine's prefill matrix products need it (without it, long
    /// steps run Kiln's matrix-vector kernels 8 tokens at a time).
    cublas: bool,
    gpus: Vec<GpuReport>,
    kernel_cache: Option<CacheSummary>,
    live_check: Option<LiveCheck>,
    problems: Vec<Problem>,
}

pub fn run(args: &DoctorArgs) -> Result<ExitCode> {
    let report = examine();
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| kiln_core::Error::InvalidArgument {
            name: "report",
            value: "doctor".into(),
            reason: e.to_string(),
        })?;
        output::print(&format!("{text}\n"));
    } else {
        output::print(&render(&report));
    }
    Ok(if report.ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn examine() -> Report {
    let probe = kiln_cuda::probe().clone();
    let mut problems = Vec::new();
    for library in [&probe.libcuda, &probe.libnvrtc] {
        if !library.found {
            problems.push(Problem {
                problem: format!(
                    "{} was not found ({})",
                    library.library,
                    library.detail.clone().unwrap_or_default()
                ),
                fix: library.fix.unwrap_or_default().to_owned(),
            });
        }
    }
    if let Some(error) = &probe.device_error {
        problems.push(Problem {
            problem: format!("the CUDA driver cannot list devices: {error}"),
            fix:
                "check that the NVIDIA driver is loaded (`nvidia-smi`) and that this process may use the GPU"
                    .into(),
        });
    } else if probe.device_count == Some(0) {
        problems.push(Problem {
            problem: "the CUDA driver reports no GPU".into(),
            fix: "check `nvidia-smi` and CUDA_VISIBLE_DEVICES".into(),
        });
    }

    let kernel_cache = match KernelCache::default_location() {
        Ok(cache) => Some(cache.summary()),
        Err(e) => {
            problems
                .push(Problem { problem: format!("kernel cache: {e}"), fix: "set KILN_CACHE_DIR".into() });
            None
        }
    };

    let mut gpus = Vec::new();
    let mut live_check = None;
    if probe.libcuda.found {
        for ordinal in 0..probe.device_count.unwrap_or(0) {
            match Gpu::open(ordinal) {
                Ok(gpu) => {
                    let facts = gpu.facts().clone();
                    let peak = DeviceFile::for_arch(facts.arch)
                        .and_then(|f| f.peak_memory_bandwidth_bytes_per_s(&facts.name))
                        .map(|b| b / 1e9)
                        .ok();
                    gpus.push(GpuReport {
                        facts,
                        peak_memory_bandwidth_gb_per_s: peak,
                        overlapped_launches: gpu.overlaps_launches(),
                    });
                }
                Err(e) => problems.push(Problem {
                    problem: format!("GPU {ordinal} cannot be opened: {e}"),
                    fix: "check `nvidia-smi`; another process may hold the GPU in exclusive mode".into(),
                }),
            }
        }
        if probe.cuda_works() && !gpus.is_empty() {
            let check = live(&mut problems);
            live_check = Some(check);
        }
    }
    let ok = problems.is_empty() && live_check.as_ref().is_some_and(|c| c.ok);
    let cublas = kiln_cuda::blas::Blas::available();
    Report {
        kiln_version: env!("CARGO_PKG_VERSION"),
        ok,
        probe,
        cublas,
        gpus,
        kernel_cache,
        live_check,
        problems,
    }
}

/// Compiles `fill_u32` into a fresh cache (so the compile is real), loads it again from that
/// cache, runs it on GPU 0 and checks every word.
fn live(problems: &mut Vec<Problem>) -> LiveCheck {
    let dir = std::env::temp_dir().join(format!("kiln-doctor-{}", std::process::id()));
    let mut check = LiveCheck::default();
    let result = live_steps(&dir, &mut check);
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(()) => check.ok = true,
        Err(e) => {
            check.error = Some(e.to_string());
            problems.push(Problem {
                problem: format!("the live kernel check failed: {e}"),
                fix: "run `kiln -vv doctor` for details; NVRTC must be able to compile for this GPU's architecture \
                      (a newer nvidia-cuda-nvrtc or CUDA toolkit may be needed)"
                    .into(),
            });
        }
    }
    check
}

fn live_steps(dir: &std::path::Path, check: &mut LiveCheck) -> Result<()> {
    let cache = KernelCache::new(dir);
    let gpu = Gpu::open_with_cache(0, cache.clone())?;
    let started = Instant::now();
    let function = gpu.function(&kernels::COPY, "fill_u32", &[])?;
    check.compile_ms = Some(started.elapsed().as_secs_f64() * 1e3);

    let options = CompileOptions::for_kernel(&kernels::COPY, gpu.arch(), Vec::new());
    let started = Instant::now();
    let (image, from_cache) = cache.get_or_compile(&kernels::COPY, &options)?;
    check.cache_hit_ms = from_cache.then(|| started.elapsed().as_secs_f64() * 1e3);
    check.registers = image.resources.iter().find(|r| r.function == "fill_u32").map(|r| r.registers);

    let n = 1usize << 20;
    let pattern = 0x4b49_4c4eu32;
    let out = gpu.alloc(4 * n)?;
    out.fill_bytes(0)?;
    let (ptr, count) = (out.device_ptr(), n as u64);
    let started = Instant::now();
    let mut launch = gpu.launch_builder(&function);
    launch.arg(&ptr).arg(&pattern).arg(&count);
    // SAFETY: fill_u32(u32* dst, u32 pattern, u64 n) writes n words; `out` holds n words.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }
        .map_err(|e| driver_error("cuLaunchKernel", e))?;
    gpu.synchronize()?;
    check.run_ms = Some(started.elapsed().as_secs_f64() * 1e3);
    let words = out.to_host_bytes()?;
    let wrong =
        words.chunks_exact(4).filter(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != pattern).count();
    if wrong > 0 {
        return Err(kiln_core::Error::Launch {
            kernel: "fill_u32",
            reason: format!("{wrong} of {n} words are wrong"),
        });
    }
    Ok(())
}

fn render(report: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let found = |l: &kiln_cuda::LibraryProbe| {
        if l.found {
            format!(
                "found, version {} ({})",
                l.version.as_deref().unwrap_or("?"),
                l.path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "path unknown".into())
            )
        } else {
            "MISSING".to_owned()
        }
    };
    let _ = writeln!(s, "kiln {}", report.kiln_version);
    let _ = writeln!(s, "libcuda:  {}", found(&report.probe.libcuda));
    let _ = writeln!(s, "libnvrtc: {}", found(&report.probe.libnvrtc));
    let _ = writeln!(
        s,
        "libcublas: {}",
        if report.cublas {
            "found (prefill matrix products)"
        } else {
            "not found: prefill runs Kiln's matrix-vector kernels 8 tokens at a time (install cuBLAS: libcublas.so.13)"
        }
    );
    match report.probe.device_count {
        Some(n) => {
            let _ = writeln!(s, "GPUs:     {n}");
        }
        None => {
            let _ = writeln!(s, "GPUs:     unknown (no driver)");
        }
    }
    for gpu in &report.gpus {
        let f = &gpu.facts;
        let _ = writeln!(
            s,
            "  cuda:{} {}  compute {}.{} ({})  {}  {} SMs  L2 {}  driver CUDA {}{}  launches {}",
            f.ordinal,
            f.name,
            f.compute_capability.0,
            f.compute_capability.1,
            f.arch,
            bytes(f.total_memory_bytes),
            f.multiprocessors,
            bytes(f.l2_cache_bytes),
            f.driver_cuda_version,
            gpu.peak_memory_bandwidth_gb_per_s.map(|p| format!("  peak {p:.0} GB/s")).unwrap_or_default(),
            if gpu.overlapped_launches { "overlapped" } else { "serial" }
        );
    }
    if let Some(cache) = &report.kernel_cache {
        let _ = writeln!(
            s,
            "kernel cache: {} ({} entries, {})",
            cache.path.display(),
            cache.entries,
            bytes(cache.bytes)
        );
    }
    if let Some(live) = &report.live_check {
        let ms = |v: Option<f64>| v.map(|v| format!("{v:.2} ms")).unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "live check: {}  compile {}  cache hit {}  run {}",
            if live.ok { "OK" } else { "FAILED" },
            ms(live.compile_ms),
            ms(live.cache_hit_ms),
            ms(live.run_ms)
        );
    }
    for problem in &report.problems {
        let _ = writeln!(s, "problem: {}\n  fix: {}", problem.problem, problem.fix);
    }
    let _ = writeln!(
        s,
        "{}",
        if report.ok { "CUDA works." } else { "CUDA does not work here; the CPU path still does." }
    );
    s
}
