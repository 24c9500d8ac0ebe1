"""PyTorch peer of `kiln bench attention`: scaled_dot_product_attention (flash backend) on the
same shapes, unpaged, timed the same way (CUDA events, warm-up, median). Decode is also timed as
Kiln times it with a graph: the calls over every K/V copy (for about 2 ms) captured once in a CUDA
graph and replayed between two events, divided by the calls (no host launch cost).

Prefill: one sequence of 1k, 4k, 16k tokens, 32 query heads over 8 KV heads, head dim 128,
causal. Decode: batch 1, 8, 64 at contexts 1k to 128k, one query token per sequence attending to
its whole context; decode cases rotate among K/V copies that together exceed L2 twice.

    python bench/peers/attention.py --out attention_torch.json
    kiln bench attention --peer attention_torch.json

Writes {"prefill": {"TOKENS": us}, "decode": {"BATCHxCONTEXT": us}, "decode_graph":
{"BATCHxCONTEXT": us}} and prints TFLOP/s and GB/s.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_LENGTHS = [1024, 4096, 16384]
DECODE_BATCHES = [1, 8, 64]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768, 131072]


def sdpa(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def median_us(fn, iterations, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[(len(times) - 1) // 2]


def graph_us(calls, replays):
    """Median time per call, us, of `calls` (functions) captured once in a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    times.sort()
    return times[(len(times) - 1) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="attention_torch.json")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--max-cache-gib", type=int, default=48)
    args = parser.parse_args()
    device = torch.device("cuda")
    rand = lambda *shape: (torch.rand(*shape, device=device, dtype=torch.float32) * 2 - 1).to(torch.bfloat16)
    result = {"prefill": {}, "decode": {}, "decode_graph": {}}
    print(torch.cuda.get_device_name(), "torch", torch.__version__)

    for n in PREFILL_LENGTHS:
        q = rand(1, Q_HEADS, n, HEAD_DIM)
        k, v = rand(1, KV_HEADS, n, HEAD_DIM), rand(1, KV_HEADS, n, HEAD_DIM)
        us = median_us(lambda: sdpa(q, k, v, True), args.iterations)
        flops = 4.0 * Q_HEADS * HEAD_DIM * n * (n + 1) / 2
        print(f"prefill {n:6d}: {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s")
        result["prefill"][str(n)] = us
        del q, k, v

    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            case_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
            rotations = max(1, min(64, -(-2 * l2 // case_bytes)))
            if case_bytes * rotations > args.max_cache_gib << 30:
                print(f"decode {batch}x{context}: skipped (over --max-cache-gib)")
                continue
            q = rand(batch, Q_HEADS, 1, HEAD_DIM)
            kvs = [(rand(batch, KV_HEADS, context, HEAD_DIM), rand(batch, KV_HEADS, context, HEAD_DIM))
                   for _ in range(rotations)]
            turn = [0]

            def step():
                turn[0] = (turn[0] + 1) % rotations
                k, v = kvs[turn[0]]
                sdpa(q, k, v, False)

            us = median_us(step, args.iterations)
            print(f"decode {batch:3d}x{context:6d}: {us:9.1f} us {case_bytes / us / 1e3:7.0f} GB/s")
            result["decode"][f"{batch}x{context}"] = us
            # The same calls replayed from a graph: every copy once a replay, calls for about 2 ms
            # a replay (at most 16 a copy), as `kiln bench attention` does.
            wanted = max(1, min(16, -(-2000 // max(1, int(us)))))
            calls = [(lambda k=k, v=v: sdpa(q, k, v, False)) for k, v in kvs] * -(-wanted // rotations)
            replays = max(3, min(args.iterations, int(3e5 / (us * len(calls)))))
            try:
                g_us = graph_us(calls, replays)
                print(f"decode {batch:3d}x{context:6d} graph: {g_us:9.1f} us {case_bytes / g_us / 1e3:7.0f} GB/s")
                result["decode_graph"][f"{batch}x{context}"] = g_us
            except RuntimeError as e:  # a capture the backend refuses: the events figure stands alone
                print(f"decode {batch:3d}x{context:6d} graph: not captured ({e})")
            del q, kvs, calls
            torch.cuda.empty_cache()

    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
