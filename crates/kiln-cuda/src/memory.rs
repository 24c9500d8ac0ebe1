//! Device memory: a pool of plain `cuMemAlloc` blocks in size classes, reused in stream order,
//! with statistics and a named out-of-memory error; [`DeviceMemory`] as a [`Tensor`]'s storage;
//! copies between host and device.
//!
//! All of Kiln's work on a device is ordered on one stream ([`Gpu::stream`]), so a block given
//! back to the pool can be handed out again at once: any later use is ordered after the earlier
//! one on that stream. Work on another stream must synchronize before it drops its blocks.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{result as driver, CudaContext, CudaStream};
use kiln_core::{DeviceBuffer, Error, Result, Storage, Tensor};
use serde::Serialize;

use crate::runtime::{driver_error, poisoned, Gpu};

/// Blocks up to this size round up to a power of two.
const SMALL_LIMIT_BYTES: usize = 1 << 20;
/// The smallest block.
const MIN_BLOCK_BYTES: usize = 256;

/// The block size a request of `bytes` is served from: powers of two up to 1 MiB (at least
/// 256 bytes), then multiples of an eighth of the power of two below, so a large block wastes
/// less than 12.5%.
pub fn size_class(bytes: usize) -> usize {
    if bytes <= SMALL_LIMIT_BYTES {
        return bytes.max(MIN_BLOCK_BYTES).next_power_of_two();
    }
    let granule = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 8;
    bytes.div_ceil(granule).saturating_mul(granule)
}

/// The pool's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Bytes of blocks handed out and not yet given back (by block size).
    pub live_bytes: u64,
    /// Bytes of blocks held for reuse.
    pub pooled_bytes: u64,
    /// The most `live_bytes` has been.
    pub peak_live_bytes: u64,
    /// The most the pool has held from the driver (live and pooled).
    pub peak_reserved_bytes: u64,
    /// Requests served by a pooled block.
    pub hits: u64,
    /// Requests that went to the driver.
    pub misses: u64,
}

#[derive(Default)]
struct PoolState {
    free: BTreeMap<usize, Vec<u64>>,
    stats: PoolStats,
}

struct PoolInner {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    state: Mutex<PoolState>,
}

/// A pool of device memory on one device.
#[derive(Clone)]
pub struct MemoryPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryPool(cuda:{} {:?})", self.inner.ordinal, self.stats())
    }
}

impl MemoryPool {
    pub(crate) fn new(context: Arc<CudaContext>, stream: Arc<CudaStream>, ordinal: usize) -> MemoryPool {
        MemoryPool { inner: Arc::new(PoolInner { context, stream, ordinal, state: Mutex::default() }) }
    }

    /// The pool's counters now.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock().map(|s| s.stats.clone()).unwrap_or_default()
    }

    /// Uninitialised device memory of at least `bytes` bytes (`len_bytes()` is `bytes`).
    ///
    /// A request the driver cannot serve first gives every pooled block back to the driver and
    /// tries again; if that fails too, the error names the request, the live and pooled bytes at
    /// the time of the request, and what the driver has free. The pool stays usable.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        let class = size_class(bytes);
        let mut state = self.inner.state.lock().map_err(|_| poisoned("memory pool"))?;
        let reused = state.free.get_mut(&class).and_then(Vec::pop);
        let ptr = match reused {
            Some(ptr) => {
                state.stats.pooled_bytes -= class as u64;
                state.stats.hits += 1;
                ptr
            }
            None => {
                let ptr = match self.inner.driver_alloc(class) {
                    Ok(ptr) => ptr,
                    Err(DriverAlloc::OutOfMemory) => {
                        let pooled_at_request = state.stats.pooled_bytes;
                        self.inner.release_pooled(&mut state)?;
                        match self.inner.driver_alloc(class) {
                            Ok(ptr) => ptr,
                            Err(DriverAlloc::OutOfMemory) => {
                                let driver_free_bytes = self.inner.driver_free_bytes()?;
                                return Err(Error::OutOfMemory {
                                    requested_bytes: bytes as u64,
                                    live_bytes: state.stats.live_bytes,
                                    pooled_bytes: pooled_at_request,
                                    driver_free_bytes,
                                });
                            }
                            Err(DriverAlloc::Other(e)) => return Err(e),
                        }
                    }
                    Err(DriverAlloc::Other(e)) => return Err(e),
                };
                state.stats.misses += 1;
                ptr
            }
        };
        let stats = &mut state.stats;
        stats.live_bytes += class as u64;
        stats.peak_live_bytes = stats.peak_live_bytes.max(stats.live_bytes);
        stats.peak_reserved_bytes = stats.peak_reserved_bytes.max(stats.live_bytes + stats.pooled_bytes);
        Ok(DeviceMemory { ptr, len_bytes: bytes, class_bytes: class, pool: self.inner.clone() })
    }

    /// Bytes the driver reports free on the device now (`cuMemGetInfo`), pooled blocks not counted.
    pub fn device_free_bytes(&self) -> Result<u64> {
        self.inner.driver_free_bytes()
    }

    /// Gives every pooled block back to the driver.
    pub fn release_pooled(&self) -> Result<()> {
        let mut state = self.inner.state.lock().map_err(|_| poisoned("memory pool"))?;
        self.inner.release_pooled(&mut state)
    }
}

