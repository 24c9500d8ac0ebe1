//! The registry of every kernel source. A kernel family adds its entry to [`ALL`]; the compile
//! check (`tests/kernels_compile.rs`) compiles each for every supported architecture and each of
//! its define sets, and fails on an error, a warning, or a register spill.

use crate::compile::KernelSource;

/// Conversions between f32 and bf16, fp16, fp8 (bit-exact with the CPU reference).
pub const CONVERT: KernelSource = KernelSource {
    name: "convert",
    source: include_str!("../kernels/convert.cu"),
    define_sets: &[&[]],
    fmad: false,
};

/// Streaming 16-byte copy and a 32-bit fill.
pub const COPY: KernelSource = KernelSource {
    name: "copy",
    source: include_str!("../kernels/copy.cu"),
    define_sets: &[&[], &[("UNROLL", "1")], &[("UNROLL", "8")]],
    fmad: true,
};

/// The norm family (RMSNorm, LayerNorm, residual, gates, groups, quantized outputs); its
/// determinism primitives (`deterministic.cuh`) are prepended.
pub const NORM: KernelSource = KernelSource {
    name: "norm",
    source: concat!(include_str!("../kernels/deterministic.cuh"), include_str!("../kernels/norm.cu")),
    define_sets: &[
        &[
            ("KIND", "0"),
            ("X_T", "2"),
            ("W_T", "2"),
            ("OUT_T", "2"),
            ("WEIGHT", "0"),
            ("HAS_BIAS", "0"),
            ("HAS_RESIDUAL", "1"),
            ("HF_ROUNDING", "1"),
            ("GATE", "0"),
            ("WARPS_PER_ROW", "1"),
            ("ROWS_PER_BLOCK", "4"),
            ("UNITS_PER_WARP", "16"),
            ("EARLY_WEIGHT", "0"),
            ("PERSISTENT", "0"),
        ],
        &[
            ("KIND", "1"),
            ("X_T", "0"),
            ("W_T", "1"),
            ("OUT_T", "4"),
            ("WEIGHT", "1"),
            ("HAS_BIAS", "1"),
            ("HAS_RESIDUAL", "1"),
            ("HF_ROUNDING", "0"),
            ("GATE", "0"),
            ("WARPS_PER_ROW", "4"),
            ("ROWS_PER_BLOCK", "1"),
            ("UNITS_PER_WARP", "4"),
            ("EARLY_WEIGHT", "1"),
            ("PERSISTENT", "1"),
        ],
        &[
            ("KIND", "0"),
            ("X_T", "1"),
            ("W_T", "0"),
            ("OUT_T", "3"),
            ("WEIGHT", "0"),
            ("HAS_BIAS", "0"),
            ("HAS_RESIDUAL", "0"),
            ("HF_ROUNDING", "1"),
            ("GATE", "1"),
            ("WARPS_PER_ROW", "8"),
            ("ROWS_PER_BLOCK", "1"),
            ("UNITS_PER_WARP", "2"),
            ("EARLY_WEIGHT", "0"),
            ("PERSISTENT", "0"),
        ],
        &[
            ("KIND", "0"),
            ("X_T", "2"),
            ("W_T", "2"),
            ("OUT_T", "5"),
            ("WEIGHT", "2"),
            ("HAS_BIAS", "0"),
            ("HAS_RESIDUAL", "0"),
            ("HF_ROUNDING", "0"),
            ("GATE", "2"),
            ("WARPS_PER_ROW", "2"),
            ("ROWS_PER_BLOCK", "2"),
            ("UNITS_PER_WARP", "1"),
            ("EARLY_WEIGHT", "0"),
            ("PERSISTENT", "1"),
        ],
    ],
    fmad: false,
};

/// RoPE on q and k in place (half-split / interleaved, partial rotary dim, positions and the cos /
/// sin table in device memory), optionally after Qwen3's per-head q/k RMSNorm; its determinism
/// primitives (`deterministic.cuh`) are prepended.
pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    source: concat!(include_str!("../kernels/deterministic.cuh"), include_str!("../kernels/rope.cu")),
    define_sets: &[
        &[
            ("X_T", "2"),
            ("W_T", "2"),
            ("LAYOUT", "0"),
            ("QK_NORM", "1"),
            ("LANES_PER_HEAD", "16"),
            ("HEADS_PER_BLOCK", "8"),
            ("UNITS", "1"),
        ],
        &[
            ("X_T", "1"),
            ("W_T", "0"),
            ("LAYOUT", "1"),
            ("QK_NORM", "0"),
            ("LANES_PER_HEAD", "8"),
            ("HEADS_PER_BLOCK", "16"),
            ("UNITS", "1"),
        ],
        &[
            ("X_T", "0"),
            ("W_T", "1"),
            ("LAYOUT", "0"),
            ("QK_NORM", "1"),
            ("LANES_PER_HEAD", "32"),
            ("HEADS_PER_BLOCK", "4"),
            ("UNITS", "4"),
        ],
        &[
            ("X_T", "2"),
            ("W_T", "2"),
            ("LAYOUT", "1"),
            ("QK_NORM", "1"),
            ("LANES_PER_HEAD", "32"),
            ("HEADS_PER_BLOCK", "1"),
            ("UNITS", "2"),
        ],
    ],
    fmad: false,
};

