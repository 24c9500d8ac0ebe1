//! The guarded load of CUDA's libraries, and [`Gpu`]: one device's context, stream, facts,
//! kernel cache and memory pool.
//!
//! `cudarc`'s loaders panic when a library is missing, so nothing here calls into `cudarc`
//! before [`probe`] has found `libcuda` under one of the very names `cudarc` will try. NVRTC is
//! loaded by Kiln itself (`crate::nvrtc`), from the system's library path, the CUDA toolkit, the
//! `nvidia-cuda-nvrtc` Python wheel, or `$KILN_NVRTC_PATH`; a machine without either library
//! still runs every CPU path, and [`probe`] says what is missing and how to install it.

use std::collections::HashMap;
use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use kiln_core::{Error, Result, Tensor};
use serde::Serialize;

use crate::compile::{self, Arch, CompileOptions, KernelCache, KernelSource};
use crate::facts::DeviceFacts;
use crate::launch::Launch;
use crate::memory::{DeviceMemory, MemoryPool};
use crate::nvrtc;

/// What to install when `libcuda` is missing.
pub const LIBCUDA_FIX: &str = "install the NVIDIA driver (it provides libcuda.so.1), or add the folder \
     holding libcuda.so.1 to LD_LIBRARY_PATH";

/// One library as the probe found it (or did not).
#[derive(Clone, Debug, Serialize)]
pub struct LibraryProbe {
    /// `libcuda` or `libnvrtc`.
    pub library: &'static str,
    pub found: bool,
    /// The file that was loaded, when known.
    pub path: Option<PathBuf>,
    /// The library's own version (`13.0`).
    pub version: Option<String>,
    /// Why it was not found or not usable.
    pub detail: Option<String>,
    /// What to install when it is missing.
    pub fix: Option<&'static str>,
}

/// What the probe found: both libraries, and the devices when `libcuda` works.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub libcuda: LibraryProbe,
    pub libnvrtc: LibraryProbe,
    /// The CUDA version the driver supports (`13.0`), from `cuDriverGetVersion`.
    pub driver_cuda_version: Option<String>,
    /// Devices the driver reports; `None` when the driver could not be asked.
    pub device_count: Option<usize>,
    /// Why the driver could not count devices.
    pub device_error: Option<String>,
}

impl Probe {
    /// Whether Kiln can compile and launch kernels here.
    pub fn cuda_works(&self) -> bool {
        self.libcuda.found && self.libnvrtc.found && self.device_count.unwrap_or(0) > 0
    }
}

/// Looks for `libcuda` and `libnvrtc` once per process; never panics.
pub fn probe() -> &'static Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(|| {
        let libcuda = probe_libcuda();
        let libnvrtc = nvrtc::probe();
        let (mut driver_cuda_version, mut device_count, mut device_error) = (None, None, None);
        if libcuda.found {
            driver_cuda_version = libcuda.version.clone();
            // Not `count_devices`: it asks `probe()` for libcuda, and a re-entrant
            // initialisation of this OnceLock would deadlock.
            match count_devices_loaded() {
                Ok(n) => device_count = Some(n),
                Err(e) => device_error = Some(e.to_string()),
            }
        }
        Probe { libcuda, libnvrtc, driver_cuda_version, device_count, device_error }
    })
}

/// `Ok` when `libcuda` was found, else the named error with its fix.
pub fn require_libcuda() -> Result<()> {
    let libcuda = &probe().libcuda;
    if libcuda.found {
        Ok(())
    } else {
        Err(Error::CudaLibraryMissing {
            library: "libcuda",
            detail: libcuda.detail.clone().unwrap_or_default(),
            fix: LIBCUDA_FIX,
        })
    }
}

