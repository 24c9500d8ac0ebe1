#!/usr/bin/env bash
# One H200: the sums of squares with fused pairs and the fixed-length (+n) norm variants: the norm benchmark at
# 2048 x 4096 and 8192 x 8192 with PyTorch in the same run; gpu_embedding, gpu_rope, gpu_norm every_variant and block_lane.
set -u
O=$OUT; R=/tmp/f2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer12/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer12/f2.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
V=total,2w1r+n,4w1r+n,4w1r+t+n,4w1r+b+n,8w1r+b+n,4w1r+b+t+n,8w1r+b+t+n
T 200 bench-norm ./kiln bench norm --sizes 2048x4096,8192x8192 --variants $V --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -3
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | cut -c1-150
T 60 test-gpu_embedding tests/gpu_embedding --test-threads=1
T 60 test-gpu_rope tests/gpu_rope --test-threads=1
T 240 test-gpu_norm-a tests/gpu_norm every_variant block_lane --test-threads=2
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f2.tgz f2
