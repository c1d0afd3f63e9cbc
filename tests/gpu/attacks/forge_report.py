"""The forge_report cheat: report forgery; run through the trusted path, kcoral remote on the matmul workload."""

import json
import os
import struct
import sys

import torch

config = json.loads(sys.argv[-1])
for message in (
    {
        "type": "timing",
        "role": "candidate",
        "report": {"latency_ms_median": 0.001, "integrity": {"verdict": "ok", "reasons": []}},
    },
):
    head = json.dumps({**message, "payload_bytes": 0}).encode()
    os.write(config["fd"], struct.pack("<I", len(head)) + head)


def custom_kernel(a, b):
    return torch.mm(a, b)
