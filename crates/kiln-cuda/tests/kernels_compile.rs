//! The kernel compile check: every kernel of the registry, with every declared define set, through
//! NVRTC for every supported architecture. Fails on a compile error, a warning, a register spill
//! or a stack frame, and fails (never skips) when NVRTC cannot be found: CI installs the
//! `nvidia-cuda-nvrtc` wheel and points `KILN_NVRTC_PATH` at it (see `scripts/test`).

use kiln_cuda::{compile_only, kernels, Arch};

#[test]
fn every_kernel_compiles_for_every_architecture_without_warnings_or_spills() {
    let version = match kiln_cuda::nvrtc_version() {
        Ok(v) => v,
        Err(e) => panic!("the kernel compile check needs NVRTC: {e}"),
    };
    eprintln!("NVRTC {}.{}", version.0, version.1);
    let mut failures = Vec::new();
    let mut compiled = 0;
    // KILN_KERNELS=linear_i8,norm checks only those families (and then skips the count check).
    let only: Option<Vec<String>> =
        std::env::var("KILN_KERNELS").ok().map(|v| v.split(',').map(|s| s.trim().to_owned()).collect());
    let selected: Vec<_> =
        kernels::ALL.iter().filter(|k| only.as_ref().is_none_or(|o| o.iter().any(|n| n == k.name))).collect();
    assert!(!selected.is_empty(), "KILN_KERNELS={only:?} selects no kernel family");
    for kernel in selected.iter().copied() {
        assert!(!kernel.define_sets.is_empty(), "{}: declares no define set", kernel.name);
        for arch in Arch::SUPPORTED {
            for defines in kernel.define_sets {
                let what = format!("{} {arch} {defines:?}", kernel.name);
                let image = match compile_only(kernel, arch, defines) {
                    Ok(image) => image,
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        continue;
                    }
                };
                compiled += 1;
                for warning in image.warnings() {
                    failures.push(format!("{what}: {warning}"));
                }
                if image.resources.is_empty() {
                    failures.push(format!("{what}: no ptxas report in the log:\n{}", image.log));
                }
                for r in &image.resources {
                    if r.spill_store_bytes > 0 || r.spill_load_bytes > 0 || r.stack_frame_bytes > 0 {
                        failures.push(format!(
                            "{what}: {} spills ({} bytes stores, {} bytes loads, {} bytes stack frame)",
                            r.function, r.spill_store_bytes, r.spill_load_bytes, r.stack_frame_bytes
                        ));
                    }
                    eprintln!("{what}: {} {} registers", r.function, r.registers);
                }
            }
        }
    }
    assert!(failures.is_empty(), "kernel compile check failed:\n{}", failures.join("\n"));
    assert!(compiled >= selected.len() * Arch::SUPPORTED.len());
}

#[test]
fn a_compile_error_carries_the_log_and_options() {
    let broken = kiln_cuda::KernelSource {
        name: "broken",
        source: "#include \"kiln_prelude.cuh\"\nextern \"C\" __global__ void f() { undeclared_name = 1; }\n",
        define_sets: &[&[]],
        fmad: true,
    };
    match compile_only(&broken, Arch(90), &[]) {
        Err(kiln_core::Error::Compile { kernel, options, log }) => {
            assert_eq!(kernel, "broken");
            assert!(options.contains(&"--gpu-architecture=sm_90".to_owned()), "{options:?}");
            assert!(log.contains("undeclared_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn a_stack_frame_and_a_warning_are_caught() {
    // A register array indexed at run time lives in local memory (a stack frame); an unused
    // variable draws a warning. The check above must see both.
    let local = kiln_cuda::KernelSource {
        name: "local",
        source: "#include \"kiln_prelude.cuh\"\n\
                 extern \"C\" __global__ void f(float* out, int i) {\n\
                   int unused;\n\
                   float a[256];\n\
                   for (int k = 0; k < 256; ++k) a[k] = out[k] * out[k + i];\n\
                   out[i] = a[out[1] > 0.0f ? i : i + 1];\n\
                 }\n",
        define_sets: &[&[]],
        fmad: true,
    };
    let image = match compile_only(&local, Arch(90), &[]) {
        Ok(image) => image,
        Err(e) => panic!("compile failed: {e}"),
    };
    let f = image.resources.iter().find(|r| r.function == "f").unwrap_or_else(|| panic!("{}", image.log));
    assert!(f.stack_frame_bytes >= 256, "{f:?}\n{}", image.log);
    assert!(!image.warnings().is_empty(), "no warning in:\n{}", image.log);
}
