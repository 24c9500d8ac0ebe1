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

/// One request of a batched generation.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub options: GenerateOptions,
}

struct Active {
    index: usize,
    sequence: crate::models::gpu::GpuSequence,
    /// Prompt tokens already run.
    prefilled: usize,
    tokens: Vec<u32>,
    last: u32,
    started: Instant,
    prompt_time: Option<Duration>,
    decode_started: Option<Instant>,
}

/// Generates for many requests on the GPU engine with continuous batching: up to the engine's
/// `max_batch` sequences run together, a request joins as soon as a slot and the KV pages for its
/// prompt plus `max_tokens` are free, and leaves when it stops; each step mixes the decode token
/// of every running sequence with prompt chunks of joining ones, within the engine's
/// `max_step_tokens`. `on_token(request, token)` sees each token as it comes and returns `false`
/// to stop that request. Results come back in the order of `requests`.
pub fn generate_batch_gpu(
    engine: &mut crate::models::gpu::GpuEngine,
    requests: &[Request],
    on_token: &mut dyn FnMut(usize, u32) -> Result<bool>,
) -> Result<Vec<Generation>> {
    let opts = *engine.options();
    let page_tokens = opts.page_tokens;
    for (i, r) in requests.iter().enumerate() {
        r.options.sampling.validate()?;
        if r.prompt.is_empty() || r.prompt.len() + r.options.max_tokens > opts.max_context {
            return Err(Error::InvalidArgument {
                name: "request",
                value: format!(
                    "#{i}: {} prompt tokens + {} to generate",
                    r.prompt.len(),
                    r.options.max_tokens
                ),
                reason: format!("between 1 and {} positions a sequence", opts.max_context),
            });
        }
        let pages = (r.prompt.len() + r.options.max_tokens).div_ceil(page_tokens);
        if pages > engine.free_pages() {
            return Err(Error::PagePoolExhausted {
                requested_pages: pages as u64,
                free_pages: engine.free_pages() as u64,
            });
        }
    }
    let mut results: Vec<Option<Generation>> = vec![None; requests.len()];
    let mut waiting: std::collections::VecDeque<usize> = (0..requests.len()).collect();
    let mut active: Vec<Active> = Vec::new();
    let mut reserved_pages = 0usize;
    let outcome = (|| -> Result<()> {
        while !waiting.is_empty() || !active.is_empty() {
            // Admit while a slot and the pages for the whole request are free.
            while let Some(&next) = waiting.front() {
                let r = &requests[next];
                let pages = (r.prompt.len() + r.options.max_tokens).div_ceil(page_tokens);
                if active.len() >= opts.max_batch
                    || reserved_pages + pages
                        > engine.free_pages() + reserved_pages_in_use(&active, page_tokens)
                {
                    break;
                }
                waiting.pop_front();
                reserved_pages += pages;
                active.push(Active {
                    index: next,
                    sequence: engine.new_sequence(r.options.sampling)?,
                    prefilled: 0,
                    tokens: Vec::new(),
                    last: 0,
                    started: Instant::now(),
                    prompt_time: None,
                    decode_started: None,
                });
            }
            // The step: one token for each decoding sequence, then prompt chunks.
            let decoding = active.iter().filter(|a| a.prefilled == requests[a.index].prompt.len()).count();
            let mut budget = opts.max_step_tokens.saturating_sub(decoding);
            let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(active.len());
            let mut runs = Vec::with_capacity(active.len());
            for (k, a) in active.iter().enumerate() {
                let prompt = &requests[a.index].prompt;
                if a.prefilled == prompt.len() {
                    inputs.push(vec![a.last]);
                    runs.push(k);
                } else if budget > 0 {
                    let take = (prompt.len() - a.prefilled).min(budget);
                    budget -= take;
                    inputs.push(prompt[a.prefilled..a.prefilled + take].to_vec());
                    runs.push(k);
                }
            }
            if runs.is_empty() {
                return Err(Error::NotServed {
                    op: "batched generation",
                    reason: "a step with no work".into(),
                });
            }
            let mut work: Vec<(&mut crate::models::gpu::GpuSequence, &[u32])> =
                Vec::with_capacity(runs.len());
            {
                let mut rest: &mut [Active] = &mut active;
                let mut offset = 0;
                for (&k, input) in runs.iter().zip(&inputs) {
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(k - offset);
                    let (item, after) = tail.split_at_mut(1);
                    item[0].sequence.step = item[0].tokens.len() as u64;
                    work.push((&mut item[0].sequence, &input[..]));
                    rest = after;
                    offset = k + 1;
                }
            }
            let sampled = engine.step(&mut work)?;
            drop(work);
            // Tokens: only a sequence whose prompt is now complete keeps its sample.
            let mut finished = Vec::new();
            for ((&k, input), &token) in runs.iter().zip(&inputs).zip(&sampled) {
                let a = &mut active[k];
                let r = &requests[a.index];
                if a.prefilled < r.prompt.len() {
                    a.prefilled += input.len();
                    if a.prefilled < r.prompt.len() {
                        continue;
                    }
                    a.prompt_time = Some(a.started.elapsed());
                    a.decode_started = Some(Instant::now());
                }
                let stop = if r.options.stop_tokens.contains(&token) {
                    Some(StopReason::StopToken(token))
                } else {
                    a.tokens.push(token);
                    a.last = token;
                    if !on_token(a.index, token)? {
                        Some(StopReason::Caller)
                    } else if a.tokens.len() >= r.options.max_tokens {
                        Some(StopReason::MaxTokens)
                    } else {
                        None
                    }
                };
                if let Some(stop) = stop {
                    finished.push((k, stop));
                }
            }
            finished.sort_by_key(|f| std::cmp::Reverse(f.0));
            for (k, stop) in finished {
                let a = active.swap_remove(k);
                let r = &requests[a.index];
                reserved_pages -= (r.prompt.len() + r.options.max_tokens).div_ceil(page_tokens);
                results[a.index] = Some(Generation {
                    tokens: a.tokens,
                    stop,
                    prompt_tokens: r.prompt.len(),
                    prompt_time: a.prompt_time.unwrap_or_default(),
                    decode_time: a.decode_started.map(|s| s.elapsed()).unwrap_or_default(),
                });
                engine.release(a.sequence);
            }
        }
        Ok(())
    })();
    for a in active.drain(..) {
        engine.release(a.sequence);
    }
    outcome?;
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.ok_or_else(|| Error::NotServed {
                op: "batched generation",
                reason: format!("request {i} did not finish"),
            })
        })
        .collect()
}

/// Pages the running sequences hold now (their reservations count the rest).
fn reserved_pages_in_use(active: &[Active], page_tokens: usize) -> usize {
    active.iter().map(|a| a.sequence.len().div_ceil(page_tokens)).sum()
}
