//! The kernel compile check: every kernel of the registry, with every declared define set, through
//! NVRTC for every supported architecture. Fails on a compile error, a warning, a register spill
//! or a stack frame, and fails (never skips) when NVRTC cannot be found: CI installs the
//! `nvidia-cuda-nvrtc` wheel and points `KILN_NVRTC_PATH` at it (see `scripts/test`). Also checks
//! that every kernel waits for the kernels before it (`kiln_wait_prior()`) before it can leave.

use kiln_cuda::{compile_only, kernels, Arch, CompileOptions, KernelCache, KernelSource};
use rayon::prelude::*;

#[test]
fn every_kernel_compiles_for_every_architecture_without_warnings_or_spills() {
    let version = match kiln_cuda::nvrtc_version() {
        Ok(v) => v,
        Err(e) => panic!("the kernel compile check needs NVRTC: {e}"),
    };
    eprintln!("NVRTC {}.{}", version.0, version.1);
    let mut failures = Vec::new();
    let mut compiled = 0;
    let mut skipped = 0;
    // KILN_KERNELS=linear_i8,norm checks only those families (and then skips the count check).
    let only: Option<Vec<String>> =
        std::env::var("KILN_KERNELS").ok().map(|v| v.split(',').map(|s| s.trim().to_owned()).collect());
    let selected: Vec<_> =
        kernels::ALL.iter().filter(|k| only.as_ref().is_none_or(|o| o.iter().any(|n| n == k.name))).collect();
    assert!(!selected.is_empty(), "KILN_KERNELS={only:?} selects no kernel family");
    // Every (kernel, architecture, define set) to compile, in order; compiled on rayon's threads
    // (NVRTC is thread-safe), reported in this order.
    let mut work = Vec::new();
    for kernel in selected.iter().copied() {
        assert!(!kernel.define_sets.is_empty(), "{}: declares no define set", kernel.name);
        for arch in Arch::SUPPORTED {
            // A family built for one architecture's specific target (sm_90a) is skipped, by
            // name, on the others; it must serve one of the supported ones.
            if !kernel.serves(arch) {
                eprintln!(
                    "{} {arch}: skipped, built for {:?} (arch-specific) only",
                    kernel.name,
                    kernel.specific_arch()
                );
                skipped += 1;
                continue;
            }
            work.extend(kernel.define_sets.iter().map(|defines| (kernel, arch, *defines)));
        }
    }
    let outcomes: Vec<(bool, Vec<String>, Vec<String>)> =
        work.par_iter().map(|&(kernel, arch, defines)| check_compile(kernel, arch, defines)).collect();
    for (ok, failed, registers) in outcomes {
        compiled += usize::from(ok);
        failures.extend(failed);
        for line in registers {
            eprintln!("{line}");
        }
    }
    assert!(failures.is_empty(), "kernel compile check failed:\n{}", failures.join("\n"));
    for kernel in &selected {
        assert!(
            Arch::SUPPORTED.iter().any(|&arch| kernel.serves(arch)),
            "{} serves none of the supported architectures",
            kernel.name
        );
    }
    assert!(compiled + skipped >= selected.len() * Arch::SUPPORTED.len());
}

