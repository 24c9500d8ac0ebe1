//! `kiln-core`: the types every part of Kiln uses, and the CPU reference of every operation.
//!
//! - [`DType`] and its table (`dtypes.toml`), [`Tensor`] over host or device storage;
//! - [`Error`], the one error enum, whose variants name the thing and its value;
//! - `ops`: the CPU reference operations, the specification every GPU kernel matches.
//!
//! ```
//! use kiln_core::{DType, Tensor};
//! let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! assert_eq!(t.narrow(0, 1, 1)?.to_f32_vec()?, vec![3.0, 4.0]);
//! assert_eq!(DType::from_gguf(3)?, DType::Q4_1);
//! # Ok::<(), kiln_core::Error>(())
//! ```

pub mod dtype;
pub mod error;
pub mod ops;
pub mod tensor;
pub mod tuning;

pub use dtype::DType;
pub use error::{Error, GgufErrorKind, Result, ResultExt};
pub use tensor::{DeviceBuffer, Element, HostBuffer, Storage, Tensor};
