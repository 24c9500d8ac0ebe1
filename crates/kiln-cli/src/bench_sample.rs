//! `kiln bench sample`: the sampler at vocabulary 151936 for batch 1 and 64 in each mode,
//! against PyTorch's sort-based top-k / top-p with `torch.multinomial`
//! (`bench/peers/sample.py`, whose JSON output `--peer` reads).
//!
//! Logits are random (never zeros) and rotate over several sets so they do not all sit in L2.
//! Times are CUDA-event medians per launch. The sampler's scratch is allocated once per batch,
//! as a decode loop (or a captured graph) does. Columns: `path`, the path
//! `SamplePath::for_rows` picks for the batch's parameters (what the engine runs), timed with
//! events around batches of launches (`time_us`) and graph-timed (`graph_us`: the same launches
//! captured once in a CUDA graph and replayed, as the engine replays its decode step, so the
//! host's launch cost is not counted); then each path graph-timed: the default of `sample`
//! (`SamplePath::Auto`: the fused path for greedy and top-k rows, the mass path for the others,
//! four launches; also event-timed), the fused path in one launch (`SamplePath::Fused`; rows
//! without top-k run on one block each, so only greedy and top-k rows are fast there), the
//! lists with the mass path (`SamplePath::Lists`) and, for greedy rows, the greedy kernel
//! (`SamplePath::Greedy`), and, for greedy and top-k rows without penalties, the top-k merge
//! kernel (`SamplePath::TopKMerge`, a candidate not chosen by `for_rows`), the top-k bound
//! kernel (`SamplePath::TopKBound`: several top-k rows), the same kernel on 512-thread blocks
//! (`SamplePath::TopKWide`: a single row past `TOPK_HEADS_KMAX`) and with the slices' lists
//! (`SamplePath::TopKHeads`: a single top-k row up to `TOPK_HEADS_KMAX`).
//!
//! `--profile` prints, instead of the table, the phases of the top-k bound (its three compiles)
//! and top-k merge kernels compiled with `SAMPLE_PROFILE=1` (one launch a sample, the median of several) for
//! their modes at batch 1 and 64: where the microseconds go, in a few seconds.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_core::ops::sample::SamplingParams;
use kiln_core::{Error, Result};
use kiln_cuda::certify::{median_graph_launch_us, median_launch_us};
use kiln_cuda::ops::sample::{
    encode_histories, encode_params, sample_with_path, sample_with_path_profiled, PenaltyScratch,
    SampleBuffers, SamplePath, SampleScratch, DEFAULT_PATH, PROFILE_SLOTS, TOPK_BOUND_KMAX, TOPK_MERGE_KMAX,
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
    /// Print the phases of the top-k bound (both last blocks) and top-k merge kernels (compiled with
    /// SAMPLE_PROFILE=1) instead of the table.
    #[arg(long)]
    pub profile: bool,
}

/// Profiled launches a case (the median of each slot is printed).
const PROFILE_RUNS: usize = 9;

