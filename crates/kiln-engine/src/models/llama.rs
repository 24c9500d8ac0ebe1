//! The Llama family on the CPU: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k
//! RMSNorm), with a tied or separate output head.
//!
//! Quantized weights stay in their file's blocks and are used in place: every linear layer is a
//! quantized-by-float dot product per block ([`crate::formats::quant`]), rows split across the
//! rayon pool. Activations are fp32. The KV cache holds fp32 keys and values per layer.
//!
//! Tensor names follow GGUF (`blk.N.attn_q.weight`); a safetensors model is read through
//! [`hf_tensor_name`], which maps them to Hugging Face's names.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use kiln_core::ops::norm::rms_norm_f32;
use kiln_core::ops::primitives::{silu, FloatType};
use kiln_core::ops::rope::{rotate, RopeTable};
use kiln_core::{DType, Error, Result};

use crate::formats::quant::{dequantize_row, dot_rows_many, dot_rows_x, DotX};
use crate::formats::WeightSource;
use crate::models::config::ModelConfig;

/// A weight matrix `[rows, cols]` (row-major; one row per output) in its file's dtype.
#[derive(Debug, Clone)]
pub struct Linear {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bias: Option<Vec<f32>>,
}

/// One transformer block's weights (norms widened to fp32, matrices left in the source).
#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// Maps a GGUF tensor name of the Llama family to its Hugging Face name.
pub fn hf_tensor_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let Some(rest) = gguf.strip_prefix("blk.") else { return gguf.to_string() };
    let Some((layer, tail)) = rest.split_once('.') else { return gguf.to_string() };
    let mapped = match tail {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        other => return format!("model.layers.{layer}.{other}"),
    };
    format!("model.layers.{layer}.{mapped}")
}

/// A loaded Llama-family model: its configuration, and its weights left in the source.
pub struct LlamaModel {
    config: ModelConfig,
    source: Box<dyn WeightSource + Send + Sync>,
    naming: fn(&str) -> String,
    embed: Linear,
    output: Linear,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel").field("config", &self.config).finish()
    }
}

/// The per-sequence state: fp32 keys and values of every layer for the positions seen so far.
///
/// Layout of `values[layer]`: `[position][kv_head][head_dim]`, contiguous. `keys[layer]` is in
/// tiles of `KEY_TILE` (16) positions, `[tile][kv_head][head_dim][position in tile]`, so that the
/// scores of a tile's positions are SIMD lanes (the last tile's unused slots hold zeros or
/// positions forgotten by [`KvCache::truncate`], never read as scores).
#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
    max_positions: usize,
    rope: RopeTable,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The most positions this cache takes.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }
    /// Forgets every position from `len` on (a rollback after a failed or rejected step).
    pub fn truncate(&mut self, len: usize, kv_width: usize) {
        if len < self.len {
            for layer in &mut self.keys {
                layer.truncate(len.div_ceil(KEY_TILE) * KEY_TILE * kv_width);
            }
            for layer in &mut self.values {
                layer.truncate(len * kv_width);
            }
            self.len = len;
        }
    }
}

impl LlamaModel {
    /// Loads a model of `config` from `source`, whose tensor names `naming` maps from GGUF's.
    /// Every tensor's presence, dtype and shape is checked here, before any forward pass.
    pub fn load(
        config: ModelConfig,
        source: Box<dyn WeightSource + Send + Sync>,
        naming: fn(&str) -> String,
    ) -> Result<LlamaModel> {
        config.validate()?;
        let c = &config;
        let q_width = c.heads * c.head_dim;
        let kv_width = c.kv_heads * c.head_dim;
        let loader = Loader { source: source.as_ref(), naming, model: &c.name };
        let embed = loader.linear("token_embd.weight", c.vocab, c.hidden, false)?;
        let output = if loader.has("output.weight") {
            loader.linear("output.weight", c.vocab, c.hidden, false)?
        } else {
            embed.clone()
        };
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let n = |t: &str| format!("blk.{i}.{t}");
            layers.push(Layer {
                attn_norm: loader.vector(&n("attn_norm.weight"), c.hidden)?,
                q: loader.linear(&n("attn_q"), q_width, c.hidden, c.qkv_bias)?,
                k: loader.linear(&n("attn_k"), kv_width, c.hidden, c.qkv_bias)?,
                v: loader.linear(&n("attn_v"), kv_width, c.hidden, c.qkv_bias)?,
                o: loader.linear(&n("attn_output"), c.hidden, q_width, false)?,
                q_norm: if c.qk_norm {
                    Some(loader.vector(&n("attn_q_norm.weight"), c.head_dim)?)
                } else {
                    None
                },
                k_norm: if c.qk_norm {
                    Some(loader.vector(&n("attn_k_norm.weight"), c.head_dim)?)
                } else {
                    None
                },
                ffn_norm: loader.vector(&n("ffn_norm.weight"), c.hidden)?,
                gate: loader.linear(&n("ffn_gate"), c.ffn, c.hidden, false)?,
                up: loader.linear(&n("ffn_up"), c.ffn, c.hidden, false)?,
                down: loader.linear(&n("ffn_down"), c.hidden, c.ffn, false)?,
            });
        }
        if loader.has(&format!("blk.{}.attn_norm.weight", c.layers)) {
            return Err(Error::Model {
                model: c.name.clone(),
                reason: format!("the file holds more layers than the {} its metadata names", c.layers),
            });
        }
        let output_norm = loader.vector("output_norm.weight", c.hidden)?;
        Ok(LlamaModel { config, source, naming, embed, output, output_norm, layers })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// A new, empty KV cache for up to `max_positions` positions (capped at the model's context).
    pub fn new_cache(&self, max_positions: usize) -> Result<KvCache> {
        let max_positions = max_positions.clamp(1, self.config.context_length.max(1));
        Ok(KvCache {
            keys: vec![Vec::new(); self.config.layers],
            values: vec![Vec::new(); self.config.layers],
            len: 0,
            max_positions,
            rope: RopeTable::new(self.config.rope, self.config.head_dim, max_positions)?,
        })
    }

