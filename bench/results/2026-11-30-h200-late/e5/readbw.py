# Read-only bandwidth on the GPU: a 4 GiB fp32 sum (PyTorch's reduction kernel), CUDA events, median of 20.
import torch
x = torch.ones(1 << 30, device="cuda", dtype=torch.float32)
for _ in range(3):
    x.sum()
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); x.sum(); b.record(); b.synchronize()
    ts.append(a.elapsed_time(b))
ts.sort()
ms = ts[len(ts) // 2]
print(f"read-only sum of 4 GiB: {ms * 1000:.1f} us, {4 * (1 << 30) / ms / 1e6:.0f} GB/s")
y = torch.empty_like(x)
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize()
    ts.append(a.elapsed_time(b))
ts.sort()
ms = ts[len(ts) // 2]
print(f"copy of 4 GiB: {ms * 1000:.1f} us, {8 * (1 << 30) / ms / 1e6:.0f} GB/s (read + write)")
