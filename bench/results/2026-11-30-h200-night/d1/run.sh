#!/usr/bin/env bash
# x2. GPU 1: gpu_sample + gpu_engine (TopKHeads listing changed). GPU 0: sampler bench + profile; LM head 8 rows x3 with torch, nvidia-smi clocks.
set -u
O=$OUT; R=/tmp/d1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; echo "$(date +%T.%N) start $name" >> $R/phases.txt; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; echo "$(date +%T.%N) end $name" >> $R/phases.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 300 test-gpu_sample tests/gpu_sample --test-threads=1
  T 150 test-gpu_engine tests/gpu_engine --test-threads=1 ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 150 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  T 100 bench-sample-profile ./kiln bench sample --profile
  nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 25 > $R/smi-lm.csv 2>&1 &
  SMI=$!
  for i in 1 2 3; do
    T 60 peer-lm_head-$i python3 bench/peers/lm_head.py --out $R/lm_head_torch$i.json
    T 90 bench-lm-head-$i ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4c,16w/4v/64txs2c,16w/4v/128txs2,8w/4v/64txs2cb2 --peer $R/lm_head_torch$i.json
  done
  kill $SMI ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (top_k_top_p|top_k|top_k_min_p) " $R/bench-sample.txt | cut -c1-200
grep -A10 "top_k_top_p batch 1 TopKHeads" $R/bench-sample-profile.txt
grep -h -E "^\| 151936|^rows" $R/bench-lm-head-*.txt
cd /tmp && tar -czf $O/d1.tgz d1
