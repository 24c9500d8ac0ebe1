//! `kiln generate`: stream a model's continuation of a prompt to stdout.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, ValueEnum};
use kiln_core::ops::sample::SamplingParams;
use kiln_core::{Error, Result};
use kiln_engine::chat::{render_with, ChatMessage};
use kiln_engine::fetch::{self, DEFAULT_MODEL};
use kiln_engine::generate::{
    generate, generate_batch_gpu, generate_gpu, GenerateOptions, Request, StopReason,
};
use kiln_engine::models::gpu::{check_formats, GpuEngine, GpuOptions};
use kiln_engine::models::llama::LlamaModel;
use kiln_engine::models::load_path;

use crate::pull::BarProgress;

/// The GPU engine's KV cache page format (`--kv-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCache {
    /// bf16 values.
    Bf16,
    /// FP8 E4M3 codes with an fp32 scale a row: about half the bytes, nearly twice the context in
    /// the same memory; read by the tiled attention kernel.
    Fp8,
}

impl KvCache {
    /// The engine's page format.
    pub fn format(self) -> kiln_engine::kv::KvFormat {
        match self {
            KvCache::Bf16 => kiln_engine::kv::KvFormat::Bf16,
            KvCache::Fp8 => kiln_engine::kv::KvFormat::Fp8E4m3,
        }
    }
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The first CUDA GPU when one works (driver, NVRTC and a device found) and its kernels take
    /// every weight format of the model, else the CPU.
    Auto,
    /// The CPU, every core (rayon).
    Cpu,
    /// The first CUDA GPU (an error names what is missing when none works).
    Cuda,
}

/// Arguments of `kiln generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A GGUF file, or a known model name fetched into the cache on first use.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// The prompt; `-` reads it from standard input.
    #[arg(long, short, required_unless_present = "prompts_file", default_value = "")]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message for `--chat` (default: the template's own).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// The most tokens to generate (0 runs the prompt alone: its speed, no token).
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy (the most likely token each step).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens holding this share of the probability.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this share of the most likely one.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Subtract from the logit of every token already seen (negative: favour them).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this times the count of each token already seen (negative: favour them).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed of the sampler: the same seed, prompt and flags give the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A file of prompts, one per line, generated together on the GPU with continuous batching
    /// (on the CPU one after another); each completion is printed after all finish.
    #[arg(long, conflicts_with = "prompt")]
    pub prompts_file: Option<PathBuf>,
    /// Sequences running together with `--prompts-file`.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Where to run: `auto` takes the GPU when one works.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// KV positions the GPU engine holds (default: the prompt plus --max-tokens).
    #[arg(long)]
    pub context: Option<usize>,
    /// Run the GPU decode steps one launch at a time instead of replaying a captured graph.
    #[arg(long)]
    pub no_graphs: bool,
    /// GPU: multiply Q8_0 / Q4_0 / Q4_1 weights dequantized in registers against fp32 x instead
    /// of on the integer units with x as 16-bit fixed point (slower, closer to the CPU forward).
    #[arg(long)]
    pub no_integer_products: bool,
    /// GPU: the KV cache's pages, `bf16` or `fp8` (E4M3 with a scale a row: about half the
    /// memory, so nearly twice the context; attention then runs the tiled kernel). The CPU
    /// engine keeps its own cache and refuses `fp8` by name.
    #[arg(long, value_enum, default_value_t = KvCache::Bf16)]
    pub kv_cache: KvCache,
    /// CPU threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the token ids (one line, after the text) for scripts.
    #[arg(long)]
    pub print_ids: bool,
}

