//! Matrix products of the prefill path through cuBLAS, loaded at run time.
//!
//! `out[n][m] (fp32) (+)= x[n][k] · W[m][k]^T` with `x` and `W` in the same 16-bit type (bf16 or
//! fp16), fp32 accumulation. Row-major on our side; cuBLAS sees the column-major transpose:
//! `out^T = W^T^T · x^T`, i.e. `gemm(T, N, m, n, k, W, lda = k, x, ldb = k, out, ldc = m)`.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys, CudaBlas};
use kiln_core::{DType, Error, Result};

use crate::memory::DeviceView;
use crate::runtime::Gpu;

/// What to install when cuBLAS is missing.
pub const LIBCUBLAS_FIX: &str = "install the CUDA toolkit's cuBLAS (libcublas.so.13, e.g. `pip install \
     nvidia-cublas`) and add its folder to LD_LIBRARY_PATH";

/// A cuBLAS handle on the device's stream.
pub struct Blas {
    handle: CudaBlas,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas(cuBLAS)")
    }
}

fn blas_error(call: &'static str, error: cudarc::cublas::result::CublasError) -> Error {
    Error::NotServed { op: "cuBLAS", reason: format!("{call}: {error:?}") }
}

impl Blas {
    /// Whether libcublas can be loaded (never panics).
    pub fn available() -> bool {
        // SAFETY: only tries to open the library under cudarc's candidate names.
        unsafe { sys::is_culib_present() }
    }

    /// A handle bound to `gpu`'s stream; `Error::CudaLibraryMissing` when libcublas is absent.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Blas> {
        if !Self::available() {
            return Err(Error::CudaLibraryMissing {
                library: "libcublas",
                detail: "not found under cudarc's names (libcublas.so, libcublas.so.13, ...)".into(),
                fix: LIBCUBLAS_FIX,
            });
        }
        let handle = CudaBlas::new(gpu.stream().clone()).map_err(|e| blas_error("cublasCreate", e))?;
        Ok(Blas { handle })
    }

    /// `out[n][m] = x[n][k] · W[m][k]^T`, or `+=` with `accumulate`; `dtype` is the type of both
    /// `x` and `W` (BF16 or F16), `out` fp32.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        dtype: DType,
        w: DeviceView,
        x: DeviceView,
        out: DeviceView,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        let data_type = match dtype {
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "cuBLAS gemm" }),
        };
        crate::ops::check_buffer("gemm", "weight", w.len_bytes, m * k * 2)?;
        crate::ops::check_buffer("gemm", "x", x.len_bytes, n * k * 2)?;
        crate::ops::check_buffer("gemm", "out", out.len_bytes, n * m * 4)?;
        let int = |what: &'static str, v: usize| {
            i32::try_from(v).map_err(|_| Error::NotServed {
                op: "cuBLAS gemm",
                reason: format!("{what} {v} does not fit in 31 bits"),
            })
        };
        let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0f32 };
        // SAFETY: the three buffers were checked to hold m*k, n*k and n*m elements of their types;
        // the handle is bound to the device's stream, which orders the product after the writes
        // of x and before any later use of out; alpha and beta live until the call returns (cuBLAS
        // reads host scalars during the call in the default pointer mode).
        unsafe {
            cublas::gemm_ex(
                *self.handle.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                (&alpha as *const f32).cast(),
                w.ptr as *const std::ffi::c_void,
                data_type,
                ki,
                x.ptr as *const std::ffi::c_void,
                data_type,
                ki,
                (&beta as *const f32).cast(),
                out.ptr as *mut std::ffi::c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                mi,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas_error("cublasGemmEx", e))
    }
}
