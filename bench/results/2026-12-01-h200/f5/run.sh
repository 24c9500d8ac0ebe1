#!/usr/bin/env bash
# One H200, the final norm defaults (2986352 + the LayerNorm test fix): the norm benchmark's defaults with PyTorch in the
# same run; gpu_norm layer_norm_at and every_flavor.
set -u
O=$OUT; R=/tmp/f5; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer12/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer12/f5.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 90 bench-norm ./kiln bench norm --default-only --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -3
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | cut -c1-150
T 60 test-gpu_norm-ln tests/gpu_norm layer_norm_at --test-threads=1
T 250 test-gpu_norm-flavors tests/gpu_norm every_flavor --test-threads=1
for f in $R/test-*.txt; do echo "== $f"; grep -E "^test |test result|FAILED|panicked|^exit" $f | head -8; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f5.tgz f5
