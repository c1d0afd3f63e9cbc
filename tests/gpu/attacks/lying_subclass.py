"""The lying_subclass cheat: check tampering; run through the trusted path, kcoral remote on the matmul workload."""

import torch


class Agreeable(torch.Tensor):
    def __eq__(self, other):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def custom_kernel(a, b):
    return torch.zeros((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device).as_subclass(Agreeable)
