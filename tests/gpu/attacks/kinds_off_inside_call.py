"""The kinds_off_inside_call cheat: timer state: activity kinds; run through benchmark() in the
evaluator on the matmul workload."""

import torch
from cupti import cupti

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


def custom_kernel(a, b):
    cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    try:
        out = torch.mm(a, b)
    finally:
        cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    _touch()
    return out
