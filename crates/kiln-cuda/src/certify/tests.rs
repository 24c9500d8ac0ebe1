//! CPU tests of the certifier's declarations: keys from shapes, pruning by facts, configuration
//! names, the lookup through the store, and the planted wrong candidate never winning.

use std::path::PathBuf;

use kiln_core::tuning::store::record_certificate;
use kiln_core::tuning::{select_winner, TuningMode};

use super::*;

const SM90: Arch = Arch(90);

/// The facts of an H200 as the driver reports them.
fn h200() -> DeviceFacts {
    DeviceFacts {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        compute_capability: (9, 0),
        arch: SM90,
        multiprocessors: 132,
        total_memory_bytes: 150_000_000_000,
        l2_cache_bytes: 52_428_800,
        shared_memory_per_block_bytes: 49_152,
        shared_memory_per_block_optin_bytes: 232_448,
        shared_memory_per_multiprocessor_bytes: 233_472,
        registers_per_block: 65_536,
        registers_per_multiprocessor: 65_536,
        max_threads_per_block: 1024,
        max_threads_per_multiprocessor: 2048,
        warp_size: 32,
        memory_bus_width_bits: 6144,
        driver_cuda_version: "13.0".into(),
    }
}

fn keys(model: &ModelShapes, families: &[Family]) -> Vec<String> {
    tasks(model, families, SM90).unwrap().iter().map(|t| t.key(SM90).unwrap().to_string()).collect()
}

#[test]
fn llama3_8b_asks_for_these_keys() {
    let keys = keys(&ModelShapes::llama3_8b(), &Family::ALL);
    let expected = [
        "norm/rms.res.hf.n4096.g1.rows1/bf16.bf16.bf16/sm_90",
        "norm/rms.res.hf.n4096.g1.rows2-64/bf16.bf16.bf16/sm_90",
        "norm/rms.res.hf.n4096.g1.rows65+/bf16.bf16.bf16/sm_90",
        // The GPU engine's norms: fp32 stream and weights, fp32 out (decode) or bf16 (prefill).
        "norm/rms.hf.n4096.g1.rows1/f32.f32.f32/sm_90",
        "norm/rms.hf.n4096.g1.rows2-64/f32.f32.f32/sm_90",
        "norm/rms.hf.n4096.g1.rows65+/f32.f32.f32/sm_90",
        "norm/rms.hf.n4096.g1.rows2-64/f32.f32.bf16/sm_90",
        "norm/rms.hf.n4096.g1.rows65+/f32.f32.bf16/sm_90",
        "lm_head/v128256.h4096.rows1/bf16.f32/sm_90",
        "lm_head/v128256.h4096.rows4/bf16.f32/sm_90",
        "attention/prefill.q32.kv8.d128.p64/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b1/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b1.long/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b2-8/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b2-8.long/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b9-64/bf16/sm_90",
        "attention/decode.q32.kv8.d128.p64.b9-64.long/bf16/sm_90",
    ];
    assert_eq!(keys, expected);
    assert_eq!(self::keys(&ModelShapes::llama3_8b(), &[Family::LmHead]), expected[8..10]);
    // The timed decode instances: 4096 positions (short), 65536 (long), 32768 for the long class
    // past 8 sequences (8.6 GB of K and V at batch 64).
    let timed: Vec<String> = tasks(&ModelShapes::llama3_8b(), &[Family::Attention], SM90)
        .unwrap()
        .iter()
        .map(Task::describe)
        .collect();
    assert_eq!(
        timed[1..],
        [
            "decode of 1 sequences at 4096 positions",
            "decode of 1 sequences at 65536 positions",
            "decode of 8 sequences at 4096 positions",
            "decode of 8 sequences at 65536 positions",
            "decode of 64 sequences at 4096 positions",
            "decode of 64 sequences at 32768 positions",
        ]
    );
}

