//! NVRTC, loaded by Kiln from wherever it is installed.
//!
//! Kiln binds the dozen NVRTC calls it uses itself rather than through `cudarc`'s loader, which
//! panics when the library is missing and only looks on the system's library path. Looked for, in
//! order: `$KILN_NVRTC_PATH` (the library file or its folder), the system's library path
//! (CUDA 13, then 12), `/usr/local/cuda/lib64`, and the `nvidia-cuda-nvrtc` Python wheel's
//! folders (`nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib`) in the usual site-packages. The library
//! found by full path is opened with `RTLD_GLOBAL`, so a later load by its soname (`cudarc`'s)
//! finds the same file.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use kiln_core::{Error, Result};

use crate::runtime::LibraryProbe;

/// What to install when `libnvrtc` is missing.
pub const LIBNVRTC_FIX: &str = "install NVRTC: `pip install nvidia-cuda-nvrtc` (CUDA 13) or \
     `pip install nvidia-cuda-nvrtc-cu12` (CUDA 12), or the CUDA toolkit; or set KILN_NVRTC_PATH to \
     the folder holding libnvrtc.so";

type Program = *mut std::ffi::c_void;
type Status = c_int;

/// The NVRTC entry points Kiln uses, resolved once.
pub(crate) struct Nvrtc {
    _library: libloading::Library,
    pub path: PathBuf,
    pub version: (i32, i32),
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    destroy_program: unsafe extern "C" fn(*mut Program) -> Status,
    get_log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

static COMPILE_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many times this process has called `nvrtcCompileProgram` (tests check cache hits with it).
pub fn compile_calls() -> u64 {
    COMPILE_CALLS.load(Ordering::Relaxed)
}

fn loaded() -> &'static std::result::Result<Nvrtc, String> {
    static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
    NVRTC.get_or_init(load)
}

/// The loaded NVRTC, or the named error with what to install.
pub(crate) fn nvrtc() -> Result<&'static Nvrtc> {
    loaded().as_ref().map_err(|detail| Error::CudaLibraryMissing {
        library: "libnvrtc",
        detail: detail.clone(),
        fix: LIBNVRTC_FIX,
    })
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    Ok(nvrtc()?.version)
}

/// The probe's view of NVRTC.
pub(crate) fn probe() -> LibraryProbe {
    match loaded() {
        Ok(n) => LibraryProbe {
            library: "libnvrtc",
            found: true,
            path: Some(n.path.clone()),
            version: Some(format!("{}.{}", n.version.0, n.version.1)),
            detail: None,
            fix: None,
        },
        Err(detail) => LibraryProbe {
            library: "libnvrtc",
            found: false,
            path: None,
            version: None,
            detail: Some(detail.clone()),
            fix: Some(LIBNVRTC_FIX),
        },
    }
}

/// NVRTC's sonames, newest first; a CUDA 12 driver gets CUDA 12's NVRTC first, since it may not
/// load images from a newer major version.
fn sonames() -> [&'static str; 3] {
    if driver_cuda_major() == Some(12) {
        ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]
    } else {
        ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    }
}

/// The wheel folders under a site-packages, in the same preference.
fn wheel_folders() -> [&'static str; 2] {
    if driver_cuda_major() == Some(12) {
        ["nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib"]
    } else {
        ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"]
    }
}

/// The CUDA major version the installed driver supports, when the driver is there.
fn driver_cuda_major() -> Option<i32> {
    crate::runtime::probe_driver_version().map(|v| v / 1000)
}

/// Every place to try, in order: full paths first where the user named one, then sonames.
fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let in_folder = |dir: &Path, out: &mut Vec<PathBuf>| {
        for name in sonames() {
            let path = dir.join(name);
            if path.exists() {
                out.push(path);
            }
        }
    };
    if let Some(value) = std::env::var_os("KILN_NVRTC_PATH").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        if path.is_dir() {
            in_folder(&path, &mut out);
        } else {
            out.push(path);
        }
    }
    out.extend(sonames().iter().map(PathBuf::from));
    in_folder(Path::new("/usr/local/cuda/lib64"), &mut out);
    for site in site_packages() {
        for sub in wheel_folders() {
            in_folder(&site.join(sub), &mut out);
        }
    }
    out
}

/// Likely site-packages folders, without starting Python.
fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|p| PathBuf::from(p).join("lib"))
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(&home).join(".local/lib"));
    }
    roots.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with("python3") {
                for sub in ["site-packages", "dist-packages"] {
                    out.push(entry.path().join(sub));
                }
            }
        }
    }
    out
}

fn load() -> std::result::Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for candidate in candidates() {
        let by_path = candidate.components().count() > 1;
        if by_path {
            preload_builtins(&candidate);
        }
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        let opened = unsafe {
            libloading::os::unix::Library::open(
                Some(&candidate),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        };
        match opened {
            Ok(library) => {
                let library = libloading::Library::from(library);
                let path = if by_path {
                    candidate.clone()
                } else {
                    crate::runtime::loaded_path("libnvrtc.so").unwrap_or(candidate.clone())
                };
                return bind(library, path).map_err(|e| format!("{}: {e}", candidate.display()));
            }
            Err(e) => tried.push(format!("{}: {e}", candidate.display())),
        }
    }
    Err(format!("tried {}", tried.join("; ")))
}

