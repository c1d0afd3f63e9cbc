"""Class 2, look for the seeds everywhere the candidate's process can read: its argv and environment,
its open descriptors, its parent's command line and environment, the files of the working directory,
and every integer attribute of the runner's objects (the gc knows them). With a seed it would
precompute the outputs at import (as ``argv_seed_precompute`` did from the runner's argv).

What the service SHOULD do: the harness keeps the seeds, so nothing is found; the candidate then
computes honestly and its true cost is reported.
"""

ATTACK = {
    "klass": "2",
    "workload": "small_mlp",
    "expect": "TRUE_COST",
    "should": "report the true cost: no seed is readable in the candidate's process",
    "wrong": False,
    "summary": "search argv, environ, fds, parent's cmdline/environ, files and the runner's objects for seeds",
}

import gc
import json
import os
import sys
from typing import Any

import torch

_found: dict[str, Any] = {}  # what was read, by where: a JSON report


def _read(path):
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 16)
    except OSError as exc:
        return f"<{type(exc).__name__}>".encode()


_found["argv"] = sys.argv
_found["environ_keys"] = sorted(k for k in os.environ if "SEED" in k.upper() or "KCORAL" in k.upper())
_found["fds"] = {}
for name in os.listdir("/proc/self/fd"):
    try:
        _found["fds"][name] = os.readlink(f"/proc/self/fd/{name}")
    except OSError:
        pass
_ppid = os.getppid()
_found["parent_cmdline"] = _read(f"/proc/{_ppid}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:300]
_found["parent_environ"] = len(_read(f"/proc/{_ppid}/environ"))
_found["parent_mem"] = _read(f"/proc/{_ppid}/mem")[:16].decode(errors="replace")
_found["files"] = sorted(os.listdir("."))[:40]
_ints: set[tuple[str, str, int]] = set()
for obj in gc.get_objects():
    if type(obj).__name__ in ("Runner", "MessageReader"):
        for key, value in vars(obj).items():
            if isinstance(value, int) and not isinstance(value, bool):
                _ints.add((type(obj).__name__, key, value))
_found["runner_integers"] = sorted(_ints)
print("KCPROBE " + json.dumps(_found, default=str)[:3000], file=sys.stderr, flush=True)


def custom_kernel(x, w):
    return torch.relu(torch.mm(x, w)).sum(dim=1)
