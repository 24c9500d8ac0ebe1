#!/usr/bin/env bash
# One H200: gpu_attention (with the cluster combine test), then decode attention at batch 1 and 8, 1k-16k, for the
# tiled kernel's decode variants at 2-8 splits with the cluster combine (the default) and without it
# (KILN_CLUSTER_COMBINE=0), PyTorch in the same run.
set -u
O=$OUT; R=/tmp/f6; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer11/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
T 240 test-gpu_attention tests/gpu_attention --test-threads=1
grep -E "^test |test result" $R/test-gpu_attention.txt
T 60 peer-attention python3 bench/peers/attention.py --out $R/attention_torch.json
C=1x4x32.s2,1x4x32.s4,1x4x32.s8,deep-1x4x16.s2,deep-1x4x16.s4,deep-1x4x16.s8,deep-1x4x32.s2,alt-1x4x32.s2,alt-1x4x32.s4
T 200 bench-cluster ./kiln bench attention --decode-only extra --decode-configs $C --decode-batches 1,8 --decode-contexts 1024,4096,16384 --peer $R/attention_torch.json
T 200 bench-ticket env KILN_CLUSTER_COMBINE=0 ./kiln bench attention --decode-only extra --decode-configs $C --decode-batches 1,8 --decode-contexts 1024,4096,16384 --peer $R/attention_torch.json
paste -d'#' <(grep -E "^\| (1|8) \| " $R/bench-cluster.txt | cut -d'|' -f2-6,9) <(grep -E "^\| (1|8) \| " $R/bench-ticket.txt | cut -d'|' -f5)
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/f6.tgz f6
