import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
ctx = int(sys.argv[1]); b = 8
r = lambda *s: (torch.rand(*s, device="cuda") * 2 - 1).to(torch.bfloat16)
q = r(b, 32, 1, 128); k = r(b, 8, ctx, 128); v = r(b, 8, ctx, 128)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3): F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
