//! `Tensor`: a dtype, a layout (shape, strides, offset, in elements) and a storage that is either
//! host memory or a device buffer owned by a backend crate.
//!
//! Views share storage: [`Tensor::narrow`] and [`Tensor::reshape`] of a contiguous tensor cost no
//! copy. Host buffers are 16-byte aligned, so a slice of any plain element type can be borrowed
//! from them without copying.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// A plain element type that host tensors can hold and hand out as slices.
pub trait Element: Copy + Send + Sync + 'static + fmt::Debug {
    /// The dtype of this element type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f64 => F64, f32 => F32, f16 => F16, bf16 => BF16, i8 => I8, i16 => I16, i32 => I32,
         i64 => I64, u8 => U8, u16 => U16, u32 => U32, u64 => U64);

/// Host bytes with 16-byte alignment.
#[derive(Clone)]
pub struct HostBuffer {
    words: Vec<u128>,
    len_bytes: usize,
}

impl HostBuffer {
    /// A zeroed buffer of `len_bytes` bytes.
    pub fn zeroed(len_bytes: usize) -> HostBuffer {
        HostBuffer { words: vec![0u128; len_bytes.div_ceil(16)], len_bytes }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> HostBuffer {
        let mut buffer = HostBuffer::zeroed(bytes.len());
        buffer.as_bytes_mut().copy_from_slice(bytes);
        buffer
    }

    /// The buffer's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `words` owns at least `len_bytes` initialised bytes; u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len_bytes) }
    }

    /// The buffer's bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len_bytes) }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({} bytes)", self.len_bytes)
    }
}

/// Reinterprets aligned bytes as a slice of plain elements.
fn cast_slice<T: Element>(bytes: &[u8]) -> Result<&[T]> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return Err(Error::InvalidArgument {
            name: "bytes",
            value: format!("{} bytes at {:p}", bytes.len(), bytes.as_ptr()),
            reason: format!("not a whole, aligned slice of {}", T::DTYPE),
        });
    }
    // SAFETY: length and alignment were checked; every bit pattern is a valid value of the
    // plain numeric types that implement `Element`.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// A buffer in device memory, implemented by a backend crate (`kiln-cuda`).
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    /// The device, in words (`"cuda:0"`).
    fn device_name(&self) -> String;
    /// Length in bytes.
    fn len_bytes(&self) -> usize;
    /// Copies `dst.len()` bytes starting at `offset_bytes` to the host.
    fn copy_to_host(&self, offset_bytes: usize, dst: &mut [u8]) -> Result<()>;
    /// The backend's own type, for downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// Where a tensor's bytes live.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Host memory.
    Host(Arc<HostBuffer>),
    /// Device memory owned by a backend.
    Device(Arc<dyn DeviceBuffer>),
}

/// A tensor: dtype, shape, strides and offset (in elements; in blocks' elements for quantized
/// types, whose innermost dimension must stay whole blocks) over shared storage.
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Storage,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The element count of `shape`, checked for overflow.
pub fn element_count(shape: &[usize], dtype: DType) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| Error::SizeOverflow {
        shape: shape.iter().map(|&d| d as u64).collect(),
        dtype: dtype.name(),
    })
}

impl Tensor {
    /// A host tensor over `buffer`, which must hold exactly `shape` of `dtype`.
    pub fn from_host_buffer(buffer: HostBuffer, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let elements = element_count(shape, dtype)?;
        let expected = dtype.bytes_for(elements as u64)?;
        if expected != buffer.len_bytes() as u64 {
            return Err(Error::ByteLength {
                what: format!("{dtype} tensor of shape {shape:?}"),
                expected,
                got: buffer.len_bytes() as u64,
            });
        }
        Ok(Tensor {
            storage: Storage::Host(Arc::new(buffer)),
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        })
    }

