//! Launcher of `kernels/sample.cu`: `kiln_core::ops::sample::sample` on the GPU, the same token
//! for the same logits, parameters, history, seed, step and stream.
//!
//! Buffers (all device memory):
//! - `logits`: `rows` rows of `vocab` fp32, `row_stride` elements apart;
//! - `params`: `rows` [`DeviceSamplingParams`] (48 bytes each, from [`encode_params`]);
//! - `steps`: `rows` `u64` step counters, read by the kernel (a captured graph replays with the
//!   counters advanced on the device);
//! - `history_offsets`: `rows + 1` `u32`, row `r`'s history is `history[offsets[r]..offsets[r+1]]`;
//! - `penalty`: a `counts` block of `rows x vocab` `u32` that is all zero (the kernel leaves it
//!   zero) and a `scratch` block of `rows x vocab` fp32; without it the penalties are not applied;
//! - `stats`: the LM head's packed block maxima, `stats_per_row` per row, for greedy rows
//!   without penalties;
//! - `tokens`: `rows` `u32` outputs ([`NO_TOKEN`] for a row whose logits are all NaN).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kiln_core::ops::sample::{SamplingParams, NO_TOKEN, PROBABILITY_BITS, WEIGHT_BITS};
use kiln_core::{Error, Result};

use crate::kernels::SAMPLE;
use crate::memory::DeviceMemory;
use crate::runtime::{driver_error, Gpu};

/// The most rows one launch samples.
pub const MAX_SAMPLE_ROWS: usize = 256;

/// Bytes of one [`DeviceSamplingParams`].
pub const PARAMS_BYTES: usize = 48;

/// One row's parameters as the kernel reads them (`KilnSampleParams` in `sample.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSamplingParams {
    pub temperature: f32,
    pub top_k: u32,
    /// `round(top_p * 2^24)`; `2^24` is off.
    pub top_p_units: u32,
    /// `round(min_p * 2^24) << 7`, the smallest weight min-p keeps.
    pub min_weight: u32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
    pub reserved: u32,
    pub seed: u64,
    pub stream: u64,
}

impl DeviceSamplingParams {
    /// The device form of `params` (validated) for sample stream `stream`.
    pub fn new(params: &SamplingParams, stream: u64) -> Result<DeviceSamplingParams> {
        params.validate()?;
        let top_p_units = if params.top_p < 1.0 { params.top_p_units() } else { 1 << PROBABILITY_BITS };
        Ok(DeviceSamplingParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p_units: top_p_units as u32,
            min_weight: (params.min_p_units() << (WEIGHT_BITS - PROBABILITY_BITS)) as u32,
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            reserved: 0,
            seed: params.seed,
            stream,
        })
    }

    /// The 48 little-endian bytes the kernel reads.
    pub fn to_bytes(&self) -> [u8; PARAMS_BYTES] {
        let mut out = [0u8; PARAMS_BYTES];
        let words = [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p_units,
            self.min_weight,
            self.repetition.to_bits(),
            self.presence.to_bits(),
            self.frequency.to_bits(),
            self.reserved,
        ];
        for (i, w) in words.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        out[32..40].copy_from_slice(&self.seed.to_le_bytes());
        out[40..48].copy_from_slice(&self.stream.to_le_bytes());
        out
    }
}

/// The `params` bytes of rows given as (parameters, stream).
pub fn encode_params(rows: &[(SamplingParams, u64)]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(rows.len() * PARAMS_BYTES);
    for (params, stream) in rows {
        out.extend_from_slice(&DeviceSamplingParams::new(params, *stream)?.to_bytes());
    }
    Ok(out)
}

/// The `history_offsets` and `history` words of per-row histories, each token checked against
/// the vocabulary.
pub fn encode_histories(histories: &[&[u32]], vocab: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut offsets = Vec::with_capacity(histories.len() + 1);
    let mut tokens = Vec::new();
    offsets.push(0u32);
    for history in histories {
        if let Some(&t) = history.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument {
                name: "history",
                value: t.to_string(),
                reason: format!("token id is outside the vocabulary of {vocab}"),
            });
        }
        tokens.extend_from_slice(history);
        offsets.push(u32::try_from(tokens.len()).map_err(|_| Error::InvalidArgument {
            name: "history",
            value: tokens.len().to_string(),
            reason: "more than 2^32 tokens of history in one launch".into(),
        })?);
    }
    Ok((offsets, tokens))
}

/// The penalty scratch of a launch (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct PenaltyScratch<'a> {
    /// `rows x vocab` `u32`, all zero.
    pub counts: &'a DeviceMemory,
    /// `rows x vocab` fp32.
    pub scratch: &'a DeviceMemory,
}

/// Device buffers of one sampler launch (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct SampleBuffers<'a> {
    pub logits: &'a DeviceMemory,
    /// Elements between the starts of two rows of `logits`.
    pub row_stride: usize,
    pub params: &'a DeviceMemory,
    pub steps: &'a DeviceMemory,
    pub history_offsets: &'a DeviceMemory,
    pub history: &'a DeviceMemory,
    pub penalty: Option<PenaltyScratch<'a>>,
    /// The LM head's statistics and how many there are per row.
    pub stats: Option<(&'a DeviceMemory, usize)>,
    pub tokens: &'a DeviceMemory,
}

/// Threads per block of the sampler.
pub const SAMPLE_THREADS: u32 = 1024;

