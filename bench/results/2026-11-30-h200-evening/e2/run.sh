#!/usr/bin/env bash
# alt-1x4x32 with K of the next tile issued before the softmax; with and without whole-line L2 fetches; GPU tests of the tiled decode variants.
set -u
O=$OUT; R=/tmp/e2; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd .xfer10/mini; cat COMMIT > $R/commit.txt; nvidia-smi > $R/nvidia-smi.txt
CUDA_VISIBLE_DEVICES=1 T 400 test-gpu_attention-tiled tests/gpu_attention --test-threads=1 decode_matches_float64 tiled_decode_combine streaming_decode_over_a_long &
export CUDA_VISIBLE_DEVICES=0
T 80 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
C="--iterations 15 --decode-batches 8 --decode-contexts 4096,16384,32768,131072 --peer $R/attention_torch.json"
T 200 bench-b8 ./kiln bench attention --decode-only extra $C --decode-configs alt-1x4x32.s4,alt-1x4x32.s3,alt-1x4x32.s6
KILN_DECODE_L2_HINT=noline T 200 bench-b8-noline ./kiln bench attention --decode-only extra $C --decode-configs alt-1x4x32.s4,alt-1x4x32.s6
wait
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit
for f in $R/bench-*.txt; do echo "== $f"; grep -hE "^\| (8|64|1) \| " $f | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'; done
grep -E "^test |test result" $R/test-gpu_attention-tiled.txt
cd /tmp && tar -czf $O/e2.tgz e2
