//! Launcher of `kernels/linear.cu` and `kernels/linear_i8.cu`: the decode-side linear layer (a
//! matrix-vector product for 1 to 8 tokens over f32, bf16, f16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
//! Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS
//! weights, with a store, residual-add or SwiGLU epilogue), the gather of embedding rows, the
//! conversion of weights to bf16 for the prefill path, and fp32 -> bf16.
//!
//! Buffers are [`DeviceView`]s, row-major: the weights `rows` (2 x `rows` for SwiGLU: gate rows,
//! then up rows) rows of `dtype.bytes_for(cols)` bytes, 16-byte aligned at the start; x `tokens x
//! cols` of the input dtype, 16-byte aligned; out `tokens x rows` fp32; bias `rows` fp32.
//!
//! The products accumulate in fp32 in an order fixed by the variant and the shape (no atomics): a
//! run repeats bit for bit; against a float64 reference the error stays within a few units of
//! fp32 rounding of `sum |w| |x|`. The dequantized values equal `dequantize_row` of the CPU
//! reference bit for bit, so [`embed_rows`] and [`to_bf16_weights`] are exact.
//!
//! The integer-path variants ([`INT8_VARIANTS`], `kernels/linear_i8.cu`; Q8_0, Q4_0 and Q4_1
//! with columns a multiple of 128, the default there) first write x as 16-bit fixed point per
//! block of 32 values in two int8 planes into a scratch (x ~ d (254 q1 + q2), at most amax / 64516
//! of its block off), then sum exact dp4a products scaled once per block: the error bound is that
//! rounding of x times the weights' integer parts, plus fp32 rounding of the block sums. A
//! token's sums do not depend on the other tokens of the call. At one token the product kernel
//! is pipelined by default ([`INT8_PIPE_ENV`]): a persistent grid whose warps keep two rounds of
//! weights in flight, summing every row in the same order (the same bits).
//!
//! The `/mma` variants (BF16 and F16 weights, 2 to 8 tokens) run the products on the tensor
//! cores: f32 x is split into 16-bit parts that sum to it (three bf16 parts, or two f16 parts of
//! x scaled by a power of two per token and 32 columns: within 2^-22 |x|), the products are
//! exact and each 32-column step's sums are added in fp32, so the same bound holds.

use cudarc::driver::LaunchConfig;
use kiln_core::{DType, Error, Result};

use crate::kernels::{LINEAR, LINEAR_I8};
use crate::memory::DeviceView;
use crate::runtime::{driver_error, Gpu};

/// Most tokens one [`linear`] call serves.
pub const MAX_TOKENS: usize = 8;

/// What happens to a sum `acc` (the dot product plus the bias) at the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `out = acc`.
    Store,
    /// `out += acc` (the residual add).
    Accumulate,
    /// `out = silu(acc_gate) * acc_up`: the weight holds `2 x rows` rows, gate rows then up rows;
    /// no bias.
    SwiGlu,
}

impl Epilogue {
    fn code(self) -> u32 {
        match self {
            Epilogue::Store => 0,
            Epilogue::Accumulate => 1,
            Epilogue::SwiGlu => 2,
        }
    }

    /// Weight rows per output row.
    pub fn weight_rows_per_output(self) -> usize {
        if self == Epilogue::SwiGlu {
            2
        } else {
            1
        }
    }
}

/// The shape and types of one linear call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinearCall {
    /// One of [`WEIGHT_DTYPES`].
    pub weight: DType,
    /// Outputs per token (for SwiGlu the weight holds `2 x rows` rows).
    pub rows: usize,
    /// Inputs per token.
    pub cols: usize,
    /// 1..=8.
    pub tokens: usize,
    /// x's dtype: F32 or BF16.
    pub input: DType,
    pub epilogue: Epilogue,
}

/// One shape of the kernel: warps per block (splitting a row's columns), output rows per block
/// (their weight rows share each load of x), pieces of a row each thread loads before it decodes
/// any (loads in flight per thread: `unroll x rows`, twice that for SwiGLU), and where x comes
/// from: read from global memory by each thread, or staged once per block in shared memory
/// (transposed so that a warp's reads are consecutive: the quantized formats' pieces span 64 to
/// 128 bytes of x, so direct reads touch one cache line per thread).
///
/// `mma` variants take the products to the tensor cores (`mma.m16n8k16`, fp32 accumulation, x
/// split into 16-bit parts that sum to it): only for BF16 and F16 weights at 2 to 8 tokens, with
/// 16 or 32 rows a block and `unroll` 32-column steps of 16 rows per warp in flight;
/// [`LinearCall::defines`] refuses them for other calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinearVariant {
    pub warps: u32,
    pub rows: u32,
    pub unroll: u32,
    pub stage_x: bool,
    pub mma: bool,
    /// The integer path (`kernels/linear_i8.cu`, Q8_0 / Q4_0 / Q4_1 weights, columns a multiple
    /// of 128): x as 16-bit fixed point in two int8 planes per block of 32, products on dp4a.
    /// There `warps` is the block's
    /// warps, `rows` the output rows a lane carries and `unroll` the 128-value units of each
    /// weight row a lane loads before using any.
    pub int8: bool,
}

const fn variant(warps: u32, rows: u32, unroll: u32) -> LinearVariant {
    LinearVariant { warps, rows, unroll, stage_x: false, mma: false, int8: false }
}

const fn staged(warps: u32, rows: u32, unroll: u32) -> LinearVariant {
    LinearVariant { warps, rows, unroll, stage_x: true, mma: false, int8: false }
}

const fn tensor_core(warps: u32, rows: u32, unroll: u32) -> LinearVariant {
    LinearVariant { warps, rows, unroll, stage_x: false, mma: true, int8: false }
}

const fn integer(warps: u32, rows: u32, unroll: u32) -> LinearVariant {
    LinearVariant { warps, rows, unroll, stage_x: false, mma: false, int8: true }
}

/// The integer-path variants (Q8_0, Q4_0, Q4_1 with columns a multiple of 128), as data: the
/// tests run every one against their own error bound (x's fixed-point rounding), the benchmark times
/// every one.
pub const INT8_VARIANTS: &[LinearVariant] = &[
    integer(4, 1, 1),
    integer(4, 2, 1),
    integer(4, 4, 1),
    integer(4, 1, 2),
    integer(4, 1, 4),
    integer(8, 1, 1),
    integer(8, 2, 1),
    integer(2, 2, 1),
    integer(16, 1, 1),
];

/// Bytes of the integer path's scratch for `tokens` tokens of `cols` inputs: x as two int8
/// planes and two floats a block of 32 values, per token.
pub fn int8_scratch_bytes(tokens: usize, cols: usize) -> usize {
    tokens * (2 * cols + cols / 32 * 8)
}

/// Values of one unit of the integer path: 4 GGUF blocks.
pub const INT8_UNIT: usize = 128;

