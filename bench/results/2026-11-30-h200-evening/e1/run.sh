#!/usr/bin/env bash
# Alternating one-stage decode (alt-1x4x16, alt-1x4x32) at batch 8 and 64 against the certified rows and PyTorch; GPU tests of the tiled decode variants.
set -u
O=$OUT; R=/tmp/e1; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd .xfer10/mini; cat COMMIT > $R/commit.txt; nvidia-smi > $R/nvidia-smi.txt
#CUDA_VISIBLE_DEVICES=1 T 400 test-gpu_attention-tiled tests/gpu_attention --test-threads=1 decode_matches_float64 tiled_decode_combine streaming_decode_over_a_long &
export CUDA_VISIBLE_DEVICES=0
cp /tmp/keep_att.json $R/attention_torch.json 2>/dev/null || T 80 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json; cp $R/attention_torch.json /tmp/keep_att.json
T 200 bench-b8 ./kiln bench attention --decode-only extra --iterations 15 --decode-batches 8 --decode-contexts 4096,16384,32768,131072 --decode-configs alt-1x4x32.s2,alt-1x4x32.s4,alt-1x4x32.s8,alt-1x4x16.s4,alt-1x4x16.s8 --peer $R/attention_torch.json
T 150 bench-b64 ./kiln bench attention --decode-only extra --iterations 10 --decode-batches 64,1 --decode-contexts 16384,131072 --decode-configs alt-1x4x32.s1,alt-1x4x32.s2,alt-1x4x16.s2 --peer $R/attention_torch.json
wait
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit
grep -hE "^\| (8|64|1) \| " $R/bench-*.txt | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'
grep -E "^test |test result" $R/test-gpu_attention-tiled.txt
cd /tmp && tar -czf $O/e1.tgz e1
