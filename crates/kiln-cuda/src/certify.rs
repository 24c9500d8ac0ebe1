//! The certifier: which configuration of the norm, LM head and attention kernels runs for a call,
//! measured on this device and proved against the oracle (DESIGN.md, "Tuning certificates").
//!
//! For each family this module declares:
//! - the **tuning key** of a call ([`Task::key`]): the shape class, the dtypes and the architecture,
//!   as a [`TuningKey`] (`norm/rms.res.hf.n4096.g1.rows1/bf16.bf16.bf16/sm_90`); a decode
//!   attention key names the batch class and the context class of the batch's longest sequence
//!   ([`DecodeClass`]: `attention/decode.q32.kv8.d128.p64.b1/bf16/sm_90` up to
//!   [`DECODE_SHORT_MAX`] positions, timed at [`DECODE_CONTEXT`]; `….b1.long/…` past them, timed
//!   at [`DECODE_LONG_CONTEXT`], or [`DECODE_LONG_CONTEXT_LARGE_BATCH`] past 8 sequences);
//! - the **candidates** ([`norm_candidates`], [`lm_head_candidates`], [`attention_candidates`]): the
//!   family's variant list, the declared default first, pruned by the device's facts (threads,
//!   shared memory, registers) before anything is compiled;
//! - the **lookup** ([`norm_variant`], [`lm_head_variant`], [`attention_config`]): the store's
//!   certified winner, parsed back into a variant (an unknown name is
//!   [`Error::UnknownTuningConfig`]), or the declared default outside strict mode.
//!
//! [`certify`] measures one key: it compiles and runs every candidate on fresh random inputs with
//! the outputs poisoned, compares each with the oracle, times each with CUDA events (a warm-up,
//! then the median of batches of launches that rotate over input sets larger than twice the L2
//! cache; the norms' batches and the decode attention's launches captured once into a CUDA graph
//! and replayed
//! ([`median_graph_launch_us`]), as the engine replays its decode step, so that a norm of a few
//! microseconds is chosen by its time on the GPU rather than by the host's cost of launching it),
//! and returns a [`Certificate`] whose winner is the fastest correct candidate. The error
//! recorded for a candidate is, for the bit-exact families (norms, LM head), the number of output
//! bytes (norm) or logits (LM head) whose bits differ from the CPU reference, 0 for a correct run;
//! for attention, the largest absolute difference from the float64 reference (correct within the
//! bf16 tolerance: relative L2 error below 1e-2 and every element within 0.05). Attention is
//! checked on a smaller instance of the same key (same heads, page size, variant and splits) than
//! the one timed, since the float64 reference of a 2048-token prefill takes minutes.
//!
//! With [`CertifyOptions::plant_wrong`] one more candidate is measured: the fastest correct variant
//! with one output element perturbed after its launch. It is timed like the others (it runs the
//! same kernel) and recorded as a wrong result, and is never chosen.

use std::fmt;

use cudarc::driver::sys::CUevent_flags;
use kiln_core::ops::attention::{paged_attention, AttentionSequence, AttentionShape};
use kiln_core::ops::lm_head::{row_bytes, LmHead, MAX_ROWS, QUANT_BLOCK};
use kiln_core::ops::norm::WeightMode;
use kiln_core::ops::norm::{Gate, NormInputs, NormKind, NormOutput, NormSpec, RmsNorm, RmsNormRounding};
use kiln_core::ops::primitives::{bf16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits, FloatType};
use kiln_core::ops::quantize::{Quantized, Quantizer};
use kiln_core::tuning::{CandidateResult, CandidateStatus, Certificate, Generator, TuningKey, TuningStore};
use kiln_core::{DType, Error, Result};
use sha2::{Digest, Sha256};

use crate::compile::{Arch, KernelSource, PRELUDE};
use crate::facts::DeviceFacts;
use crate::kernels::{ATTENTION, LM_HEAD, NORM};
use crate::memory::DeviceMemory;
use crate::ops::attention::{
    attention, decode_splits_for, decode_stream_splits_for, scratch_bytes, AttentionKernel, AttentionVariant,
    KvBuffers, PagedBatch,
};
use crate::ops::lm_head::{lm_head, plan, LmHeadBuffers, LmHeadVariant, LM_HEAD_VARIANTS};
use crate::ops::norm::{norm, NormBuffers, NormCall, NormVariant, NORM_VARIANTS};
use crate::runtime::{driver_error, Gpu};

/// Kiln's version, written into every certificate's generator.
pub const KILN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The activations' type on the GPU (x of the norms, q/k/v of attention).
pub const ACTIVATIONS: DType = DType::BF16;
/// Positions per KV page of the attention keys a model asks for.
pub const PAGE_TOKENS: usize = 64;
/// Row counts certified for the norms: decode, a small batch, a prefill (one per row class).
pub const NORM_ROWS: [usize; 3] = [1, 16, 2048];
/// Row counts certified for the LM head (each is compiled separately): decode and a batch of 4.
pub const LM_HEAD_ROWS: [usize; 2] = [1, 4];
/// Query tokens of the prefill attention key's timed instance.
pub const PREFILL_TOKENS: usize = 2048;
/// Batches certified for decode attention (one per batch class).
pub const DECODE_BATCHES: [usize; 3] = [1, 8, 64];
/// Context of the short decode class's timed instance ([`DecodeClass::Short`]).
pub const DECODE_CONTEXT: usize = 4096;
/// The longest context of decode attention's short class; longer ones are its long class
/// ([`DecodeClass`]). The engine takes its boundary from `GpuOptions`, this one by default. On the
/// H200 the long class's configurations lead from 16k positions on at every batch class
/// (`bench/results/2026-11-30-h200-final/f1`: batch 8 at 16k, 124.7 us against the short class's
/// 143.6), and both classes are even at 4k.
pub const DECODE_SHORT_MAX: usize = 8_192;
/// Context of the long decode class's timed instance ([`DecodeClass::Long`]) at batches up to 8:
/// the geometric middle of 16k and 256k positions (Llama-3-8B's K and V: 0.27 GB at batch 1, 2.1 GB
/// at batch 8).
pub const DECODE_LONG_CONTEXT: usize = 65_536;
/// Context of the long decode class's timed instance past 8 sequences: at batch 64, 8.6 GB of K and
/// V (65536 positions would take 17.2 GB); at batch 64 the same variants lead from 16k to 128k.
pub const DECODE_LONG_CONTEXT_LARGE_BATCH: usize = 32_768;

/// Largest number of input sets a timing rotates over.
const MAX_SETS: usize = 4096;

// ---- families ------------------------------------------------------------------------------

/// A tuned kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Norm,
    LmHead,
    Attention,
}

impl Family {
    pub const ALL: [Family; 3] = [Family::Norm, Family::LmHead, Family::Attention];

    /// The name on the command line: `norm`, `lm-head`, `attention`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Norm => "norm",
            Family::LmHead => "lm-head",
            Family::Attention => "attention",
        }
    }

    /// The `kernel` part of the family's tuning keys.
    pub fn kernel(self) -> &'static str {
        match self {
            Family::Norm => "norm",
            Family::LmHead => "lm_head",
            Family::Attention => "attention",
        }
    }

    /// Parses a command-line name (or the key's kernel name).
    pub fn parse(name: &str) -> Result<Family> {
        Family::ALL.into_iter().find(|f| f.name() == name || f.kernel() == name).ok_or_else(|| {
            Error::InvalidArgument {
                name: "--kernel",
                value: name.to_owned(),
                reason: "one of norm, lm-head, attention".into(),
            }
        })
    }

    /// The family's kernel source.
    pub fn source(self) -> &'static KernelSource {
        match self {
            Family::Norm => &NORM,
            Family::LmHead => &LM_HEAD,
            Family::Attention => &ATTENTION,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The generator of a family's proofs: Kiln's version and the SHA-256 of the prelude and source.
pub fn generator(family: Family) -> Generator {
    let mut hasher = Sha256::new();
    hasher.update(PRELUDE.as_bytes());
    hasher.update(family.source().source.as_bytes());
    let source_sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Generator { kiln_version: KILN_VERSION.to_owned(), source_sha256 }
}

// ---- the calls a model makes ---------------------------------------------------------------

/// The shapes and types of a model that decide its kernels' keys.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShapes {
    pub name: String,
    pub hidden: usize,
    pub vocab: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: bool,
    /// The stored type of the norm weights.
    pub norm_weight: DType,
    /// The stored type of the output (LM head) weights.
    pub lm_head_weight: DType,
}

impl ModelShapes {
    /// Llama-3-8B: hidden 4096, vocabulary 128256, 32 heads over 8 KV heads of 128, bf16 weights.
    pub fn llama3_8b() -> ModelShapes {
        ModelShapes {
            name: "llama3-8b".into(),
            hidden: 4096,
            vocab: 128_256,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            rms_eps: 1e-5,
            qk_norm: false,
            norm_weight: DType::BF16,
            lm_head_weight: DType::BF16,
        }
    }

