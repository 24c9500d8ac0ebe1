#!/usr/bin/env bash
# llama.cpp's CPU speed on SmolLM2-135M-Instruct Q4_1, the peer figure for Kiln's CPU backend.
#
#   bench/peers/llamacpp_cpu_bench.sh LLAMA_BENCH [MODEL] [THREADS]
#
# LLAMA_BENCH: a llama-bench built for the CPU, e.g. from the llama-cpp-python sdist's
# vendor/llama.cpp (see bench/results/2026-11-29-cpu-smollm2-llamacpp.md for the exact build):
#   cmake -S llama.cpp -B build -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF \
#     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
#     -DCMAKE_BUILD_TYPE=Release
#   cmake --build build -j2 --target llama-bench
# MODEL defaults to .models/SmolLM2-135M-Instruct.Q4_1.gguf; THREADS to the number of cores.
# Prints the machine, then llama-bench's markdown table: pp64 and pp512 are prompt tokens/s over
# 64 and 512-token prompts, tg128 is decode tokens/s over 128 generated tokens (5 repetitions).
# Run it on an idle machine: llama.cpp's threads spin at barriers, so with other processes on the
# cores its 2-thread speed collapses (it also prints the load average to show the state).
set -eu
bench=${1:?usage: $0 LLAMA_BENCH [MODEL] [THREADS]}
model=${2:-.models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${3:-$(nproc)}
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(nproc) cores"
echo "load average: $(cut -d" " -f1-3 /proc/loadavg)"
echo "model: $model ($(sha256sum "$model" | cut -c1-16)...)"
"$bench" -m "$model" -p 64,512 -n 128 -t "$threads" -r 5 -o md
