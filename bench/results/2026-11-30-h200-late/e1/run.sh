#!/usr/bin/env bash
# One H200: the lean ring (LEAN) against the cooperative ring at 8 rows, PyTorch before each run,
# nvidia-smi clocks beside; gpu_lm_head; Nsight Compute issue/stall metrics and source counters.
set -u
O=$OUT; R=/tmp/e1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 20 > $R/smi.csv 2>&1 &
SMI=$!
V=16w/4v/64txs2c,16w/4v/64txs4c,16w/4v/64txs2l,16w/4v/64txs4l,16w/4v/128txs4l,8w/4v/64txs4lb2
T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 150 bench-lm-head ./kiln bench lm-head --variants $V --peer $R/lm_head_torch.json
for i in 1 2 3; do
  T 60 peer-lm_head-$i python3 bench/peers/lm_head.py --out $R/lm_head_torch$i.json
  T 60 bench-lm-head-l$i ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4l --peer $R/lm_head_torch$i.json
  T 60 bench-lm-head-c$i ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4c --peer $R/lm_head_torch$i.json
done
kill $SMI
( cd /tmp && tar -czf $O/e1-bench.tgz e1 )
grep -h -E "^\| 151936" $R/bench-lm-head.txt
grep -h -E "^rows 8" $R/bench-lm-head-[lc][123].txt
grep -h '"8"' $R/lm_head_torch*.json
T 300 test-gpu_lm_head tests/gpu_lm_head --test-threads=1
grep -E "test result|FAILED|panicked|^exit|cases" $R/test-gpu_lm_head.txt | head -12
M=sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__warps_active.avg.per_cycle_active
for v in 16w/4v/64txs4l 16w/4v/64txs4c; do
  n=$(echo $v | tr '/' '_')
  T 120 ncu-$n ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --metrics $M ./kiln bench lm-head --rows 8 --variants $v --batches 1 --launches 2
  grep -E "ratio|pct|inst_executed|duration|per_second|per_cycle" $R/ncu-$n.txt | awk '{print $1, $NF}' | head -20
done
T 150 ncu-src ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --section SourceCounters --section WarpStateStats -o $R/lean ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4l --batches 1 --launches 2
T 60 ncu-src-page ncu -i $R/lean.ncu-rep --page source --csv --print-source sass
wc -l $R/ncu-src-page.txt; head -3 $R/ncu-src-page.txt | cut -c1-300
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/e1.tgz e1
