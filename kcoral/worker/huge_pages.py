"""The zygote's heap in huge pages: fresh workers fork and exit in a fraction of the time.

A process that has imported torch holds 150 MB and more of anonymous memory (the C++ libraries'
static tables, Python's objects), mapped in 4 KiB pages. Every ``fork()`` copies their page table
entries and marks each page copy-on-write, and every worker's exit tears them down again: on the
2-core VM 4.5 to 5 ms of the zygote's CPU per fork and 6.6 to 7.6 ms of the child's for an exit
that ran nothing (against 1.2 and 2.3 ms without torch). Collapsed into 2 MiB pages once
(``MADV_COLLAPSE``, Linux 6.1 and later; the zygote does it once it has forked a few workers, see
``HUGE_PAGES_AFTER_FORKS`` in :mod:`kcoral.worker.zygote`), the same memory is a few hundred entries:
1.5 to 2 ms a fork and 2.8 to 3.4 ms an exit, over 1,000 forks with the zygote writing between
them (``benchmarks/RESULTS.md``, "The zygote's heap in huge pages").

What it does not change: a write to a page the zygote shares with a worker still copies 4 KiB
(the kernel splits the huge page's mapping in the writer and copies the one page), so neither
process's copy-on-write grows; the regions are not marked ``MADV_HUGEPAGE``, so what a worker
allocates later is in ordinary pages, as before. Best effort: on an older kernel, or where the
kernel has no huge page to give, nothing is collapsed and nothing else changes.
"""

from __future__ import annotations

import ctypes

MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages)
MAPS = "/proc/self/maps"


def _collapsible(line: str) -> tuple[int, int] | None:
    """The huge-page-aligned part of one writable private anonymous mapping (the brk heap
    included) of ``/proc/self/maps``, or None."""
    fields = line.split()
    if len(fields) < 5:
        return None
    name = fields[5] if len(fields) > 5 else ""
    permissions = fields[1]
    if name not in ("", "[heap]") or not permissions.startswith("rw") or not permissions.endswith("p"):
        return None
    low, high = (int(address, 16) for address in fields[0].split("-"))
    start = -(-low // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = high // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (start, end) if end - start >= HUGE_PAGE_BYTES else None


PIECE_BYTES = 8 << 20  # collapsed in one call: a few milliseconds, so its caller stays responsive


class Collapse:
    """The collapse of this process's anonymous memory into huge pages where the kernel can, a
    piece of PIECE_BYTES at a time (all at once took 60 to 400 ms on the 2-core VM, during which a
    zygote could neither report an exit nor announce the next worker)."""

    def __init__(self) -> None:
        try:
            with open(MAPS) as maps:
                regions = [region for line in maps if (region := _collapsible(line)) is not None]
        except OSError:
            regions = []
        self.pieces = [
            (low, min(high, low + PIECE_BYTES)) for start, high in regions for low in range(start, high, PIECE_BYTES)
        ]
        self.collapsed = 0  # bytes so far
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def step(self) -> bool:
        """Collapse the next piece; whether any is left."""
        if self.pieces:
            start, end = self.pieces.pop()
            # EINVAL (an older kernel, or a region that cannot be), EAGAIN or ENOMEM (no huge page
            # now, or the region is gone): that piece stays as it is.
            if self._madvise(start, end - start, MADV_COLLAPSE) == 0:
                self.collapsed += end - start
        return bool(self.pieces)


def collapse_anonymous_memory() -> int:
    """Collapse all of this process's anonymous memory now, where the kernel can; the bytes
    collapsed (0 where it cannot: an older kernel, no huge pages free, or no ``/proc``)."""
    collapse = Collapse()
    while collapse.step():
        pass
    return collapse.collapsed


def anonymous_huge_bytes(pid: int | str = "self") -> int:
    """The anonymous memory of a process in huge pages now (``AnonHugePages``), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


__all__ = ["Collapse", "anonymous_huge_bytes", "collapse_anonymous_memory"]
