#!/usr/bin/env bash
# One H200 at da63c03, short: the LM head at 8 rows with PyTorch (two processes), then the sampler
# table with PyTorch. Outputs go straight to $OUT.
set -u
R=$OUT/c1; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer15/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer15/c1.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 40 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 40 bench-lm-head-8-1 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json --variants 16w/4v/64txs2c
T 40 bench-lm-head-8-2 ./kiln bench lm-head --rows 8 --peer $R/lm_head_torch.json --variants 16w/4v/64txs2c
grep -h -E "^\| 151936|^exit" $R/bench-lm-head-8-*.txt
T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
T 100 bench-sample ./kiln bench sample --peer $R/sample_torch.json
grep -E "^\| (top_k_top_p|greedy) " $R/bench-sample.txt | cut -c1-160
echo "total $((SECONDS-t0)) s"
