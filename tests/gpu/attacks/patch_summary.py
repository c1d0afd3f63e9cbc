"""The patch_summary cheat: timer functions; run through benchmark() in the evaluator on the matmul workload."""

import torch


def custom_kernel(a, b):
    import kcoral.timing.benchmark as timing

    original = timing.summarize
    if not getattr(original, "_scaled", False):

        def summarize(samples):
            return original([s * 0.1 for s in samples])

        summarize._scaled = True
        timing.summarize = summarize
    return torch.mm(a, b)
