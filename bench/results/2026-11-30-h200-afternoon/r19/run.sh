#!/usr/bin/env bash
# x2. GPU 1: GPU tests (sampler, engine, attention, the rest of gpu_norm).
# GPU 0: PyTorch peers (norm, sampler, LM head; same run), sampler profile and bench, LM head at 8 rows, norm defaults.
set -u
O=$OUT; R=/tmp/r19; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer9/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 500 test-gpu_sample tests/gpu_sample --test-threads=1 &
  T 500 test-gpu_engine tests/gpu_engine --test-threads=1 &
  T 500 test-gpu_attention tests/gpu_attention --test-threads=1 &
  T 540 test-gpu_norm-rest tests/gpu_norm --skip quantized --skip block_lane --skip weight_ahead &
  wait ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 50 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 50 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 60 sample-profile ./kiln bench sample --profile
  T 100 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  T 80 bench-lm-head-8 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json
  T 90 bench-norm ./kiln bench norm --default-only --peer $R/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (top_k_top_p|top_k|greedy)" $R/bench-sample.txt | cut -c1-250
grep -E "span" $R/sample-profile.txt | grep "batch 1 "
grep -E "^\| 151936" $R/bench-lm-head-8.txt
grep -E "^same-size|^(rms|layer)[a-z_0-9]* +(2048|8192)" $R/bench-norm.txt | cut -c1-140
cd /tmp && tar -czf $O/r19.tgz r19
