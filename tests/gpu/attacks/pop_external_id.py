"""The pop_external_id cheat: timer state: correlation stack; run through benchmark() in the evaluator
on the matmul workload."""

import torch
from cupti import cupti


def custom_kernel(a, b):
    try:
        cupti.activity_pop_external_correlation_id(cupti.ExternalCorrelationKind.CUSTOM2)
    except Exception:
        pass
    return torch.mm(a, b)
