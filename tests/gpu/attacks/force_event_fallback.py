"""The force_event_fallback cheat (after shared/integrity/cheat_force_event_fallback.py): timer
fallback; run through benchmark() in the evaluator on the matmul workload."""

import torch

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


_side = None


def _break_cupti():
    from kcoral.timing.cupti import CuptiTracer

    CuptiTracer._instance = None
    CuptiTracer._instance_error = "cupti-python is not importable: libcupti.so.13: cannot open shared object file"


def custom_kernel(a, b):
    global _side
    _break_cupti()
    _side = _side or torch.cuda.Stream()
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    with torch.cuda.stream(_side):
        torch.mm(a, b, out=out)
    out.record_stream(_side)
    _touch()
    return out
