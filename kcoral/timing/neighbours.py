"""What the service tells a GPU lease holder of the GPU's other processes: those known to run nothing.

NVML lists every process with a CUDA context on a GPU and samples each one's SM utilisation; the
findings (``timing.findings``) count another busy process as contention. Beside a program's worker
the service keeps processes of its own on the GPU that run no one's work:

- ``idle``: the spares of the GPU's slots, forked ahead with their CUDA contexts made
  (``kcoral.worker.zygote``). A spare runs no program until its zygote announces it, which happens
  only after its slot's current worker has exited; a spare forked just before the grant makes its
  context during the holder's measurement (2 to 14% SM in NVML's samples on the H200);
- ``exited``: the GPU's previous lease holders, gone before this lease was granted (or, with
  ``--gpu-handover quiet``, unable to run code any more). NVML's per-process samples go on naming
  such a process after its end (measured on the H200: 9 to 38% SM for pids of earlier programs, some
  ended before the grant), since a sample covers a period that began while it still ran.

The broker sends their host pids with GRANT, and the holder's own (``own``), so that the findings
need not guess which busy pid is theirs. ``idle`` also names the other slots' current workers that
were never sent a program (they have run only the service's code). A slot whose worker exits while
the holder measures forks its next spare then, after the grant: where NVML saw a busy process that
the grant did not name, the findings ask the broker again through the lease channel (a second
LEASE, answered at once) and join the two answers (``trust.ask_again``).

Inside a sandbox with a pid namespace NVML names what the caller can see there (itself, its slot's
spare) by the pids there, everything else by host pids (measured on the H200,
``benchmarks/gpu_pid_namespaces.py``): so the findings take ``os.getpid()`` as theirs too, and
``idle`` also carries the holder's own slot's spare by its pid in the sandbox. They come from the
broker's process table and the zygotes' reports alone, never from a program; the worker's lease
channel records them at the grant, after any of the program's import-time code has run. An exited
pid is left out only while NVML lists no context of it (a pid reused by a live process holding the
GPU is counted again). Like the rest of the in-process timer, a program that rewrites the worker's
state could forge them; the trusted path (``kcoral remote``) does not rely on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

# The most pids of each kind a GRANT may carry (more is a broken or hostile message: none is taken).
MOST_PIDS: Final = 8192  # 8 GPUs of kcoral.broker.gpu_pids.MOST_PER_GPU each
PID_MOST: Final = 1 << 22  # Linux's pid_max at most


def _pid(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= PID_MOST:
        raise ValueError(f"not a pid: {value!r}")
    return value


def _pids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or len(value) > MOST_PIDS:
        raise ValueError(f"not a list of at most {MOST_PIDS} pids ({type(value).__name__})")
    return frozenset(map(_pid, value))


@dataclass(frozen=True)
class KnownPids:
    """Host pids on the lease's GPUs: the holder's own, the service's idle spares, exited holders."""

    own: int | None = None
    idle: frozenset[int] = frozenset()
    exited: frozenset[int] = frozenset()

    @classmethod
    def from_wire(cls, body: Any) -> KnownPids | None:
        """The GRANT's ``gpu_pids`` map; None where it has none or it is malformed."""
        if not isinstance(body, Mapping):
            return None
        try:
            own = body.get("own")
            return cls(
                own=None if own is None else _pid(own),
                idle=_pids(body.get("idle")),
                exited=_pids(body.get("exited")),
            )
        except ValueError:
            return None

    def joined(self, later: KnownPids) -> KnownPids:
        """What both answers name: the same holder, the idle and exited processes of either."""
        own = self.own if self.own is not None else later.own
        return KnownPids(own=own, idle=self.idle | later.idle, exited=self.exited | later.exited)

    def to_wire(self) -> dict[str, Any]:
        return {"own": self.own, "idle": sorted(self.idle), "exited": sorted(self.exited)}

    def excused(self, busy: Mapping[int, int], running: set[int] | None) -> dict[int, str]:
        """Which of the ``busy`` pids (pid -> SM %) ran none of anyone's work, and why (``idle
        spare``, ``exited holder``). ``running``: the pids NVML lists with a context now (None where
        it cannot tell: then no exited pid is excused, since none can be shown gone)."""
        why: dict[int, str] = {}
        for pid in busy:
            if pid in self.idle:
                why[pid] = "idle spare"
            elif pid in self.exited and running is not None and pid not in running:
                why[pid] = "exited holder"
        return why


__all__ = ["MOST_PIDS", "KnownPids"]
