"""The patch_torch_sync cheat: timer functions; run through benchmark() in the evaluator on the matmul workload."""

import torch

_real = torch.cuda.synchronize


def custom_kernel(a, b):
    torch.cuda.synchronize = lambda *args, **kwargs: None
    return torch.mm(a, b)