/// Register words of one unit of `dtype` on the integer path.
fn int8_unit_words(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q8_0 => Some(34),
        DType::Q4_0 => Some(18),
        DType::Q4_1 => Some(20),
        _ => None,
    }
}

/// Shared memory a block of the integer path may stage weights in (static shared memory).
const INT8_STAGE_LIMIT: usize = 48 << 10;

/// Bytes of one round of weights a block of `variant` stages for `call` on the integer path
/// (each warp: `unroll` units of each of its weight rows for 32 lanes); `None` off the integer
/// formats. Pipelined, a block holds two rounds.
fn int8_stage_bytes(call: &LinearCall, variant: LinearVariant) -> Option<usize> {
    let words = int8_unit_words(call.weight)?;
    let weight_rows = variant.rows as usize * call.epilogue.weight_rows_per_output();
    Some(variant.warps as usize * variant.unroll as usize * weight_rows * 32 * words * 4)
}

/// Lanes that split a row on the integer path: the largest power of two (8 to 32) not above
/// the row's units.
fn int8_lanes_per_row(cols: usize) -> usize {
    let units = (cols / INT8_UNIT).max(1);
    (1usize << units.ilog2()).clamp(8, 32)
}

/// Tokens the `mma` variants serve (one token leaves 7 of the tensor cores' 8 columns idle: the
/// CUDA-core path is not bound by its arithmetic there).
pub const MMA_TOKENS: std::ops::RangeInclusive<usize> = 2..=MAX_TOKENS;

/// The variants, as data; the tests run every one, the benchmark times every one.
pub const LINEAR_VARIANTS: &[LinearVariant] = &[
    variant(4, 1, 2),
    variant(4, 1, 4),
    variant(8, 1, 2),
    variant(2, 1, 4),
    variant(1, 1, 4),
    variant(4, 2, 2),
    variant(2, 2, 2),
    variant(8, 2, 1),
    variant(4, 4, 1),
    variant(1, 4, 2),
    staged(4, 4, 1),
    staged(8, 4, 1),
    staged(4, 2, 2),
    staged(2, 4, 1),
    staged(1, 4, 1),
    staged(8, 1, 2),
    // Tensor cores: 16 rows a block give 4096-row layers 256 blocks; 32 rows halve the x read
    // per weight byte (one B fragment serves two tiles) but give them only 128 blocks, hence the
    // wider blocks there.
    tensor_core(4, 16, 4),
    tensor_core(8, 16, 2),
    tensor_core(2, 16, 4),
    tensor_core(4, 32, 2),
    tensor_core(8, 32, 1),
    tensor_core(8, 32, 2),
    tensor_core(16, 32, 1),
];

/// Most sums (output rows x weight rows per output x tokens) one thread of a block carries.
pub const MAX_SLOTS: usize = 64;

impl LinearVariant {
    /// A short label: `4w/1r/2u`, with `/x` when x is staged, `/mma` on the tensor cores.
    pub fn label(&self) -> String {
        let stage = if self.stage_x { "/x" } else { "" };
        let mma = if self.mma { "/mma" } else { "" };
        let int8 = if self.int8 { "/i8" } else { "" };
        format!("{}w/{}r/{}u{stage}{mma}{int8}", self.warps, self.rows, self.unroll)
    }

    /// The integer path's default for `call`, when it serves the call: 4 warps a block, a warp
    /// per row group; two output rows a lane where that still leaves 16 row groups per SM of an
    /// H200; units in flight to cover a lane's share of a row (at most 4), within about 80 words
    /// of weights in registers (40 beyond 4 tokens).
    pub fn int8_default_for(call: &LinearCall) -> Option<LinearVariant> {
        let words = int8_unit_words(call.weight)?;
        if call.cols == 0 || !call.cols.is_multiple_of(INT8_UNIT) {
            return None;
        }
        let gates = call.epilogue.weight_rows_per_output();
        let lanes = int8_lanes_per_row(call.cols);
        let side = 32 / lanes;
        let lane_units = (call.cols / INT8_UNIT).div_ceil(lanes);
        // Pipelined, two rounds are in flight: two units of a lane a round suffice.
        let pipe = int8_pipe_on(call.tokens);
        let most = if pipe { 2 } else { 4 };
        let mut unroll = (lane_units.next_power_of_two()).min(most);
        let mut rows = if call.rows.div_ceil(side * 2) >= 132 * 16 { 2 } else { 1 };
        // Beyond 4 tokens the tokens' x chunks crowd the registers too.
        let budget = if call.tokens > 4 { 40 } else { 80 };
        while rows * gates * unroll * words > budget && unroll > 1 {
            unroll /= 2;
        }
        // Pipelined, a block's two rounds of weights fit the stage limit.
        let staged = |rows: usize, unroll: usize| {
            int8_stage_bytes(call, integer(4, rows as u32, unroll as u32)).map_or(0, |b| 2 * b)
        };
        while (rows * gates * unroll * words > budget
            || rows * gates * call.tokens > 32
            || (pipe && staged(rows, unroll) > INT8_STAGE_LIMIT))
            && rows > 1
        {
            rows /= 2;
        }
        while pipe && staged(rows, unroll) > INT8_STAGE_LIMIT && unroll > 1 {
            unroll /= 2;
        }
        Some(integer(4, rows as u32, unroll as u32))
    }

    /// The default for `call`, as measured on the H200 (`bench/results/2026-11-30-h200-final/
    /// linear-bandwidth.txt` and this commit's results):
    /// - Q8_0, Q4_0, Q4_1 with columns a multiple of 128: the integer path
    ///   ([`LinearVariant::int8_default_for`]);
    /// - the other block formats: four warps, up to four rows a block, one piece in flight, x
    ///   read through the cache;
    /// - BF16 / F16: at 1 and 2 tokens four warps, two rows a block, two pieces in flight (86% of
    ///   the copy rate at one token, 83% at two); at 3 to 8 tokens the tensor cores, 16 rows a
    ///   block (73% against 52% of the CUDA-core default at 4 and 8 tokens), where that leaves a
    ///   block per SM;
    /// - otherwise x read directly: one output row per block up to 2 tokens, 2 up to 4 tokens and
    ///   4 beyond, as long as that leaves two blocks per SM of an H200; enough warps that each
    ///   thread loads about `unroll` pieces of a row, 1 to 8.
    pub fn default_for(call: &LinearCall) -> LinearVariant {
        Self::int8_default_for(call).unwrap_or_else(|| Self::dequantizing_default_for(call))
    }

