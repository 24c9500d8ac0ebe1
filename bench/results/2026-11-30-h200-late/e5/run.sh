#!/usr/bin/env bash
# One H200: the read-only bandwidth (PyTorch sum) against a copy, and Nsight Compute of FlashAttention-2's decode at
# batch 8 / 128k with the metrics of e3 (for the comparison with alt-1x4x32).
set -u
O=$OUT; R=/tmp/e5; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi > $R/nvidia-smi.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
T 60 readbw python3 .xfer11/readbw.py
cat $R/readbw.txt
M=$(grep -o 'M=[^ ]*' .xfer11/e3.sh | head -1 | cut -c3-)
T 150 ncu-fa2 ncu --clock-control none -k regex:flash -s 2 -c 1 --metrics $M python3 .xfer11/fa2_b8.py
grep -E "^\s+[a-z_]+__[a-z_.]+ " $R/ncu-fa2.txt | awk '{print $1, $(NF)}' | head -40
grep -E "flash|Kernel|==ERR" $R/ncu-fa2.txt | head -5
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/e5.tgz e5
