#!/usr/bin/env bash
# x2, the final code. GPU 1: every GPU test of the changed families (norm, sampler, attention, engine, LM head).
# GPU 0: PyTorch peers and the benchmarks (sampler, LM head at 8 rows, decode attention, norm defaults), same run.
set -u
O=$OUT; R=/tmp/f1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer10/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 530 test-gpu_norm tests/gpu_norm &
  ( T 400 test-gpu_sample tests/gpu_sample --test-threads=1; T 150 test-gpu_engine tests/gpu_engine --test-threads=1 ) &
  ( T 250 test-gpu_attention tests/gpu_attention --test-threads=1; T 250 test-gpu_lm_head tests/gpu_lm_head ) &
  wait ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 80 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 150 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  T 90 bench-lm-head-8 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json
  T 60 bench-attention ./kiln bench attention --decode-only zzz --iterations 15 --peer $R/attention_torch.json
  T 110 bench-norm ./kiln bench norm --default-only --peer $R/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (top_k_top_p|top_k) " $R/bench-sample.txt | cut -c1-200
grep -E "^\| 151936" $R/bench-lm-head-8.txt
grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'
grep -E "certified|default" $R/bench-norm.txt | grep -E "2048x4096|8192x8192" | cut -c1-150
cd /tmp && tar -czf $O/f1.tgz f1