#[test]
fn keys_follow_the_model_shapes_and_types() {
    // SmolLM2-135M as its GGUF stores it: f32 norm weights, a Q8_0 output layer, 9 / 3 heads of 64.
    let keys = keys(&ModelShapes::named("smollm2-135m").unwrap(), &Family::ALL);
    assert!(keys.contains(&"norm/rms.res.hf.n576.g1.rows1/bf16.f32.bf16/sm_90".to_owned()), "{keys:?}");
    assert!(keys.contains(&"lm_head/v49152.h576.rows4/q8_0.f32/sm_90".to_owned()), "{keys:?}");
    assert!(keys.contains(&"attention/decode.q9.kv3.d64.p64.b1/bf16/sm_90".to_owned()), "{keys:?}");
    assert!(keys.contains(&"attention/decode.q9.kv3.d64.p64.b9-64.long/bf16/sm_90".to_owned()), "{keys:?}");
    // Qwen3's per-head q norm adds its own keys: 32 segments of 128, no residual.
    let qwen3 = ModelShapes { qk_norm: true, ..ModelShapes::llama3_8b() };
    let keys = self::keys(&qwen3, &[Family::Norm]);
    assert_eq!(keys.len(), 11);
    assert!(keys.contains(&"norm/rms.hf.n128.g32.rows1/bf16.bf16.bf16/sm_90".to_owned()), "{keys:?}");
}

#[test]
fn row_and_batch_classes_have_their_boundaries() {
    assert_eq!(
        [1, 2, 64, 65, 8192].map(norm_rows_class),
        ["rows1", "rows2-64", "rows2-64", "rows65+", "rows65+"]
    );
    assert_eq!(
        [1, 2, 8, 9, 64, 65].map(decode_batch_class),
        ["b1", "b2-8", "b2-8", "b9-64", "b9-64", "b65+"]
    );
    // A decode key depends on the context only through its class: the same key (so the same
    // configuration and grid) at every context of a class, the boundary at DECODE_SHORT_MAX.
    let task = |context| AttentionTask {
        shape: AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 },
        phase: AttentionPhase::Decode { batch: 8, context },
    };
    let key = |context| task(context).key(SM90).unwrap().to_string();
    assert_eq!(key(100), "attention/decode.q32.kv8.d128.p64.b2-8/bf16/sm_90");
    assert_eq!(key(1), key(DECODE_SHORT_MAX));
    assert_eq!(key(DECODE_SHORT_MAX + 1), "attention/decode.q32.kv8.d128.p64.b2-8.long/bf16/sm_90");
    assert_eq!(key(DECODE_SHORT_MAX + 1), key(1 << 20));
    assert_eq!(
        [0, 1, DECODE_SHORT_MAX, DECODE_SHORT_MAX + 1, 131_072].map(|c| DecodeClass::of(c, DECODE_SHORT_MAX)),
        [DecodeClass::Short, DecodeClass::Short, DecodeClass::Short, DecodeClass::Long, DecodeClass::Long]
    );
    // Each class's timed context has the class's key, and the engine's lookup (at the timed
    // context) names the same key as a call at any context of the class.
    for class in DecodeClass::ALL {
        for batch in [1, 8, 9, 64] {
            assert_eq!(DecodeClass::of(class.timed_context(batch), DECODE_SHORT_MAX), class);
        }
        let context = if class == DecodeClass::Short { 700 } else { 200_000 };
        assert_eq!(
            AttentionTask::decode(task(1).shape, 8, class).key(SM90).unwrap(),
            task(context).key(SM90).unwrap()
        );
    }
    assert_eq!(task(5).decode_class(), Some(DecodeClass::Short));
    let prefill = AttentionTask { phase: AttentionPhase::Prefill { tokens: 20_000 }, ..task(1) };
    assert_eq!(prefill.decode_class(), None);
    // Different architectures are different keys.
    let norm = tasks(&ModelShapes::llama3_8b(), &[Family::Norm], SM90).unwrap()[0];
    assert_ne!(norm.key(SM90).unwrap(), norm.key(Arch(80)).unwrap());
}

#[test]
fn candidates_start_with_the_default_and_fit_an_h200() {
    let facts = h200();
    for task in tasks(&ModelShapes::llama3_8b(), &Family::ALL, SM90).unwrap() {
        let (first, kept, pruned) = match &task {
            Task::Norm(t) => {
                let c = norm_candidates(t, &facts);
                (c.kept.first().map(|v| norm_label(*v)), c.kept.len(), c.pruned)
            }
            Task::LmHead(t) => {
                let c = lm_head_candidates(t, &facts);
                (c.kept.first().map(|v| v.label()), c.kept.len(), c.pruned)
            }
            Task::Attention(t) => {
                let c = attention_candidates(t, &facts);
                (c.kept.first().map(|v| v.label()), c.kept.len(), c.pruned)
            }
        };
        assert_eq!(first, Some(task.default_config(&facts)), "{task:?}");
        assert!(kept >= 2, "{task:?}: {kept} candidates");
        // On an H200 nothing Kiln lists is too big; only shapes the kernel does not serve go.
        assert!(pruned.iter().all(|p| p.reason.starts_with("not served")), "{task:?}: {pruned:?}");
    }
}