    /// A matrix's bytes as its source holds them.
    pub(crate) fn bytes(&self, linear: &Linear) -> Result<&[u8]> {
        self.source.tensor_bytes(&(self.naming)(&linear.name))
    }

    pub(crate) fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub(crate) fn embedding(&self) -> &Linear {
        &self.embed
    }

    pub(crate) fn output(&self) -> &Linear {
        &self.output
    }

    pub(crate) fn output_norm(&self) -> &[f32] {
        &self.output_norm
    }

    /// Runs `tokens` (at the cache's next positions) through the model, appends their keys and
    /// values to `cache`, and returns the logits of the last token.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let team = DecodeTeam::new();
        let helpers = if tokens.len() == 1 { rayon::current_num_threads().saturating_sub(1) } else { 0 };
        if helpers == 0 {
            return self.forward_with(tokens, cache, &team);
        }
        rayon::scope(|scope| {
            for _ in 0..helpers {
                scope.spawn(|_| team.help());
            }
            let _stop = StopOnDrop(&team);
            self.forward_with(tokens, cache, &team)
        })
    }

    /// [`LlamaModel::forward`], with the matrix-vector products of a single token shared by `team`.
    fn forward_with<'w>(
        &'w self,
        tokens: &[u32],
        cache: &mut KvCache,
        team: &DecodeTeam<'w>,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument {
                name: "tokens",
                value: "[]".into(),
                reason: "empty".into(),
            });
        }
        if cache.len + n > cache.max_positions {
            return Err(Error::InvalidArgument {
                name: "positions",
                value: (cache.len + n).to_string(),
                reason: format!("the KV cache holds at most {} positions", cache.max_positions),
            });
        }
        let hidden = c.hidden;
        let q_width = c.heads * c.head_dim;
        let kv_width = c.kv_heads * c.head_dim;

        // Embedding rows.
        let embed_bytes = self.bytes(&self.embed)?;
        let row_bytes = self.embed.dtype.bytes_for(hidden as u64)? as usize;
        let mut x = vec![0f32; n * hidden];
        for (t, &id) in tokens.iter().enumerate() {
            if id as usize >= c.vocab {
                return Err(Error::OutOfBounds {
                    op: "embedding",
                    what: "token id",
                    value: id.into(),
                    limit: c.vocab as u64,
                });
            }
            let start = id as usize * row_bytes;
            dequantize_row(
                self.embed.dtype,
                &embed_bytes[start..start + row_bytes],
                &mut x[t * hidden..(t + 1) * hidden],
            )?;
        }

        let mut h = vec![0f32; n * hidden];
        let mut q = vec![0f32; n * q_width];
        let mut k = vec![0f32; n * kv_width];
        let mut v = vec![0f32; n * kv_width];
        let mut attn = vec![0f32; n * q_width];
        let mut gate = vec![0f32; n * c.ffn];
        let mut up = vec![0f32; n * c.ffn];
        let mut proj = vec![0f32; n * hidden];
        let start_pos = cache.len;

        for (index, layer) in self.layers.iter().enumerate() {
            rms_norm_f32(&x, &layer.attn_norm, c.rms_eps, &mut h)?;
            self.linears(
                team,
                &mut [(&layer.q, &mut q[..]), (&layer.k, &mut k[..]), (&layer.v, &mut v[..])],
                &h,
                n,
            )?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                let mut tmp = vec![0f32; c.head_dim];
                for head in q.chunks_mut(c.head_dim) {
                    rms_norm_f32(head, qn, c.rms_eps, &mut tmp)?;
                    head.copy_from_slice(&tmp);
                }
                for head in k.chunks_mut(c.head_dim) {
                    rms_norm_f32(head, kn, c.rms_eps, &mut tmp)?;
                    head.copy_from_slice(&tmp);
                }
            }
            for t in 0..n {
                let pos = start_pos + t;
                apply_rope_row(&mut q[t * q_width..(t + 1) * q_width], c.head_dim, pos, &cache.rope);
                apply_rope_row(&mut k[t * kv_width..(t + 1) * kv_width], c.head_dim, pos, &cache.rope);
            }
            append_keys(&mut cache.keys[index], start_pos, &k, kv_width);
            cache.values[index].extend_from_slice(&v);
            let shape = AttentionShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim };
            attention(shape, &q, &cache.keys[index], &cache.values[index], start_pos, &mut attn);
            self.linears(team, &mut [(&layer.o, &mut proj[..])], &attn, n)?;
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);

            rms_norm_f32(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
            self.linears(team, &mut [(&layer.gate, &mut gate[..]), (&layer.up, &mut up[..])], &h, n)?;
            swiglu(&mut gate, &up);
            self.linears(team, &mut [(&layer.down, &mut proj[..])], &gate, n)?;
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        }
        cache.len += n;

        let last = &x[(n - 1) * hidden..];
        let mut normed = vec![0f32; hidden];
        rms_norm_f32(last, &self.output_norm, c.rms_eps, &mut normed)?;
        let mut logits = vec![0f32; c.vocab];
        self.linears(team, &mut [(&self.output, &mut logits[..])], &normed, 1)?;
        Ok(logits)
    }

    /// Several linear layers of the same input. For one token their rows are shared out among
    /// `team` as one job (see [`DecodeTeam`]).
    fn linears<'w>(
        &'w self,
        team: &DecodeTeam<'w>,
        layers: &mut [(&Linear, &mut [f32])],
        x: &[f32],
        n: usize,
    ) -> Result<()> {
        if n != 1 {
            for (linear, out) in layers.iter_mut() {
                self.linear(linear, x, n, out)?;
            }
            return Ok(());
        }
        // Two parts per thread: small enough to even out, few enough to claim cheaply.
        let parts_per_layer = 2 * rayon::current_num_threads().max(1);
        let mut parts = Vec::new();
        for (output, (linear, out)) in layers.iter().enumerate() {
            if out.len() != linear.rows || x.len() != linear.cols {
                return Err(Error::ShapeMismatch {
                    op: "linear",
                    expected: vec![linear.rows, linear.cols],
                    got: vec![out.len(), x.len()],
                });
            }
            let bytes = self.bytes(linear)?;
            let row_bytes = linear.dtype.bytes_for(linear.cols as u64)? as usize;
            let rows_per_part = linear.rows.div_ceil(parts_per_layer).max(1);
            let mut first_row = 0;
            while first_row < linear.rows {
                let rows = rows_per_part.min(linear.rows - first_row);
                let weights = &bytes[first_row * row_bytes..(first_row + rows) * row_bytes];
                parts.push(MatvecPart { dtype: linear.dtype, weights, output, first_row, rows });
                first_row += rows;
            }
        }
        team.run(parts, x, layers)?;
        for (linear, out) in layers.iter_mut() {
            if let Some(bias) = &linear.bias {
                out.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
        }
        Ok(())
    }

    /// `out[t] = W x[t] (+ bias)` for `n > 1` rows of `x`; the weight is read once for all rows.
    fn linear(&self, linear: &Linear, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let bytes = self.bytes(linear)?;
        let (rows, cols) = (linear.rows, linear.cols);
        {
            let row_bytes = linear.dtype.bytes_for(cols as u64)? as usize;
            // A task takes a slice of rows small enough to stay in L2 (about 32 KiB) and runs
            // every token over it, so the weights come from memory once for all tokens.
            let rows_per_chunk = (32 * 1024 / row_bytes.max(1)).clamp(2, rows.max(2)) & !1;
            // Result [chunk][token][row in chunk], so each task owns a contiguous block.
            let mut blocked = vec![0f32; rows * n];
            // x prepared once a token for every chunk of rows.
            let xs: Vec<DotX> = x.chunks_exact(cols).map(|x| DotX::for_dtypes(x, [linear.dtype])).collect();
            blocked.par_chunks_mut(rows_per_chunk * n).enumerate().try_for_each(|(chunk, dst)| {
                let first = chunk * rows_per_chunk;
                let count = dst.len() / n;
                let weights = &bytes[first * row_bytes..(first + count) * row_bytes];
                dot_rows_many(linear.dtype, weights, &xs, dst)
            })?;
            for (chunk, block) in blocked.chunks(rows_per_chunk * n).enumerate() {
                let first = chunk * rows_per_chunk;
                let count = block.len() / n;
                for (t, token_out) in block.chunks(count).enumerate() {
                    out[t * rows + first..t * rows + first + count].copy_from_slice(token_out);
                }
            }
        }
        if let Some(bias) = &linear.bias {
            for row in out.chunks_mut(rows) {
                row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
        }
        Ok(())
    }
}

/// The threads that share a decode step's matrix-vector products.
///
/// A decode step runs about four small products per layer (a tenth of a millisecond each on two
/// cores); waking rayon's sleeping pool for each cost about 15% of the step. Instead the step
/// runs inside one rayon scope whose helpers spin between products ([`DecodeTeam::help`]) and
/// claim parts of each product (row ranges) with an atomic counter, handing their rows back
/// through a mutex. The caller takes parts too and waits only for parts already claimed, so a
/// helper that never starts (a busy pool) slows the step down but cannot stall it. Every row is
/// computed by the same kernel whichever thread takes it, so the logits do not depend on the split.
struct DecodeTeam<'w> {
    job: Mutex<Option<Arc<MatvecJob<'w>>>>,
    /// Bumped after each new job is stored in `job`.
    generation: AtomicUsize,
    stop: AtomicBool,
}

