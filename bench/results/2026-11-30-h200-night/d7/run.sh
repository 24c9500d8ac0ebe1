#!/usr/bin/env bash
# One H200: decode attention at batch 1 and 8 with KV pages of 64, 256 and 1024 tokens (kiln bench attention --page-tokens), PyTorch (unpaged) in the same run.
set -u
O=$OUT; R=/tmp/d7; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 90 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
for P in 64 256 1024; do
  T 150 bench-page$P ./kiln bench attention --page-tokens $P --decode-only extra --decode-configs alt-1x4x32.s4,hybrid-1x4x16.s2,1x4x32.s16 --decode-batches 1,8 --decode-contexts 16384,131072 --iterations 15 --peer $R/attention_torch.json
done
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
for P in 64 256 1024; do echo "== page $P"; grep -E "^\| (1|8) \| " $R/bench-page$P.txt | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'; done
cd /tmp && tar -czf $O/d7.tgz d7
