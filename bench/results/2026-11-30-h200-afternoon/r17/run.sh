#!/usr/bin/env bash
set -u
O=$OUT; R=/tmp/r17; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
for pf in 0 128 256; do
  KILN_L2_PF=$pf timeout 200 .xfer7/kiln-pf bench attention --decode-only zzz --decode-configs hybrid-1x4x16.s2,1x4x16.s2,1x4x32.s1 --decode-batches 1,8,64 --decode-contexts 4096,16384,131072 --peer .xfer7/attention_torch.json --iterations 15 > $R/att-$pf.txt 2>&1
  echo "== attention pf $pf at $((SECONDS-t0)) s"; grep "^| " $R/att-$pf.txt | grep -v "^| batch\|^|---" | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'
done
for pf in 0 256; do
  KILN_L2_PF=$pf timeout 120 .xfer7/kiln-pf bench lm-head --rows 1,8 > $R/lm-$pf.txt 2>&1
  echo "== lm pf $pf at $((SECONDS-t0)) s"; grep -E "^\| |certified|default" $R/lm-$pf.txt | head -12
  KILN_L2_PF=$pf timeout 120 .xfer7/kiln-pf bench norm --default-only > $R/norm-$pf.txt 2>&1
  echo "== norm pf $pf at $((SECONDS-t0)) s"; grep -E "certified|default" $R/norm-$pf.txt | grep -v "^rms\|^layer" | cut -c1-110 | head -24
done
cd /tmp && tar -czf $O/r17.tgz r17
