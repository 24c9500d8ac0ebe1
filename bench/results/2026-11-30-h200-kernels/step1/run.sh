#!/usr/bin/env bash
# x2. GPU 1: attention + sampler tests. GPU 0: read-bandwidth probe, bench sample, bench attention.
set -u
O=$OUT; R=/tmp/r8; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer5/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  timeout 150 tests/gpu_attention --test-threads=1 > $R/test-gpu_attention.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_attention.txt
  timeout 90 tests/gpu_sample --test-threads=1 > $R/test-gpu_sample.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_sample.txt ) &
( export CUDA_VISIBLE_DEVICES=0
  ( /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/readbw .xfer5/readbw.cu && timeout 60 /tmp/readbw ) > $R/readbw.txt 2>&1
  cd bundle
  timeout 60 ./kiln bench sample --peer bench/sample_torch.json > $R/bench-sample.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-sample.txt
  timeout 330 ./kiln bench attention --peer bench/attention_torch.json > $R/bench-attention.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-attention.txt ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
cat $R/readbw.txt
grep -E "top_k_top_p|exit" $R/bench-sample.txt | head -5
grep -E "^\| (1|8) \| (4096|131072|32768|16384) .*(certified|stream)|exit" $R/bench-attention.txt | head -40
cd /tmp && tar -czf $O/r8.tgz r8
