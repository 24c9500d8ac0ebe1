"""PyTorch peer of `kiln bench norm`: the same norms at the same shapes, timed the same way.

Cases: torch.nn.functional.rms_norm; the residual add plus rms_norm written in PyTorch; the
rms_norm followed by INT8 and NVFP4-style per-16 quantization written in PyTorch (what a model
without a fused kernel runs); torch.nn.functional.layer_norm. bf16, inputs rotated so they do not
sit in L2, median of the batches. As `kiln bench norm` times by default, each batch of launches is
captured once into a CUDA graph (torch.cuda.graph) and replayed between CUDA events, so that
PyTorch's host cost per call stays out of the time too; a case whose capture fails is timed eagerly
and marked so. `--plain-launches` times eager calls between events (pair it with
`kiln bench norm --plain-launches`).

    python bench/peers/norm.py --out norm_torch.json
    kiln bench norm --peer norm_torch.json

Prints a table and writes {case: {"ROWSxHIDDEN": microseconds}}.
"""

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = [(1, 4096), (2048, 4096), (8192, 8192)]


def rms_norm(x, w, res=None):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def rms_norm_residual(x, w, res):
    h = x + res
    res.copy_(h)
    return F.rms_norm(h, (h.shape[-1],), w, 1e-5)


def rms_norm_int8(x, w, res=None):
    y = F.rms_norm(x, (x.shape[-1],), w, 1e-5).float().view(x.shape[0], -1, 16)
    scale = y.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, (y / scale).round().clamp(-127, 127), torch.zeros_like(y)).to(torch.int8)
    return q, scale


_GRIDS = {}


def e2m1_grid(device):
    # Made once, outside any graph capture (a host-to-device copy cannot be captured).
    if device not in _GRIDS:
        _GRIDS[device] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=device)
    return _GRIDS[device]


def rms_norm_nvfp4(x, w, res=None):
    y = F.rms_norm(x, (x.shape[-1],), w, 1e-5).float().view(x.shape[0], -1, 16)
    s = (y.abs().amax(-1, keepdim=True) / 6.0 * 448.0).clamp(max=448.0).to(torch.float8_e4m3fn)
    d = s.float() / 448.0
    v = (y / d).clamp(-6, 6)
    # E2M1 rounding through the nearest-value table; packing two codes per byte.
    grid = e2m1_grid(x.device)
    code = (v.abs().unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)
    code = code.view(x.shape[0], -1, 2)
    return code[..., 0] | (code[..., 1] << 4), s


def layer_norm(x, w, res=None, b=None):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


CASES = {
    "rms_norm": rms_norm,
    "rms_norm_residual": rms_norm_residual,
    "rms_norm_int8": rms_norm_int8,
    "rms_norm_nvfp4": rms_norm_nvfp4,
    "layer_norm": layer_norm,
}


def timed(fn, sets, batches, launches):
    for i in range(max(3, launches)):
        fn(*sets[i % len(sets)])
    times = []
    k = 0
    for _ in range(batches):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn(*sets[k % len(sets)])
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    times.sort()
    return times[len(times) // 2]


def graph_timed(fn, sets, batches, launches):
    for i in range(max(3, launches)):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(launches):
            fn(*sets[k % len(sets)])
    graph.replay()
    times = []
    for _ in range(batches):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="norm_torch.json")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--plain-launches", action="store_true",
                        help="time eager calls between CUDA events instead of CUDA graph replays")
    args = parser.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    results = {}
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}, "
          f"{'eager calls' if args.plain_launches else 'CUDA graph replays'} between CUDA events")
    print(f"{'case':<20} {'shape':>12} {'time_us':>10}")
    for rows, hidden in SHAPES:
        x_bytes = rows * hidden * 2
        sets_n = max(2, min(64, -(-2 * l2 // (3 * x_bytes))))
        w = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
        b = torch.rand(hidden, device=dev, dtype=torch.bfloat16) - 0.5
        for name, fn in CASES.items():
            sets = [
                (torch.rand(rows, hidden, device=dev, dtype=torch.bfloat16) * 4 - 2, w,
                 torch.rand(rows, hidden, device=dev, dtype=torch.bfloat16) * 4 - 2)
                for _ in range(sets_n)
            ]
            run = (lambda x, w, r: layer_norm(x, w, r, b)) if name == "layer_norm" else fn
            how = ""
            if args.plain_launches:
                us = timed(run, sets, args.batches, args.launches)
            else:
                try:
                    us = graph_timed(run, sets, args.batches, args.launches)
                except RuntimeError as e:
                    how = f" (eager: capture failed: {str(e).splitlines()[0][:80]})"
                    torch.cuda.synchronize()
                    us = timed(run, sets, args.batches, args.launches)
            results.setdefault(name, {})[f"{rows}x{hidden}"] = us
            print(f"{name:<20} {rows}x{hidden:>7} {us:>10.2f}{how}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
