#!/usr/bin/env bash
# One H200: first decode attention at batch 8 and 64 with alt2 (K a tile ahead) against alt and the certified rows, PyTorch in the same run.
set -u
O=$OUT; R=/tmp/d6; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( cd bundle
  T 90 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 150 bench-b8 ./kiln bench attention --decode-only extra --decode-configs alt2-1x4x32.s2,alt2-1x4x32.s4,alt2-1x4x32.s8,alt-1x4x32.s4 --decode-batches 8 --decode-contexts 4096,16384,32768,131072 --iterations 15 --peer $R/attention_torch.json
  T 150 bench-b64 ./kiln bench attention --decode-only extra --decode-configs alt2-1x4x32.s1,alt2-1x4x32.s2 --decode-batches 64 --decode-contexts 16384,131072 --iterations 10 --peer $R/attention_torch.json
  T 100 bench-b1 ./kiln bench attention --decode-only extra --decode-configs alt2-1x4x32.s16,alt2-1x4x32.s32 --decode-batches 1 --decode-contexts 32768,131072 --iterations 15 --peer $R/attention_torch.json
  ( cd /tmp && tar -czf $O/d6-bench.tgz d6 )
  for f in bench-b8 bench-b64 bench-b1; do echo "== $f"; grep -E "^\| (1|8|64) \| " $R/$f.txt | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'; done
  T 300 test-gpu_attention tests/gpu_attention --test-threads=1 )
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
cd /tmp && tar -czf $O/d6.tgz d6
