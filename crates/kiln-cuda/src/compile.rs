//! NVRTC compiles of Kiln's kernels, with the prelude and an on-disk cache of compiled images.
//!
//! Every kernel source is self-contained: it includes `"kiln_prelude.cuh"` (handed to NVRTC as a
//! named header, `kernels/prelude.cuh`) and nothing from the CUDA toolkit, so a machine needs only
//! the driver and `libnvrtc`. Kernels compile straight to a cubin for the device's exact
//! architecture with `--ptxas-options=-v`, so the log reports each entry's registers, stack frame
//! and spill bytes ([`KernelResources`]) with or without a GPU.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kiln_core::{Error, Result};
use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::nvrtc;

/// The prelude every kernel includes as `"kiln_prelude.cuh"`.
pub const PRELUDE: &str = include_str!("../kernels/prelude.cuh");
/// The name kernels include the prelude by.
pub const PRELUDE_NAME: &str = "kiln_prelude.cuh";

/// Bumped when the cache's file layout or the options Kiln adds change meaning.
const CACHE_FORMAT: &str = "kiln-kernel-cache-v1";

/// One kernel family's source, as registered in [`crate::kernels::ALL`].
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// The family's name (`"norm"`), also the program name in NVRTC's messages.
    pub name: &'static str,
    /// The CUDA C++ source (`include_str!("../kernels/norm.cu")`).
    pub source: &'static str,
    /// Every set of defines that must compile (the CI check compiles each for every
    /// architecture); one empty set when the kernel has no compile-time constants.
    pub define_sets: &'static [&'static [(&'static str, &'static str)]],
    /// Whether NVRTC may contract `a * b + c` into an FMA. Deterministic kernels, which must
    /// match the CPU reference bit for bit, set `false` (`--fmad=false`).
    pub fmad: bool,
}

impl KernelSource {
    /// The one architecture this family is built for with its architecture-specific features
    /// (`sm_90a`), from [`crate::kernels::ARCH_SPECIFIC`]; `None` for the families every
    /// architecture builds.
    pub fn specific_arch(&self) -> Option<Arch> {
        crate::kernels::ARCH_SPECIFIC.iter().find(|(name, _)| *name == self.name).map(|(_, arch)| *arch)
    }

    /// Whether the family builds for `arch`.
    pub fn serves(&self, arch: Arch) -> bool {
        self.specific_arch().is_none_or(|served| served == arch)
    }
}

/// A compute capability as a number: 90 for `sm_90`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(into = "String")]
pub struct Arch(pub u32);

impl Arch {
    /// The architectures Kiln compiles for in CI.
    pub const SUPPORTED: [Arch; 4] = [Arch(80), Arch(86), Arch(89), Arch(90)];

    /// The architecture of compute capability `major.minor`.
    pub fn from_compute_capability(major: u32, minor: u32) -> Arch {
        Arch(major * 10 + minor)
    }

    /// Parses `sm_90` or `90`.
    pub fn parse(text: &str) -> Result<Arch> {
        let digits = text.strip_prefix("sm_").unwrap_or(text);
        digits.parse().map(Arch).map_err(|_| Error::InvalidArgument {
            name: "architecture",
            value: text.to_owned(),
            reason: "expected sm_XX, such as sm_90".into(),
        })
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

impl From<Arch> for String {
    fn from(arch: Arch) -> String {
        arch.to_string()
    }
}

/// The options of one compile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileOptions {
    pub arch: Arch,
    /// Compile-time constants, in the order given (`-DNAME=VALUE`).
    pub defines: Vec<(String, String)>,
    /// Whether FMA contraction is allowed (`--fmad`).
    pub fmad: bool,
    /// Whether to target the architecture-specific features (`sm_90a`: wgmma, setmaxnreg), for
    /// the kernels of [`crate::kernels::ARCH_SPECIFIC`]. Such an image runs on that
    /// architecture only.
    pub arch_specific: bool,
}

impl CompileOptions {
    /// The options for `kernel` on `arch` with `defines`.
    pub fn for_kernel(kernel: &KernelSource, arch: Arch, defines: Vec<(String, String)>) -> CompileOptions {
        let arch_specific = kernel.specific_arch() == Some(arch);
        CompileOptions { arch, defines, fmad: kernel.fmad, arch_specific }
    }

    /// The command-line options handed to NVRTC.
    pub fn nvrtc_options(&self) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={}{}", self.arch, if self.arch_specific { "a" } else { "" }),
            "--std=c++17".to_owned(),
            format!("--fmad={}", self.fmad),
            "--ptxas-options=-v".to_owned(),
            "--ptxas-options=--warn-on-spills".to_owned(),
            "--ptxas-options=--warn-on-local-memory-usage".to_owned(),
        ];
        options.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        options
    }
}

/// What ptxas reports for one entry function.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KernelResources {
    pub function: String,
    pub registers: u32,
    pub stack_frame_bytes: u64,
    pub spill_store_bytes: u64,
    pub spill_load_bytes: u64,
}

