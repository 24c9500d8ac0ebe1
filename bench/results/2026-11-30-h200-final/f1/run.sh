#!/usr/bin/env bash
# One H200: decode attention at 4k and 16k for candidate configurations (short/long class boundary), PyTorch in the same run.
set -u
O=$OUT; R=/tmp/f1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
rm -rf bundle/tuning/certificates && cp -r tuning/certificates bundle/tuning/certificates
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
T 200 bench-attention ./kiln bench attention --decode-only extra --decode-configs 1x4x32.s1,1x4x32.s2,1x4x32.s4,1x4x32.s8,1x4x32.s16,alt-1x4x32.s2,1x4x16.s2,1x4x16.s4,1x4x16.s8,deep-1x4x16.s2,deep-1x4x16.s4,deep-1x4x32.s2 --decode-contexts 4096,16384 --peer $R/attention_torch.json
grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | cut -c1-160
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f1.tgz f1