fn probe_libcuda() -> LibraryProbe {
    let mut candidates = cudarc::get_lib_name_candidates("cuda");
    let mut seen = std::collections::HashSet::new();
    candidates.retain(|name| seen.insert(name.clone()));
    let mut errors = Vec::new();
    for name in &candidates {
        // SAFETY: loading libcuda runs its initialisers, which have no preconditions; it is the
        // same load that cudarc performs.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => {
                let version = driver_version_from(&library);
                let path = loaded_path("libcuda");
                // Kept loaded for the life of the process: cudarc loads the same file by name.
                std::mem::forget(library);
                return LibraryProbe {
                    library: "libcuda",
                    found: true,
                    path,
                    version,
                    detail: None,
                    fix: None,
                };
            }
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    LibraryProbe {
        library: "libcuda",
        found: false,
        path: None,
        version: None,
        detail: Some(format!("tried {}", candidates.join(", "))),
        fix: Some(LIBCUDA_FIX),
    }
}

fn driver_version_from(library: &libloading::Library) -> Option<String> {
    driver_version_number(library).map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

fn driver_version_number(library: &libloading::Library) -> Option<i32> {
    // SAFETY: cuDriverGetVersion has this signature in every CUDA release and may be called
    // before cuInit.
    unsafe {
        let get: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> =
            library.get(b"cuDriverGetVersion\0").ok()?;
        let mut version: c_int = 0;
        (get(&mut version) == 0).then_some(version)
    }
}

/// The driver's CUDA version as a number (13000 for 13.0), asked of `libcuda.so.1` directly;
/// `None` without a driver. Never panics.
pub(crate) fn probe_driver_version() -> Option<i32> {
    static VERSION: OnceLock<Option<i32>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        // SAFETY: as in `probe_libcuda`.
        let library = unsafe { libloading::Library::new("libcuda.so.1") }.ok()?;
        let version = driver_version_number(&library);
        std::mem::forget(library);
        version
    })
}

/// The path of a loaded shared object whose file name starts with `prefix`, from the process's
/// memory map (Linux); `None` elsewhere.
pub(crate) fn loaded_path(prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().filter_map(|line| line.split_whitespace().nth(5)).map(Path::new).find_map(|path| {
        let name = path.file_name()?.to_str()?;
        (name.starts_with(prefix) && name.contains(".so")).then(|| path.to_path_buf())
    })
}

fn count_devices() -> Result<usize> {
    require_libcuda()?;
    count_devices_loaded()
}

/// The device count, once libcuda is known to be loadable.
fn count_devices_loaded() -> Result<usize> {
    cudarc::driver::result::init().map_err(|e| driver_error("cuInit", e))?;
    let count =
        cudarc::driver::result::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Kiln's error for a failed driver call.
pub fn driver_error(call: &'static str, error: cudarc::driver::DriverError) -> Error {
    Error::Driver { call, message: format!("{error:?}") }
}

/// The number of CUDA devices, or the named error when `libcuda` is missing.
pub fn device_count() -> Result<usize> {
    count_devices()
}

/// Counters of the kernel compiler and its caches, for `kiln doctor` and tests.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CompileStats {
    /// Kernels compiled by NVRTC in this process.
    pub compiles: u64,
    /// Kernels loaded from the disk cache.
    pub disk_hits: u64,
    /// Functions served from the in-process cache.
    pub memory_hits: u64,
    /// Time of the last NVRTC compile, microseconds.
    pub last_compile_us: Option<u64>,
    /// Time of the last disk-cache load, microseconds.
    pub last_disk_hit_us: Option<u64>,
}

type FunctionKey = (&'static str, String, Vec<(String, String)>);

/// One CUDA device: its context, Kiln's stream on it, its facts, the kernel cache and the memory
/// pool. All of Kiln's work on the device is ordered on [`Gpu::stream`].
pub struct Gpu {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    facts: DeviceFacts,
    cache: KernelCache,
    pool: MemoryPool,
    modules: Mutex<HashMap<FunctionKey, (Arc<CudaModule>, CudaFunction)>>,
    stats: Mutex<CompileStats>,
    overlap: AtomicBool,
    cluster_combine: AtomicBool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{} {})", self.facts.ordinal, self.facts.name)
    }
}