    /// [`LinearVariant::default_for`] off the integer path: every format dequantized in
    /// registers against x as given.
    pub fn dequantizing_default_for(call: &LinearCall) -> LinearVariant {
        let quantized = call.weight.is_quantized();
        let gates = call.epilogue.weight_rows_per_output();
        if quantized {
            // Measured on the H200 (bench/results/2026-11-30-h200/linear-bandwidth.txt): four warps,
            // four rows a block, one piece in flight, x read through the cache rather than staged
            // is the fastest listed variant of every block format at 1 token and at 8 (Q4_0: 1184
            // against 878 GB/s at 1 token, 244 against 50 at 8). Fewer rows for small matrices and
            // where the sums would crowd the registers (SwiGLU at more than 4 tokens).
            let mut rows = 4u32;
            while rows > 1
                && (call.rows.div_ceil(rows as usize) < 264 || rows as usize * gates * call.tokens > 32)
            {
                rows /= 2;
            }
            return variant(4, rows, 1);
        }
        if matches!(call.weight, DType::BF16 | DType::F16) {
            if MMA_TOKENS.contains(&call.tokens) && call.tokens >= 3 && call.rows.div_ceil(16) >= 132 {
                return tensor_core(4, 16, 4);
            }
            if call.tokens <= 2 && call.rows.div_ceil(2) >= 264 {
                return variant(4, 2, 2);
            }
        }
        let mut rows: u32 = match call.tokens {
            0..=2 => 1,
            3..=4 => 2,
            _ => 4,
        };
        while rows > 1
            && (call.rows.div_ceil(rows as usize) < 264 || rows as usize * gates * call.tokens > MAX_SLOTS)
        {
            rows /= 2;
        }
        let weight_rows = rows as usize * gates;
        let piece = piece_size(call.weight).unwrap_or(8);
        let pieces = (call.cols / piece).max(1);
        let unroll: u32 = match weight_rows {
            1 => 4,
            2 => 2,
            _ => 1,
        };
        let per_warp = 32 * unroll as usize;
        let warps = (pieces / per_warp).clamp(1, 8);
        let warps = 1u32 << warps.ilog2();
        variant(warps, rows, unroll)
    }
}

/// Every weight dtype the linear kernels take (embedding gather and bf16 conversion included).
pub const WEIGHT_DTYPES: [DType; 15] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

/// Whether the linear kernels take weights of `dtype` (one of [`WEIGHT_DTYPES`]): `Ok`, or
/// [`Error::DTypeNotServed`].
pub fn serves_weight(dtype: DType) -> Result<()> {
    weight_code(dtype).map(|_| ())
}

/// The kernel's code of a weight dtype.
fn weight_code(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        DType::Q4_K => 6,
        DType::Q6_K => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q5_K => 10,
        DType::IQ4_NL => 11,
        DType::IQ4_XS => 12,
        DType::Q2_K => 13,
        DType::Q3_K => 14,
        other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "linear kernel weights" }),
    })
}

/// Values of one thread's piece of a row (the column multiple the kernels need).
fn piece_values(dtype: DType) -> Result<usize> {
    Ok(match weight_code(dtype)? {
        0..=2 => 8,
        3 => 16,
        4 | 5 | 8 | 9 | 11 => 32,
        _ => 256, // a piece is 32 values, but the K formats come in super-blocks of 256
    })
}

fn not_served(reason: String) -> Error {
    Error::NotServed { op: "linear kernel", reason }
}

fn flag(b: bool) -> String {
    if b { "1" } else { "0" }.to_owned()
}

/// Checks `cols` against `dtype`'s column multiple and returns the bytes of one row.
fn row_bytes(dtype: DType, cols: usize) -> Result<usize> {
    let multiple = piece_values(dtype)?;
    if cols == 0 || !cols.is_multiple_of(multiple) || i32::try_from(cols).is_err() {
        return Err(not_served(format!(
            "{cols} columns of {dtype} (needs a positive multiple of {multiple})"
        )));
    }
    Ok(dtype.bytes_for(cols as u64)? as usize)
}

fn check_alignment(what: &'static str, view: DeviceView, bytes: u64) -> Result<()> {
    if !view.ptr.is_multiple_of(bytes) {
        return Err(Error::InvalidArgument {
            name: what,
            value: format!("device address {:#x}", view.ptr),
            reason: format!("the linear kernels need it {bytes}-byte aligned"),
        });
    }
    Ok(())
}

impl LinearCall {
    /// Checks what the kernel serves for this call on `variant` and returns its compile-time
    /// constants.
    pub fn defines(&self, variant: LinearVariant, has_bias: bool) -> Result<Vec<(&'static str, String)>> {
        let w_t = weight_code(self.weight)?;
        let x_t = match self.input {
            DType::F32 => 0,
            DType::BF16 => 1,
            other => return Err(Error::DTypeNotServed { dtype: other.name(), op: "linear kernel input" }),
        };
        if self.tokens == 0 || self.tokens > MAX_TOKENS {
            return Err(not_served(format!("{} tokens (1 to {MAX_TOKENS})", self.tokens)));
        }
        if self.rows == 0 || i32::try_from(self.rows * self.epilogue.weight_rows_per_output()).is_err() {
            return Err(not_served(format!("{} rows", self.rows)));
        }
        row_bytes(self.weight, self.cols)?;
        if has_bias && self.epilogue == Epilogue::SwiGlu {
            return Err(Error::InvalidArgument {
                name: "bias",
                value: "given".to_owned(),
                reason: "the SwiGLU epilogue takes no bias".to_owned(),
            });
        }
        let mut defines = vec![
            ("W_T", w_t.to_string()),
            ("X_T", x_t.to_string()),
            ("TOKENS", self.tokens.to_string()),
            ("EPI", self.epilogue.code().to_string()),
            ("HAS_BIAS", flag(has_bias)),
            ("WARPS", variant.warps.to_string()),
        ];
        if variant.int8 {
            self.check_int8(variant)?;
            defines.extend([
                ("RL", variant.rows.to_string()),
                ("UNR", variant.unroll.to_string()),
                ("LPR", int8_lanes_per_row(self.cols).to_string()),
                ("PIPE", flag(self.int8_pipelined(variant))),
            ]);
            return Ok(defines);
        }
        if variant.mma {
            self.check_tensor_core(variant)?;
        } else {
            self.check_cuda_core(variant)?;
        }
        defines.extend([
            ("ROWS", variant.rows.to_string()),
            ("UNROLL", variant.unroll.to_string()),
            ("STAGE", flag(variant.stage_x)),
            ("MMA", flag(variant.mma)),
        ]);
        Ok(defines)
    }

    /// The `mma` variants: BF16 or F16 weights, 2 to 8 tokens, 16 or 32 rows a block, x read
    /// directly.
    fn check_tensor_core(&self, variant: LinearVariant) -> Result<()> {
        let refuse =
            |what: String| Err(not_served(format!("variant {} (tensor cores) for {what}", variant.label())));
        if !matches!(self.weight, DType::BF16 | DType::F16) {
            return refuse(format!("{} weights (BF16 or F16 only)", self.weight));
        }
        if !MMA_TOKENS.contains(&self.tokens) {
            return refuse(format!("{} tokens (2 to {MAX_TOKENS})", self.tokens));
        }
        if ![1, 2, 4, 8, 16].contains(&variant.warps)
            || ![16, 32].contains(&variant.rows)
            || ![1, 2, 4].contains(&variant.unroll)
            || variant.stage_x
        {
            return refuse("its shape (1 to 16 warps, 16 or 32 rows, unroll 1, 2 or 4, x not staged)".into());
        }
        Ok(())
    }

