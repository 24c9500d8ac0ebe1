#!/usr/bin/env bash
# One H200, c8cfd69: Nsight Compute issue / stall metrics of the 8-row LM head, 16w/4v/64txs4c and
# 16w/4v/64txs2c (split loop, two buffers), and source counters (SASS) of 16w/4v/64txs4c.
set -u
O=$OUT; R=/tmp/r2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer14/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
cat bundle/COMMIT > $R/commit.txt; cp .xfer14/r2.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
M=sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__warps_active.avg.per_cycle_active,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_fmaheavy.sum,smsp__inst_executed_pipe_fmalite.sum
for v in 16w/4v/64txs4c 16w/4v/64txs2c; do
  n=$(echo $v | tr '/' '_')
  T 100 ncu-$n ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --metrics $M ./kiln bench lm-head --rows 8 --variants $v --batches 1 --launches 2
  grep -E "ratio|pct|inst_executed|duration|per_second|per_cycle" $R/ncu-$n.txt | awk '{print $1, $NF}'
done
T 150 ncu-src ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --section SourceCounters --section WarpStateStats -o $R/s4c ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4c --batches 1 --launches 2
T 60 ncu-src-page ncu -i $R/s4c.ncu-rep --page source --csv --print-source sass
gzip -f $R/ncu-src-page.txt; rm -f $R/s4c.ncu-rep
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/r2.tgz r2
