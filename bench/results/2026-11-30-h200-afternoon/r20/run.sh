#!/usr/bin/env bash
set -u
O=$OUT; R=/tmp/r20; rm -rf $R; mkdir -p $R; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KILN_CACHE_DIR=/tmp/kiln-cache
for g in 0 3 17 1030; do
  KILN_KV_GAP_MIB=$g timeout 100 .xfer9/kiln-gap bench attention --decode-only zzz --decode-configs 1x4x32.s2 --decode-batches 1,8,64 --decode-contexts 32768,131072 --peer .xfer9/attention_torch.json --iterations 10 > $R/gap-$g.txt 2>&1
  echo "== gap $g at $((SECONDS-t0)) s"; grep "^kv:" $R/gap-$g.txt | head -6 | tr '\n' ' '; echo
  grep "^| " $R/gap-$g.txt | grep -v "^| batch\|^|---" | awk -F'|' '{print $2,$3,$4,$5,$7,$9}'
done
cd /tmp && tar -czf $O/r20.tgz r20
