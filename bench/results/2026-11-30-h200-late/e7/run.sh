#!/usr/bin/env bash
# One H200: K/V tiles in swizzled unpadded rows. PyTorch peer; the decode table with the certified configurations
# (batch 1, 8, 64; 1k to 128k) and alt-1x4x32.s2 at batch 8; Nsight Compute L2 sectors at batch 8 / 128k; gpu_attention.
set -u
O=$OUT; R=/tmp/e7; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 100 bench-attention ./kiln bench attention --decode-only zzz --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | cut -c1-150
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
T 60 ncu-alt ncu --clock-control none -k regex:^kiln_attention$ -s 3 -c 1 --metrics $M ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s2 --decode-batches 8 --decode-contexts 131072 --iterations 3
grep -E "^\s+[a-z_]+__[a-z_.]+ " $R/ncu-alt.txt | awk '{print $1, $(NF)}'
( cd /tmp && tar -czf $O/e7-part.tgz e7 )
T 200 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "test result|FAILED|panicked|^exit" $R/test-gpu_attention.txt | head -5
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/e7.tgz e7
