"""The kinds_off_for_good cheat: timer state: activity kinds; run through benchmark() in the evaluator
on the matmul workload."""

import torch
from cupti import cupti

_calls = 0


def custom_kernel(a, b):
    global _calls
    _calls += 1
    if _calls > 3:
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    return torch.mm(a, b)
