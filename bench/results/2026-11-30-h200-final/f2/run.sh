#!/usr/bin/env bash
# One H200: decode attention with the short class ending at 8192 positions (the shipped certificates), three
# runs of the decode table with PyTorch in the same run; gpu_attention.
set -u
O=$OUT; R=/tmp/f2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
for i in 1 2 3; do
  T 60 peer-attention-$i python3 bench/peers/attention.py --out $R/attention_torch-$i.json
  T 120 bench-attention-$i ./kiln bench attention --decode-only zzz --peer $R/attention_torch-$i.json
  grep -E "^\| (1|8|64) \| " $R/bench-attention-$i.txt | cut -c1-150
done
T 200 test-gpu_attention tests/gpu_attention --test-threads=1
tail -3 $R/test-gpu_attention.txt
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f2.tgz f2
