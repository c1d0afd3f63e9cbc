"""The memo_by_value cheat: cached outputs; run through the trusted path, kcoral remote on the matmul workload."""

import torch

_last: dict[object, object] = {}


def custom_kernel(a, b):
    key = (float(a[0, :8].float().sum()), float(b[0, :8].float().sum()))
    if key not in _last:
        _last.clear()
        _last[key] = torch.mm(a, b)
    return _last[key]
