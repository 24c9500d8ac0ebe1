#!/usr/bin/env bash
# x2. GPU 1: gpu_norm (every test: the new NVFP4 code default and the +t variants).
# GPU 0: PyTorch peers (sampler, norm), the sampler's profile and bench (TopKHeads), norm defaults and the +t variants.
set -u
O=$OUT; R=/tmp/m1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer10/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 570 test-gpu_norm tests/gpu_norm --test-threads=2 ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 50 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 90 sample-profile ./kiln bench sample --profile
  T 150 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 150 bench-norm ./kiln bench norm --variants total --peer $R/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (top_k_top_p|top_k|greedy)" $R/bench-sample.txt | cut -c1-300
grep -iE "span|heads|counts|fallback" $R/sample-profile.txt | grep "batch 1 " | head -20
grep -E "^same-size|^(rms|layer)[a-z_0-9]* +(1|2048|8192) " $R/bench-norm.txt | cut -c1-150
cd /tmp && tar -czf $O/m1.tgz m1
