#!/usr/bin/env bash
# One H200: FP8 pages with K in fp16 against fp16 Q: gpu_attention, gpu_engine, decode over FP8 pages with PyTorch.
set -u
O=$OUT; R=/tmp/f10; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 240 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "test result|FAILED|panicked" $R/test-gpu_attention.txt | head
T 120 test-gpu_engine tests/gpu_engine --test-threads=1 --nocapture
grep -E "test result|FAILED|panicked|fp8 step" $R/test-gpu_engine.txt | head -14
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 150 bench-attention-fp8 ./kiln bench attention --decode-only zzz --kv-fp8 --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention-fp8.txt | cut -d'|' -f2-7,9
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f10.tgz f10
