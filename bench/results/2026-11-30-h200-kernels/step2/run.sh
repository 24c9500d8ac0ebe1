#!/usr/bin/env bash
# x2. GPU 1: LM head test, persistent attention tests, staged norm test + bench. GPU 0: LM head bench + torch, attention decode bench.
set -u
O=$OUT; R=/tmp/r9; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer5/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  ( timeout 90 tests/gpu_attention --test-threads=1 persistent > $R/test-gpu_attention.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_attention.txt ) &
  ( timeout 230 tests/gpu_lm_head > $R/test-gpu_lm_head.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_lm_head.txt ) &
  ( timeout 230 tests/gpu_norm staged extreme > $R/test-gpu_norm.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_norm.txt ) &
  ( timeout 200 tests/gpu_sample --test-threads=1 > $R/test-gpu_sample.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_sample.txt ) &
  ( timeout 200 tests/gpu_engine a_change_of_sampling > $R/test-gpu_engine.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/test-gpu_engine.txt ) &
  wait
  timeout 170 ./kiln bench norm --variants staged --peer bench/norm_torch.json > $R/bench-norm.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-norm.txt ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  timeout 100 ./kiln bench attention --decode-only persist,bulk --peer bench/attention_torch.json > $R/bench-attention.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-attention.txt
  timeout 60 python3 bench/peers/lm_head.py --out $R/lm_head_torch.json > $R/peer-lm_head.txt 2>&1
  timeout 200 ./kiln bench lm-head --peer $R/lm_head_torch.json > $R/bench-lm-head.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-lm-head.txt
  timeout 40 ./kiln bench sample --profile > $R/sample-profile.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/sample-profile.txt
  timeout 70 ./kiln bench sample --peer bench/sample_torch.json > $R/bench-sample.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-sample.txt ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
grep -E "^\| (1|8|64) \|.*(certified|persist|bulk)|exit" $R/bench-attention.txt | head -70
grep -E "best|exit|torch" $R/bench-lm-head.txt | head -20
grep -E "^(rms|layer)|exit" $R/bench-norm.txt | grep -v "^[a-z_]* [0-9]*x[0-9]* [0-9]" | head -30
grep -E "top_k_top_p|exit" $R/bench-sample.txt
cat $R/sample-profile.txt | head -60
cd /tmp && tar -czf $O/r9.tgz r9
