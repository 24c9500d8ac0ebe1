#!/usr/bin/env bash
# One H200, c8cfd69: LM head at 8 rows (the default with and without SPLIT / PBUF, tile-128 cooperative
# variants), PyTorch before each; NVFP4 / INT8 norms with the keep_x variants; gpu_lm_head.
set -u
O=$OUT; R=/tmp/r1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
rm -rf /tmp/keep/bundle; tar -C /tmp/keep -xJf .xfer14/bundle.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
nvidia-smi > $R/nvidia-smi.txt; cat bundle/COMMIT > $R/commit.txt; cp .xfer14/r1.sh $R/run.sh
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cd bundle
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 50 > $R/smi.csv 2>&1 &
SMI=$!
D=16w/4v/64txs2c
T 60 peer-lm_head python3 bench/peers/lm_head.py --out $R/lm_head_torch.json
T 120 bench-lm-head-v ./kiln bench lm-head --rows 8 --variants $D,16w/4v/64txs4c,16w/4v/128txs2c,16w/4v/128txs4c --peer $R/lm_head_torch.json
KILN_LM_HEAD_OFF=SPLIT,PBUF T 60 bench-lm-head-off-both ./kiln bench lm-head --rows 8 --variants $D --peer $R/lm_head_torch.json
KILN_LM_HEAD_OFF=SPLIT T 60 bench-lm-head-off-split ./kiln bench lm-head --rows 8 --variants $D --peer $R/lm_head_torch.json
KILN_LM_HEAD_OFF=PBUF T 60 bench-lm-head-off-pbuf ./kiln bench lm-head --rows 8 --variants $D --peer $R/lm_head_torch.json
T 60 peer-lm_head-2 python3 bench/peers/lm_head.py --out $R/lm_head_torch2.json
T 60 bench-lm-head-2 ./kiln bench lm-head --rows 8 --variants $D --peer $R/lm_head_torch2.json
KILN_LM_HEAD_OFF=SPLIT,PBUF T 60 bench-lm-head-off-both-2 ./kiln bench lm-head --rows 8 --variants $D --peer $R/lm_head_torch2.json
kill $SMI
grep -h -E "^\| 151936" $R/bench-lm-head-*.txt
grep -h '"8"' $R/lm_head_torch*.json
T 60 peer-norm python3 bench/peers/norm.py --out $R/norm_torch.json
T 120 bench-norm-variants ./kiln bench norm --cases rms_norm_nvfp4,rms_norm_int8 --sizes 2048x4096,8192x8192 --variants 4w1r+b+n,4w1r+b+t+n,4w1r+b+n+k,4w1r+b+t+n+k,8w1r+b+n --batches 60 --peer $R/norm_torch.json
grep -E "^(rms|layer)[a-z_0-9]* +[0-9]" $R/bench-norm-variants.txt | cut -c1-150
T 240 test-gpu_lm_head tests/gpu_lm_head --test-threads=1
grep -E "test result|FAILED|panicked|^exit" $R/test-gpu_lm_head.txt | head -12
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/r1.tgz r1
