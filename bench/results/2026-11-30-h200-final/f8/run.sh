#!/usr/bin/env bash
# One H200: gpu_attention with the FP8 page tests; decode attention over FP8 pages (tiled wide / deep at the
# certified splits) and over bf16 pages, PyTorch in the same run.
set -u
O=$OUT; R=/tmp/f8; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 240 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "^test |test result" $R/test-gpu_attention.txt
grep -E "panicked|fp8" $R/test-gpu_attention.txt | head -20
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 150 bench-attention-fp8 ./kiln bench attention --decode-only zzz --kv-fp8 --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention-fp8.txt | cut -d'|' -f2-6,9
T 100 bench-attention-bf16 ./kiln bench attention --decode-only zzz --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention-bf16.txt | cut -d'|' -f2-6,9
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f8.tgz f8
