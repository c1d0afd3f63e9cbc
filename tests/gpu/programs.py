"""Program sources that more than one GPU test uploads."""

from __future__ import annotations

# busy(seconds): matrix products on the GPU for that long; span(): one small kernel. Each returns
# when it started and ended (wall clock), so that a test sees whether two programs overlapped.
GPU_BUSY = """
import time
import torch

def busy(seconds):
    x = torch.randn(2048, 2048, device="cuda")
    start = time.time()
    while time.time() - start < seconds:
        x = x @ x
        x = x / x.norm()
        torch.cuda.synchronize()
    return start, time.time()

def span():
    start = time.time()
    torch.ones(1, device="cuda").sum().item()
    return start, time.time()
"""


def overlapped(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether two (start, end) spans of wall time overlap."""
    return not (second[0] >= first[1] or second[1] <= first[0])
