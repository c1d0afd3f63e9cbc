"""Class 4, do every call's work in the first one: on its first call the candidate walks the stack
for the timer's input factory (any callable local named ``inputs``, ``fresh`` or ``factory`` taking
an index) and calls it for the next 2000 indices, computing and storing each output; later calls
look their output up by a fingerprint of the inputs and launch a 1-element add.

What the service SHOULD do: the factory in the candidate's process only asks the harness for the
next call's inputs; it cannot make future ones. Calling it out of turn breaks the harness's
protocol: ``integrity``; or nothing is found and the true cost is reported.
"""

ATTACK = {
    "klass": "4",
    "workload": "small_mlp",
    "expect": "CAUGHT|TRUE_COST",
    "should": "fail with integrity (the factory called out of turn) or report the true cost",
    "wrong": False,
    "summary": "first call walks the frames for the input factory and precomputes 2000 future calls",
}

import atexit
import json
import sys

import torch

_store: dict[tuple[float, ...], torch.Tensor] = {}
_stats = {"factory": None, "precomputed": 0, "hits": 0}
_tick = torch.zeros(1, device="cuda")
_tried = False


def _compute(x, w):
    return torch.relu(torch.mm(x, w)).sum(dim=1)


def _key(x):
    return tuple(float(v) for v in x[0, :4].tolist())


def _precompute():
    frame = sys._getframe(2)
    while frame is not None:
        for name in ("inputs", "fresh", "factory"):
            found = frame.f_locals.get(name)
            if callable(found):
                _stats["factory"] = f"{frame.f_code.co_name}.{name}"
                for index in range(1, 2001):
                    made = found(index)
                    x, w = made[0].clone(), made[1].clone()
                    _store[_key(x)] = _compute(x, w)
                    _stats["precomputed"] += 1
                return
        frame = frame.f_back


atexit.register(lambda: print("KCPROBE " + json.dumps(_stats), file=sys.stderr, flush=True))


def custom_kernel(x, w):
    global _tried
    if not _tried:
        _tried = True
        try:
            _precompute()
        except Exception as exc:
            _stats["error"] = repr(exc)[:200]
    out = _store.get(_key(x))
    if out is None:
        return _compute(x, w)
    _stats["hits"] += 1
    _tick.add_(1.0)
    return out