/// The median over `runs` of slot `i`, with `f` of the slots.
fn median_of(runs: &[Vec<u64>], f: impl Fn(&[u64]) -> f64) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(|r| f(r)).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The profile lines of one case: the kernel's span from the first block's entry (ns of
/// %globaltimer), block (0, 0)'s phases and the phases of row 0's last block (SM cycles, and
/// microseconds at the clock that block measured), row 0's counts.
fn profile_lines(name: &str, batch: usize, path: SamplePath, runs: &[Vec<u64>]) -> String {
    let ns = |a: usize| move |r: &[u64]| r[a].wrapping_sub(!r[0]) as f64;
    let cycles = |a: usize, b: usize| move |r: &[u64]| r[b].wrapping_sub(r[a]) as f64;
    // The last block's clock: its cycles over its nanoseconds.
    let ghz =
        median_of(runs, |r| r[22].wrapping_sub(r[16]) as f64 / (r[25].wrapping_sub(r[24]) as f64).max(1.0))
            .max(0.1);
    let mut out = format!(
        "{name} batch {batch} {path:?}: span {:.2} us (last ticket at {:.2} us, row 0's last block {:.2} to {:.2} us), \
         clock {ghz:.2} GHz\n",
        median_of(runs, ns(2)) / 1e3,
        median_of(runs, ns(1)) / 1e3,
        median_of(runs, ns(24)) / 1e3,
        median_of(runs, ns(25)) / 1e3,
    );
    // A phase the launches did not reach (a greedy row skips the weights) has no stamps.
    let phase = |label: &str, a: usize, b: usize| {
        let reached: Vec<Vec<u64>> = runs.iter().filter(|r| r[a] != 0 && r[b] != 0).cloned().collect();
        if reached.is_empty() {
            return format!("  {label:<28} {:>8} cycles {:>7} us\n", "-", "-");
        }
        let c = median_of(&reached, cycles(a, b));
        format!("  {label:<28} {c:>8.0} cycles {:>7.2} us\n", c / ghz / 1e3)
    };
    // (label, first slot, last slot) of each phase of the path's kernel.
    // The heads path's row 0 that found a saturated list ran the bound path's last block.
    let heads = path == SamplePath::TopKHeads && runs.iter().all(|r| r[40] == 0);
    let phases: &[(&str, usize, usize)] = if heads {
        &[
            ("block (0,0) keys loaded", 8, 9),
            ("block (0,0) candidates", 9, 12),
            ("block (0,0) barrier", 12, 13),
            ("block (0,0) list ranked", 13, 14),
            ("block (0,0) fence + barrier", 14, 10),
            ("block (0,0) ticket", 10, 11),
            ("last block: lists + row max", 16, 17),
            ("last block: bins + pick", 17, 18),
            ("last block: candidates", 18, 20),
            ("last block: rank", 20, 21),
            ("last block: finish", 21, 22),
        ]
    } else if path == SamplePath::TopKMerge {
        &[
            ("block (0,0) slice loaded", 8, 9),
            ("block (0,0) histogram + pick", 9, 10),
            ("block (0,0) list written", 10, 11),
            ("block (0,0) fence + ticket", 11, 12),
            ("last block: heads staged", 16, 17),
            ("last block: bound", 17, 18),
            ("last block: survivors", 18, 19),
            ("last block: rank", 19, 20),
            ("last block: finish", 20, 22),
        ]
    } else {
        &[
            ("block (0,0) keys loaded", 8, 9),
            ("block (0,0) maxima + fence", 9, 10),
            ("block (0,0) ticket", 10, 11),
            ("last block: maxima + row max", 16, 17),
            ("last block: bins + bound search", 17, 18),
            ("last block: groups listed", 18, 19),
            ("last block: gather", 19, 20),
            ("last block: rank", 20, 21),
            ("last block: finish", 21, 22),
        ]
    };
    for &(label, a, b) in phases {
        out.push_str(&phase(label, a, b));
    }
    if path == SamplePath::TopKMerge {
        let last = &runs[runs.len() - 1];
        out.push_str(&format!(
            "  row 0: k {}, {} slices, staged depth {}, {} survivors, fallback {}\n",
            last[35], last[37], last[38], last[33], last[36]
        ));
        return out;
    }
    let last = &runs[runs.len() - 1];
    if heads {
        out.push_str(&format!(
            "  row 0: k {}, {} slices, {} listed tokens, {} candidates, fallback {}\n",
            last[35], last[37], last[32], last[34], last[36]
        ));
        return out;
    }
    if path == SamplePath::TopKHeads {
        let saturated = runs.iter().filter(|r| r[40] != 0).count();
        out.push_str(&format!(
            "  {saturated} of {} runs found a saturated list (the bound path's phases)\n",
            runs.len()
        ));
    }
    out.push_str(&format!(
        "  row 0: k {}, {} slices of {} groups, {} valid groups, {} radix passes (crowded bin), {} candidate groups, {} \
         candidates, fallback {}\n",
        last[35], last[37], last[38], last[32], last[39], last[33], last[34], last[36]
    ));
    out
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
         | mode | batch | path | time_us | graph_us | auto_us | auto_graph_us | fused_graph_us | lists_graph_us \
         | greedy_graph_us | topk_merge_graph_us | topk_bound_graph_us | topk_wide_graph_us | topk_heads_graph_us \
         | torch_us | torch / kiln | torch / kiln graph |\n\
         | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: \
         | ---: | ---: |\n",
        gpu.facts().name,
        gpu.arch()
    );
    let mut values = Values::fresh();
    let mut profiles = String::new();
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
            let launch = |path: SamplePath, i: usize| {
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
            };
            let time =
                |path: SamplePath| median_launch_us(&gpu, args.batches, args.launches, |i| launch(path, i));
            let graph_time = |path: SamplePath| {
                median_graph_launch_us(&gpu, args.batches, args.launches, |i| launch(path, i))
            };
            let bound_serves =
                !penalties && (params.is_greedy() || (1..=TOPK_BOUND_KMAX).contains(&params.top_k));
            if args.profile {
                // The top-k merge kernel serves the same rows.
                for profiled in [
                    SamplePath::TopKBound,
                    SamplePath::TopKWide,
                    SamplePath::TopKHeads,
                    SamplePath::TopKMerge,
                ] {
                    if !bound_serves {
                        break;
                    }
                    let profile = gpu.alloc(PROFILE_SLOTS * 8)?;
                    let mut runs = Vec::new();
                    for i in 0..PROFILE_RUNS + 1 {
                        profile.fill_bytes(0)?;
                        let buffers = SampleBuffers {
                            logits: &logits[i % sets],
                            row_stride: vocab,
                            params: &params_dev,
                            steps: &steps_dev,
                            history_offsets: &offsets_dev,
                            history: &history_dev,
                            penalty: None,
                            stats: None,
                            tokens: &out,
                            scratch: Some(&sample_scratch),
                        };
                        sample_with_path_profiled(&gpu, batch, vocab, buffers, profiled, Some(&profile))?;
                        let bytes = profile.to_host_bytes()?;
                        let slots: Vec<u64> = bytes
                            .chunks_exact(8)
                            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                            .collect();
                        if i > 0 {
                            runs.push(slots); // the first launch compiles and warms
                        }
                    }
                    let lines = profile_lines(name, batch, profiled, &runs);
                    print!("{lines}");
                    profiles.push_str(&lines);
                }
                continue;
            }
            let path = SamplePath::for_rows(rows.iter().map(|(p, _)| p));
            let us = time(path)?;
            let graph_us = graph_time(path)?;
            let auto_us = time(DEFAULT_PATH)?;
            let auto_graph_us = graph_time(DEFAULT_PATH)?;
            let fused_graph_us = graph_time(SamplePath::Fused)?;
            let lists_graph_us = graph_time(SamplePath::Lists)?;
            // The greedy kernel serves only greedy rows without penalties (the others run on one
            // block each there).
            let greedy_graph_us = if params.is_greedy() && !penalties {
                format!("{:.1}", graph_time(SamplePath::Greedy)?)
            } else {
                "-".to_owned()
            };
            // The top-k merge kernel serves greedy rows and rows with 1 <= top_k <=
            // TOPK_MERGE_KMAX, without penalties (the others run on one block each there).
            let merge_serves =
                !penalties && (params.is_greedy() || (1..=TOPK_MERGE_KMAX).contains(&params.top_k));
            let topk_merge_graph_us = if merge_serves {
                format!("{:.1}", graph_time(SamplePath::TopKMerge)?)
            } else {
                "-".to_owned()
            };
            let topk_bound_graph_us = if bound_serves {
                format!("{:.1}", graph_time(SamplePath::TopKBound)?)
            } else {
                "-".to_owned()
            };
            let topk_wide_graph_us = if bound_serves {
                format!("{:.1}", graph_time(SamplePath::TopKWide)?)
            } else {
                "-".to_owned()
            };
            let topk_heads_graph_us = if bound_serves {
                format!("{:.1}", graph_time(SamplePath::TopKHeads)?)
            } else {
                "-".to_owned()
            };
            let torch = peer.get(name).and_then(|m| m.get(&batch.to_string())).copied();
            let ratio = |kiln: f64| torch.map_or("-".to_owned(), |t| format!("{:.2}x", t / kiln));
            table.push_str(&format!(
                "| {name} | {batch} | {path:?} | {us:.1} | {graph_us:.1} | {auto_us:.1} | {auto_graph_us:.1} \
                 | {fused_graph_us:.1} | {lists_graph_us:.1} | {greedy_graph_us} | {topk_merge_graph_us} \
                 | {topk_bound_graph_us} | {topk_wide_graph_us} | {topk_heads_graph_us} | {} | {} | {} |\n",
                torch.map_or("-".to_owned(), |t| format!("{t:.1}")),
                ratio(us),
                ratio(graph_us),
            ));
        }
    }
    if args.profile {
        if let Some(path) = &args.out {
            std::fs::write(path, &profiles).map_err(|e| Error::io(path, e))?;
        }
        return Ok(());
    }
    table.push_str(
        "\npath: SamplePath::for_rows of the batch's parameters. time_us, auto_us: CUDA events around \
         batches of launches, per launch. *graph_us: the same launches captured in one CUDA graph and \
         replayed (no host launch cost). torch: events per launch; torch / kiln against time_us, torch / \
         kiln graph against graph_us.\n",
    );
    print!("{table}");
    if let Some(path) = &args.out {
        std::fs::write(path, &table).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}
