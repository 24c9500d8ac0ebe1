#!/usr/bin/env bash
# x2 (or one GPU in turn). GPU 1: gpu_attention (K and V buffers refilled as soon as free), gpu_norm (NVFP4 round 2).
# GPU 0: PyTorch peers; decode attention (certified rows and alt-1x4x32 at batch 1, 8, 64); attention re-certified
# for llama3-8b into the bundle's certificates, then the decode table again with them; the NVFP4 / INT8 norm cases.
set -u
O=$OUT; R=/tmp/e4; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
NG=$(nvidia-smi -L | wc -l)
TESTS() { cd bundle; T 200 test-gpu_attention tests/gpu_attention --test-threads=1; T 400 test-gpu_norm tests/gpu_norm; }
BENCH() { cd bundle
  T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
  T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
  T 90 bench-attention-alt ./kiln bench attention --decode-only extra --decode-configs alt-1x4x32.s1,alt-1x4x32.s2,alt-1x4x32.s4 --decode-batches 1,8,64 --peer $R/attention_torch.json
  cp -r tuning/certificates $R/certificates-before
  T 120 certify-attention-llama3-8b ./kiln tune certify --shapes llama3-8b --kernel attention --out tuning/certificates --report $R/tuning-attention-llama3-8b.md
  cp -r tuning/certificates $R/certificates-after
  T 90 bench-attention ./kiln bench attention --decode-only zzz --peer $R/attention_torch.json
  T 90 bench-norm-q ./kiln bench norm --cases rms_norm_nvfp4,rms_norm_int8 --variants total --peer $R/norm_torch.json
  ( cd /tmp && tar -czf $O/e4-bench.tgz e4 ); }
if [ "$NG" -ge 2 ]; then ( export CUDA_VISIBLE_DEVICES=1; TESTS ) & ( export CUDA_VISIBLE_DEVICES=0; BENCH ) & wait
else ( BENCH ); ( TESTS ); fi
echo "total $((SECONDS-t0)) s  gpus $NG"
for f in $R/test-*.txt; do echo "== $f"; grep -E "test result|FAILED|panicked|^exit" $f | head -8; done
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done | grep exit | tr '\n' ' '; echo
grep -E "^\| (1|8|64) \| " $R/bench-attention-alt.txt | cut -c1-150
echo; grep -E "^\| (1|8|64) \| " $R/bench-attention.txt | cut -c1-150
grep -E "decode" $R/tuning-attention-llama3-8b.md | cut -c1-200
grep -E "nvfp4|int8" $R/bench-norm-q.txt | grep -v "^same" | cut -c1-160
cd /tmp && tar -czf $O/e4.tgz e4
