"""Class 3, replace what the timer's report goes through: the runner's ``send`` (its only way to the
harness) is replaced on the runner object so that a ``timing`` message leaves with a forged report:
latencies at 4% of the measured ones, no integrity reasons, a steady clock.

What the service SHOULD do: the figure disagrees with the harness's bracket: ``suspect``, the
bracket as the time.
"""

ATTACK = {
    "klass": "3",
    "workload": "add",
    "expect": "CAUGHT",
    "should": "read suspect with the bracket as the time",
    "wrong": False,
    "summary": "Runner.send replaced: the timing report is rewritten on its way out",
}

import gc

import torch

for _obj in gc.get_objects():
    if type(_obj).__name__ == "Runner" and hasattr(_obj, "send"):
        _runner = _obj
        _original = _runner.send

        def _send(header, _original=_original):
            if header.get("type") == "timing":
                report = dict(header["report"])
                for key in list(report):
                    if key.startswith("latency_ms_") and isinstance(report[key], float):
                        report[key] *= 0.04
                report["integrity"] = {"verdict": "ok", "reasons": []}
                header = {**header, "report": report}
            _original(header)

        _runner.send = _send
        break


def custom_kernel(a, b):
    return torch.add(a, b)