    /// The integer path: Q8_0, Q4_0 or Q4_1 weights, columns a multiple of 128, 1 to 16 warps,
    /// 1 to 4 rows a lane, 1 to 4 units in flight, at most 32 sums and 80 words of weights a
    /// lane.
    fn check_int8(&self, variant: LinearVariant) -> Result<()> {
        let refuse =
            |what: String| Err(not_served(format!("variant {} (integer path) for {what}", variant.label())));
        let Some(words) = int8_unit_words(self.weight) else {
            return refuse(format!("{} weights (Q8_0, Q4_0 or Q4_1 only)", self.weight));
        };
        if !self.cols.is_multiple_of(INT8_UNIT) {
            return refuse(format!("{} columns (a multiple of {INT8_UNIT})", self.cols));
        }
        let weight_rows = variant.rows as usize * self.epilogue.weight_rows_per_output();
        if ![1, 2, 4, 8, 16].contains(&variant.warps)
            || ![1, 2, 4].contains(&variant.rows)
            || ![1, 2, 4].contains(&variant.unroll)
            || variant.stage_x
            || variant.mma
            || weight_rows * self.tokens > 32
            || weight_rows * variant.unroll as usize * words > 80
            || int8_stage_bytes(self, variant).is_some_and(|b| b > INT8_STAGE_LIMIT)
        {
            return refuse(format!(
                "{} tokens, {:?} (1 to 16 warps, 1 to 4 rows and units; at most 32 sums and 80 words a lane, 48 KiB of staged weights a block)",
                self.tokens, self.epilogue
            ));
        }
        Ok(())
    }

    /// Whether the integer path runs `variant` pipelined for this call ([`INT8_PIPE_ENV`]): turned
    /// on, and the two stages of weights a warp fit the 48 KiB of a block.
    pub fn int8_pipelined(&self, variant: LinearVariant) -> bool {
        variant.int8
            && int8_pipe_on(self.tokens)
            && int8_stage_bytes(self, variant).is_some_and(|b| 2 * b <= INT8_STAGE_LIMIT)
    }

    /// Bytes of the integer path's scratch ([`int8_scratch_bytes`]).
    pub fn int8_scratch_bytes(&self) -> usize {
        int8_scratch_bytes(self.tokens, self.cols)
    }

    /// The CUDA-core variants: at most [`MAX_SLOTS`] sums per thread.
    fn check_cuda_core(&self, variant: LinearVariant) -> Result<()> {
        let slots = variant.rows as usize * self.epilogue.weight_rows_per_output() * self.tokens;
        if ![1, 2, 4, 8, 16].contains(&variant.warps)
            || ![1, 2, 4, 8].contains(&variant.rows)
            || ![1, 2, 4].contains(&variant.unroll)
            || slots > MAX_SLOTS
        {
            return Err(not_served(format!(
                "variant {} for {} tokens, {:?} ({slots} sums per thread, at most {MAX_SLOTS})",
                variant.label(),
                self.tokens,
                self.epilogue
            )));
        }
        Ok(())
    }

    /// Bytes of the weights, x and out.
    pub fn buffer_bytes(&self) -> Result<(usize, usize, usize)> {
        let row = row_bytes(self.weight, self.cols)?;
        let x = self.input.size_in_bytes().unwrap_or(4);
        Ok((
            self.rows * self.epilogue.weight_rows_per_output() * row,
            self.tokens * self.cols * x,
            self.tokens * self.rows * 4,
        ))
    }
}

fn define_refs<'a>(defines: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    defines.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// `out[t][r]` (fp32, row stride `rows`) for `t < tokens`, `r < rows`:
/// `acc = sum_c W[r][c] * x[t][c] (+ bias[r])`; Store: `out = acc`; Accumulate: `out += acc`;
/// SwiGlu: `out = silu(acc_gate) * acc_up` (no bias). Runs on `gpu`'s stream with `variant` (or
/// [`LinearVariant::default_for`]). An integer-path variant needs a scratch
/// ([`LinearCall::int8_scratch_bytes`]): this allocates one and waits for the stream before
/// giving it back; [`linear_with_scratch`] takes the caller's.
pub fn linear(
    gpu: &Gpu,
    call: &LinearCall,
    weight: DeviceView,
    bias: Option<DeviceView>,
    x: DeviceView,
    out: DeviceView,
    variant: Option<LinearVariant>,
) -> Result<()> {
    let variant = variant.unwrap_or_else(|| LinearVariant::default_for(call));
    if !variant.int8 {
        return linear_with_scratch(gpu, call, weight, bias, x, out, Some(variant), None).map(|_| ());
    }
    let scratch = gpu.alloc(call.int8_scratch_bytes().max(16))?;
    linear_with_scratch(gpu, call, weight, bias, x, out, Some(variant), Some(scratch.view()))?;
    gpu.synchronize()
}

/// [`linear`] with the integer path's scratch given (16-byte aligned, at least
/// [`LinearCall::int8_scratch_bytes`]; unused by the other variants): what a captured decode
/// step runs. With no variant the default is [`LinearVariant::default_for`] when a scratch is
/// given, [`LinearVariant::dequantizing_default_for`] when not. Returns the kernel launches made
/// (2 on the integer path, 1 otherwise).
#[allow(clippy::too_many_arguments)]
pub fn linear_with_scratch(
    gpu: &Gpu,
    call: &LinearCall,
    weight: DeviceView,
    bias: Option<DeviceView>,
    x: DeviceView,
    out: DeviceView,
    variant: Option<LinearVariant>,
    scratch: Option<DeviceView>,
) -> Result<usize> {
    linear_inner(gpu, call, weight, bias, Some(x), out, variant, scratch)
}

/// The integer-path product of `call` with x already rounded into `scratch` (by
/// [`crate::ops::norm::norm_with_int8_planes`]): one launch, no rounding launch. `variant`, or
/// [`LinearVariant::default_for`], must be an integer-path one.
pub fn linear_prequantized(
    gpu: &Gpu,
    call: &LinearCall,
    weight: DeviceView,
    bias: Option<DeviceView>,
    scratch: DeviceView,
    out: DeviceView,
    variant: Option<LinearVariant>,
) -> Result<usize> {
    let variant = variant.unwrap_or_else(|| LinearVariant::default_for(call));
    if !variant.int8 {
        return Err(not_served(format!("x rounded ahead for the non-integer variant {}", variant.label())));
    }
    linear_inner(gpu, call, weight, bias, None, out, Some(variant), Some(scratch))
}

