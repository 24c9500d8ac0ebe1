//! Launchers of `kernels/forward.cu`: the glue of a transformer block between its matrix products
//! (see the kernel file). Buffers are [`DeviceView`]s into memory the engine owns (the weight
//! arena, the activation slab, the KV pages); each launcher checks every length it relies on.

use cudarc::driver::LaunchConfig;
use kiln_core::{DType, Error, Result};

use crate::kernels::FORWARD;
use crate::memory::DeviceView;
use crate::runtime::{driver_error, Gpu};

/// Warps of a `kiln_qkv_prepare` block, one (token, head) each.
const WARPS: usize = 4;
/// The largest head the kernel's shared rows hold.
pub const MAX_HEAD_DIM: usize = 256;

fn function(gpu: &Gpu, entry: &str) -> Result<cudarc::driver::CudaFunction> {
    gpu.function(&FORWARD, entry, &[("FWD_WARPS", "4"), ("FWD_MAX_HEAD_DIM", "256")])
}

fn check(what: &str, view: DeviceView, want: usize) -> Result<()> {
    super::check_buffer("forward", what, view.len_bytes, want)
}

fn i32_of(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::NotServed {
        op: "forward kernels",
        reason: format!("{what} {value} does not fit in 31 bits"),
    })
}

/// The output code of a float type: 0 fp32, 1 fp16, 2 bf16.
fn type_code(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => Err(Error::DTypeNotServed { dtype: other.name(), op: "forward kernels output" }),
    }
}

