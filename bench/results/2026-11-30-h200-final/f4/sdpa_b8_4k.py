import torch, torch.nn.functional as F
q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(30):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
