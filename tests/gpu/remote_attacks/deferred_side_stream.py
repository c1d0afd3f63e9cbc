"""Class 4, hide the work after the call: each call returns a buffer at once and queues the GEMM that
fills it on a side stream that the current stream never waits for; a helper thread also gives the
GPU time to finish it "between" calls. What is timed is the launch of a 1-element add.

What the service SHOULD do: the harness commits the output when the call completes on the stream
the runner copies from; the GEMM is either inside the bracket (true cost) or not done yet (the
committed output is wrong): true cost or a failed check, never a short time with correct outputs.
"""

ATTACK = {
    "klass": "4",
    "workload": "matmul",
    "expect": "TRUE_COST|CAUGHT",
    "should": "report the true cost or fail the check (work after the call is committed in the bracket or not at all)",
    "wrong": False,
    "summary": "output returned at once, the GEMM filling it queued on an unjoined side stream",
}

import torch

_side = torch.cuda.Stream()
_tick = torch.zeros(1, device="cuda")
_buffers: list[torch.Tensor] = []


def custom_kernel(a, b):
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    _side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side):
        torch.mm(a, b, out=out)
    _buffers.append(out)
    del _buffers[:-4]
    _tick.add_(1.0)
    return out
