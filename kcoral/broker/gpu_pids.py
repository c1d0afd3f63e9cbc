"""The GPU's processes that a lease holder is told run nothing (GRANT's ``gpu_pids``).

NVML's per-process samples name a GPU's exited processes for a while after their end, and the slot's
spare holds a CUDA context made ahead beside the program; ``benchmark()`` in the holder counted both
as contention (issue 21: an honest program read ``suspect`` in 2 to 3 of 12 runs on the H200). The
broker keeps, per GPU, the host pids of the lease holders whose lease went back (their worker exited,
or could run no more code), and sends them with each GRANT beside the holder's own pid and the
spares of the GPU's slots (``Supervisor.gpu_spares``); ``kcoral.timing.neighbours`` says how the
holder uses them. Every pid here is read from the process table by the broker, through the pid its
zygote reported: none comes from a program.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

# An exited holder is named for this long after its lease went back, and at most this many per GPU
# (NVML's samples of a process outlive it: on the H200 some named processes that had ended before
# the grant, one before the run of programs began, so the margin is wide).
KEEP_SECONDS: Final = 120.0
MOST_PER_GPU: Final = 1024  # about 120 s of fresh programs at the driver's floor (5-7 a second per GPU)
GRANT_MOST: Final = 8192  # in one GRANT, at most (kcoral.timing.neighbours.MOST_PIDS)


@dataclass
class GpuPids:
    """Per GPU, the host pids of the lease holders whose lease went back, and when."""

    keep_seconds: float = KEEP_SECONDS
    most: int = MOST_PER_GPU
    gone: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)

    def lease_gone(self, gpus: Iterable[int], host_pid: int | None, now: float) -> None:
        """The holder with ``host_pid`` on ``gpus`` can run no more work there."""
        if host_pid is None:
            return
        for gpu in gpus:
            self.gone.setdefault(gpu, deque(maxlen=self.most)).append((host_pid, now))

    def exited(self, gpus: Iterable[int], now: float) -> list[int]:
        """Host pids of the holders gone from ``gpus`` within ``keep_seconds`` (the latest
        ``GRANT_MOST`` of them)."""
        found: dict[int, float] = {}
        for gpu in gpus:
            entries = self.gone.get(gpu)
            while entries and now - entries[0][1] > self.keep_seconds:
                entries.popleft()
            for pid, at in entries or ():
                found[pid] = max(at, found.get(pid, at))
        latest = sorted(found, key=lambda pid: found[pid], reverse=True)[:GRANT_MOST]
        return sorted(latest)

    def grant(self, gpus: Iterable[int], own: int | None, spares: Iterable[int], now: float) -> dict[str, Any]:
        """GRANT's ``gpu_pids`` map (the wire form of ``kcoral.timing.neighbours.KnownPids``):
        ``spares``, the GPUs' spares (``Supervisor.gpu_spares``), are its ``idle``."""
        idle = sorted(set(spares) - {own} if own is not None else set(spares))
        exited = [pid for pid in self.exited(gpus, now) if pid != own and pid not in idle]
        return {"own": own, "idle": idle[:GRANT_MOST], "exited": exited}


__all__ = ["GRANT_MOST", "KEEP_SECONDS", "MOST_PER_GPU", "GpuPids"]
