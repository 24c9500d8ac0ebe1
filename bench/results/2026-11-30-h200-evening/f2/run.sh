#!/usr/bin/env bash
# The final norm code (c6a5d16): LayerNorm tests at 8 units a warp and every flavor (GPU 1); norm defaults with PyTorch (GPU 0).
set -u
O=$OUT; R=/tmp/f2; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd .xfer10/mini2; cat COMMIT > $R/commit.txt; nvidia-smi > $R/nvidia-smi.txt
CUDA_VISIBLE_DEVICES=1 T 170 test-gpu_norm-layer tests/gpu_norm layer_norm_at every_flavor_and_dtype &
export CUDA_VISIBLE_DEVICES=0
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 110 bench-norm ./kiln bench norm --default-only --peer $R/norm_torch.json
wait
echo "total $((SECONDS-t0)) s"
grep -E "^test |test result" $R/test-gpu_norm-layer.txt
grep -E "certified|default" $R/bench-norm.txt | grep -E "2048x4096|8192x8192" | cut -c1-150
cd /tmp && tar -czf $O/f2.tgz f2