enum DriverAlloc {
    OutOfMemory,
    Other(Error),
}

impl PoolInner {
    fn driver_alloc(&self, bytes: usize) -> std::result::Result<u64, DriverAlloc> {
        self.context.bind_to_thread().map_err(|e| DriverAlloc::Other(driver_error("cuCtxSetCurrent", e)))?;
        // SAFETY: the context is current; the block is plain device memory that Kiln owns until
        // `cuMemFree`, and nothing reads it before it is written.
        match unsafe { driver::malloc_sync(bytes) } {
            Ok(ptr) => Ok(ptr),
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(DriverAlloc::OutOfMemory),
            Err(e) => Err(DriverAlloc::Other(driver_error("cuMemAlloc", e))),
        }
    }

    fn driver_free_bytes(&self) -> Result<u64> {
        self.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let (free, _total) = driver::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(free as u64)
    }

    fn release_pooled(&self, state: &mut PoolState) -> Result<()> {
        if state.free.is_empty() {
            return Ok(());
        }
        // Pooled blocks may still be read by work queued before they were given back.
        self.stream.synchronize().map_err(|e| driver_error("cuStreamSynchronize", e))?;
        self.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        for (class, ptrs) in std::mem::take(&mut state.free) {
            for ptr in ptrs {
                // SAFETY: `ptr` came from cuMemAlloc, is in no one's hands (it was pooled), and
                // the stream that used it last has finished.
                unsafe { driver::free_sync(ptr) }.map_err(|e| driver_error("cuMemFree", e))?;
                state.stats.pooled_bytes -= class as u64;
            }
        }
        Ok(())
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        if let Ok(state) = self.state.get_mut() {
            let mut taken = std::mem::take(state);
            if let Err(e) = self.release_pooled(&mut taken) {
                tracing::warn!("releasing the memory pool of cuda:{}: {e}", self.ordinal);
            }
        }
    }
}

/// A block of device memory from the pool, given back when dropped. Reads and writes through it
/// are ordered on the device's stream.
pub struct DeviceMemory {
    ptr: u64,
    len_bytes: usize,
    class_bytes: usize,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory(cuda:{} {:#x}, {} bytes)", self.pool.ordinal, self.ptr, self.len_bytes)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(mut state) = self.pool.state.lock() {
            state.free.entry(self.class_bytes).or_default().push(self.ptr);
            state.stats.live_bytes -= self.class_bytes as u64;
            state.stats.pooled_bytes += self.class_bytes as u64;
        }
    }
}

impl DeviceMemory {
    /// The device address, to pass to a kernel (`.arg(&memory.device_ptr())`).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The bytes asked for.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    fn check_range(&self, op: &'static str, offset_bytes: usize, len: usize) -> Result<()> {
        match offset_bytes.checked_add(len) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(Error::OutOfBounds {
                op,
                what: "byte range end",
                value: offset_bytes as u64 + len as u64,
                limit: self.len_bytes as u64,
            }),
        }
    }

    fn stream(&self) -> &CudaStream {
        &self.pool.stream
    }

    fn sync(&self) -> Result<()> {
        self.stream().synchronize().map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    /// Copies `src` to the device at `offset_bytes`; returns when the copy is done.
    pub fn copy_from_host(&self, offset_bytes: usize, src: &[u8]) -> Result<()> {
        self.check_range("copy_from_host", offset_bytes, src.len())?;
        self.pool.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: the range was checked against this block; `src` outlives the copy because the
        // stream is synchronized before returning.
        unsafe { driver::memcpy_htod_async(self.ptr + offset_bytes as u64, src, self.stream().cu_stream()) }
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        self.sync()
    }

    /// Copies `dst.len()` bytes from `offset_bytes` to the host, after all queued work.
    pub fn copy_to_host(&self, offset_bytes: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range("copy_to_host", offset_bytes, dst.len())?;
        self.pool.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: the range was checked; `dst` is written only by this copy, which has finished
        // when the stream synchronizes below.
        unsafe { driver::memcpy_dtoh_async(dst, self.ptr + offset_bytes as u64, self.stream().cu_stream()) }
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
        self.sync()
    }

    /// The whole block, copied to the host.
    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len_bytes];
        self.copy_to_host(0, &mut out)?;
        Ok(out)
    }

    /// Queues a copy of all of `src` into this block at offset 0 (no wait).
    pub fn copy_from_device(&self, src: &DeviceMemory) -> Result<()> {
        self.check_range("copy_from_device", 0, src.len_bytes)?;
        self.pool.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: both ranges are within their blocks, and both blocks stay allocated until the
        // copy has run (the pool reuses blocks only in stream order).
        unsafe { driver::memcpy_dtod_async(self.ptr, src.ptr, src.len_bytes, self.stream().cu_stream()) }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))
    }

    /// Queues setting every byte to `value` (tests poison outputs with it; no wait).
    pub fn fill_bytes(&self, value: u8) -> Result<()> {
        self.pool.context.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: the range is exactly this block.
        unsafe { driver::memset_d8_async(self.ptr, value, self.len_bytes, self.stream().cu_stream()) }
            .map_err(|e| driver_error("cuMemsetD8Async", e))
    }
}