fn read_prompt(prompt: &str) -> Result<String> {
    if prompt != "-" {
        return Ok(prompt.to_string());
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
        .map_err(|e| Error::io(PathBuf::from("<stdin>"), e))?;
    Ok(text)
}

/// FP8 KV pages are the GPU engine's.
fn check_kv_cache(args: &GenerateArgs, use_gpu: bool) -> Result<()> {
    if !use_gpu && args.kv_cache != KvCache::Bf16 {
        return Err(Error::NotServed {
            op: "--kv-cache fp8",
            reason: "FP8 KV pages are the GPU engine's; the CPU engine runs on the CPU here".into(),
        });
    }
    Ok(())
}

/// Whether the GPU runs `model`, `use_gpu` being the device's choice: under `--device auto`, a
/// model with a weight format the CUDA kernels do not take ([`check_formats`]) runs on the CPU,
/// with a warning naming the tensor; `--device cuda` fails there, before any upload.
fn gpu_serves(args: &GenerateArgs, use_gpu: bool, model: &LlamaModel) -> Result<bool> {
    if !use_gpu {
        return Ok(false);
    }
    match check_formats(model) {
        Ok(()) => Ok(true),
        Err(e) if args.device == DeviceChoice::Auto && matches!(e.root(), Error::DTypeNotServed { .. }) => {
            tracing::warn!("{e}: {}; running on the CPU", e.root());
            check_kv_cache(args, false)?;
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

pub fn run(args: &GenerateArgs) -> Result<ExitCode> {
    let use_gpu = match args.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => {
            kiln_cuda::runtime::require_libcuda()?;
            true
        }
        DeviceChoice::Auto => kiln_cuda::probe().cuda_works(),
    };
    check_kv_cache(args, use_gpu)?;
    if let Some(threads) = args.threads {
        if threads == 0 {
            return Err(Error::InvalidArgument {
                name: "--threads",
                value: "0".into(),
                reason: "at least one thread".into(),
            });
        }
        // The global pool can be set once per process; this is the first use.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: args.seed,
    };
    sampling.validate()?;
    if let Some(file) = &args.prompts_file {
        return run_batch(args, file, use_gpu, sampling);
    }
    let prompt_text = read_prompt(&args.prompt)?;

    let path = fetch::resolve_model(&args.model, &mut BarProgress::new())?;
    let load_started = Instant::now();
    let (model, tokenizer) = load_path(&path)?;
    let use_gpu = gpu_serves(args, use_gpu, &model)?;
    let load_time = load_started.elapsed();
    tracing::debug!(config = ?model.config(), "model loaded");

    let (text, add_special) = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.as_str()));
        }
        messages.push(ChatMessage::new("user", prompt_text));
        (render_with(&tokenizer, &messages, true)?, false)
    } else {
        (prompt_text, true)
    };
    let prompt = tokenizer.encode(&text, add_special)?;
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        stop_tokens: tokenizer.eos_ids().to_vec(),
        prefill_chunk: 256,
    };

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut stream = tokenizer.stream();
    let mut broken_pipe = false;
    let mut engine = if use_gpu {
        let gpu = kiln_cuda::Gpu::open(0)?;
        let context = args
            .context
            .unwrap_or(prompt.len() + args.max_tokens + 1)
            .min(model.config().context_length.max(1));
        let gpu_options = GpuOptions {
            max_context: context,
            graphs: !args.no_graphs,
            integer_products: !args.no_integer_products,
            kv_format: args.kv_cache.format(),
            ..GpuOptions::default()
        };
        let mut engine = GpuEngine::new(gpu, &model, gpu_options)?;
        engine.use_tuning(crate::tune::open_store()?);
        let load = engine.load_report();
        tracing::info!(
            weights_gb = load.weight_bytes as f64 / 1e9,
            gb_per_s = load.gigabytes_per_second(),
            "weights on the GPU"
        );
        Some(engine)
    } else {
        None
    };
    let mut on_token = |token| {
        let piece = stream.step(token)?;
        match out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                broken_pipe = true;
                Ok(false)
            }
            Err(e) => Err(Error::io(PathBuf::from("<stdout>"), e)),
        }
    };
    let generation = match engine.as_mut() {
        Some(engine) => generate_gpu(engine, &prompt, &options, &mut on_token)?,
        None => generate(&model, &prompt, &options, &mut on_token)?,
    };
    if broken_pipe {
        return Ok(ExitCode::SUCCESS);
    }
    let tail = stream.finish();
    let _ = writeln!(out, "{tail}");
    if args.print_ids {
        let ids: Vec<String> = generation.tokens.iter().map(u32::to_string).collect();
        let _ = writeln!(out, "ids: {}", ids.join(" "));
    }
    let stop = match generation.stop {
        StopReason::StopToken(t) => format!("stop token {t}"),
        StopReason::MaxTokens => "max tokens".into(),
        StopReason::ContextFull => "context full".into(),
        StopReason::Caller => "stopped".into(),
    };
    let device = if engine.is_some() { "cuda:0" } else { "cpu" };
    eprintln!(
        "kiln: {} on {device} | load {:.2} s | prompt {} tokens, {:.1} tok/s | decode {} tokens, {:.1} tok/s | {stop}",
        path.display(),
        load_time.as_secs_f64(),
        generation.prompt_tokens,
        generation.prompt_tokens_per_second(),
        generation.tokens.len(),
        generation.decode_tokens_per_second(),
    );
    Ok(ExitCode::SUCCESS)
}

