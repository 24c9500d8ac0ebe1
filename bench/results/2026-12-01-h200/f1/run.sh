#!/usr/bin/env bash
# One H200: the persistent norm variants with the weight widened into shared memory (+f) and x held widened (+x):
# the norm cases at 2048 x 4096 and 8192 x 8192 with PyTorch in the same run; gpu_norm smem_weight and every_variant.
set -u
O=$OUT; R=/tmp/f1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer12/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer12/f1.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
V=total,4w1r+p+b+t+f,4w1r+p+b+t+f+x,8w1r+p+b+t+f,8w1r+p+b+t+f+x
T 200 bench-norm ./kiln bench norm --sizes 2048x4096,8192x8192 --variants $V --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -5
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | cut -c1-150
T 150 test-smem tests/gpu_norm smem_weight --test-threads=1
T 200 test-every tests/gpu_norm every_variant --test-threads=1
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f1.tgz f1
