//! The Llama family on CUDA: the whole forward pass on the device, with no host round trip per
//! layer.
//!
//! - **Weights** live in one arena: every matrix in its file's format (bf16, fp16, fp32, Q8_0,
//!   Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS), q|k|v and gate|up placed back
//!   to back so that one launch serves each pair when their formats agree; biases and q/k norm
//!   weights as fp32. The norms' weights are fp32 blocks of their own (the norm kernel takes
//!   whole blocks).
//! - **Activations** are blocks sized by the [`GpuPlan`] once, before the first token; a step
//!   allocates nothing, so a decode step can be captured as a CUDA graph and replayed.
//! - **KV cache**: bf16 pages (`kiln_engine::kv` bookkeeping, `[page][kv_head][slot][head_dim]`),
//!   as many as the plan leaves room for.
//!
//! A step runs each sequence's new tokens: embedding, then per layer RMSNorm, q|k|v, q/k norm +
//! RoPE + the K/V write into the pages, paged attention, the output projection added into the
//! residual stream, RMSNorm, gate|up with SwiGLU, the down projection added into the residual
//! stream; then the final norm of each sequence's last token, the LM head and the sampler.
//! Steps of at most 8 tokens use Kiln's matrix-vector kernels (weights read once for all
//! tokens); longer ones use cuBLAS on 16-bit copies of the activations (quantized weights are
//! expanded to bf16 one matrix at a time).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kiln_core::ops::attention::AttentionShape;
use kiln_core::ops::norm::RmsNorm;
use kiln_core::ops::rope::{RopeLayout, RopeTable};
use kiln_core::ops::sample::SamplingParams;
use kiln_core::tuning::TuningStore;
use kiln_core::{DType, Error, Result};
use kiln_cuda::blas::Blas;
use kiln_cuda::certify;
use kiln_cuda::cudarc::driver::{sys as cu, CudaGraph};
use kiln_cuda::memory::size_class;
use kiln_cuda::ops::attention::{self, decode_splits, scratch_bytes, KvBuffers, KvScales, PagedBatch};
use kiln_cuda::ops::forward::{self, QkvBuffers, QkvShape};
use kiln_cuda::ops::linear::{self, Epilogue, LinearCall};
use kiln_cuda::ops::norm::{self as norm_op, NormBuffers, NormCall};
use kiln_cuda::ops::sample::{
    self as sample_op, DeviceSamplingParams, SampleBuffers, SamplePath, PARAMS_BYTES,
};
use kiln_cuda::{DeviceMemory, DeviceView, Gpu};

use crate::kv::{KvFormat, KvLayout, PagePool, PageTable};
use crate::models::config::ModelConfig;
use crate::models::llama::{Layer, Linear, LlamaModel};

/// Tokens a launch of the matrix-vector kernels takes; longer steps use the matrix-product path.
pub const MATVEC_TOKENS: usize = 8;
/// Alignment of every tensor in the weight arena.
const ARENA_ALIGN: usize = 256;

/// What the engine is sized for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuOptions {
    /// Sequences one step serves (at most 256, the sampler's rows).
    pub max_batch: usize,
    /// Tokens one step runs, over all its sequences (a prefill chunk).
    pub max_step_tokens: usize,
    /// Positions a sequence may reach (prompt plus generated).
    pub max_context: usize,
    /// Positions per KV page (a power of two).
    pub page_tokens: usize,
    /// KV pages; `None` gives every sequence of the batch room for `max_context`.
    pub kv_pages: Option<usize>,
    /// Size the KV pool from what is left instead: this share (0 to 1) of the device memory free
    /// once the weights and the workspace are in place, less a reserve for cuBLAS.
    pub kv_fill: Option<f32>,
    /// Capture pure decode steps as CUDA graphs and replay them.
    pub graphs: bool,
    /// Steps of at most this many tokens (1 to 8) run Kiln's matrix-vector kernels; longer ones
    /// the matrix products (cuBLAS).
    pub matvec_tokens: usize,
    /// Q8_0 / Q4_0 / Q4_1 matrix-vector products on the integer path (x as 16-bit fixed point per
    /// block of 32, `kiln_cuda::ops::linear::INT8_VARIANTS`); false: dequantized in registers
    /// against fp32 x (slower, closer to the CPU forward).
    pub integer_products: bool,
    /// The decode norms before the q/k/v and gate/up products also write their output rounded
    /// as those products take it on the integer path (`norm_with_int8_planes`), which then run
    /// without a rounding launch of their own: the same bits as the rounding launch (checked by
    /// `tests/gpu_linear`), 64 fewer launches a Llama-3-8B step. On by default.
    pub norm_rounds_x: bool,
    /// The longest context of decode attention's short class
    /// ([`certify::DecodeClass`]): a decode step whose longest sequence is past it runs the long
    /// class's certified configuration, and is captured apart. `certify::DECODE_SHORT_MAX` by
    /// default, the boundary the certificates were measured for.
    pub decode_short_max: usize,
    /// The KV pages' format: bf16, or FP8 E4M3 with a scale a row (`KvFormat::Fp8E4m3`: about
    /// half the bytes, so nearly twice the positions in the same memory). FP8 pages are read by
    /// the tiled attention kernel's variants: where the certificate names another kernel, decode
    /// runs the tiled wide variant at the certified splits and prefill the tiled prefill.
    pub kv_format: KvFormat,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            max_batch: 1,
            max_step_tokens: 512,
            max_context: 4096,
            page_tokens: certify::PAGE_TOKENS,
            kv_pages: None,
            kv_fill: None,
            graphs: true,
            integer_products: true,
            norm_rounds_x: true,
            matvec_tokens: MATVEC_TOKENS,
            decode_short_max: certify::DECODE_SHORT_MAX,
            kv_format: KvFormat::Bf16,
        }
    }
}

/// Bytes of one page's codes (or values) and of its scales in one layer's K (or V) buffer.
fn kv_page_bytes(c: &ModelConfig, o: &GpuOptions) -> (usize, usize) {
    let rows = c.kv_heads * o.page_tokens;
    (rows * c.head_dim * o.kv_format.bytes(), rows * o.kv_format.scale_bytes())
}

/// One matrix in the arena.
#[derive(Debug, Clone, Copy)]
struct DeviceLinear {
    weight: DeviceView,
    bias: Option<DeviceView>,
    dtype: DType,
    rows: usize,
    cols: usize,
}

#[derive(Debug)]
struct DeviceLayer {
    attn_norm: DeviceMemory,
    ffn_norm: DeviceMemory,
    /// q|k|v as one matrix when their formats agree, else each on its own.
    qkv: Vec<DeviceLinear>,
    q_norm: Option<DeviceView>,
    k_norm: Option<DeviceView>,
    o: DeviceLinear,
    /// gate|up as one matrix (SwiGLU epilogue) when their formats agree, else each on its own.
    gate_up: Vec<DeviceLinear>,
    down: DeviceLinear,
}

/// The memory a model and its engine take on the device, known before anything is allocated.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuPlan {
    /// The weight arena (matrices, biases, q/k norms).
    pub weight_bytes: u64,
    /// The norms' fp32 weight blocks and the RoPE tables.
    pub small_bytes: u64,
    /// Activations, per-step metadata, sampler buffers.
    pub activation_bytes: u64,
    /// bf16 copies of one quantized matrix for the matrix-product path, and attention partials.
    pub scratch_bytes: u64,
    pub kv_pages: u64,
    pub kv_bytes: u64,
    /// Everything above, in the pool's block sizes.
    pub total_bytes: u64,
    /// What cuBLAS is expected to add on its own (its workspace), not counted in `total_bytes`.
    pub cublas_workspace_bytes: u64,
}

/// Bytes of `count` elements of `dtype`.
fn bytes_of(dtype: DType, count: usize) -> Result<usize> {
    Ok(dtype.bytes_for(count as u64)? as usize)
}

fn align(n: usize) -> usize {
    n.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// The activation blocks of an engine, by name and bytes, in allocation order.
fn activation_sizes(c: &ModelConfig, o: &GpuOptions) -> Vec<(&'static str, usize)> {
    let t = o.max_step_tokens;
    let b = o.max_batch;
    let qkv = (c.heads + 2 * c.kv_heads) * c.head_dim;
    let q = c.heads * c.head_dim;
    let pages_per_seq = o.max_context.div_ceil(o.page_tokens);
    vec![
        ("x", t * c.hidden * 4),
        ("h", t * c.hidden * 4),
        ("h16", t * c.hidden * 2),
        ("qkv", t * qkv * 4),
        ("q16", t * q * 2),
        ("attn16", t * q * 2),
        ("attn_f16", t * q * 2),
        ("mlp", t * 2 * c.ffn * 4),
        ("mlp16", t * c.ffn * 2),
        ("last", b * c.hidden * 4),
        ("last_normed", b * c.hidden * 4),
        ("last16", b * c.hidden * 2),
        ("logits", b * c.vocab * 4),
        ("meta", MetaLayout::new(t, b, pages_per_seq).words * 4),
        ("params", b * PARAMS_BYTES),
        ("steps", b * 8),
        ("history_offsets", (b + 1) * 4),
        ("tokens", b * 4),
        // With FP8 pages: the step's new K and V rows in bf16 before they are quantized into
        // their slots, and the slots 0..t they are written at there.
        ("kv_new", if o.kv_format == KvFormat::Bf16 { 4 } else { 2 * t * c.kv_heads * c.head_dim * 2 }),
        ("kv_rows", if o.kv_format == KvFormat::Bf16 { 4 } else { t * 4 }),
    ]
}

/// Where each section of the per-step metadata block starts, in 32-bit words, for capacities of
/// `t` tokens, `b` sequences and `pages` pages a sequence: ids, positions, slots `[t]`; last rows
/// `[b]`; query offsets `[b + 1]`; context lengths `[b]`; page offsets `[b + 1]`; page ids
/// `[b][pages]`. The host writes it and the kernels read it through the same layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MetaLayout {
    ids: usize,
    positions: usize,
    slots: usize,
    last_rows: usize,
    query_offsets: usize,
    context_lens: usize,
    page_offsets: usize,
    page_ids: usize,
    pages_per_seq: usize,
    words: usize,
}