/// `--prompts-file`: every line a prompt, generated together on the GPU.
fn run_batch(
    args: &GenerateArgs,
    file: &std::path::Path,
    use_gpu: bool,
    sampling: SamplingParams,
) -> Result<ExitCode> {
    if args.batch == 0 {
        return Err(Error::InvalidArgument {
            name: "--batch",
            value: "0".into(),
            reason: "at least 1".into(),
        });
    }
    let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if lines.is_empty() {
        return Err(Error::InvalidArgument {
            name: "--prompts-file",
            value: file.display().to_string(),
            reason: "holds no prompt".into(),
        });
    }
    let path = fetch::resolve_model(&args.model, &mut BarProgress::new())?;
    let (model, tokenizer) = load_path(&path)?;
    let use_gpu = gpu_serves(args, use_gpu, &model)?;
    let mut requests = Vec::with_capacity(lines.len());
    for line in &lines {
        let (text, add_special) = if args.chat {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new("system", system.as_str()));
            }
            messages.push(ChatMessage::new("user", *line));
            (render_with(&tokenizer, &messages, true)?, false)
        } else {
            (line.to_string(), true)
        };
        requests.push(Request {
            prompt: tokenizer.encode(&text, add_special)?,
            options: GenerateOptions {
                max_tokens: args.max_tokens,
                sampling,
                stop_tokens: tokenizer.eos_ids().to_vec(),
                prefill_chunk: 256,
            },
        });
    }
    if !use_gpu {
        // On the CPU the prompts run one after another.
        let started = Instant::now();
        let mut out = std::io::stdout().lock();
        let mut total = 0;
        for (i, r) in requests.iter().enumerate() {
            let g = generate(&model, &r.prompt, &r.options, &mut |_| Ok(true))?;
            total += g.tokens.len();
            let _ = writeln!(out, "[{i}] {}", tokenizer.decode(&g.tokens)?);
            if args.print_ids {
                let ids: Vec<String> = g.tokens.iter().map(u32::to_string).collect();
                let _ = writeln!(out, "[{i}] ids: {}", ids.join(" "));
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        eprintln!(
            "kiln: {} on cpu | {} prompts, one at a time | {total} tokens in {elapsed:.2} s ({:.1} tok/s)",
            path.display(),
            requests.len(),
            total as f64 / elapsed.max(1e-9)
        );
        return Ok(ExitCode::SUCCESS);
    }
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let context =
        args.context.unwrap_or(longest + args.max_tokens + 1).min(model.config().context_length.max(1));
    let options = GpuOptions {
        max_batch: args.batch.min(requests.len()),
        max_step_tokens: 512.max(args.batch),
        max_context: context,
        graphs: !args.no_graphs,
        integer_products: !args.no_integer_products,
        kv_format: args.kv_cache.format(),
        ..GpuOptions::default()
    };
    let mut engine = GpuEngine::new(kiln_cuda::Gpu::open(0)?, &model, options)?;
    engine.use_tuning(crate::tune::open_store()?);
    let started = Instant::now();
    let generations = generate_batch_gpu(&mut engine, &requests, &mut |_, _| Ok(true))?;
    let elapsed = started.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    let mut total = 0;
    for (i, g) in generations.iter().enumerate() {
        total += g.tokens.len();
        let _ = writeln!(out, "[{i}] {}", tokenizer.decode(&g.tokens)?);
        if args.print_ids {
            let ids: Vec<String> = g.tokens.iter().map(u32::to_string).collect();
            let _ = writeln!(out, "[{i}] ids: {}", ids.join(" "));
        }
    }
    eprintln!(
        "kiln: {} on cuda:0 | {} prompts, {} at a time | {total} tokens in {elapsed:.2} s ({:.1} tok/s)",
        path.display(),
        requests.len(),
        options.max_batch,
        total as f64 / elapsed.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
