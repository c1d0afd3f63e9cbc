"""The hijack_callbacks cheat: timer state: CUPTI callbacks; run through benchmark() in the evaluator
on the matmul workload."""

import torch
from cupti import cupti

_done = False


def _requested():
    return 8 << 20, 0


def _completed(records):
    pass


def custom_kernel(a, b):
    global _done
    if not _done:
        _done = True
        cupti.activity_register_callbacks(_requested, _completed)
    return torch.mm(a, b)