impl MetaLayout {
    fn new(t: usize, b: usize, pages_per_seq: usize) -> MetaLayout {
        let last_rows = 3 * t;
        let query_offsets = last_rows + b;
        let context_lens = query_offsets + b + 1;
        let page_offsets = context_lens + b;
        let page_ids = page_offsets + b + 1;
        MetaLayout {
            ids: 0,
            positions: t,
            slots: 2 * t,
            last_rows,
            query_offsets,
            context_lens,
            page_offsets,
            page_ids,
            pages_per_seq,
            words: page_ids + b * pages_per_seq,
        }
    }

    fn of(o: &GpuOptions) -> MetaLayout {
        MetaLayout::new(o.max_step_tokens, o.max_batch, o.max_context.div_ceil(o.page_tokens))
    }
}

/// The matrices of a layer that share one launch.
fn fused_groups(layer: &Layer) -> (Vec<&Linear>, Vec<&Linear>) {
    (vec![&layer.q, &layer.k, &layer.v], vec![&layer.gate, &layer.up])
}

/// Bytes of the weight arena: every matrix aligned, biases and q/k norms as fp32.
fn arena_bytes(model: &LlamaModel) -> Result<usize> {
    let c = model.config();
    let mut total = 0;
    let mut add = |bytes: usize| total += align(bytes);
    for layer in model.layers() {
        let (qkv, gate_up) = fused_groups(layer);
        for l in qkv.iter().chain(&gate_up).chain([&&layer.o, &&layer.down]) {
            // Matrices of a fused group are placed back to back; their row bytes are whole blocks,
            // so no padding goes between them (the group is aligned as a whole).
            add(bytes_of(l.dtype, l.rows * l.cols)?);
            if let Some(bias) = &l.bias {
                add(bias.len() * 4);
            }
        }
        if c.qk_norm {
            add(c.head_dim * 4);
            add(c.head_dim * 4);
        }
    }
    add(bytes_of(model.embedding().dtype, c.vocab * c.hidden)?);
    if model.output().name != model.embedding().name {
        add(bytes_of(model.output().dtype, c.vocab * c.hidden)?);
    }
    Ok(total + 4 * ARENA_ALIGN)
}

/// The largest bf16 copy the matrix-product path makes of a non-16-bit matrix (0 when every
/// matrix is bf16 or fp16).
fn expand_scratch_bytes(model: &LlamaModel) -> usize {
    let mut most = 0;
    for layer in model.layers() {
        let (qkv, gate_up) = fused_groups(layer);
        for group in [qkv, gate_up, vec![&layer.o], vec![&layer.down]] {
            if group.iter().all(|l| matches!(l.dtype, DType::BF16 | DType::F16)) && fusable(&group) {
                continue;
            }
            let rows: usize = group.iter().map(|l| l.rows).sum();
            most = most.max(rows * group[0].cols * 2);
        }
    }
    most
}

/// The integer-path scratch of the decode products: x of up to [`MATVEC_TOKENS`] tokens as int8
/// planes and their block scales, for the widest input of any matrix.
fn int8_scratch_bytes(model: &LlamaModel) -> usize {
    let mut cols = model.config().hidden;
    for layer in model.layers() {
        for l in [&layer.q, &layer.k, &layer.v, &layer.o, &layer.gate, &layer.up, &layer.down] {
            cols = cols.max(l.cols);
        }
    }
    linear::int8_scratch_bytes(MATVEC_TOKENS, cols)
}

/// Whether the CUDA kernels take every weight of `model` in its format: each matrix of the layers
/// and the output head, and the token embedding's rows (`linear::embed_rows`), all through the
/// linear kernels' formats. The first that does not is [`Error::DTypeNotServed`] in the context of
/// its tensor's name (`--device cpu` serves every format the loader accepts).
pub fn check_formats(model: &LlamaModel) -> Result<()> {
    let weights = model
        .layers()
        .iter()
        .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
        .chain([model.output(), model.embedding()]);
    first_unserved(weights)
}

fn first_unserved<'a>(weights: impl IntoIterator<Item = &'a Linear>) -> Result<()> {
    for l in weights {
        linear::serves_weight(l.dtype)
            .map_err(|e| e.context(format!("tensor `{}` on the GPU (`--device cpu` serves it)", l.name)))?;
    }
    Ok(())
}

impl GpuPlan {
    /// The plan of `model` under `options` (an error where [`check_formats`] finds a weight the
    /// kernels do not take).
    pub fn new(model: &LlamaModel, options: &GpuOptions) -> Result<GpuPlan> {
        let c = model.config();
        validate_options(c, options)?;
        check_formats(model)?;
        let weight_bytes = size_class(arena_bytes(model)?) as u64;
        let rope_positions = options.max_context;
        let rotary = c.rope.rotary_dim;
        let small = 2 * c.layers * size_class(c.hidden * 4)
            + size_class(c.hidden * 4)
            + 2 * size_class(rope_positions * rotary / 2 * 4);
        let activations: usize =
            activation_sizes(c, options).iter().map(|(_, bytes)| size_class((*bytes).max(4))).sum();
        let shape = attention_shape(c, options.page_tokens);
        let splits = 64; // the most `decode_splits` gives
        let attn_scratch = scratch_bytes(&shape, options.max_batch, splits).max(4);
        let expand = expand_scratch_bytes(model);
        let scratch = size_class(attn_scratch)
            + if expand > 0 { size_class(expand) } else { 0 }
            + size_class(sample_op::scratch_bytes(options.max_batch, c.vocab))
            + size_class(int8_scratch_bytes(model));
        let kv_pages =
            options.kv_pages.unwrap_or(options.max_batch * options.max_context.div_ceil(options.page_tokens));
        let (page_bytes, scale_bytes) = kv_page_bytes(c, options);
        let kv_block = size_class(kv_pages * page_bytes)
            + if scale_bytes > 0 { size_class(kv_pages * scale_bytes) } else { 0 };
        let kv_bytes = (2 * c.layers * kv_block) as u64;
        let total = weight_bytes + (small + activations + scratch) as u64 + kv_bytes;
        Ok(GpuPlan {
            weight_bytes,
            small_bytes: small as u64,
            activation_bytes: activations as u64,
            scratch_bytes: scratch as u64,
            kv_pages: kv_pages as u64,
            kv_bytes,
            total_bytes: total,
            cublas_workspace_bytes: 32 << 20,
        })
    }
}

fn validate_options(c: &ModelConfig, o: &GpuOptions) -> Result<()> {
    let bad = |name: &'static str, value: usize, reason: &str| Error::InvalidArgument {
        name,
        value: value.to_string(),
        reason: reason.to_string(),
    };
    if o.max_batch == 0 || o.max_batch > sample_op::MAX_SAMPLE_ROWS {
        return Err(bad("max_batch", o.max_batch, "between 1 and 256 (the sampler's rows)"));
    }
    if o.max_step_tokens < o.max_batch {
        return Err(bad("max_step_tokens", o.max_step_tokens, "at least max_batch (one token a sequence)"));
    }
    if o.kv_fill.is_some_and(|f| !(f > 0.0 && f <= 1.0)) {
        return Err(Error::InvalidArgument {
            name: "kv_fill",
            value: format!("{:?}", o.kv_fill),
            reason: "a share of the free memory in (0, 1]".into(),
        });
    }
    if o.matvec_tokens == 0 || o.matvec_tokens > MATVEC_TOKENS {
        return Err(bad("matvec_tokens", o.matvec_tokens, "between 1 and 8"));
    }
    if o.max_step_tokens > 65_535 {
        return Err(bad("max_step_tokens", o.max_step_tokens, "at most 65535"));
    }
    if !o.page_tokens.is_power_of_two() || o.page_tokens > 1024 {
        return Err(bad("page_tokens", o.page_tokens, "a power of two up to 1024"));
    }
    if o.max_context == 0 || o.max_context > c.context_length.max(1) {
        return Err(bad(
            "max_context",
            o.max_context,
            &format!("between 1 and the model's context, {}", c.context_length),
        ));
    }
    if !attention::HEAD_DIMS.contains(&c.head_dim) {
        return Err(Error::NotServed {
            op: "CUDA attention",
            reason: format!("head size {} (served: {:?})", c.head_dim, attention::HEAD_DIMS),
        });
    }
    Ok(())
}

fn attention_shape(c: &ModelConfig, page_tokens: usize) -> AttentionShape {
    AttentionShape {
        q_heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        page_tokens,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
    }
}

/// Load figures of a model's weights.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LoadReport {
    pub weight_bytes: u64,
    pub seconds: f64,
}

impl LoadReport {
    pub fn gigabytes_per_second(&self) -> f64 {
        self.weight_bytes as f64 / self.seconds.max(1e-9) / 1e9
    }
}

/// The activation blocks (see [`activation_sizes`]).
#[derive(Debug)]
struct Workspace {
    x: DeviceMemory,
    h: DeviceMemory,
    h16: DeviceMemory,
    qkv: DeviceMemory,
    q16: DeviceMemory,
    attn16: DeviceMemory,
    attn_f16: DeviceMemory,
    mlp: DeviceMemory,
    mlp16: DeviceMemory,
    last: DeviceMemory,
    last_normed: DeviceMemory,
    last16: DeviceMemory,
    logits: DeviceMemory,
    meta: DeviceMemory,
    params: DeviceMemory,
    steps: DeviceMemory,
    history_offsets: DeviceMemory,
    history: DeviceMemory,
    tokens: DeviceMemory,
    attn_scratch: DeviceMemory,
    expand: Option<DeviceMemory>,
    sample_scratch: sample_op::SampleScratch,
    /// x as int8 planes for the integer-path products.
    int8: DeviceMemory,
    /// FP8 pages: the new K rows then the new V rows, bf16 `[token][kv_head][head_dim]` each.
    kv_new: DeviceMemory,
    /// FP8 pages: 0, 1, .., max_step_tokens - 1 (u32), the rows of `kv_new`.
    kv_rows: DeviceMemory,
}

