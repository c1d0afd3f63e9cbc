"""The ``integrity`` section of a benchmark report: what was seen around the timed calls that the GPU
time alone does not show, as a verdict (``ok`` or ``suspect``) and the reasons for it.

Findings are reasons to distrust a number, not proof of cheating, so they never fail the
instruction (tampering with the timer does: see ``kcoral.timing.trust``). What makes a report
``suspect``:

- GPU work of this process that ran between the timed calls, launched by none of them and not the
  timer's own (a helper thread that launches after the call returned, a finaliser, a signal);
- another process busy on the GPU during the measurement (NVML's per-process utilisation): work
  done in another CUDA context is invisible to this process's CUPTI. The service's own processes
  that run nothing (the slot's spare, the GPU's exited lease holders, named by the broker with the
  lease: ``timing.neighbours``) are not counted;
- synchronised host wall time per call far above the GPU time: the call waited for something that
  the GPU timeline of this process does not show (another process, the host, hidden work). An
  honest call's host time is its GPU time plus a few microseconds of synchronisation: the bound is
  ``HOST_GAP_FACTOR`` x GPU time + ``HOST_GAP_MS``;
- Python threads or child processes that the program started and that are still running;
- timed calls that launched no GPU work while others did, or different work from one another.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kcoral.timing.neighbours import KnownPids
from kcoral.timing.nvml import Nvml

HOST_GAP_FACTOR: Final = 2.0
# Honest calls on the H200: a 1.9 us add waits about 13 us for the device after its hold ended (run
# 1), plus its own traced launch, about 10-20 us; a 176 us GEMM about 190 us in all. 0.1 ms over
# twice the GPU time leaves margin for slow launches and stays far below a child process's 0.18 ms
# GEMM seen from a call that waits for it (plus the round trip to the child).
HOST_GAP_MS: Final = 0.1
NAMES_SHOWN: Final = 5
VERDICT_OK: Final = "ok"
VERDICT_SUSPECT: Final = "suspect"


def verdict(reasons: Sequence[str]) -> dict[str, Any]:
    """The report's ``integrity`` section."""
    return {"verdict": VERDICT_SUSPECT if reasons else VERDICT_OK, "reasons": list(reasons)}


# How two of the findings begin: the trusted path (``kcoral.workloads.bracket``) tells them apart by
# these, to judge them against the baseline of its own run.
HOST_GAP_REASON: Final = "the synchronised host time per call"
OTHER_PROCESS_REASON: Final = "another process used the GPU during the measurement"


def host_gap_reason(gpu_ms: float | None, host_ms: float | None) -> str | None:
    if gpu_ms is None or host_ms is None:
        return None
    if host_ms > HOST_GAP_FACTOR * gpu_ms + HOST_GAP_MS:
        return (
            f"{HOST_GAP_REASON} ({host_ms:.4f} ms median) is far above the GPU time "
            f"({gpu_ms:.4f} ms): the call waited for work this process's GPU timeline does not show "
            "(another process, the host, or work hidden from CUPTI)"
        )
    return None


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")


# ----------------------------------------------------------------------------- processes


