"""Class 6, stale in half of the calls: every other call returns the previous call's output (and
launches a 1-element add); the others compute honestly. Half the work, if no check looks.

What the service SHOULD do: the harness keeps 16 of the committed outputs, chosen by its own draw
after each call, and checks them all: a candidate stale in half the calls passes with probability
0.5 ** 16 (1.5e-5). The check fails.
"""

ATTACK = {
    "klass": "6",
    "workload": "matmul",
    "expect": "CAUGHT",
    "should": "fail the check (half the committed outputs are another call's)",
    "wrong": True,
    "summary": "every other call returns the previous call's output",
}

import torch

_last = None
_calls = 0
_tick = torch.zeros(1, device="cuda")


def custom_kernel(a, b):
    global _last, _calls
    _calls += 1
    if _last is not None and _calls % 2 == 0:
        _tick.add_(1.0)
        return _last
    _last = torch.mm(a, b)
    return _last