    /// SmolLM2-135M-Instruct as Kiln's default model (the Q4_1 GGUF) stores it: hidden 576,
    /// vocabulary 49152, 9 heads over 3 KV heads of 64, f32 norm weights, a Q8_0 output layer (the
    /// token embedding, tied).
    pub fn smollm2_135m() -> ModelShapes {
        ModelShapes {
            name: "smollm2-135m".into(),
            hidden: 576,
            vocab: 49_152,
            q_heads: 9,
            kv_heads: 3,
            head_dim: 64,
            rms_eps: 1e-5,
            qk_norm: false,
            norm_weight: DType::F32,
            lm_head_weight: DType::Q8_0,
        }
    }

    /// The built-in shape sets by name: `llama3-8b`, `smollm2-135m`.
    pub fn named(name: &str) -> Result<ModelShapes> {
        match name {
            "llama3-8b" | "llama-3-8b" | "Meta-Llama-3-8B" => Ok(ModelShapes::llama3_8b()),
            "smollm2-135m" | "smollm2" => Ok(ModelShapes::smollm2_135m()),
            other => Err(Error::InvalidArgument {
                name: "--shapes",
                value: other.to_owned(),
                reason: "the known shape sets are: llama3-8b, smollm2-135m".into(),
            }),
        }
    }
}

/// A norm call: its shape and types, and whether it adds the residual stream first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormTask {
    pub call: NormCall,
    pub residual: bool,
}

/// An LM head call over `rows` rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LmHeadTask {
    pub head: LmHead,
    pub rows: usize,
}

/// The phase of an attention call, with the size of the instance that is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPhase {
    /// One sequence of `tokens` query tokens (the key holds for every prefill or chunk).
    Prefill { tokens: usize },
    /// `batch` sequences of one query token at `context` positions (the key depends on the
    /// batch's class and the context's [`DecodeClass`] under [`DECODE_SHORT_MAX`]).
    Decode { batch: usize, context: usize },
}

/// The context class of a decode attention call, from the batch's longest context.
///
/// The best decode variant depends on the context (at batch 1 the streaming kernels win at 4k, the
/// wide tiled one at 128k), so each batch class has a certificate per context class. Within a
/// class the configuration (variant and splits) is fixed, and the grid does not depend on the
/// context: a decode step captured as a CUDA graph replays as the cache grows until its longest
/// sequence crosses into the other class, which needs a step captured with that class's
/// configuration (the engine keys its graphs by the class).
///
/// The short class keeps the unsuffixed key (`decode.q32.kv8.d128.p64.b1`): certificates made
/// before the classes existed were timed at 4096 positions and are the short class's. The long
/// class's key ends in `.long`. A store without the long class's certificate runs the short
/// class's (in strict mode too; see [`attention_config`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DecodeClass {
    /// Longest context up to the boundary ([`DECODE_SHORT_MAX`] by default).
    Short,
    /// Longest context past the boundary.
    Long,
}

impl DecodeClass {
    pub const ALL: [DecodeClass; 2] = [DecodeClass::Short, DecodeClass::Long];

    /// The class of a batch whose longest context is `max_context` positions, the short class
    /// holding contexts of at most `short_max` positions.
    pub fn of(max_context: usize, short_max: usize) -> DecodeClass {
        if max_context <= short_max {
            DecodeClass::Short
        } else {
            DecodeClass::Long
        }
    }

    /// `short` or `long`.
    pub fn name(self) -> &'static str {
        match self {
            DecodeClass::Short => "short",
            DecodeClass::Long => "long",
        }
    }

    /// What the class adds to a decode key: nothing (short), `.long`.
    pub fn key_suffix(self) -> &'static str {
        match self {
            DecodeClass::Short => "",
            DecodeClass::Long => ".long",
        }
    }

    /// The context of the class's timed instance at `batch` sequences: [`DECODE_CONTEXT`];
    /// [`DECODE_LONG_CONTEXT`], or [`DECODE_LONG_CONTEXT_LARGE_BATCH`] past 8 sequences. A task at
    /// this context has this class's key (both sides of [`DECODE_SHORT_MAX`]).
    pub fn timed_context(self, batch: usize) -> usize {
        match self {
            DecodeClass::Short => DECODE_CONTEXT,
            DecodeClass::Long if batch > 8 => DECODE_LONG_CONTEXT_LARGE_BATCH,
            DecodeClass::Long => DECODE_LONG_CONTEXT,
        }
    }
}

/// An attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionTask {
    pub shape: AttentionShape,
    pub phase: AttentionPhase,
}

/// One call to certify.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Task {
    Norm(NormTask),
    LmHead(LmHeadTask),
    Attention(AttentionTask),
}

impl Task {
    pub fn family(&self) -> Family {
        match self {
            Task::Norm(_) => Family::Norm,
            Task::LmHead(_) => Family::LmHead,
            Task::Attention(_) => Family::Attention,
        }
    }

    /// The call's tuning key on `arch`.
    pub fn key(&self, arch: Arch) -> Result<TuningKey> {
        match self {
            Task::Norm(t) => t.key(arch),
            Task::LmHead(t) => t.key(arch),
            Task::Attention(t) => t.key(arch),
        }
    }

    /// The label of the family's declared default for this call.
    pub fn default_config(&self, facts: &DeviceFacts) -> String {
        match self {
            Task::Norm(t) => norm_label(NormVariant::default_for(&t.call)),
            Task::LmHead(t) => {
                LmHeadVariant::default_for_call(&t.head, t.rows, facts.shared_memory_per_block_optin_bytes)
                    .label()
            }
            Task::Attention(t) => t.default_config(facts.multiprocessors).label(),
        }
    }

    /// The instance that is timed, in words (`2048 x 4096`).
    pub fn describe(&self) -> String {
        match self {
            Task::Norm(t) => format!("{} rows x {}", t.call.rows, t.call.hidden),
            Task::LmHead(t) => format!("{} rows x {} x {}", t.rows, t.head.vocab, t.head.hidden),
            Task::Attention(t) => match t.phase {
                AttentionPhase::Prefill { tokens } => format!("prefill of {tokens} tokens"),
                AttentionPhase::Decode { batch, context } => {
                    format!("decode of {batch} sequences at {context} positions")
                }
            },
        }
    }
}

