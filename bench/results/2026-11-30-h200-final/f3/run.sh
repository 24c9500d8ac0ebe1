#!/usr/bin/env bash
# One H200: the whole attention benchmark (prefill table with every prefill variant, decode table with the
# certified configuration and the comparison rows), PyTorch in the same run, at the shipped certificates.
set -u
O=$OUT; R=/tmp/f3; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 90 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 400 bench-attention env KILN_TUNING=strict ./kiln bench attention --peer $R/attention_torch.json --out $R/attention.md
grep -E "^\| (1024|4096|16384) \|" $R/bench-attention.txt | cut -c1-170
grep -E "^\| (1|8|64) \| .*certified" $R/bench-attention.txt | cut -c1-150
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f3.tgz f3
