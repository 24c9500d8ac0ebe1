//! `kiln bench generate`: prompt and decode throughput of the GPU engine at several batch sizes
//! and depths, against the memory floor (the weights' bytes over the copy ceiling measured in the
//! same run) and, when given, llama.cpp's `llama-bench -o json` figures on the same file.

use std::path::PathBuf;
use std::time::Instant;

use kiln_core::ops::sample::SamplingParams;
use kiln_core::{Error, Result};
use kiln_engine::fetch;
use kiln_engine::models::gpu::{GpuEngine, GpuOptions};
use kiln_engine::models::load_model;
use kiln_engine::models::test_models::random_ids;
use serde::Serialize;

use crate::pull::BarProgress;

/// Arguments of `kiln bench generate`.
#[derive(Debug, clap::Args)]
pub struct BenchGenerateArgs {
    /// A GGUF file, a Hugging Face folder, or a known model name.
    #[arg(long, short, default_value = fetch::DEFAULT_MODEL)]
    model: String,
    /// Batch sizes (sequences decoding together), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence (random ids).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Decode steps measured.
    #[arg(long, default_value_t = 128)]
    decode: usize,
    /// Positions already in the cache before the measured decode, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Run decode steps one launch at a time instead of replaying captured graphs.
    #[arg(long)]
    no_graphs: bool,
    /// Multiply Q8_0 / Q4_0 / Q4_1 weights dequantized in registers instead of on the integer
    /// units (x as 16-bit fixed point).
    #[arg(long)]
    no_integer_products: bool,
    /// Round x for the integer-path products in launches of their own, instead of in the norms
    /// before the q/k/v and gate/up products (the default).
    #[arg(long)]
    no_norm_rounds_x: bool,
    /// Launch every kernel after the one before it has finished, instead of letting it start
    /// while that one finishes (sm_90 and later; the same results either way).
    #[arg(long)]
    serial_launches: bool,
    /// Steps of at most this many tokens use Kiln's matrix-vector kernels, longer ones cuBLAS.
    #[arg(long, default_value_t = kiln_engine::models::gpu::MATVEC_TOKENS)]
    matvec_tokens: usize,
    /// llama.cpp's `llama-bench -o json` output on the same model file, for the ratio columns.
    #[arg(long)]
    peer_llamacpp: Option<PathBuf>,
    /// Write the rows as JSON here as well.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Row {
    batch: usize,
    depth: usize,
    prompt_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    decode_step_us: f64,
    floor_tokens_per_s: f64,
    percent_of_floor: f64,
    launches_per_step: Option<usize>,
    peer_prompt_tokens_per_s: Option<f64>,
    peer_decode_tokens_per_s: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    gpu: String,
    weight_bytes: u64,
    load_gb_per_s: f64,
    copy_gb_per_s: f64,
    graphs: bool,
    /// Q8_0 / Q4_0 / Q4_1 decode products on the integer path (`--no-integer-products` clears it).
    integer_products: bool,
    /// Kernels start while the one before them finishes (`--serial-launches` clears it).
    overlapped_launches: bool,
    /// The norms wrote x rounded for the integer-path products (`--no-norm-rounds-x` clears it).
    norm_rounds_x: bool,
    rows: Vec<Row>,
}

/// llama-bench's JSON rows: (n_prompt, n_gen, n_depth, avg_ts).
fn read_peer(path: &PathBuf) -> Result<Vec<(u64, u64, u64, f64)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::InvalidArgument {
        name: "--peer-llamacpp",
        value: path.display().to_string(),
        reason: format!("not llama-bench JSON: {e}"),
    })?;
    let rows = json.as_array().ok_or_else(|| Error::InvalidArgument {
        name: "--peer-llamacpp",
        value: path.display().to_string(),
        reason: "expected a JSON array (llama-bench -o json)".into(),
    })?;
    Ok(rows
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap_or(0);
            (n("n_prompt"), n("n_gen"), n("n_depth"), r["avg_ts"].as_f64().unwrap_or(f64::NAN))
        })
        .collect())
}

