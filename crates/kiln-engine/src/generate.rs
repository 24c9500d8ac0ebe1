//! The generation loop: prefill the prompt, then sample one token at a time until a stop
//! condition, handing each token to the caller as it comes.

use std::time::{Duration, Instant};

use kiln_core::ops::sample::{sample, SamplingParams};
use kiln_core::{Error, Result};

use crate::models::LlamaModel;

/// How a generation runs.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The most tokens to generate.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end the generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens per forward call during prefill (bounds the activation memory).
    pub prefill_chunk: usize,
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was sampled.
    StopToken(u32),
    /// `max_tokens` were generated.
    MaxTokens,
    /// The KV cache (the model's context) is full.
    ContextFull,
    /// The caller asked to stop.
    Caller,
}

/// What a generation produced and how fast.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    /// Prompt tokens per second of prefill.
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    /// Generated tokens per second, counting the steps after the first token (each a forward
    /// of one token); the first token comes from the prefill's logits.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates from `prompt`, calling `on_token` with each new token; `on_token` returns `false`
/// to stop early.
pub fn generate(
    model: &LlamaModel,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::InvalidArgument {
            name: "prompt",
            value: "0 tokens".into(),
            reason: "a generation needs at least one prompt token".into(),
        });
    }
    options.sampling.validate()?;
    let mut cache = model.new_cache(prompt.len() + options.max_tokens)?;
    if prompt.len() >= cache.max_positions() {
        return Err(Error::InvalidArgument {
            name: "prompt",
            value: format!("{} tokens", prompt.len()),
            reason: format!("the model's context holds {} positions", cache.max_positions()),
        });
    }
    let started = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(options.prefill_chunk.max(1)) {
        logits = model.forward(chunk, &mut cache)?;
    }
    let prompt_time = started.elapsed();

    let decode_started = Instant::now();
    let mut history = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut stop = StopReason::MaxTokens;
    for step in 0..options.max_tokens {
        let token = sample(&logits, &options.sampling, &history, step as u64, 0)?;
        if options.stop_tokens.contains(&token) {
            stop = StopReason::StopToken(token);
            break;
        }
        tokens.push(token);
        history.push(token);
        if !on_token(token)? {
            stop = StopReason::Caller;
            break;
        }
        if tokens.len() == options.max_tokens {
            break;
        }
        if cache.len() + 1 > cache.max_positions() {
            stop = StopReason::ContextFull;
            break;
        }
        logits = model.forward(&[token], &mut cache)?;
    }
    Ok(Generation {
        tokens,
        stop,
        prompt_tokens: prompt.len(),
        prompt_time,
        decode_time: decode_started.elapsed(),
    })
}

/// As [`generate`], on the GPU engine: prefill in chunks of at most the engine's step size, then
/// one decode step a token (a captured graph after the first). The sampler runs on the device with
/// the same parameters, seed and steps as the CPU path.
pub fn generate_gpu(
    engine: &mut crate::models::gpu::GpuEngine,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::InvalidArgument {
            name: "prompt",
            value: "0 tokens".into(),
            reason: "a generation needs at least one prompt token".into(),
        });
    }
    let max_context = engine.options().max_context;
    if prompt.len() >= max_context {
        return Err(Error::InvalidArgument {
            name: "prompt",
            value: format!("{} tokens", prompt.len()),
            reason: format!("the engine holds {max_context} positions a sequence"),
        });
    }
    let mut sequence = engine.new_sequence(options.sampling)?;
    let result = run_gpu(engine, &mut sequence, prompt, options, on_token);
    engine.release(sequence);
    result
}

fn run_gpu(
    engine: &mut crate::models::gpu::GpuEngine,
    sequence: &mut crate::models::gpu::GpuSequence,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<bool>,
) -> Result<Generation> {
    let chunk = options.prefill_chunk.clamp(1, engine.options().max_step_tokens);
    let max_context = engine.options().max_context;
    let started = Instant::now();
    let mut token = 0;
    for part in prompt.chunks(chunk) {
        sequence.step = 0;
        token = engine.step(&mut [(&mut *sequence, part)])?[0];
    }
    let prompt_time = started.elapsed();
    let decode_started = Instant::now();
    let mut tokens = Vec::new();
    let mut stop = StopReason::MaxTokens;
    for step in 0..options.max_tokens {
        if options.stop_tokens.contains(&token) {
            stop = StopReason::StopToken(token);
            break;
        }
        tokens.push(token);
        if !on_token(token)? {
            stop = StopReason::Caller;
            break;
        }
        if tokens.len() == options.max_tokens {
            break;
        }
        if sequence.len() + 1 > max_context {
            stop = StopReason::ContextFull;
            break;
        }
        sequence.step = step as u64 + 1;
        token = engine.step(&mut [(&mut *sequence, &[token])])?[0];
    }
    Ok(Generation {
        tokens,
        stop,
        prompt_tokens: prompt.len(),
        prompt_time,
        decode_time: decode_started.elapsed(),
    })
}
