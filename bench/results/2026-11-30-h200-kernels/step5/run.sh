#!/usr/bin/env bash
# x2. GPU 1: the sampler and engine tests. GPU 0: the sampler's PyTorch peer (same run), its profile and its bench.
set -u
O=$OUT; R=/tmp/r12; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer5/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 200 test-gpu_sample tests/gpu_sample --test-threads=1 &
  T 200 test-gpu_engine tests/gpu_engine --test-threads=1 &
  wait ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 60 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 60 sample-profile ./kiln bench sample --profile
  T 90 bench-sample ./kiln bench sample --peer $R/sample_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
grep -E "^\| (top_k|greedy)" $R/bench-sample.txt | cut -c1-150
grep -A10 "top_k_top_p batch (1|64) TopKBound" -E $R/sample-profile.txt
cd /tmp && tar -czf $O/r12.tgz r12