#[test]
fn a_candidate_needing_more_shared_memory_than_the_device_gives_is_pruned() {
    // A device whose blocks may use 48 KiB of shared memory at most.
    let small = DeviceFacts { shared_memory_per_block_optin_bytes: 48 * 1024, ..h200() };
    let shape = AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 };
    let prefill = AttentionTask { shape, phase: AttentionPhase::Prefill { tokens: 2048 } };
    let wide = AttentionConfig { variant: AttentionVariant::PREFILL_WIDE, splits: 1 };
    assert!(AttentionVariant::PREFILL_WIDE.shared_bytes(128) > 48 * 1024);
    let c = attention_candidates(&prefill, &small);
    assert!(!c.kept.contains(&wide), "{c:?}");
    let pruned = c.pruned.iter().find(|p| p.config == wide.label()).expect("the wide variant is pruned");
    assert!(pruned.reason.contains("shared memory") && pruned.reason.contains("49152"), "{pruned:?}");
    assert!(attention_candidates(&prefill, &h200()).kept.contains(&wide));

    // The LM head's tile of 128 over 4 rows of 4096 needs 16 units x 4 rows x 129 x 4 bytes.
    let head = LmHead {
        hidden: 4096,
        vocab: 128_256,
        weight: DType::BF16,
        logit_scale: 1.0,
        soft_cap: None,
        stats_block: None,
    };
    let task = LmHeadTask { head, rows: 4 };
    let tiny = DeviceFacts { shared_memory_per_block_optin_bytes: 20 * 1024, ..h200() };
    let c = lm_head_candidates(&task, &tiny);
    let big = c.pruned.iter().find(|p| p.config == "8w/8v/128t").expect("tile 128 pruned");
    assert!(big.reason.contains(&(16 * 4 * 129 * 4 + 64).to_string()), "{big:?}");
    assert!(c.kept.iter().all(|v| plan(&head, 4, *v).unwrap().shared_bytes + 64 <= 20 * 1024));
    assert!(lm_head_candidates(&task, &h200()).kept.iter().any(|v| v.label() == "8w/8v/128t"));

    // Too many threads or registers for the block prune norm variants the same way.
    let norm = tasks(&ModelShapes::llama3_8b(), &[Family::Norm], SM90).unwrap()[0];
    let Task::Norm(norm) = norm else { panic!("a norm task") };
    let few_threads = DeviceFacts { max_threads_per_block: 128, ..h200() };
    let c = norm_candidates(&norm, &few_threads);
    assert!(c.kept.iter().all(|v| 32 * v.warps_per_row * v.rows_per_block <= 128), "{c:?}");
    assert!(c.pruned.iter().any(|p| p.config == "16w1r" && p.reason.contains("512 threads")), "{c:?}");
    let few_registers = DeviceFacts { registers_per_block: 8192, ..h200() };
    let c = norm_candidates(&norm, &few_registers);
    assert!(c.pruned.iter().any(|p| p.config == "1w4r" && p.reason.contains("registers")), "{c:?}");
}

#[test]
fn every_configuration_name_parses_back() {
    for &v in NORM_VARIANTS {
        assert_eq!(parse_norm_variant(&norm_label(v)), Some(v));
    }
    for &v in LM_HEAD_VARIANTS {
        assert_eq!(parse_lm_head_variant(&v.label()), Some(v));
    }
    for rows in 1..=MAX_ROWS {
        let v = LmHeadVariant::default_for(rows);
        assert_eq!(parse_lm_head_variant(&v.label()), Some(v));
    }
    for variant in AttentionVariant::ALL {
        for splits in [1, 7, 64] {
            let c = AttentionConfig { variant, splits };
            assert_eq!(AttentionConfig::parse(&c.label()), Some(c));
        }
    }
    assert_eq!(
        norm_label(NormVariant {
            warps_per_row: 4,
            rows_per_block: 2,
            early_weight: true,
            persistent: false,
            stages: 0,
            block_lane: false,
            weight_ahead: false,
            row_total: false,
            fixed_n: false,
        }),
        "4w2r+e"
    );
    assert_eq!(AttentionConfig { variant: AttentionVariant::PREFILL, splits: 1 }.label(), "4x1x64.s1");
    for bad in ["", "3w1r", "4w1r+x", "4w1r ", "planted-wrong(4w1r)"] {
        assert_eq!(parse_norm_variant(bad), None, "{bad:?}");
    }
    for bad in ["16w/4v/32", "16w/4v/32tq", "99w/4v/32t"] {
        assert_eq!(parse_lm_head_variant(bad), None, "{bad:?}");
    }
    for bad in ["4x1x64", "4x1x64.s0", "4x1x64.s65", "4x1x64.sx", "3x1x64.s1", "4x1x64.s1.s2"] {
        assert_eq!(AttentionConfig::parse(bad), None, "{bad:?}");
    }
}

