"""Writes a Q5_0, Q5_1, Q5_K, IQ4_NL or IQ4_XS copy of an F16/BF16/F32 GGUF: every 2-D weight (the
token embedding and the output layer too) in that format, the rest (norms) as they are; metadata
copied. For GPU machines without llama-quantize: the models of `kiln bench generate` and
`gpu_parity` in those formats.

- Q5_0 and Q5_1: ggml's reference rounding (Q5_0: d = the block's value of largest magnitude / -16,
  q = min(31, trunc(x / d + 16.5)); Q5_1: d = (max - min) / 31, m = min,
  q = min(31, trunc((x - m) / d + 0.5))), checked bit for bit against gguf-py's quantizer on the
  first rows of each tensor.
- Q5_K: a plain min-max rounding, not llama-quantize's search: each sub-block of 32 takes
  scale (max - min') / 31 and offset -min' (min' = min(min, 0)); the super-block's d and dmin are
  the largest of them over 63 (f16), the 6-bit sub-block scales and offsets are rounded from them,
  and q = round((x + dmin m) / (d sc)) clamped to 0..31. Checked by gguf-py's dequantizer: every
  value within half a step (plus the scales' rounding) of its input.
- IQ4_NL and IQ4_XS: a plain rounding, not llama-quantize's search: a block's (IQ4_XS: a
  sub-block's) scale is its value of largest magnitude over -127 (IQ4_XS: the sub-block scales
  are d (ls - 32) with d their largest magnitude over 31, f16), and each code the table value
  nearest x / scale. Checked by gguf-py's dequantizer: every value within the table's largest
  half gap (12 steps) of its input.

usage: quantize_gguf.py IN.gguf OUT.gguf Q5_0|Q5_1|Q5_K|IQ4_NL|IQ4_XS   (needs gguf-py on
PYTHONPATH and torch; the GPU when there is one)
"""
import sys
import time

import gguf
import numpy as np
import torch

from gguf_copy import float_rows, writer_like

src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3]
# MOSTLY_Q5_0, MOSTLY_Q5_1, MOSTLY_Q5_K_M, MOSTLY_IQ4_NL, MOSTLY_IQ4_XS
FILE_TYPE = {"Q5_0": 8, "Q5_1": 9, "Q5_K": 17, "IQ4_NL": 25, "IQ4_XS": 30}
if kind not in FILE_TYPE:
    sys.exit(f"type must be one of {sorted(FILE_TYPE)}, not {kind}")
qtype = gguf.GGMLQuantizationType[kind]
block = 256 if kind in ("Q5_K", "IQ4_XS") else 32
dev = "cuda" if torch.cuda.is_available() else "cpu"

r = gguf.GGUFReader(src)
w = writer_like(r, dst, FILE_TYPE[kind])


def div(a, b):
    """a / b rounded as IEEE division: PyTorch on CUDA divides by a host scalar as a product with
    its reciprocal, which can differ from the division in the last bit (and from numpy's)."""
    return a / torch.full_like(a, b)


def f16_bytes(t):
    """float32 [..., 1] -> uint8 [..., 2] (the f16 bits, little-endian)"""
    return t.to(torch.float16).view(torch.uint8)


def pack_high(q):
    """q: int [..., 32] of 5-bit values -> (qh uint8 [..., 4] with bit j = bit 4 of q[j], qs [..., 16])"""
    bits = ((q >> 4) & 1).to(torch.int64)
    qh = (bits << torch.arange(32, device=q.device)).sum(-1, keepdim=True)
    qh = torch.cat([(qh >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
    qs = ((q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)).to(torch.uint8)
    return qh, qs


def q5_0(x):
    """x: float32 [blocks, 32] -> uint8 [blocks, 22]"""
    idx = x.abs().argmax(-1, keepdim=True)
    mx = torch.gather(x, -1, idx)
    d = div(mx, -16.0)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp((x * inv + 16.5).to(torch.int32), max=31)
    qh, qs = pack_high(q)
    return torch.cat([f16_bytes(d), qh, qs], -1)


def q5_1(x):
    """x: float32 [blocks, 32] -> uint8 [blocks, 24]"""
    mn = x.min(-1, keepdim=True).values
    mx = x.max(-1, keepdim=True).values
    d = div(mx - mn, 31.0)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(((x - mn) * inv + 0.5).to(torch.int32), max=31)
    qh, qs = pack_high(q)
    return torch.cat([f16_bytes(d), f16_bytes(mn), qh, qs], -1)


def q5_k(x):
    """x: float32 [blocks, 256] -> uint8 [blocks, 176]"""
    n = x.shape[0]
    sub = x.view(n, 8, 32)
    lo = torch.clamp(sub.min(-1).values, max=0.0)
    scale = div(sub.max(-1).values - lo, 31.0)  # [n, 8]
    offset = -lo
    d = div(scale.max(-1, keepdim=True).values, 63.0).to(torch.float16).float()
    dmin = div(offset.max(-1, keepdim=True).values, 63.0).to(torch.float16).float()
    sc = torch.where(d > 0, torch.round(scale / torch.where(d > 0, d, 1.0)), 0.0).clamp(0, 63).to(torch.int32)
    m = torch.where(dmin > 0, torch.round(offset / torch.where(dmin > 0, dmin, 1.0)), 0.0).clamp(0, 63).to(torch.int32)
    d1 = (d * sc).unsqueeze(-1)
    m1 = (dmin * m).unsqueeze(-1)
    q = torch.where(d1 > 0, torch.round((sub + m1) / torch.where(d1 > 0, d1, 1.0)), 0.0).clamp(0, 31).to(torch.int32)
    # scales[12] as get_scale_min_k4 reads them.
    s = torch.empty(n, 12, dtype=torch.int32, device=x.device)
    s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    # Chunk c (64 values: sub-blocks 2c, 2c + 1): qs[32c + l] = low nibbles of value l and l + 32;
    # qh[l] bit 2c: bit 4 of value 64c + l, bit 2c + 1: of value 64c + 32 + l.
    q = q.view(n, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    shifts = (2 * torch.arange(4, device=x.device)).view(1, 4, 1)
    qh = ((((q[:, :, 0] >> 4) & 1) << shifts) | (((q[:, :, 1] >> 4) & 1) << (shifts + 1))).sum(1)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), s.to(torch.uint8), qh.to(torch.uint8), qs.to(torch.uint8)], -1)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def iq4_codes(x, scale):
    """x: float32 [..., 32], scale [..., 1] -> qs uint8 [..., 16]: the nearest table value's index"""
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=x.device)
    y = torch.where(scale != 0, x / torch.where(scale != 0, scale, 1.0), torch.zeros_like(x))
    code = (y.unsqueeze(-1) - table).abs().argmin(-1).to(torch.int32)
    return ((code[..., :16] & 0xF) | ((code[..., 16:] & 0xF) << 4)).to(torch.uint8)


