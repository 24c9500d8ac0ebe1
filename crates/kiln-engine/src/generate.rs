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
    options.sampling.validate()?;
    // One position past the prompt even for no new token (`max_tokens` 0 runs the prompt alone).
    check_prompt(prompt, model.config().context_length.max(1), "the model's context")?;
    let mut cache = model.new_cache(prompt.len() + options.max_tokens.max(1))?;
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
    check_prompt(prompt, engine.options().max_context, "the engine's sequences")?;
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

/// `Error::InvalidArgument` for an empty prompt or one that fills `positions` (what `holder` holds).
fn check_prompt(prompt: &[u32], positions: usize, holder: &str) -> Result<()> {
    let reason = if prompt.is_empty() {
        "a generation needs at least one prompt token (the prompt made none)".to_string()
    } else if prompt.len() >= positions {
        format!("a generation needs room for one more token; {holder} holds {positions} positions")
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument { name: "prompt", value: format!("{} tokens", prompt.len()), reason })
}

/// One request of a batched generation.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub options: GenerateOptions,
}

/// What continuous batching needs of an engine: sequences with a sampler step, steps over many
/// sequences, and the KV pages it has free. [`crate::models::gpu::GpuEngine`] is one.
pub trait BatchEngine {
    type Sequence;
    /// Sequences a step serves, tokens a step runs, positions a sequence holds, positions a page.
    fn limits(&self) -> (usize, usize, usize, usize);
    fn free_pages(&self) -> usize;
    fn new_sequence(&self, params: SamplingParams) -> Result<Self::Sequence>;
    /// Positions the sequence holds.
    fn positions(sequence: &Self::Sequence) -> usize;
    /// Sets the sampler's step for the sequence's next sample.
    fn set_step(sequence: &mut Self::Sequence, step: u64);
    /// Runs each sequence's tokens and samples one token for each (see
    /// [`crate::models::gpu::GpuEngine::step`]).
    fn step(&mut self, work: &mut [(&mut Self::Sequence, &[u32])]) -> Result<Vec<u32>>;
    fn release(&mut self, sequence: Self::Sequence);
}

impl BatchEngine for crate::models::gpu::GpuEngine {
    type Sequence = crate::models::gpu::GpuSequence;
    fn limits(&self) -> (usize, usize, usize, usize) {
        let o = self.options();
        (o.max_batch, o.max_step_tokens, o.max_context, o.page_tokens)
    }
    fn free_pages(&self) -> usize {
        crate::models::gpu::GpuEngine::free_pages(self)
    }
    fn new_sequence(&self, params: SamplingParams) -> Result<Self::Sequence> {
        crate::models::gpu::GpuEngine::new_sequence(self, params)
    }
    fn positions(sequence: &Self::Sequence) -> usize {
        sequence.len()
    }
    fn set_step(sequence: &mut Self::Sequence, step: u64) {
        sequence.step = step;
    }
    fn step(&mut self, work: &mut [(&mut Self::Sequence, &[u32])]) -> Result<Vec<u32>> {
        crate::models::gpu::GpuEngine::step(self, work)
    }
    fn release(&mut self, sequence: Self::Sequence) {
        crate::models::gpu::GpuEngine::release(self, sequence)
    }
}

