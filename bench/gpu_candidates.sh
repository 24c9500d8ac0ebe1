#!/usr/bin/env bash
# The candidate variants against the defaults on one GPU, from a bundle (scripts/gpu-bundle),
# each part under 10 minutes:
#   lm-head  the LM head at 8 rows: the shift decode against the matrix-unit decode (`m`) and
#            reductions of 2 rows' sums (`r2`), in alternating processes, PyTorch's torch.matmul
#            measured once; 1, 2 and 4 rows for the same pairs; an ncu count of instructions and
#            issue of each 8-row variant.
#   norm     the INT8 and NVFP4 norm outputs at 2048 x 4096 and 8192 x 8192: the staged grids
#            of one lane a quantization block (`+s2+b+n`, `+s3+b+n`) at 16, 32 and 48 warps a
#            multiprocessor against the defaults, PyTorch measured once.
#   lm-head-8  the default at 8 rows (4 stages) against 2 stages in alternating processes, PyTorch
#            measured before each pair; then every row count's default.
#   tests    the GPU tests of the LM head and of the norms side by side (bit for bit against the
#            CPU reference, the candidates and their special-value tests included).
#   norm-check  the acceptance of the norms, embedding and RoPE in one call: every gpu_embedding
#            and gpu_rope test, every gpu_norm test, then PyTorch's norms and three processes of
#            `kiln bench norm --default-only` against them (each followed by INT8 and NVFP4 at
#            2048 x 4096 with the 2-warp one-wave candidate beside the defaults), then every
#            one-lane-a-block variant of INT8 and NVFP4 at the large shapes, and every variant of
#            RMSNorm and LayerNorm at 2048 x 4096 (about 460 s on an H100: the gpu_norm tests 340 s
#            of it; the tests run beside each other, gpu_norm's on 16 threads, within 420 s).
#   norm-bench  norm-check without the tests: PyTorch's norms, three processes of the defaults,
#            every variant of RMSNorm and LayerNorm at 2048 x 4096, then every one-lane-a-block
#            variant of INT8 and NVFP4 (about 140 s).
#   quant    the Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS weights: gpu_linear's product test on them
#            (every epilogue, token count and variant), its embedding-gather and bf16-conversion
#            tests on every format, greedy GPU-vs-CPU parity on the tiny random model quantized to
#            each (bench/peers/quantize_gguf.py; needs gguf-py in the bundle), and the one-token
#            bandwidth table of the 4- and 5-bit formats (about 500 s).
#   quant-1b the Llama-3.2-1B shape (random weights) in Q5_K and IQ4_XS: decode speed at batch 1
#            and 8 against the memory floor, and GPU-vs-CPU parity over 16 steps.
#   cd bundle && ../bench/gpu_candidates.sh lm-head|lm-head-8|norm|tests|norm-check|norm-bench|quant|quant-1b RESULTS_DIR
set -u
part=${1:?usage: $0 lm-head|lm-head-8|norm|tests|norm-check|norm-bench|quant|quant-1b RESULTS_DIR (run inside the bundle directory)}
out=${2:?usage: $0 lm-head|lm-head-8|norm|tests|norm-check|norm-bench|quant|quant-1b RESULTS_DIR (run inside the bundle directory)}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)  # bench/ of the checkout this script runs from
t0=$SECONDS
T() { local limit=$1 name=$2; shift 2; timeout "$limit" "$@" > "$out/$name.txt" 2>&1; echo "exit $? at $((SECONDS - t0)) s" >> "$out/$name.txt"; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
[ -f COMMIT ] && cp COMMIT "$out/commit.txt"
if [ "$part" = quant ]; then
  export PYTHONPATH="$PWD/gguf-py"
  KILN_LINEAR_DTYPES=Q5_0,Q5_1,Q5_K,IQ4_NL,IQ4_XS T 300 test-gpu_linear-new tests/gpu_linear --test-threads=4 linear_matches
  T 120 test-gpu_linear-rest tests/gpu_linear embed_rows bf16_weights every_variant_serves
  grep -h -E "^test |test result|^exit" "$out"/test-gpu_linear-*.txt
  mkdir -p /tmp/m && python3 peers/make_models.py tiny /tmp/m/tiny > "$out/make-models.txt" 2>&1
  for q in Q5_0 Q5_1 Q5_K IQ4_NL IQ4_XS; do
    l=$(echo "$q" | tr A-Z a-z)
    python3 "$here/peers/quantize_gguf.py" /tmp/m/tiny/tiny-f16.gguf "/tmp/m/tiny/tiny-$l.gguf" "$q" >> "$out/make-models.txt" 2>&1
    T 120 "parity-tiny-$l" ./gpu_parity "/tmp/m/tiny/tiny-$l.gguf" - --steps 32
    tail -3 "$out/parity-tiny-$l.txt"
  done
  T 60 generate-tiny-q5_k ./kiln generate --device cuda -m /tmp/m/tiny/tiny-q5_k.gguf -p "Hello there" -n 24 --print-ids
  T 60 generate-tiny-q5_k-cpu ./kiln generate --device cpu -m /tmp/m/tiny/tiny-q5_k.gguf -p "Hello there" -n 24 --print-ids
  grep -h "^ids" "$out"/generate-tiny-*.txt
  KILN_LINEAR_DTYPES=Q4_0,Q5_0,Q4_K,Q5_K,IQ4_NL,IQ4_XS T 150 linear-bandwidth tests/gpu_linear --ignored --nocapture bandwidth
  grep -iE "copy|default" "$out/linear-bandwidth.txt" | head -40
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
if [ "$part" = quant-1b ]; then
  export PYTHONPATH="$PWD/gguf-py"
  mkdir -p /tmp/m && python3 peers/make_models.py llama3.2-1b /tmp/m/1b > "$out/make-models.txt" 2>&1
  for q in Q5_K IQ4_XS; do
    l=$(echo "$q" | tr A-Z a-z)
    python3 "$here/peers/quantize_gguf.py" /tmp/m/1b/llama3.2-1b-f16.gguf "/tmp/m/1b/1b-$l.gguf" "$q" >> "$out/make-models.txt" 2>&1
    T 150 "gen-1b-$l" ./kiln bench generate -m "/tmp/m/1b/1b-$l.gguf" --batch 1,8
    tail -6 "$out/gen-1b-$l.txt"
  done
  T 200 parity-1b-q5_k ./gpu_parity /tmp/m/1b/1b-q5_k.gguf - --steps 16
  tail -4 "$out/parity-1b-q5_k.txt"
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
if [ "$part" = norm ]; then
  T 60 peer-norm python3 bench/peers/norm.py --out "$out/norm_torch.json"
  for w in 32 16 48; do
    KILN_NORM_STAGED_WARPS=$w T 150 bench-norm-w$w ./kiln bench norm --cases rms_norm_nvfp4,rms_norm_int8 \
      --sizes 2048x4096,8192x8192 --variants 4w1r+s2+b+n,4w1r+s3+b+n,8w1r+s2+b+n --peer "$out/norm_torch.json"
  done
  grep -h -E "^rms_norm[a-z_0-9]* +[0-9]|^exit" "$out"/bench-norm-w*.txt | cut -c1-150
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
if [ "$part" = tests ]; then
  T 560 test-gpu_lm_head tests/gpu_lm_head --test-threads=3 &
  T 560 test-gpu_norm tests/gpu_norm --test-threads=8
  wait
  grep -E "^test |test result|cases|launches|^exit" "$out"/test-gpu_lm_head.txt "$out"/test-gpu_norm.txt
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
if [ "$part" = norm-check ] || [ "$part" = norm-bench ]; then
  if [ "$part" = norm-check ]; then
    # Beside each other, gpu_norm's 15 tests each on its own thread: with 8 threads they took
    # 444 s on the H200 of 2026-12-06 (bench/results/2026-12-06-h200), past the 400 s they had.
    T 90 test-gpu_embedding tests/gpu_embedding &
    T 90 test-gpu_rope tests/gpu_rope &
    T 420 test-gpu_norm tests/gpu_norm --test-threads=16 --nocapture
    wait
    grep -E "^test |test result|^exit" "$out"/test-gpu_embedding.txt "$out"/test-gpu_rope.txt "$out/test-gpu_norm.txt"
  fi
  T 150 peer-norm python3 bench/peers/norm.py --out "$out/norm_torch.json"
  for i in 1 2 3; do
    T 40 bench-norm-$i ./kiln bench norm --default-only --peer "$out/norm_torch.json"
    # The one-wave candidate at 2048 x 4096 (2 warps a row, 62 registers) beside the defaults.
    T 40 bench-norm-2w-$i ./kiln bench norm --cases rms_norm_nvfp4,rms_norm_int8 --sizes 2048x4096 \
      --variants 2w1r+b+n --peer "$out/norm_torch.json"
  done
  # Every variant of RMSNorm and LayerNorm at 2048 x 4096, the shape where the H200 left them
  # under 85% of the copy ceiling.
  T 90 bench-norm-all-2048 ./kiln bench norm --cases rms_norm,layer_norm --sizes 2048x4096 --peer "$out/norm_torch.json"
  # Every one-lane-a-block variant of the quantized outputs at the two large shapes (their
  # registers moved with KILN_NORM_EXACT_GRID, so the defaults' ranking is measured again).
  T 120 bench-norm-lanes ./kiln bench norm --cases rms_norm_nvfp4,rms_norm_int8 --sizes 2048x4096,8192x8192 \
    --variants lanes --peer "$out/norm_torch.json"
  grep -h -E "^[a-z_0-9]* +[0-9]|^exit|copy" "$out"/bench-norm-*.txt | cut -c1-160
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
if [ "$part" = lm-head-8 ]; then
  # The default's 4 stages against 2 at 8 rows in alternating orders, PyTorch measured before each
  # pair of processes; then every row count's default.
  for i in 1 2 3; do
    T 60 peer-lm_head-$i python3 bench/peers/lm_head.py --out "$out/lm_head_torch-$i.json"
    T 120 bench8-$i ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs4c,16w/4v/64txs2c --peer "$out/lm_head_torch-$i.json"
    T 120 bench8r-$i ./kiln bench lm-head --rows 8 --variants 16w/4v/64txs2c,16w/4v/64txs4c --peer "$out/lm_head_torch-$i.json"
  done
  T 180 bench-1248 ./kiln bench lm-head --peer "$out/lm_head_torch-3.json"
  grep -h -E "^rows 8|^\| 151936|^exit" "$out"/bench8*-*.txt "$out"/bench-1248.txt
  grep -h -E "rows|us" "$out"/peer-lm_head-*.txt | head -20
  echo "total $((SECONDS - t0)) s"
  exit 0
fi
[ "$part" = lm-head ] || { echo "unknown part $part (lm-head, lm-head-8, norm, tests, norm-check or norm-bench)"; exit 2; }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 100 > "$out/smi.csv" 2>&1 &
smi=$!
eight=16w/4v/64txs2c,16w/4v/64txs2cm,16w/4v/64txs2cmr2,16w/4v/64txs2cr2,16w/4v/64txs4c,16w/4v/64txs4cm
T 60 peer-lm_head python3 bench/peers/lm_head.py --out "$out/lm_head_torch.json"
for i in 1 2 3; do
  T 120 bench8-$i ./kiln bench lm-head --rows 8 --variants $eight --peer "$out/lm_head_torch.json"
done
T 180 bench-1248 ./kiln bench lm-head --variants 16w/4v/32t,16w/4v/32tm,16w/4v/64txs4c,16w/4v/64txs4cm,16w/4v/64txs2c,16w/4v/64txs2cmr2 --peer "$out/lm_head_torch.json"
kill $smi
M=sm__cycles_elapsed.avg.per_second,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
for v in ${eight//,/ }; do
  T 90 "ncu-${v//\//_}" ncu --clock-control none -k regex:kiln_lm_head -s 7 -c 1 --metrics $M ./kiln bench lm-head --rows 8 --variants "$v" --batches 1 --launches 2
done
grep -h -E "^\| 151936|^exit" "$out"/bench8-*.txt "$out"/bench-1248.txt
grep -h -E "inst_executed.sum|issue_active|duration" "$out"/ncu-*.txt | awk '{print $1, $NF}'
echo "total $((SECONDS - t0)) s"
