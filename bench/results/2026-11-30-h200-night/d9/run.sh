#!/usr/bin/env bash
# One H200: the final sampler code (fused_append / fused_rank in the slice lists): gpu_sample, gpu_engine, the sampler benchmark with PyTorch.
set -u
O=$OUT; R=/tmp/d9; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
T 120 bench-sample ./kiln bench sample --peer $R/sample_torch.json
( cd /tmp && tar -czf $O/d9-bench.tgz d9 )
grep -E "^\| (top_k_top_p|top_k|top_k_min_p|top_p|min_p) " $R/bench-sample.txt | cut -c1-120
T 250 test-gpu_sample tests/gpu_sample --test-threads=1
T 100 test-gpu_engine tests/gpu_engine --test-threads=1
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
cd /tmp && tar -czf $O/d9.tgz d9
