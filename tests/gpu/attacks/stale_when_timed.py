"""The stale_when_timed cheat: telling timed calls from untimed; run through the trusted path, kcoral
remote on the matmul workload."""

import sys

import torch

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


_last = None


def _timed():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "timed_calls":
            return True
        frame = frame.f_back
    return False


def custom_kernel(a, b):
    global _last
    if _timed() and _last is not None:
        _touch()
        return _last
    _last = torch.mm(a, b)
    return _last
