#!/usr/bin/env bash
# One H200: gpu_norm every_flavor_and_dtype (the +n defaults over every flavor and dtype); the norm cases at 2048 x 4096
# three times with PyTorch in the same run (the spread between runs).
set -u
O=$OUT; R=/tmp/f4; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer12/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer12/f4.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 330 test-gpu_norm tests/gpu_norm every_flavor --test-threads=1
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
for i in 1 2 3; do
  T 60 bench-norm-2048-$i ./kiln bench norm --sizes 2048x4096 --variants 2w1r+n,4w1r+b+n,8w1r+b+n --peer $R/norm_torch.json
  grep -E "^(rms|layer)[a-z_0-9]* +2048" $R/bench-norm-2048-$i.txt | grep -E "default|best|listed" | cut -c1-150
done
for f in $R/test-*.txt; do echo "== $f"; grep -E "^test |test result|FAILED|panicked|^exit" $f | head -12; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f4.tgz f4