    /// A host tensor holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_host_buffer(HostBuffer::from_bytes(bytes), dtype, shape)
    }

    /// A host tensor of plain elements.
    pub fn from_slice<T: Element>(values: &[T], shape: &[usize]) -> Result<Tensor> {
        let len = std::mem::size_of_val(values);
        // SAFETY: plain numeric elements have no padding; the slice is `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), len) };
        Tensor::from_bytes(bytes, T::DTYPE, shape)
    }

    /// A zeroed host tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let elements = element_count(shape, dtype)?;
        let bytes = usize::try_from(dtype.bytes_for(elements as u64)?).map_err(|_| Error::SizeOverflow {
            shape: shape.iter().map(|&d| d as u64).collect(),
            dtype: dtype.name(),
        })?;
        Tensor::from_host_buffer(HostBuffer::zeroed(bytes), dtype, shape)
    }

    /// A tensor over a device buffer; the backend guarantees the buffer holds the shape.
    pub fn from_device_buffer(
        buffer: Arc<dyn DeviceBuffer>,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let elements = element_count(shape, dtype)?;
        let expected = dtype.bytes_for(elements as u64)?;
        if expected > buffer.len_bytes() as u64 {
            return Err(Error::ByteLength {
                what: format!("{dtype} device tensor of shape {shape:?}"),
                expected,
                got: buffer.len_bytes() as u64,
            });
        }
        Ok(Tensor {
            storage: Storage::Device(buffer),
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether the tensor lives in host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.storage, Storage::Host(_))
    }

    /// Whether elements are laid out row-major with no gaps (step 1 in the last dimension).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&dim, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if dim != 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(dim);
        }
        true
    }

    fn byte_range(&self) -> Result<(usize, usize)> {
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: "byte view",
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            });
        }
        let start = self.dtype.bytes_for(self.offset as u64)? as usize;
        let len = self.dtype.bytes_for(self.elements() as u64)? as usize;
        Ok((start, start + len))
    }

    /// The bytes of a contiguous host tensor.
    pub fn host_bytes(&self) -> Result<&[u8]> {
        let (start, end) = self.byte_range()?;
        match &self.storage {
            Storage::Host(buffer) => Ok(&buffer.as_bytes()[start..end]),
            Storage::Device(buffer) => Err(Error::NotServed {
                op: "host_bytes",
                reason: format!("tensor lives on {}; copy it to the host first", buffer.device_name()),
            }),
        }
    }

    /// The elements of a contiguous host tensor of type `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        if self.dtype != T::DTYPE {
            return Err(Error::InvalidArgument {
                name: "dtype",
                value: self.dtype.to_string(),
                reason: format!("expected {}", T::DTYPE),
            });
        }
        cast_slice(self.host_bytes()?)
    }

    /// A contiguous host copy of this tensor (a copy from the device when it lives there).
    pub fn to_host(&self) -> Result<Tensor> {
        match &self.storage {
            Storage::Host(_) => self.contiguous(),
            Storage::Device(buffer) => {
                let (start, end) = self.byte_range()?;
                let mut host = HostBuffer::zeroed(end - start);
                buffer.copy_to_host(start, host.as_bytes_mut())?;
                Tensor::from_host_buffer(host, self.dtype, &self.shape)
            }
        }
    }

    /// A contiguous copy of a host tensor (the same storage when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let Storage::Host(buffer) = &self.storage else {
            return Err(Error::NotServed { op: "contiguous", reason: "strided device tensors".into() });
        };
        let Some(size) = self.dtype.size_in_bytes() else {
            return Err(Error::NotContiguous {
                op: "contiguous copy of a quantized tensor",
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            });
        };
        let src = buffer.as_bytes();
        let mut out = HostBuffer::zeroed(self.elements() * size);
        let dst = out.as_bytes_mut();
        let mut index = vec![0usize; self.rank()];
        for i in 0..self.elements() {
            let mut linear = self.offset;
            for (&ix, &stride) in index.iter().zip(&self.strides) {
                linear += ix * stride;
            }
            dst[i * size..(i + 1) * size].copy_from_slice(&src[linear * size..(linear + 1) * size]);
            for d in (0..self.rank()).rev() {
                index[d] += 1;
                if index[d] < self.shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Tensor::from_host_buffer(out, self.dtype, &self.shape)
    }

    /// The view of `len` indices of dimension `dim` starting at `start`; no copy.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let Some(&size) = self.shape.get(dim) else {
            return Err(Error::OutOfBounds {
                op: "narrow",
                what: "dimension",
                value: dim as u64,
                limit: self.rank() as u64,
            });
        };
        let end = start.checked_add(len).filter(|&e| e <= size).ok_or(Error::OutOfBounds {
            op: "narrow",
            what: "end index",
            value: start as u64 + len as u64,
            limit: size as u64,
        })?;
        let _ = end;
        if self.dtype.is_quantized()
            && dim + 1 == self.rank()
            && (!(start as u64).is_multiple_of(self.dtype.block_size())
                || !(len as u64).is_multiple_of(self.dtype.block_size()))
        {
            return Err(Error::NotBlockAligned {
                dtype: self.dtype.name(),
                elements: start as u64,
                block_size: self.dtype.block_size(),
            });
        }
        let mut view = self.clone();
        view.offset += start * self.strides[dim];
        view.shape[dim] = len;
        Ok(view)
    }

    /// The same elements under a new shape; the tensor must be contiguous. No copy.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if element_count(shape, self.dtype)? != self.elements() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                expected: self.shape.clone(),
                got: shape.to_vec(),
            });
        }
        if !self.is_contiguous() {
            return Err(Error::NotContiguous {
                op: "reshape",
                shape: self.shape.clone(),
                strides: self.strides.clone(),
            });
        }
        let mut view = self.clone();
        view.shape = shape.to_vec();
        view.strides = contiguous_strides(shape);
        Ok(view)
    }

    /// The elements widened to f32 (plain float and integer types; quantized types are
    /// dequantized by the format readers, not here).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let host = self.to_host()?;
        let bytes = host.host_bytes()?;
        Ok(match self.dtype {
            DType::F32 => cast_slice::<f32>(bytes)?.to_vec(),
            DType::F64 => cast_slice::<f64>(bytes)?.iter().map(|&v| v as f32).collect(),
            DType::F16 => cast_slice::<f16>(bytes)?.iter().map(|v| v.to_f32()).collect(),
            DType::BF16 => cast_slice::<bf16>(bytes)?.iter().map(|v| v.to_f32()).collect(),
            DType::I8 => cast_slice::<i8>(bytes)?.iter().map(|&v| f32::from(v)).collect(),
            DType::U8 | DType::BOOL => bytes.iter().map(|&v| f32::from(v)).collect(),
            DType::I32 => cast_slice::<i32>(bytes)?.iter().map(|&v| v as f32).collect(),
            DType::I64 => cast_slice::<i64>(bytes)?.iter().map(|&v| v as f32).collect(),
            other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "to_f32_vec" }),
        })
    }

    /// A host copy converted to `dtype` among the float types, rounding to nearest even.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return self.to_host();
        }
        let values = self.to_f32_vec()?;
        match dtype {
            DType::F32 => Tensor::from_slice(&values, &self.shape),
            DType::F64 => {
                Tensor::from_slice(&values.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &self.shape)
            }
            DType::F16 => {
                Tensor::from_slice(&values.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(), &self.shape)
            }
            DType::BF16 => Tensor::from_slice(
                &values.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                &self.shape,
            ),
            other => Err(Error::DTypeNotServed { dtype: other.name(), op: "to_dtype" }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_is_a_view_and_contiguous_copies() {
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let t = Tensor::from_slice(&values, &[2, 3, 4]).unwrap();
        let v = t.narrow(2, 1, 2).unwrap();
        assert!(!v.is_contiguous());
        let c = v.contiguous().unwrap();
        assert_eq!(c.as_slice::<f32>().unwrap(), &[1., 2., 5., 6., 9., 10., 13., 14., 17., 18., 21., 22.]);
        let rows = t.narrow(1, 1, 1).unwrap().contiguous().unwrap();
        assert_eq!(rows.as_slice::<f32>().unwrap(), &[4., 5., 6., 7., 16., 17., 18., 19.]);
    }

    #[test]
    fn narrow_out_of_bounds_is_named() {
        let t = Tensor::zeros(DType::F32, &[4, 4]).unwrap();
        assert!(matches!(
            t.narrow(1, 3, 2),
            Err(Error::OutOfBounds { what: "end index", value: 5, limit: 4, .. })
        ));
        assert!(matches!(t.narrow(2, 0, 1), Err(Error::OutOfBounds { what: "dimension", .. })));
    }

    #[test]
    fn casts_round_to_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values; ties go to the even one (1.0).
        let t = Tensor::from_slice(&[1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], &[2]).unwrap();
        let b = t.to_dtype(DType::BF16).unwrap();
        let back = b.to_f32_vec().unwrap();
        assert_eq!(back, vec![1.0, 1.0 + 4.0 / 256.0]);
    }

    #[test]
    fn byte_length_is_checked() {
        let err = Tensor::from_bytes(&[0u8; 7], DType::F32, &[2]).unwrap_err();
        assert!(matches!(err, Error::ByteLength { expected: 8, got: 7, .. }));
        let q = Tensor::zeros(DType::Q4_1, &[2, 64]).unwrap();
        assert_eq!(q.host_bytes().unwrap().len(), 80);
        assert!(matches!(Tensor::zeros(DType::Q4_1, &[3, 33]), Err(Error::NotBlockAligned { .. })));
    }
}
