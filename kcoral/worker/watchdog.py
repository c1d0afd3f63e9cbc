"""The zygote's watchdog: the running program's processes and workspace, sampled against the slot's
limits (see :mod:`kcoral.worker.processes` for why the process and memory limits are not rlimits
alone). The zygote asks it when a sample is due and kills the worker it names over a limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kcoral.worker import limits, processes, workspace

WATCH_INTERVAL_SECONDS = 0.05  # how often the watchdog samples the processes of the program
# The workspace walk costs about 25 us per entry on the 2-core VM under load (10,100 entries:
# 245 ms at a load average of 15): it runs at most every WORKSPACE_SAMPLE_SECONDS, and never takes
# more than 1/WORKSPACE_SAMPLE_FACTOR of the zygote's time.
WORKSPACE_SAMPLE_SECONDS = 0.25
WORKSPACE_SAMPLE_FACTOR = 20
# Entries (files, directories, links) one program may keep in its workspace. It bounds each walk
# (2.5 s at the bound on that loaded VM, during which the zygote answers nothing) and the inodes
# one program can take; more fails like the byte quota.
MAX_WORKSPACE_ENTRIES = 100_000
# The limits that need sampling: without any of them the watchdog sleeps.
WATCHED_LIMITS = ("processes", "memory_bytes", "workspace_bytes")


class Watchdog:
    """Samples every process below the zygote but the spare, and the slot's workspace."""

    def __init__(self, bounds: dict[str, int], workspace_dir: Path, *, private_ipc: bool) -> None:
        self.bounds = bounds
        self.workspace_dir = workspace_dir
        self.private_ipc = private_ipc  # System V segments are the slot's own: their bytes count
        self.watched = any(bounds.get(name) for name in WATCHED_LIMITS)
        self.next_watch = 0.0
        self.next_workspace_sample = 0.0

    def program_may_start(self, now: float) -> None:
        """A new worker is announced: its workspace is first walked a sample period from now."""
        self.next_workspace_sample = now + WORKSPACE_SAMPLE_SECONDS

    def due(self, now: float) -> bool:
        """Whether a sample is due now (then the next one is WATCH_INTERVAL_SECONDS away)."""
        if not self.watched or now < self.next_watch:
            return False
        self.next_watch = now + WATCH_INTERVAL_SECONDS
        return True

    def breach(self, *, spare: set[int]) -> str | None:
        """The limit the program's processes or workspace are over, said for its result, or None."""
        bounds = self.bounds
        most = bounds.get("processes") or None
        # Every process below the zygote but the spare: the worker's tree and those it made with
        # CLONE_PARENT.
        tree = processes.descendants(os.getpid(), most, spare=spare)
        detached = workspace.detached_segment_bytes() if self.private_ipc else 0
        breach = limits.limit_breach(tree, bounds, detached)
        if breach is None and bounds.get("workspace_bytes") and time.monotonic() >= self.next_workspace_sample:
            breach = self.workspace_breach(bounds["workspace_bytes"], tree)
        return breach

    def workspace_breach(self, quota: int, tree: list[int]) -> str | None:
        start = time.monotonic()
        used = workspace.usage(self.workspace_dir, MAX_WORKSPACE_ENTRIES)
        unlinked = limits.unlinked_file_bytes(tree)  # deleted files and memfds still held
        took = time.monotonic() - start
        self.next_workspace_sample = time.monotonic() + max(WORKSPACE_SAMPLE_SECONDS, WORKSPACE_SAMPLE_FACTOR * took)
        limit = limits.describe_limit("workspace_bytes", quota)
        if not used.complete:
            return f"more than {MAX_WORKSPACE_ENTRIES} files in its workspace, over {limit}"
        if used.bytes + unlinked > quota:
            held = f" and in deleted files it holds ({limits.format_bytes(unlinked)})" if unlinked else ""
            return f"{limits.format_bytes(used.bytes + unlinked)} in its workspace{held}, over {limit}"
        return None


__all__ = ["MAX_WORKSPACE_ENTRIES", "WATCH_INTERVAL_SECONDS", "WORKSPACE_SAMPLE_SECONDS", "Watchdog"]
