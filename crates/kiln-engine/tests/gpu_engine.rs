//! The GPU engine against the CPU forward on tiny random models of each family (Llama, Qwen2 with
//! q/k/v bias, Qwen3 with q/k norm and a tied head): prefill (the matrix-product path) and decode
//! (the matrix-vector path) logits within bf16's tolerance of the CPU's, captured graphs equal to
//! plain launches bit for bit, sequences batched together equal to each alone within tolerance, and
//! a failed step that leaves the cache as it was. Needs an NVIDIA GPU (`--features gpu-tests`).

use kiln_core::ops::sample::SamplingParams;
use kiln_core::Error;
use kiln_engine::models::gpu::{GpuEngine, GpuOptions, GpuSequence};
use kiln_engine::models::test_models::{random_ids, write_tiny_model, TinySpec};
use kiln_engine::models::{load_model, LlamaModel};

/// The largest |gpu - cpu| over the largest |cpu|: the GPU keeps q, K, V and the attention
/// probabilities in bf16.
const TOLERANCE: f32 = 3e-2;

fn model(arch: &'static str, tied: bool, seed: u64) -> LlamaModel {
    let dir = std::env::temp_dir().join(format!("kiln-gpu-engine-{arch}-{seed}-{}", std::process::id()));
    let spec = TinySpec { architecture: arch, tied, ..TinySpec::llama() };
    write_tiny_model(&dir, &spec, seed).expect("tiny model");
    load_model(&dir).expect("load")
}

fn relative(gpu: &[f32], cpu: &[f32]) -> f32 {
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    gpu.iter().zip(cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, ..SamplingParams::default() }
}

fn engine(model: &LlamaModel, graphs: bool, batch: usize) -> GpuEngine {
    let gpu = kiln_cuda::Gpu::open(0).expect("a CUDA GPU");
    let options = GpuOptions { max_batch: batch, max_context: 256, graphs, ..GpuOptions::default() };
    GpuEngine::new(gpu, model, options).expect("engine")
}

/// Runs `prompt` then `steps` decode tokens (the CPU's greedy choices) and returns each step's
/// logits from the CPU and the GPU.
fn both(
    model: &LlamaModel,
    engine: &mut GpuEngine,
    prompt: &[u32],
    steps: usize,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut cache = model.new_cache(prompt.len() + steps + 1).expect("cache");
    let mut seq = engine.new_sequence(greedy()).expect("sequence");
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    for _ in 0..=steps {
        let cpu = model.forward(&input, &mut cache).expect("cpu forward");
        let (_, mut gpu) = engine.step_with_logits(&mut [(&mut seq, &input)]).expect("gpu step");
        let next = kiln_core::ops::sample::argmax(&cpu).expect("argmax");
        out.push((gpu.remove(0), cpu));
        input = vec![next];
    }
    engine.release(seq);
    out
}

#[test]
fn gpu_logits_follow_the_cpu_forward_for_each_family() {
    for (arch, tied) in [("LlamaForCausalLM", false), ("Qwen2ForCausalLM", false), ("Qwen3ForCausalLM", true)]
    {
        let model = model(arch, tied, 11);
        let mut engine = engine(&model, true, 1);
        // 37 prompt tokens take the matrix-product path, the decode steps the matrix-vector one.
        for (step, (gpu, cpu)) in both(&model, &mut engine, &random_ids(3, 37, 300), 12).iter().enumerate() {
            let r = relative(gpu, cpu);
            assert!(r <= TOLERANCE, "{arch} step {step}: {r:.3e}");
            let (g, c) = (kiln_core::ops::sample::argmax(gpu), kiln_core::ops::sample::argmax(cpu));
            if g != c {
                let (g, c) = (g.expect("gpu argmax") as usize, c.expect("cpu argmax") as usize);
                let margin = cpu[c] - cpu[g];
                let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(margin <= 2.0 * r * scale, "{arch} step {step}: parts at margin {margin}");
            }
        }
    }
}

