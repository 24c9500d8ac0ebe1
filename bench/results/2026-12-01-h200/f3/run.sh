#!/usr/bin/env bash
# One H200: the norm defaults with the segment length compiled in (+n): the norm benchmark (all shapes) with PyTorch in
# the same run; gpu_norm fixed_n, every_variant and every_flavor; gpu_engine.
set -u
O=$OUT; R=/tmp/f3; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer12/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer12/f3.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 150 bench-norm ./kiln bench norm --variants total,2w1r+n,4w1r+n,4w1r+b+n,8w1r+b+n,4w1r+b+t+n --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -3
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | grep -E "default|best" | cut -c1-150
T 230 test-gpu_norm tests/gpu_norm fixed_n every_variant every_flavor --test-threads=3
T 110 test-gpu_engine tests/gpu_engine --test-threads=1
for f in $R/test-*.txt; do echo "== $f"; grep -E "^test |test result|FAILED|panicked|^exit" $f | head -12; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f3.tgz f3