/// One item of the compile check: whether `kernel` compiled for `arch` with `defines`, what failed
/// (the error, each warning, a missing ptxas report, spills or a stack frame), and each entry's
/// registers.
fn check_compile(
    kernel: &KernelSource,
    arch: Arch,
    defines: &[(&str, &str)],
) -> (bool, Vec<String>, Vec<String>) {
    let what = format!("{} {arch} {defines:?}", kernel.name);
    let image = match compile_only(kernel, arch, defines) {
        Ok(image) => image,
        Err(e) => return (false, vec![format!("{what}: {e}")], Vec::new()),
    };
    let mut failures: Vec<String> = image.warnings().iter().map(|w| format!("{what}: {w}")).collect();
    if image.resources.is_empty() {
        failures.push(format!("{what}: no ptxas report in the log:\n{}", image.log));
    }
    let mut registers = Vec::new();
    for r in &image.resources {
        if r.spill_store_bytes > 0 || r.spill_load_bytes > 0 || r.stack_frame_bytes > 0 {
            failures.push(format!(
                "{what}: {} spills ({} bytes stores, {} bytes loads, {} bytes stack frame)",
                r.function, r.spill_store_bytes, r.spill_load_bytes, r.stack_frame_bytes
            ));
        }
        registers.push(format!("{what}: {} {} registers", r.function, r.registers));
    }
    (true, failures, registers)
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

/// The body of each `__global__` function of `source`: from its first `{` to the matching `}`.
fn global_bodies(source: &str) -> Vec<(String, &str)> {
    let mut bodies = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("__global__") {
        let from = &rest[at..];
        let Some(open) = from.find('{') else { break };
        let name = from[..open]
            .split('(')
            .next()
            .and_then(|head| head.split_whitespace().last())
            .unwrap_or("?")
            .to_owned();
        let mut depth = 0usize;
        let mut end = from.len();
        for (i, c) in from[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        bodies.push((name, &from[open..end]));
        rest = &from[end..];
    }
    bodies
}

/// What is wrong with the waits of `source`'s kernels, and how many kernels it has.
fn wait_failures(family: &str, source: &str) -> (usize, Vec<String>) {
    let mut failures = Vec::new();
    let bodies = global_bodies(source);
    for (name, body) in &bodies {
        match body.find("kiln_wait_prior()") {
            None => failures.push(format!("{family}: {name} never calls kiln_wait_prior()")),
            Some(wait) => {
                if body.find("return").is_some_and(|ret| ret < wait) {
                    failures.push(format!("{family}: {name} may return before kiln_wait_prior()"));
                }
            }
        }
    }
    (bodies.len(), failures)
}

#[test]
fn every_kernel_waits_for_the_kernels_before_it() {
    // Kiln's launches may overlap the kernel before them (`kiln_cuda::launch`): every kernel must
    // call kiln_wait_prior() before it reads or writes what an earlier kernel may write, and no
    // block may leave before the call (a grid whose blocks all left early could finish before
    // the kernel it follows).
    let mut kernels = 0;
    let mut failures = Vec::new();
    for kernel in kernels::ALL {
        let (count, found) = wait_failures(kernel.name, kernel.source);
        kernels += count;
        failures.extend(found);
    }
    assert!(kernels >= 20, "only {kernels} kernels found in the registry's sources");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The check itself finds a missing wait and an early return.
    let missing = "extern \"C\" __global__ void a(int* p) { if (p) { p[0] = 1; } }";
    let early = "extern \"C\" __global__ void b(int* p) { if (!p) return; kiln_wait_prior(); p[0] = 1; }";
    assert_eq!(wait_failures("t", missing).1.len(), 1);
    assert_eq!(wait_failures("t", early).1.len(), 1);
}

/// `KernelCache::warm` (the parallel warm-up behind `Gpu::warm`), with no GPU: it compiles each
/// distinct specialization once, on rayon's threads, into files that `get_or_compile` then reads
/// (the same image a compile gives), skips what the cache holds, and reports a failing
/// specialization by name after storing the others.
#[test]
fn warm_compiles_each_specialization_once_into_the_cache() {
    let dir = std::env::temp_dir().join(format!("kiln-warm-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::new(&dir);
    let kernel = &kernels::NORM;
    assert!(kernel.define_sets.len() >= 3, "{}", kernel.define_sets.len());
    let options_of = |defines: &[(&str, &str)]| {
        let defines = defines.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        CompileOptions::for_kernel(kernel, Arch(90), defines)
    };
    let mut options: Vec<CompileOptions> = kernel.define_sets[..3].iter().map(|d| options_of(d)).collect();
    options.push(options_of(kernel.define_sets[1]));
    let compiled = match cache.warm(kernel, &options) {
        Ok(n) => n,
        Err(e) => panic!("warm failed: {e}"),
    };
    assert_eq!(compiled, 3, "three distinct specializations, one repeated");
    let cubins = std::fs::read_dir(&dir)
        .map(|d| d.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "cubin")).count())
        .unwrap_or(0);
    assert_eq!(cubins, 3);
    let leftovers = std::fs::read_dir(&dir)
        .map(|d| d.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "tmp")).count())
        .unwrap_or(0);
    assert_eq!(leftovers, 0, "files written aside were all renamed");
    assert_eq!(cache.warm(kernel, &options).ok(), Some(0), "a second warm-up finds them all");
    for option in &options[..3] {
        let (image, from_cache) = cache.get_or_compile(kernel, option).unwrap_or_else(|e| panic!("{e}"));
        assert!(from_cache, "{:?}", option.defines);
        let fresh = kiln_cuda::compile::compile(kernel, option).unwrap_or_else(|e| panic!("{e}"));
        assert!(image.image == fresh.image, "{:?}: the cached image is not a compile's", option.defines);
    }

    // A specialization that does not compile fails the warm-up by name; the others are stored.
    let broken = KernelSource {
        name: "broken",
        source: "#include \"kiln_prelude.cuh\"\n\
                 #if BROKEN\n#error broken on purpose\n#endif\n\
                 extern \"C\" __global__ void f(float* out) { out[threadIdx.x] = 1.0f; }\n",
        define_sets: &[&[]],
        fmad: true,
    };
    let set =
        |v: &str| CompileOptions::for_kernel(&broken, Arch(90), vec![("BROKEN".to_owned(), v.to_owned())]);
    match cache.warm(&broken, &[set("0"), set("1"), set("2")]) {
        Err(kiln_core::Error::Compile { kernel, options, .. }) => {
            assert_eq!(kernel, "broken");
            assert!(options.iter().any(|o| o == "-DBROKEN=1"), "{options:?}");
        }
        other => panic!("expected the compile error of BROKEN=1, got {other:?}"),
    }
    let (_, from_cache) = cache.get_or_compile(&broken, &set("0")).unwrap_or_else(|e| panic!("{e}"));
    assert!(from_cache, "BROKEN=0 was stored beside the failure");
    let _ = std::fs::remove_dir_all(&dir);
}
