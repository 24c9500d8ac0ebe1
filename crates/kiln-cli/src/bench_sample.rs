//! `kiln bench sample`: the sampler at vocabulary 151936 for batch 1 and 64 in each mode,
//! against PyTorch's sort-based top-k / top-p with `torch.multinomial`
//! (`bench/peers/sample.py`, whose JSON output `--peer` reads).
//!
//! Logits are random (never zeros) and rotate over several sets so they do not all sit in L2;
//! the step counters advance on every launch. Times are CUDA-event medians per launch. The
//! sampler's scratch is allocated once per batch, as a decode loop (or a captured graph) does.
//! Columns: the default path, the fused path in one launch (`SamplePath::Fused`: rows without
//! top-k run on one block each, so only its top-k and greedy rows are fast), and the fused path
//! with the mass path (`SamplePath::FusedMass`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_core::ops::sample::SamplingParams;
use kiln_core::{Error, Result};
use kiln_cuda::certify::median_launch_us;
use kiln_cuda::ops::sample::{
    encode_histories, encode_params, sample_with_path, PenaltyScratch, SampleBuffers, SamplePath,
    SampleScratch, DEFAULT_PATH,
};
use kiln_cuda::Gpu;

use crate::bench_lm_head::{read_peer, upload, Values};

/// Arguments of `kiln bench sample`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchSampleArgs {
    /// JSON written by `bench/peers/sample.py` ({mode: {"BATCH": microseconds}}).
    #[arg(long)]
    pub peer: Option<PathBuf>,
    /// Vocabulary size.
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Batches timed per case (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub batches: usize,
    /// Launches per batch.
    #[arg(long, default_value_t = 20)]
    pub launches: usize,
    /// Also write the table (markdown) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The modes of the table, the same names as the peer's.
fn modes() -> Vec<(&'static str, SamplingParams)> {
    let d = SamplingParams { temperature: 0.8, seed: 1234, ..SamplingParams::default() };
    vec![
        ("greedy", SamplingParams::greedy()),
        ("temperature", d),
        ("top_k", SamplingParams { top_k: 50, ..d }),
        ("top_p", SamplingParams { top_p: 0.9, ..d }),
        ("top_k_top_p", SamplingParams { top_k: 50, top_p: 0.9, ..d }),
        ("min_p", SamplingParams { min_p: 0.05, ..d }),
        ("top_k_min_p", SamplingParams { top_k: 50, min_p: 0.05, ..d }),
        (
            "top_k_penalties",
            SamplingParams {
                top_k: 50,
                top_p: 0.9,
                repetition_penalty: 1.1,
                frequency_penalty: 0.2,
                presence_penalty: 0.1,
                ..d
            },
        ),
        (
            "penalties",
            SamplingParams { repetition_penalty: 1.1, frequency_penalty: 0.2, presence_penalty: 0.1, ..d },
        ),
    ]
}

/// Runs the benchmark and prints the table.
pub fn run(args: &BenchSampleArgs) -> Result<()> {
    let gpu = Gpu::open(0)?;
    let peer: BTreeMap<String, BTreeMap<String, f64>> =
        read_peer(args.peer.as_deref(), "bench/peers/sample.py")?;
    let vocab = args.vocab;
    if vocab == 0 {
        return Err(Error::InvalidArgument {
            name: "--vocab",
            value: "0".into(),
            reason: "must be positive".into(),
        });
    }
    let mut table = format!(
        "Sampler, vocabulary {vocab}, on {} ({})\n\n\
         | mode | batch | time_us | fused_us | fused_mass_us | torch_us | torch / kiln | torch / fused |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        gpu.facts().name,
        gpu.arch()
    );
    let mut values = Values::fresh();
    for batch in [1usize, 64] {
        let sets = 4;
        let logits = (0..sets)
            .map(|_| {
                let bytes: Vec<u8> =
                    (0..batch * vocab).flat_map(|_| (values.next() * 12.0).to_le_bytes()).collect();
                upload(&gpu, &bytes)
            })
            .collect::<Result<Vec<_>>>()?;
        let histories: Vec<Vec<u32>> =
            (0..batch).map(|r| (0..256).map(|i| ((r * 977 + i * 131) % vocab) as u32).collect()).collect();
        let history_refs: Vec<&[u32]> = histories.iter().map(Vec::as_slice).collect();
        let (offsets, tokens) = encode_histories(&history_refs, vocab)?;
        let offsets_dev = upload(&gpu, &offsets.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        let history_dev = upload(&gpu, &tokens.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        let counts = gpu.alloc(batch * vocab * 4)?;
        counts.fill_bytes(0)?;
        let scratch = gpu.alloc(batch * vocab * 4)?;
        let out = gpu.alloc(batch * 4)?;
        let sample_scratch = SampleScratch::new(&gpu, batch, vocab)?;
        let steps: Vec<u8> = (0..batch as u64).flat_map(|s| s.to_le_bytes()).collect();
        let steps_dev = upload(&gpu, &steps)?;
        for (name, params) in modes() {
            let rows: Vec<(SamplingParams, u64)> = (0..batch).map(|r| (params, r as u64)).collect();
            let params_dev = upload(&gpu, &encode_params(&rows)?)?;
            let penalties = params.has_penalties();
            let time = |path: SamplePath| {
                median_launch_us(&gpu, args.batches, args.launches, |i| {
                    let buffers = SampleBuffers {
                        logits: &logits[i % sets],
                        row_stride: vocab,
                        params: &params_dev,
                        steps: &steps_dev,
                        history_offsets: &offsets_dev,
                        history: &history_dev,
                        penalty: penalties.then_some(PenaltyScratch { counts: &counts, scratch: &scratch }),
                        stats: None,
                        tokens: &out,
                        scratch: Some(&sample_scratch),
                    };
                    sample_with_path(&gpu, batch, vocab, buffers, path)
                })
            };
            let us = time(DEFAULT_PATH)?;
            // The fused path in one launch (rows without top-k then run on one block each), and
            // with the mass path for those rows.
            let fused_us = time(SamplePath::Fused)?;
            let fused_mass_us = time(SamplePath::FusedMass)?;
            let torch = peer.get(name).and_then(|m| m.get(&batch.to_string())).copied();
            let ratio = |kiln: f64| torch.map_or("-".to_owned(), |t| format!("{:.2}x", t / kiln));
            table.push_str(&format!(
                "| {name} | {batch} | {us:.1} | {fused_us:.1} | {fused_mass_us:.1} | {} | {} | {} |\n",
                torch.map_or("-".to_owned(), |t| format!("{t:.1}")),
                ratio(us),
                ratio(fused_us),
            ));
        }
    }
    print!("{table}");
    if let Some(path) = &args.out {
        std::fs::write(path, &table).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}
