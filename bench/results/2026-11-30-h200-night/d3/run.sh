#!/usr/bin/env bash
# x2. GPU 1: gpu_sample, gpu_engine (TopKHeads threshold lists). GPU 0: sampler bench + profile; LM head 8 rows under ncu (issue, clock, DRAM).
set -u
O=$OUT; R=/tmp/d3; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache PATH=/usr/local/cuda/bin:$PATH
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 300 test-gpu_sample tests/gpu_sample --test-threads=1
  T 150 test-gpu_engine tests/gpu_engine --test-threads=1 ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 100 bench-sample-profile ./kiln bench sample --profile
  T 150 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  M=sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum.per_second,gpu__time_duration.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__warps_active.avg.per_cycle_active
  T 120 ncu-lm-head ncu --clock-control none -k regex:kiln_lm_head -s 3 -c 2 --metrics $M ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4c --batches 1 --launches 2 ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (greedy|top_k_top_p|top_k|top_k_min_p) " $R/bench-sample.txt | cut -c1-150
grep -A13 "top_k_top_p batch 1 TopKHeads" $R/bench-sample-profile.txt
grep -A13 "greedy batch 1 TopKHeads" $R/bench-sample-profile.txt
grep -E "kiln_lm_head|per_second|pct|inst_executed|duration|ratio|per_cycle" $R/ncu-lm-head.txt | head -40
cd /tmp && tar -czf $O/d3.tgz d3
