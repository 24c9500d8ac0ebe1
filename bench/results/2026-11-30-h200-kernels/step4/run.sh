#!/usr/bin/env bash
# x2. GPU 1: the tests of the new defaults (sampler routing, LM head default, engine), then the LM head and sampler benches with their peers.
# GPU 0: the attention peer, attention and LM head certification (llama3-8b, smollm2-135m), the attention bench.
set -u
O=$OUT; R=/tmp/r11; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer5/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 200 test-gpu_sample tests/gpu_sample --test-threads=1 &
  T 200 test-gpu_lm_head tests/gpu_lm_head &
  T 200 test-gpu_engine tests/gpu_engine --test-threads=1 &
  wait
  T 40 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 100 bench-lm-head ./kiln bench lm-head --peer $R/lm_head_torch.json
  T 60 bench-sample ./kiln bench sample --peer $R/sample_torch.json ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 100 certify-attention-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel attention --out tuning/certificates --report $R/tuning-attention-llama3-8b.md
  T 80 certify-attention-smollm2 ./kiln tune certify --shapes smollm2-135m --kernel attention --out tuning/certificates --report $R/tuning-attention-smollm2.md
  T 120 certify-lm_head-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel lm-head --out tuning/certificates --report $R/tuning-lm_head-llama3-8b.md
  T 60 certify-lm_head-smollm2 ./kiln tune certify --shapes smollm2-135m --kernel lm-head --out tuning/certificates --report $R/tuning-lm_head-smollm2.md
  mkdir -p $R/certificates; cp -r tuning/certificates/attention tuning/certificates/lm_head $R/certificates/
  T 150 bench-attention ./kiln bench attention --peer $R/attention_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "decode|lm_head" $R/tuning-*.md | cut -d'|' -f3,5,6,7,8 | head -20
grep -E "top_k|greedy" $R/bench-sample.txt | cut -c1-120
grep -E "^\| (1|8|64) \|.*certified" $R/bench-attention.txt
grep -E "^\| 151936" $R/bench-lm-head.txt
cd /tmp && tar -czf $O/r11.tgz r11