/// FP8 E4M3 KV pages (`KvFormat::Fp8E4m3`): prefill and decode logits within twice E4M3's relative
/// step (1/8 of the largest CPU logit) of the CPU forward (its cache in fp32), different from the
/// bf16 pages' logits (the FP8 path runs), and captured decode steps equal to plain launches bit
/// for bit; the same pages take fewer bytes.
#[test]
fn fp8_kv_pages_follow_the_cpu_forward_and_replay_bit_for_bit() {
    use kiln_engine::kv::KvFormat;
    let model = model("LlamaForCausalLM", false, 17);
    let prompt = random_ids(4, 29, 300);
    let fp8 = |graphs: bool| {
        let gpu = kiln_cuda::Gpu::open(0).expect("a CUDA GPU");
        let options =
            GpuOptions { max_context: 256, graphs, kv_format: KvFormat::Fp8E4m3, ..GpuOptions::default() };
        GpuEngine::new(gpu, &model, options).expect("fp8 engine")
    };
    let mut fp8_engine = fp8(true);
    let mut bf16 = engine(&model, true, 1);
    let fp8_steps = both(&model, &mut fp8_engine, &prompt, 10);
    let bf16_steps = both(&model, &mut bf16, &prompt, 10);
    let mut differs = false;
    for (step, ((gpu, cpu), (plain, _))) in fp8_steps.iter().zip(&bf16_steps).enumerate() {
        let r = relative(gpu, cpu);
        println!("fp8 step {step}: {r:.3e} of the largest logit (bf16 pages: {:.3e})", relative(plain, cpu));
        assert!(r <= 0.125, "fp8 step {step}: {r:.3e}");
        differs |= gpu != plain;
    }
    assert!(differs, "the FP8 pages gave the bf16 pages' logits: the FP8 path did not run");
    let run = |graphs: bool| -> Vec<Vec<u32>> {
        let mut e = fp8(graphs);
        let mut seq = e.new_sequence(greedy()).expect("sequence");
        let (mut tokens, _) = e.step_with_logits(&mut [(&mut seq, &prompt)]).expect("prefill");
        let mut rows = Vec::new();
        for _ in 0..6 {
            let (next, logits) = e.step_with_logits(&mut [(&mut seq, &[tokens[0]])]).expect("decode");
            rows.push(logits[0].iter().map(|v| v.to_bits()).collect());
            tokens = next;
        }
        rows
    };
    assert!(run(false) == run(true), "fp8 decode: replayed logits differ from plain launches");
    let bf16_pages = bf16.plan().kv_pages;
    let options = GpuOptions { max_context: 256, kv_format: KvFormat::Fp8E4m3, ..GpuOptions::default() };
    let plan = kiln_engine::models::gpu::GpuPlan::new(&model, &options).expect("plan");
    assert_eq!(plan.kv_pages, bf16_pages, "the same pages asked for");
    let bf16_plan = kiln_engine::models::gpu::GpuPlan::new(
        &model,
        &GpuOptions { max_context: 256, ..GpuOptions::default() },
    )
    .expect("plan");
    assert!(
        plan.kv_bytes < bf16_plan.kv_bytes,
        "fp8 pages take {} bytes against bf16's {}",
        plan.kv_bytes,
        bf16_plan.kv_bytes
    );
}

#[test]
fn captured_decode_steps_equal_plain_launches_bit_for_bit() {
    let model = model("LlamaForCausalLM", false, 5);
    let prompt = random_ids(9, 20, 300);
    let run = |graphs: bool| -> Vec<Vec<u32>> {
        let mut engine = engine(&model, graphs, 1);
        let mut seq = engine.new_sequence(greedy()).expect("sequence");
        let mut rows = Vec::new();
        let (mut tokens, _) = engine.step_with_logits(&mut [(&mut seq, &prompt)]).expect("prefill");
        for _ in 0..8 {
            let (next, logits) = engine.step_with_logits(&mut [(&mut seq, &[tokens[0]])]).expect("decode");
            rows.push(logits[0].iter().map(|v| v.to_bits()).collect());
            tokens = next;
        }
        rows
    };
    let plain = run(false);
    let captured = run(true);
    assert_eq!(plain.len(), captured.len());
    for (step, (a, b)) in plain.iter().zip(&captured).enumerate() {
        assert!(a == b, "decode step {step}: replayed logits differ from plain launches");
    }
}

