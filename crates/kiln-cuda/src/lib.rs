//! `kiln-cuda`: Kiln's CUDA backend.
//!
//! - [`runtime`]: the guarded load of `libcuda` and `libnvrtc` ([`probe`] never panics), and
//!   [`Gpu`], one device's context, stream, facts, kernel cache and memory pool;
//! - [`compile`]: NVRTC compiles with the Kiln prelude, and the on-disk cache of images;
//! - [`kernels`]: the registry of every kernel source (`kernels/*.cu`);
//! - [`facts`]: the driver's device attributes and the device files (`devices/sm_XX.toml`);
//! - [`memory`]: the device memory pool, `DeviceMemory` as tensor storage, host/device copies.
//!
//! Compiling and launching a kernel:
//!
//! ```no_run
//! use cudarc::driver::LaunchConfig;
//! use kiln_cuda::{kernels, Gpu};
//!
//! let gpu = Gpu::open(0)?;
//! let function = gpu.function(&kernels::COPY, "fill_u32", &[])?;
//! let n = 1024u64;
//! let out = gpu.alloc(4 * n as usize)?;
//! let (ptr, pattern) = (out.device_ptr(), 7u32);
//! let mut launch = gpu.launch_builder(&function);
//! launch.arg(&ptr).arg(&pattern).arg(&n);
//! // SAFETY: fill_u32(u32* dst, u32 pattern, u64 n) writes n words, and `out` holds n words.
//! unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }
//!     .map_err(|e| kiln_cuda::runtime::driver_error("cuLaunchKernel", e))?;
//! let words = out.to_host_bytes()?;
//! # Ok::<(), kiln_core::Error>(())
//! ```

pub mod blas;
pub mod certify;
pub mod compile;
pub mod facts;
pub mod kernels;
pub mod launch;
pub mod memory;
mod nvrtc;
pub mod ops;
pub mod runtime;

pub use compile::{Arch, CompileOptions, CompiledKernel, KernelCache, KernelResources, KernelSource};
pub use facts::{DeviceFacts, DeviceFile};
pub use launch::Launch;
pub use memory::{DeviceMemory, DeviceView, MemoryPool, PoolStats};
pub use nvrtc::{compile_calls as nvrtc_compile_calls, version as nvrtc_version, LIBNVRTC_FIX};
pub use runtime::{compile_only, device_count, probe, Gpu, LibraryProbe, Probe};

/// `cudarc`, re-exported so kernel launchers use the same version (`LaunchConfig`,
/// `PushKernelArg`, `CudaFunction`).
pub use cudarc;