fn elementwise_config(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The shape of the attention input of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkvShape {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Leading elements of each head that rotate (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// GPT-J pairs `(2i, 2i + 1)` instead of NeoX halves `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
    /// Positions the cos/sin tables hold.
    pub table_positions: usize,
    /// Positions per cache page (a power of two).
    pub page_tokens: usize,
    /// Pages each of the caches holds.
    pub cache_pages: usize,
    pub eps: f32,
}

/// The buffers of [`qkv_prepare`].
#[derive(Debug, Clone, Copy)]
pub struct QkvBuffers {
    /// fp32 `[tokens][(heads + 2 kv_heads) * head_dim]`.
    pub qkv: DeviceView,
    /// fp32 `[head_dim]` each, for Qwen3's per-head RMSNorm (both or neither).
    pub q_norm: Option<DeviceView>,
    pub k_norm: Option<DeviceView>,
    /// fp32 `[table_positions][rotary_dim / 2]` each.
    pub cos: DeviceView,
    pub sin: DeviceView,
    /// i32 `[tokens]`, each below `table_positions` (the caller's contract: read on the device).
    pub positions: DeviceView,
    /// u32 `[tokens]`, each below `cache_pages * page_tokens` (the caller's contract).
    pub slots: DeviceView,
    /// bf16 `[tokens][heads][head_dim]`.
    pub q_out: DeviceView,
    /// bf16 `[page][kv_head][slot][head_dim]` each.
    pub k_cache: DeviceView,
    pub v_cache: DeviceView,
}

/// q/k RMSNorm per head, RoPE at each token's position, q to bf16, k and v into the cache.
pub fn qkv_prepare(gpu: &Gpu, shape: &QkvShape, b: QkvBuffers) -> Result<()> {
    let s = shape;
    if s.head_dim == 0
        || s.head_dim > MAX_HEAD_DIM
        || s.rotary_dim > s.head_dim
        || !s.rotary_dim.is_multiple_of(2)
    {
        return Err(Error::NotServed {
            op: "qkv_prepare kernel",
            reason: format!("head_dim {} with rotary_dim {}", s.head_dim, s.rotary_dim),
        });
    }
    if !s.page_tokens.is_power_of_two() || s.heads == 0 || s.kv_heads == 0 {
        return Err(Error::InvalidArgument {
            name: "qkv shape",
            value: format!("{s:?}"),
            reason: "page_tokens must be a power of two and the head counts nonzero".into(),
        });
    }
    if b.q_norm.is_some() != b.k_norm.is_some() {
        return Err(Error::InvalidArgument {
            name: "q_norm / k_norm",
            value: "one of them".into(),
            reason: "the per-head norm needs both weights".into(),
        });
    }
    let all_heads = s.heads + 2 * s.kv_heads;
    check("qkv", b.qkv, s.tokens * all_heads * s.head_dim * 4)?;
    if let (Some(q), Some(k)) = (b.q_norm, b.k_norm) {
        check("q_norm", q, s.head_dim * 4)?;
        check("k_norm", k, s.head_dim * 4)?;
    }
    check("cos", b.cos, s.table_positions * s.rotary_dim / 2 * 4)?;
    check("sin", b.sin, s.table_positions * s.rotary_dim / 2 * 4)?;
    check("positions", b.positions, s.tokens * 4)?;
    check("slots", b.slots, s.tokens * 4)?;
    check("q_out", b.q_out, s.tokens * s.heads * s.head_dim * 2)?;
    let cache_bytes = s.cache_pages * s.kv_heads * s.page_tokens * s.head_dim * 2;
    check("k_cache", b.k_cache, cache_bytes)?;
    check("v_cache", b.v_cache, cache_bytes)?;
    if s.tokens == 0 {
        return Ok(());
    }
    if s.tokens > 65_535 {
        return Err(Error::NotServed { op: "qkv_prepare kernel", reason: format!("{} tokens", s.tokens) });
    }
    let kernel = function(gpu, "kiln_qkv_prepare")?;
    let config = LaunchConfig {
        grid_dim: (all_heads.div_ceil(WARPS) as u32, s.tokens as u32, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (q_norm, k_norm) = (b.q_norm.map_or(0, |v| v.ptr), b.k_norm.map_or(0, |v| v.ptr));
    let ints = [
        i32_of("rotary_dim", s.rotary_dim)?,
        i32::from(s.interleaved),
        i32_of("tokens", s.tokens)?,
        i32_of("heads", s.heads)?,
        i32_of("kv_heads", s.kv_heads)?,
        i32_of("head_dim", s.head_dim)?,
        s.page_tokens.trailing_zeros() as i32,
    ];
    let mut launch = gpu.launch_builder(&kernel);
    launch.arg(&b.qkv.ptr).arg(&q_norm).arg(&k_norm).arg(&s.eps).arg(&b.cos.ptr).arg(&b.sin.ptr);
    launch.arg(&ints[0]).arg(&ints[1]).arg(&b.positions.ptr).arg(&b.slots.ptr);
    launch.arg(&b.q_out.ptr).arg(&b.k_cache.ptr).arg(&b.v_cache.ptr);
    for value in &ints[2..] {
        launch.arg(value);
    }
    // SAFETY: the arguments match `kiln_qkv_prepare` (3 pointers, f32, 2 pointers, 2 i32, 5
    // pointers, 5 i32); every buffer was checked above to hold what the grid touches, given the
    // caller's contract that positions lie below `table_positions` and slots inside the caches;
    // the views' owners outlive the stream's work (the engine keeps them for the model's life).
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_qkv_prepare)", e))?;
    Ok(())
}

/// `out[t][i] = silu(gate_up[t][i]) * gate_up[t][width + i]`, written as `out_type`.
pub fn swiglu(
    gpu: &Gpu,
    gate_up: DeviceView,
    tokens: usize,
    width: usize,
    out: DeviceView,
    out_type: DType,
) -> Result<()> {
    let code = type_code(out_type)?;
    check("gate_up", gate_up, tokens * width * 2 * 4)?;
    check("swiglu out", out, tokens * width * out_type.bytes_for(1)? as usize)?;
    if tokens * width == 0 {
        return Ok(());
    }
    let kernel = function(gpu, "kiln_swiglu")?;
    let (t, w) = (tokens as u64, width as u64);
    let mut launch = gpu.launch_builder(&kernel);
    launch.arg(&gate_up.ptr).arg(&out.ptr).arg(&t).arg(&w).arg(&code);
    // SAFETY: matches `kiln_swiglu(const float*, void*, u64, u64, int)`; both buffers were checked
    // to hold `tokens * width` outputs and twice as many inputs.
    unsafe { launch.launch(elementwise_config(tokens * width)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_swiglu)", e))?;
    Ok(())
}

/// bf16 -> fp16 of `count` values.
pub fn bf16_to_f16(gpu: &Gpu, src: DeviceView, count: usize, out: DeviceView) -> Result<()> {
    check("bf16 source", src, count * 2)?;
    check("fp16 out", out, count * 2)?;
    if count == 0 {
        return Ok(());
    }
    let kernel = function(gpu, "kiln_bf16_to_f16")?;
    let n = count as u64;
    let mut launch = gpu.launch_builder(&kernel);
    launch.arg(&src.ptr).arg(&out.ptr).arg(&n);
    // SAFETY: matches `kiln_bf16_to_f16(const u16*, u16*, u64)`; both hold `count` values.
    unsafe { launch.launch(elementwise_config(count)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_bf16_to_f16)", e))?;
    Ok(())
}

/// `x[t][i] += bias[i]` for fp32 `x` `[tokens][width]`.
pub fn add_bias(gpu: &Gpu, x: DeviceView, bias: DeviceView, tokens: usize, width: usize) -> Result<()> {
    check("x", x, tokens * width * 4)?;
    check("bias", bias, width * 4)?;
    if tokens * width == 0 {
        return Ok(());
    }
    let kernel = function(gpu, "kiln_add_bias")?;
    let (t, w) = (tokens as u64, width as u64);
    let mut launch = gpu.launch_builder(&kernel);
    launch.arg(&x.ptr).arg(&bias.ptr).arg(&t).arg(&w);
    // SAFETY: matches `kiln_add_bias(float*, const float*, u64, u64)`; lengths checked above.
    unsafe { launch.launch(elementwise_config(tokens * width)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_add_bias)", e))?;
    Ok(())
}

/// `out[r] = src[rows[r]]` for `count` fp32 rows of `width`; `rows` (i32, on the device) must
/// lie below `src_rows` (the caller's contract).
pub fn gather_rows(
    gpu: &Gpu,
    src: DeviceView,
    src_rows: usize,
    rows: DeviceView,
    count: usize,
    width: usize,
    out: DeviceView,
) -> Result<()> {
    check("gather source", src, src_rows * width * 4)?;
    check("gather rows", rows, count * 4)?;
    check("gather out", out, count * width * 4)?;
    if count * width == 0 {
        return Ok(());
    }
    let kernel = function(gpu, "kiln_gather_rows")?;
    let (c, w) = (i32_of("rows", count)?, width as u64);
    let mut launch = gpu.launch_builder(&kernel);
    launch.arg(&src.ptr).arg(&rows.ptr).arg(&c).arg(&w).arg(&out.ptr);
    // SAFETY: matches `kiln_gather_rows(const float*, const int*, int, u64, float*)`; lengths
    // checked above, row indices bounded by the caller's contract.
    unsafe { launch.launch(elementwise_config(count * width)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_gather_rows)", e))?;
    Ok(())
}