/// A sequence whose decode steps cross the attention class boundary (moved to 48 positions), the
/// short and long classes certified to different configurations (the streaming kernel unsplit,
/// the wide tiled one at 4 splits): the engine's lookup names the long class's past the boundary;
/// with graphs each class is captured once (two graphs) and every step's logits equal plain
/// launches' bit for bit, so no graph captured in one class replays in the other; and a run that
/// keeps the short class throughout has the same logits up to the boundary and others past it
/// (the long configuration does run there).
#[test]
fn decode_steps_crossing_the_attention_class_boundary_capture_again() {
    use kiln_core::tuning::store::record_certificate;
    use kiln_core::tuning::{CandidateResult, Certificate, Generator, TuningMode, TuningStore};
    use kiln_cuda::certify::{AttentionConfig, AttentionTask, DecodeClass};

    const BOUNDARY: usize = 48;
    let model = model("LlamaForCausalLM", false, 17);
    let prompt = random_ids(6, 20, 300);
    let dir = std::env::temp_dir().join(format!("kiln-gpu-engine-classes-{}", std::process::id()));
    let (certs, index) = (dir.join("certificates"), dir.join("index"));
    let c = model.config();
    let shape = kiln_core::ops::attention::AttentionShape {
        q_heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        page_tokens: GpuOptions::default().page_tokens,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
    };
    let (short, long) = ("1x4x16.s1", "1x4x32.s4");
    let arch = kiln_cuda::Gpu::open(0).expect("a CUDA GPU").arch();
    for (class, winner) in [(DecodeClass::Short, short), (DecodeClass::Long, long)] {
        let key = AttentionTask::decode(shape, 1, class).key(arch).expect("key");
        let generator = Generator { kiln_version: "0.1.0".into(), source_sha256: "ab".repeat(32) };
        let candidates = vec![CandidateResult::ok(winner, 1.0, 1e-3)];
        let certificate =
            Certificate::new(key, candidates, generator, "GPU", "CUDA", "2026-11-30").expect("certificate");
        record_certificate(&certs, certificate).expect("record");
    }
    let parsed = |label: &str| {
        let config = AttentionConfig::parse(label).expect("label");
        (Some(config.variant), config.splits)
    };
    // Decode logits (as bits) and the context of each step, and the graphs captured.
    let run = |graphs: bool, short_max: usize| -> (Vec<(usize, Vec<u32>)>, usize) {
        let gpu = kiln_cuda::Gpu::open(0).expect("a CUDA GPU");
        let options =
            GpuOptions { max_context: 256, graphs, decode_short_max: short_max, ..GpuOptions::default() };
        let mut engine = GpuEngine::new(gpu, &model, options).expect("engine");
        // Default mode: the keys without a certificate (prefill, norms) run their defaults.
        engine.use_tuning(
            TuningStore::open(std::slice::from_ref(&certs), &index, TuningMode::Default).expect("store"),
        );
        assert_eq!(engine.decode_attention_config(1, short_max).expect("short"), parsed(short));
        assert_eq!(engine.decode_attention_config(1, short_max + 1).expect("long"), parsed(long));
        let mut seq = engine.new_sequence(greedy()).expect("sequence");
        let (mut tokens, _) = engine.step_with_logits(&mut [(&mut seq, &prompt)]).expect("prefill");
        let mut rows = Vec::new();
        for _ in 0..60 {
            let (next, logits) = engine.step_with_logits(&mut [(&mut seq, &[tokens[0]])]).expect("decode");
            let context = seq.len();
            rows.push((context, logits[0].iter().map(|v| v.to_bits()).collect()));
            if graphs && context == BOUNDARY {
                assert_eq!(engine.captured_graphs(), 1, "one graph up to the boundary");
            }
            tokens = next;
        }
        engine.release(seq);
        (rows, engine.captured_graphs())
    };
    let (plain, none) = run(false, BOUNDARY);
    let (captured, graphs) = run(true, BOUNDARY);
    let (all_short, _) = run(false, 256);
    std::fs::remove_dir_all(&dir).expect("remove the certificates");
    assert_eq!(none, 0);
    assert_eq!(graphs, 2, "one graph per attention class");
    assert!(
        plain.first().is_some_and(|r| r.0 < BOUNDARY) && plain.last().is_some_and(|r| r.0 > BOUNDARY + 8)
    );
    for ((context, a), (_, b)) in plain.iter().zip(&captured) {
        assert!(a == b, "context {context}: replayed logits differ from plain launches");
    }
    let mut differ_past = false;
    for ((context, a), (_, b)) in plain.iter().zip(&all_short) {
        if *context <= BOUNDARY {
            assert!(a == b, "context {context}: the short class's logits differ between runs");
        } else {
            differ_past |= a != b;
        }
    }
    assert!(differ_past, "the long class's configuration gave the short one's logits at every step");
}

