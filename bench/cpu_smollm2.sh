#!/usr/bin/env bash
# Kiln's CPU speed on SmolLM2-135M-Instruct Q4_1 beside llama.cpp's, same machine, same threads.
#   bench/cpu_smollm2.sh LLAMA_BENCH [MODEL] [THREADS]
# Kiln: prompt tok/s over a 64- and a 512-token prompt (296 and 2377 characters of the sentence
# below make exactly 64 and 512 SmolLM2 tokens; the table's header says how many Kiln counted),
# decode tok/s over 128 tokens (3 runs, median); llama.cpp: llama-bench pp64, pp512, tg128 (5
# repetitions). Run on an idle machine.
set -eu
bench=${1:?usage: $0 LLAMA_BENCH [MODEL] [THREADS]}
model=${2:-.models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${3:-$(nproc)}
kiln=${KILN:-target/release/kiln}
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD)"
echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(nproc) cores, threads $threads"
echo "load average before: $(cut -d" " -f1-3 /proc/loadavg)"
words() { yes "The quick brown fox jumps over the lazy dog near the river bank." | head -c "$1" | tr '\n' ' '; }
median() { sort -n | sed -n 2p; }
run() {  # run PROMPT_CHARS MAX_TOKENS FIELD
  for _ in 1 2 3; do
    words "$1" | "$kiln" generate --device cpu -m "$model" -p - -n "$2" --threads "$threads" 2>&1 >/dev/null \
      | sed -n "s/.*$3 \([0-9]*\) tokens, \([0-9.]*\) tok\/s.*/\2/p"
  done | median
}
tokens() { words "$1" | "$kiln" generate --device cpu -m "$model" -p - -n 1 --threads "$threads" 2>&1 >/dev/null \
  | sed -n 's/.*prompt \([0-9]*\) tokens.*/\1/p'; }
echo "kiln prompt tokens: $(tokens 296) and $(tokens 2377)"
pp64=$(run 296 1 prompt); pp512=$(run 2377 1 prompt); tg=$(run 40 128 decode)
echo
echo "| engine | pp64 tok/s | pp512 tok/s | tg128 tok/s |"
echo "| --- | ---: | ---: | ---: |"
echo "| kiln | $pp64 | $pp512 | $tg |"
"$bench" -m "$model" -p 64,512 -n 128 -t "$threads" -r 5 -o md 2>/dev/null | grep -E "^\| (model|llama)"
echo "load average after: $(cut -d" " -f1-3 /proc/loadavg)"
