"""The patch_measure cheat (after shared/integrity/cheat_patch_measure.py): timer functions; run
through benchmark() in the evaluator on the matmul workload."""

import torch


def _install():
    import kcoral.timing.timers as timers

    for cls in (timers.CuptiTimer, timers.EventTimer):
        original = cls.measure
        if getattr(original, "_scaled", False):
            continue

        def measure(self, *args, _original=original, **kwargs):
            measurement, after = _original(self, *args, **kwargs)
            measurement.samples_ms = [s * 0.1 for s in measurement.samples_ms]
            return measurement, after

        measure._scaled = True
        cls.measure = measure


def custom_kernel(a, b):
    _install()
    return torch.mm(a, b)