/// Rows `first_row..first_row + rows` of the product written to output `output` of the job.
struct MatvecPart<'w> {
    dtype: DType,
    /// The part's rows, in the source's bytes.
    weights: &'w [u8],
    output: usize,
    first_row: usize,
    rows: usize,
}

struct MatvecJob<'w> {
    x: DotX,
    parts: Vec<MatvecPart<'w>>,
    /// The next part to claim.
    next: AtomicUsize,
    /// Parts not finished yet, by whichever thread claimed them.
    unfinished: AtomicUsize,
    /// The helpers' finished parts: part index and its rows.
    results: Mutex<Vec<(usize, Result<Vec<f32>>)>>,
}

impl MatvecJob<'_> {
    fn claim(&self) -> Option<usize> {
        let index = self.next.fetch_add(1, Ordering::Relaxed);
        (index < self.parts.len()).then_some(index)
    }
}

/// Tells the team's helpers to return, however the step ends.
struct StopOnDrop<'a, 'w>(&'a DecodeTeam<'w>);

impl Drop for StopOnDrop<'_, '_> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Release);
    }
}

/// Counts a claimed part as finished, however its product ends.
struct FinishOnDrop<'a>(&'a AtomicUsize);

impl Drop for FinishOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl<'w> DecodeTeam<'w> {
    fn new() -> Self {
        DecodeTeam { job: Mutex::new(None), generation: AtomicUsize::new(0), stop: AtomicBool::new(false) }
    }

