#!/usr/bin/env bash
# Decode and prefill attention at the final code (certified configurations) with PyTorch's peer in the same run.
set -u
O=$OUT; R=/tmp/r22; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer9/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 80 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 130 bench-attention ./kiln bench attention --decode-only zzz --iterations 15 --peer $R/attention_torch.json
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| " $R/bench-attention.txt | grep -v "^| batch\|^|---\|^| tokens" | awk -F'|' '{print $2,$3,$4,$5,$6,$7,$9}'
cd /tmp && tar -czf $O/r22.tgz r22