/// Requests whose sampling parameters pick other sampler paths (greedy, top-k + top-p, plain
/// temperature) one after another on one sequence: with graphs each path is captured on its own
/// (a change of parameters captures again, a return to earlier ones replays), every token is the
/// CPU reference's for the step's logits, and the tokens equal those of plain launches.
#[test]
fn a_change_of_sampling_parameters_captures_again() {
    let model = model("LlamaForCausalLM", false, 13);
    let prompt = random_ids(5, 12, 300);
    let top_k =
        SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, seed: 77, ..SamplingParams::default() };
    let plain = SamplingParams { temperature: 1.1, seed: 5, ..SamplingParams::default() };
    let phases = [greedy(), top_k, greedy(), plain, top_k];
    let run = |graphs: bool| -> (Vec<u32>, usize) {
        let mut engine = engine(&model, graphs, 1);
        let mut seq = engine.new_sequence(greedy()).expect("sequence");
        let mut tokens = engine.step(&mut [(&mut seq, &prompt)]).expect("prefill");
        let mut out = Vec::new();
        for (phase, params) in phases.iter().enumerate() {
            seq.params = *params;
            for i in 0..4 {
                let step = seq.step;
                let (next, logits) =
                    engine.step_with_logits(&mut [(&mut seq, &[tokens[0]])]).expect("decode");
                let want =
                    kiln_core::ops::sample::sample(&logits[0], params, &[], step, 0).expect("reference");
                assert_eq!(
                    next[0], want,
                    "graphs {graphs} phase {phase} step {i}: token against the reference"
                );
                seq.step += 1;
                out.push(next[0]);
                tokens = next;
            }
        }
        (out, engine.captured_graphs())
    };
    let (plain_tokens, none) = run(false);
    let (captured_tokens, captured) = run(true);
    assert_eq!(none, 0, "graphs off captured {none}");
    // Greedy, top-k + top-p and plain temperature: three paths, three graphs.
    assert_eq!(captured, 3, "one graph per path");
    assert_eq!(plain_tokens, captured_tokens, "replayed steps sampled other tokens");
}

#[test]
fn overlapped_launches_equal_serial_launches_bit_for_bit() {
    // Each kernel of a step may start while the one before it finishes (sm_90 and later); it
    // waits inside for that kernel's writes, so the logits are the same bits as with every launch
    // waiting for the one before it, captured or not.
    // Wide enough that every matrix product runs many blocks a multiprocessor, with outputs
    // that share cache lines between blocks (the accumulating products into the residual).
    let dir = std::env::temp_dir().join(format!("kiln-gpu-engine-overlap-{}", std::process::id()));
    let spec = TinySpec {
        architecture: "Qwen3ForCausalLM",
        hidden: 768,
        heads: 12,
        kv_heads: 4,
        head_dim: 64,
        ffn: 2048,
        vocab: 4096,
        layers: 4,
        tied: true,
    };
    write_tiny_model(&dir, &spec, 8).expect("model");
    let model = load_model(&dir).expect("load");
    let prompt = random_ids(4, 24, 4096);
    let run = |overlap: bool, graphs: bool| -> Vec<Vec<u32>> {
        let gpu = kiln_cuda::Gpu::open(0).expect("a CUDA GPU");
        gpu.set_overlap_launches(overlap);
        assert_eq!(gpu.overlaps_launches(), overlap && gpu.facts().compute_capability.0 >= 9);
        let options = GpuOptions { max_batch: 1, max_context: 256, graphs, ..GpuOptions::default() };
        let mut engine = GpuEngine::new(gpu, &model, options).expect("engine");
        let mut seq = engine.new_sequence(greedy()).expect("sequence");
        let (mut tokens, first) = engine.step_with_logits(&mut [(&mut seq, &prompt)]).expect("prefill");
        let mut rows = vec![first[0].iter().map(|v| v.to_bits()).collect()];
        for _ in 0..24 {
            let (next, logits) = engine.step_with_logits(&mut [(&mut seq, &[tokens[0]])]).expect("decode");
            rows.push(logits[0].iter().map(|v| v.to_bits()).collect());
            tokens = next;
        }
        rows
    };
    let serial = run(false, true);
    for graphs in [true, false] {
        let overlapped = run(true, graphs);
        assert_eq!(serial.len(), overlapped.len());
        for (step, (a, b)) in serial.iter().zip(&overlapped).enumerate() {
            assert!(a == b, "step {step} (graphs {graphs}): overlapped launches changed the logits");
        }
    }
}

