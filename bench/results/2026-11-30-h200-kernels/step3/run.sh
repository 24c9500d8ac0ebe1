#!/usr/bin/env bash
# x2. GPU 1: every GPU test of the changed families, then (once GPU 0 has certified) the attention bench.
# GPU 0: PyTorch attention peer, attention certification (llama3-8b, smollm2-135m), the other peers (same run),
# then the sampler, LM head and norm benches.
set -u
O=$OUT; R=/tmp/r10; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer5/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 220 test-gpu_sample tests/gpu_sample --test-threads=1 &
  T 220 test-gpu_attention tests/gpu_attention --test-threads=1 &
  T 220 test-gpu_norm tests/gpu_norm block_lane &
  T 220 test-gpu_lm_head tests/gpu_lm_head &
  T 220 test-gpu_engine tests/gpu_engine --test-threads=1 &
  wait
  while [ ! -f $R/certified.done ] && [ $((SECONDS-t0)) -lt 330 ]; do sleep 2; done
  T 200 bench-attention ./kiln bench attention --peer $R/attention_torch.json ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 70 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 130 certify-attention-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel attention --out tuning/certificates --report $R/tuning-attention-llama3-8b.md
  T 80 certify-attention-smollm2 ./kiln tune certify --shapes smollm2-135m --kernel attention --out tuning/certificates --report $R/tuning-attention-smollm2.md
  mkdir -p $R/certificates; cp -r tuning/certificates/attention $R/certificates/; touch $R/certified.done
  T 40 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 40 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 30 sample-profile ./kiln bench sample --profile
  T 40 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  T 100 bench-lm-head ./kiln bench lm-head --peer $R/lm_head_torch.json
  T 100 bench-norm ./kiln bench norm --variants lanes --peer $R/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "top_k_top_p" $R/bench-sample.txt
grep -E "^\| (1|8) \| (4096|131072) .*(certified|own)" $R/bench-attention.txt
grep -E "^\| 151936" $R/bench-lm-head.txt
grep -E "^rms_norm_(int8|nvfp4) +(2048|8192).*(best|certified)" $R/bench-norm.txt
cd /tmp && tar -czf $O/r10.tgz r10
