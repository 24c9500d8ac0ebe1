#!/usr/bin/env bash
set -u
O=$OUT; R=/tmp/r16; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
C=hybrid-1x4x16.s2,deep-1x4x16.s2,deep4-1x4x16.s2,deep5-1x4x16.s2,hybrid4-1x4x16.s2,hybrid5-1x4x16.s2,deep4-1x4x16.s4,hybrid4-1x4x16.s4,deep5-1x4x16.s1,deep4-1x4x16.s3
timeout 300 .xfer7/kiln-deep bench attention --decode-only extra --decode-configs $C --decode-batches 8,64 --decode-contexts 4096,16384,32768,131072 --peer .xfer7/attention_torch.json --iterations 15 > $R/bench.txt 2>&1
echo "exit $? at $((SECONDS-t0)) s" >> $R/bench.txt
grep "^| " $R/bench.txt | grep -v "^| batch\|^|---" | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'
grep -i "error" $R/bench.txt | head; tail -2 $R/bench.txt
cd /tmp && tar -czf $O/r16.tgz r16