/// The calls `model` makes of `families`, one per key (the first of each key is kept).
pub fn tasks(model: &ModelShapes, families: &[Family], arch: Arch) -> Result<Vec<Task>> {
    let mut all = Vec::new();
    if families.contains(&Family::Norm) {
        // Every layer adds the residual stream then normalizes (input and post-attention norms,
        // and the final norm), in Hugging Face's rounding order.
        let spec: NormSpec = RmsNorm::llama(model.rms_eps, ACTIVATIONS).into();
        for rows in NORM_ROWS {
            let call = NormCall {
                spec,
                rows,
                hidden: model.hidden,
                x_type: ACTIVATIONS,
                weight_type: model.norm_weight,
            };
            all.push(Task::Norm(NormTask { call, residual: true }));
        }
        // The GPU engine's own norms: the fp32 residual stream (the residual is added by the
        // matrix products' epilogues), fp32 weights, an fp32 output for its matrix-vector steps and
        // a bf16 one for its matrix products.
        for (rows, out) in
            NORM_ROWS.into_iter().map(|r| (r, DType::F32)).chain([(16, DType::BF16), (2048, DType::BF16)])
        {
            all.push(Task::Norm(NormTask { call: engine_norm_call(model, rows, out), residual: false }));
        }
        if model.qk_norm {
            // Qwen3's per-head norm of q: one segment per head, no residual.
            let spec: NormSpec =
                RmsNorm { groups: model.q_heads, ..RmsNorm::llama(model.rms_eps, ACTIVATIONS) }.into();
            for rows in NORM_ROWS {
                let call = NormCall {
                    spec,
                    rows,
                    hidden: model.q_heads * model.head_dim,
                    x_type: ACTIVATIONS,
                    weight_type: model.norm_weight,
                };
                all.push(Task::Norm(NormTask { call, residual: false }));
            }
        }
    }
    if families.contains(&Family::LmHead) {
        let head = LmHead {
            hidden: model.hidden,
            vocab: model.vocab,
            weight: model.lm_head_weight,
            logit_scale: 1.0,
            soft_cap: None,
            stats_block: None,
        };
        for rows in LM_HEAD_ROWS {
            all.push(Task::LmHead(LmHeadTask { head, rows }));
        }
    }
    if families.contains(&Family::Attention) {
        let shape = AttentionShape {
            q_heads: model.q_heads,
            kv_heads: model.kv_heads,
            head_dim: model.head_dim,
            page_tokens: PAGE_TOKENS,
            scale: 1.0 / (model.head_dim as f32).sqrt(),
        };
        all.push(Task::Attention(AttentionTask {
            shape,
            phase: AttentionPhase::Prefill { tokens: PREFILL_TOKENS },
        }));
        for batch in DECODE_BATCHES {
            for class in DecodeClass::ALL {
                all.push(Task::Attention(AttentionTask {
                    shape,
                    phase: AttentionPhase::Decode { batch, context: class.timed_context(batch) },
                }));
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut distinct = Vec::new();
    for task in all {
        if seen.insert(task.key(arch)?.to_string()) {
            distinct.push(task);
        }
    }
    Ok(distinct)
}

/// The RMSNorm call of Kiln's GPU engine over `rows` rows of `model` into `out` (fp32 input and
/// weights, Hugging Face's rounding order).
pub fn engine_norm_call(model: &ModelShapes, rows: usize, out: DType) -> NormCall {
    NormCall {
        spec: RmsNorm::llama(model.rms_eps, out).into(),
        rows,
        hidden: model.hidden,
        x_type: DType::F32,
        weight_type: DType::F32,
    }
}

// ---- keys ----------------------------------------------------------------------------------

fn dtype_token(dtype: DType) -> String {
    dtype.name().to_ascii_lowercase()
}

/// The row class of a norm call: `rows1`, `rows2-64`, `rows65+`.
pub fn norm_rows_class(rows: usize) -> &'static str {
    match rows {
        0 | 1 => "rows1",
        2..=64 => "rows2-64",
        _ => "rows65+",
    }
}

/// The batch class of a decode attention call: `b1`, `b2-8`, `b9-64`, `b65+`.
pub fn decode_batch_class(batch: usize) -> &'static str {
    match batch {
        0 | 1 => "b1",
        2..=8 => "b2-8",
        9..=64 => "b9-64",
        _ => "b65+",
    }
}

impl NormTask {
    /// `norm/<flavor>.n<segment>.g<groups>.<rows class>/<x>.<weight>.<out>/<arch>`, the flavor
    /// being the kind and what the spec adds (`rms.res.hf`: RMSNorm after the residual add, Hugging
    /// Face rounding).
    pub fn key(&self, arch: Arch) -> Result<TuningKey> {
        let s = &self.call.spec;
        let mut flavor = String::from(if s.kind == NormKind::Rms { "rms" } else { "layer" });
        if self.residual {
            flavor.push_str(".res");
        }
        if s.rounding == RmsNormRounding::HuggingFace && s.kind == NormKind::Rms {
            flavor.push_str(".hf");
        }
        match s.weight {
            WeightMode::Plain => {}
            WeightMode::OnePlus => flavor.push_str(".one_plus"),
            WeightMode::None => flavor.push_str(".no_weight"),
        }
        if s.bias {
            flavor.push_str(".bias");
        }
        match s.gate {
            None => {}
            Some(Gate::Before) => flavor.push_str(".gate_before"),
            Some(Gate::After) => flavor.push_str(".gate_after"),
        }
        let out = match s.out {
            NormOutput::Float(dtype) => dtype_token(dtype),
            NormOutput::Quantized(Quantizer::Int8) => "int8".into(),
            NormOutput::Quantized(Quantizer::Nvfp4 { .. }) => "nvfp4".into(),
            NormOutput::Quantized(Quantizer::Fp8E4m3 { .. }) => "fp8_e4m3".into(),
        };
        TuningKey::new(
            Family::Norm.kernel(),
            format!(
                "{flavor}.n{}.g{}.{}",
                self.call.segment_len(),
                s.groups,
                norm_rows_class(self.call.rows)
            ),
            format!("{}.{}.{out}", dtype_token(self.call.x_type), dtype_token(self.call.weight_type)),
            arch.to_string(),
        )
    }
}

impl LmHeadTask {
    /// `lm_head/v<vocab>.h<hidden>.rows<rows>[.stats<block>][.softcap]/<weight>.f32/<arch>`; the
    /// row count is exact, since each is compiled separately.
    pub fn key(&self, arch: Arch) -> Result<TuningKey> {
        let h = &self.head;
        let mut class = format!("v{}.h{}.rows{}", h.vocab, h.hidden, self.rows);
        if let Some(block) = h.stats_block {
            class.push_str(&format!(".stats{block}"));
        }
        if h.soft_cap.is_some() {
            class.push_str(".softcap");
        }
        TuningKey::new(
            Family::LmHead.kernel(),
            class,
            format!("{}.f32", dtype_token(h.weight)),
            arch.to_string(),
        )
    }
}

impl AttentionTask {
    /// `attention/prefill.q<heads>.kv<heads>.d<dim>.p<page>/bf16/<arch>`, or
    /// `decode.….b<class>` (short contexts) and `decode.….b<class>.long` ([`DecodeClass`]).
    pub fn key(&self, arch: Arch) -> Result<TuningKey> {
        let s = &self.shape;
        let base = format!("q{}.kv{}.d{}.p{}", s.q_heads, s.kv_heads, s.head_dim, s.page_tokens);
        let class = match self.phase {
            AttentionPhase::Prefill { .. } => format!("prefill.{base}"),
            AttentionPhase::Decode { batch, context } => format!(
                "decode.{base}.{}{}",
                decode_batch_class(batch),
                DecodeClass::of(context, DECODE_SHORT_MAX).key_suffix()
            ),
        };
        TuningKey::new(Family::Attention.kernel(), class, dtype_token(ACTIVATIONS), arch.to_string())
    }

    /// A decode call's context class (under [`DECODE_SHORT_MAX`]); `None` for prefill.
    pub fn decode_class(&self) -> Option<DecodeClass> {
        match self.phase {
            AttentionPhase::Prefill { .. } => None,
            AttentionPhase::Decode { context, .. } => Some(DecodeClass::of(context, DECODE_SHORT_MAX)),
        }
    }

    /// The decode call of `batch` sequences in `class`, as the engine and the bench look it up
    /// (at the class's timed context, so its key is the class's whatever the boundary in use).
    pub fn decode(shape: AttentionShape, batch: usize, class: DecodeClass) -> AttentionTask {
        AttentionTask { shape, phase: AttentionPhase::Decode { batch, context: class.timed_context(batch) } }
    }

    /// The declared default: the variant for the phase, and the splits of
    /// [`crate::ops::attention::decode_splits`] for decode, 1 for prefill.
    pub fn default_config(&self, multiprocessors: u32) -> AttentionConfig {
        match self.phase {
            AttentionPhase::Prefill { tokens } => {
                AttentionConfig { variant: AttentionVariant::default_for(tokens), splits: 1 }
            }
            AttentionPhase::Decode { batch, .. } => AttentionConfig {
                variant: AttentionVariant::default_for(1),
                splits: decode_splits_for(multiprocessors, batch, self.shape.kv_heads),
            },
        }
    }
}

// ---- configurations and their names ----------------------------------------------------------

/// A norm variant's name: `4w1r` (warps per row, rows per block), `+e` when it loads the weight
/// early, `+p` when its grid is persistent, `+s3` for a staged grid of 3 cp.async stages, `+b` for
/// one lane a quantization block, `+w` when it loads the weight a unit ahead, `+t` when the row's
/// first warp alone finishes the total, `+n` when the segment length is compiled in.
pub fn norm_label(v: NormVariant) -> String {
    format!(
        "{}w{}r{}{}{}{}{}{}{}",
        v.warps_per_row,
        v.rows_per_block,
        if v.early_weight { "+e" } else { "" },
        if v.persistent { "+p" } else { "" },
        if v.stages > 0 { format!("+s{}", v.stages) } else { String::new() },
        if v.block_lane { "+b" } else { "" },
        if v.weight_ahead { "+w" } else { "" },
        if v.row_total { "+t" } else { "" },
        if v.fixed_n { "+n" } else { "" }
    )
}

/// The listed norm variant named `label`.
pub fn parse_norm_variant(label: &str) -> Option<NormVariant> {
    NORM_VARIANTS.iter().copied().find(|v| norm_label(*v) == label)
}

/// The LM head variant named `label` ([`LmHeadVariant::label`]): a listed one or a row count's default.
pub fn parse_lm_head_variant(label: &str) -> Option<LmHeadVariant> {
    LM_HEAD_VARIANTS
        .iter()
        .copied()
        .chain((1..=MAX_ROWS).map(LmHeadVariant::default_for))
        .find(|v| v.label() == label)
}

/// An attention configuration: the variant and the splits of the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionConfig {
    pub variant: AttentionVariant,
    pub splits: u32,
}

impl AttentionConfig {
    /// `4x1x64.s1`: warps_m x warps_n x warp_keys, then the splits; the wgmma prefill kernels'
    /// named `wgmma-8x1x128.s1` and `wgmma-pingpong-8x1x128.s1`, the decode variants three K/V
    /// tiles deep `deep-1x4x16.s8`, the one-stage alternating ones `alt-1x4x32.s4`, the hybrid decode `hybrid-1x4x16.s33`, and the streaming
    /// decode variants but the default `stream<stages>-...` (`stream3-1x8x16.s2`,
    /// `stream6-1x4x16.s2`).
    pub fn label(&self) -> String {
        let v = &self.variant;
        let kernel = match v.kernel {
            AttentionKernel::Warpgroup => "wgmma-",
            AttentionKernel::WarpgroupPingpong => "wgmma-pingpong-",
            _ if v.hybrid => "hybrid-",
            AttentionKernel::Tiled if v.stages == AttentionVariant::DECODE_DEEP.stages => "deep-",
            AttentionKernel::Tiled if v.stages == 1 => "alt-",
            AttentionKernel::Streaming if *v != AttentionVariant::DECODE => {
                return format!(
                    "stream{}-{}x{}x{}.s{}",
                    v.stages, v.warps_m, v.warps_n, v.warp_keys, self.splits
                );
            }
            AttentionKernel::Tiled | AttentionKernel::Streaming => "",
        };
        format!("{kernel}{}x{}x{}.s{}", v.warps_m, v.warps_n, v.warp_keys, self.splits)
    }

