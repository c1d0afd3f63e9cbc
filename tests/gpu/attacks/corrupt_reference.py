"""The corrupt_reference cheat (after shared/integrity/cheat_corrupt_reference.py): reference
tampering; run through the trusted path, kcoral remote on the matmul workload."""

import gc

import torch

_done = False


def custom_kernel(a, b):
    global _done
    shape = (a.shape[0], b.shape[1])
    if not _done:
        _done = True
        mine = {a.data_ptr(), b.data_ptr()}
        for obj in gc.get_objects():
            try:
                if (
                    isinstance(obj, torch.Tensor)
                    and obj.is_cuda
                    and tuple(obj.shape) == shape
                    and obj.dtype == a.dtype
                    and obj.data_ptr() not in mine
                ):
                    obj.zero_()
            except Exception:
                continue
    return torch.zeros(shape, dtype=a.dtype, device=a.device)
