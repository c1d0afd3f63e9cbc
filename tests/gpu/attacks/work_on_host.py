"""The work_on_host cheat: work on the host; run through benchmark() in the evaluator on the reduce workload."""

import torch


def custom_kernel(x):
    host = x.cpu()
    total = float(host.double().sum())  # the reduction runs on the CPU
    return torch.tensor(total, dtype=x.dtype, device=x.device)