pub fn run(args: &BenchGenerateArgs) -> Result<()> {
    let path = fetch::resolve_model(&args.model, &mut BarProgress::new())?;
    let model = load_model(&path)?;
    let gpu = kiln_cuda::Gpu::open(0)?;
    gpu.set_overlap_launches(!args.serial_launches);
    let copy = crate::bench::copy_ceiling(&gpu, 1 << 30, 5, 30)?;
    let peer = args.peer_llamacpp.as_ref().map(read_peer).transpose()?;
    let vocab = model.config().vocab;
    let mut rows = Vec::new();
    let mut weight_bytes = 0;
    let mut load_gb_per_s = 0.0;
    println!(
        "| batch | depth | prompt tok/s | decode tok/s | step (us) | floor tok/s | % of floor | launches/step | llama.cpp prompt | llama.cpp decode | decode vs llama.cpp |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for &depth in &args.depth {
        // Decode at depth is a one-sequence figure (as llama-bench's): the KV cache of a full
        // batch at long depth would not fit.
        let batches: Vec<usize> = if depth == 0 { args.batch.clone() } else { vec![1] };
        let max_batch = batches.iter().copied().max().unwrap_or(1);
        let context = depth + args.prompt + args.decode + 1;
        let options = GpuOptions {
            max_batch,
            max_step_tokens: args.chunk.max(max_batch),
            max_context: context.min(model.config().context_length),
            graphs: !args.no_graphs,
            matvec_tokens: args.matvec_tokens,
            integer_products: !args.no_integer_products,
            norm_rounds_x: !args.no_norm_rounds_x,
            ..GpuOptions::default()
        };
        let mut engine = GpuEngine::new(gpu.clone(), &model, options)?;
        engine.use_tuning(crate::tune::open_store()?);
        // Warm-up: one prefill chunk and decode steps at every batch size, so that the kernels
        // are compiled (or read from the disk cache) before anything is timed.
        {
            let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
            let mut warm: Vec<_> = Vec::new();
            for b in 0..max_batch {
                let mut seq = engine.new_sequence(params)?;
                let ids = random_ids(1000 + b as u64, args.chunk.min(args.prompt).max(1), vocab);
                engine.step(&mut [(&mut seq, &ids[..])])?;
                warm.push(seq);
            }
            for &batch in &batches {
                for _ in 0..3 {
                    let inputs = vec![[1u32]; batch];
                    let mut work: Vec<_> =
                        warm.iter_mut().take(batch).zip(&inputs).map(|(s, i)| (s, &i[..])).collect();
                    engine.step(&mut work)?;
                }
            }
            for seq in warm {
                engine.release(seq);
            }
        }
        for &batch in &batches {
            let load = engine.load_report();
            weight_bytes = load.weight_bytes;
            load_gb_per_s = load.gigabytes_per_second();
            let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
            let mut seqs = Vec::with_capacity(batch);
            for _ in 0..batch {
                seqs.push(engine.new_sequence(params)?);
            }
            // Depth, then the measured prompt, sequence by sequence in chunks.
            let mut prompt_seconds = 0.0;
            let mut last = vec![0u32; batch];
            for (b, seq) in seqs.iter_mut().enumerate() {
                let ids = random_ids(b as u64 + 1, depth + args.prompt, vocab);
                let (before, measured) = ids.split_at(depth);
                for part in before.chunks(args.chunk) {
                    engine.step(&mut [(seq, part)])?;
                }
                gpu.synchronize()?;
                let started = Instant::now();
                for part in measured.chunks(args.chunk) {
                    last[b] = engine.step(&mut [(seq, part)])?[0];
                }
                prompt_seconds += started.elapsed().as_secs_f64();
            }
            // Decode: two warm-up steps (compile, capture), then the measured ones.
            let mut decode = |engine: &mut GpuEngine, seqs: &mut [kiln_engine::models::gpu::GpuSequence]| {
                let inputs: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
                let mut work: Vec<(&mut kiln_engine::models::gpu::GpuSequence, &[u32])> =
                    seqs.iter_mut().zip(&inputs).map(|(s, i)| (s, &i[..])).collect();
                let tokens = engine.step(&mut work)?;
                last.copy_from_slice(&tokens);
                Ok::<(), Error>(())
            };
            for _ in 0..2 {
                decode(&mut engine, &mut seqs)?;
            }
            let steps = args.decode.saturating_sub(2).max(1);
            let started = Instant::now();
            for _ in 0..steps {
                decode(&mut engine, &mut seqs)?;
            }
            let decode_seconds = started.elapsed().as_secs_f64();
            let prompt_tps = (batch * args.prompt) as f64 / prompt_seconds.max(1e-9);
            let decode_tps = (batch * steps) as f64 / decode_seconds.max(1e-9);
            let step_us = decode_seconds / steps as f64 * 1e6;
            let floor = copy.gb_per_s * 1e9 / weight_bytes.max(1) as f64 * batch as f64;
            let launches = engine.launches_per_step(batch);
            for seq in seqs {
                engine.release(seq);
            }
            let find = |gen: bool| {
                peer.as_ref().and_then(|rows| {
                    rows.iter()
                        .find(|(p, g, d, _)| {
                            *d == depth as u64
                                && if gen { *g > 0 && *p == 0 } else { *p == args.prompt as u64 && *g == 0 }
                        })
                        .map(|r| r.3)
                })
            };
            // llama-bench decodes one sequence: its figures are set against batch 1 only.
            let (peer_prompt, peer_decode) =
                if batch == 1 { (find(false), find(true)) } else { (None, None) };
            let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            let ratio = peer_decode.map_or("-".to_string(), |p| format!("{:.2}x", decode_tps / p));
            println!(
                "| {batch} | {depth} | {prompt_tps:.1} | {decode_tps:.1} | {step_us:.1} | {floor:.1} | {:.1}% | {} | {} | {} | {ratio} |",
                100.0 * decode_tps / floor,
                launches.map_or("-".into(), |l| l.to_string()),
                fmt(peer_prompt),
                fmt(peer_decode),
            );
            rows.push(Row {
                batch,
                depth,
                prompt_tokens_per_s: prompt_tps,
                decode_tokens_per_s: decode_tps,
                decode_step_us: step_us,
                floor_tokens_per_s: floor,
                percent_of_floor: 100.0 * decode_tps / floor,
                launches_per_step: launches,
                peer_prompt_tokens_per_s: peer_prompt,
                peer_decode_tokens_per_s: peer_decode,
            });
        }
    }
    println!(
        "model {} | weights {:.2} GB loaded at {:.2} GB/s | copy ceiling {:.1} GB/s (same run) | floor = copy / weight bytes x batch | quantized products: {} | launches: {}",
        path.display(),
        weight_bytes as f64 / 1e9,
        load_gb_per_s,
        copy.gb_per_s,
        if args.no_integer_products { "dequantized in registers" } else { "integer path" },
        if gpu.overlaps_launches() { "overlapped" } else { "serial" }
    );
    if let Some(out) = &args.out {
        let report = Report {
            model: path.display().to_string(),
            gpu: gpu.facts().name.clone(),
            weight_bytes,
            load_gb_per_s,
            copy_gb_per_s: copy.gb_per_s,
            graphs: !args.no_graphs,
            integer_products: !args.no_integer_products,
            overlapped_launches: gpu.overlaps_launches(),
            norm_rounds_x: !args.no_norm_rounds_x,
            rows,
        };
        let text = serde_json::to_string_pretty(&report).map_err(|e| Error::InvalidArgument {
            name: "report",
            value: "json".into(),
            reason: e.to_string(),
        })?;
        std::fs::write(out, text).map_err(|e| Error::io(out, e))?;
    }
    Ok(())
}
