//! GPU tests of the CUDA runtime: a kernel compiled and run against the CPU, the disk cache hit
//! on a second compile, pool reuse, the out-of-memory error with work going on after it, and the
//! device facts against the driver and the device file.
//!
//! Built only with `--features gpu-tests` (they need an NVIDIA GPU). Inputs are fresh random
//! values each run (the seed is printed), outputs are poisoned before each launch, and every
//! element is checked.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kiln_core::ops::quantize::{e4m3_to_f32, f32_to_e4m3};
use kiln_core::{DType, Error, Result, Tensor};
use kiln_cuda::runtime::driver_error;
use kiln_cuda::{kernels, DeviceFile, DeviceMemory, Gpu, KernelCache};

/// A splitmix64 stream seeded from the clock, so each run draws new inputs.
struct Random(u64);

impl Random {
    fn fresh(test: &str) -> Random {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        eprintln!("{test}: seed {seed:#x}");
        Random(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Half raw bit patterns (NaN, infinities, subnormals included), half values of moderate size.
    fn f32(&mut self) -> f32 {
        let r = self.next();
        if r & 1 == 0 {
            f32::from_bits((r >> 32) as u32)
        } else {
            let unit = ((r >> 40) as f32) / (1u64 << 24) as f32 * 2.0 - 1.0;
            unit * 2f32.powi(((r >> 8) % 40) as i32 - 20)
        }
    }
}

fn gpu() -> Arc<Gpu> {
    match Gpu::open(0) {
        Ok(gpu) => gpu,
        Err(e) => panic!("the GPU tests need CUDA device 0: {e}"),
    }
}

fn temp_cache(test: &str) -> KernelCache {
    let dir = std::env::temp_dir().join(format!("kiln-gpu-test-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    KernelCache::new(dir)
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceMemory> {
    let memory = gpu.alloc(bytes.len())?;
    memory.copy_from_host(0, bytes)?;
    Ok(memory)
}

/// Runs `entry(in, out, n)` of the convert kernels over `input`, output poisoned first.
fn convert(gpu: &Gpu, entry: &str, input: &[u8], n: usize, out_bytes_per_element: usize) -> Result<Vec<u8>> {
    let function = gpu.function(&kernels::CONVERT, entry, &[])?;
    let src = upload(gpu, input)?;
    let dst = gpu.alloc(n * out_bytes_per_element)?;
    dst.fill_bytes(0xA5)?;
    let (src_ptr, dst_ptr, count) = (src.device_ptr(), dst.device_ptr(), n as u64);
    let mut launch = gpu.stream().launch_builder(&function);
    launch.arg(&src_ptr).arg(&dst_ptr).arg(&count);
    let config = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `entry(const IN* in, OUT* out, u64 n)` reads n inputs and writes n outputs; both
    // blocks hold that many.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel", e))?;
    dst.to_host_bytes()
}

fn same_float(gpu: f32, cpu: f32) -> bool {
    gpu.to_bits() == cpu.to_bits() || (gpu.is_nan() && cpu.is_nan())
}

#[test]
fn conversion_kernels_match_the_cpu_bit_for_bit() -> Result<()> {
    let gpu = gpu();
    let mut random = Random::fresh("conversions");
    let n = 1 << 20;
    let values: Vec<f32> = (0..n).map(|_| random.f32()).collect();
    let input: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();

    let bf16 = convert(&gpu, "convert_f32_to_bf16", &input, n, 2)?;
    let f16 = convert(&gpu, "convert_f32_to_f16", &input, n, 2)?;
    let e4m3 = convert(&gpu, "convert_f32_to_e4m3", &input, n, 1)?;
    for (i, &v) in values.iter().enumerate() {
        let got_bf16 = u16::from_le_bytes([bf16[2 * i], bf16[2 * i + 1]]);
        let want_bf16 = half::bf16::from_f32(v).to_bits();
        assert!(
            got_bf16 == want_bf16 || (v.is_nan() && half::bf16::from_bits(got_bf16).is_nan()),
            "bf16 of {v:e} ({:#x}): GPU {got_bf16:#x}, CPU {want_bf16:#x}",
            v.to_bits()
        );
        let got_f16 = u16::from_le_bytes([f16[2 * i], f16[2 * i + 1]]);
        let want_f16 = half::f16::from_f32(v).to_bits();
        assert!(
            got_f16 == want_f16 || (v.is_nan() && half::f16::from_bits(got_f16).is_nan()),
            "f16 of {v:e} ({:#x}): GPU {got_f16:#x}, CPU {want_f16:#x}",
            v.to_bits()
        );
        assert_eq!(e4m3[i], f32_to_e4m3(v), "e4m3 of {v:e} ({:#x})", v.to_bits());
    }

    // Every 16-bit and 8-bit code back to f32.
    let codes16: Vec<u8> = (0..=u16::MAX).flat_map(|c| c.to_le_bytes()).collect();
    let from_bf16 = convert(&gpu, "convert_bf16_to_f32", &codes16, 1 << 16, 4)?;
    let from_f16 = convert(&gpu, "convert_f16_to_f32", &codes16, 1 << 16, 4)?;
    for code in 0..=u16::MAX {
        let i = code as usize * 4;
        let got = |b: &[u8]| f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        assert!(same_float(got(&from_bf16), half::bf16::from_bits(code).to_f32()), "bf16 code {code:#x}");
        assert!(same_float(got(&from_f16), half::f16::from_bits(code).to_f32()), "f16 code {code:#x}");
    }
    let codes8: Vec<u8> = (0..=u8::MAX).collect();
    let from_e4m3 = convert(&gpu, "convert_e4m3_to_f32", &codes8, 256, 4)?;
    let from_e5m2 = convert(&gpu, "convert_e5m2_to_f32", &codes8, 256, 4)?;
    for code in 0..=u8::MAX {
        let i = code as usize * 4;
        let got = |b: &[u8]| f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        assert!(same_float(got(&from_e4m3), e4m3_to_f32(code)), "e4m3 code {code:#x}");
        // e5m2 is the top byte of fp16.
        let want = half::f16::from_bits(u16::from(code) << 8).to_f32();
        assert!(same_float(got(&from_e5m2), want), "e5m2 code {code:#x}");
    }

    // e5m2 encoding against the plain definition: the nearest finite code, ties to the even code,
    // saturating to the largest finite value (57344); infinities stay infinities.
    let e5m2 = convert(&gpu, "convert_f32_to_e5m2", &input, n, 1)?;
    let finite: Vec<(u8, f64)> =
        (0u8..0x7C).map(|c| (c, f64::from(half::f16::from_bits(u16::from(c) << 8).to_f32()))).collect();
    for (i, &v) in values.iter().enumerate().take(1 << 16) {
        let got = e5m2[i];
        let sign = ((v.to_bits() >> 24) & 0x80) as u8;
        let want = if v.is_nan() {
            assert!(got & 0x7F > 0x7C, "e5m2 of NaN gave {got:#x}");
            continue;
        } else if v.is_infinite() {
            sign | 0x7C
        } else {
            let a = f64::from(v.abs());
            // Past the largest finite value the nearest is that value (saturation); comparing
            // distances there in f64 would round both to the same number and pick the even code.
            let largest = finite[finite.len() - 1];
            let mut best = if a >= largest.1 { largest } else { finite[0] };
            for &(c, x) in finite.iter().filter(|_| a < largest.1) {
                let (d, db) = ((x - a).abs(), (best.1 - a).abs());
                if d < db || (d == db && c % 2 == 0) {
                    best = (c, x);
                }
            }
            sign | best.0
        };
        assert_eq!(got, want, "e5m2 of {v:e} ({:#x})", v.to_bits());
    }
    Ok(())
}

#[test]
fn second_compile_is_a_disk_cache_hit_without_nvrtc() -> Result<()> {
    let cache = temp_cache("cache-hit");
    let first = Gpu::open_with_cache(0, cache.clone())?;
    let started = Instant::now();
    first.function(&kernels::COPY, "fill_u32", &[("UNROLL", "8")])?;
    let compile_time = started.elapsed();
    assert_eq!(first.compile_stats().compiles, 1);
    assert_eq!(cache.summary().entries, 1);

    // A second device handle has no modules in memory: the image must come from disk.
    let calls_before = kiln_cuda::nvrtc_compile_calls();
    let second = Gpu::open_with_cache(0, cache.clone())?;
    let started = Instant::now();
    let function = second.function(&kernels::COPY, "fill_u32", &[("UNROLL", "8")])?;
    let hit_time = started.elapsed();
    assert_eq!(kiln_cuda::nvrtc_compile_calls(), calls_before, "NVRTC ran on a cache hit");
    let stats = second.compile_stats();
    assert_eq!((stats.compiles, stats.disk_hits), (0, 1));
    assert!(hit_time < compile_time, "cache hit {hit_time:?} not faster than compile {compile_time:?}");
    eprintln!("compile {compile_time:?}, cache hit {hit_time:?}");

    // The cached image runs.
    let mut random = Random::fresh("cache-hit");
    let n = 100_003usize;
    let pattern = random.next() as u32;
    let out = second.alloc(4 * n)?;
    out.fill_bytes(0)?;
    let (ptr, count) = (out.device_ptr(), n as u64);
    let mut launch = second.stream().launch_builder(&function);
    launch.arg(&ptr).arg(&pattern).arg(&count);
    // SAFETY: fill_u32(u32* dst, u32 pattern, u64 n) writes n words; `out` holds n words.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }
        .map_err(|e| driver_error("cuLaunchKernel", e))?;
    let words = out.to_host_bytes()?;
    assert!(words.chunks_exact(4).all(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == pattern));

    // The in-process table serves the third request.
    second.function(&kernels::COPY, "fill_u32", &[("UNROLL", "8")])?;
    assert_eq!(second.compile_stats().memory_hits, 1);
    let _ = std::fs::remove_dir_all(cache.dir());
    Ok(())
}

#[test]
fn the_pool_reuses_blocks_and_counts() -> Result<()> {
    let gpu = Gpu::open_with_cache(0, temp_cache("pool"))?;
    let pool = gpu.pool();
    let before = pool.stats();
    let first = gpu.alloc(3 << 20)?;
    let first_ptr = first.device_ptr();
    let class = kiln_cuda::memory::size_class(3 << 20) as u64;
    assert_eq!(pool.stats().live_bytes, before.live_bytes + class);
    drop(first);
    assert_eq!(pool.stats().pooled_bytes, before.pooled_bytes + class);
    let second = gpu.alloc((3 << 20) - 100)?;
    assert_eq!(second.device_ptr(), first_ptr, "a block of the same class is reused");
    let stats = pool.stats();
    assert_eq!(stats.hits, before.hits + 1);
    assert_eq!(stats.misses, before.misses + 1);
    assert_eq!(stats.pooled_bytes, before.pooled_bytes);
    assert!(stats.peak_live_bytes >= class);

    // Reused memory holds what is written to it.
    let mut random = Random::fresh("pool");
    let data: Vec<u8> = (0..second.len_bytes()).map(|_| random.next() as u8).collect();
    second.copy_from_host(0, &data)?;
    assert_eq!(second.to_host_bytes()?, data);
    Ok(())
}

#[test]
fn out_of_memory_is_named_and_work_goes_on() -> Result<()> {
    let gpu = Gpu::open_with_cache(0, temp_cache("oom"))?;
    let held = gpu.alloc(64 << 20)?;
    let requested = 2 * gpu.facts().total_memory_bytes as usize;
    match gpu.alloc(requested) {
        Err(Error::OutOfMemory { requested_bytes, live_bytes, pooled_bytes: _, driver_free_bytes }) => {
            assert_eq!(requested_bytes, requested as u64);
            assert!(live_bytes >= 64 << 20, "live {live_bytes}");
            assert!(driver_free_bytes < requested_bytes);
            assert!(driver_free_bytes > 0);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // The context is still good: a small allocation, a copy and a kernel all work.
    let mut random = Random::fresh("oom");
    let data: Vec<u8> = (0..4096).map(|_| random.next() as u8).collect();
    let small = upload(&gpu, &data)?;
    assert_eq!(small.to_host_bytes()?, data);
    let copy = gpu.alloc(4096)?;
    copy.fill_bytes(0xEE)?;
    copy.copy_from_device(&small)?;
    assert_eq!(copy.to_host_bytes()?, data);
    drop(held);
    Ok(())
}

#[test]
fn device_facts_agree_with_the_driver_and_the_device_file() -> Result<()> {
    let gpu = gpu();
    let facts = gpu.facts();
    eprintln!("{facts:#?}");
    assert_eq!(facts.arch.0, facts.compute_capability.0 * 10 + facts.compute_capability.1);
    assert!(facts.multiprocessors > 0 && facts.total_memory_bytes > 0 && facts.l2_cache_bytes > 0);
    assert_eq!(facts.warp_size, 32);
    let (free, total) = gpu.context().mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
    assert_eq!(total as u64, facts.total_memory_bytes);
    assert!(free as u64 <= facts.total_memory_bytes);

    let file = DeviceFile::for_arch(facts.arch)?;
    assert_eq!(
        file.fact("shared_memory_per_multiprocessor_bytes")?,
        facts.shared_memory_per_multiprocessor_bytes
    );
    assert_eq!(file.fact("shared_memory_per_block_optin_bytes")?, facts.shared_memory_per_block_optin_bytes);
    assert_eq!(file.fact("registers_per_multiprocessor")?, u64::from(facts.registers_per_multiprocessor));
    assert_eq!(file.fact("max_threads_per_multiprocessor")?, u64::from(facts.max_threads_per_multiprocessor));
    let peak = file.peak_memory_bandwidth_bytes_per_s(&facts.name)?;
    assert!(peak > 1e11, "{peak}");
    Ok(())
}

#[test]
fn tensors_go_to_the_device_and_back() -> Result<()> {
    let gpu = gpu();
    let mut random = Random::fresh("tensors");
    let values: Vec<f32> = (0..3 * 1000).map(|_| random.f32()).collect();
    let host = Tensor::from_slice(&values, &[3, 1000])?;
    let device = gpu.upload(&host)?;
    assert!(!device.is_host());
    assert_eq!(device.shape(), &[3, 1000]);
    assert_eq!(device.dtype(), DType::F32);
    let back = device.to_host()?;
    let got = back.as_slice::<f32>()?;
    assert!(got.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()));
    // A row view of the device tensor copies only its row back.
    let row = device.narrow(0, 2, 1)?.to_host()?;
    assert!(row.as_slice::<f32>()?.iter().zip(&values[2000..]).all(|(a, b)| a.to_bits() == b.to_bits()));
    let ptr = kiln_cuda::memory::device_ptr(&device.narrow(0, 1, 1)?)?;
    assert_eq!(ptr, kiln_cuda::memory::device_ptr(&device)? + 4000);
    Ok(())
}
