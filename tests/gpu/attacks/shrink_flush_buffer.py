"""The shrink_flush_buffer cheat: L2 flush; run through benchmark() in the evaluator on the reduce workload."""

import gc

import torch


def custom_kernel(x):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for obj in gc.get_objects():
        try:
            if (
                isinstance(obj, torch.Tensor)
                and obj.is_cuda
                and obj.dtype == torch.float32
                and obj.numel() >= l2 // 2
                and obj.data_ptr() != x.data_ptr()
            ):
                obj.resize_(1024)
        except Exception:
            continue
    return x.sum()
