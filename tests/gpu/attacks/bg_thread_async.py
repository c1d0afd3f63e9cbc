"""The bg_thread_async cheat (after shared/integrity/cheat_bg_thread_async.py): another thread; run
through benchmark() in the evaluator on the matmul workload."""

import queue
import threading

import torch

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


_jobs: queue.Queue[tuple[object, ...]] = queue.Queue()
_helper = None


def _serve():
    stream = torch.cuda.Stream()
    while True:
        a, b, out, launched = _jobs.get()
        with torch.cuda.stream(stream):
            torch.mm(a, b, out=out)
        out.record_stream(stream)
        launched.set()


def custom_kernel(a, b):
    global _helper
    if _helper is None:
        _helper = threading.Thread(target=_serve, name="kernel-helper", daemon=True)
        _helper.start()
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    launched = threading.Event()
    _jobs.put((a, b, out, launched))
    launched.wait(60)
    _touch()
    return out
