#!/usr/bin/env bash
# One H200: the LM head with the exchange (XCHG) on and off at 8 rows (2- and 4-stage cooperative
# rings, alternating processes), the table at 1, 2, 4, 8 rows with PyTorch, an ncu profile of the
# 8-row default, gpu_lm_head.
set -u
O=$OUT; R=/tmp/a1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer15/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer15/a1.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 100 > $R/smi.csv 2>&1 &
SMI=$!
D=16w/4v/64txs2c; S4=16w/4v/64txs4c
T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 90 bench-lm-head ./kiln bench lm-head --variants $D --peer $R/lm_head_torch.json
for i in 1 2; do
  T 60 bench8-xchg-$i ./kiln bench lm-head --rows 8 --variants $D,$S4 --peer $R/lm_head_torch.json
  KILN_LM_HEAD_OFF=XCHG T 60 bench8-noxchg-$i ./kiln bench lm-head --rows 8 --variants $D,$S4 --peer $R/lm_head_torch.json
done
kill $SMI
grep -h -E "^\| 151936|^exit" $R/bench-lm-head.txt $R/bench8-*.txt
M=sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio
T 60 ncu-xchg ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --metrics $M ./kiln bench lm-head --rows 8 --variants $D --batches 1 --launches 2
grep -E "ratio|pct|inst_executed|duration|per_second" $R/ncu-xchg.txt | awk '{print $1, $NF}'
T 240 test-gpu_lm_head tests/gpu_lm_head --test-threads=1
grep -E "test result|FAILED|panicked|^exit" $R/test-gpu_lm_head.txt | head -12
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/a1.tgz a1
