#!/usr/bin/env bash
# One H200: decode attention at batch 8, 4096 positions under Nsight Compute (kernel durations and DRAM
# throughput of the certified short configuration and of 1x4x32.s2) and PyTorch SDPA's kernels the same way.
set -u
O=$OUT; R=/tmp/f4; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__cycles_active.avg,smsp__warps_active.avg.per_cycle_active,launch__grid_size,launch__registers_per_thread
T 200 ncu-kiln ncu --clock-control none -k regex:^kiln_attention$ -s 20 -c 6 --metrics $M ./kiln bench attention --decode-only extra --decode-configs 1x4x32.s2 --decode-batches 8 --decode-contexts 4096
cp ../.xfer11/fa2_b8.py $R/ 2>/dev/null
cat > $R/sdpa_b8_4k.py <<'PY'
import torch, torch.nn.functional as F
q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(30):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
PY
T 200 ncu-torch ncu --clock-control none -s 20 -c 6 --metrics $M python3 $R/sdpa_b8_4k.py
grep -E "kiln_attention|flash|gpu__time_duration|dram__throughput|dram__bytes_read|sm__cycles_active|warps_active|grid_size|registers" $R/ncu-kiln.txt | head -30
grep -E "  [a-zA-Z_].*\(|gpu__time_duration|dram__throughput|dram__bytes_read|sm__cycles_active|warps_active|grid_size|registers" $R/ncu-torch.txt | head -40
grep -E "^\| 8 \| 4096" $R/ncu-kiln.txt | cut -c1-150
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f4.tgz f4
