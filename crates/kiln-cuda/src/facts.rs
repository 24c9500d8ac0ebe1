//! What Kiln knows about a device: the driver's attributes ([`DeviceFacts`]), and the published
//! figures of its architecture and product ([`DeviceFile`], `devices/sm_XX.toml`).
//!
//! A figure the driver cannot give (peak memory bandwidth, for one) comes from the device file.
//! A fact absent from its file is [`Error::MissingDeviceFact`], never a default.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as Attribute;
use cudarc::driver::CudaContext;
use kiln_core::{Error, Result};
use serde::{Deserialize, Serialize};

use crate::compile::Arch;
use crate::runtime::driver_error;

/// A device as the driver describes it.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceFacts {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, `(9, 0)` on Hopper.
    pub compute_capability: (u32, u32),
    pub arch: Arch,
    pub multiprocessors: u32,
    pub total_memory_bytes: u64,
    pub l2_cache_bytes: u64,
    pub shared_memory_per_block_bytes: u64,
    /// The most a block can ask for after raising its dynamic shared-memory limit.
    pub shared_memory_per_block_optin_bytes: u64,
    pub shared_memory_per_multiprocessor_bytes: u64,
    pub registers_per_block: u32,
    pub registers_per_multiprocessor: u32,
    pub max_threads_per_block: u32,
    pub max_threads_per_multiprocessor: u32,
    pub warp_size: u32,
    pub memory_bus_width_bits: u32,
    /// The CUDA version the driver supports (`13.0`).
    pub driver_cuda_version: String,
}

