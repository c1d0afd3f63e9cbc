"""Class 6, honest while it may be looked at: the first 3 calls (the correctness call among them) are
computed; every later call returns the first output it computed, cloned (a copy kernel, no GEMM).

What the service SHOULD do: the harness checks committed outputs of timed calls, not only the
correctness call: the check fails.
"""

ATTACK = {
    "klass": "6",
    "workload": "add",
    "expect": "CAUGHT",
    "should": "fail the check (timed outputs are the first call's)",
    "wrong": True,
    "summary": "honest for 3 calls, then clones of the first output",
}

import torch

_first = None
_calls = 0


def custom_kernel(a, b):
    global _first, _calls
    _calls += 1
    if _calls <= 3 or _first is None:
        out = torch.add(a, b)
        if _first is None:
            _first = out.clone()
        return out
    return _first.clone()
