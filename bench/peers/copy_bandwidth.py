#!/usr/bin/env python3
"""PyTorch's device-to-device copy bandwidth: the peer of `kiln bench copy`.

Times `dst.copy_(src)` on two uint8 buffers with CUDA events: a warm-up, then the median of many
copies; bytes counted = read + written. Prints one JSON object (`--json` is the default output, as
`kiln bench copy --peer` reads it).
"""
import argparse
import json
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=2 << 30, help="bytes per buffer")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()

    device = torch.device(args.device)
    src = torch.empty(args.bytes, dtype=torch.uint8, device=device).fill_(0x5A)
    dst = torch.empty_like(src)
    for _ in range(args.warmup):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times_us = []
    for _ in range(max(args.iterations, 1)):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times_us.append(start.elapsed_time(end) * 1e3)
    if not torch.equal(dst[:4096], src[:4096]):
        raise SystemExit("copy_bandwidth.py: the copy is wrong")
    median_us = statistics.median_low(times_us)
    print(json.dumps({
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "bytes": args.bytes,
        "iterations": len(times_us),
        "median_us": median_us,
        "min_us": min(times_us),
        "gb_per_s": 2 * args.bytes / (median_us * 1e3),
    }))


if __name__ == "__main__":
    main()
