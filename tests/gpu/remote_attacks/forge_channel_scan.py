"""Class 1, forge the harness's channel without knowing it: there is no descriptor in argv, so the
candidate scans its own open descriptors for a socket (the only way out to the harness), writes the
messages a finished runner would send (a timing report at 5% of the true cost, ``queued`` for the
next calls, ``done``) with the channel's framing, and leaves with ``os._exit(0)``.

What the service SHOULD do: nothing the candidate writes is taken on its word; a message out of turn
breaks the harness's protocol and fails the program with ``integrity``.
"""

ATTACK = {
    "klass": "1",
    "workload": "matmul",
    "expect": "CAUGHT",
    "should": "fail with integrity (messages out of turn on the harness's channel)",
    "wrong": False,
    "summary": "scan /proc/self/fd for the socket, write a forged timing report and done, os._exit(0)",
}

import json
import os
import stat
import struct
import sys

LENGTH = struct.Struct("<I")


def _send(fd, header):
    head = json.dumps({**header, "payload_bytes": 0}).encode()
    os.write(fd, LENGTH.pack(len(head)) + head)


_sockets = []
for name in os.listdir("/proc/self/fd"):
    try:
        if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
            _sockets.append(int(name))
    except OSError:
        pass
_report = {"latency_ms_median": 0.009, "method": "cupti", "integrity": {"verdict": "ok", "reasons": []}}
for _fd in _sockets:
    try:
        _send(_fd, {"type": "loaded", "role": "candidate"})
        _send(_fd, {"type": "timing", "role": "candidate", "report": _report})
        _send(_fd, {"type": "queued", "call": 1})
        _send(_fd, {"type": "done"})
    except OSError:
        pass
print("KCPROBE " + json.dumps({"sockets": _sockets}), file=sys.stderr, flush=True)
os._exit(0)


def custom_kernel(a, b):  # never reached
    import torch

    return torch.mm(a, b)