def signed_max(x):
    """The value of largest magnitude of each row of x [..., n], with its sign: [..., 1]"""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


def iq4_nl(x):
    """x: float32 [blocks, 32] -> uint8 [blocks, 18]"""
    d = div(signed_max(x), -127.0).to(torch.float16)
    return torch.cat([d.view(torch.uint8), iq4_codes(x, d.float())], -1)


def iq4_xs(x):
    """x: float32 [blocks, 256] -> uint8 [blocks, 136]"""
    n = x.shape[0]
    sub = x.view(n, 8, 32)
    scale = div(signed_max(sub).squeeze(-1), -127.0)  # [n, 8]
    d = div(scale.abs().max(-1, keepdim=True).values, 31.0).to(torch.float16).float()
    ls = torch.where(d > 0, torch.round(scale / torch.where(d > 0, d, 1.0)), 0.0).clamp(-32, 31).to(torch.int32) + 32
    dl = (d * (ls - 32)).unsqueeze(-1)
    qs = iq4_codes(sub, dl).reshape(n, 128)
    high = (((ls >> 4) & 3) << (2 * torch.arange(8, device=x.device))).sum(-1, keepdim=True)
    scales_h = torch.cat([high & 0xFF, (high >> 8) & 0xFF], -1).to(torch.uint8)
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).to(torch.uint8)
    return torch.cat([f16_bytes(d), scales_h, scales_l, qs], -1)


QUANTIZE = {"Q5_0": q5_0, "Q5_1": q5_1, "Q5_K": q5_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs}


def quantize(a):
    """a: float32 [rows, cols] -> uint8 [rows, cols / block * bytes]"""
    rows, cols = a.shape
    out = []
    step = max(1, (1 << 26) // cols)  # rows per slice: 64 Mi values
    for r0 in range(0, rows, step):
        x = torch.from_numpy(a[r0:r0 + step]).to(dev).reshape(-1, block)
        out.append(QUANTIZE[kind](x).reshape(min(step, rows - r0), -1).cpu().numpy())
    return np.concatenate(out)


def check(name, a, q):
    """The first rows against gguf-py: the same bytes (Q5_0, Q5_1), or every value within its step."""
    head = a[:16]
    if kind in ("Q5_0", "Q5_1"):
        ref = gguf.quants.quantize(head, qtype)
        assert np.array_equal(ref, q[:16]), f"{name}: {kind} differs from gguf-py's quantizer"
        return
    back = gguf.quants.dequantize(q[:16], qtype).reshape(head.shape)
    if kind in ("IQ4_NL", "IQ4_XS"):
        # A block's (sub-block's) scale is m / 127, m its largest |x|: the codes' values are
        # -127 .. 113 in gaps of at most 24, so a value lands within 14 steps of the scale (113
        # for 127 at the top). IQ4_XS rounds each sub-block's scale to a multiple of d (its
        # super-block's largest over 31, f16): at most d / 2 off, on codes up to 127.
        sub = head.reshape(-1, 32)
        m = np.abs(sub).max(-1, keepdims=True)
        bound = 14.5 / 127.0 * m * (1 + 2e-3)
        if kind == "IQ4_XS":
            d = np.abs(head.reshape(-1, 256)).max(-1, keepdims=True) / 127.0 / 31.0
            bound = (bound.reshape(-1, 8) + 64.0 * d * (1 + 2e-3)).reshape(-1, 1)
        err = np.abs(back - head).reshape(-1, 32)
        assert (err <= bound + 1e-7).all(), f"{name}: {kind} error {(err - bound).max()} past its bound"
        return
    blocks = q[:16].reshape(-1, 176)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    # Half a step of the largest sub-block scale, the sub-block scales' and offsets' rounding
    # (half a step of d and dmin, times 31 and 1), and f16's rounding of d and dmin.
    span = np.abs(head.reshape(-1, 256)).max(-1, keepdims=True)
    bound = 0.5 * d * 63 + 16 * d + 0.5 * dmin + 1e-2 * span + 1e-7
    err = np.abs(back.reshape(-1, 256) - head.reshape(-1, 256))
    assert (err <= bound).all(), f"{name}: Q5_K error {err.max()} past its bound"


t0 = time.time()
counts = {}
for t in r.tensors:
    a = float_rows(t)
    if a is not None and a.shape[1] % block == 0:
        q = quantize(np.ascontiguousarray(a))
        check(t.name, a, q)
        w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
        counts[kind] = counts.get(kind, 0) + 1
    else:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"{dst}: {len(r.tensors)} tensors {counts} in {time.time() - t0:.1f} s")