impl Gpu {
    /// Opens device `ordinal`: the primary context, a new stream, the device facts, and the kernel
    /// cache at its default place (`$KILN_CACHE_DIR/kernels`).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        Gpu::open_with_cache(ordinal, KernelCache::default_location()?)
    }

    /// Opens device `ordinal` with the kernel cache in `cache`.
    pub fn open_with_cache(ordinal: usize, cache: KernelCache) -> Result<Arc<Gpu>> {
        require_libcuda()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::OutOfBounds {
                op: "Gpu::open",
                what: "device ordinal",
                value: ordinal as u64,
                limit: count as u64,
            });
        }
        let context = CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        let stream = context.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
        let facts = DeviceFacts::query(&context)?;
        let pool = MemoryPool::new(context.clone(), stream.clone(), ordinal);
        tracing::debug!(ordinal, name = %facts.name, arch = %facts.arch, "opened GPU");
        let overlap = AtomicBool::new(crate::launch::overlap_default(facts.compute_capability.0));
        let cluster_combine =
            AtomicBool::new(crate::launch::cluster_combine_default(facts.compute_capability.0));
        Ok(Arc::new(Gpu {
            context,
            stream,
            facts,
            cache,
            pool,
            modules: Mutex::new(HashMap::new()),
            stats: Mutex::new(CompileStats::default()),
            overlap,
            cluster_combine,
        }))
    }

    /// Kiln's stream on this device; launches and copies go here.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A launch of `function` on [`Gpu::stream`] that may overlap the kernel before it
    /// ([`crate::launch`]): push the arguments with [`Launch::arg`], then [`Launch::launch`].
    pub fn launch_builder<'a>(&'a self, function: &'a CudaFunction) -> Launch<'a> {
        Launch::new(self, function)
    }

    /// Whether [`Gpu::launch_builder`]'s launches overlap the kernel before them: on by default on
    /// sm_90 and later unless `KILN_OVERLAP_LAUNCHES=0`.
    pub fn overlaps_launches(&self) -> bool {
        self.overlap.load(Ordering::Relaxed)
    }

    /// Turns overlapping launches on or off (on is ignored where the device cannot overlap).
    /// Results are the same bits either way; only the time between kernels changes.
    pub fn set_overlap_launches(&self, on: bool) {
        self.overlap.store(on && self.facts.compute_capability.0 >= 9, Ordering::Relaxed);
    }

    /// Whether split decode attention on the tiled kernel combines its splits through a thread
    /// block cluster's distributed shared memory ([`crate::ops::attention`]): on by default on
    /// sm_90 and later unless `KILN_CLUSTER_COMBINE=0`.
    pub fn cluster_combine(&self) -> bool {
        self.cluster_combine.load(Ordering::Relaxed)
    }

    /// Turns the cluster combine on or off (on is ignored before sm_90). Results are the same
    /// bits either way: the combine's arithmetic and order are the same; only where the partials
    /// travel changes.
    pub fn set_cluster_combine(&self, on: bool) {
        self.cluster_combine.store(on && self.facts.compute_capability.0 >= 9, Ordering::Relaxed);
    }

    /// The device's (primary) context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// What the driver says about this device.
    pub fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    /// The architecture kernels are compiled for (`sm_90` on Hopper).
    pub fn arch(&self) -> Arch {
        self.facts.arch
    }

    /// The device memory pool.
    pub fn pool(&self) -> &MemoryPool {
        &self.pool
    }

    /// The on-disk kernel cache.
    pub fn kernel_cache(&self) -> &KernelCache {
        &self.cache
    }

    /// The compiler counters of this device.
    pub fn compile_stats(&self) -> CompileStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits until all work on [`Gpu::stream`] is done.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    /// Allocates `bytes` of uninitialised device memory from the pool.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        self.pool.alloc(bytes)
    }

    /// A device copy of a host tensor (made contiguous first).
    pub fn upload(&self, tensor: &Tensor) -> Result<Tensor> {
        crate::memory::upload(self, tensor)
    }

    /// The function `entry` of `kernel`, compiled for this device with `defines`.
    ///
    /// Looked up in order: this process's modules, the disk cache, NVRTC. Defines are the
    /// compile-time constants of one specialization (`&[("BLOCK", "256")]`).
    pub fn function(
        &self,
        kernel: &KernelSource,
        entry: &str,
        defines: &[(&str, &str)],
    ) -> Result<CudaFunction> {
        let defines =
            specialization(defines.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect());
        let key: FunctionKey = (kernel.name, entry.to_owned(), defines.clone());
        let mut modules = self.modules.lock().map_err(|_| poisoned("kernel module table"))?;
        if let Some((_, function)) = modules.get(&key) {
            self.bump(|s| s.memory_hits += 1);
            return Ok(function.clone());
        }
        // One module per (kernel, defines); other entries of the same module are found by name.
        if let Some(module) = modules.iter().find(|((n, _, d), _)| *n == kernel.name && *d == defines) {
            let module = module.1 .0.clone();
            let function = load_function(kernel, &module, entry)?;
            modules.insert(key, (module, function.clone()));
            return Ok(function);
        }
        let options = CompileOptions::for_kernel(kernel, self.arch(), defines);
        let started = Instant::now();
        let (compiled, from_cache) = self.cache.get_or_compile(kernel, &options)?;
        let elapsed_us = started.elapsed().as_micros() as u64;
        self.bump(|s| {
            if from_cache {
                s.disk_hits += 1;
                s.last_disk_hit_us = Some(elapsed_us);
            } else {
                s.compiles += 1;
                s.last_compile_us = Some(elapsed_us);
            }
        });
        tracing::debug!(kernel = kernel.name, from_cache, elapsed_us, "kernel image ready");
        let module = self
            .context
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.image))
            .map_err(|e| driver_error("cuModuleLoadData", e))
            .map_err(|e| e.context(format!("loading kernel {}", kernel.name)))?;
        let function = load_function(kernel, &module, entry)?;
        modules.insert(key, (module, function.clone()));
        Ok(function)
    }

    /// Compiles these specializations of `kernel` (each a define list, as [`Gpu::function`] takes
    /// it) for this device into the disk cache, on rayon's threads, so that the `function` calls
    /// that follow load them instead of compiling one after another. Those already in the cache
    /// are not compiled again. Returns how many were compiled.
    pub fn warm(&self, kernel: &KernelSource, specializations: &[Vec<(String, String)>]) -> Result<usize> {
        let options: Vec<CompileOptions> = specializations
            .iter()
            .map(|defines| CompileOptions::for_kernel(kernel, self.arch(), specialization(defines.clone())))
            .collect();
        let started = Instant::now();
        let compiled = self.cache.warm(kernel, &options)?;
        tracing::debug!(
            kernel = kernel.name,
            compiled,
            elapsed_us = started.elapsed().as_micros() as u64,
            "kernels warmed"
        );
        Ok(compiled)
    }

    fn bump(&self, f: impl FnOnce(&mut CompileStats)) {
        if let Ok(mut stats) = self.stats.lock() {
            f(&mut stats);
        }
    }
}