    /// The configuration named `label`: a variant of [`AttentionVariant::ALL`] or a wgmma prefill
    /// variant, splits 1 to 64.
    pub fn parse(label: &str) -> Option<AttentionConfig> {
        let (_, splits) = label.rsplit_once(".s")?;
        let splits: u32 = splits.parse().ok().filter(|s| (1..=64).contains(s))?;
        let others = [
            AttentionVariant::PREFILL_WGMMA,
            AttentionVariant::PREFILL_WGMMA_PINGPONG,
            AttentionVariant::DECODE_DEEP,
            AttentionVariant::DECODE_WIDE_DEEP,
            AttentionVariant::DECODE_HYBRID,
            AttentionVariant::DECODE_STREAM_WIDE,
            AttentionVariant::DECODE_STREAM_DEEP,
            AttentionVariant::DECODE_ALT,
            AttentionVariant::DECODE_ALT_WIDE,
        ];
        let variant = AttentionVariant::ALL
            .into_iter()
            .chain(others)
            .find(|&variant| AttentionConfig { variant, splits }.label() == label)?;
        Some(AttentionConfig { variant, splits })
    }
}

fn unknown_config(key: &TuningKey, config: &str) -> Error {
    Error::UnknownTuningConfig { kernel: key.kernel.clone(), key: key.to_string(), config: config.to_owned() }
}

/// The norm variant to run for `task` on `arch`: the certified winner; without one, in strict
/// mode [`Error::KeyNotCertified`], else [`NormVariant::default_for`] the call.
pub fn norm_variant(store: &TuningStore, task: &NormTask, arch: Arch) -> Result<NormVariant> {
    let key = task.key(arch)?;
    let default = norm_label(NormVariant::default_for(&task.call));
    let chosen = store.config_for(&key, &default)?;
    let variant = parse_norm_variant(chosen).ok_or_else(|| unknown_config(&key, chosen))?;
    task.call.validate(variant).map_err(|e| e.context(format!("certified `{chosen}` for {key}")))?;
    Ok(variant)
}

/// The LM head variant to run for `task` on `arch` (see [`norm_variant`]), on a device whose
/// blocks may opt in to `shared_limit` bytes of shared memory (for the declared default).
pub fn lm_head_variant(
    store: &TuningStore,
    task: &LmHeadTask,
    arch: Arch,
    shared_limit: u64,
) -> Result<LmHeadVariant> {
    let key = task.key(arch)?;
    let default = LmHeadVariant::default_for_call(&task.head, task.rows, shared_limit).label();
    let chosen = store.config_for(&key, &default)?;
    let variant = parse_lm_head_variant(chosen).ok_or_else(|| unknown_config(&key, chosen))?;
    plan(&task.head, task.rows, variant).map_err(|e| e.context(format!("certified `{chosen}` for {key}")))?;
    Ok(variant)
}

/// The attention configuration to run for `task` on a device of `multiprocessors` (see
/// [`norm_variant`]; the default is [`AttentionTask::default_config`]). A decode call of the long
/// class ([`DecodeClass`]) whose key is not certified runs the short class's certificate when
/// there is one, in either mode: a store made before the classes existed (or certified with
/// short keys only) keeps the configuration it had; without either certificate the store's mode
/// decides as for any key.
pub fn attention_config(
    store: &TuningStore,
    task: &AttentionTask,
    arch: Arch,
    multiprocessors: u32,
) -> Result<AttentionConfig> {
    let key = task.key(arch)?;
    let default = task.default_config(multiprocessors).label();
    let chosen = match (task.decode_class(), task.phase, store.winner(&key)) {
        (Some(DecodeClass::Long), AttentionPhase::Decode { batch, .. }, None) => {
            let short_key = AttentionTask::decode(task.shape, batch, DecodeClass::Short).key(arch)?;
            match store.winner(&short_key) {
                Some(winner) => {
                    tracing::debug!("no certificate for {key}; running the short class's `{winner}`");
                    winner
                }
                None => store.config_for(&key, &default)?,
            }
        }
        _ => store.config_for(&key, &default)?,
    };
    AttentionConfig::parse(chosen).ok_or_else(|| unknown_config(&key, chosen))
}

// ---- candidates, pruned by the device's facts --------------------------------------------

/// A candidate left out before compiling, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunedCandidate {
    pub config: String,
    pub reason: String,
}

/// A family's candidates for one call: those kept (the declared default first), those pruned.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates<C> {
    pub kept: Vec<C>,
    pub pruned: Vec<PrunedCandidate>,
}

impl<C> Candidates<C> {
    fn sort(list: Vec<(C, String, Option<String>)>) -> Candidates<C> {
        let mut candidates = Candidates { kept: Vec::new(), pruned: Vec::new() };
        for (config, label, why) in list {
            match why {
                None => candidates.kept.push(config),
                Some(reason) => candidates.pruned.push(PrunedCandidate { config: label, reason }),
            }
        }
        candidates
    }
}

/// A default-first list without repeats.
fn default_first<C: PartialEq + Copy>(default: C, all: impl IntoIterator<Item = C>) -> Vec<C> {
    let mut list = vec![default];
    for c in all {
        if !list.contains(&c) {
            list.push(c);
        }
    }
    list
}

/// Most registers a thread may use (the ISA's limit on every architecture Kiln serves).
const MAX_REGISTERS_PER_THREAD: u64 = 255;

/// The norm variants for `task`: those the kernel serves for the shape, whose block fits the
/// device's threads, static shared memory and registers (an upper estimate: 8 fp32 values per
/// unit of 256 elements held by each lane, twice when the weight is loaded early, plus 32).
pub fn norm_candidates(task: &NormTask, facts: &DeviceFacts) -> Candidates<NormVariant> {
    let list = default_first(NormVariant::default_for(&task.call), NORM_VARIANTS.iter().copied());
    Candidates::sort(
        list.into_iter()
            .map(|v| {
                let why = match task.call.validate(v) {
                    Err(e) => Some(format!("not served: {e}")),
                    Ok(units) => {
                        let threads = 32 * u64::from(v.warps_per_row) * u64::from(v.rows_per_block);
                        let held = if v.warps_per_row > 1 { units } else { 1 };
                        let staged = v.staged_shared_bytes(&task.call, task.residual).unwrap_or(usize::MAX);
                        let shared = 2 * u64::from(v.rows_per_block) * held as u64 * 4 + staged as u64;
                        // Staged variants opt in to more than the default per block.
                        let shared_limit = if v.stages > 0 {
                            facts.shared_memory_per_block_optin_bytes
                        } else {
                            facts.shared_memory_per_block_bytes
                        };
                        let registers = 8 * units as u64 * if v.early_weight { 2 } else { 1 } + 32;
                        if threads > u64::from(facts.max_threads_per_block) {
                            Some(format!(
                                "{threads} threads, the device allows {}",
                                facts.max_threads_per_block
                            ))
                        } else if shared > shared_limit {
                            Some(format!("{shared} bytes of shared memory, the device gives {shared_limit}"))
                        } else if registers > MAX_REGISTERS_PER_THREAD
                            || threads * registers > u64::from(facts.registers_per_block)
                        {
                            Some(format!(
                                "about {registers} registers a thread x {threads} threads, the device \
                                 gives {} a block",
                                facts.registers_per_block
                            ))
                        } else {
                            None
                        }
                    }
                };
                (v, norm_label(v), why)
            })
            .collect(),
    )
}

/// The LM head variants for `task`: those the kernel serves for the row count whose block fits
/// the device's threads and opt-in shared memory.
pub fn lm_head_candidates(task: &LmHeadTask, facts: &DeviceFacts) -> Candidates<LmHeadVariant> {
    let list = default_first(
        LmHeadVariant::default_for_call(&task.head, task.rows, facts.shared_memory_per_block_optin_bytes),
        LM_HEAD_VARIANTS.iter().copied(),
    );
    Candidates::sort(
        list.into_iter()
            .map(|v| {
                let why = match plan(&task.head, task.rows, v) {
                    Err(e) => Some(format!("not served: {e}")),
                    // The kernel's static shared memory (per-row tile maxima) is at most 64 bytes.
                    Ok(p) if p.shared_bytes as u64 + 64 > facts.shared_memory_per_block_optin_bytes => {
                        Some(format!(
                            "{} bytes of shared memory, the device gives {}",
                            p.shared_bytes + 64,
                            facts.shared_memory_per_block_optin_bytes
                        ))
                    }
                    Ok(p) if p.threads > facts.max_threads_per_block => Some(format!(
                        "{} threads, the device allows {}",
                        p.threads, facts.max_threads_per_block
                    )),
                    Ok(_) => None,
                };
                (v, v.label(), why)
            })
            .collect(),
    )
}

/// The one-block-a-multiprocessor streaming decode variants ([`AttentionVariant::DECODE_STREAM_WIDE`],
/// [`AttentionVariant::DECODE_STREAM_DEEP`]) at their own splits ([`decode_stream_splits_for`]: one
/// wave) and twice that (two waves, at most 64).
fn stream_candidates(task: &AttentionTask, facts: &DeviceFacts) -> Vec<AttentionConfig> {
    let AttentionPhase::Decode { batch, .. } = task.phase else { return Vec::new() };
    let s = decode_stream_splits_for(facts.multiprocessors, batch, task.shape.kv_heads);
    let mut splits = vec![s, (2 * s).min(64)];
    splits.dedup();
    [AttentionVariant::DECODE_STREAM_WIDE, AttentionVariant::DECODE_STREAM_DEEP]
        .into_iter()
        .flat_map(|variant| splits.iter().map(move |&splits| AttentionConfig { variant, splits }))
        .collect()
}

