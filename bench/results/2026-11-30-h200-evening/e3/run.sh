#!/usr/bin/env bash
# alt decode at three blocks a multiprocessor (KILN_DECODE_MIN_BLOCKS=3) against two, batch 8.
set -u
O=$OUT; R=/tmp/e3; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd .xfer10/mini; cat COMMIT > $R/commit.txt
T 80 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
C="--decode-only extra --iterations 15 --decode-batches 8 --decode-contexts 16384,32768,131072 --peer $R/attention_torch.json"
T 200 bench-b8 ./kiln bench attention $C --decode-configs alt-1x4x32.s4,alt-1x4x16.s4
KILN_DECODE_MIN_BLOCKS=3 T 200 bench-b8-3blocks ./kiln bench attention $C --decode-configs alt-1x4x32.s6,alt-1x4x32.s4,alt-1x4x16.s6,alt-1x4x16.s5,alt-1x4x16.s8
echo "total $((SECONDS-t0)) s"
for f in $R/bench-*.txt; do echo "== $f"; grep -hE "^\| (8|64|1) \| " $f | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'; done
cd /tmp && tar -czf $O/e3.tgz e3