/// [`linear_with_scratch`], or with `x` None the integer path on a scratch rounded ahead.
#[allow(clippy::too_many_arguments)]
fn linear_inner(
    gpu: &Gpu,
    call: &LinearCall,
    weight: DeviceView,
    bias: Option<DeviceView>,
    x: Option<DeviceView>,
    out: DeviceView,
    variant: Option<LinearVariant>,
    scratch: Option<DeviceView>,
) -> Result<usize> {
    let variant = variant.unwrap_or_else(|| {
        if scratch.is_some() {
            LinearVariant::default_for(call)
        } else {
            LinearVariant::dequantizing_default_for(call)
        }
    });
    let defines = call.defines(variant, bias.is_some())?;
    let (w_bytes, x_bytes, out_bytes) = call.buffer_bytes()?;
    super::check_buffer("linear", "weight", weight.len_bytes, w_bytes)?;
    if let Some(x) = x {
        super::check_buffer("linear", "x", x.len_bytes, x_bytes)?;
        check_alignment("x", x, 16)?;
    }
    super::check_buffer("linear", "out", out.len_bytes, out_bytes)?;
    if let Some(bias) = bias {
        super::check_buffer("linear", "bias", bias.len_bytes, call.rows * 4)?;
        check_alignment("bias", bias, 4)?;
    }
    check_alignment("weight", weight, 16)?;
    check_alignment("out", out, 4)?;

    let (x_arg, function, config) = if variant.int8 {
        let scratch = scratch.ok_or_else(|| Error::InvalidArgument {
            name: "scratch",
            value: "none".to_owned(),
            reason: format!("the integer-path variant {} needs one", variant.label()),
        })?;
        super::check_buffer("linear", "scratch", scratch.len_bytes, call.int8_scratch_bytes())?;
        check_alignment("scratch", scratch, 16)?;
        if x.is_none() {
            // x was rounded into the scratch ahead of this call.
            let (function, config) = int8_launch(gpu, call, variant, &defines)?;
            (scratch.ptr, function, config)
        } else if let Some((x, shared)) = x.zip(int8_fused_shared_bytes(call, variant)) {
            // One launch: the product kernel rounds x itself into shared memory.
            let mut defines = defines.clone();
            defines.retain(|(name, _)| *name != "PIPE");
            defines.extend([("FUSE", "1".to_owned()), ("PIPE", "0".to_owned())]);
            let (function, mut config) = int8_launch(gpu, call, variant, &defines)?;
            config.shared_mem_bytes = shared as u32;
            (x.ptr, function, config)
        } else {
            let x = x.ok_or_else(|| not_served("no x to round".to_owned()))?;
            int8_quantize(gpu, call, &defines, x, scratch)?;
            let (function, config) = int8_launch(gpu, call, variant, &defines)?;
            (scratch.ptr, function, config)
        }
    } else {
        let x = x.ok_or_else(|| not_served("no x for the CUDA-core path".to_owned()))?;
        let function = gpu.function(&LINEAR, "kiln_linear", &define_refs(&defines))?;
        let blocks = u32::try_from(call.rows.div_ceil(variant.rows as usize))
            .map_err(|_| not_served(format!("{} rows", call.rows)))?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (variant.warps * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        (x.ptr, function, config)
    };
    let rows = call.rows as i32; // checked by `defines`
    let cols = call.cols as i32;
    let row_bytes = (w_bytes / (call.rows * call.epilogue.weight_rows_per_output())) as i64;
    let bias_ptr = bias.map_or(0u64, |b| b.ptr);
    let mut launch = gpu.launch_builder(&function);
    launch.arg(&weight.ptr).arg(&bias_ptr).arg(&x_arg).arg(&out.ptr).arg(&rows).arg(&cols).arg(&row_bytes);
    // SAFETY: the arguments match `kiln_linear`'s signature (4 pointers, i32, i32, i64); the
    // weight, x, out and bias views were checked above to hold what the kernel touches for this
    // call (rows x weight rows per output rows of `row_bytes`, tokens x cols inputs, tokens x rows
    // outputs, rows biases) and to have the alignment of its vector loads; `bias` is null only when
    // HAS_BIAS = 0 makes the kernel ignore it; the views' owners keep the memory alive until the
    // stream has run the kernel (the `DeviceView` contract).
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_linear)", e))?;
    // The integer path's rounding launch ran unless x came rounded or the product rounded it.
    Ok(if variant.int8 && x.is_some() && config.shared_mem_bytes == 0 { 2 } else { 1 })
}

/// The environment variable that sets whether the integer path's product kernel is pipelined
/// (`1`: at every token count) or not (`0`); unset, it is pipelined at one token. Pipelined, the
/// grid is persistent (the blocks that fit the GPU at once) and each warp keeps two rounds of
/// weights in flight, the next round's (or the next row group's) copies issued before the
/// current round is summed. The sums and their order are the same either way, so are the
/// outputs' bits. On an H200 the Llama-3-8B shape Q4_0 decode ran at 389.1 tok/s pipelined
/// against 361.0 plain (`bench/results/2026-11-30-h200-pipe/`).
pub const INT8_PIPE_ENV: &str = "KILN_INT8_PIPE";

/// Whether the integer path is pipelined for a call of `tokens` tokens ([`INT8_PIPE_ENV`]).
pub fn int8_pipe_on(tokens: usize) -> bool {
    match std::env::var(INT8_PIPE_ENV).as_deref().map(str::trim) {
        Ok("1") => true,
        Ok("0") => false,
        _ => tokens == 1,
    }
}

/// The environment variable that turns the integer path's fused rounding on (`1`): at one token
/// the product kernel then rounds x itself into shared memory, with no launch of its own. Off by
/// default: on an H200 every block rounding the whole of x cost more than the launch it saves
/// (Llama-3-8B shape Q4_0 decode 281.7 tok/s fused against 356.4 with the rounding launch,
/// `bench/results/2026-11-30-h200-overlap/`).
pub const INT8_FUSED_ENV: &str = "KILN_INT8_FUSED";

/// Shared memory of the integer path's fused rounding for `call` on `variant`, when it is turned
/// on ([`INT8_FUSED_ENV`]) and serves the call: one token, and x's two planes and scales (2.25
/// bytes a column) beside the warps' weight stages within the 48 KiB a block gets without an
/// opt-in.
pub fn int8_fused_shared_bytes(call: &LinearCall, variant: LinearVariant) -> Option<usize> {
    let stage = int8_stage_bytes(call, variant)?;
    if !variant.int8 || call.tokens != 1 || !std::env::var(INT8_FUSED_ENV).is_ok_and(|v| v.trim() == "1") {
        return None;
    }
    let shared = int8_scratch_bytes(call.tokens, call.cols);
    (stage + shared <= INT8_STAGE_LIMIT).then_some(shared)
}