/// Embedding lookup (bf16 / fp16 / fp32 / Q8_0 tables, out-of-vocabulary flag, row sums of squares
/// in the norm's units); its determinism primitives (`deterministic.cuh`) are prepended.
pub const EMBEDDING: KernelSource = KernelSource {
    name: "embedding",
    source: concat!(include_str!("../kernels/deterministic.cuh"), include_str!("../kernels/embedding.cu")),
    define_sets: &[
        &[
            ("TABLE_T", "2"),
            ("OUT_T", "0"),
            ("SUM_SQUARES", "1"),
            ("WARPS_PER_ROW", "1"),
            ("ROWS_PER_BLOCK", "4"),
        ],
        &[
            ("TABLE_T", "3"),
            ("OUT_T", "2"),
            ("SUM_SQUARES", "1"),
            ("WARPS_PER_ROW", "4"),
            ("ROWS_PER_BLOCK", "2"),
        ],
        &[
            ("TABLE_T", "0"),
            ("OUT_T", "1"),
            ("SUM_SQUARES", "0"),
            ("WARPS_PER_ROW", "8"),
            ("ROWS_PER_BLOCK", "1"),
        ],
        &[
            ("TABLE_T", "1"),
            ("OUT_T", "1"),
            ("SUM_SQUARES", "1"),
            ("WARPS_PER_ROW", "16"),
            ("ROWS_PER_BLOCK", "1"),
        ],
    ],
    fmad: false,
};

/// The LM head (`logits = h W^T` for 1..8 rows, bf16 / fp16 / Q8_0 / Q4_0 / Q4_1 weights, scales,
/// soft-capping, block argmax); its determinism primitives (`deterministic.cuh`) are prepended.
pub const LM_HEAD: KernelSource = KernelSource {
    name: "lm_head",
    source: concat!(include_str!("../kernels/deterministic.cuh"), include_str!("../kernels/lm_head.cu")),
    define_sets: &[
        &[
            ("ROWS", "1"),
            ("W_T", "0"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "8"),
            ("W_T", "0"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "1"),
            ("SOFT_CAP", "1"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "3"),
            ("W_T", "1"),
            ("WARPS", "16"),
            ("VROWS", "8"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "1"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "2"),
            ("W_T", "2"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "1"),
            ("SOFT_CAP", "0"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "5"),
            ("W_T", "3"),
            ("WARPS", "4"),
            ("VROWS", "2"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "4"),
            ("W_T", "4"),
            ("WARPS", "8"),
            ("VROWS", "8"),
            ("XSLOT", "0"),
            ("PIPE", "0"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "8"),
            ("W_T", "0"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "1"),
            ("SOFT_CAP", "1"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "4"),
            ("W_T", "0"),
            ("WARPS", "8"),
            ("VROWS", "8"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "8"),
            ("W_T", "0"),
            ("WARPS", "4"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "1"),
            ("W_T", "0"),
            ("WARPS", "16"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "2"),
            ("W_T", "0"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "3"),
            ("W_T", "2"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "1"),
            ("SOFT_CAP", "1"),
            ("STATS", "1"),
        ],
        &[
            ("ROWS", "8"),
            ("W_T", "4"),
            ("WARPS", "8"),
            ("VROWS", "4"),
            ("XSLOT", "1"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "1"),
            ("STATS", "0"),
        ],
        &[
            ("ROWS", "5"),
            ("W_T", "1"),
            ("WARPS", "16"),
            ("VROWS", "4"),
            ("XSLOT", "0"),
            ("PIPE", "1"),
            ("ROW_SCALE", "0"),
            ("SOFT_CAP", "0"),
            ("STATS", "1"),
        ],
    ],
    fmad: false,
};

/// Causal GQA attention over the paged KV cache (prefill and split decode), the combine of the
/// splits, and the K/V append. Defines: `HEAD_DIM`, `WARPS_M`, `WARPS_N`, `WARP_KEYS`.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    source: include_str!("../kernels/attention.cu"),
    define_sets: &[
        &[("HEAD_DIM", "128"), ("WARPS_M", "4"), ("WARPS_N", "1"), ("WARP_KEYS", "64")],
        &[("HEAD_DIM", "64"), ("WARPS_M", "4"), ("WARPS_N", "1"), ("WARP_KEYS", "64")],
        &[("HEAD_DIM", "128"), ("WARPS_M", "8"), ("WARPS_N", "1"), ("WARP_KEYS", "64")],
        &[("HEAD_DIM", "128"), ("WARPS_M", "1"), ("WARPS_N", "4"), ("WARP_KEYS", "16")],
        &[("HEAD_DIM", "64"), ("WARPS_M", "1"), ("WARPS_N", "4"), ("WARP_KEYS", "16")],
        &[("HEAD_DIM", "128"), ("WARPS_M", "1"), ("WARPS_N", "4"), ("WARP_KEYS", "32")],
    ],
    fmad: true,
};

