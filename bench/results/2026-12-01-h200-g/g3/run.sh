#!/usr/bin/env bash
# One H200, 3ab2ef6 (NVFP4's global-scale range checked once a segment; the extreme-global-scale test): the norm
# benchmark's defaults with PyTorch in the same run, the NVFP4 variants at the large shapes; the whole gpu_norm suite.
set -u
O=$OUT; R=/tmp/g3; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer13/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer13/g3.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 50 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 90 bench-norm ./kiln bench norm --default-only --peer $R/norm_torch.json
T 90 bench-norm-variants ./kiln bench norm --cases rms_norm_nvfp4 --sizes 2048x4096,8192x8192 --variants 4w1r+b+n,4w1r+b+t+n --batches 60 --peer $R/norm_torch.json
grep -vE "^same|^rms|^layer" $R/bench-norm.txt | head -3
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm.txt | cut -c1-150
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm-variants.txt | cut -c1-150
T 360 test-gpu_norm tests/gpu_norm --test-threads=8
for f in $R/test-*.txt; do echo "== $f"; grep -E "^test |test result|FAILED|panicked|^exit" $f | head -20; done
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/g3.tgz g3
