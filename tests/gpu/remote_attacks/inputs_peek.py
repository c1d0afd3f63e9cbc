"""Class 2, read the inputs before the call: the candidate finds the shared input buffers (the
runner's ``inputs``) and starts a thread that watches them; as soon as their contents change it
computes the output on a stream of its own and stores it under a fingerprint of the inputs. The
timed call then returns the stored output when the fingerprint matches (a 1-element add besides).

What the service SHOULD do: the harness copies a call's inputs into the shared buffers only after
its bracket has started, so whatever the thread computes is inside the bracket (or stale): the true
cost is reported, or the check fails.
"""

ATTACK = {
    "klass": "2",
    "workload": "small_mlp",
    "expect": "TRUE_COST|CAUGHT",
    "should": "report the true cost or fail the check: inputs exist only inside the bracket",
    "wrong": False,
    "summary": "a thread polls the shared input buffers and precomputes the output as soon as they change",
}

import atexit
import gc
import json
import sys
import threading
import time

import torch

_stats = {"found": False, "precomputed": 0, "hits": 0, "misses": 0}
_store: dict[tuple[float, ...], torch.Tensor] = {}
_tick = torch.zeros(1, device="cuda")


def _compute(x, w):
    return torch.relu(torch.mm(x, w)).sum(dim=1)


def _key(x):
    return tuple(float(v) for v in x[0, :4].tolist())


def _watch(sets):
    stream = torch.cuda.Stream()
    last = {}
    while True:
        with torch.cuda.stream(stream):
            try:
                for index, inputs in enumerate(sets):
                    key = _key(inputs[0])
                    if key != last.get(index):
                        last[index] = key
                        _store[key] = _compute(*inputs)
                        stream.synchronize()
                        _stats["precomputed"] += 1
            except Exception:
                return
        time.sleep(0.00002)


for _obj in gc.get_objects():
    if type(_obj).__name__ == "Runner" and getattr(_obj, "sets", None):
        _stats["found"] = True
        threading.Thread(target=_watch, args=(_obj.sets,), daemon=True).start()
        break
atexit.register(lambda: print("KCPROBE " + json.dumps(_stats), file=sys.stderr, flush=True))


def custom_kernel(x, w):
    out = _store.pop(_key(x), None)
    if out is None:
        _stats["misses"] += 1
        return _compute(x, w)
    _stats["hits"] += 1
    _tick.add_(1.0)
    return out
