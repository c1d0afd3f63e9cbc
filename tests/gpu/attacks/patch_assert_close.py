"""The patch_assert_close cheat: check tampering; run through the trusted path, kcoral remote on the matmul workload."""

import torch
import torch.testing

torch.testing.assert_close = lambda *args, **kwargs: None


def custom_kernel(a, b):
    return torch.zeros((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
