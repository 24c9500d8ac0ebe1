#!/usr/bin/env bash
# x2. GPU 1: gpu_sample (default, and KILN_SAMPLE_FENCE=one), gpu_engine. GPU 0: sampler profile + bench, both fence modes.
set -u
O=$OUT; R=/tmp/d2; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
( export CUDA_VISIBLE_DEVICES=1; cd bundle
  T 300 test-gpu_sample tests/gpu_sample --test-threads=1 &
  ( KILN_CACHE_DIR=/tmp/kiln-cache2 KILN_SAMPLE_FENCE=one T 300 test-gpu_sample-fence1 tests/gpu_sample --test-threads=1 ) &
  T 150 test-gpu_engine tests/gpu_engine --test-threads=1
  wait ) &
( export CUDA_VISIBLE_DEVICES=0; cd bundle
  T 40 peer-sample python3 bench/peers/sample.py --out $R/sample_torch.json
  T 100 bench-sample-profile ./kiln bench sample --profile
  ( export KILN_SAMPLE_FENCE=one; T 100 bench-sample-profile-fence1 ./kiln bench sample --profile )
  T 150 bench-sample ./kiln bench sample --peer $R/sample_torch.json
  ( export KILN_SAMPLE_FENCE=one; T 150 bench-sample-fence1 ./kiln bench sample --peer $R/sample_torch.json ) ) &
wait
echo "total $((SECONDS-t0)) s"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -6; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
for f in bench-sample bench-sample-fence1; do echo "== $f"; grep -E "^\| (greedy|top_k_top_p|top_k|top_k_min_p) " $R/$f.txt | cut -c1-120; done
for f in bench-sample-profile bench-sample-profile-fence1; do echo "== $f"; grep -A13 "top_k_top_p batch 1 TopKHeads" $R/$f.txt; grep -A6 "top_k_top_p batch 1 TopKWide" $R/$f.txt; done
cd /tmp && tar -czf $O/d2.tgz d2