/// A fresh directory under the system's temporary folder.
fn scratch_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir = std::env::temp_dir().join(format!("kiln-certify-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn generator_of_test() -> Generator {
    Generator { kiln_version: "0.1.0".into(), source_sha256: "cd".repeat(32) }
}

#[test]
fn lookups_answer_the_winner_the_default_or_a_named_error() {
    let task = match tasks(&ModelShapes::llama3_8b(), &[Family::Norm], SM90).unwrap()[0] {
        Task::Norm(t) => t,
        other => panic!("{other:?}"),
    };
    let key = task.key(SM90).unwrap();
    let dir = scratch_dir("lookup");
    let (certs, index) = (dir.join("certificates"), dir.join("index"));
    let open = |mode| TuningStore::open(std::slice::from_ref(&certs), &index, mode).unwrap();

    // No certificate: the declared default, or in strict mode an error naming kernel and key.
    assert_eq!(
        norm_variant(&open(TuningMode::Default), &task, SM90).unwrap(),
        NormVariant::default_for(&task.call)
    );
    match norm_variant(&open(TuningMode::Strict), &task, SM90) {
        Err(Error::KeyNotCertified { kernel, key: named }) => {
            assert_eq!(kernel, "norm");
            assert_eq!(named, key.to_string());
        }
        other => panic!("expected KeyNotCertified, got {other:?}"),
    }

    // A certificate: its winner, in either mode.
    let candidates = vec![CandidateResult::ok("8w1r", 5.0, 0.0), CandidateResult::ok("2w2r+e", 3.0, 0.0)];
    let c = Certificate::new(
        key.clone(),
        candidates,
        generator_of_test(),
        "NVIDIA H200",
        "CUDA 13.0",
        "2026-11-30",
    )
    .unwrap();
    record_certificate(&certs, c).unwrap();
    let want = NormVariant {
        warps_per_row: 2,
        rows_per_block: 2,
        early_weight: true,
        persistent: false,
        stages: 0,
        block_lane: false,
        weight_ahead: false,
        row_total: false,
        fixed_n: false,
    };
    assert_eq!(norm_variant(&open(TuningMode::Strict), &task, SM90).unwrap(), want);

    // A winner the family does not have is refused by name.
    let lm = match tasks(&ModelShapes::llama3_8b(), &[Family::LmHead], SM90).unwrap()[0] {
        Task::LmHead(t) => t,
        other => panic!("{other:?}"),
    };
    let lm_key = lm.key(SM90).unwrap();
    let c = Certificate::new(
        lm_key.clone(),
        vec![CandidateResult::ok("64w/4v/32t", 1.0, 0.0)],
        generator_of_test(),
        "NVIDIA H200",
        "CUDA 13.0",
        "2026-11-30",
    )
    .unwrap();
    record_certificate(&certs, c).unwrap();
    match lm_head_variant(&open(TuningMode::Default), &lm, SM90, 232_448) {
        Err(Error::UnknownTuningConfig { kernel, key, config }) => {
            assert_eq!((kernel.as_str(), config.as_str()), ("lm_head", "64w/4v/32t"));
            assert_eq!(key, lm_key.to_string());
        }
        other => panic!("expected UnknownTuningConfig, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A decode lookup names its class's key: the long class's certificate past the boundary, the
/// short one's up to it; a long-class key without a certificate runs the short class's (the
/// certificates made before the classes), in strict mode too; with neither, the mode decides.
#[test]
fn decode_lookups_follow_the_context_class() {
    let shape = AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 };
    let at = |batch, context| AttentionTask { shape, phase: AttentionPhase::Decode { batch, context } };
    let dir = scratch_dir("decode-classes");
    let (certs, index) = (dir.join("certificates"), dir.join("index"));
    let open = |mode| TuningStore::open(std::slice::from_ref(&certs), &index, mode).unwrap();
    let config = |store: &TuningStore, batch, context| {
        attention_config(store, &at(batch, context), SM90, 132).map(|c| c.label())
    };
    let record = |task: AttentionTask, winner: &str| {
        let c = Certificate::new(
            task.key(SM90).unwrap(),
            vec![CandidateResult::ok(winner, 1.0, 1e-3)],
            generator_of_test(),
            "NVIDIA H200",
            "CUDA 13.0",
            "2026-11-30",
        )
        .unwrap();
        record_certificate(&certs, c).unwrap();
    };

    // Nothing certified: the long class is a key of its own, refused by name in strict mode.
    match attention_config(&open(TuningMode::Strict), &at(1, 70_000), SM90, 132) {
        Err(Error::KeyNotCertified { key, .. }) => {
            assert_eq!(key, "attention/decode.q32.kv8.d128.p64.b1.long/bf16/sm_90")
        }
        other => panic!("expected KeyNotCertified, got {other:?}"),
    }
    let default = at(1, 4096).default_config(132).label();
    assert_eq!(config(&open(TuningMode::Default), 1, 70_000).unwrap(), default);

    // Only the short class certified (a store of before the classes): both classes run it.
    record(AttentionTask::decode(shape, 1, DecodeClass::Short), "stream3-1x8x16.s16");
    for context in [1, DECODE_SHORT_MAX, DECODE_SHORT_MAX + 1, 131_072] {
        assert_eq!(config(&open(TuningMode::Strict), 1, context).unwrap(), "stream3-1x8x16.s16");
    }
    // Both certified: each class its own, the boundary at DECODE_SHORT_MAX.
    record(AttentionTask::decode(shape, 1, DecodeClass::Long), "1x4x32.s16");
    let strict = open(TuningMode::Strict);
    assert_eq!(config(&strict, 1, DECODE_SHORT_MAX).unwrap(), "stream3-1x8x16.s16");
    assert_eq!(config(&strict, 1, DECODE_SHORT_MAX + 1).unwrap(), "1x4x32.s16");
    assert_eq!(config(&strict, 1, 131_072).unwrap(), "1x4x32.s16");
    // Another batch class borrows nothing from this one.
    assert!(matches!(config(&strict, 8, 131_072), Err(Error::KeyNotCertified { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_attention_default_is_the_launchers_default() {
    let shape = AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 };
    let decode = AttentionTask { shape, phase: AttentionPhase::Decode { batch: 1, context: 4096 } };
    let c = decode.default_config(132);
    assert_eq!(c.variant, AttentionVariant::default_for(1));
    assert_eq!(c.splits, decode_splits_for(132, 1, 8));
    assert_eq!(c.splits, 33);
    let prefill = AttentionTask { shape, phase: AttentionPhase::Prefill { tokens: 2048 } };
    assert_eq!(
        prefill.default_config(132),
        AttentionConfig { variant: AttentionVariant::PREFILL, splits: 1 }
    );
    // The decode candidates: six variants (streaming, wide, the two deep ones, the hybrid, the
    // one-stage wide one) at 1, half, once and twice the default splits and at the streaming
    // kernels' splits, and the wide and deep streaming ones at once and twice their own (16 at
    // batch 1: one wave of 128 one-block multiprocessors), each named apart and parsed back.
    let kept = attention_candidates(&decode, &h200()).kept;
    let labels: Vec<String> = kept.iter().map(|c| c.label()).collect();
    assert_eq!(labels[0], "1x4x16.s33");
    assert_eq!(labels.len(), 34, "{labels:?}");
    for label in [
        "alt-1x4x32.s1",
        "alt-1x4x32.s64",
        "1x4x32.s16",
        "1x4x32.s64",
        "1x4x16.s1",
        "deep-1x4x16.s17",
        "deep-1x4x32.s64",
        "hybrid-1x4x16.s33",
        "stream3-1x8x16.s16",
        "stream3-1x8x16.s32",
        "stream6-1x4x16.s16",
        "stream6-1x4x16.s32",
    ] {
        assert!(labels.contains(&label.to_owned()), "{label} in {labels:?}");
    }
    for c in &kept {
        assert_eq!(AttentionConfig::parse(&c.label()), Some(*c), "{}", c.label());
    }
    // Names that older certificates list among their measured candidates but that no variant
    // has any more: never parsed as a configuration to run.
    for label in ["persist5-1x4x16.s64", "bulk5-1x4x16.s9", "bulk3-1x4x16.s32", "own5-1x4x16.s64"] {
        assert_eq!(AttentionConfig::parse(label), None, "{label}");
    }
    // Prefill: the two tiled variants and, on sm_90 at head dim 128, the two wgmma kernels.
    let prefill_labels: Vec<String> =
        attention_candidates(&prefill, &h200()).kept.iter().map(|c| c.label()).collect();
    assert!(prefill_labels.contains(&"wgmma-pingpong-8x1x128.s1".to_owned()), "{prefill_labels:?}");
    let small = AttentionTask { shape: AttentionShape { head_dim: 64, ..shape }, ..prefill };
    let pruned = attention_candidates(&small, &h200()).pruned;
    assert_eq!(pruned.len(), 2, "{pruned:?}");
    assert!(pruned.iter().all(|p| p.reason.contains("head dim 128")), "{pruned:?}");
}

#[test]
fn the_wide_and_deep_streaming_decode_variants_are_candidates_with_names_of_their_own() {
    let shape = AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 };
    let wide = AttentionVariant::DECODE_STREAM_WIDE;
    let deep = AttentionVariant::DECODE_STREAM_DEEP;
    // Batch 8 (the b2-8 key): 2 splits (128 blocks, one a multiprocessor) and 4 (two waves).
    let batch8 = AttentionTask { shape, phase: AttentionPhase::Decode { batch: 8, context: 16_384 } };
    let kept = attention_candidates(&batch8, &h200()).kept;
    let labels: Vec<String> = kept.iter().map(|c| c.label()).collect();
    // The default is unchanged: the streaming kernel at the two-blocks-a-multiprocessor splits.
    assert_eq!(labels[0], "1x4x16.s4");
    assert_eq!(kept[0], batch8.default_config(132));
    for (variant, label) in [
        (wide, "stream3-1x8x16.s2"),
        (wide, "stream3-1x8x16.s4"),
        (deep, "stream6-1x4x16.s2"),
        (deep, "stream6-1x4x16.s4"),
    ] {
        assert!(labels.contains(&label.to_owned()), "{label} in {labels:?}");
        let splits = label.rsplit_once(".s").unwrap().1.parse().unwrap();
        let config = AttentionConfig { variant, splits };
        assert_eq!(config.label(), label);
        assert_eq!(AttentionConfig::parse(label), Some(config));
    }
    assert_eq!(labels.iter().filter(|l| l.starts_with("stream")).count(), 4, "{labels:?}");
    // Every name distinct, every one parsed back to its configuration.
    let distinct: std::collections::HashSet<&String> = labels.iter().collect();
    assert_eq!(distinct.len(), labels.len(), "{labels:?}");
    for c in &kept {
        assert_eq!(AttentionConfig::parse(&c.label()), Some(*c), "{}", c.label());
    }
    // The default streaming variant keeps its name; other streaming shapes do not parse.
    let default = AttentionConfig { variant: AttentionVariant::DECODE, splits: 2 };
    assert_eq!(default.label(), "1x4x16.s2");
    assert_eq!(AttentionConfig::parse("1x4x16.s2"), Some(default));
    for bad in [
        "stream3-1x4x16.s2",
        "stream6-1x8x16.s2",
        "stream4-1x4x16.s2",
        "stream-1x8x16.s2",
        "stream3-1x8x16.s65",
    ] {
        assert_eq!(AttentionConfig::parse(bad), None, "{bad:?}");
    }
    // Batch 64 takes one split (512 blocks), and its twice; no prefill lists them.
    let batch64 = AttentionTask { shape, phase: AttentionPhase::Decode { batch: 64, context: 4096 } };
    let labels: Vec<String> =
        attention_candidates(&batch64, &h200()).kept.iter().map(|c| c.label()).collect();
    assert!(labels.contains(&"stream3-1x8x16.s1".to_owned()), "{labels:?}");
    assert!(labels.contains(&"stream6-1x4x16.s2".to_owned()), "{labels:?}");
    let prefill = AttentionTask { shape, phase: AttentionPhase::Prefill { tokens: 2048 } };
    assert!(attention_candidates(&prefill, &h200()).kept.iter().all(|c| !c.label().starts_with("stream")));
    // A device with 99 KiB of opt-in shared memory (sm_86) prunes both (192 KiB at head dim 128).
    let small = DeviceFacts { shared_memory_per_block_optin_bytes: 99 * 1024, ..h200() };
    let pruned = attention_candidates(&batch8, &small).pruned;
    assert!(pruned.iter().any(|p| p.config == "stream3-1x8x16.s2"), "{pruned:?}");
    assert!(pruned.iter().any(|p| p.config == "stream6-1x4x16.s2"), "{pruned:?}");
}

#[test]
fn the_planted_wrong_candidate_never_wins() {
    // The planted candidate runs the fastest variant, so its time is about the fastest's: here it
    // is strictly the fastest of all, and still never chosen.
    let key = TuningKey::new("norm", "rms.res.hf.n4096.g1.rows1", "bf16.bf16.bf16", "sm_90").unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..200 {
        let mut results: Vec<CandidateResult> = (0..1 + rng.next() % 12)
            .map(|i| CandidateResult::ok(format!("v{i}"), f64::from(rng.uniform(1.0, 100.0)), 0.0))
            .collect();
        results.push(pruned_result(&PrunedCandidate { config: "16w1r".into(), reason: "too big".into() }));
        let fastest = select_winner(&key, &results).unwrap().clone();
        let check = Check { error: 1.0, wrong: Some("1 bytes differ from the CPU reference".into()) };
        let planted = run_result(planted_label(&fastest.config), Some(fastest.score_us() * 0.5), &check);
        assert!(!planted.is_eligible());
        results.insert((rng.next() % results.len() as u64) as usize, planted);
        let c = Certificate::new(key.clone(), results, generator_of_test(), "GPU", "CUDA 13.0", "2026-11-30")
            .unwrap();
        assert_eq!(c.winner, fastest.config);
        assert!(!c.winner.starts_with("planted-wrong"));
        c.validate().unwrap();
    }
    // With only wrong, failed and pruned candidates there is no certificate.
    let check = Check { error: 3.0, wrong: Some("3 logits differ".into()) };
    let only_wrong = vec![
        run_result(planted_label("16w/4v/32t"), Some(1.0), &check),
        failed_result("8w/4v/64t".into(), &Error::NotServed { op: "lm_head kernel", reason: "x".into() }),
    ];
    assert!(matches!(
        Certificate::new(key, only_wrong, generator_of_test(), "GPU", "CUDA 13.0", "2026-11-30"),
        Err(Error::NoCorrectCandidate { candidates: 2, .. })
    ));
}

#[test]
fn a_correct_check_records_ok_and_zero_error() {
    let ok = run_result("4w1r".into(), Some(2.5), &Check { error: 0.0, wrong: None });
    assert_eq!(ok, CandidateResult::ok("4w1r", 2.5, 0.0));
    let pruned = pruned_result(&PrunedCandidate { config: "16w1r".into(), reason: "512 threads".into() });
    assert!(
        matches!(&pruned.status, CandidateStatus::Failed { detail } if detail.starts_with("pruned before compile"))
    );
    assert_eq!(byte_differences(&[1, 2, 3], &[1, 9, 3]), (1, Some(1)));
    assert_eq!(byte_differences(&[1, 2, 3], &[1, 2]), (1, Some(2)));
    assert_eq!(byte_differences(&[1, 2], &[1, 2]), (0, None));
}

#[test]
fn rotation_sets_exceed_twice_the_l2_cache() {
    let l2 = 52_428_800u64;
    for set in [8 << 10, 1 << 20, 30 << 20, 200 << 20] {
        let sets = rotation_sets(set, l2);
        assert!(sets * set >= 2 * l2 as usize || sets == MAX_SETS, "{set}: {sets}");
        assert!(sets >= 1);
    }
    assert_eq!(rotation_sets(1 << 30, l2), 1);
}

#[test]
fn families_parse_by_command_line_or_kernel_name() {
    for family in Family::ALL {
        assert_eq!(Family::parse(family.name()).unwrap(), family);
        assert_eq!(Family::parse(family.kernel()).unwrap(), family);
    }
    assert!(matches!(Family::parse("gemm"), Err(Error::InvalidArgument { name: "--kernel", .. })));
    // The generator names the kernel source by its hash, so an edit to the source is a new generator.
    let g = generator(Family::Norm);
    assert_eq!(g.source_sha256.len(), 64);
    assert_ne!(g, generator(Family::LmHead));
    assert_eq!(g.kiln_version, KILN_VERSION);
}