struct Active<S> {
    index: usize,
    sequence: S,
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
pub fn generate_batch_gpu<E: BatchEngine>(
    engine: &mut E,
    requests: &[Request],
    on_token: &mut dyn FnMut(usize, u32) -> Result<bool>,
) -> Result<Vec<Generation>> {
    let (max_batch, max_step_tokens, max_context, page_tokens) = engine.limits();
    for (i, r) in requests.iter().enumerate() {
        r.options.sampling.validate()?;
        if r.prompt.is_empty() || r.prompt.len() + r.options.max_tokens > max_context {
            return Err(Error::InvalidArgument {
                name: "request",
                value: format!(
                    "#{i}: {} prompt tokens + {} to generate",
                    r.prompt.len(),
                    r.options.max_tokens
                ),
                reason: format!("between 1 and {} positions a sequence", max_context),
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
    let mut active: Vec<Active<E::Sequence>> = Vec::new();
    let mut reserved_pages = 0usize;
    let outcome = (|| -> Result<()> {
        while !waiting.is_empty() || !active.is_empty() {
            // Admit while a slot and the pages for the whole request are free.
            while let Some(&next) = waiting.front() {
                let r = &requests[next];
                let pages = (r.prompt.len() + r.options.max_tokens).div_ceil(page_tokens);
                if active.len() >= max_batch
                    || reserved_pages + pages
                        > engine.free_pages() + reserved_pages_in_use::<E>(&active, page_tokens)
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
            let mut budget = max_step_tokens.saturating_sub(decoding);
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
            let mut work: Vec<(&mut E::Sequence, &[u32])> = Vec::with_capacity(runs.len());
            {
                let mut rest: &mut [Active<E::Sequence>] = &mut active;
                let mut offset = 0;
                for (&k, input) in runs.iter().zip(&inputs) {
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(k - offset);
                    let (item, after) = tail.split_at_mut(1);
                    let step = item[0].tokens.len() as u64;
                    E::set_step(&mut item[0].sequence, step);
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
fn reserved_pages_in_use<E: BatchEngine>(active: &[Active<E::Sequence>], page_tokens: usize) -> usize {
    active.iter().map(|a| E::positions(&a.sequence).div_ceil(page_tokens)).sum()
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    /// An engine on the host: a sequence's next token is its last input token plus one (mod 1000);
    /// pages are counted, steps recorded.
    struct Fake {
        limits: (usize, usize, usize, usize),
        pages: usize,
        used: usize,
        steps: Vec<(usize, usize)>,
        samples: Vec<(usize, u64, u32)>,
        fail_at_step: Option<usize>,
        made: std::cell::Cell<usize>,
    }

    struct Seq {
        id: usize,
        positions: usize,
        pages: usize,
        step: u64,
    }

    impl BatchEngine for Fake {
        type Sequence = Seq;
        fn limits(&self) -> (usize, usize, usize, usize) {
            self.limits
        }
        fn free_pages(&self) -> usize {
            self.pages - self.used
        }
        fn new_sequence(&self, _: SamplingParams) -> Result<Seq> {
            self.made.set(self.made.get() + 1);
            Ok(Seq { id: self.made.get() - 1, positions: 0, pages: 0, step: 0 })
        }
        fn positions(s: &Seq) -> usize {
            s.positions
        }
        fn set_step(s: &mut Seq, step: u64) {
            s.step = step;
        }
        fn step(&mut self, work: &mut [(&mut Seq, &[u32])]) -> Result<Vec<u32>> {
            if self.fail_at_step == Some(self.steps.len()) {
                return Err(Error::NotServed { op: "fake", reason: "planned failure".into() });
            }
            let (max_batch, max_tokens, context, page) = self.limits;
            let tokens: usize = work.iter().map(|(_, t)| t.len()).sum();
            assert!(
                work.len() <= max_batch && tokens <= max_tokens,
                "{} sequences, {tokens} tokens",
                work.len()
            );
            self.steps.push((work.len(), tokens));
            let mut out = Vec::new();
            for (seq, input) in work.iter_mut() {
                seq.positions += input.len();
                assert!(seq.positions <= context);
                let pages = seq.positions.div_ceil(page);
                self.used += pages - seq.pages;
                seq.pages = pages;
                assert!(self.used <= self.pages, "over the pool");
                let token = (input[input.len() - 1] + 1) % 1000;
                self.samples.push((seq.id, seq.step, token));
                out.push(token);
            }
            Ok(out)
        }
        fn release(&mut self, s: Seq) {
            self.used -= s.pages;
        }
    }

    fn fake(max_batch: usize, max_tokens: usize, pages: usize) -> Fake {
        Fake {
            limits: (max_batch, max_tokens, 256, 16),
            pages,
            used: 0,
            steps: Vec::new(),
            samples: Vec::new(),
            fail_at_step: None,
            made: std::cell::Cell::new(0),
        }
    }

    fn request(first: u32, prompt_len: usize, max_tokens: usize, stop: &[u32]) -> Request {
        Request {
            prompt: (0..prompt_len as u32).map(|i| first + i).collect(),
            options: GenerateOptions {
                max_tokens,
                sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
                stop_tokens: stop.to_vec(),
                prefill_chunk: 64,
            },
        }
    }

    #[test]
    fn batched_requests_give_what_each_gives_alone_in_request_order() {
        let requests: Vec<Request> =
            (0..7).map(|i| request(100 * i as u32, 3 + 11 * i, 5 + i, &[])).collect();
        let mut alone = Vec::new();
        for r in &requests {
            let mut e = fake(1, 64, 1000);
            alone.push(generate_batch_gpu(&mut e, std::slice::from_ref(r), &mut |_, _| Ok(true)).unwrap());
        }
        let mut e = fake(3, 40, 1000);
        let mut seen = vec![0usize; requests.len()];
        let all = generate_batch_gpu(&mut e, &requests, &mut |i, _| {
            seen[i] += 1;
            Ok(true)
        })
        .unwrap();
        for (i, g) in all.iter().enumerate() {
            assert_eq!(g.tokens, alone[i][0].tokens, "request {i}");
            // Each sequence continues from its prompt's last token.
            let last = requests[i].prompt[requests[i].prompt.len() - 1];
            let expected: Vec<u32> =
                (1..=requests[i].options.max_tokens as u32).map(|k| (last + k) % 1000).collect();
            assert_eq!(g.tokens, expected);
            assert_eq!(g.stop, StopReason::MaxTokens);
            assert_eq!(seen[i], g.tokens.len());
        }
        // Steps mixed prompts and decodes within the limits, with up to 3 sequences at once.
        assert!(e.steps.iter().any(|&(seqs, _)| seqs == 3));
        assert_eq!(e.used, 0, "every page given back");
        // Sequences start in request order; the samples each kept were drawn at steps 0, 1, 2, ...
        // (a prompt chunk that does not finish the prompt samples too, and its token is dropped).
        for (i, g) in all.iter().enumerate() {
            let mine: Vec<(u64, u32)> = e.samples.iter().filter(|s| s.0 == i).map(|s| (s.1, s.2)).collect();
            let kept = &mine[mine.len() - g.tokens.len()..];
            let steps: Vec<u64> = kept.iter().map(|k| k.0).collect();
            assert_eq!(steps, (0..g.tokens.len() as u64).collect::<Vec<_>>(), "request {i}");
            assert_eq!(kept.iter().map(|k| k.1).collect::<Vec<_>>(), g.tokens);
        }
    }

    #[test]
    fn requests_wait_for_pages_and_stop_on_their_own_terms() {
        // 6 pages of 16 positions: each request needs 2 (prompt 10 + 8 tokens), so 3 run at once.
        let mut requests: Vec<Request> = (0..5).map(|i| request(10 * i as u32, 10, 8, &[])).collect();
        requests[1] = request(10, 10, 8, &[23]); // its third token would be 23: stops there
        let mut e = fake(8, 64, 6);
        let all = generate_batch_gpu(&mut e, &requests, &mut |i, _| Ok(i != 3)).unwrap();
        assert!(e.steps.iter().all(|&(seqs, _)| seqs <= 3), "{:?}", e.steps);
        assert_eq!(all[1].stop, StopReason::StopToken(23));
        assert_eq!(all[1].tokens, vec![20, 21, 22]);
        assert_eq!(all[3].stop, StopReason::Caller);
        assert_eq!(all[3].tokens.len(), 1);
        assert_eq!(all[4].tokens.len(), 8);
        assert_eq!(e.used, 0);
        // A request that could never fit is refused before anything runs.
        let mut small = fake(8, 64, 1);
        let e2 = generate_batch_gpu(&mut small, &requests[..1], &mut |_, _| Ok(true)).unwrap_err();
        assert!(matches!(e2, Error::PagePoolExhausted { requested_pages: 2, free_pages: 1 }), "{e2}");
        assert!(small.steps.is_empty());
    }

    #[test]
    fn a_failed_step_gives_every_page_back_and_names_the_error() {
        let requests: Vec<Request> = (0..4).map(|i| request(i as u32, 20, 10, &[])).collect();
        let mut e = fake(4, 64, 1000);
        e.fail_at_step = Some(3);
        let err = generate_batch_gpu(&mut e, &requests, &mut |_, _| Ok(true)).unwrap_err();
        assert!(matches!(err, Error::NotServed { op: "fake", .. }), "{err}");
        assert_eq!(e.used, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::test_models::{write_tiny_model, TinySpec};

    /// `max_tokens` 0 runs the prompt alone (no token, the prompt counted); more tokens follow the
    /// greedy argmax of the logits, the first one that of the prompt's forward; an empty prompt, and
    /// one that fills the model's context, are named argument errors.
    #[test]
    fn a_generation_runs_the_prompt_alone_or_greedy_tokens_after_it() {
        let dir = std::env::temp_dir().join(format!("kiln-generate-{}", std::process::id()));
        let model =
            crate::models::load_model(&write_tiny_model(&dir, &TinySpec::llama(), 7).unwrap()).unwrap();
        let prompt = [5u32, 17, 42, 99];
        let options = |max_tokens| GenerateOptions {
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_tokens: Vec::new(),
            prefill_chunk: 3,
        };
        let none = generate(&model, &prompt, &options(0), &mut |_| Ok(true)).unwrap();
        assert!(none.tokens.is_empty());
        assert_eq!((none.stop, none.prompt_tokens), (StopReason::MaxTokens, prompt.len()));

        let mut streamed = Vec::new();
        let three = generate(&model, &prompt, &options(3), &mut |t| {
            streamed.push(t);
            Ok(true)
        })
        .unwrap();
        assert_eq!((three.tokens.len(), three.stop), (3, StopReason::MaxTokens));
        assert_eq!(streamed, three.tokens);
        let mut cache = model.new_cache(prompt.len() + 1).unwrap();
        let logits = model.forward(&prompt, &mut cache).unwrap();
        assert_eq!(Some(three.tokens[0]), kiln_core::ops::sample::argmax(&logits));

        match generate(&model, &[], &options(3), &mut |_| Ok(true)) {
            Err(Error::InvalidArgument { name: "prompt", reason, .. }) => {
                assert!(reason.contains("the prompt made none"), "{reason}")
            }
            other => panic!("expected a prompt error, got {other:?}"),
        }
        // A prompt that fills the model's context leaves no room: the error names the context's
        // length, not the cache sized for this generation.
        let context = model.config().context_length;
        let long = vec![5u32; context];
        match generate(&model, &long, &options(3), &mut |_| Ok(true)) {
            Err(Error::InvalidArgument { name: "prompt", reason, .. }) => {
                assert!(reason.contains(&format!("holds {context} positions")), "{reason}")
            }
            other => panic!("expected a prompt error, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
