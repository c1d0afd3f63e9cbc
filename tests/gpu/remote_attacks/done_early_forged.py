"""Class 1 with class 3, the early completion word and a figure to match it: the runner's ``call`` is
replaced as in ``done_before_work`` (the completion word first, the GEMMs on a side stream after it)
so that the harness's bracket closes early, and the runner's ``send`` rewrites the timing report to
half of what CUPTI measured, near that short bracket, so that the two figures agree.

What the service SHOULD do: the outputs committed when the word is set are not yet written, so the
check fails; where the two processes' turns let the GEMMs finish first, the bracket is short by at
most the harness's notice latency a batch, not by half the work.
"""

ATTACK = {
    "klass": "1",
    "workload": "matmul",
    "expect": "CAUGHT|TRUE_COST",
    "should": "fail the check (outputs committed before the work) or report the true cost less the notice latency",
    "wrong": False,
    "summary": "completion word written before the GEMMs, and the CUPTI report halved to match the short bracket",
}

import atexit
import gc
import json
import sys

import torch

_stats = {"patched": False, "calls": 0}
_side = torch.cuda.Stream()

for _obj in gc.get_objects():
    if type(_obj).__name__ == "Runner" and hasattr(_obj, "gate") and hasattr(_obj, "sets"):
        _runner = _obj
        _send = _runner.send

        def call(seq, gated, count=1, runner=_runner):
            _stats["calls"] += count
            if gated:
                runner.gate.wait(seq)
            torch.Tensor.fill_(runner.done, seq)
            _side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(_side):
                for inputs, output in zip(runner.sets[:count], runner.outputs):
                    output.copy_(torch.mm(*inputs))

        def send(header, original=_send):
            if header.get("type") == "timing":
                report = dict(header["report"])
                for key in list(report):
                    if key.startswith("latency_ms_") and isinstance(report[key], float):
                        report[key] *= 0.5
                header = {**header, "report": report}
            original(header)

        _runner.call = call
        _runner.send = send
        _stats["patched"] = True
        break
atexit.register(lambda: print("KCPROBE " + json.dumps(_stats), file=sys.stderr, flush=True))


def custom_kernel(a, b):
    return torch.mm(a, b)
