#!/usr/bin/env bash
# x2. GPU 1: gpu_norm (NVFP4 codes of the exact product y * inverse). GPU 0: gpu_attention (bulk-copy
# decode variant), then PyTorch peers, decode attention at batch 8 (alt vs bulk), norm benchmark.
set -u
O=$OUT; R=/tmp/e2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
NG=$(nvidia-smi -L | wc -l)
if [ "$NG" -ge 2 ]; then G1=1; else G1=0; fi
( export CUDA_VISIBLE_DEVICES=$G1; cd bundle
  T 480 test-gpu_norm tests/gpu_norm ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 200 test-gpu_attention tests/gpu_attention --test-threads=1
  T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 150 bench-attention-b8 ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s4,bulk-1x4x32.s4 --decode-batches 8 --decode-contexts 16384,32768,131072 --peer $R/attention_torch.json
  ( cd /tmp && tar -czf $O/e2-part.tgz e2 )
  T 150 bench-norm ./kiln bench norm --default-only --variants lanes,total --peer $R/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s  gpus $NG"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
grep -E "^\| 8 \| " $R/bench-attention-b8.txt | cut -c1-200
grep -E "nvfp4|int8" $R/bench-norm.txt | grep -v "^same\|: " | cut -c1-160
cd /tmp && tar -czf $O/e2.tgz e2
