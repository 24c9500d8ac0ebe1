#!/usr/bin/env bash
# ncu of PyTorch's and Kiln's decode attention at batch 8 (16k, 128k) and of the LM head at 8 rows.
set -u
O=$OUT; R=/tmp/n1; rm -rf $R; mkdir -p /tmp/keep $R; t0=$SECONDS
tar -C /tmp/keep -xJf .xfer10/bundle69.tar.xz && rm -rf bundle && ln -s /tmp/keep/bundle bundle
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
NCU=/usr/local/cuda/bin/ncu; which ncu >/dev/null 2>&1 && NCU=ncu
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
T() { local lim=$1 name=$2; shift 2; timeout $lim "$@" > $R/$name.txt 2>&1; echo "exit $? at $((SECONDS-t0)) s" >> $R/$name.txt; }
cat > $R/torch_dec.py <<'PY'
import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
ctx = int(sys.argv[1]); b = 8
r = lambda *s: (torch.rand(*s, device="cuda") * 2 - 1).to(torch.bfloat16)
q = r(b, 32, 1, 128); k = r(b, 8, ctx, 128); v = r(b, 8, ctx, 128)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3): F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
PY
cat > $R/torch_lm.py <<'PY'
import torch
w = (torch.rand(151936, 4096, device="cuda") - 0.5).to(torch.bfloat16); h = (torch.rand(8, 4096, device="cuda") - 0.5).to(torch.bfloat16)
for _ in range(3): torch.matmul(h, w.t())
torch.cuda.synchronize()
PY
T 120 ncu-torch-dec16k $NCU --clock-control none --launch-skip 2 --launch-count 2 $SEC python3 $R/torch_dec.py 16384
T 120 ncu-torch-dec128k $NCU --clock-control none --launch-skip 2 --launch-count 2 $SEC python3 $R/torch_dec.py 131072
T 90 ncu-torch-lm $NCU --clock-control none --launch-skip 2 --launch-count 1 $SEC python3 $R/torch_lm.py
cd bundle
T 150 ncu-kiln-dec16k $NCU --clock-control none -k regex:attention --launch-skip 3 --launch-count 2 $SEC ./kiln bench attention --decode-only zzz --iterations 3 --decode-batches 8 --decode-contexts 16384
T 150 ncu-kiln-dec128k $NCU --clock-control none -k regex:attention --launch-skip 3 --launch-count 2 $SEC ./kiln bench attention --decode-only zzz --iterations 3 --decode-batches 8 --decode-contexts 131072
echo "total $((SECONDS-t0)) s"
for f in $R/*.txt; do echo "$(basename $f): $(grep -h '^exit' $f)"; done
cd /tmp && tar -czf $O/n1.tgz n1