/// A sequence the engine serves: its pages, sampling parameters and sample counter.
#[derive(Debug)]
pub struct GpuSequence {
    table: PageTable,
    pub params: SamplingParams,
    /// The step of the next sample (the sampler's counter; the caller advances it, so that
    /// prompt chunks before the first sample do not count).
    pub step: u64,
    /// Tokens seen (prompt and generated), for the penalties.
    pub history: Vec<u32>,
}

impl GpuSequence {
    /// Positions held in the cache.
    pub fn len(&self) -> usize {
        self.table.len()
    }
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

/// The model on one GPU with its KV pages, workspace and captured decode steps.
pub struct GpuEngine {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    options: GpuOptions,
    plan: GpuPlan,
    _arena: DeviceMemory,
    embed: DeviceLinear,
    output: DeviceLinear,
    output_norm: DeviceMemory,
    layers: Vec<DeviceLayer>,
    rope_cos: DeviceMemory,
    rope_sin: DeviceMemory,
    kv: Vec<(DeviceMemory, DeviceMemory)>,
    /// With FP8 pages, each layer's K and V row scales (empty for bf16 pages).
    kv_scales: Vec<(DeviceMemory, DeviceMemory)>,
    pool: PagePool,
    ws: Workspace,
    blas: Option<Blas>,
    /// Captured decode steps by [`StepKey`] (a graph holds the launches of one sampler path and
    /// one decode attention configuration: a batch whose parameters pick another path, or whose
    /// longest context crosses into the other attention class, is captured again).
    graphs: HashMap<StepKey, CudaGraph>,
    /// The step keys whose kernels a plain step has compiled.
    warmed: HashSet<StepKey>,
    load: LoadReport,
    launches_per_step: HashMap<usize, usize>,
    /// Certified kernel configurations; without a store every kernel runs its declared default.
    tuning: Option<TuningStore>,
    /// The sampling parameters last copied to the device (copied again only when they change).
    uploaded_params: Vec<u8>,
}

impl std::fmt::Debug for GpuEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuEngine").field("config", &self.config).field("plan", &self.plan).finish()
    }
}

/// Copies host bytes into the arena and hands out views.
struct ArenaWriter<'a> {
    arena: &'a DeviceMemory,
    offset: usize,
}

impl ArenaWriter<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<DeviceView> {
        let view = self.arena.slice(self.offset, bytes.len())?;
        self.arena.copy_from_host(self.offset, bytes)?;
        self.offset += align(bytes.len());
        Ok(view)
    }

    fn put_f32(&mut self, values: &[f32]) -> Result<DeviceView> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.put(&bytes)
    }

    /// A group's matrices: back to back when one launch can serve them (same format and width),
    /// else each aligned on its own; their biases (fp32) back to back after them.
    fn put_group(&mut self, model: &LlamaModel, group: &[&Linear]) -> Result<Vec<DeviceLinear>> {
        let contiguous = fusable(group);
        let mut offset = self.offset;
        let mut out = Vec::with_capacity(group.len());
        for l in group {
            let bytes = model.bytes(l)?;
            let view = self.arena.slice(offset, bytes.len())?;
            self.arena.copy_from_host(offset, bytes)?;
            offset += if contiguous { bytes.len() } else { align(bytes.len()) };
            out.push(DeviceLinear { weight: view, bias: None, dtype: l.dtype, rows: l.rows, cols: l.cols });
        }
        self.offset = align(offset);
        if group.iter().any(|l| l.bias.is_some()) {
            let mut host = Vec::new();
            let mut spans = Vec::with_capacity(group.len());
            for l in group {
                spans.push(l.bias.as_ref().map(|b| (host.len(), b.len() * 4)));
                if let Some(b) = &l.bias {
                    host.extend(b.iter().flat_map(|v| v.to_le_bytes()));
                }
            }
            let view = self.put(&host)?;
            for (d, span) in out.iter_mut().zip(spans) {
                if let Some((at, len)) = span {
                    d.bias = Some(view.slice(at, len)?);
                }
            }
        }
        Ok(out)
    }
}

/// Whether one launch can serve a group: one format and one width.
fn fusable(group: &[&Linear]) -> bool {
    group.windows(2).all(|w| w[0].dtype == w[1].dtype && w[0].cols == w[1].cols)
}

/// One matrix over a group [`ArenaWriter::put_group`] placed back to back, with its biases
/// (all or none) back to back too; otherwise the parts as they are.
fn fuse(parts: Vec<DeviceLinear>) -> Vec<DeviceLinear> {
    let contiguous = parts.windows(2).all(|w| {
        w[0].dtype == w[1].dtype
            && w[0].cols == w[1].cols
            && w[0].weight.ptr + w[0].weight.len_bytes as u64 == w[1].weight.ptr
    });
    if parts.len() < 2 || !contiguous {
        return parts;
    }
    let with_bias = parts.iter().filter(|p| p.bias.is_some()).count();
    if with_bias != 0 && with_bias != parts.len() {
        return parts;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    let span = |a: DeviceView, b: DeviceView| DeviceView {
        ptr: a.ptr,
        len_bytes: (b.ptr - a.ptr) as usize + b.len_bytes,
    };
    let bias = match (first.bias, last.bias) {
        (Some(a), Some(b)) => Some(span(a, b)),
        _ => None,
    };
    vec![DeviceLinear {
        weight: span(first.weight, last.weight),
        bias,
        dtype: first.dtype,
        rows: parts.iter().map(|p| p.rows).sum(),
        cols: first.cols,
    }]
}

/// The sampler's path for a step's rows: [`SamplePath::for_rows`] of their parameters (one
/// launch for plain greedy or top-k rows instead of the default's four).
fn sample_path<'a>(rows: impl IntoIterator<Item = &'a SamplingParams>) -> SamplePath {
    SamplePath::for_rows(rows)
}

/// What a step's launches depend on beyond the device memory they read, and so the key of a
/// captured decode step: the batch size (the grids), the sampler path, and the decode attention
/// class of the batch's longest context (the certified variant and splits, baked into the graph).
/// Within a class a captured step replays as the cache grows (the attention grid does not depend
/// on the context); a batch crossing the class boundary has another key and is captured again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StepKey {
    batch: usize,
    path: SamplePath,
    class: certify::DecodeClass,
}

impl StepKey {
    /// The key of a step of `batch` sequences whose longest context (this step's tokens included)
    /// is `max_context`, the short attention class ending at `short_max`.
    fn new(batch: usize, path: SamplePath, max_context: usize, short_max: usize) -> StepKey {
        StepKey { batch, path, class: certify::DecodeClass::of(max_context, short_max) }
    }
}

fn device_f32(gpu: &Gpu, values: &[f32]) -> Result<DeviceMemory> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let memory = gpu.alloc(bytes.len().max(4))?;
    memory.copy_from_host(0, &bytes)?;
    Ok(memory)
}

