#!/usr/bin/env bash
set -u
O=$OUT; R=/tmp/r14; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
C=hybrid-1x4x16.s2,hybrid-1x4x16.s4,1x4x32.s2,deep-1x4x16.s2,1x4x16.s2,stream6-1x4x16.s2
for b in kv1 p512; do
timeout 200 .xfer7/kiln-$b bench attention --decode-only extra --decode-configs $C --decode-batches 8,64 --decode-contexts 32768,131072 --iterations 15 > $R/bench-$b.txt 2>&1
echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-$b.txt
echo "== $b"; grep "^| " $R/bench-$b.txt | grep -v "^| batch\|^|---" | awk -F'|' '{print $2,$3,$4,$5,$6,$7}'
tail -2 $R/bench-$b.txt
done
cd /tmp && tar -czf $O/r14.tgz r14
