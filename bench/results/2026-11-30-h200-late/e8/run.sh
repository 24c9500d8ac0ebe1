#!/usr/bin/env bash
# One H200: attention re-certified for llama3-8b with the swizzled K/V tiles (into the bundle's certificates),
# then the decode table with the new certificates and PyTorch in the same run.
set -u
O=$OUT; R=/tmp/e8; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
cp -r tuning/certificates $R/certificates-before
T 100 certify-attention-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel attention --out tuning/certificates --report $R/tuning-attention-llama3-8b.md
cp -r tuning/certificates $R/certificates-after
grep -E "decode|prefill" $R/tuning-attention-llama3-8b.md | cut -c1-220
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 100 bench-attention ./kiln bench attention --decode-only zzz --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | cut -c1-150
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/e8.tgz e8
