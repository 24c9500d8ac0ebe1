#!/usr/bin/env bash
# x2. GPU 0: the LM head's PyTorch peer and the LM head at 8 rows (same run). GPU 1: the sampler's phase profile.
set -u
O=$OUT; R=/tmp/r21; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer9/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 200 sample-profile ./kiln bench sample --profile ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 50 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 100 bench-lm-head-8 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
cat $R/lm_head_torch.json; echo
grep -E "^\| 151936|rows 8 16w/4v/64txs" $R/bench-lm-head-8.txt
grep -A10 "top_k_top_p batch 1 TopKWide" $R/sample-profile.txt
cd /tmp && tar -czf $O/r21.tgz r21
