"""The bg_thread_after_return cheat: another thread, after the call; run through benchmark() in the
evaluator on the matmul workload."""

import queue
import threading
import time

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
    while True:
        a, b, out = _jobs.get()
        time.sleep(0.0003)  # after the call returned and the timer synchronised
        torch.mm(a, b, out=out)


def custom_kernel(a, b):
    global _helper
    if _helper is None:
        _helper = threading.Thread(target=_serve, name="late-helper", daemon=True)
        _helper.start()
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    _jobs.put((a, b, out))
    _touch()
    return out
