#!/usr/bin/env bash
# One H200 at the final LM head / norm code: gpu_lm_head (3 test threads) beside the whole gpu_norm
# suite (8 test threads), then the LM head table at 1, 2, 4, 8 rows with PyTorch.
set -u
O=$OUT; R=/tmp/b2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer15/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer15/b2.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 420 test-gpu_lm_head tests/gpu_lm_head --test-threads=3 &
LM=$!
T 420 test-gpu_norm tests/gpu_norm --test-threads=8
wait $LM
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
( cd /tmp && tar -czf $O/b2-tests.tgz b2 )
T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 90 bench-lm-head ./kiln bench lm-head --variants 16w/4v/64txs2c --peer $R/lm_head_torch.json
grep -h -E "^\| 151936|^exit" $R/bench-lm-head.txt
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/b2.tgz b2
