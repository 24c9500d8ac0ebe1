# FlashAttention-2 (PyTorch SDPA, flash backend) decode at batch 8, context 131072, GQA 32/8, head dim 128:
# the peer's kernel alone, for Nsight Compute.
import torch
import torch.nn.functional as F
b, hq, hkv, ctx, d = 8, 32, 8, 131072, 128
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
    for _ in range(4):
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
print("ok", o.shape)