/// The attention configurations for `task`: prefill runs each prefill variant unsplit; decode
/// runs each decode variant at 1, half, once and twice the default splits, and the wide and deep
/// streaming ones at their own splits (`stream_candidates`); each must fit the
/// device's threads and opt-in shared memory.
pub fn attention_candidates(task: &AttentionTask, facts: &DeviceFacts) -> Candidates<AttentionConfig> {
    let default = task.default_config(facts.multiprocessors);
    let others: Vec<AttentionConfig> = match task.phase {
        AttentionPhase::Prefill { .. } => [
            AttentionVariant::PREFILL,
            AttentionVariant::PREFILL_WIDE,
            AttentionVariant::PREFILL_WGMMA,
            AttentionVariant::PREFILL_WGMMA_PINGPONG,
        ]
        .into_iter()
        .map(|variant| AttentionConfig { variant, splits: 1 })
        .collect(),
        AttentionPhase::Decode { batch, .. } => {
            let s = default.splits;
            // With the streaming kernels' splits too (one block a multiprocessor for 8 warps: 16
            // at batch 1 with 8 kv heads), where the wide kernel reads fastest at long contexts.
            let stream = decode_stream_splits_for(facts.multiprocessors, batch, task.shape.kv_heads);
            let mut splits = vec![1, s.div_ceil(2), s, (2 * s).min(64), stream];
            splits.sort_unstable();
            splits.dedup();
            [
                AttentionVariant::DECODE,
                AttentionVariant::DECODE_WIDE,
                AttentionVariant::DECODE_DEEP,
                AttentionVariant::DECODE_WIDE_DEEP,
                AttentionVariant::DECODE_HYBRID,
                AttentionVariant::DECODE_ALT_WIDE,
            ]
            .into_iter()
            .flat_map(|variant| splits.iter().map(move |&splits| AttentionConfig { variant, splits }))
            .chain(stream_candidates(task, facts))
            .collect()
        }
    };
    let list = default_first(default, others);
    Candidates::sort(
        list.into_iter()
            .map(|c| {
                let v = c.variant;
                let shared = v.shared_bytes(task.shape.head_dim) as u64;
                let threads = 32 * v.warps_m * v.warps_n;
                let wgmma =
                    matches!(v, AttentionVariant::PREFILL_WGMMA | AttentionVariant::PREFILL_WGMMA_PINGPONG);
                let why = if wgmma && (facts.compute_capability != (9, 0) || task.shape.head_dim != 128) {
                    Some(format!(
                        "the wgmma prefill serves sm_90 and head dim 128, not sm_{}{} and head dim {}",
                        facts.compute_capability.0, facts.compute_capability.1, task.shape.head_dim
                    ))
                } else if shared > facts.shared_memory_per_block_optin_bytes {
                    Some(format!(
                        "{shared} bytes of shared memory, the device gives {}",
                        facts.shared_memory_per_block_optin_bytes
                    ))
                } else if threads > facts.max_threads_per_block {
                    Some(format!("{threads} threads, the device allows {}", facts.max_threads_per_block))
                } else {
                    None
                };
                (c, c.label(), why)
            })
            .collect(),
    )
}

// ---- selection records -------------------------------------------------------------------

/// The record of a candidate pruned before compiling (it never ran, so it can never win).
pub fn pruned_result(pruned: &PrunedCandidate) -> CandidateResult {
    CandidateResult {
        config: pruned.config.clone(),
        time_us: None,
        error: None,
        status: CandidateStatus::Failed { detail: format!("pruned before compile: {}", pruned.reason) },
    }
}

/// The name of the planted wrong candidate made from the variant `label`.
pub fn planted_label(label: &str) -> String {
    format!("planted-wrong({label})")
}

/// The record of a run: `Ok` when the oracle agreed, else a wrong result.
fn run_result(config: String, time_us: Option<f64>, check: &Check) -> CandidateResult {
    CandidateResult {
        config,
        time_us,
        error: Some(check.error),
        status: match &check.wrong {
            None => CandidateStatus::Ok,
            Some(detail) => CandidateStatus::WrongResult { detail: detail.clone() },
        },
    }
}

fn failed_result(config: String, error: &Error) -> CandidateResult {
    CandidateResult {
        config,
        time_us: None,
        error: None,
        status: CandidateStatus::Failed { detail: error.to_string() },
    }
}

// ---- measuring --------------------------------------------------------------------------

/// How a certification measures.
#[derive(Debug, Clone)]
pub struct CertifyOptions {
    /// Timed batches per candidate (the median is kept).
    pub batches: usize,
    /// Launches per batch (each on the next input set).
    pub launches: usize,
    /// Adds the planted wrong candidate (see the module docs).
    pub plant_wrong: bool,
    /// The date written into the certificate (ISO 8601).
    pub date: String,
}

/// What [`certify`] returns: the certificate and the declared default's name.
#[derive(Debug, Clone)]
pub struct Certified {
    pub certificate: Certificate,
    pub default_config: String,
    /// The planted wrong candidate's name, when one was planted.
    pub planted: Option<String>,
}

/// An oracle comparison.
#[derive(Debug, Clone, PartialEq)]
struct Check {
    error: f64,
    /// Why the result is wrong, or `None` when it agrees.
    wrong: Option<String>,
}

/// One key's inputs, oracle and timing sets.
trait Harness {
    type Config: Copy;
    fn label(&self, config: Self::Config) -> String;
    /// Runs `config` once on the check inputs (outputs poisoned first), perturbs one output
    /// element after the launch when `plant`, and compares with the oracle.
    fn check(&mut self, gpu: &Gpu, config: Self::Config, plant: bool) -> Result<Check>;
    /// The median time of one launch of `config`, microseconds.
    fn time_us(&mut self, gpu: &Gpu, config: Self::Config, options: &CertifyOptions) -> Result<f64>;
}

/// Measures `task` on `gpu` and returns its certificate; `progress` is called with each
/// candidate's name before it is measured.
pub fn certify(
    gpu: &Gpu,
    task: &Task,
    options: &CertifyOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Certified> {
    let arch = gpu.arch();
    let key = task.key(arch)?;
    let facts = gpu.facts();
    let mut rng = Rng::fresh();
    let (results, planted) = match task {
        Task::Norm(t) => {
            let candidates = norm_candidates(t, facts);
            let mut harness = NormHarness::new(gpu, *t, &mut rng)?;
            measure(gpu, &mut harness, &candidates, options, progress)?
        }
        Task::LmHead(t) => {
            let candidates = lm_head_candidates(t, facts);
            let mut harness = LmHeadHarness::new(gpu, *t, &mut rng)?;
            measure(gpu, &mut harness, &candidates, options, progress)?
        }
        Task::Attention(t) => {
            let candidates = attention_candidates(t, facts);
            let mut harness = AttentionHarness::new(gpu, *t, &mut rng)?;
            measure(gpu, &mut harness, &candidates, options, progress)?
        }
    };
    let certificate = Certificate::new(
        key,
        results,
        generator(task.family()),
        facts.name.clone(),
        format!("CUDA {}", facts.driver_cuda_version),
        options.date.clone(),
    )?;
    Ok(Certified { certificate, default_config: task.default_config(facts), planted })
}

fn measure<H: Harness>(
    gpu: &Gpu,
    harness: &mut H,
    candidates: &Candidates<H::Config>,
    options: &CertifyOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<CandidateResult>, Option<String>)> {
    let mut results = Vec::new();
    let mut ran: Vec<(H::Config, f64)> = Vec::new();
    for &config in &candidates.kept {
        let label = harness.label(config);
        progress(&label);
        let check = match harness.check(gpu, config, false) {
            Ok(check) => check,
            Err(e) => {
                tracing::warn!("{label}: {e}");
                results.push(failed_result(label, &e));
                continue;
            }
        };
        match harness.time_us(gpu, config, options) {
            Ok(us) => {
                if check.wrong.is_none() {
                    ran.push((config, us));
                }
                results.push(run_result(label, Some(us), &check));
            }
            Err(e) => results.push(failed_result(label, &e)),
        }
    }
    results.extend(candidates.pruned.iter().map(pruned_result));
    let mut planted = None;
    if options.plant_wrong {
        if let Some(&(fastest, _)) = ran.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
            let label = planted_label(&harness.label(fastest));
            progress(&label);
            let check = harness.check(gpu, fastest, true)?;
            let us = harness.time_us(gpu, fastest, options)?;
            results.push(run_result(label.clone(), Some(us), &check));
            planted = Some(label);
        }
    }
    Ok((results, planted))
}