#[test]
fn sequences_batched_together_match_each_alone() {
    let model = model("LlamaForCausalLM", false, 21);
    let prompts = [random_ids(1, 5, 300), random_ids(2, 17, 300), random_ids(3, 40, 300)];
    let mut alone = Vec::new();
    for p in &prompts {
        let mut engine = engine(&model, false, 1);
        let mut seq = engine.new_sequence(greedy()).expect("sequence");
        let (t, l) = engine.step_with_logits(&mut [(&mut seq, p)]).expect("prefill");
        let (_, l2) = engine.step_with_logits(&mut [(&mut seq, &[t[0]])]).expect("decode");
        alone.push((t[0], l.into_iter().next().expect("row"), l2.into_iter().next().expect("row")));
    }
    let mut engine = engine(&model, true, 3);
    let mut seqs: Vec<GpuSequence> =
        (0..3).map(|_| engine.new_sequence(greedy()).expect("sequence")).collect();
    let (tokens, logits) = {
        let mut work: Vec<(&mut GpuSequence, &[u32])> =
            seqs.iter_mut().zip(&prompts).map(|(s, p)| (s, &p[..])).collect();
        engine.step_with_logits(&mut work).expect("batched prefill")
    };
    let next: Vec<[u32; 1]> = alone.iter().map(|a| [a.0]).collect();
    let (_, logits2) = {
        let mut work: Vec<(&mut GpuSequence, &[u32])> =
            seqs.iter_mut().zip(&next).map(|(s, t)| (s, &t[..])).collect();
        engine.step_with_logits(&mut work).expect("batched decode")
    };
    for (i, a) in alone.iter().enumerate() {
        assert!(relative(&logits[i], &a.1) <= TOLERANCE, "sequence {i}: prefill");
        assert!(relative(&logits2[i], &a.2) <= TOLERANCE, "sequence {i}: decode");
        let _ = tokens[i];
    }
}

#[test]
fn a_failed_step_leaves_the_cache_as_it_was() {
    let model = model("LlamaForCausalLM", false, 8);
    let mut engine = engine(&model, true, 2);
    let mut a = engine.new_sequence(greedy()).expect("sequence");
    let mut b = engine.new_sequence(greedy()).expect("sequence");
    engine.step(&mut [(&mut a, &random_ids(4, 10, 300))]).expect("prefill");
    let free = engine.free_pages();
    // The second sequence's token is outside the vocabulary: the step fails by name and neither
    // sequence keeps a position from it.
    let bad = [300u32];
    let good = [1u32];
    let e = engine.step(&mut [(&mut a, &good), (&mut b, &bad)]).expect_err("out of range");
    assert!(matches!(e, Error::OutOfBounds { what: "token id", .. }), "{e}");
    assert_eq!((a.len(), b.len(), engine.free_pages()), (10, 0, free));
    engine.step(&mut [(&mut a, &good), (&mut b, &good)]).expect("a later step works");
    assert_eq!((a.len(), b.len()), (11, 1));
}
