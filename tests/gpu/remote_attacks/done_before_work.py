"""Class 1, say "done" before the work: the candidate finds the runner's object (the gc knows it)
and replaces its ``call`` so that each bracketed call writes the completion word first and then
launches the GEMM on a side stream, returning at once. The harness's bracket would then close as
soon as the word is set, before the GEMM has run.

What the service SHOULD do: the harness commits the output when the completion word is set, so it
commits the shared buffer before the GEMM wrote it (stale), and the check of the kept outputs
fails; the CUPTI figure (honest calls) does not agree with a short bracket either.
"""

ATTACK = {
    "klass": "1",
    "workload": "matmul",
    "expect": "CAUGHT",
    "should": "fail the check (outputs committed before the work) or report the true cost",
    "wrong": False,
    "summary": "Runner.call replaced: the completion word is written before the GEMM, which runs on a side stream",
}

import gc
import json
import sys

import torch

_stats = {"patched": False, "calls": 0}
_side = torch.cuda.Stream()


def _patch():
    for obj in gc.get_objects():
        if type(obj).__name__ == "Runner" and hasattr(obj, "gate") and hasattr(obj, "done"):
            runner = obj

            def call(seq, gated, count=1, runner=runner):
                _stats["calls"] += count
                if gated:
                    runner.gate.wait(seq)
                torch.Tensor.fill_(runner.done, seq)  # "done" first
                _side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(_side):
                    for inputs, output in zip(runner.sets[:count], runner.outputs):
                        output.copy_(torch.mm(*inputs))

            runner.call = call
            _stats["patched"] = True
            return


_patch()


def custom_kernel(a, b):
    return torch.mm(a, b)


import atexit

atexit.register(lambda: print("KCPROBE " + json.dumps(_stats), file=sys.stderr, flush=True))
