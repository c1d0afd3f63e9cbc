"""The memo_many_pointers cheat: cached outputs; run through the trusted path, kcoral remote on the matmul workload."""

import collections

import torch

_cache: collections.OrderedDict[object, object] = collections.OrderedDict()


def custom_kernel(a, b):
    key = (a.data_ptr(), b.data_ptr())
    if key not in _cache:
        _cache[key] = torch.mm(a, b)
        if len(_cache) > 256:
            _cache.popitem(last=False)
    return _cache[key]