/// A specialization's defines as Kiln compiles them: the caller's, then the fence handoff's
/// (`KILN_HANDOFF`) when the environment chooses one.
fn specialization(mut defines: Vec<(String, String)>) -> Vec<(String, String)> {
    if let Some(handoff) = crate::launch::handoff_define() {
        defines.push(("KILN_HANDOFF".to_owned(), handoff.to_owned()));
    }
    defines
}

fn load_function(kernel: &KernelSource, module: &Arc<CudaModule>, entry: &str) -> Result<CudaFunction> {
    module
        .load_function(entry)
        .map_err(|e| driver_error("cuModuleGetFunction", e))
        .map_err(|e| e.context(format!("kernel {}: entry `{entry}`", kernel.name)))
}

pub(crate) fn poisoned(what: &str) -> Error {
    Error::NotServed {
        op: "kiln-cuda",
        reason: format!("{what} is unusable after a panic in another thread"),
    }
}

/// Compiles `kernel` for `arch` with no GPU, no cache: the CI check and `kiln doctor` use it.
pub fn compile_only(
    kernel: &KernelSource,
    arch: Arch,
    defines: &[(&str, &str)],
) -> Result<compile::CompiledKernel> {
    let defines = defines.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    compile::compile(kernel, &CompileOptions::for_kernel(kernel, arch, defines))
}
