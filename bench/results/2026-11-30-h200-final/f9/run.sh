#!/usr/bin/env bash
# One H200: gpu_attention and gpu_engine with FP8 pages (4-deep code pipeline), then decode attention over FP8
# pages and over bf16 pages with PyTorch in the same run.
set -u
O=$OUT; R=/tmp/f9; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 240 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "test result|FAILED|panicked" $R/test-gpu_attention.txt | head; grep -E "^q_heads.*KV_FP8|fp8" $R/test-gpu_attention.txt | head -3
T 120 test-gpu_engine tests/gpu_engine --test-threads=1 --nocapture
grep -E "test result|FAILED|panicked|fp8 step" $R/test-gpu_engine.txt | head -20
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 150 bench-attention-fp8 ./kiln bench attention --decode-only zzz --kv-fp8 --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention-fp8.txt | cut -d'|' -f2-7,9
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f9.tgz f9
