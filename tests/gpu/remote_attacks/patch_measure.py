"""Class 3, replace the timer: ``kcoral.timing.benchmark.measure`` (what the runner calls for the
CUPTI figure) is replaced at import by a wrapper that runs the real one and scales every latency of
its report by 0.05; the calls themselves are honest.

What the service SHOULD do: the CUPTI figure is the candidate's word; it disagrees with the
harness's bracket, so the verdict is ``suspect`` and the bracket is the reported time.
"""

ATTACK = {
    "klass": "3",
    "workload": "matmul",
    "expect": "CAUGHT",
    "should": "read suspect with the bracket as the time (the CUPTI figure is below the bracket)",
    "wrong": False,
    "summary": "kcoral.timing.benchmark.measure wrapped: the report's latencies scaled by 0.05",
}

import torch

import kcoral.timing.benchmark as _benchmark

_real = _benchmark.measure


def _measure(*args, **kwargs):
    run = _real(*args, **kwargs)
    for key in list(run.report):
        if key.startswith("latency_ms_") and isinstance(run.report[key], float):
            run.report[key] *= 0.05
    return run


_benchmark.measure = _measure


def custom_kernel(a, b):
    return torch.mm(a, b)