/// Samples one token for each of `rows` rows of `vocab` logits on `gpu`'s stream.
pub fn sample(gpu: &Gpu, rows: usize, vocab: usize, buffers: SampleBuffers<'_>) -> Result<()> {
    if rows == 0 || rows > MAX_SAMPLE_ROWS {
        return Err(Error::NotServed {
            op: "sample kernel",
            reason: format!("{rows} rows (1 to {MAX_SAMPLE_ROWS})"),
        });
    }
    if vocab == 0 || vocab >= NO_TOKEN as usize || buffers.row_stride < vocab {
        return Err(Error::NotServed {
            op: "sample kernel",
            reason: format!("vocab {vocab} with row stride {}", buffers.row_stride),
        });
    }
    super::check_buffer(
        "sample",
        "logits",
        buffers.logits.len_bytes(),
        ((rows - 1) * buffers.row_stride + vocab) * 4,
    )?;
    super::check_buffer("sample", "params", buffers.params.len_bytes(), rows * PARAMS_BYTES)?;
    super::check_buffer("sample", "steps", buffers.steps.len_bytes(), rows * 8)?;
    super::check_buffer("sample", "history_offsets", buffers.history_offsets.len_bytes(), (rows + 1) * 4)?;
    super::check_buffer("sample", "tokens", buffers.tokens.len_bytes(), rows * 4)?;
    if let Some(p) = buffers.penalty {
        super::check_buffer("sample", "counts", p.counts.len_bytes(), rows * vocab * 4)?;
        super::check_buffer("sample", "scratch", p.scratch.len_bytes(), rows * vocab * 4)?;
    }
    let (stats, stats_per_row) = match buffers.stats {
        Some((m, per_row)) => {
            super::check_buffer("sample", "stats", m.len_bytes(), rows * per_row * 8)?;
            (
                m.device_ptr(),
                i32::try_from(per_row).map_err(|_| Error::NotServed {
                    op: "sample kernel",
                    reason: format!("{per_row} statistics per row"),
                })?,
            )
        }
        None => (0u64, 0i32),
    };
    let threads = SAMPLE_THREADS.to_string();
    let penalties = if buffers.penalty.is_some() { "1" } else { "0" };
    let function =
        gpu.function(&SAMPLE, "kiln_sample", &[("THREADS", &threads), ("PENALTIES", penalties)])?;
    let config = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (SAMPLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (counts, scratch) =
        buffers.penalty.map_or((0u64, 0u64), |p| (p.counts.device_ptr(), p.scratch.device_ptr()));
    let (logits, params, steps) =
        (buffers.logits.device_ptr(), buffers.params.device_ptr(), buffers.steps.device_ptr());
    let (offsets, history, tokens) =
        (buffers.history_offsets.device_ptr(), buffers.history.device_ptr(), buffers.tokens.device_ptr());
    let (vocab, row_stride) = (vocab as i64, buffers.row_stride as i64);
    let mut launch = gpu.stream().launch_builder(&function);
    launch
        .arg(&logits)
        .arg(&vocab)
        .arg(&row_stride)
        .arg(&params)
        .arg(&steps)
        .arg(&offsets)
        .arg(&history)
        .arg(&counts)
        .arg(&scratch)
        .arg(&stats)
        .arg(&stats_per_row)
        .arg(&tokens);
    // SAFETY: the arguments match `kiln_sample`'s signature (pointer, i64, i64, 7 pointers, i32,
    // pointer); every buffer was checked above to hold what `rows` blocks touch; `counts` and
    // `scratch` are null only with PENALTIES=0, `stats` only with zero statistics per row; the
    // history words are read within `history_offsets`' ranges, which the caller built with
    // `encode_histories` (the kernel also skips a token beyond the vocabulary); the blocks come
    // from this device's pool, which reuses memory only in this stream's order.
    unsafe { launch.launch(config) }.map_err(|e| driver_error("cuLaunchKernel(kiln_sample)", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_encode_as_the_kernel_reads_them() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            seed: 0xABCD,
            ..Default::default()
        };
        let d = DeviceSamplingParams::new(&p, 3).unwrap();
        assert_eq!(std::mem::size_of::<DeviceSamplingParams>(), PARAMS_BYTES);
        assert_eq!(d.top_p_units, (0.9f32 * 16_777_216.0).round() as u32);
        assert_eq!(d.min_weight, ((0.05f32 * 16_777_216.0).round() as u32) << 7);
        let bytes = d.to_bytes();
        assert_eq!(&bytes[0..4], &0.7f32.to_le_bytes());
        assert_eq!(&bytes[32..40], &0xABCDu64.to_le_bytes());
        assert_eq!(&bytes[40..48], &3u64.to_le_bytes());
        let off = DeviceSamplingParams::new(&SamplingParams::default(), 0).unwrap();
        assert_eq!(off.top_p_units, 1 << 24);
        assert!(DeviceSamplingParams::new(&SamplingParams { top_p: 2.0, ..p }, 0).is_err());
    }

    #[test]
    fn histories_are_checked_against_the_vocabulary() {
        let (offsets, tokens) = encode_histories(&[&[1, 2], &[], &[3]], 10).unwrap();
        assert_eq!(offsets, vec![0, 2, 2, 3]);
        assert_eq!(tokens, vec![1, 2, 3]);
        assert!(matches!(
            encode_histories(&[&[10]], 10),
            Err(Error::InvalidArgument { name: "history", .. })
        ));
    }
}