/// A byte range of device memory that something else owns (a tensor inside a weight arena, an
/// activation inside a planned slab): what a launcher needs to pass an address and check a length.
///
/// A view does not keep its memory alive; the owner must outlive every launch that uses it
/// (launchers document this in their SAFETY notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceView {
    pub ptr: u64,
    pub len_bytes: usize,
}

impl DeviceView {
    /// The view of `len` bytes from `offset`, `Error::OutOfBounds` past the end.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len_bytes => {
                Ok(DeviceView { ptr: self.ptr + offset as u64, len_bytes: len })
            }
            _ => Err(Error::OutOfBounds {
                op: "device view",
                what: "byte range end",
                value: offset as u64 + len as u64,
                limit: self.len_bytes as u64,
            }),
        }
    }
}

impl DeviceMemory {
    /// The whole block as a view.
    pub fn view(&self) -> DeviceView {
        DeviceView { ptr: self.ptr, len_bytes: self.len_bytes }
    }

    /// The view of `len` bytes from `offset`, `Error::OutOfBounds` past the end.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView> {
        self.view().slice(offset, len)
    }
}

impl From<&DeviceMemory> for DeviceView {
    fn from(memory: &DeviceMemory) -> DeviceView {
        memory.view()
    }
}

impl DeviceBuffer for DeviceMemory {
    fn device_name(&self) -> String {
        format!("cuda:{}", self.pool.ordinal)
    }
    fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    fn copy_to_host(&self, offset_bytes: usize, dst: &mut [u8]) -> Result<()> {
        DeviceMemory::copy_to_host(self, offset_bytes, dst)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A device copy of a host tensor (made contiguous first), in memory from `gpu`'s pool.
pub fn upload(gpu: &Gpu, tensor: &Tensor) -> Result<Tensor> {
    let host = tensor.to_host()?;
    let bytes = host.host_bytes()?;
    let memory = gpu.alloc(bytes.len())?;
    memory.copy_from_host(0, bytes)?;
    Tensor::from_device_buffer(Arc::new(memory), host.dtype(), host.shape())
}

/// An empty (uninitialised) device tensor of `dtype` and `shape`.
pub fn empty(gpu: &Gpu, dtype: kiln_core::DType, shape: &[usize]) -> Result<Tensor> {
    let elements = kiln_core::tensor::element_count(shape, dtype)?;
    let bytes = usize::try_from(dtype.bytes_for(elements as u64)?).map_err(|_| Error::SizeOverflow {
        shape: shape.iter().map(|&d| d as u64).collect(),
        dtype: dtype.name(),
    })?;
    Tensor::from_device_buffer(Arc::new(gpu.alloc(bytes)?), dtype, shape)
}

/// The device address of a contiguous CUDA tensor's first element, for a kernel argument.
pub fn device_ptr(tensor: &Tensor) -> Result<u64> {
    let Storage::Device(buffer) = tensor.storage() else {
        return Err(Error::NotServed { op: "device_ptr", reason: "the tensor lives on the host".into() });
    };
    let memory = buffer.as_any().downcast_ref::<DeviceMemory>().ok_or_else(|| Error::NotServed {
        op: "device_ptr",
        reason: format!("the tensor's storage on {} is not Kiln CUDA memory", buffer.device_name()),
    })?;
    if !tensor.is_contiguous() {
        return Err(Error::NotContiguous {
            op: "device_ptr",
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
        });
    }
    let offset = tensor.dtype().bytes_for(tensor.offset() as u64)?;
    Ok(memory.device_ptr() + offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
        for bytes in [3_000_000usize, 123_456_789, 4 << 30, (4 << 30) + 1] {
            let class = size_class(bytes);
            assert!(class >= bytes, "{bytes} -> {class}");
            assert!((class - bytes) as f64 <= bytes as f64 * 0.125, "{bytes} -> {class}");
        }
        assert!(size_class(usize::MAX - 5) >= usize::MAX / 2);
    }
}
