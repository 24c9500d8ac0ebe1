#!/usr/bin/env bash
# x2. GPU 1: gpu_lm_head (the tile-128 cooperative variants among every variant). GPU 0: LM head 8 rows, every variant, PyTorch in the same run; then three runs of the best candidates.
set -u
O=$OUT; R=/tmp/d4; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 300 test-gpu_lm_head tests/gpu_lm_head ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
  T 150 bench-lm-head-8 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json
  for i in 1 2 3; do
    T 60 peer-lm_head-$i python3 bench/peers/lm_head.py --out $R/lm_head_torch$i.json
    T 90 bench-lm-head-$i ./kiln bench lm-head --rows 8 --batches 40 --variants 16w/4v/64txs4c,16w/4v/128txs2c,16w/4v/128txs4c --peer $R/lm_head_torch$i.json
  done ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^rows 8 16w/4v/(64|128)txs.c|^\| 151936" $R/bench-lm-head-8.txt
grep -h -E "^\| 151936|^rows" $R/bench-lm-head-[123].txt
grep -h '"8"' $R/lm_head_torch*.json
cd /tmp && tar -czf $O/d4.tgz d4
