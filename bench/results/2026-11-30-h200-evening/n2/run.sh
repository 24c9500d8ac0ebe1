#!/usr/bin/env bash
set -u
O=$OUT; R=/tmp/n2; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
NCU=ncu; which ncu >/dev/null 2>&1 || NCU=/usr/local/cuda/bin/ncu
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
T 120 ncu-torch-dec16k $NCU --clock-control none -k regex:'flash|fmha|attn' --launch-skip 2 --launch-count 4 $SEC python3 $R/torch_dec.py 16384
T 120 ncu-torch-dec128k $NCU --clock-control none -k regex:'flash|fmha|attn' --launch-skip 2 --launch-count 4 $SEC python3 $R/torch_dec.py 131072
T 90 ncu-torch-lm $NCU --clock-control none -k regex:'gemm|gemv|sm90|cutlass|Kernel' --launch-skip 1 --launch-count 2 $SEC python3 $R/torch_lm.py
echo "total $((SECONDS-t0)) s"
cd /tmp && tar -czf $O/n2.tgz n2
