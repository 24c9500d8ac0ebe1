//! The Llama family on the CPU: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k
//! RMSNorm), with a tied or separate output head.
//!
//! Quantized weights stay in their file's blocks and are used in place: every linear layer is a
//! quantized-by-float dot product per block ([`crate::formats::quant`]), rows split across the
//! rayon pool. Activations are fp32. The KV cache holds fp32 keys and values per layer.
//!
//! Tensor names follow GGUF (`blk.N.attn_q.weight`); a safetensors model is read through
//! [`hf_tensor_name`], which maps them to Hugging Face's names.

use rayon::prelude::*;

use kiln_core::ops::norm::rms_norm_f32;
use kiln_core::ops::primitives::{silu, FloatType};
use kiln_core::ops::rope::{rotate, RopeTable};
use kiln_core::{DType, Error, Result};

use crate::formats::quant::{dequantize_row, dot_rows, matvec};
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
/// Layout of `keys[layer]` and `values[layer]`: `[position][kv_head][head_dim]`, contiguous.
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
            for layer in self.keys.iter_mut().chain(self.values.iter_mut()) {
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
            cache.keys[index].extend_from_slice(&k);
            cache.values[index].extend_from_slice(&v);
            attention(c, &q, &cache.keys[index], &cache.values[index], start_pos, &mut attn);
            self.linear(&layer.o, &attn, n, &mut proj)?;
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);

            rms_norm_f32(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
            self.linears(&mut [(&layer.gate, &mut gate[..]), (&layer.up, &mut up[..])], &h, n)?;
            gate.iter_mut().zip(&up).for_each(|(g, u)| *g = silu(*g) * u);
            self.linear(&layer.down, &gate, n, &mut proj)?;
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        }
        cache.len += n;

        let last = &x[(n - 1) * hidden..];
        let mut normed = vec![0f32; hidden];
        rms_norm_f32(last, &self.output_norm, c.rms_eps, &mut normed)?;
        let mut logits = vec![0f32; c.vocab];
        self.linear(&self.output, &normed, 1, &mut logits)?;
        Ok(logits)
    }

    /// Several linear layers of the same input. For one token they run as one parallel region
    /// (each layer's rows split per thread), since waking the pool once per layer costs more
    /// than the small products themselves.
    fn linears(&self, layers: &mut [(&Linear, &mut [f32])], x: &[f32], n: usize) -> Result<()> {
        if n != 1 {
            for (linear, out) in layers.iter_mut() {
                self.linear(linear, x, n, out)?;
            }
            return Ok(());
        }
        let threads = rayon::current_num_threads().max(1);
        let mut tasks: Vec<(&Linear, &[u8], usize, &mut [f32])> = Vec::new();
        for (linear, out) in layers.iter_mut() {
            let linear: &Linear = linear;
            if out.len() != linear.rows || x.len() != linear.cols {
                return Err(Error::ShapeMismatch {
                    op: "linear",
                    expected: vec![linear.rows, linear.cols],
                    got: vec![out.len(), x.len()],
                });
            }
            let bytes = self.bytes(linear)?;
            let row_bytes = linear.dtype.bytes_for(linear.cols as u64)? as usize;
            let rows_per_task = linear.rows.div_ceil(threads).max(1);
            for (chunk, dst) in out.chunks_mut(rows_per_task).enumerate() {
                tasks.push((linear, bytes, chunk * rows_per_task * row_bytes, dst));
            }
        }
        tasks.into_par_iter().try_for_each(|(linear, bytes, start, dst)| {
            let row_bytes = linear.dtype.bytes_for(linear.cols as u64)? as usize;
            dot_rows(linear.dtype, &bytes[start..start + dst.len() * row_bytes], x, dst)
        })?;
        for (linear, out) in layers.iter_mut() {
            if let Some(bias) = &linear.bias {
                out.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
        }
        Ok(())
    }

    /// `out[t] = W x[t] (+ bias)` for `n` rows of `x`; the weight is read once for all rows.
    fn linear(&self, linear: &Linear, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let bytes = self.bytes(linear)?;
        let (rows, cols) = (linear.rows, linear.cols);
        if n == 1 {
            matvec(linear.dtype, bytes, rows, cols, x, out)?;
        } else {
            let row_bytes = linear.dtype.bytes_for(cols as u64)? as usize;
            // A task takes a slice of rows small enough to stay in L2 (about 32 KiB) and runs
            // every token over it, so the weights come from memory once for all tokens.
            let rows_per_chunk = (32 * 1024 / row_bytes.max(1)).clamp(2, rows.max(2)) & !1;
            // Result [chunk][token][row in chunk], so each task owns a contiguous block.
            let mut blocked = vec![0f32; rows * n];
            blocked.par_chunks_mut(rows_per_chunk * n).enumerate().try_for_each(|(chunk, dst)| {
                let first = chunk * rows_per_chunk;
                let count = dst.len() / n;
                let weights = &bytes[first * row_bytes..(first + count) * row_bytes];
                for (t, token_out) in dst.chunks_mut(count).enumerate() {
                    dot_rows(linear.dtype, weights, &x[t * cols..(t + 1) * cols], token_out)?;
                }
                Ok::<(), Error>(())
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

/// Causal grouped-query attention of `n` new tokens at positions `start..start + n` over every
/// cached position, one (token, head) pair per task.
fn attention(c: &ModelConfig, q: &[f32], keys: &[f32], values: &[f32], start: usize, out: &mut [f32]) {
    let hd = c.head_dim;
    let group = c.heads / c.kv_heads;
    let kv_width = c.kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let one = |(task, o): (usize, &mut [f32])| {
        let (t, head) = (task / c.heads, task % c.heads);
        let kv_head = head / group;
        let qh = &q[t * c.heads * hd + head * hd..][..hd];
        let visible = start + t + 1;
        let mut scores: Vec<f32> = (0..visible)
            .map(|p| {
                let kp = &keys[p * kv_width + kv_head * hd..][..hd];
                qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        o.fill(0.0);
        for (p, &s) in scores.iter().enumerate() {
            let w = s / total;
            let vp = &values[p * kv_width + kv_head * hd..][..hd];
            o.iter_mut().zip(vp).for_each(|(a, b)| *a += w * b);
        }
    };
    // Waking the pool costs more than a short decode step's attention.
    let work = out.len() / hd * (start + out.len() / (c.heads * hd)) * hd;
    if work < 1 << 18 {
        out.chunks_mut(hd).enumerate().for_each(one);
    } else {
        out.par_chunks_mut(hd).enumerate().for_each(one);
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