impl DeviceFacts {
    /// Asks the driver about the device of `context`.
    pub fn query(context: &Arc<CudaContext>) -> Result<DeviceFacts> {
        let attribute = |a: Attribute| -> Result<u32> {
            let value = context.attribute(a).map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
            u32::try_from(value).map_err(|_| Error::Driver {
                call: "cuDeviceGetAttribute",
                message: format!("{a:?} is negative ({value})"),
            })
        };
        let major = attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let mut version = 0;
        // SAFETY: cuDriverGetVersion writes one int; libcuda was found by the probe.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| driver_error("cuDriverGetVersion", e))?;
        Ok(DeviceFacts {
            ordinal: context.ordinal(),
            name: context.name().map_err(|e| driver_error("cuDeviceGetName", e))?,
            compute_capability: (major, minor),
            arch: Arch::from_compute_capability(major, minor),
            multiprocessors: attribute(Attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory_bytes: context.total_mem().map_err(|e| driver_error("cuDeviceTotalMem", e))? as u64,
            l2_cache_bytes: attribute(Attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.into(),
            shared_memory_per_block_bytes: attribute(
                Attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            )?
            .into(),
            shared_memory_per_block_optin_bytes: attribute(
                Attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?
            .into(),
            shared_memory_per_multiprocessor_bytes: attribute(
                Attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )?
            .into(),
            registers_per_block: attribute(Attribute::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK)?,
            registers_per_multiprocessor: attribute(
                Attribute::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
            )?,
            max_threads_per_block: attribute(Attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_threads_per_multiprocessor: attribute(
                Attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            )?,
            warp_size: attribute(Attribute::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
            memory_bus_width_bits: attribute(Attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
            driver_cuda_version: format!("{}.{}", version / 1000, (version % 1000) / 10),
        })
    }

    /// The device file of this device's architecture.
    pub fn device_file(&self) -> Result<DeviceFile> {
        DeviceFile::for_arch(self.arch)
    }
}

/// The published figures of one architecture, and of the products built on it.
#[derive(Clone, Debug, Deserialize)]
pub struct DeviceFile {
    /// `sm_90`.
    pub arch: String,
    /// Architecture-wide figures: `shared_memory_per_multiprocessor_bytes = 233472`.
    #[serde(default)]
    facts: BTreeMap<String, u64>,
    /// Per product, by the name the driver reports (`"NVIDIA H200"`): its own figures.
    #[serde(default)]
    products: BTreeMap<String, BTreeMap<String, f64>>,
}

const DEVICE_FILES: [(u32, &str); 4] = [
    (80, include_str!("../devices/sm_80.toml")),
    (86, include_str!("../devices/sm_86.toml")),
    (89, include_str!("../devices/sm_89.toml")),
    (90, include_str!("../devices/sm_90.toml")),
];

impl DeviceFile {
    /// The built-in device file of `arch`; an architecture without one is `MissingDeviceFact`.
    pub fn for_arch(arch: Arch) -> Result<DeviceFile> {
        let (_, text) = DEVICE_FILES
            .iter()
            .find(|(a, _)| *a == arch.0)
            .ok_or_else(|| Error::MissingDeviceFact { fact: "device file", arch: arch.to_string() })?;
        DeviceFile::parse(text, &format!("devices/{arch}.toml"))
    }

    /// Parses a device file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<DeviceFile> {
        toml::from_str(text).map_err(|e| Error::InvalidArgument {
            name: "device file",
            value: origin.to_owned(),
            reason: e.to_string(),
        })
    }

    /// An architecture-wide fact (`"shared_memory_per_multiprocessor_bytes"`).
    pub fn fact(&self, fact: &'static str) -> Result<u64> {
        self.facts
            .get(fact)
            .copied()
            .ok_or_else(|| Error::MissingDeviceFact { fact, arch: self.arch.clone() })
    }

    /// A product's fact (`"peak_memory_bandwidth_gb_per_s"` of `"NVIDIA H200"`).
    pub fn product_fact(&self, product: &str, fact: &'static str) -> Result<f64> {
        self.products
            .get(product)
            .and_then(|p| p.get(fact))
            .copied()
            .ok_or_else(|| Error::MissingDeviceFact { fact, arch: format!("{} ({product})", self.arch) })
    }

    /// The published peak memory bandwidth of `product`, bytes per second.
    pub fn peak_memory_bandwidth_bytes_per_s(&self, product: &str) -> Result<f64> {
        Ok(self.product_fact(product, "peak_memory_bandwidth_gb_per_s")? * 1e9)
    }
}

/// The architecture-wide facts every device file must list.
pub const REQUIRED_FACTS: [&str; 6] = [
    "shared_memory_per_multiprocessor_bytes",
    "shared_memory_per_block_optin_bytes",
    "registers_per_multiprocessor",
    "max_registers_per_thread",
    "max_threads_per_multiprocessor",
    "max_blocks_per_multiprocessor",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_file_lists_every_required_fact() -> Result<()> {
        for arch in Arch::SUPPORTED {
            let file = DeviceFile::for_arch(arch)?;
            assert_eq!(file.arch, arch.to_string());
            for fact in REQUIRED_FACTS {
                assert!(file.fact(fact)? > 0, "{arch}: {fact}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_fact_absent_from_its_file_is_named() -> Result<()> {
        let file = DeviceFile::parse(
            "arch = \"sm_90\"\n[facts]\nregisters_per_multiprocessor = 65536\n\
             [products.\"NVIDIA H200\"]\npeak_memory_bandwidth_gb_per_s = 4800\n",
            "test",
        )?;
        assert_eq!(file.fact("registers_per_multiprocessor")?, 65536);
        match file.fact("shared_memory_per_multiprocessor_bytes") {
            Err(Error::MissingDeviceFact { fact, arch }) => {
                assert_eq!(fact, "shared_memory_per_multiprocessor_bytes");
                assert_eq!(arch, "sm_90");
            }
            other => panic!("expected MissingDeviceFact, got {other:?}"),
        }
        assert_eq!(file.peak_memory_bandwidth_bytes_per_s("NVIDIA H200")?, 4.8e12);
        match file.peak_memory_bandwidth_bytes_per_s("NVIDIA H100 PCIe") {
            Err(Error::MissingDeviceFact { fact: "peak_memory_bandwidth_gb_per_s", arch }) => {
                assert_eq!(arch, "sm_90 (NVIDIA H100 PCIe)");
            }
            other => panic!("expected MissingDeviceFact, got {other:?}"),
        }
        Ok(())
    }

    #[test]
    fn an_architecture_without_a_file_is_named() {
        assert!(matches!(
            DeviceFile::for_arch(Arch(75)),
            Err(Error::MissingDeviceFact { fact: "device file", ref arch }) if arch == "sm_75"
        ));
    }

    #[test]
    fn the_h200_is_known() -> Result<()> {
        let file = DeviceFile::for_arch(Arch(90))?;
        assert_eq!(file.peak_memory_bandwidth_bytes_per_s("NVIDIA H200")?, 4.8e12);
        Ok(())
    }
}
