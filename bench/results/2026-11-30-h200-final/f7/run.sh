#!/usr/bin/env bash
# One H200: gpu_attention and gpu_engine with the cluster combine (one block a multiprocessor or fewer), attention
# re-certified for llama3-8b (into the bundle's certificates), then the decode table three times and the whole
# attention benchmark once in strict tuning mode, PyTorch before each.
set -u
O=$OUT; R=/tmp/f7; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 200 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "test result|FAILED|panicked" $R/test-gpu_attention.txt | head -5
T 100 test-gpu_engine tests/gpu_engine --test-threads=1
grep -E "test result|FAILED|panicked" $R/test-gpu_engine.txt | head -5
cp -r tuning/certificates $R/certificates-before
T 120 certify-attention-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel attention --out tuning/certificates --report $R/tuning-attention-llama3-8b.md
cp -r tuning/certificates $R/certificates-after
grep -E "decode" $R/tuning-attention-llama3-8b.md | cut -d'|' -f3,5,6,7,8 | cut -c1-200
for i in 1 2 3; do
  T 60 peer-attention-$i python3 bench/peers/attention.py --out $R/attention_torch-$i.json
  T 100 bench-attention-$i ./kiln bench attention --decode-only zzz --peer $R/attention_torch-$i.json
  grep -E "^\| (1|8|64) \| " $R/bench-attention-$i.txt | cut -d'|' -f2-5,9
done
T 60 peer-attention-full python3 bench/peers/attention.py --out $R/attention_torch-full.json
T 300 bench-attention-full env KILN_TUNING=strict ./kiln bench attention --peer $R/attention_torch-full.json --out $R/attention-full.md
grep -E "^\| (1024|4096|16384) \| certified" $R/bench-attention-full.txt | cut -c1-150
grep -E "^\| (1|8|64) \| .*certified" $R/bench-attention-full.txt | cut -d'|' -f2-5,9
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f7.tgz f7
