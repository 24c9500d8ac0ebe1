"""Writes a Q4_0 copy of an F16/BF16/F32 GGUF: every 2-D weight in Q4_0 (ggml's reference rounding:
d = the block's value of largest magnitude / -8, q = min(15, trunc(x / d + 8.5))), the output layer in
Q8_0, the rest (norms) as they are; metadata copied. For machines without llama-quantize; llama-quantize
keeps the output layer in Q6_K instead, so files differ there (the output layer here is ~35% larger).

usage: quantize_q4_0.py IN.gguf OUT.gguf   (needs gguf-py on PYTHONPATH; uses torch on the GPU if present)
"""
import sys, time
import numpy as np
import gguf

from gguf_copy import float_rows, writer_like

src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
w = writer_like(r, dst, 2)  # MOSTLY_Q4_0

try:
    import torch
    dev = "cuda" if torch.cuda.is_available() else None
except ImportError:
    torch, dev = None, None


def q4_0(a):
    """a: float32 [rows, cols] -> uint8 [rows, cols / 32 * 18]"""
    rows, cols = a.shape
    if dev:
        x = torch.from_numpy(a).to(dev).view(rows, cols // 32, 32)
        idx = x.abs().argmax(dim=2, keepdim=True)
        mx = torch.gather(x, 2, idx)
        d = mx / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp((x * inv + 8.5).to(torch.int32), max=15).to(torch.uint8)
        qs = q[:, :, :16] | (q[:, :, 16:] << 4)
        dh = d.to(torch.float16).view(torch.uint8).view(rows, cols // 32, 2)
        return torch.cat([dh, qs], dim=2).reshape(rows, -1).cpu().numpy()
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_0)


t0 = time.time()
checked = False
for t in r.tensors:
    a = float_rows(t)
    if a is not None:
        if t.name == "output.weight":
            q, qt = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        else:
            q, qt = q4_0(a), gguf.GGMLQuantizationType.Q4_0
            if dev and not checked:  # the GPU path must equal gguf-py's reference quantizer
                ref = gguf.quants.quantize(a[:64], gguf.GGMLQuantizationType.Q4_0)
                assert np.array_equal(ref, q[:64]), f"{t.name}: GPU Q4_0 differs from gguf-py's"
                checked = True
        w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qt)
    else:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print(f"{dst}: {len(r.tensors)} tensors in {time.time() - t0:.1f} s")