/// NVRTC opens `libnvrtc-builtins.so.X.Y` by name at compile time. A library found outside the
/// system's search path (the wheel's folder) has its builtins beside it: open them first,
/// globally, so NVRTC's load by name finds them already loaded.
fn preload_builtins(nvrtc_path: &Path) {
    let Some(dir) = nvrtc_path.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("libnvrtc-builtins.so") {
            // SAFETY: the builtins library has no initialisers with preconditions.
            let opened = unsafe {
                libloading::os::unix::Library::open(
                    Some(entry.path()),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            };
            match opened {
                // Kept for the life of the process, as NVRTC is.
                Ok(library) => std::mem::forget(library),
                Err(e) => tracing::debug!("{}: {e}", entry.path().display()),
            }
        }
    }
}

fn bind(library: libloading::Library, path: PathBuf) -> std::result::Result<Nvrtc, String> {
    // SAFETY: each symbol is declared with the signature of nvrtc.h (stable since CUDA 11.1).
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *library.get(concat!($name, "\0").as_bytes()).map_err(|e| format!("symbol {}: {e}", $name))?
            };
        }
        let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status = sym!("nvrtcVersion");
        let nvrtc = Nvrtc {
            create_program: sym!("nvrtcCreateProgram"),
            compile_program: sym!("nvrtcCompileProgram"),
            destroy_program: sym!("nvrtcDestroyProgram"),
            get_log_size: sym!("nvrtcGetProgramLogSize"),
            get_log: sym!("nvrtcGetProgramLog"),
            get_cubin_size: sym!("nvrtcGetCUBINSize"),
            get_cubin: sym!("nvrtcGetCUBIN"),
            get_error_string: sym!("nvrtcGetErrorString"),
            version: (0, 0),
            path,
            _library: library,
        };
        let (mut major, mut minor) = (0, 0);
        if version_fn(&mut major, &mut minor) != 0 {
            return Err("nvrtcVersion failed".into());
        }
        Ok(Nvrtc { version: (major, minor), ..nvrtc })
    }
}

/// The output of one NVRTC compile.
pub(crate) struct Output {
    /// The cubin; `None` when the compile failed.
    pub cubin: Option<Vec<u8>>,
    pub log: String,
}

impl Nvrtc {
    /// Compiles `source` (named `name`) with the named `headers` and `options` to a cubin.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
    ) -> Result<Output> {
        let c = |s: &str, what: &str| {
            CString::new(s).map_err(|_| Error::InvalidArgument {
                name: "kernel source",
                value: format!("{name}: {what}"),
                reason: "contains a NUL byte".into(),
            })
        };
        let source_c = c(source, "source")?;
        let name_c = c(name, "name")?;
        let header_sources: Vec<CString> =
            headers.iter().map(|(_, s)| c(s, "header")).collect::<Result<_>>()?;
        let header_names: Vec<CString> =
            headers.iter().map(|(n, _)| c(n, "header name")).collect::<Result<_>>()?;
        let options_c: Vec<CString> = options.iter().map(|o| c(o, "option")).collect::<Result<_>>()?;
        let header_source_ptrs: Vec<*const c_char> = header_sources.iter().map(|s| s.as_ptr()).collect();
        let header_name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
        let option_ptrs: Vec<*const c_char> = options_c.iter().map(|s| s.as_ptr()).collect();

        let mut program: Program = std::ptr::null_mut();
        // SAFETY: every pointer is to a NUL-terminated string alive until the end of this
        // function; the arrays hold `headers.len()` entries; `program` is destroyed below.
        unsafe {
            self.check(
                "nvrtcCreateProgram",
                (self.create_program)(
                    &mut program,
                    source_c.as_ptr(),
                    name_c.as_ptr(),
                    headers.len() as c_int,
                    header_source_ptrs.as_ptr(),
                    header_name_ptrs.as_ptr(),
                ),
            )?;
            COMPILE_CALLS.fetch_add(1, Ordering::Relaxed);
            let status = (self.compile_program)(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            let log = self.log(program);
            let cubin = if status == 0 { Some(self.cubin(program)) } else { None };
            (self.destroy_program)(&mut program);
            let cubin = cubin.transpose()?;
            Ok(Output { cubin, log: log? })
        }
    }

    /// # Safety
    /// `program` must be a live program.
    unsafe fn log(&self, program: Program) -> Result<String> {
        let mut size = 0usize;
        self.check("nvrtcGetProgramLogSize", (self.get_log_size)(program, &mut size))?;
        let mut log = vec![0u8; size.max(1)];
        self.check("nvrtcGetProgramLog", (self.get_log)(program, log.as_mut_ptr().cast()))?;
        let text =
            CStr::from_bytes_until_nul(&log).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(text)
    }

    /// # Safety
    /// `program` must be a live, successfully compiled program.
    unsafe fn cubin(&self, program: Program) -> Result<Vec<u8>> {
        let mut size = 0usize;
        self.check("nvrtcGetCUBINSize", (self.get_cubin_size)(program, &mut size))?;
        let mut cubin = vec![0u8; size];
        self.check("nvrtcGetCUBIN", (self.get_cubin)(program, cubin.as_mut_ptr().cast()))?;
        Ok(cubin)
    }

    fn check(&self, call: &'static str, status: Status) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any status.
        let message = unsafe {
            let text = (self.get_error_string)(status);
            if text.is_null() {
                format!("status {status}")
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            }
        };
        Err(Error::Driver { call, message })
    }
}
