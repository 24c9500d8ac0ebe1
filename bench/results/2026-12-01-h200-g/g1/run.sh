#!/usr/bin/env bash
# One H200: quantized norm outputs from the packed bf16 product (Hugging Face rounding: v rounded to x's type), and
# 64-register bounds for 8 units a warp (experiment): the INT8 / NVFP4 variants at 2048 x 4096 and 8192 x 8192 with
# PyTorch; gpu_norm fixed_n, every_flavor.
set -u
O=$OUT; R=/tmp/g1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer13/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer13/g1.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 150 bench-norm ./kiln bench norm --cases rms_norm_int8,rms_norm_nvfp4 --sizes 2048x4096,8192x8192 --variants 2w1r+b,2w1r+b+n,4w1r+b,4w1r+b+n,8w1r+b,8w1r+b+n,4w1r+b+t+n --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -3
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | cut -c1-150
T 330 test-gpu_norm tests/gpu_norm fixed_n every_flavor --test-threads=3
for f in $R/test-*.txt; do echo "== $f"; grep -E "^test |test result|FAILED|panicked|^exit" $f | head -12; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/g1.tgz g1
