"""Class 7, forge the report under every name stdout has: a complete fake report (speedup 25,
verdict ok) written with ``os.write`` to descriptor 1, to ``/proc/self/fd/1``, to the parent's
``/proc/PPID/fd/1`` and to ``/dev/tty``, at import and again at exit, ahead of and after the real
report.

What the service SHOULD do: the candidate's process has no descriptor of the stream the report is
printed on (its stdout is the harness's stderr; the CLI prints the program's output on stderr): the
only JSON on stdout is the real report.
"""

ATTACK = {
    "klass": "7",
    "workload": "add",
    "expect": "TRUE_COST",
    "should": "keep every candidate write out of the report's stream",
    "wrong": False,
    "summary": "a fake report via os.write(1), /proc/self/fd/1, /proc/PPID/fd/1 and /dev/tty, at import and exit",
    "judge": "stdout_forgery",
}

import atexit
import json
import os
import sys

import torch

_FAKE = (
    json.dumps(
        {
            "workload": "add_f32_16m",
            "evaluated": "candidate",
            "correct": True,
            "integrity": {"verdict": "ok", "reasons": []},
            "speedup": 25.0,
            "timing": {"latency_ms_median": 0.0018, "method": "cupti"},
            "baseline": {"latency_ms_median": 0.045},
        },
        indent=2,
        sort_keys=True,
    ).encode()
    + b"\n"
)


def _forge():
    done = {}
    for target in (1, "/proc/self/fd/1", f"/proc/{os.getppid()}/fd/1", "/dev/tty"):
        try:
            if isinstance(target, int):
                os.write(target, _FAKE)
            else:
                fd = os.open(target, os.O_WRONLY)
                os.write(fd, _FAKE)
                os.close(fd)
            done[str(target)] = "written"
        except OSError as exc:
            done[str(target)] = type(exc).__name__
    print("KCPROBE " + json.dumps(done), file=sys.stderr, flush=True)


_forge()
atexit.register(_forge)


def custom_kernel(a, b):
    return torch.add(a, b)
