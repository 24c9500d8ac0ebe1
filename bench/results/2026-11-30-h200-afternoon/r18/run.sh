#!/usr/bin/env bash
# x2. GPU 1: GPU tests of the changed families. GPU 0: exploration benches (peers from earlier runs).
set -u
O=$OUT; R=/tmp/r18; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer8/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
P=$PWD/.xfer8
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 420 test-gpu_attention tests/gpu_attention --test-threads=1 &
  T 300 test-gpu_lm_head tests/gpu_lm_head &
  T 520 test-gpu_norm tests/gpu_norm quantized block_lane weight_ahead &
  T 300 test-gpu_sample tests/gpu_sample --test-threads=1 &
  wait ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 90 bench-attention-hp ./kiln bench attention --peer $P/attention_torch.json --decode-only extra --decode-configs hp2-1x4x16.s2,hp2-hybrid-1x4x16.s2,hp2-1x4x16.s1,hp2-hybrid-1x4x16.s1,hp4-1x4x16.s1,hp4-hybrid-1x4x16.s1,hp4-hybrid-1x4x16.s2,hybrid-1x4x16.s2 --decode-batches 8 --decode-contexts 4096,16384,32768,131072
  T 120 bench-lm-head-8 ./kiln bench lm-head --rows 8 --peer $P/lm_head_torch.json
  T 60 sample-profile ./kiln bench sample --profile
  T 280 bench-norm ./kiln bench norm --variants lanes,ahead --peer $P/norm_torch.json ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| 8 " $R/bench-attention-hp.txt | awk -F'|' '{print $3,$4,$5,$7,$9}'
grep -E "^\| 151936" $R/bench-lm-head-8.txt
grep -E "^(rms|layer)[a-z_0-9]* +(2048|8192).*(best|certified)" $R/bench-norm.txt | cut -c1-130
cd /tmp && tar -czf $O/r18.tgz r18
