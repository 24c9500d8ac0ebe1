#!/usr/bin/env bash
# b8 decode: splits beyond one wave.
set -u
O=$OUT; R=/tmp/r13; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt
C=""
for s in 4 8 16 32; do C="$C,1x4x16.s$s,hybrid-1x4x16.s$s,deep-1x4x16.s$s,stream6-1x4x16.s$s,stream3-1x8x16.s$s"; done
for s in 4 8 16; do C="$C,1x4x32.s$s,deep-1x4x32.s$s"; done
C=${C#,}
timeout 400 .xfer7/kiln bench attention --decode-only extra --decode-configs $C --decode-batches 8 --decode-contexts 4096,16384,32768,131072 --peer .xfer7/attention_torch.json --iterations 15 > $R/bench-b8.txt 2>&1
echo "exit $? at $((SECONDS-t0)) s" >> $R/bench-b8.txt
grep "^| 8" $R/bench-b8.txt | awk -F'|' '{print $3,$4,$5,$7,$9}'
tail -3 $R/bench-b8.txt
cd /tmp && tar -czf $O/r13.tgz r13
