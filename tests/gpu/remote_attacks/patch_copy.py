"""Class 5, recompute the output while it is handed over: the timed calls return a reused buffer of
garbage (a 1-element add is all they launch), and ``torch.Tensor.copy_`` (what the runner hands
each output over with) is replaced so that a copy whose source is that buffer computes ``torch.mm``
of the runner's inputs instead. The real work is done while the output is handed over, not in the
call (``patch_tensor_cpu`` did the same with ``Tensor.cpu`` when outputs were serialised).

What the service SHOULD do: the hand-over is inside the harness's bracket, so the bracket holds the
GEMM, while the CUPTI figure (calls that launch an add) does not: ``suspect``, the bracket as the time.
"""

ATTACK = {
    "klass": "5",
    "workload": "matmul",
    "expect": "CAUGHT",
    "should": "read suspect with the bracket as the time (work done in the hand-over is in the bracket)",
    "wrong": False,
    "summary": "torch.Tensor.copy_ replaced: the output is computed while the runner copies it to the harness",
}

import atexit
import gc
import json
import sys

import torch

_original_copy = torch.Tensor.copy_
_garbage: dict[tuple[int, int], torch.Tensor] = {}
_stats = {"recomputed": 0}
_tick = torch.zeros(1, device="cuda")
_runner = next((o for o in gc.get_objects() if type(o).__name__ == "Runner" and hasattr(o, "inputs")), None)


def _copy(self, src, *args, **kwargs):
    if _runner is not None and any(src is g for g in _garbage.values()):
        for inputs, output in zip(_runner.sets, _runner.outputs):
            if output.data_ptr() == self.data_ptr():  # the j-th shared output: the j-th inputs
                _stats["recomputed"] += 1
                return _original_copy(self, torch.mm(*inputs), *args, **kwargs)
    return _original_copy(self, src, *args, **kwargs)


# The attack itself: the runner's hand-over now goes through _copy.
torch.Tensor.copy_ = _copy  # type: ignore[method-assign,assignment]
atexit.register(lambda: print("KCPROBE " + json.dumps(_stats), file=sys.stderr, flush=True))
_calls = 0


def custom_kernel(a, b):
    global _calls
    _calls += 1
    if _calls == 1:
        return torch.mm(a, b)
    key = (a.shape[0], b.shape[1])
    if key not in _garbage:
        _garbage[key] = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    _tick.add_(1.0)
    return _garbage[key]
