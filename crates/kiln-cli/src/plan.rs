//! `kiln plan`: the GPU memory a model takes under given limits, known before anything runs; with
//! `--measure`, the engine is built and run (a prefill and decode steps) and the pool's measured
//! peak is printed beside the plan.

use std::process::ExitCode;

use kiln_core::ops::sample::SamplingParams;
use kiln_core::{Error, Result};
use kiln_engine::fetch;
use kiln_engine::models::gpu::{GpuEngine, GpuOptions, GpuPlan};
use kiln_engine::models::load_model;

use crate::pull::BarProgress;

/// Arguments of `kiln plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A GGUF file, a Hugging Face folder, or a known model name.
    #[arg(long, short, default_value = fetch::DEFAULT_MODEL)]
    model: String,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Positions a sequence may reach.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Tokens one prefill step runs.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// The KV cache's pages, `bf16` or `fp8` (E4M3 with a scale a row).
    #[arg(long, value_enum, default_value_t = crate::generate::KvCache::Bf16)]
    kv_cache: crate::generate::KvCache,
    /// Build the engine on the GPU, run a full-context prefill and decode steps on every sequence,
    /// and print the measured peak beside the plan.
    #[arg(long)]
    measure: bool,
    /// With `--measure`: size the KV pool from what is left, this share of the device memory free
    /// once the weights and the workspace are in place (the plan then shows the pages it got).
    #[arg(long)]
    kv_fill: Option<f32>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

pub fn run(args: &PlanArgs) -> Result<ExitCode> {
    let path = fetch::resolve_model(&args.model, &mut BarProgress::new())?;
    let model = load_model(&path)?;
    let options = GpuOptions {
        max_batch: args.batch,
        max_step_tokens: args.chunk.max(args.batch),
        max_context: args.context.min(model.config().context_length),
        kv_format: args.kv_cache.format(),
        ..GpuOptions::default()
    };
    let plan = GpuPlan::new(&model, &options)?;
    if args.json && !args.measure {
        let text = serde_json::to_string_pretty(&plan).map_err(|e| Error::InvalidArgument {
            name: "plan",
            value: "json".into(),
            reason: e.to_string(),
        })?;
        println!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "plan for {} (batch {}, context {}, step {} tokens)",
        path.display(),
        args.batch,
        options.max_context,
        options.max_step_tokens
    );
    println!("| part | bytes |");
    println!("| --- | ---: |");
    println!("| weights (one arena) | {} |", mib(plan.weight_bytes));
    println!("| norm weights, RoPE tables | {} |", mib(plan.small_bytes));
    println!("| activations, metadata, sampler | {} |", mib(plan.activation_bytes));
    println!("| scratch (attention partials, bf16 expansion, sampler) | {} |", mib(plan.scratch_bytes));
    println!("| KV cache ({} pages) | {} |", plan.kv_pages, mib(plan.kv_bytes));
    println!("| **peak (Kiln's pool)** | **{}** |", mib(plan.total_bytes));
    println!("| cuBLAS workspace (its own, estimated) | {} |", mib(plan.cublas_workspace_bytes));
    if !args.measure {
        return Ok(ExitCode::SUCCESS);
    }
    let gpu = kiln_cuda::Gpu::open(0)?;
    let before = gpu.pool().stats();
    let mut engine = GpuEngine::new(gpu.clone(), &model, GpuOptions { kv_fill: args.kv_fill, ..options })?;
    let plan = engine.plan().clone();
    if args.kv_fill.is_some() {
        println!(
            "KV pool sized from what is left: {} pages ({}, {} positions a sequence at most {})",
            plan.kv_pages,
            mib(plan.kv_bytes),
            plan.kv_pages as usize * options.page_tokens,
            options.max_context
        );
    }
    let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let vocab = model.config().vocab as u32;
    let mut seqs = Vec::new();
    for b in 0..args.batch {
        let mut seq = engine.new_sequence(params)?;
        let ids: Vec<u32> =
            (0..options.max_context - 2).map(|i| (i as u32 * 7919 + b as u32) % vocab).collect();
        for part in ids.chunks(options.max_step_tokens) {
            engine.step(&mut [(&mut seq, part)])?;
        }
        seqs.push(seq);
    }
    for _ in 0..2 {
        let inputs = vec![[1u32]; seqs.len()];
        let mut work: Vec<_> = seqs.iter_mut().zip(&inputs).map(|(s, i)| (s, &i[..])).collect();
        engine.step(&mut work)?;
    }
    gpu.synchronize()?;
    let after = gpu.pool().stats();
    let measured = after.peak_live_bytes.saturating_sub(before.live_bytes);
    println!(
        "measured: pool peak {} (planned {}, difference {:+.2}%)",
        mib(measured),
        mib(plan.total_bytes),
        100.0 * (measured as f64 - plan.total_bytes as f64) / plan.total_bytes as f64
    );
    for seq in seqs {
        engine.release(seq);
    }
    Ok(ExitCode::SUCCESS)
}