impl GpuEngine {
    /// Uploads `model` to `gpu` and sizes the engine by `options`.
    pub fn new(gpu: Arc<Gpu>, model: &LlamaModel, options: GpuOptions) -> Result<GpuEngine> {
        let c = model.config().clone();
        let plan = GpuPlan::new(model, &options)?;
        if c.qkv_bias && c.qk_norm {
            return Err(Error::NotServed {
                op: "CUDA forward",
                reason: "q/k/v biases with q/k norms".into(),
            });
        }
        let started = Instant::now();
        let arena = gpu.alloc(arena_bytes(model)?)?;
        let mut w = ArenaWriter { arena: &arena, offset: 0 };
        let mut layers = Vec::with_capacity(c.layers);
        for layer in model.layers() {
            let (qkv, gate_up) = fused_groups(layer);
            let qkv = fuse(w.put_group(model, &qkv)?);
            let gate_up = fuse(w.put_group(model, &gate_up)?);
            let o = w.put_group(model, &[&layer.o])?[0];
            let down = w.put_group(model, &[&layer.down])?[0];
            let (q_norm, k_norm) = match (&layer.q_norm, &layer.k_norm) {
                (Some(q), Some(k)) => (Some(w.put_f32(q)?), Some(w.put_f32(k)?)),
                _ => (None, None),
            };
            layers.push(DeviceLayer {
                attn_norm: device_f32(&gpu, &layer.attn_norm)?,
                ffn_norm: device_f32(&gpu, &layer.ffn_norm)?,
                qkv,
                q_norm,
                k_norm,
                o,
                gate_up,
                down,
            });
        }
        let embed = w.put_group(model, &[model.embedding()])?[0];
        let output = if model.output().name == model.embedding().name {
            embed
        } else {
            w.put_group(model, &[model.output()])?[0]
        };
        let output_norm = device_f32(&gpu, model.output_norm())?;
        gpu.synchronize()?;
        let load = LoadReport { weight_bytes: w.offset as u64, seconds: started.elapsed().as_secs_f64() };

        let table = RopeTable::new(c.rope, c.head_dim, options.max_context)?;
        let rope_cos = device_f32(&gpu, &table.cos)?;
        let rope_sin = device_f32(&gpu, &table.sin)?;

        let sizes = activation_sizes(&c, &options);
        let mut blocks: Vec<DeviceMemory> = Vec::with_capacity(sizes.len());
        for (_, bytes) in &sizes {
            blocks.push(gpu.alloc((*bytes).max(4))?);
        }
        let mut it = blocks.into_iter();
        let mut next =
            || it.next().ok_or_else(|| Error::NotServed { op: "workspace", reason: "sizes".into() });
        let shape = attention_shape(&c, options.page_tokens);
        let expand = expand_scratch_bytes(model);
        let ws = Workspace {
            x: next()?,
            h: next()?,
            h16: next()?,
            qkv: next()?,
            q16: next()?,
            attn16: next()?,
            attn_f16: next()?,
            mlp: next()?,
            mlp16: next()?,
            last: next()?,
            last_normed: next()?,
            last16: next()?,
            logits: next()?,
            meta: next()?,
            params: next()?,
            steps: next()?,
            history_offsets: next()?,
            tokens: next()?,
            kv_new: next()?,
            kv_rows: next()?,
            history: gpu.alloc(4)?,
            attn_scratch: gpu.alloc(scratch_bytes(&shape, options.max_batch, 64).max(4))?,
            expand: if expand > 0 { Some(gpu.alloc(expand)?) } else { None },
            sample_scratch: sample_op::SampleScratch::new(&gpu, options.max_batch, c.vocab)?,
            int8: gpu.alloc(int8_scratch_bytes(model))?,
        };
        ws.history_offsets.fill_bytes(0)?;
        if options.kv_format != KvFormat::Bf16 {
            let rows: Vec<u8> = (0..options.max_step_tokens as u32).flat_map(u32::to_le_bytes).collect();
            ws.kv_rows.copy_from_host(0, &rows)?;
        }

        // The KV pages: as planned, or what is left of the device's memory.
        let mut plan = plan;
        let (page_bytes, scale_bytes) = kv_page_bytes(&c, &options);
        if let Some(share) = options.kv_fill {
            let free = gpu.pool().device_free_bytes()? as f64;
            let reserve = plan.cublas_workspace_bytes as f64;
            let budget = ((free * f64::from(share) - reserve) / 1.125).max(0.0);
            let pages = (budget / (2 * c.layers * (page_bytes + scale_bytes)) as f64) as usize;
            let needed = options.max_context.div_ceil(options.page_tokens);
            if pages < needed {
                return Err(Error::OutOfMemory {
                    requested_bytes: (2 * c.layers * (page_bytes + scale_bytes) * needed) as u64,
                    live_bytes: gpu.pool().stats().live_bytes,
                    pooled_bytes: gpu.pool().stats().pooled_bytes,
                    driver_free_bytes: free as u64,
                });
            }
            plan.total_bytes -= plan.kv_bytes;
            plan.kv_pages = pages as u64;
            let scales = if scale_bytes > 0 { size_class(pages * scale_bytes) } else { 0 };
            plan.kv_bytes = (2 * c.layers * (size_class(pages * page_bytes) + scales)) as u64;
            plan.total_bytes += plan.kv_bytes;
        }
        let kv_pages = plan.kv_pages as usize;
        let layout = KvLayout::new(c.layers, c.kv_heads, c.head_dim, options.page_tokens, options.kv_format)?;
        let mut kv = Vec::with_capacity(c.layers);
        let mut kv_scales = Vec::with_capacity(if scale_bytes > 0 { c.layers } else { 0 });
        for _ in 0..c.layers {
            kv.push((gpu.alloc(kv_pages * page_bytes)?, gpu.alloc(kv_pages * page_bytes)?));
            if scale_bytes > 0 {
                kv_scales.push((gpu.alloc(kv_pages * scale_bytes)?, gpu.alloc(kv_pages * scale_bytes)?));
            }
        }
        let pool = PagePool::new(layout, kv_pages)?;
        let blas = if Blas::available() { Some(Blas::new(&gpu)?) } else { None };
        Ok(GpuEngine {
            gpu,
            config: c,
            options,
            plan,
            _arena: arena,
            embed,
            output,
            output_norm,
            layers,
            rope_cos,
            rope_sin,
            kv,
            kv_scales,
            pool,
            ws,
            blas,
            graphs: HashMap::new(),
            warmed: HashSet::new(),
            load,
            launches_per_step: HashMap::new(),
            uploaded_params: Vec::new(),
            tuning: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn plan(&self) -> &GpuPlan {
        &self.plan
    }
    pub fn options(&self) -> &GpuOptions {
        &self.options
    }
    pub fn load_report(&self) -> LoadReport {
        self.load
    }
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// Kernel launches of the last step of each batch size that was measured (graph capture
    /// counts them).
    pub fn launches_per_step(&self, batch: usize) -> Option<usize> {
        self.launches_per_step.get(&batch).copied()
    }
    /// Decode steps captured as CUDA graphs (one per batch size, sampler path and decode
    /// attention class).
    pub fn captured_graphs(&self) -> usize {
        self.graphs.len()
    }
    /// KV pages not in use.
    pub fn free_pages(&self) -> usize {
        self.pool.available_pages()
    }

    /// Runs every kernel with the configuration certified for its key in `store` (the store's
    /// mode decides what an uncertified key does: the declared default, or in strict mode
    /// `Error::KeyNotCertified` at the step that needs it). Captured graphs are dropped.
    pub fn use_tuning(&mut self, store: TuningStore) {
        self.tuning = Some(store);
        self.graphs.clear();
    }

    fn model_shapes(&self) -> certify::ModelShapes {
        let c = &self.config;
        certify::ModelShapes {
            name: c.name.clone(),
            hidden: c.hidden,
            vocab: c.vocab,
            q_heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            rms_eps: c.rms_eps,
            qk_norm: c.qk_norm,
            norm_weight: DType::F32,
            lm_head_weight: self.output.dtype,
        }
    }

    /// One matrix-vector call of `l` (`rows` outputs a token, `tokens` rows of x) on the default
    /// variant, with the integer path's scratch when the options allow that path
    /// ([`linear::linear_with_scratch`] takes the integer default only when given one). Returns
    /// the launches.
    #[allow(clippy::too_many_arguments)]
    fn matvec(
        &self,
        l: &DeviceLinear,
        rows: usize,
        tokens: usize,
        input: DType,
        epilogue: Epilogue,
        bias: Option<DeviceView>,
        x: DeviceView,
        out: DeviceView,
    ) -> Result<usize> {
        let call = LinearCall { weight: l.dtype, rows, cols: l.cols, tokens, input, epilogue };
        let scratch = self.options.integer_products.then(|| self.ws.int8.view());
        linear::linear_with_scratch(&self.gpu, &call, l.weight, bias, x, out, None, scratch)
    }

    /// The weight format of `group` when the norm before it should also write its output rounded
    /// for the integer path ([`GpuOptions::norm_rounds_x`]): one fused matrix whose default
    /// product for `t` tokens of fp32 x (`fp32_matvec`) is an integer-path one.
    fn rounds_ahead(
        &self,
        group: &[DeviceLinear],
        rows: usize,
        t: usize,
        epilogue: Epilogue,
        fp32_matvec: bool,
    ) -> Option<DType> {
        let o = &self.options;
        if !(fp32_matvec && o.integer_products && o.norm_rounds_x && group.len() == 1 && t <= MATVEC_TOKENS) {
            return None;
        }
        let l = &group[0];
        let call = LinearCall { weight: l.dtype, rows, cols: l.cols, tokens: t, input: DType::F32, epilogue };
        linear::LinearVariant::default_for(&call).int8.then_some(l.dtype)
    }

    /// The norm `call` before a product group; with `ahead` (the group's weight format, from
    /// [`GpuEngine::rounds_ahead`]) it also writes its output rounded for the integer path.
    fn norm_before(
        &self,
        call: &NormCall,
        buffers: NormBuffers<'_>,
        variant: Option<norm_op::NormVariant>,
        ahead: Option<DType>,
    ) -> Result<()> {
        match ahead {
            Some(weight) => {
                norm_op::norm_with_int8_planes(&self.gpu, call, buffers, variant, self.ws.int8.view(), weight)
            }
            None => norm_op::norm(&self.gpu, call, buffers, variant),
        }
    }

    /// The integer-path product of `l` on x the norm before it rounded into the scratch.
    fn matvec_rounded(
        &self,
        l: &DeviceLinear,
        rows: usize,
        tokens: usize,
        epilogue: Epilogue,
        out: DeviceView,
    ) -> Result<usize> {
        let call = LinearCall { weight: l.dtype, rows, cols: l.cols, tokens, input: DType::F32, epilogue };
        linear::linear_prequantized(&self.gpu, &call, l.weight, l.bias, self.ws.int8.view(), out, None)
    }

    /// The norm variant for `rows` rows into `out`: certified, or the declared default.
    fn norm_variant(&self, rows: usize, out: DType) -> Result<Option<norm_op::NormVariant>> {
        let Some(store) = &self.tuning else { return Ok(None) };
        let task = certify::NormTask {
            call: certify::engine_norm_call(&self.model_shapes(), rows, out),
            residual: false,
        };
        certify::norm_variant(store, &task, self.gpu.arch()).map(Some)
    }

    /// The attention variant and splits a decode step of `batch` sequences whose longest context
    /// is `max_context` positions runs: its class's certified configuration, or the declared
    /// default (a variant of `None`: the launcher's default).
    pub fn decode_attention_config(
        &self,
        batch: usize,
        max_context: usize,
    ) -> Result<(Option<attention::AttentionVariant>, u32)> {
        let shape = attention_shape(&self.config, self.options.page_tokens);
        let class = certify::DecodeClass::of(max_context, self.options.decode_short_max);
        self.attention_config(&shape, batch, 1, class)
    }

    /// The attention variant and splits of a call with `max_query` tokens a sequence over `b`
    /// sequences (`class`: a decode call's context class, the one of its step's key):
    /// certified, or the declared default.
    fn attention_config(
        &self,
        shape: &AttentionShape,
        b: usize,
        max_query: usize,
        class: certify::DecodeClass,
    ) -> Result<(Option<attention::AttentionVariant>, u32)> {
        let default_splits =
            if max_query == 1 { decode_splits(&self.gpu, b, self.config.kv_heads) } else { 1 };
        let Some(store) = &self.tuning else { return Ok((None, default_splits)) };
        let task = if max_query == 1 {
            certify::AttentionTask::decode(*shape, b, class)
        } else {
            certify::AttentionTask {
                shape: *shape,
                phase: certify::AttentionPhase::Prefill { tokens: max_query },
            }
        };
        let config =
            certify::attention_config(store, &task, self.gpu.arch(), self.gpu.facts().multiprocessors)?;
        Ok((Some(config.variant), config.splits))
    }

    /// The attention variant for the pages' format: with FP8 pages, a chosen (or default)
    /// variant that reads bf16 pages only gives way to the tiled kernel's (decode: the wide
    /// variant at the same splits; prefill: the tiled prefill).
    fn kv_variant(
        &self,
        chosen: Option<attention::AttentionVariant>,
        max_query: usize,
    ) -> Option<attention::AttentionVariant> {
        if self.options.kv_format == KvFormat::Bf16 {
            return chosen;
        }
        let variant = chosen.unwrap_or_else(|| attention::AttentionVariant::default_for(max_query));
        if attention::serves_fp8_kv(variant) {
            Some(variant)
        } else if max_query == 1 {
            Some(attention::AttentionVariant::DECODE_WIDE)
        } else {
            Some(attention::AttentionVariant::PREFILL)
        }
    }

    /// A new, empty sequence.
    pub fn new_sequence(&self, params: SamplingParams) -> Result<GpuSequence> {
        params.validate()?;
        Ok(GpuSequence { table: self.pool.new_table(), params, step: 0, history: Vec::new() })
    }

    /// Gives a sequence's pages back.
    pub fn release(&mut self, sequence: GpuSequence) {
        self.pool.release(sequence.table);
    }

    /// Runs each sequence's new tokens and samples one token for each at the sequence's `step`;
    /// returns the tokens. The new tokens join the sequences' caches and histories. On an error
    /// the caches are as before the step.
    pub fn step(&mut self, work: &mut [(&mut GpuSequence, &[u32])]) -> Result<Vec<u32>> {
        self.run_step(work)
    }

    /// As [`GpuEngine::step`], and also returns each sequence's logits of its last token.
    pub fn step_with_logits(
        &mut self,
        work: &mut [(&mut GpuSequence, &[u32])],
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        let tokens = self.run_step(work)?;
        let vocab = self.config.vocab;
        // Only the rows of this step's sequences.
        let mut bytes = vec![0u8; work.len() * vocab * 4];
        self.ws.logits.copy_to_host(0, &mut bytes)?;
        let logits = bytes
            .chunks_exact(vocab * 4)
            .map(|row| row.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            .collect();
        Ok((tokens, logits))
    }

    fn run_step(&mut self, work: &mut [(&mut GpuSequence, &[u32])]) -> Result<Vec<u32>> {
        let b = work.len();
        let t: usize = work.iter().map(|(_, tokens)| tokens.len()).sum();
        let o = self.options;
        if b == 0 || b > o.max_batch {
            return Err(Error::InvalidArgument {
                name: "sequences",
                value: b.to_string(),
                reason: format!("a step serves 1 to {} sequences (the engine's max_batch)", o.max_batch),
            });
        }
        if work.iter().any(|(_, tokens)| tokens.is_empty()) || t > o.max_step_tokens {
            return Err(Error::InvalidArgument {
                name: "step tokens",
                value: t.to_string(),
                reason: format!(
                    "every sequence needs at least one new token, {} in all at most",
                    o.max_step_tokens
                ),
            });
        }
        let vocab = self.config.vocab;
        for (seq, tokens) in work.iter() {
            if seq.len() + tokens.len() > o.max_context {
                return Err(Error::InvalidArgument {
                    name: "positions",
                    value: (seq.len() + tokens.len()).to_string(),
                    reason: format!("the engine holds at most {} positions a sequence", o.max_context),
                });
            }
            if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
                return Err(Error::OutOfBounds {
                    op: "embedding",
                    what: "token id",
                    value: id.into(),
                    limit: vocab as u64,
                });
            }
        }
        // Pages for the new positions: all or nothing over the batch.
        let mut plans = Vec::with_capacity(b);
        for (seq, tokens) in work.iter_mut() {
            match self.pool.append(&mut seq.table, tokens) {
                Ok(plan) if plan.copies.is_empty() => plans.push(plan),
                Ok(_) => {
                    return Err(Error::NotServed {
                        op: "CUDA forward",
                        reason: "copy-on-write of shared pages".into(),
                    })
                }
                Err(e) => {
                    self.undo_appends(work, plans.len());
                    return Err(e);
                }
            }
        }
        let result = self.run_planned(work, &plans, t);
        if result.is_err() {
            self.undo_appends(work, plans.len());
        }
        result
    }

    /// Forgets the positions this step appended to the first `count` sequences of `work`.
    fn undo_appends(&mut self, work: &mut [(&mut GpuSequence, &[u32])], count: usize) {
        for (seq, tokens) in work.iter_mut().take(count) {
            let len = seq.table.len() - tokens.len();
            self.pool.truncate(&mut seq.table, len);
        }
    }

    fn run_planned(
        &mut self,
        work: &mut [(&mut GpuSequence, &[u32])],
        plans: &[crate::kv::AppendPlan],
        t: usize,
    ) -> Result<Vec<u32>> {
        let b = work.len();
        let o = self.options;
        let m = MetaLayout::of(&o);
        let mut meta = vec![0u32; m.words];
        let mut row = 0usize;
        let mut max_query = 0;
        let mut max_context = 0;
        for (i, ((seq, tokens), plan)) in work.iter().zip(plans).enumerate() {
            for (j, &id) in tokens.iter().enumerate() {
                meta[m.ids + row + j] = id;
                meta[m.positions + row + j] = (plan.first_position + j) as u32;
                meta[m.slots + row + j] = plan.slots[j];
            }
            meta[m.query_offsets + i] = row as u32;
            row += tokens.len();
            meta[m.last_rows + i] = (row - 1) as u32;
            meta[m.context_lens + i] = seq.table.len() as u32;
            meta[m.page_offsets + i] = (i * m.pages_per_seq) as u32;
            for (k, &page) in seq.table.pages().iter().enumerate() {
                meta[m.page_ids + i * m.pages_per_seq + k] = page;
            }
            max_query = max_query.max(tokens.len());
            max_context = max_context.max(seq.table.len());
        }
        meta[m.query_offsets + b] = row as u32;
        meta[m.page_offsets + b] = (b * m.pages_per_seq) as u32;
        let meta_bytes: Vec<u8> = meta.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.ws.meta.copy_from_host(0, &meta_bytes)?;
        let mut params = Vec::with_capacity(b * PARAMS_BYTES);
        let mut steps = Vec::with_capacity(b * 8);
        for (seq, _) in work.iter() {
            params.extend_from_slice(&DeviceSamplingParams::new(&seq.params, 0)?.to_bytes());
            steps.extend_from_slice(&seq.step.to_le_bytes());
        }
        if params != self.uploaded_params {
            self.uploaded_params.clear();
            self.ws.params.copy_from_host(0, &params)?;
            self.uploaded_params = params;
        }
        self.ws.steps.copy_from_host(0, &steps)?;

        let penalties = work.iter().any(|(seq, _)| {
            seq.params.repetition_penalty != 1.0
                || seq.params.presence_penalty != 0.0
                || seq.params.frequency_penalty != 0.0
        });
        let histories: Vec<Vec<u32>> = work
            .iter()
            .map(|(seq, tokens)| seq.history.iter().chain(tokens.iter()).copied().collect())
            .collect();
        let decode = max_query == 1;
        let graph_ok = o.graphs && decode && !penalties;
        // The sampler's path for these rows' parameters (known here, so the step runs one launch
        // where the rows allow); part of a captured graph's key.
        let path = sample_path(work.iter().map(|(seq, _)| &seq.params));
        let key = StepKey::new(b, path, max_context, o.decode_short_max);
        if graph_ok {
            if let Some(graph) = self.graphs.get(&key) {
                graph.launch().map_err(|e| kiln_cuda::runtime::driver_error("cuGraphLaunch", e))?;
            } else {
                // The first step of this size runs plainly (it compiles every kernel), the next
                // one is captured.
                let warmed = self.warmed.contains(&key);
                if warmed {
                    let stream = self.gpu.stream().clone();
                    stream
                        .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .map_err(|e| kiln_cuda::runtime::driver_error("cuStreamBeginCapture", e))?;
                    let launched = self.launch_step(b, t, max_query, None, key);
                    let graph = stream
                        .end_capture(cu::CUgraphInstantiate_flags(0))
                        .map_err(|e| kiln_cuda::runtime::driver_error("cuStreamEndCapture", e))?;
                    launched?;
                    let graph = graph.ok_or_else(|| Error::NotServed {
                        op: "CUDA graph",
                        reason: "the capture recorded no work".into(),
                    })?;
                    graph.launch().map_err(|e| kiln_cuda::runtime::driver_error("cuGraphLaunch", e))?;
                    self.graphs.insert(key, graph);
                } else {
                    let launches = self.launch_step(b, t, max_query, None, key)?;
                    self.launches_per_step.insert(b, launches);
                    self.warmed.insert(key);
                }
            }
        } else {
            let history = if penalties { Some(histories.as_slice()) } else { None };
            let launches = self.launch_step(b, t, max_query, history, key)?;
            if decode {
                self.launches_per_step.insert(b, launches);
                self.warmed.insert(key);
            }
        }
        let mut token_bytes = vec![0u8; b * 4];
        self.ws.tokens.copy_to_host(0, &mut token_bytes)?;
        let tokens: Vec<u32> =
            token_bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        for (i, (seq, new)) in work.iter_mut().enumerate() {
            seq.history.extend_from_slice(new);
            self.pool.commit(&mut seq.table);
            if tokens[i] as usize >= self.config.vocab {
                return Err(Error::NotServed {
                    op: "sampler",
                    reason: format!("row {i} gave no token (its logits are all NaN)"),
                });
            }
        }
        Ok(tokens)
    }

    /// Queues the whole step on the stream; returns the number of kernel launches. The sampler
    /// path and the decode attention class are `key`'s, so a captured step runs what its key says.
    fn launch_step(
        &self,
        b: usize,
        t: usize,
        max_query: usize,
        histories: Option<&[Vec<u32>]>,
        key: StepKey,
    ) -> Result<usize> {
        let path = key.path;
        let c = &self.config;
        let o = &self.options;
        let gpu = &*self.gpu;
        let ws = &self.ws;
        let mut launches = 0usize;
        let m = MetaLayout::of(o);
        let meta = ws.meta.view();
        let word = |at: usize, count: usize| meta.slice(at * 4, count * 4);
        let ids = word(m.ids, t)?;
        let positions = word(m.positions, t)?;
        let slots = word(m.slots, t)?;
        let last_rows = word(m.last_rows, b)?;
        let batch = PagedBatch::from_views(
            word(m.query_offsets, b + 1)?,
            word(m.context_lens, b)?,
            word(m.page_offsets, b + 1)?,
            word(m.page_ids, o.max_batch * m.pages_per_seq)?,
            b,
            t,
            max_query,
        )?;
        let shape = attention_shape(c, o.page_tokens);
        let (attention_variant, splits) = self.attention_config(&shape, b, max_query, key.class)?;
        let attention_variant = self.kv_variant(attention_variant, max_query);
        let norm_t = self.norm_variant(t, if t <= o.matvec_tokens { DType::F32 } else { DType::BF16 })?;
        let matvec = t <= o.matvec_tokens || self.blas.is_none();

        linear::embed_rows(gpu, self.embed.dtype, self.embed.weight, c.vocab, c.hidden, ids, t, ws.x.view())?;
        launches += 1;
        let norm_call = |rows: usize, out: DType| NormCall {
            spec: RmsNorm::llama(c.rms_eps, out).into(),
            rows,
            hidden: c.hidden,
            x_type: DType::F32,
            weight_type: DType::F32,
        };
        let q_width = c.heads * c.head_dim;
        let qkv_width = (c.heads + 2 * c.kv_heads) * c.head_dim;
        for (index, layer) in self.layers.iter().enumerate() {
            // Attention.
            let half = if matvec { DType::F32 } else { self.gemm_type(&layer.qkv) };
            let h = if matvec { &ws.h } else { &ws.h16 };
            let variant = if half == DType::F16 { None } else { norm_t };
            let buffers = self.norm_buffers(&ws.x, &layer.attn_norm, h);
            let ahead =
                self.rounds_ahead(&layer.qkv, qkv_width, t, Epilogue::Store, matvec && half == DType::F32);
            self.norm_before(&norm_call(t, half), buffers, variant, ahead)?;
            launches += 1;
            if ahead.is_some() {
                launches +=
                    self.matvec_rounded(&layer.qkv[0], qkv_width, t, Epilogue::Store, ws.qkv.view())?;
            } else {
                launches +=
                    self.linear_group(&layer.qkv, h.view(), half, t, ws.qkv.view(), Epilogue::Store, matvec)?;
            }
            let (k_cache, v_cache) = &self.kv[index];
            let fp8 = self.kv_scales.get(index).map(|(k, v)| KvScales { k, v });
            // With FP8 pages the new K and V rows go to `kv_new` in bf16 first (as a cache of
            // one-position pages, at rows 0..t), then are quantized into their slots.
            let kv_rows = t * c.kv_heads * c.head_dim * 2;
            let kv_half = o.max_step_tokens * c.kv_heads * c.head_dim * 2;
            let (new_pages, new_tokens, new_slots, k_into, v_into) = match fp8 {
                Some(_) => (
                    o.max_step_tokens,
                    1,
                    ws.kv_rows.slice(0, t * 4)?,
                    ws.kv_new.slice(0, kv_half)?,
                    ws.kv_new.slice(kv_half, kv_half)?,
                ),
                None => (self.plan.kv_pages as usize, o.page_tokens, slots, k_cache.view(), v_cache.view()),
            };
            forward::qkv_prepare(
                gpu,
                &QkvShape {
                    tokens: t,
                    heads: c.heads,
                    kv_heads: c.kv_heads,
                    head_dim: c.head_dim,
                    rotary_dim: c.rope.rotary_dim,
                    interleaved: c.rope.layout == RopeLayout::Interleaved,
                    table_positions: o.max_context,
                    page_tokens: new_tokens,
                    cache_pages: new_pages,
                    eps: c.rms_eps,
                },
                QkvBuffers {
                    qkv: ws.qkv.slice(0, t * qkv_width * 4)?,
                    q_norm: layer.q_norm,
                    k_norm: layer.k_norm,
                    cos: self.rope_cos.view(),
                    sin: self.rope_sin.view(),
                    positions,
                    slots: new_slots,
                    q_out: ws.q16.view(),
                    k_cache: k_into,
                    v_cache: v_into,
                },
            )?;
            launches += 1;
            let cache = KvBuffers { k: k_cache, v: v_cache, pages: self.plan.kv_pages as usize, scales: fp8 };
            if fp8.is_some() {
                attention::kv_append_fp8(
                    gpu,
                    &shape,
                    k_into.slice(0, kv_rows)?,
                    v_into.slice(0, kv_rows)?,
                    slots,
                    t,
                    cache,
                )?;
                launches += 1;
            }
            attention::attention(
                gpu,
                &shape,
                &batch,
                &ws.q16,
                cache,
                &ws.attn16,
                Some(&ws.attn_scratch),
                splits,
                attention_variant,
            )?;
            launches += if splits > 1 { 2 } else { 1 };
            let o_half = if matvec { DType::BF16 } else { self.gemm_type(std::slice::from_ref(&layer.o)) };
            let attn_in = if o_half == DType::F16 {
                forward::bf16_to_f16(gpu, ws.attn16.view(), t * q_width, ws.attn_f16.view())?;
                launches += 1;
                ws.attn_f16.view()
            } else {
                ws.attn16.view()
            };
            launches += self.linear_group(
                std::slice::from_ref(&layer.o),
                attn_in,
                o_half,
                t,
                ws.x.view(),
                Epilogue::Accumulate,
                matvec,
            )?;
            // MLP.
            let half = if matvec { DType::F32 } else { self.gemm_type(&layer.gate_up) };
            let variant = if half == DType::F16 { None } else { norm_t };
            let buffers = self.norm_buffers(&ws.x, &layer.ffn_norm, h);
            let ahead =
                self.rounds_ahead(&layer.gate_up, c.ffn, t, Epilogue::SwiGlu, matvec && half == DType::F32);
            self.norm_before(&norm_call(t, half), buffers, variant, ahead)?;
            launches += 1;
            launches += self.mlp(layer, h.view(), half, t, matvec, ahead.is_some())?;
        }
        // The last token of each sequence: final norm, LM head, sampler. More rows than the
        // matrix-vector kernels take at once go through cuBLAS when the head is 16-bit.
        // A pure decode step's last rows are all its rows: no gather.
        let last = if t == b {
            &ws.x
        } else {
            forward::gather_rows(gpu, ws.x.view(), t, last_rows, b, c.hidden, ws.last.view())?;
            launches += 1;
            &ws.last
        };
        let head_gemm = b > o.matvec_tokens
            && matches!(self.output.dtype, DType::BF16 | DType::F16)
            && self.blas.is_some();
        if let (true, Some(blas)) = (head_gemm, self.blas.as_ref()) {
            let half = self.output.dtype;
            norm_op::norm(
                gpu,
                &norm_call(b, half),
                self.norm_buffers(last, &self.output_norm, &ws.last16),
                None,
            )?;
            blas.gemm(
                half,
                self.output.weight,
                ws.last16.slice(0, b * c.hidden * 2)?,
                ws.logits.slice(0, b * c.vocab * 4)?,
                c.vocab,
                b,
                c.hidden,
                false,
            )?;
            launches += 2;
        } else {
            norm_op::norm(
                gpu,
                &norm_call(b, DType::F32),
                self.norm_buffers(last, &self.output_norm, &ws.last_normed),
                self.norm_variant(b, DType::F32)?,
            )?;
            launches += 1;
            for start in (0..b).step_by(MATVEC_TOKENS) {
                let rows = (b - start).min(MATVEC_TOKENS);
                launches += self.matvec(
                    &self.output,
                    c.vocab,
                    rows,
                    DType::F32,
                    Epilogue::Store,
                    None,
                    ws.last_normed.slice(start * c.hidden * 4, rows * c.hidden * 4)?,
                    ws.logits.slice(start * c.vocab * 4, rows * c.vocab * 4)?,
                )?;
            }
        }
        // Penalties need the histories and a zeroed count block (allocated here: such steps are
        // never captured).
        let (offsets, history, counts, scratch);
        let mut penalty = None;
        if let Some(histories) = histories {
            let refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
            let (off, tokens) = sample_op::encode_histories(&refs, c.vocab)?;
            offsets = gpu.alloc(off.len() * 4)?;
            offsets.copy_from_host(0, &off.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>())?;
            history = gpu.alloc((tokens.len() * 4).max(4))?;
            history.copy_from_host(0, &tokens.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>())?;
            counts = gpu.alloc(b * c.vocab * 4)?;
            counts.fill_bytes(0)?;
            scratch = gpu.alloc(b * c.vocab * 4)?;
            penalty = Some(sample_op::PenaltyScratch { counts: &counts, scratch: &scratch });
            sample_op::sample_with_path(
                gpu,
                b,
                c.vocab,
                SampleBuffers {
                    logits: &ws.logits,
                    row_stride: c.vocab,
                    params: &ws.params,
                    steps: &ws.steps,
                    history_offsets: &offsets,
                    history: &history,
                    penalty,
                    stats: None,
                    tokens: &ws.tokens,
                    scratch: Some(&ws.sample_scratch),
                },
                path,
            )?;
        } else {
            let _ = &mut penalty;
            sample_op::sample_with_path(
                gpu,
                b,
                c.vocab,
                SampleBuffers {
                    logits: &ws.logits,
                    row_stride: c.vocab,
                    params: &ws.params,
                    steps: &ws.steps,
                    history_offsets: &ws.history_offsets,
                    history: &ws.history,
                    penalty: None,
                    stats: None,
                    tokens: &ws.tokens,
                    scratch: Some(&ws.sample_scratch),
                },
                path,
            )?;
        }
        launches += 1;
        Ok(launches)
    }

    fn norm_buffers<'a>(
        &self,
        x: &'a DeviceMemory,
        weight: &'a DeviceMemory,
        out: &'a DeviceMemory,
    ) -> NormBuffers<'a> {
        NormBuffers { x, residual: None, weight: Some(weight), bias: None, gate: None, out, scales: None }
    }

    /// The 16-bit type the matrix-product path hands cuBLAS for `group`: fp16 for fp16 weights,
    /// bf16 otherwise (other formats are expanded to bf16).
    fn gemm_type(&self, group: &[DeviceLinear]) -> DType {
        if group.iter().all(|l| l.dtype == DType::F16) {
            DType::F16
        } else {
            DType::BF16
        }
    }

    /// `out (+)= x · W^T` for each matrix of `group`, outputs side by side (`out` rows hold every
    /// matrix's outputs in turn). Returns the launches.
    #[allow(clippy::too_many_arguments)]
    fn linear_group(
        &self,
        group: &[DeviceLinear],
        x: DeviceView,
        x_type: DType,
        t: usize,
        out: DeviceView,
        epilogue: Epilogue,
        matvec: bool,
    ) -> Result<usize> {
        let width: usize = group.iter().map(|l| l.rows).sum();
        let mut launches = 0;
        if matvec {
            if group.len() > 1 && (t > 1 || !matches!(epilogue, Epilogue::Store)) {
                // Unfused groups write into a scratch layout only for one token; the engine
                // fuses every group whose formats agree, so this is the rare mixed case.
                return self.linear_group_mixed(group, x, x_type, t, out, epilogue);
            }
            let mut column = 0;
            for l in group {
                for start in (0..t).step_by(MATVEC_TOKENS) {
                    let n = (t - start).min(MATVEC_TOKENS);
                    let x_bytes = bytes_of(x_type, l.cols)?;
                    launches += self.matvec(
                        l,
                        l.rows,
                        n,
                        x_type,
                        epilogue,
                        l.bias,
                        x.slice(start * x_bytes, n * x_bytes)?,
                        out.slice((start * width + column) * 4, (n * width - column) * 4)?,
                    )?;
                }
                column += l.rows;
            }
            return Ok(launches);
        }
        let blas = self.blas.as_ref().ok_or_else(|| Error::NotServed {
            op: "matrix product",
            reason: "cuBLAS is not loaded".into(),
        })?;
        if group.len() > 1 {
            return self.linear_group_mixed(group, x, x_type, t, out, epilogue);
        }
        let l = &group[0];
        let w = self.gemm_weight(l, x_type)?;
        launches += usize::from(w.1);
        let accumulate = matches!(epilogue, Epilogue::Accumulate);
        if l.bias.is_some() && accumulate {
            return Err(Error::NotServed { op: "matrix product", reason: "a bias with accumulation".into() });
        }
        blas.gemm(
            x_type,
            w.0,
            x.slice(0, t * l.cols * 2)?,
            out.slice(0, t * l.rows * 4)?,
            l.rows,
            t,
            l.cols,
            accumulate,
        )?;
        launches += 1;
        if let Some(bias) = l.bias {
            forward::add_bias(&self.gpu, out, bias, t, l.rows)?;
            launches += 1;
        }
        Ok(launches)
    }

    /// Matrices of one group in different formats: each into its own columns, one token row at
    /// a time (the output rows interleave the matrices).
    fn linear_group_mixed(
        &self,
        group: &[DeviceLinear],
        x: DeviceView,
        x_type: DType,
        t: usize,
        out: DeviceView,
        epilogue: Epilogue,
    ) -> Result<usize> {
        let width: usize = group.iter().map(|l| l.rows).sum();
        let x_bytes = bytes_of(x_type, group[0].cols)?;
        let mut launches = 0;
        for token in 0..t {
            let mut column = 0;
            for l in group {
                launches += self.matvec(
                    l,
                    l.rows,
                    1,
                    x_type,
                    epilogue,
                    l.bias,
                    x.slice(token * x_bytes, x_bytes)?,
                    out.slice((token * width + column) * 4, l.rows * 4)?,
                )?;
                column += l.rows;
            }
        }
        Ok(launches)
    }

    /// The weight as cuBLAS takes it: itself when already of `x_type`, else expanded to bf16 in
    /// the scratch (the bool says whether an expansion was launched).
    fn gemm_weight(&self, l: &DeviceLinear, x_type: DType) -> Result<(DeviceView, bool)> {
        if l.dtype == x_type {
            return Ok((l.weight, false));
        }
        let scratch = self.ws.expand.as_ref().ok_or_else(|| Error::NotServed {
            op: "matrix product",
            reason: format!("{} weights need an expansion scratch", l.dtype),
        })?;
        let view = scratch.slice(0, l.rows * l.cols * 2)?;
        linear::to_bf16_weights(&self.gpu, l.dtype, l.weight, l.rows, l.cols, view)?;
        Ok((view, true))
    }

    /// gate|up with SwiGLU, then the down projection added into the residual stream.
    /// The MLP from the normed `h`; `rounded`: the norm also wrote h rounded for the integer
    /// path into the scratch ([`GpuEngine::rounds_ahead`]).
    fn mlp(
        &self,
        layer: &DeviceLayer,
        h: DeviceView,
        half: DType,
        t: usize,
        matvec: bool,
        rounded: bool,
    ) -> Result<usize> {
        let c = &self.config;
        let ws = &self.ws;
        let mut launches = 0;
        let down_in_type;
        if matvec && layer.gate_up.len() == 1 {
            let l = &layer.gate_up[0];
            if rounded {
                launches +=
                    self.matvec_rounded(l, c.ffn, t, Epilogue::SwiGlu, ws.mlp.slice(0, t * c.ffn * 4)?)?;
            } else {
                for start in (0..t).step_by(MATVEC_TOKENS) {
                    let n = (t - start).min(MATVEC_TOKENS);
                    launches += self.matvec(
                        l,
                        c.ffn,
                        n,
                        half,
                        Epilogue::SwiGlu,
                        None,
                        h.slice(start * c.hidden * 4, n * c.hidden * 4)?,
                        ws.mlp.slice(start * c.ffn * 4, n * c.ffn * 4)?,
                    )?;
                }
            }
            down_in_type = DType::F32;
            launches += self.linear_group(
                std::slice::from_ref(&layer.down),
                ws.mlp.view(),
                down_in_type,
                t,
                ws.x.view(),
                Epilogue::Accumulate,
                true,
            )?;
            return Ok(launches);
        }
        // gate and up side by side into `mlp` ([t][2 ffn]), SwiGLU into the down product's type.
        launches += self.linear_group(&layer.gate_up, h, half, t, ws.mlp.view(), Epilogue::Store, matvec)?;
        down_in_type = if matvec { DType::F32 } else { self.gemm_type(std::slice::from_ref(&layer.down)) };
        let (down_in, out_type) = if matvec { (&ws.h, DType::F32) } else { (&ws.mlp16, down_in_type) };
        // In the matvec path the SwiGLU output (fp32) goes to `h`, free at this point, when it
        // is large enough; otherwise to mlp16 as bf16.
        let (down_in, out_type) = if matvec && down_in.len_bytes() < t * c.ffn * 4 {
            (&ws.mlp16, DType::BF16)
        } else {
            (down_in, out_type)
        };
        forward::swiglu(&self.gpu, ws.mlp.view(), t, c.ffn, down_in.view(), out_type)?;
        launches += 1;
        launches += self.linear_group(
            std::slice::from_ref(&layer.down),
            down_in.view(),
            out_type,
            t,
            ws.x.view(),
            Epilogue::Accumulate,
            matvec,
        )?;
        Ok(launches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny Llama folder (hidden 128, 2 heads of 64 over 1 KV head, ffn 256, vocabulary 100, 2
    /// layers) in a fresh directory under the system's temporary folder.
    fn tiny_llama(tag: &str, tied: bool) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-gpu-plan-{tag}-{}", std::process::id()));
        let spec = crate::models::test_models::TinySpec {
            hidden: 128,
            heads: 2,
            kv_heads: 1,
            head_dim: 64,
            ffn: 256,
            vocab: 100,
            layers: 2,
            tied,
            ..crate::models::test_models::TinySpec::llama()
        };
        crate::models::test_models::write_tiny_model(&dir, &spec, 1).unwrap()
    }

    /// A step's graph key changes with the sampler path its rows' parameters pick: a request of
    /// other parameters is captured again, one of the same path replays.
    #[test]
    fn the_graph_key_follows_the_rows_parameters() {
        let greedy = SamplingParams::greedy();
        let top_k = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, ..SamplingParams::default() };
        let plain = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
        assert_eq!(sample_path([&greedy]), SamplePath::Greedy);
        assert_eq!(sample_path([&top_k]), SamplePath::TopKHeads);
        assert_eq!(sample_path([&top_k, &top_k]), SamplePath::TopKBound);
        assert_eq!(sample_path([&greedy, &top_k]), SamplePath::Fused);
        assert_eq!(sample_path([&plain]), SamplePath::Lists);
        assert_eq!(sample_path([&plain, &top_k]), SamplePath::Auto);
        let keys: HashSet<(usize, SamplePath)> =
            [(1, sample_path([&greedy])), (1, sample_path([&top_k])), (1, sample_path([&greedy]))].into();
        assert_eq!(keys.len(), 2);
        // Another seed or top-k of the same path keeps the key (the parameters are read on the
        // device).
        let other = SamplingParams { top_k: 7, seed: 99, ..top_k };
        assert_eq!(sample_path([&other]), sample_path([&top_k]));
    }

    /// A captured step's key holds the decode attention class of the batch's longest context, so
    /// every context that replays a graph looks up the configuration it was captured with: the
    /// key changes once as a sequence grows over the boundary, and the two keys of a batch size
    /// name the two classes' certificates (different here).
    #[test]
    fn the_graph_key_holds_the_decode_attention_class() {
        use kiln_core::tuning::store::record_certificate;
        use kiln_core::tuning::{CandidateResult, Certificate, Generator, TuningMode};
        use std::collections::BTreeMap;

        let dir = std::env::temp_dir().join(format!("kiln-step-key-{}", std::process::id()));
        let (certs, index) = (dir.join("certificates"), dir.join("index"));
        let shape = AttentionShape { q_heads: 32, kv_heads: 8, head_dim: 128, page_tokens: 64, scale: 0.088 };
        let arch = kiln_cuda::Arch(90);
        for (class, winner) in
            [(certify::DecodeClass::Short, "stream3-1x8x16.s16"), (certify::DecodeClass::Long, "1x4x32.s16")]
        {
            let key = certify::AttentionTask::decode(shape, 1, class).key(arch).unwrap();
            let generator = Generator { kiln_version: "0.1.0".into(), source_sha256: "ab".repeat(32) };
            let candidates = vec![CandidateResult::ok(winner, 1.0, 1e-3)];
            let c = Certificate::new(key, candidates, generator, "NVIDIA H200", "CUDA 13.0", "2026-11-30")
                .unwrap();
            record_certificate(&certs, c).unwrap();
        }
        let store = TuningStore::open(std::slice::from_ref(&certs), &index, TuningMode::Strict).unwrap();
        let path = sample_path([&SamplingParams { temperature: 0.0, ..SamplingParams::default() }]);
        // As the engine looks a decode step's configuration up: by the key's class.
        let config = |key: StepKey| {
            let task = certify::AttentionTask::decode(shape, key.batch, key.class);
            certify::attention_config(&store, &task, arch, 132).unwrap().label()
        };
        for short_max in [48, certify::DECODE_SHORT_MAX] {
            let keys: Vec<StepKey> =
                (1..=3 * short_max).map(|c| StepKey::new(1, path, c, short_max)).collect();
            let changes: Vec<usize> = (1..keys.len()).filter(|&i| keys[i] != keys[i - 1]).collect();
            assert_eq!(changes, [short_max], "the key changes once, past the boundary");
            assert_eq!(keys[short_max - 1].class, certify::DecodeClass::Short);
            assert_eq!(keys[short_max].class, certify::DecodeClass::Long);
            let mut seen: BTreeMap<String, String> = BTreeMap::new();
            for (i, &key) in keys.iter().enumerate() {
                let chosen = config(key);
                let want = if i < short_max { "stream3-1x8x16.s16" } else { "1x4x32.s16" };
                assert_eq!(chosen, want, "context {} of {short_max}", i + 1);
                let previous = seen.insert(format!("{key:?}"), chosen.clone());
                assert!(previous.is_none_or(|p| p == chosen), "one key, two configurations");
            }
            assert_eq!(seen.len(), 2);
            // Another batch size or sampler path is another key in either class.
            assert_ne!(StepKey::new(2, path, 1, short_max), keys[0]);
            assert_ne!(StepKey::new(1, SamplePath::Fused, 1, short_max), keys[0]);
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_plan_adds_up_and_holds_every_tensor() {
        let dir = tiny_llama("plan", false);
        let model = crate::models::load_model(&dir).unwrap();
        let options =
            GpuOptions { max_batch: 4, max_context: 300, max_step_tokens: 64, ..GpuOptions::default() };
        let plan = GpuPlan::new(&model, &options).unwrap();
        // Every matrix (bf16) and the separate output fit in the arena, each at most one
        // alignment unit of padding away.
        let matrices = 2 * (128 * 128 + 64 * 128 * 2 + 128 * 128 + 3 * 256 * 128) + 2 * 100 * 128;
        let arena = arena_bytes(&model).unwrap();
        assert!(arena >= matrices * 2, "{arena} < {}", matrices * 2);
        assert!(arena <= matrices * 2 + 64 * ARENA_ALIGN, "{arena}");
        assert_eq!(plan.weight_bytes, size_class(arena) as u64);
        // Pages: every sequence of the batch can reach the context.
        assert_eq!(plan.kv_pages, 4 * 300u64.div_ceil(options.page_tokens as u64));
        assert_eq!(
            plan.total_bytes,
            plan.weight_bytes + plan.small_bytes + plan.activation_bytes + plan.scratch_bytes + plan.kv_bytes
        );
        // bf16 everywhere: no expansion scratch for the matrix products.
        assert_eq!(expand_scratch_bytes(&model), 0);
        // A tied head adds no second copy.
        let tied = crate::models::load_model(&tiny_llama("tied", true)).unwrap();
        assert_eq!(arena_bytes(&model).unwrap() - arena_bytes(&tied).unwrap(), align(100 * 128 * 2));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A weight format the CUDA kernels do not take is named with its tensor (a layer's matrix,
    /// the output head or the embedding table); every format of the linear kernels
    /// (`linear::WEIGHT_DTYPES`) passes in every tensor, Q4_K and Q6_K embedding tables (common in
    /// Q4_K_M files) among them.
    #[test]
    fn weights_the_kernels_do_not_take_are_named_with_their_tensor() {
        let tensor =
            |name: &str, dtype| Linear { name: name.into(), dtype, rows: 256, cols: 256, bias: None };
        let served: Vec<Linear> = ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]
            .iter()
            .flat_map(|name| linear::WEIGHT_DTYPES.map(|dtype| tensor(name, dtype)))
            .collect();
        assert!(first_unserved(&served).is_ok());
        for (bad, dtype) in [
            ("blk.0.ffn_down.weight", DType::Q8_K),
            ("blk.1.attn_v.weight", DType::F64),
            ("token_embd.weight", DType::F8_E4M3),
        ] {
            let weights = [tensor("blk.0.attn_q.weight", DType::Q4_0), tensor(bad, dtype)];
            let err = first_unserved(&weights).unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
            assert!(
                matches!(err.root(), Error::DTypeNotServed { dtype: d, .. } if *d == dtype.name()),
                "{err:?}"
            );
        }
    }

    #[test]
    fn options_outside_what_the_engine_serves_are_named() {
        let model = crate::models::load_model(&tiny_llama("options", true)).unwrap();
        let bad = |o: GpuOptions| match GpuPlan::new(&model, &o) {
            Err(Error::InvalidArgument { name, .. }) => name,
            other => panic!("expected a named argument error, got {other:?}"),
        };
        let ok = GpuOptions { max_context: 256, ..GpuOptions::default() };
        assert!(GpuPlan::new(&model, &ok).is_ok());
        assert_eq!(bad(GpuOptions { max_batch: 0, ..ok }), "max_batch");
        assert_eq!(bad(GpuOptions { max_batch: 257, max_step_tokens: 512, ..ok }), "max_batch");
        assert_eq!(bad(GpuOptions { max_step_tokens: 2, max_batch: 4, ..ok }), "max_step_tokens");
        assert_eq!(bad(GpuOptions { page_tokens: 48, ..ok }), "page_tokens");
        assert_eq!(bad(GpuOptions { max_context: 5000, ..ok }), "max_context");
        assert_eq!(bad(GpuOptions { matvec_tokens: 9, ..ok }), "matvec_tokens");
    }

    #[test]
    fn metadata_sections_follow_one_another_without_overlap() {
        for (t, b, p) in [(1, 1, 1), (512, 8, 64), (64, 64, 3)] {
            let m = MetaLayout::new(t, b, p);
            let sections = [
                (m.ids, t),
                (m.positions, t),
                (m.slots, t),
                (m.last_rows, b),
                (m.query_offsets, b + 1),
                (m.context_lens, b),
                (m.page_offsets, b + 1),
                (m.page_ids, b * p),
            ];
            let mut end = 0;
            for (start, len) in sections {
                assert_eq!(start, end, "{t} {b} {p}");
                end = start + len;
            }
            assert_eq!(end, m.words);
        }
    }

    fn part(ptr: u64, bytes: usize, bias: Option<(u64, usize)>, dtype: DType) -> DeviceLinear {
        DeviceLinear {
            weight: DeviceView { ptr, len_bytes: bytes },
            bias: bias.map(|(ptr, len_bytes)| DeviceView { ptr, len_bytes }),
            dtype,
            rows: bytes / 256,
            cols: 128,
        }
    }

    #[test]
    fn groups_fuse_only_when_back_to_back_in_one_format() {
        let a = part(0x1000, 512, None, DType::BF16);
        let b = part(0x1200, 256, None, DType::BF16);
        let fused = fuse(vec![a, b]);
        assert_eq!(fused.len(), 1);
        assert_eq!(fused[0].weight, DeviceView { ptr: 0x1000, len_bytes: 768 });
        assert_eq!(fused[0].rows, a.rows + b.rows);
        // A gap, another format, or a bias on one part only: left apart.
        assert_eq!(fuse(vec![a, part(0x1300, 256, None, DType::BF16)]).len(), 2);
        assert_eq!(fuse(vec![a, part(0x1200, 256, None, DType::F16)]).len(), 2);
        assert_eq!(fuse(vec![part(0x1000, 512, Some((0x9000, 8)), DType::BF16), b]).len(), 2);
        // Biases back to back fuse with their matrices.
        let with = fuse(vec![
            part(0x1000, 512, Some((0x9000, 8)), DType::BF16),
            part(0x1200, 256, Some((0x9008, 4)), DType::BF16),
        ]);
        assert_eq!(with[0].bias, Some(DeviceView { ptr: 0x9000, len_bytes: 12 }));
    }
}