/// A compiled kernel image and what the compiler said.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    /// The cubin.
    pub image: Vec<u8>,
    /// NVRTC's log (ptxas's report included).
    pub log: String,
    /// Per entry: registers, stack frame, spills.
    pub resources: Vec<KernelResources>,
}

impl CompiledKernel {
    /// Warnings in the log (ptxas's spill warnings included).
    pub fn warnings(&self) -> Vec<&str> {
        self.log.lines().filter(|l| l.to_ascii_lowercase().contains("warning")).collect()
    }
}

/// Compiles `kernel` with `options` (no cache, no GPU needed).
pub fn compile(kernel: &KernelSource, options: &CompileOptions) -> Result<CompiledKernel> {
    if !kernel.serves(options.arch) {
        return Err(Error::NotServed {
            op: "kernel compile",
            reason: format!(
                "{} is built for {}a only, not {}",
                kernel.name,
                kernel.specific_arch().map_or_else(String::new, |a| a.to_string()),
                options.arch
            ),
        });
    }
    let nvrtc = nvrtc::nvrtc()?;
    let flags = options.nvrtc_options();
    let started = Instant::now();
    let output = nvrtc.compile(kernel.name, kernel.source, &[(PRELUDE_NAME, PRELUDE)], &flags)?;
    tracing::debug!(kernel = kernel.name, arch = %options.arch, elapsed_us = started.elapsed().as_micros() as u64, "NVRTC compile");
    match output.cubin {
        Some(image) => {
            let resources = parse_resources(&output.log);
            Ok(CompiledKernel { image, log: output.log, resources })
        }
        None => Err(Error::Compile { kernel: kernel.name.to_owned(), options: flags, log: output.log }),
    }
}

/// Parses ptxas's `-v` report: per function, registers, stack frame and spill bytes.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u64> {
        let end = line.find(unit)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        let line = line.trim();
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            let function = rest.trim().to_owned();
            if !out.iter().any(|r| r.function == function) {
                out.push(KernelResources { function, ..Default::default() });
            }
        } else if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let function = rest.split('\'').next().unwrap_or_default().to_owned();
            if !out.iter().any(|r| r.function == function) {
                out.push(KernelResources { function, ..Default::default() });
            }
        } else if let Some(current) = out.last_mut() {
            if line.contains("bytes stack frame") {
                current.stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                current.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                current.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used ") && line.contains(" registers") {
                current.registers = number_before(line, " registers").unwrap_or(0) as u32;
            }
        }
    }
    out
}

/// The on-disk cache of compiled images: one `<sha256>.cubin` (and its `.log`) per
/// (source, prelude, options, architecture, NVRTC version).
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

/// What the cache folder holds.
#[derive(Clone, Debug, Serialize)]
pub struct CacheSummary {
    pub path: PathBuf,
    pub entries: u64,
    pub bytes: u64,
}

impl KernelCache {
    /// A cache in `dir` (created on first store).
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// `$KILN_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/kiln/kernels`, else `~/.cache/kiln/kernels`.
    pub fn default_location() -> Result<KernelCache> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let root = var("KILN_CACHE_DIR")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("kiln")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/kiln")))
            .ok_or_else(|| Error::InvalidArgument {
                name: "KILN_CACHE_DIR",
                value: String::new(),
                reason: "neither KILN_CACHE_DIR, XDG_CACHE_HOME nor HOME is set".into(),
            })?;
        Ok(KernelCache::new(root.join("kernels")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache key of `kernel` compiled with `options` by the loaded NVRTC.
    pub fn key(kernel: &KernelSource, options: &CompileOptions) -> Result<String> {
        let (major, minor) = nvrtc::version()?;
        let mut hash = Sha256::new();
        for part in [CACHE_FORMAT, kernel.name, kernel.source, PRELUDE] {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part.as_bytes());
        }
        for option in options.nvrtc_options() {
            hash.update((option.len() as u64).to_le_bytes());
            hash.update(option.as_bytes());
        }
        hash.update(format!("nvrtc {major}.{minor}").as_bytes());
        Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The compiled image from the cache, or a fresh compile stored for next time. The flag says
    /// whether it came from the cache.
    pub fn get_or_compile(
        &self,
        kernel: &KernelSource,
        options: &CompileOptions,
    ) -> Result<(CompiledKernel, bool)> {
        let key = KernelCache::key(kernel, options)?;
        let cubin_path = self.cubin_path(&key);
        let log_path = self.dir.join(format!("{key}.log"));
        if let Ok(image) = std::fs::read(&cubin_path) {
            if !image.is_empty() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let resources = parse_resources(&log);
                return Ok((CompiledKernel { image, log, resources }, true));
            }
        }
        let compiled = compile(kernel, options)?;
        // A cache that cannot be written costs a recompile next time, not a failure now.
        if let Err(e) = self.store(&key, &compiled) {
            tracing::warn!("kernel cache {}: {e}", self.dir.display());
        }
        Ok((compiled, false))
    }

    /// Compiles every specialization in `options` that the cache does not hold yet, on rayon's
    /// threads, and stores each: the `get_or_compile` calls that follow read them from disk
    /// instead of compiling one after another. Options that give the same key are compiled once.
    /// Returns how many were compiled. Every specialization is tried; the first error (in
    /// `options`' order) is returned after all have finished.
    pub fn warm(&self, kernel: &KernelSource, options: &[CompileOptions]) -> Result<usize> {
        let mut keys = HashSet::new();
        let mut work: Vec<(String, &CompileOptions)> = Vec::new();
        for option in options {
            let key = KernelCache::key(kernel, option)?;
            let cached = std::fs::metadata(self.cubin_path(&key)).is_ok_and(|m| m.len() > 0);
            if !cached && keys.insert(key.clone()) {
                work.push((key, option));
            }
        }
        let stored: Vec<Result<()>> = work
            .par_iter()
            .map(|(key, option)| compile(kernel, option).and_then(|compiled| self.store(key, &compiled)))
            .collect();
        stored.into_iter().find_map(Result::err).map_or(Ok(work.len()), Err)
    }

    /// Where the cache keeps the image of `key`.
    fn cubin_path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.cubin"))
    }