/// The integer path's first launch: x as two int8 planes and block scales into `scratch`.
fn int8_quantize(
    gpu: &Gpu,
    call: &LinearCall,
    defines: &[(&'static str, String)],
    x: DeviceView,
    scratch: DeviceView,
) -> Result<()> {
    let function = gpu.function(&LINEAR_I8, "kiln_linear_i8_quantize", &define_refs(defines))?;
    let quads = call.tokens * call.cols / 4;
    let blocks = quads.div_ceil(256).clamp(1, 4 * gpu.facts().multiprocessors as usize) as u32;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let cols = call.cols as i32; // checked by `defines`
    let mut launch = gpu.launch_builder(&function);
    launch.arg(&x.ptr).arg(&scratch.ptr).arg(&cols);
    // SAFETY: the arguments match `kiln_linear_i8_quantize`'s signature (2 pointers, i32); x holds
    // tokens x cols inputs of the call's input dtype and the scratch `int8_scratch_bytes`, 16-byte
    // aligned, as the caller checked; the views' owners keep the memory alive until the stream has
    // run the kernel.
    unsafe { launch.launch(config) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_linear_i8_quantize)", e))?;
    Ok(())
}

/// The integer path's product kernel and grid: a warp per row group.
fn int8_launch(
    gpu: &Gpu,
    call: &LinearCall,
    variant: LinearVariant,
    defines: &[(&'static str, String)],
) -> Result<(cudarc::driver::CudaFunction, LaunchConfig)> {
    let function = gpu.function(&LINEAR_I8, "kiln_linear_i8", &define_refs(defines))?;
    let side = 32 / int8_lanes_per_row(call.cols);
    let groups = call.rows.div_ceil(side * variant.rows as usize);
    let mut blocks = groups.div_ceil(variant.warps as usize);
    if defines.iter().any(|(name, value)| *name == "PIPE" && value == "1") {
        // Persistent: the blocks that are resident at once; each warp loops over row groups.
        let resident =
            function.occupancy_max_active_blocks_per_multiprocessor(variant.warps * 32, 0, None).map_err(
                |e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor(kiln_linear_i8)", e),
            )?;
        let multiprocessors = gpu.facts().multiprocessors.max(1) as usize;
        blocks = blocks.min(resident.max(1) as usize * multiprocessors);
    }
    let blocks = u32::try_from(blocks).map_err(|_| not_served(format!("{} rows", call.rows)))?;
    let config =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (variant.warps * 32, 1, 1), shared_mem_bytes: 0 };
    Ok((function, config))
}

/// A grid-stride launch of `total` threads' work: 256 threads a block, at most 65536 blocks.
fn stride_config(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// Rows of an embedding table of any dtype [`linear`] serves, gathered and widened to fp32:
/// `out[t] = row ids[t]` (`tokens x cols` fp32, 16-byte aligned); an id >= `vocab` gives a zero
/// row. `ids`: u32 `[tokens]` on the device (so a captured graph can replay it).
#[allow(clippy::too_many_arguments)]
pub fn embed_rows(
    gpu: &Gpu,
    dtype: DType,
    table: DeviceView,
    vocab: usize,
    cols: usize,
    ids: DeviceView,
    tokens: usize,
    out: DeviceView,
) -> Result<()> {
    let code = weight_code(dtype)?;
    let row = row_bytes(dtype, cols)?;
    if tokens == 0 {
        return Ok(());
    }
    super::check_buffer("embed_rows", "table", table.len_bytes, vocab * row)?;
    super::check_buffer("embed_rows", "ids", ids.len_bytes, tokens * 4)?;
    super::check_buffer("embed_rows", "out", out.len_bytes, tokens * cols * 4)?;
    check_alignment("table", table, 16)?;
    check_alignment("ids", ids, 4)?;
    check_alignment("out", out, 16)?;
    let code = code.to_string();
    let function = gpu.function(&LINEAR, "kiln_linear_embed", &[("W_T", code.as_str())])?;
    let pieces = cols / piece_size(dtype)?;
    let (vocab, cols, row_bytes, tokens_arg) = (vocab as i64, cols as i32, row as i64, tokens as i64);
    let mut launch = gpu.launch_builder(&function);
    launch
        .arg(&table.ptr)
        .arg(&ids.ptr)
        .arg(&out.ptr)
        .arg(&vocab)
        .arg(&cols)
        .arg(&row_bytes)
        .arg(&tokens_arg);
    // SAFETY: the arguments match `kiln_linear_embed`'s signature (3 pointers, i64, i32, i64, i64);
    // the table holds `vocab` rows of `row_bytes` and the kernel reads only rows of ids below
    // `vocab`; ids holds `tokens` u32 and out `tokens x cols` fp32, 16-byte aligned, as checked
    // above; the views' owners keep the memory alive until the stream has run the kernel.
    unsafe { launch.launch(stride_config(tokens * pieces)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_linear_embed)", e))?;
    Ok(())
}

/// Values one thread of the gather / conversion kernels handles (a piece).
fn piece_size(dtype: DType) -> Result<usize> {
    Ok(match weight_code(dtype)? {
        0..=2 => 8,
        3 => 16,
        _ => 32,
    })
}

/// Dequantizes / converts `rows x cols` weights of any dtype [`linear`] serves to bf16 (round to
/// nearest even; `out` 16-byte aligned), for the prefill path that hands bf16 weights to cuBLAS.
pub fn to_bf16_weights(
    gpu: &Gpu,
    dtype: DType,
    src: DeviceView,
    rows: usize,
    cols: usize,
    out: DeviceView,
) -> Result<()> {
    let code = weight_code(dtype)?;
    let row = row_bytes(dtype, cols)?;
    if rows == 0 {
        return Ok(());
    }
    super::check_buffer("to_bf16_weights", "src", src.len_bytes, rows * row)?;
    super::check_buffer("to_bf16_weights", "out", out.len_bytes, rows * cols * 2)?;
    check_alignment("src", src, 16)?;
    check_alignment("out", out, 16)?;
    let code = code.to_string();
    let function = gpu.function(&LINEAR, "kiln_linear_to_bf16", &[("W_T", code.as_str())])?;
    let pieces = cols / piece_size(dtype)?;
    let (rows_arg, cols_arg, row_bytes) = (rows as i64, cols as i32, row as i64);
    let mut launch = gpu.launch_builder(&function);
    launch.arg(&src.ptr).arg(&out.ptr).arg(&rows_arg).arg(&cols_arg).arg(&row_bytes);
    // SAFETY: the arguments match `kiln_linear_to_bf16`'s signature (2 pointers, i64, i32, i64);
    // src holds `rows` rows of `row_bytes` and out `rows x cols` bf16, 16-byte aligned, as checked
    // above; the views' owners keep the memory alive until the stream has run the kernel.
    unsafe { launch.launch(stride_config(rows * pieces)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_linear_to_bf16)", e))?;
    Ok(())
}

/// fp32 -> bf16 (round to nearest even) of `count` values.
pub fn f32_to_bf16(gpu: &Gpu, src: DeviceView, count: usize, out: DeviceView) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    super::check_buffer("f32_to_bf16", "src", src.len_bytes, count * 4)?;
    super::check_buffer("f32_to_bf16", "out", out.len_bytes, count * 2)?;
    check_alignment("src", src, 4)?;
    check_alignment("out", out, 2)?;
    let function = gpu.function(&LINEAR, "kiln_linear_f32_to_bf16", &[])?;
    let count_arg = count as i64;
    let mut launch = gpu.launch_builder(&function);
    launch.arg(&src.ptr).arg(&out.ptr).arg(&count_arg);
    // SAFETY: the arguments match `kiln_linear_f32_to_bf16`'s signature (2 pointers, i64); src
    // holds `count` fp32 and out `count` bf16, aligned, as checked above; the views' owners keep
    // the memory alive until the stream has run the kernel.
    unsafe { launch.launch(stride_config(count)) }
        .map_err(|e| driver_error("cuLaunchKernel(kiln_linear_f32_to_bf16)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(weight: DType, rows: usize, cols: usize, tokens: usize, epilogue: Epilogue) -> LinearCall {
        LinearCall { weight, rows, cols, tokens, input: DType::F32, epilogue }
    }

    #[test]
    fn the_weight_dtypes_are_those_the_kernel_codes_serve() {
        let mut codes: Vec<u32> = WEIGHT_DTYPES.iter().map(|&d| weight_code(d).unwrap()).collect();
        codes.sort_unstable();
        assert_eq!(codes, (0..15).collect::<Vec<u32>>(), "one kernel code a dtype");
        for &dtype in DType::ALL {
            assert_eq!(serves_weight(dtype).is_ok(), WEIGHT_DTYPES.contains(&dtype), "{dtype}");
        }
    }

    #[test]
    fn every_default_variant_is_served() {
        for dtype in WEIGHT_DTYPES {
            for epilogue in [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu] {
                for tokens in 1..=MAX_TOKENS {
                    for (rows, cols) in [(1, 256), (2048, 2048), (14336, 4096), (4096, 14336)] {
                        let c = call(dtype, rows, cols, tokens, epilogue);
                        let v = LinearVariant::default_for(&c);
                        c.defines(v, false).unwrap_or_else(|e| panic!("{c:?} {v:?}: {e}"));
                    }
                }
            }
        }
    }

    #[test]
    fn block_formats_default_to_the_measured_fastest_variant() {
        // The integer path for Q8_0 / Q4_0 / Q4_1 when the columns are a multiple of 128.
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            for epilogue in [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu] {
                for tokens in 1..=MAX_TOKENS {
                    for (rows, cols) in [(4096, 4096), (14336, 4096), (4096, 14336), (3072, 2048), (64, 1536)]
                    {
                        let c = call(dtype, rows, cols, tokens, epilogue);
                        let v = LinearVariant::default_for(&c);
                        assert!(v.int8 && v.warps == 4, "{c:?} {v:?}");
                        assert!(c.defines(v, false).is_ok(), "{c:?} {v:?}");
                    }
                }
            }
            let odd = call(dtype, 576, 576, 1, Epilogue::Store);
            assert!(!LinearVariant::default_for(&odd).int8, "576 columns are not a multiple of 128");
            // Off the integer path (the engine's `integer_products: false`): dequantized in registers.
            let c = call(dtype, 4096, 4096, 1, Epilogue::Store);
            assert_eq!(LinearVariant::dequantizing_default_for(&c), variant(4, 4, 1));
        }
        // Llama-3-8B's Q4_0 layers at one token, pipelined (two rounds in flight a warp): two rows
        // a lane where rows abound, two units a round over the 14336 columns of the down
        // projection, one row a lane for gate/up (its two stages of two weight rows fill 48 KiB);
        // at two tokens (not pipelined) four units a round.
        assert_eq!(
            LinearVariant::default_for(&call(DType::Q4_0, 6144, 4096, 1, Epilogue::Store)),
            integer(4, 2, 1)
        );
        if std::env::var(INT8_PIPE_ENV).is_err() {
            let down = call(DType::Q4_0, 4096, 14336, 1, Epilogue::Accumulate);
            assert_eq!(LinearVariant::default_for(&down), integer(4, 1, 2));
            assert!(down.int8_pipelined(integer(4, 1, 2)));
            let gate_up = call(DType::Q4_0, 14336, 4096, 1, Epilogue::SwiGlu);
            assert_eq!(LinearVariant::default_for(&gate_up), integer(4, 1, 1));
            assert!(gate_up.int8_pipelined(integer(4, 1, 1)));
            assert!(!gate_up.int8_pipelined(integer(4, 2, 1)), "four stages of 4.5 KiB a warp");
            let two = call(DType::Q4_0, 4096, 14336, 2, Epilogue::Accumulate);
            assert_eq!(LinearVariant::default_for(&two), integer(4, 1, 4));
            assert!(!two.int8_pipelined(integer(4, 1, 4)));
        }
        // The other block formats, and the 4-bit ones off the integer path: four warps, one
        // piece in flight, x read through the cache.
        for dtype in [DType::Q4_K, DType::Q6_K, DType::Q4_0, DType::Q8_0] {
            let cols = if matches!(dtype, DType::Q4_K | DType::Q6_K) { 4096 } else { 4000 };
            for epilogue in [Epilogue::Store, Epilogue::SwiGlu] {
                for tokens in 1..=MAX_TOKENS {
                    let c = call(dtype, 4096, cols, tokens, epilogue);
                    let v = LinearVariant::default_for(&c);
                    let weight_rows = v.rows as usize * epilogue.weight_rows_per_output();
                    assert!(!v.int8 && !v.stage_x && v.warps == 4 && v.unroll == 1, "{c:?} {v:?}");
                    assert!(weight_rows * tokens <= 32, "{c:?} {v:?}");
                    assert!(4096usize.div_ceil(v.rows as usize) >= 264, "{c:?} {v:?}");
                    assert!(c.defines(v, false).is_ok(), "{c:?} {v:?}");
                }
            }
        }
        assert_eq!(LinearVariant::default_for(&call(DType::Q4_K, 576, 512, 1, Epilogue::Store)).rows, 2);
        // 16-bit weights: two rows a block at 1-2 tokens, the tensor cores from 3 tokens, on
        // matrices large enough.
        for dtype in [DType::BF16, DType::F16] {
            assert_eq!(
                LinearVariant::default_for(&call(dtype, 4096, 4096, 1, Epilogue::Store)),
                variant(4, 2, 2)
            );
            for tokens in 3..=MAX_TOKENS {
                let c = call(dtype, 4096, 4096, tokens, Epilogue::SwiGlu);
                assert_eq!(LinearVariant::default_for(&c), tensor_core(4, 16, 4));
            }
            assert!(!LinearVariant::default_for(&call(dtype, 576, 576, 8, Epilogue::Store)).mma);
        }
    }

    #[test]
    fn unserved_calls_are_named() {
        let v = variant(4, 1, 2);
        let ok = call(DType::BF16, 64, 64, 1, Epilogue::Store);
        assert!(ok.defines(v, true).is_ok());
        for dtype in [DType::Q8_K, DType::F8_E4M3, DType::F64, DType::I32] {
            let unserved = LinearCall { weight: dtype, cols: 256, ..ok };
            assert!(matches!(unserved.defines(v, false), Err(Error::DTypeNotServed { .. })), "{dtype}");
        }
        let f16_x = LinearCall { input: DType::F16, ..ok };
        assert!(matches!(f16_x.defines(v, false), Err(Error::DTypeNotServed { .. })));
        for tokens in [0, 9] {
            let c = LinearCall { tokens, ..ok };
            assert!(matches!(c.defines(v, false), Err(Error::NotServed { .. })));
        }
        let ragged = LinearCall { cols: 60, ..ok };
        assert!(matches!(ragged.defines(v, false), Err(Error::NotServed { .. })));
        let k_576 = LinearCall { weight: DType::Q4_K, cols: 576, ..ok };
        assert!(matches!(k_576.defines(v, false), Err(Error::NotServed { .. })));
        let swiglu = LinearCall { epilogue: Epilogue::SwiGlu, ..ok };
        assert!(matches!(swiglu.defines(v, true), Err(Error::InvalidArgument { name: "bias", .. })));
        let wide = LinearCall { tokens: 8, epilogue: Epilogue::SwiGlu, ..ok };
        assert!(matches!(wide.defines(variant(4, 8, 1), false), Err(Error::NotServed { .. })));
        assert!(matches!(ok.defines(variant(3, 1, 1), false), Err(Error::NotServed { .. })));
    }

    #[test]
    fn mma_variants_serve_16_bit_weights_at_2_to_8_tokens_and_refuse_the_rest_by_name() {
        let mma: Vec<LinearVariant> = LINEAR_VARIANTS.iter().copied().filter(|v| v.mma).collect();
        assert!(!mma.is_empty());
        for v in &mma {
            assert!(v.label().ends_with("/mma"), "{}", v.label());
            for dtype in [DType::BF16, DType::F16] {
                for epilogue in [Epilogue::Store, Epilogue::Accumulate, Epilogue::SwiGlu] {
                    for tokens in MMA_TOKENS {
                        for input in [DType::F32, DType::BF16] {
                            let c = LinearCall { input, ..call(dtype, 2051, 4104, tokens, epilogue) };
                            let defines = c.defines(*v, false).unwrap_or_else(|e| panic!("{c:?} {v:?}: {e}"));
                            assert!(defines.contains(&("MMA", "1".to_owned())));
                        }
                    }
                    let one = call(dtype, 64, 64, 1, epilogue);
                    assert!(
                        matches!(one.defines(*v, false), Err(Error::NotServed { reason, .. }) if reason.contains(&v.label())),
                        "{v:?} at one token"
                    );
                }
            }
            for dtype in WEIGHT_DTYPES.into_iter().filter(|d| !matches!(d, DType::BF16 | DType::F16)) {
                let c = call(dtype, 64, 256, 8, Epilogue::Store);
                assert!(
                    matches!(c.defines(*v, false), Err(Error::NotServed { reason, .. }) if reason.contains(&v.label())),
                    "{v:?} on {dtype}"
                );
            }
        }
        // Shapes the kernel does not take: 8 rows, unroll 8, staged x.
        let c = call(DType::BF16, 64, 64, 4, Epilogue::Store);
        for v in [
            tensor_core(4, 8, 1),
            tensor_core(4, 16, 8),
            LinearVariant { stage_x: true, ..tensor_core(4, 16, 1) },
        ] {
            assert!(matches!(c.defines(v, false), Err(Error::NotServed { .. })), "{v:?}");
        }
        // The CUDA-core path keeps its row counts; the defaults take the tensor cores only from 3
        // tokens.
        assert!(matches!(c.defines(variant(4, 16, 1), false), Err(Error::NotServed { .. })));
        for tokens in 1..=MAX_TOKENS {
            let v = LinearVariant::default_for(&call(DType::F16, 4096, 4096, tokens, Epilogue::Store));
            assert_eq!(v.mma, tokens >= 3, "{tokens} tokens: {v:?}");
        }
    }

    #[test]
    fn buffer_bytes_follow_the_block_layouts() {
        let c = call(DType::Q6_K, 3, 512, 2, Epilogue::SwiGlu);
        assert_eq!(c.buffer_bytes().unwrap(), (6 * 420, 2 * 512 * 4, 2 * 3 * 4));
        let c = LinearCall { input: DType::BF16, ..call(DType::Q4_0, 5, 64, 3, Epilogue::Store) };
        assert_eq!(c.buffer_bytes().unwrap(), (5 * 36, 3 * 64 * 2, 3 * 5 * 4));
        // Q5_0, Q5_1: 22 and 24 bytes a block of 32; Q5_K 176 a super-block of 256.
        assert_eq!(call(DType::Q5_0, 3, 96, 1, Epilogue::Store).buffer_bytes().unwrap().0, 3 * 3 * 22);
        assert_eq!(call(DType::Q5_1, 3, 96, 1, Epilogue::Store).buffer_bytes().unwrap().0, 3 * 3 * 24);
        assert_eq!(call(DType::Q5_K, 2, 512, 1, Epilogue::Store).buffer_bytes().unwrap().0, 2 * 2 * 176);
        // Q5_K rows come in super-blocks of 256 values, Q5_0 / Q5_1 rows in blocks of 32.
        assert!(matches!(
            call(DType::Q5_K, 2, 288, 1, Epilogue::Store).buffer_bytes(),
            Err(Error::NotServed { .. })
        ));
        assert!(matches!(
            call(DType::Q5_0, 2, 48, 1, Epilogue::Store).buffer_bytes(),
            Err(Error::NotServed { .. })
        ));
        // Q2_K, Q3_K: 84 and 110 bytes a super-block of 256.
        assert_eq!(call(DType::Q2_K, 2, 512, 1, Epilogue::Store).buffer_bytes().unwrap().0, 2 * 2 * 84);
        assert_eq!(call(DType::Q3_K, 2, 512, 1, Epilogue::Store).buffer_bytes().unwrap().0, 2 * 2 * 110);
        // IQ4_NL: 18 bytes a block of 32; IQ4_XS: 136 a super-block of 256.
        assert_eq!(call(DType::IQ4_NL, 3, 96, 1, Epilogue::Store).buffer_bytes().unwrap().0, 3 * 3 * 18);
        assert_eq!(call(DType::IQ4_XS, 2, 512, 1, Epilogue::Store).buffer_bytes().unwrap().0, 2 * 2 * 136);
        assert!(matches!(
            call(DType::IQ4_XS, 2, 288, 1, Epilogue::Store).buffer_bytes(),
            Err(Error::NotServed { .. })
        ));
    }
}
