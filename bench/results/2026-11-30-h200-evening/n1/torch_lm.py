import torch
w = (torch.rand(151936, 4096, device="cuda") - 0.5).to(torch.bfloat16); h = (torch.rand(8, 4096, device="cuda") - 0.5).to(torch.bfloat16)
for _ in range(3): torch.matmul(h, w.t())
torch.cuda.synchronize()
