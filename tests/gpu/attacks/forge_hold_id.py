"""The forge_hold_id cheat: timer state: correlation ids; run through benchmark() in the evaluator on
the matmul workload."""

import sys

import torch
from cupti import cupti

from kcoral.timing.cupti import HOLD_ID_OFFSET

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


def _timer_ids():
    frame = sys._getframe(1)
    while frame is not None:
        names = frame.f_locals
        if "base" in names and "index" in names and "brackets" in names:
            return names["base"], names["index"]
        frame = frame.f_back
    return None


def custom_kernel(a, b):
    ids = _timer_ids()
    if ids is None:
        return torch.mm(a, b)
    base, index = ids
    kind = cupti.ExternalCorrelationKind.CUSTOM2
    cupti.activity_push_external_correlation_id(kind, base + HOLD_ID_OFFSET + index)
    try:
        out = torch.mm(a, b)
    finally:
        cupti.activity_pop_external_correlation_id(kind)
    _touch()
    return out
