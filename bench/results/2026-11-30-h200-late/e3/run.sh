#!/usr/bin/env bash
# One H200: Nsight Compute of decode attention at batch 8 / 128k (alt-1x4x32.s4 and FlashAttention-2 through
# PyTorch SDPA), and of the NVFP4 norm at 8192x8192 and 2048x4096: throughput, stall reasons, source counters.
set -u
O=$OUT; R=/tmp/e3; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum.per_second,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__shared_mem_per_block_static,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__waves_per_multiprocessor,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__warps_active.avg.per_cycle_active
cd bundle
P() { local name=$1; shift; T 150 ncu-$name ncu --clock-control none "$@"; grep -E "^\s+[a-z_]+__[a-z_.]+ " $R/ncu-$name.txt | awk '{print $1, $(NF)}' | head -40; }
echo "== alt b8 128k"; P alt -k regex:^kiln_attention$ -s 3 -c 1 --metrics $M ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s4 --decode-batches 8 --decode-contexts 131072 --iterations 3
echo "== fa2 b8 128k"; P fa2 -k regex:flash -s 2 -c 1 --metrics $M python3 ../.xfer11/fa2_b8.py
echo "== nvfp4 8192"; P nvfp4-8192 -k regex:kiln_norm -s 3 -c 1 --metrics $M ./kiln bench norm --cases rms_norm_nvfp4 --sizes 8192x8192 --default-only --batches 1 --launches 1
echo "== nvfp4 2048"; P nvfp4-2048 -k regex:kiln_norm -s 3 -c 1 --metrics $M ./kiln bench norm --cases rms_norm_nvfp4 --sizes 2048x4096 --default-only --batches 1 --launches 1
( cd /tmp && tar -czf $O/e3-part.tgz e3 )
T 150 ncu-src-alt ncu --clock-control none -k regex:^kiln_attention$ -s 3 -c 1 --section SourceCounters --section WarpStateStats -o $R/alt ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s4 --decode-batches 8 --decode-contexts 131072 --iterations 3
T 60 src-alt ncu -i $R/alt.ncu-rep --page source --csv --print-source sass
T 120 ncu-src-nvfp4 ncu --clock-control none -k regex:kiln_norm -s 3 -c 1 --section SourceCounters --section WarpStateStats -o $R/nvfp4 ./kiln bench norm --cases rms_norm_nvfp4 --sizes 8192x8192 --default-only --batches 1 --launches 1
T 60 src-nvfp4 ncu -i $R/nvfp4.ncu-rep --page source --csv --print-source sass
rm -f $R/*.ncu-rep
wc -l $R/src-*.txt
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/e3.tgz e3