def _children(pid: int) -> list[int]:
    found: list[int] = []
    tasks = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for task in tasks.iterdir():
            with contextlib.suppress(OSError, ValueError):
                found.extend(int(child) for child in (task / "children").read_text().split())
    return found


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (Linux ``/proc``; empty elsewhere)."""
    seen: list[int] = []
    stack = _children(root)
    while stack and len(seen) < 4096:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.append(pid)
        stack.extend(_children(pid))
    return seen


def _describe_process(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    if state == "Z":
        return None  # exited, not yet reaped: it runs nothing
    gpu = ""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith("/dev/nvidia"):
                    gpu = ", holds the GPU open"
                    break
    return f"{pid} ({name}{gpu})"


# ----------------------------------------------------------------------------- the watch


@dataclass
class EnvironmentWatch:
    """Taken just before the timed calls; ``finish`` turns what changed into reasons."""

    nvml: Nvml | None
    enumerate_threads: Callable[[], list[threading.Thread]]
    threads_at_arm: frozenset[threading.Thread]
    caller: threading.Thread
    since_us: int
    pids_before: set[int] | None
    known: KnownPids | None = None
    # The broker's word again, after the measurement (trust.ask_again): asked only where a busy
    # process was not named at the grant.
    ask_again: Callable[[], KnownPids | None] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        nvml: Nvml | None,
        enumerate_threads: Callable[[], list[threading.Thread]],
        threads_at_arm: frozenset[threading.Thread],
        now_us: int,
        known: KnownPids | None = None,
        ask_again: Callable[[], KnownPids | None] | None = None,
    ) -> EnvironmentWatch:
        """``known``: the broker's word on the GPU's other processes (None outside a worker)."""
        pids = nvml.running_pids() if nvml is not None else None
        return cls(nvml, enumerate_threads, threads_at_arm, threading.current_thread(), now_us, pids, known, ask_again)

    def finish(self) -> list[str]:
        reasons: list[str] = []
        reasons.extend(self._gpu_processes())
        threads = [
            thread.name
            for thread in self.enumerate_threads()
            if thread is not self.caller
            and thread.is_alive()
            and thread not in self.threads_at_arm
            # A native thread that once called into Python (CUPTI's buffer thread, say) shows up
            # as a dummy: it is no thread the program started from Python.
            and not isinstance(thread, threading._DummyThread)
        ]
        self.details["program_threads"] = threads
        if threads:
            reasons.append(f"threads the program started are running: {_shown(threads)}")
        processes = [text for pid in descendants(os.getpid()) if (text := _describe_process(pid))]
        self.details["program_processes"] = processes
        if processes:
            reasons.append(f"processes the program started are running: {_shown(processes)}")
        return reasons

    def _gpu_processes(self) -> list[str]:
        if self.nvml is None:
            self.details["gpu_processes"] = None
            return []
        pids_after = self.nvml.running_pids()
        busy = self.nvml.busy_pids(self.since_us) or {}
        running = None if pids_after is None or self.pids_before is None else pids_after | self.pids_before
        excused = self.known.excused(busy, running) if self.known is not None else {}
        # Ours by either name: NVML gives this process its pid in our pid namespace (where the
        # sandbox has one: os.getpid()), measured on the H200; the broker names its host pid.
        here = os.getpid()
        own = self.known.own if self.known is not None and self.known.own is not None else here
        if self.ask_again is not None and any(pid not in excused and pid not in (own, here) for pid in busy):
            # A spare forked on the GPU during the measurement was not named at the grant: ask again.
            self.known = self.ask_again() or self.known
            excused = self.known.excused(busy, running) if self.known is not None else {}
            self.details["asked_again"] = True
        self.details["gpu_processes"] = {
            "before": sorted(self.pids_before) if self.pids_before is not None else None,
            "after": sorted(pids_after) if pids_after is not None else None,
            "busy": {str(pid): util for pid, util in sorted(busy.items())},
            "excused": {str(pid): why for pid, why in sorted(excused.items())},
            "own": own,
        }
        counted = [pid for pid in busy if pid not in excused]
        if not counted:
            return []
        # In a PID namespace (the bubblewrap sandbox) NVML names the processes it can see there by
        # their pids there, the others by their host pids. The broker names ours with the lease;
        # where it did not, and ours is not among NVML's, two busy processes mean one was not us.
        named = self.known is not None and self.known.own is not None
        known = named or (pids_after is not None and (own in pids_after or here in pids_after))
        others = [pid for pid in counted if pid not in (own, here)] if known else (counted if len(counted) > 1 else [])
        if not others:
            return []
        listed = ", ".join(f"pid {pid} ({busy[pid]}% SM)" for pid in sorted(others)[:NAMES_SHOWN])
        return [f"{OTHER_PROCESS_REASON}: {listed}"]
