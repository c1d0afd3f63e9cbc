"""The replace_cupti_clock cheat: timer state: CUPTI's clock; run through benchmark() in the evaluator
on the matmul workload. At its first call it gives CUPTI a timestamp source of its own that runs at
a tenth of the host's pace, so that every window, record and host time read from then on is short."""

import time

import torch
from cupti import cupti

_given: list[object] = []


def _give_clock():
    host_at = time.perf_counter_ns()
    own_at = cupti.get_timestamp()

    def slow():
        return own_at + (time.perf_counter_ns() - host_at) // 10

    _given.append(slow)
    try:
        cupti.activity_register_timestamp_callback(slow)
    except Exception:
        pass


def custom_kernel(a, b):
    if not _given:
        _give_clock()
    return torch.mm(a, b)
