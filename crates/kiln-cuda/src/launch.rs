//! Kernel launches that may overlap the kernel before them (programmatic dependent launch).
//!
//! A decode step is hundreds of short kernels in a row; between two of them the GPU drains the
//! first, then starts the second, and the second's first loads of weights start from an idle
//! memory system. On sm_90 and later [`Launch`] lets each kernel start while the one before it is
//! finishing: its blocks request what no kernel writes (weights) and then wait, in the kernel,
//! with `kiln_wait_prior()` (the prelude) until the kernels before it have finished and their
//! writes are visible. Every Kiln kernel calls it in every thread before touching anything an
//! earlier kernel may write (the compile test checks the sources), so with the default hand-off
//! below a kernel launched this way reads the same data, and gives the same bits, as one launched
//! the ordinary way (`tests/gpu_engine`, `gpu_parity`). CUDA graph capture records the overlap as
//! a programmatic edge, so captured decode steps keep it.
//!
//! Overlap is on by default where the device supports it; [`crate::Gpu::set_overlap_launches`]
//! or `KILN_OVERLAP_LAUNCHES=0` turns it off (every launch then waits for the one before it).
//!
//! When the next kernel may start is the kernels' `KILN_HANDOFF` (the prelude): by default once
//! every block of the kernel before it has exited, so that no block of the next kernel shares a
//! multiprocessor with one of the kernel before it. `KILN_LAUNCH_HANDOFF=fence` or `early`
//! compiles the kernels to let the next one start as soon as every block has passed its wait
//! (with or without an acquire fence after the wait): for measurement only. On an H200 the early
//! hand-off broke the default model's decode (`gpu_parity`: logits off by more than the largest
//! logit within a few steps, while the default hand-off and serial launches agree with the CPU
//! to 1e-2), most likely through lines of the residual stream that blocks of the accumulating
//! product had cached in a multiprocessor's L1 and the next kernel's blocks on it then read.

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{sys, CudaFunction, DeviceRepr, DriverError, LaunchConfig};

use crate::Gpu;

/// The environment variable that turns overlapping launches off (`0`).
pub const OVERLAP_ENV: &str = "KILN_OVERLAP_LAUNCHES";

/// The environment variable that picks the kernels' hand-off (`exit`, `fence`, `early`).
pub const HANDOFF_ENV: &str = "KILN_LAUNCH_HANDOFF";

/// The `KILN_HANDOFF` define for every kernel compile, when the environment asks for a hand-off
/// other than the default (`exit`).
pub(crate) fn handoff_define() -> Option<&'static str> {
    match std::env::var(HANDOFF_ENV).ok()?.trim() {
        "fence" => Some("1"),
        "early" => Some("2"),
        _ => None,
    }
}

/// The environment variable that turns the cluster combine of split decode attention off (`0`).
pub const CLUSTER_COMBINE_ENV: &str = "KILN_CLUSTER_COMBINE";

/// Whether a device of compute capability `major`.x has thread block clusters, and the
/// environment does not turn the cluster combine off.
pub(crate) fn cluster_combine_default(major: u32) -> bool {
    major >= 9 && std::env::var(CLUSTER_COMBINE_ENV).map_or(true, |v| v.trim() != "0")
}

/// Whether a device of compute capability `major`.x can overlap launches, and the environment
/// does not turn it off.
pub(crate) fn overlap_default(major: u32) -> bool {
    major >= 9 && std::env::var(OVERLAP_ENV).map_or(true, |v| v.trim() != "0")
}

/// The arguments of one launch of a kernel on [`Gpu::stream`], pushed in the kernel's parameter
/// order ([`Gpu::launch_builder`]).
pub struct Launch<'a> {
    gpu: &'a Gpu,
    function: &'a CudaFunction,
    args: Vec<*mut c_void>,
    cluster: Option<(u32, u32, u32)>,
    _values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    pub(crate) fn new(gpu: &'a Gpu, function: &'a CudaFunction) -> Launch<'a> {
        Launch { gpu, function, args: Vec::with_capacity(16), cluster: None, _values: PhantomData }
    }

    /// Launches the grid as thread block clusters of `dims` blocks (sm_90 and later; each grid
    /// dimension a multiple of the cluster's).
    pub fn cluster(&mut self, dims: (u32, u32, u32)) -> &mut Self {
        self.cluster = Some(dims);
        self
    }

    /// The next kernel parameter: a plain value (a device pointer is a `u64`).
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Queues the kernel on the GPU's stream, overlapping the kernel before it when the GPU
    /// allows ([`Gpu::overlaps_launches`]).
    ///
    /// # Safety
    ///
    /// The arguments must match the kernel's parameters in number, order and type, every pointer
    /// must hold what the kernel reads and writes for `config`, and the memory must stay alive
    /// until the stream has run the kernel. The kernel must call `kiln_wait_prior()` in every
    /// thread before it touches memory an earlier kernel may write.
    pub unsafe fn launch(&mut self, config: LaunchConfig) -> Result<(), DriverError> {
        self.gpu.context().bind_to_thread()?;
        // SAFETY: the union's other members are unused for these attribute ids; zeroed is valid.
        let mut attributes: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut count = 0usize;
        if self.gpu.overlaps_launches() {
            attributes[count].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attributes[count].value.programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if let Some((x, y, z)) = self.cluster {
            attributes[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attributes[count].value.clusterDim.x = x;
            attributes[count].value.clusterDim.y = y;
            attributes[count].value.clusterDim.z = z;
            count += 1;
        }
        let launch_config = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.gpu.stream().cu_stream(),
            attrs: attributes.as_mut_ptr(),
            numAttrs: count as u32,
        };
        // SAFETY: the configuration and attribute outlive the call; the function belongs to the
        // GPU's context; the caller vouches for the arguments (see above).
        unsafe {
            sys::cuLaunchKernelEx(
                &launch_config,
                self.function.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}
