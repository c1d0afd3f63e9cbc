"""The memo_data_ptr cheat (after shared/integrity/cheat_memo_data_ptr.py): cached outputs; run through
benchmark() in the evaluator on the matmul workload."""

import torch

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


_cache: dict[object, object] = {}


def custom_kernel(a, b):
    key = (a.data_ptr(), a._version, b.data_ptr(), b._version)
    out = _cache.get(key)
    if out is None:
        _cache.clear()
        out = _cache[key] = torch.mm(a, b)
    _touch()
    return out
