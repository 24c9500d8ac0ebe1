#!/usr/bin/env bash
# One H200 (x2 machine, GPU 0 only). LM head at 1, 2, 4 and 8 rows: the certified / default variants and the candidates, PyTorch in the same run.
set -u
O=$OUT; R=/tmp/d5; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache CUDA_VISIBLE_DEVICES=0
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 200 bench-lm-head ./kiln bench lm-head --variants 16w/4v/32t,16w/4v/64txs4c,16w/4v/64txs2c --peer $R/lm_head_torch.json
echo "total $((SECONDS-t0)) s"
grep -E "^\| 151936" $R/bench-lm-head.txt; cat $R/lm_head_torch.json
cd /tmp && tar -czf $O/d5.tgz d5
