"""PyTorch peer of `kiln bench lm-head`: torch.matmul of h (ROWS x 4096, bf16) with W^T
(W 151936 x 4096 bf16) for 1, 2, 4 and 8 rows, timed the same way (CUDA events around batches of
launches, the median of the batches; W is far larger than L2).

    python bench/peers/lm_head.py --out lm_head_torch.json
    kiln bench lm-head --peer lm_head_torch.json

Prints a table and writes {"ROWS": microseconds}.
"""

import argparse
import json

import torch


def timed(fn, batches, launches):
    for _ in range(max(3, launches)):
        fn()
    times = []
    for _ in range(batches):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="lm_head_torch.json")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--launches", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}")
    w = torch.rand(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16) * 2 - 1
    results = {}
    print(f"{'rows':>4} {'time_us':>10} {'GB/s':>8}")
    for rows in [1, 2, 4, 8]:
        hs = [torch.rand(rows, args.hidden, device=dev, dtype=torch.bfloat16) * 2 - 1 for _ in range(4)]
        k = [0]

        def run():
            h = hs[k[0] % len(hs)]
            k[0] += 1
            return torch.matmul(h, w.t())

        us = timed(run, args.batches, args.launches)
        gbs = (w.numel() * 2 + rows * args.hidden * 2 + rows * args.vocab * 2) / us / 1e3
        results[str(rows)] = us
        print(f"{rows:>4} {us:>10.1f} {gbs:>8.0f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
