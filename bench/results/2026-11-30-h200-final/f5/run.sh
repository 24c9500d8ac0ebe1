#!/usr/bin/env bash
# One H200: decode attention at 1k-16k, batch 8, the one-stage (alt) decode at 2-8 splits beside the certified configuration.
set -u
O=$OUT; R=/tmp/f5; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
[ -e /tmp/keep/bundle/COMMIT ] || { tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz; }; rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 200 bench-attention ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s2,alt-1x4x32.s3,alt-1x4x32.s4,alt-1x4x32.s6,alt-1x4x32.s8,alt-1x4x16.s4,alt-1x4x16.s8,1x4x32.s2,1x4x32.s3 --decode-batches 8 --decode-contexts 1024,4096,16384 --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | cut -c1-150
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f5.tgz f5