    /// A helper's loop: takes parts of each new job until the team stops.
    fn help(&self) {
        let mut seen = 0;
        let mut idle_spins = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            let generation = self.generation.load(Ordering::Acquire);
            if generation == seen {
                // Between products, run the step's other parallel work (attention's heads, handed
                // to the pool); spin while products follow each other closely; yield the core in
                // a long gap.
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle_spins = 0;
                    continue;
                }
                idle_spins = idle_spins.saturating_add(1);
                if idle_spins < 1 << 16 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            seen = generation;
            idle_spins = 0;
            let Some(job) = self.job.lock().ok().and_then(|job| job.clone()) else { continue };
            while let Some(index) = job.claim() {
                // Counted as finished even if the product panics, so the caller never waits on it.
                let _finished = FinishOnDrop(&job.unfinished);
                let part = &job.parts[index];
                let mut rows = vec![0f32; part.rows];
                let result = dot_rows_x(part.dtype, part.weights, &job.x, &mut rows).map(|()| rows);
                if let Ok(mut results) = job.results.lock() {
                    results.push((index, result));
                }
            }
        }
    }

    /// Runs `parts` (each a row range of one of `outputs`) over `x` with the team's helpers, and
    /// returns once every part is in `outputs`.
    fn run(
        &self,
        parts: Vec<MatvecPart<'w>>,
        x: &[f32],
        outputs: &mut [(&Linear, &mut [f32])],
    ) -> Result<()> {
        let count = parts.len();
        let job = Arc::new(MatvecJob {
            x: DotX::for_dtypes(x, parts.iter().map(|p| p.dtype)),
            parts,
            next: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(count),
            results: Mutex::new(Vec::new()),
        });
        if let Ok(mut slot) = self.job.lock() {
            *slot = Some(Arc::clone(&job));
            self.generation.fetch_add(1, Ordering::Release);
        }
        let mut done = vec![false; count];
        let mut first_error = None;
        while let Some(index) = job.claim() {
            let part = &job.parts[index];
            let out = &mut outputs[part.output].1[part.first_row..part.first_row + part.rows];
            if let Err(e) = dot_rows_x(part.dtype, part.weights, &job.x, out) {
                first_error.get_or_insert(e);
            }
            done[index] = true;
            job.unfinished.fetch_sub(1, Ordering::Release);
        }
        while job.unfinished.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        // A poisoned lock still holds every result pushed before the panic.
        let results =
            std::mem::take(&mut *job.results.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        for (index, rows) in results {
            let part = &job.parts[index];
            match rows {
                Ok(rows) => {
                    outputs[part.output].1[part.first_row..part.first_row + part.rows].copy_from_slice(&rows);
                    done[index] = true;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        // A part claimed by a helper that panicked (rayon raises the panic when the scope ends).
        for (part, _) in job.parts.iter().zip(&done).filter(|(_, done)| !**done) {
            let out = &mut outputs[part.output].1[part.first_row..part.first_row + part.rows];
            dot_rows_x(part.dtype, part.weights, &job.x, out)?;
        }
        Ok(())
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, over the pool for a prompt. On x86-64 with FMA the loop is
/// compiled with it, so `exp_poly`'s fused multiply-adds are instructions, not library calls
/// (the same bits: a fused multiply-add rounds once either way).
fn swiglu(gate: &mut [f32], up: &[f32]) {
    const CHUNK: usize = 4096;
    let run = |(g, u): (&mut [f32], &[f32])| {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { swiglu_fma(g, u) };
        }
        swiglu_plain(g, u)
    };
    if gate.len() > CHUNK {
        gate.par_chunks_mut(CHUNK).zip(up.par_chunks(CHUNK)).for_each(run);
    } else {
        run((gate, up));
    }
}

#[inline(always)]
fn swiglu_plain(gate: &mut [f32], up: &[f32]) {
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = silu(*g) * u);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(gate: &mut [f32], up: &[f32]) {
    swiglu_plain(gate, up)
}

/// Rotates every head of one token's q or k row with the table's cos and sin at `position`.
fn apply_rope_row(row: &mut [f32], head_dim: usize, position: usize, table: &RopeTable) {
    let half = table.spec.rotary_dim / 2;
    let cos = &table.cos[position * half..(position + 1) * half];
    let sin = &table.sin[position * half..(position + 1) * half];
    for head in row.chunks_mut(head_dim) {
        for i in 0..half {
            let (ia, ib) = table.spec.pair(i);
            let (a, b) = rotate(head[ia], head[ib], cos[i], sin[i], FloatType::F32);
            head[ia] = a;
            head[ib] = b;
        }
    }
}

/// Positions a tile of the key cache holds: their scores are summed side by side.
const KEY_TILE: usize = 16;

/// Writes the keys of `k.len() / kv_width` new positions from `start` into a layer's tiled key
/// cache (see [`KvCache`]; `kv_width` = KV heads x head_dim), growing it a zeroed tile at a
/// time. Within a tile, value `i` of a position's row (head `i / head_dim`, element
/// `i % head_dim`) sits at `i * KEY_TILE`.
fn append_keys(keys: &mut Vec<f32>, start: usize, k: &[f32], kv_width: usize) {
    for (t, row) in k.chunks_exact(kv_width).enumerate() {
        let p = start + t;
        let tile = p / KEY_TILE;
        if keys.len() < (tile + 1) * KEY_TILE * kv_width {
            keys.resize((tile + 1) * KEY_TILE * kv_width, 0.0);
        }
        let base = tile * KEY_TILE * kv_width + p % KEY_TILE;
        for (i, &v) in row.iter().enumerate() {
            keys[base + i * KEY_TILE] = v;
        }
    }
}

/// The scores `q . k_p * scale` of `N` tiles' KEY_TILE positions each (a tile:
/// `[head_dim][KEY_TILE]`): each position's running sum over the head dimension, in order, from
/// -0.0 (as `Iterator::sum`), so every score is the sum one position at a time would give; the
/// positions are the lanes of SIMD registers, and the `N` tiles `N` independent chains in flight.
#[inline(always)]
fn tile_scores<const N: usize>(qh: &[f32], tiles: [&[f32]; N], scale: f32) -> [[f32; KEY_TILE]; N] {
    let mut sums = [[-0.0f32; KEY_TILE]; N];
    for (d, &qd) in qh.iter().enumerate() {
        for (tile_sums, tile) in sums.iter_mut().zip(tiles) {
            if let Some(kd) = tile[d * KEY_TILE..].first_chunk::<KEY_TILE>() {
                for (sum, &kv) in tile_sums.iter_mut().zip(kd) {
                    *sum += qd * kv;
                }
            }
        }
    }
    sums.map(|tile| tile.map(|s| s * scale))
}

/// Rows of values requested this far ahead of the weighted sum: a row of a KV head is a few
/// cache lines every `kv_width` values, a stride the hardware's prefetchers follow late.
const PREFETCH_ROWS: usize = 16;

/// Asks for the cache lines of `values[at..at + len]` (nothing past the end; a hint only).
#[inline(always)]
fn prefetch_row(values: &[f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if at + len <= values.len() {
        for line in (0..len).step_by(16) {
            // SAFETY: a prefetch reads nothing and faults on nothing; the address is in `values`.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().add(at + line).cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, at, len);
}

/// `acc[i] += w_p v_p[i]` for the positions of `weights` in order, row `p` of the values at
/// `values[first + p * stride..]` (the first `acc.len()` of it when shorter than `N`), the sums
/// kept in registers.
#[inline(always)]
fn weighted_rows<const N: usize>(
    mut acc: [f32; N],
    weights: &[f32],
    values: &[f32],
    first: usize,
    stride: usize,
    width: usize,
) -> [f32; N] {
    if width == N {
        for (p, &w) in weights.iter().enumerate() {
            prefetch_row(values, first + (p + PREFETCH_ROWS) * stride, N);
            if let Some(vp) = values[first + p * stride..].first_chunk::<N>() {
                for (a, &v) in acc.iter_mut().zip(vp) {
                    *a += w * v;
                }
            }
        }
    } else {
        for (p, &w) in weights.iter().enumerate() {
            let at = first + p * stride;
            for (a, &v) in acc.iter_mut().zip(&values[at..at + width]) {
                *a += w * v;
            }
        }
    }
    acc
}

/// One KV head of a layer's cache as attention reads it: the tiled keys, the values, and where
/// the head sits in a position's row.
#[derive(Clone, Copy)]
struct HeadCache<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    kv_width: usize,
    kv_head: usize,
}

/// Query heads that share a KV head taken together, at most this many: their scores and outputs
/// read each tile of keys and each row of values once.
const HEADS_TOGETHER: usize = 4;

/// `G` query heads of one token (each `head_dim` long, one after the other in `q`) sharing one KV
/// head, over `visible` positions, into `o` (the same layout): for each head the scores tile by
/// tile, the softmax and the weighted sum of the values, each head's operations in the order one
/// head alone takes them (the same bits). Compiled for AVX-512 too and chosen at run time.
fn heads_attention<const G: usize>(
    q: &[f32],
    cache: HeadCache<'_>,
    scale: f32,
    visible: usize,
    o: &mut [f32],
) {
    #[inline(always)]
    fn run<const G: usize>(q: &[f32], cache: HeadCache<'_>, scale: f32, visible: usize, o: &mut [f32]) {
        let HeadCache { keys, values, kv_width, kv_head } = cache;
        let hd = q.len() / G;
        let qs: [&[f32]; G] = std::array::from_fn(|g| &q[g * hd..][..hd]);
        // Each head's scores, `visible` of them, one head after another.
        let mut scores = vec![0f32; G * visible];
        let tile_at = |tile: usize| tile * KEY_TILE * kv_width + kv_head * hd * KEY_TILE;
        // Four tiles side by side (four independent chains of additions a head), then the rest.
        let groups = visible / (4 * KEY_TILE);
        // The G heads one after another over the same four tiles (16 KiB at a head size of 64),
        // which the first head brought into the L1 cache.
        for group in 0..groups {
            let tiles: [&[f32]; 4] =
                std::array::from_fn(|i| &keys[tile_at(4 * group + i)..][..hd * KEY_TILE]);
            for (dst, qh) in scores.chunks_exact_mut(visible).zip(qs) {
                let sums = tile_scores(qh, tiles, scale);
                dst[group * 4 * KEY_TILE..][..4 * KEY_TILE].copy_from_slice(sums.as_flattened());
            }
        }
        let done = groups * 4 * KEY_TILE;
        for (i, first) in (done..visible).step_by(KEY_TILE).enumerate() {
            let at = tile_at(done / KEY_TILE + i);
            let len = KEY_TILE.min(visible - first);
            for (dst, qh) in scores.chunks_exact_mut(visible).zip(qs) {
                let [sums] = tile_scores(qh, [&keys[at..at + hd * KEY_TILE]], scale);
                dst[first..first + len].copy_from_slice(&sums[..len]);
            }
        }
        for head in scores.chunks_exact_mut(visible) {
            let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // The exponentials, then their sum in order: a sum kept across the calls would pass
            // through memory at each one.
            for s in head.iter_mut() {
                *s = (*s - max).exp();
            }
            let total = head.iter().fold(0f32, |total, &s| total + s);
            for s in head.iter_mut() {
                *s /= total;
            }
        }
        // o[d] = sum over positions, in order from +0.0, of w_p v_p[d]: VALUE_CHUNK values of d
        // of a head at a time held in registers across VALUE_BLOCK positions, the G heads one
        // after another over the same block of rows (16 KiB at most), which the first head
        // brought into the L1 cache.
        const VALUE_CHUNK: usize = 64;
        const VALUE_BLOCK: usize = 64;
        for c in 0..hd.div_ceil(VALUE_CHUNK) {
            let width = VALUE_CHUNK.min(hd - c * VALUE_CHUNK);
            let mut sums = [[0f32; VALUE_CHUNK]; G];
            let first = kv_head * hd + c * VALUE_CHUNK;
            for block in (0..visible).step_by(VALUE_BLOCK) {
                let end = visible.min(block + VALUE_BLOCK);
                let at = block * kv_width + first;
                for (head_sums, head) in sums.iter_mut().zip(scores.chunks_exact(visible)) {
                    *head_sums = weighted_rows(*head_sums, &head[block..end], values, at, kv_width, width);
                }
            }
            for (g, head_sums) in sums.iter().enumerate() {
                o[g * hd + c * VALUE_CHUNK..][..width].copy_from_slice(&head_sums[..width]);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512<const G: usize>(
        q: &[f32],
        cache: HeadCache<'_>,
        scale: f32,
        visible: usize,
        o: &mut [f32],
    ) {
        run::<G>(q, cache, scale, visible, o)
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { run_avx512::<G>(q, cache, scale, visible, o) };
    }
    run::<G>(q, cache, scale, visible, o)
}

/// The head counts and size of an attention.
#[derive(Debug, Clone, Copy)]
struct AttentionShape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Causal grouped-query attention of `n` new tokens at positions `start..start + n` over every
/// cached position (`keys` tiled, see [`KvCache`]), a task one token's heads of a KV head's group.
fn attention(c: AttentionShape, q: &[f32], keys: &[f32], values: &[f32], start: usize, out: &mut [f32]) {
    let hd = c.head_dim;
    let group = c.heads / c.kv_heads;
    let kv_width = c.kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let tokens = out.len() / (c.heads * hd);
    // A task: one token's heads of one KV head's group for a prompt, taken HEADS_TOGETHER at a
    // time (each tile of keys and row of values read once for them); one token's single head for
    // a few tokens, so that a decode step's heads spread over the threads.
    let task_heads = if tokens >= 8 { group } else { 1 };
    let one = |(task, o): (usize, &mut [f32])| {
        let (t, first) = (task * task_heads / c.heads, task * task_heads % c.heads);
        let q = &q[t * c.heads * hd + first * hd..][..task_heads * hd];
        let cache = HeadCache { keys, values, kv_width, kv_head: first / group };
        let visible = start + t + 1;
        for (q, o) in q.chunks(HEADS_TOGETHER * hd).zip(o.chunks_mut(HEADS_TOGETHER * hd)) {
            match o.len() / hd {
                4 => heads_attention::<4>(q, cache, scale, visible, o),
                3 => heads_attention::<3>(q, cache, scale, visible, o),
                2 => heads_attention::<2>(q, cache, scale, visible, o),
                _ => heads_attention::<1>(q, cache, scale, visible, o),
            }
        }
    };
    // Waking the pool costs more than a short step's attention; during a decode step the pool's
    // other threads are the step's team, which take the heads between products.
    let work = tokens * c.heads * (start + tokens) * hd;
    if work < 1 << 14 {
        out.chunks_mut(task_heads * hd).enumerate().for_each(one);
    } else {
        out.par_chunks_mut(task_heads * hd).enumerate().for_each(one);
    }
}

/// Looks tensors up by GGUF name and checks their dtype and shape.
struct Loader<'a> {
    source: &'a (dyn WeightSource + Send + Sync),
    naming: fn(&str) -> String,
    model: &'a str,
}

impl Loader<'_> {
    fn has(&self, name: &str) -> bool {
        self.source.weight_info(&(self.naming)(name)).is_some()
    }

    fn info(&self, name: &str) -> Result<crate::formats::WeightInfo> {
        let mapped = (self.naming)(name);
        self.source
            .weight_info(&mapped)
            .ok_or_else(|| Error::MissingTensor { model: self.model.to_string(), tensor: mapped })
    }

    fn check_shape(&self, name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
        if got != expected {
            return Err(Error::Model {
                model: self.model.to_string(),
                reason: format!("tensor `{name}` has shape {got:?}, the configuration implies {expected:?}"),
            });
        }
        Ok(())
    }

    /// A 1-D tensor of `len` values widened to fp32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        self.check_shape(name, &info.shape, &[len])?;
        self.source.tensor(&(self.naming)(name))?.to_f32_vec()
    }

    /// A matrix `[rows, cols]`; `base` without `.weight` when `bias` may follow.
    fn linear(&self, base: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        let name = if base.ends_with(".weight") { base.to_string() } else { format!("{base}.weight") };
        let info = self.info(&name)?;
        self.check_shape(&name, &info.shape, &[rows, cols])?;
        if !info.dtype.is_served() || matches!(info.dtype, DType::Q8_1) {
            return Err(Error::DTypeNotServed { dtype: info.dtype.name(), op: "linear layer" });
        }
        info.dtype.bytes_for(cols as u64).map_err(|e| e.context(format!("tensor `{name}`")))?;
        let bias = if bias {
            let bias_name = format!("{}.bias", base.trim_end_matches(".weight"));
            Some(self.vector(&bias_name, rows)?)
        } else {
            None
        };
        Ok(Linear { name, dtype: info.dtype, rows, cols, bias })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention over the tiled key cache, filled by a prompt and then single steps (crossing
    /// tiles) and cut back once by `KvCache::truncate`'s rule, equals a plain one-position-at-a-time
    /// reading of the untiled rows bit for bit: each score a sum over the head in order from
    /// -0.0, times the scale; the softmax; each output a sum over positions in order from +0.0.
    #[test]
    fn tiled_attention_equals_the_plain_sums_bit_for_bit() {
        let mut values = crate::models::test_models::Values::from_clock();
        let mut next = || values.next();
        for shape in [
            AttentionShape { heads: 9, kv_heads: 3, head_dim: 64 },
            AttentionShape { heads: 4, kv_heads: 4, head_dim: 80 },
            AttentionShape { heads: 2, kv_heads: 1, head_dim: 8 },
            // Groups of 7 and 5: a prompt's tasks take 4 then 3, and 4 then 1, heads together.
            AttentionShape { heads: 14, kv_heads: 2, head_dim: 16 },
            AttentionShape { heads: 5, kv_heads: 1, head_dim: 96 },
        ] {
            let (hd, kv_width) = (shape.head_dim, shape.kv_heads * shape.head_dim);
            let q_width = shape.heads * hd;
            let mut keys = Vec::new();
            let mut rows: Vec<f32> = Vec::new();
            let mut values: Vec<f32> = Vec::new();
            // A prompt of 70 positions (a group of four tiles and a part), then 14 steps of one,
            // truncated to 79, then 9 more.
            let mut steps = vec![70];
            steps.extend([1; 14]);
            steps.extend([0, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
            let mut len = 0usize;
            for n in steps {
                if n == 0 {
                    len = 79;
                    keys.truncate(len.div_ceil(KEY_TILE) * KEY_TILE * kv_width);
                    rows.truncate(len * kv_width);
                    values.truncate(len * kv_width);
                    continue;
                }
                let k: Vec<f32> = (0..n * kv_width).map(|_| next() * 3.0).collect();
                let v: Vec<f32> = (0..n * kv_width).map(|_| next()).collect();
                let q: Vec<f32> = (0..n * q_width).map(|_| next() * 3.0).collect();
                append_keys(&mut keys, len, &k, kv_width);
                rows.extend_from_slice(&k);
                values.extend_from_slice(&v);
                let mut out = vec![f32::NAN; n * q_width];
                attention(shape, &q, &keys, &values, len, &mut out);
                let scale = 1.0 / (hd as f32).sqrt();
                for t in 0..n {
                    for head in 0..shape.heads {
                        let kvh = head / (shape.heads / shape.kv_heads);
                        let qh = &q[t * q_width + head * hd..][..hd];
                        let visible = len + t + 1;
                        let mut scores: Vec<f32> = (0..visible)
                            .map(|p| {
                                let kp = &rows[p * kv_width + kvh * hd..][..hd];
                                qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale
                            })
                            .collect();
                        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut total = 0f32;
                        for s in scores.iter_mut() {
                            *s = (*s - max).exp();
                            total += *s;
                        }
                        for d in 0..hd {
                            let mut want = 0f32;
                            for (p, &s) in scores.iter().enumerate() {
                                want += (s / total) * values[p * kv_width + kvh * hd + d];
                            }
                            let got = out[t * q_width + head * hd + d];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{shape:?} position {visible} head {head} d {d}"
                            );
                        }
                    }
                }
                len += n;
            }
        }
    }
}