    fn store(&self, key: &str, compiled: &CompiledKernel) -> Result<()> {
        // Tells apart the files that threads of this process write aside at once.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let write = |name: String, bytes: &[u8]| -> Result<()> {
            // Written aside then renamed, so a reader never sees half a file.
            let n = WRITES.fetch_add(1, Ordering::Relaxed);
            let tmp = self.dir.join(format!("{name}.{}.{n}.tmp", std::process::id()));
            let path = self.dir.join(name);
            std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
        };
        write(format!("{key}.log"), compiled.log.as_bytes())?;
        write(format!("{key}.cubin"), &compiled.image)
    }

    /// Entries and bytes in the cache folder (zero when it does not exist yet).
    pub fn summary(&self) -> CacheSummary {
        let (mut entries, mut bytes) = (0, 0);
        if let Ok(dir) = std::fs::read_dir(&self.dir) {
            for entry in dir.flatten() {
                let path = entry.path();
                let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                bytes += size;
                if path.extension().is_some_and(|e| e == "cubin") {
                    entries += 1;
                }
            }
        }
        CacheSummary { path: self.dir.clone(), entries, bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTXAS_LOG: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'kiln_add' for 'sm_90'\n\
ptxas info    : Function properties for kiln_add\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 38 registers, used 0 barriers, 376 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'kiln_scale' for 'sm_90'\n\
ptxas info    : Function properties for kiln_scale\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 10 registers, 368 bytes cmem[0]\n";

    #[test]
    fn parses_registers_stack_and_spills_per_entry() {
        let resources = parse_resources(PTXAS_LOG);
        assert_eq!(
            resources,
            vec![
                KernelResources {
                    function: "kiln_add".into(),
                    registers: 38,
                    stack_frame_bytes: 8,
                    spill_store_bytes: 4,
                    spill_load_bytes: 12,
                },
                KernelResources { function: "kiln_scale".into(), registers: 10, ..Default::default() },
            ]
        );
    }

    #[test]
    fn arch_parses_and_prints() {
        assert_eq!(Arch::parse("sm_90").ok(), Some(Arch(90)));
        assert_eq!(Arch::parse("86").ok(), Some(Arch(86)));
        assert!(matches!(Arch::parse("hopper"), Err(Error::InvalidArgument { name: "architecture", .. })));
        assert_eq!(Arch::from_compute_capability(8, 9).to_string(), "sm_89");
    }

    #[test]
    fn options_carry_arch_fmad_and_defines() {
        let options = CompileOptions {
            arch: Arch(80),
            defines: vec![("BLOCK".into(), "256".into())],
            fmad: false,
            arch_specific: false,
        };
        let flags = options.nvrtc_options();
        assert!(flags.contains(&"--gpu-architecture=sm_80".to_owned()));
        assert!(flags.contains(&"--fmad=false".to_owned()));
        assert!(flags.contains(&"-DBLOCK=256".to_owned()));
        let specific = CompileOptions { arch: Arch(90), arch_specific: true, ..options };
        assert!(specific.nvrtc_options().contains(&"--gpu-architecture=sm_90a".to_owned()));
    }

    #[test]
    fn arch_specific_families_target_their_arch_only() {
        let prefill = crate::kernels::ATTENTION_PREFILL;
        assert_eq!(prefill.specific_arch(), Some(Arch(90)));
        assert!(prefill.serves(Arch(90)) && !prefill.serves(Arch(80)) && !prefill.serves(Arch(89)));
        assert!(CompileOptions::for_kernel(&prefill, Arch(90), Vec::new()).arch_specific);
        let plain = crate::kernels::ATTENTION;
        assert!(plain.serves(Arch(80)) && plain.serves(Arch(90)));
        assert!(!CompileOptions::for_kernel(&plain, Arch(90), Vec::new()).arch_specific);
    }
}