/// The sampler (penalties, temperature, top-k / top-p by radix selection, min-p, Philox draw in
/// fixed point); its determinism primitives (`deterministic.cuh`) are prepended.
pub const SAMPLE: KernelSource = KernelSource {
    name: "sample",
    source: concat!(include_str!("../kernels/deterministic.cuh"), include_str!("../kernels/sample.cu")),
    define_sets: &[&[("THREADS", "1024"), ("PENALTIES", "1")], &[("THREADS", "256"), ("PENALTIES", "0")]],
    fmad: false,
};

/// The glue of a transformer block between its matrix products: q/k norm + RoPE + the write of
/// k and v into the paged cache, SwiGLU, 16-bit conversions, a bias add, a row gather. Defines:
/// `FWD_WARPS` (warps a block of `kiln_qkv_prepare`), `FWD_MAX_HEAD_DIM`.
pub const FORWARD: KernelSource = KernelSource {
    name: "forward",
    source: include_str!("../kernels/forward.cu"),
    define_sets: &[&[("FWD_WARPS", "4"), ("FWD_MAX_HEAD_DIM", "256")]],
    fmad: false,
};

/// The decode-side linear layer (1..8 tokens, f32 / bf16 / f16 / Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K
/// weights dequantized in registers, store / residual-add / SwiGLU epilogues), the embedding-row
/// gather, weights to bf16 and fp32 -> bf16. Defines: `W_T`, `X_T`, `TOKENS`, `EPI`, `HAS_BIAS`,
/// `WARPS`, `ROWS`, `UNROLL`.
pub const LINEAR: KernelSource = KernelSource {
    name: "linear",
    source: include_str!("../kernels/linear.cu"),
    define_sets: &[
        &[
            ("W_T", "0"),
            ("X_T", "0"),
            ("TOKENS", "1"),
            ("EPI", "0"),
            ("HAS_BIAS", "1"),
            ("WARPS", "4"),
            ("ROWS", "1"),
            ("UNROLL", "4"),
        ],
        &[
            ("W_T", "1"),
            ("X_T", "1"),
            ("TOKENS", "1"),
            ("EPI", "2"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "1"),
            ("UNROLL", "2"),
        ],
        &[
            ("W_T", "2"),
            ("X_T", "0"),
            ("TOKENS", "1"),
            ("EPI", "1"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "1"),
            ("UNROLL", "4"),
        ],
        &[
            ("W_T", "2"),
            ("X_T", "0"),
            ("TOKENS", "8"),
            ("EPI", "2"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "2"),
            ("UNROLL", "1"),
        ],
        &[
            ("W_T", "3"),
            ("X_T", "0"),
            ("TOKENS", "4"),
            ("EPI", "0"),
            ("HAS_BIAS", "1"),
            ("WARPS", "2"),
            ("ROWS", "2"),
            ("UNROLL", "2"),
        ],
        &[
            ("W_T", "4"),
            ("X_T", "1"),
            ("TOKENS", "1"),
            ("EPI", "2"),
            ("HAS_BIAS", "0"),
            ("WARPS", "1"),
            ("ROWS", "1"),
            ("UNROLL", "4"),
        ],
        &[
            ("W_T", "5"),
            ("X_T", "0"),
            ("TOKENS", "8"),
            ("EPI", "1"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "4"),
            ("UNROLL", "1"),
        ],
        &[
            ("W_T", "6"),
            ("X_T", "0"),
            ("TOKENS", "2"),
            ("EPI", "0"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "1"),
            ("UNROLL", "2"),
        ],
        &[
            ("W_T", "7"),
            ("X_T", "1"),
            ("TOKENS", "1"),
            ("EPI", "2"),
            ("HAS_BIAS", "0"),
            ("WARPS", "4"),
            ("ROWS", "1"),
            ("UNROLL", "2"),
        ],
        &[
            ("W_T", "7"),
            ("X_T", "0"),
            ("TOKENS", "8"),
            ("EPI", "1"),
            ("HAS_BIAS", "1"),
            ("WARPS", "4"),
            ("ROWS", "4"),
            ("UNROLL", "1"),
        ],
    ],
    fmad: true,
};

/// Every kernel source of Kiln.
pub const ALL: &[KernelSource] =
    &[CONVERT, COPY, NORM, ROPE, EMBEDDING, LM_HEAD, ATTENTION, SAMPLE, FORWARD, LINEAR];