/// The median time per launch, microseconds, of `batches` batches of `launches` calls of
/// `launch(i)` between CUDA events, after a warm-up of `launches` calls (at least 3).
pub fn median_launch_us(
    gpu: &Gpu,
    batches: usize,
    launches: usize,
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let launches = launches.max(1);
    for i in 0..launches.max(3) {
        launch(i)?;
    }
    let start = gpu.context().new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let end = gpu.context().new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let mut per_launch_us = Vec::with_capacity(batches.max(1));
    let mut counter = launches.max(3);
    for _ in 0..batches.max(1) {
        start.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        for _ in 0..launches {
            launch(counter)?;
            counter += 1;
        }
        end.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        end.synchronize().map_err(|e| driver_error("cuEventSynchronize", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
        per_launch_us.push(f64::from(ms) * 1000.0 / launches as f64);
    }
    per_launch_us.sort_by(f64::total_cmp);
    Ok(per_launch_us[per_launch_us.len() / 2])
}

/// As [`median_launch_us`], with the `launches` calls of a batch captured once into a CUDA graph
/// and the graph replayed per batch, so that the host's cost per launch (microseconds: the
/// launcher's checks, the driver's launch) stays out of the time, as in a captured decode step.
/// The calls are warmed up plainly first (at least 3, so every kernel is compiled and loaded),
/// then captured with `launch(launches.max(3))` onwards, then the graph replayed once before the
/// timed batches. The captured calls read and write the same buffers at every replay.
pub fn median_graph_launch_us(
    gpu: &Gpu,
    batches: usize,
    launches: usize,
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let launches = launches.max(1);
    let warm_up = launches.max(3);
    for i in 0..warm_up {
        launch(i)?;
    }
    let per_launch_us = graph_replay_us(gpu, warm_up..warm_up + launches, batches, launch)?;
    Ok(per_launch_us[per_launch_us.len() / 2])
}

/// The calls `launch(i)` for `i` in `indices` captured once into a CUDA graph (the capture ends
/// whatever a call returned, so the stream is never left capturing), the graph replayed once,
/// then `replays` times (at least once) between CUDA events: the time per call of each replay,
/// microseconds, sorted.
pub fn graph_replay_us(
    gpu: &Gpu,
    indices: std::ops::Range<usize>,
    replays: usize,
    launch: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f64>> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let calls = indices.len().max(1);
    let stream = gpu.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
    let launched = indices.into_iter().try_for_each(launch);
    let graph =
        stream.end_capture(CUgraphInstantiate_flags(0)).map_err(|e| driver_error("cuStreamEndCapture", e))?;
    launched?;
    let graph = graph.ok_or_else(|| Error::NotServed {
        op: "CUDA graph",
        reason: "the capture of the timed launches recorded no work".into(),
    })?;
    graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = gpu.context().new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let end = gpu.context().new_event(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    let mut per_launch_us = Vec::with_capacity(replays.max(1));
    for _ in 0..replays.max(1) {
        start.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))?;
        end.record(gpu.stream()).map_err(|e| driver_error("cuEventRecord", e))?;
        end.synchronize().map_err(|e| driver_error("cuEventSynchronize", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
        per_launch_us.push(f64::from(ms) * 1000.0 / calls as f64);
    }
    per_launch_us.sort_by(f64::total_cmp);
    Ok(per_launch_us)
}

/// Launches [`median_launch_us`] makes with `options` (warm-up included).
fn launches_of(options: &CertifyOptions) -> usize {
    options.launches.max(3) + options.batches.max(1) * options.launches.max(1)
}

/// Input sets to rotate over so that together they exceed twice the L2 cache (at least 1).
pub fn rotation_sets(set_bytes: usize, l2_bytes: u64) -> usize {
    (2 * l2_bytes as usize).div_ceil(set_bytes.max(1)).clamp(1, MAX_SETS)
}

/// xorshift64*, seeded from the clock: fresh inputs on every run.
struct Rng(u64);

impl Rng {
    fn fresh() -> Rng {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Rng(nanos | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [lo, hi), 24 bits of resolution.
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }

    /// `len` values in [lo, hi) rounded to `ty`.
    fn values(&mut self, len: usize, lo: f32, hi: f32, ty: FloatType) -> Vec<f32> {
        (0..len).map(|_| ty.round(self.uniform(lo, hi))).collect()
    }
}

fn encode(values: &[f32], ty: FloatType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * ty.bytes());
    for &v in values {
        ty.encode(v, &mut out);
    }
    out
}

fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceMemory> {
    let memory = gpu.alloc(bytes.len().max(16))?;
    memory.copy_from_host(0, bytes)?;
    Ok(memory)
}

fn poisoned(gpu: &Gpu, bytes: usize, value: u8) -> Result<DeviceMemory> {
    let memory = gpu.alloc(bytes.max(16))?;
    memory.fill_bytes(value)?;
    Ok(memory)
}

/// Flips the lowest bit of byte `offset` of `memory` (after the stream's work is done).
fn flip_byte(gpu: &Gpu, memory: &DeviceMemory, offset: usize) -> Result<()> {
    gpu.synchronize()?;
    let mut byte = [0u8];
    memory.copy_to_host(offset, &mut byte)?;
    memory.copy_from_host(offset, &[byte[0] ^ 1])
}

/// Bytes of `got` that differ from `want`, and the first such index.
fn byte_differences(want: &[u8], got: &[u8]) -> (usize, Option<usize>) {
    let mut count = want.len().saturating_sub(got.len());
    let mut first = (count > 0).then_some(got.len());
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        if a != b {
            count += 1;
            first.get_or_insert(i);
        }
    }
    (count, first)
}

// ---- norm ---------------------------------------------------------------------------------

struct NormSet {
    x: DeviceMemory,
    residual: Option<DeviceMemory>,
    out: DeviceMemory,
    scales: Option<DeviceMemory>,
}

struct NormHarness {
    task: NormTask,
    x: DeviceMemory,
    residual_source: Option<DeviceMemory>,
    residual: Option<DeviceMemory>,
    weight: Option<DeviceMemory>,
    bias: Option<DeviceMemory>,
    gate: Option<DeviceMemory>,
    want_out: Vec<u8>,
    want_scales: Vec<u8>,
    want_residual: Option<Vec<u8>>,
    sets: Vec<NormSet>,
    /// The next input set: each timing continues where the last one stopped, so no candidate
    /// finds the sets the previous one left in L2.
    turn: usize,
}

impl NormHarness {
    fn new(gpu: &Gpu, task: NormTask, rng: &mut Rng) -> Result<NormHarness> {
        let call = task.call;
        let (rows, hidden, s) = (call.rows, call.hidden, call.spec);
        let xt = FloatType::of(call.x_type, "norm input")?;
        let wt = FloatType::of(call.weight_type, "norm weight")?;
        let x = rng.values(rows * hidden, -2.0, 2.0, xt);
        let residual = rng.values(rows * hidden, -2.0, 2.0, xt);
        let weight = rng.values(hidden, 0.25, 1.75, wt);
        let bias = rng.values(hidden, -0.5, 0.5, wt);
        let gate = rng.values(rows * hidden, -6.0, 6.0, xt);
        let inputs = NormInputs {
            x: &x,
            x_type: call.x_type,
            residual: task.residual.then_some(&residual[..]),
            weight: (s.weight != WeightMode::None).then_some(&weight[..]),
            bias: s.bias.then_some(&bias[..]),
            gate: s.gate.map(|_| &gate[..]),
        };
        let want = s.run(hidden, &inputs)?;
        let (want_out, want_scales) = match (&s.out, want.quantized) {
            (NormOutput::Float(dtype), _) => {
                (encode(&want.y, FloatType::of(*dtype, "norm output")?), Vec::new())
            }
            (_, Some(Quantized::Int8 { codes, scales })) => (
                codes.iter().map(|&c| c as u8).collect(),
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
            (_, Some(Quantized::Nvfp4 { packed, scales })) => (packed, scales),
            (_, Some(Quantized::Fp8E4m3 { codes })) => (codes, Vec::new()),
            (_, None) => {
                return Err(Error::NotServed {
                    op: "norm certification",
                    reason: "the reference returned no quantized output".into(),
                })
            }
        };
        let want_residual = want.residual.as_ref().map(|r| encode(r, xt));

        let (x_bytes, _, out_bytes, scale_bytes) = call.buffer_bytes()?;
        let residual_source = task.residual.then(|| upload(gpu, &encode(&residual, xt))).transpose()?;
        let residual_work = task.residual.then(|| gpu.alloc(x_bytes.max(16))).transpose()?;
        let set_bytes = x_bytes * if task.residual { 2 } else { 1 } + out_bytes + scale_bytes;
        let sets = rotation_sets(set_bytes, gpu.facts().l2_cache_bytes).max(2);
        let mut timing = Vec::with_capacity(sets);
        // One random block per distinct set would cost seconds for thousands of tiny sets; the
        // sets share a few random blocks (the addresses, not the values, keep L2 cold).
        let blocks: Vec<Vec<u8>> =
            (0..sets.min(8)).map(|_| encode(&rng.values(rows * hidden, -2.0, 2.0, xt), xt)).collect();
        for i in 0..sets {
            let block = &blocks[i % blocks.len()];
            timing.push(NormSet {
                x: upload(gpu, block)?,
                residual: task.residual.then(|| upload(gpu, &blocks[(i + 1) % blocks.len()])).transpose()?,
                out: gpu.alloc(out_bytes.max(16))?,
                scales: (scale_bytes > 0).then(|| gpu.alloc(scale_bytes)).transpose()?,
            });
        }
        Ok(NormHarness {
            task,
            x: upload(gpu, &encode(&x, xt))?,
            residual_source,
            residual: residual_work,
            weight: (s.weight != WeightMode::None).then(|| upload(gpu, &encode(&weight, wt))).transpose()?,
            bias: s.bias.then(|| upload(gpu, &encode(&bias, wt))).transpose()?,
            gate: s.gate.map(|_| upload(gpu, &encode(&gate, xt))).transpose()?,
            want_out,
            want_scales,
            want_residual,
            sets: timing,
            turn: 0,
        })
    }
}

impl Harness for NormHarness {
    type Config = NormVariant;

    fn label(&self, config: NormVariant) -> String {
        norm_label(config)
    }

    fn check(&mut self, gpu: &Gpu, variant: NormVariant, plant: bool) -> Result<Check> {
        let (_, _, out_bytes, scale_bytes) = self.task.call.buffer_bytes()?;
        if let (Some(work), Some(source)) = (&self.residual, &self.residual_source) {
            work.copy_from_device(source)?;
        }
        let out = poisoned(gpu, out_bytes, 0xA7)?;
        let scales = (scale_bytes > 0).then(|| poisoned(gpu, scale_bytes, 0xA7)).transpose()?;
        let buffers = NormBuffers {
            x: &self.x,
            residual: self.residual.as_ref(),
            weight: self.weight.as_ref(),
            bias: self.bias.as_ref(),
            gate: self.gate.as_ref(),
            out: &out,
            scales: scales.as_ref(),
        };
        norm(gpu, &self.task.call, buffers, Some(variant))?;
        if plant {
            flip_byte(gpu, &out, out_bytes / 2)?;
        }
        gpu.synchronize()?;
        let mut differing = 0;
        let mut first = None;
        let mut compare = |what: &str, want: &[u8], got: Vec<u8>| {
            let (count, at) = byte_differences(want, &got[..want.len().min(got.len())]);
            differing += count;
            if first.is_none() {
                first = at.map(|i| format!("{what} byte {i}"));
            }
        };
        compare("output", &self.want_out, out.to_host_bytes()?);
        if let Some(scales) = &scales {
            compare("scale", &self.want_scales, scales.to_host_bytes()?);
        }
        if let (Some(want), Some(got)) = (&self.want_residual, &self.residual) {
            compare("residual", want, got.to_host_bytes()?);
        }
        let wrong = first.map(|at| format!("{differing} bytes differ from the CPU reference, first at {at}"));
        Ok(Check { error: differing as f64, wrong })
    }

    fn time_us(&mut self, gpu: &Gpu, variant: NormVariant, options: &CertifyOptions) -> Result<f64> {
        let call = self.task.call;
        let (sets, turn) = (&self.sets, self.turn);
        self.turn += launches_of(options);
        median_graph_launch_us(gpu, options.batches, options.launches, |i| {
            let set = &sets[(turn + i) % sets.len()];
            let buffers = NormBuffers {
                x: &set.x,
                residual: set.residual.as_ref(),
                weight: self.weight.as_ref(),
                bias: self.bias.as_ref(),
                gate: self.gate.as_ref(),
                out: &set.out,
                scales: set.scales.as_ref(),
            };
            norm(gpu, &call, buffers, Some(variant))
        })
    }
}

// ---- LM head ----------------------------------------------------------------------------

struct LmHeadHarness {
    task: LmHeadTask,
    weights: Vec<DeviceMemory>,
    h: Vec<DeviceMemory>,
    logits: Vec<DeviceMemory>,
    want: Vec<f32>,
    /// The next input set (see [`NormHarness`]'s).
    turn: usize,
}

/// Random weights of `dtype`: floats in [-1, 1), or blocks with small positive scales (and
/// offsets for Q4_1) and random codes.
fn random_weights(rng: &mut Rng, dtype: DType, vocab: usize, hidden: usize) -> Result<Vec<u8>> {
    let elements = vocab * hidden;
    Ok(match dtype {
        DType::BF16 => {
            (0..elements).flat_map(|_| f32_to_bf16_bits(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect()
        }
        DType::F16 => {
            (0..elements).flat_map(|_| f32_to_f16_bits(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect()
        }
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
            let (block_bytes, header) = match dtype {
                DType::Q8_0 => (34, 2),
                DType::Q4_0 => (18, 2),
                _ => (20, 4),
            };
            let mut out = Vec::with_capacity(elements / QUANT_BLOCK * block_bytes);
            for _ in 0..elements / QUANT_BLOCK {
                out.extend_from_slice(&f32_to_f16_bits(rng.uniform(0.001, 0.05)).to_le_bytes());
                if header == 4 {
                    out.extend_from_slice(&f32_to_f16_bits(rng.uniform(-0.2, 0.2)).to_le_bytes());
                }
                out.extend((0..block_bytes - header).map(|_| rng.next() as u8));
            }
            out
        }
        other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "lm_head certification" }),
    })
}

/// Random LM head weights of `dtype` (see the certifier's inputs) from `seed`, for benchmarks.
pub fn random_lm_head_weights(seed: u64, dtype: DType, vocab: usize, hidden: usize) -> Result<Vec<u8>> {
    random_weights(&mut Rng(seed | 1), dtype, vocab, hidden)
}

impl LmHeadHarness {
    fn new(gpu: &Gpu, task: LmHeadTask, rng: &mut Rng) -> Result<LmHeadHarness> {
        let head = task.head;
        let rows = task.rows;
        let h: Vec<f32> = (0..rows * head.hidden).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let w = random_weights(rng, head.weight, head.vocab, head.hidden)?;
        if w.len() != head.vocab * row_bytes(head.weight, head.hidden)? {
            return Err(Error::ByteLength {
                what: "lm_head certification weights".into(),
                expected: (head.vocab * row_bytes(head.weight, head.hidden)?) as u64,
                got: w.len() as u64,
            });
        }
        let want = head.run(&h, &w, None)?.logits;
        let first = upload(gpu, &w)?;
        drop(w);
        // Copies of W at other addresses, so that together they exceed twice the L2 cache.
        let copies = rotation_sets(first.len_bytes(), gpu.facts().l2_cache_bytes).min(8);
        let mut weights = vec![first];
        for _ in 1..copies {
            let copy = gpu.alloc(weights[0].len_bytes())?;
            copy.copy_from_device(&weights[0])?;
            weights.push(copy);
        }
        let h_bytes: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
        let hs = (0..4).map(|_| upload(gpu, &h_bytes)).collect::<Result<Vec<_>>>()?;
        let logits = (0..4).map(|_| gpu.alloc(rows * head.vocab * 4)).collect::<Result<Vec<_>>>()?;
        Ok(LmHeadHarness { task, weights, h: hs, logits, want, turn: 0 })
    }
}

impl Harness for LmHeadHarness {
    type Config = LmHeadVariant;

    fn label(&self, config: LmHeadVariant) -> String {
        config.label()
    }

    fn check(&mut self, gpu: &Gpu, variant: LmHeadVariant, plant: bool) -> Result<Check> {
        let (head, rows) = (self.task.head, self.task.rows);
        let logits = poisoned(gpu, rows * head.vocab * 4, 0xFF)?;
        let buffers = LmHeadBuffers {
            h: &self.h[0],
            weights: &self.weights[0],
            row_scale: None,
            logits: &logits,
            stats: None,
        };
        lm_head(gpu, &head, rows, buffers, Some(variant))?;
        if plant {
            // The lowest bit of the middle logit.
            flip_byte(gpu, &logits, (rows * head.vocab / 2) * 4)?;
        }
        gpu.synchronize()?;
        let got = logits.to_host_bytes()?;
        let mut differing = 0usize;
        let mut first = None;
        for (i, (&w, chunk)) in self.want.iter().zip(got.chunks_exact(4)).enumerate() {
            let g = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            if !(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())) {
                differing += 1;
                first.get_or_insert((i, w, g));
            }
        }
        let wrong = first.map(|(i, w, g)| {
            format!("{differing} logits differ from the CPU reference, first at {i}: want {w:e}, got {g:e}")
        });
        Ok(Check { error: differing as f64, wrong })
    }

    fn time_us(&mut self, gpu: &Gpu, variant: LmHeadVariant, options: &CertifyOptions) -> Result<f64> {
        let (head, rows) = (self.task.head, self.task.rows);
        let (weights, h, logits) = (&self.weights, &self.h, &self.logits);
        let turn = self.turn;
        self.turn += launches_of(options);
        median_launch_us(gpu, options.batches, options.launches, |i| {
            let i = turn + i;
            let buffers = LmHeadBuffers {
                h: &h[i % h.len()],
                weights: &weights[i % weights.len()],
                row_scale: None,
                logits: &logits[i % logits.len()],
                stats: None,
            };
            lm_head(gpu, &head, rows, buffers, Some(variant))
        })
    }
}

// ---- attention --------------------------------------------------------------------------

/// A device copy of one batch of sequences over one cache.
struct AttentionCase {
    batches: Vec<PagedBatch>,
    q: DeviceMemory,
    k: DeviceMemory,
    v: DeviceMemory,
    pages: usize,
    out: DeviceMemory,
    total_queries: usize,
}

struct AttentionHarness {
    task: AttentionTask,
    check: AttentionCase,
    want: Vec<f64>,
    timing: AttentionCase,
    /// The next input set (see [`NormHarness`]'s).
    turn: usize,
}

/// bf16 values in [-amplitude, amplitude), as f32.
fn bf16_values(rng: &mut Rng, len: usize, amplitude: f32) -> Vec<f32> {
    (0..len).map(|_| bf16_bits_to_f32(f32_to_bf16_bits(rng.uniform(-amplitude, amplitude)))).collect()
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes()).collect()
}

/// A device buffer of `bytes` random bf16: a random block of at most 64 MiB, tiled.
fn random_device(gpu: &Gpu, rng: &mut Rng, bytes: usize) -> Result<DeviceMemory> {
    let block = bf16_bytes(&bf16_values(rng, bytes.min(64 << 20) / 2, 1.0));
    let memory = gpu.alloc(bytes.max(16))?;
    let mut offset = 0;
    while offset < bytes && !block.is_empty() {
        let n = block.len().min(bytes - offset);
        memory.copy_from_host(offset, &block[..n])?;
        offset += n;
    }
    Ok(memory)
}

impl AttentionHarness {
    fn new(gpu: &Gpu, task: AttentionTask, rng: &mut Rng) -> Result<AttentionHarness> {
        let shape = task.shape;
        let page_elements = shape.kv_heads * shape.page_tokens * shape.head_dim;
        // The check: a smaller instance of the same key. Prefill: a fresh prompt and a chunk after
        // cached positions; decode: the key's batch at ragged contexts.
        let sequences: Vec<(usize, usize)> = match task.phase {
            AttentionPhase::Prefill { .. } => {
                vec![(200 + rng.next() as usize % 100, 0), (100 + rng.next() as usize % 60, 150)]
                    .into_iter()
                    .map(|(q, cached)| (q, q + cached))
                    .collect()
            }
            AttentionPhase::Decode { batch, .. } => {
                let mut sequences: Vec<(usize, usize)> =
                    (0..batch).map(|_| (1, 1 + rng.next() as usize % 1500)).collect();
                // The long class's check: one sequence past the class boundary, so the
                // certified splits are proved over contexts of the class.
                if let (Some(DecodeClass::Long), Some(first)) = (task.decode_class(), sequences.first_mut()) {
                    first.1 = DECODE_SHORT_MAX + 1 + rng.next() as usize % 4096;
                }
                sequences
            }
        };
        let needed: usize = sequences.iter().map(|&(_, c)| c.div_ceil(shape.page_tokens)).sum();
        let pages = needed + 3;
        // Pages handed out in a shuffled order, so no page table is contiguous.
        let mut order: Vec<u32> = (0..pages as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
        let mut next = order.into_iter();
        let tables: Vec<Vec<u32>> = sequences
            .iter()
            .map(|&(_, c)| (0..c.div_ceil(shape.page_tokens)).filter_map(|_| next.next()).collect())
            .collect();
        let total_queries: usize = sequences.iter().map(|&(q, _)| q).sum();
        let q = bf16_values(rng, total_queries * shape.q_heads * shape.head_dim, 3.0);
        let k = bf16_values(rng, pages * page_elements, 1.0);
        let v = bf16_values(rng, pages * page_elements, 1.0);
        let refs: Vec<AttentionSequence<'_>> = sequences
            .iter()
            .zip(&tables)
            .map(|(&(query_tokens, context_tokens), pages)| AttentionSequence {
                query_tokens,
                context_tokens,
                pages,
            })
            .collect();
        let want = paged_attention(&shape, &q, &k, &v, &refs)?;
        let check = AttentionCase {
            batches: vec![PagedBatch::upload(gpu, &shape, &refs, pages)?],
            q: upload(gpu, &bf16_bytes(&q))?,
            k: upload(gpu, &bf16_bytes(&k))?,
            v: upload(gpu, &bf16_bytes(&v))?,
            pages,
            out: gpu.alloc(q.len() * 2)?,
            total_queries,
        };

        // The timed instance: contiguous page tables, rotated over sets that exceed twice L2.
        let (batch, query_tokens, context) = match task.phase {
            AttentionPhase::Prefill { tokens } => (1, tokens, tokens),
            AttentionPhase::Decode { batch, context } => (batch, 1, context),
        };
        let pages_per_sequence = context.div_ceil(shape.page_tokens);
        let set_bytes = batch * pages_per_sequence * page_elements * 2 * 2;
        let rotations = rotation_sets(set_bytes, gpu.facts().l2_cache_bytes).min(64);
        let total_pages = pages_per_sequence * batch * rotations;
        let tables: Vec<Vec<u32>> = (0..batch * rotations)
            .map(|s| {
                let first = (s * pages_per_sequence) as u32;
                (first..first + pages_per_sequence as u32).collect()
            })
            .collect();
        let batches = tables
            .chunks(batch)
            .map(|group| {
                let sequences: Vec<AttentionSequence<'_>> = group
                    .iter()
                    .map(|pages| AttentionSequence { query_tokens, context_tokens: context, pages })
                    .collect();
                PagedBatch::upload(gpu, &shape, &sequences, total_pages)
            })
            .collect::<Result<Vec<_>>>()?;
        let q_bytes = batch * query_tokens * shape.q_heads * shape.head_dim * 2;
        let cache_bytes = total_pages * page_elements * 2;
        let timing = AttentionCase {
            batches,
            q: random_device(gpu, rng, q_bytes)?,
            k: random_device(gpu, rng, cache_bytes)?,
            v: random_device(gpu, rng, cache_bytes)?,
            pages: total_pages,
            out: gpu.alloc(q_bytes)?,
            total_queries: batch * query_tokens,
        };
        Ok(AttentionHarness { task, check, want, timing, turn: 0 })
    }
}

/// Runs `config` over `case`'s batch `turn` (scratch allocated for its splits).
fn run_attention(
    gpu: &Gpu,
    shape: &AttentionShape,
    case: &AttentionCase,
    scratch: &DeviceMemory,
    turn: usize,
    config: AttentionConfig,
) -> Result<()> {
    let cache = KvBuffers { k: &case.k, v: &case.v, pages: case.pages, scales: None };
    attention(
        gpu,
        shape,
        &case.batches[turn % case.batches.len()],
        &case.q,
        cache,
        &case.out,
        Some(scratch),
        config.splits,
        Some(config.variant),
    )
}

impl Harness for AttentionHarness {
    type Config = AttentionConfig;

    fn label(&self, config: AttentionConfig) -> String {
        config.label()
    }

    fn check(&mut self, gpu: &Gpu, config: AttentionConfig, plant: bool) -> Result<Check> {
        let shape = self.task.shape;
        let case = &self.check;
        case.out.fill_bytes(0xFF)?; // bf16 NaN
        let scratch = poisoned(gpu, scratch_bytes(&shape, case.total_queries, config.splits), 0xFF)?;
        run_attention(gpu, &shape, case, &scratch, 0, config)?;
        if plant {
            // The middle element, one away from what the kernel wrote.
            gpu.synchronize()?;
            let at = self.want.len() / 2 * 2;
            let mut bits = [0u8; 2];
            case.out.copy_to_host(at, &mut bits)?;
            let wrong = bf16_bits_to_f32(u16::from_le_bytes(bits)) + 1.0;
            case.out.copy_from_host(at, &f32_to_bf16_bits(wrong).to_le_bytes())?;
        }
        gpu.synchronize()?;
        let got = case.out.to_host_bytes()?;
        let (mut error, mut norm, mut worst) = (0f64, 0f64, 0f64);
        let mut not_finite = None;
        for (i, (chunk, &w)) in got.chunks_exact(2).zip(&self.want).enumerate() {
            let g = f64::from(bf16_bits_to_f32(u16::from_le_bytes([chunk[0], chunk[1]])));
            if !g.is_finite() {
                not_finite.get_or_insert(i);
                worst = f64::INFINITY;
                continue;
            }
            error += (g - w) * (g - w);
            norm += w * w;
            worst = worst.max((g - w).abs());
        }
        let relative = (error / norm.max(1e-300)).sqrt();
        let wrong = if let Some(i) = not_finite {
            Some(format!("element {i} is not finite (unwritten or NaN)"))
        } else if relative >= 1e-2 || worst >= 0.05 {
            Some(format!(
                "relative L2 error {relative:.3e} (limit 1e-2), worst element off by {worst:.3e} (limit 0.05)"
            ))
        } else {
            None
        };
        Ok(Check { error: worst, wrong })
    }

    fn time_us(&mut self, gpu: &Gpu, config: AttentionConfig, options: &CertifyOptions) -> Result<f64> {
        let shape = self.task.shape;
        let case = &self.timing;
        let scratch = gpu.alloc(scratch_bytes(&shape, case.total_queries, config.splits).max(16))?;
        let turn = self.turn;
        match self.task.phase {
            // Prefill launches are long: a batch is one launch.
            AttentionPhase::Prefill { .. } => {
                self.turn += launches_of(&CertifyOptions { launches: 1, ..options.clone() });
                median_launch_us(gpu, options.batches, 1, |i| {
                    run_attention(gpu, &shape, case, &scratch, turn + i, config)
                })
            }
            // A decode launch takes microseconds, and the engine replays it in its captured step:
            // timed as graph replays (no host launch cost) over every rotated page table, so the
            // batch's reads exceed the L2 cache as they do at the key's context.
            AttentionPhase::Decode { .. } => {
                let launches = case.batches.len().max(1);
                self.turn += launches_of(&CertifyOptions { launches, ..options.clone() });
                median_graph_launch_us(gpu, options.batches, launches, |i| {
                    run_attention(gpu, &shape, case, &scratch, turn + i, config)
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
