"""What a program's processes use, and the limits they are held to.

Shared by the zygote (whose watchdog measures the whole tree of the program that runs) and the
worker (which sets its rlimits and explains an error that an rlimit caused).

Resource limits. ``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE`` are plain per-process rlimits. Memory is
``RLIMIT_DATA`` (private writable memory: heap and anonymous mappings) rather than ``RLIMIT_AS``,
because CUDA reserves far more address space than it uses and fails to start under ``RLIMIT_AS``.
On an H200 host a CUDA context, a 20 GiB device allocation, 1 GiB of pinned host memory and a
cuBLAS matmul all work under a 4 GiB ``RLIMIT_DATA`` (a process with a CUDA context counts about
1.4 GiB of data, so the limit must be well above that on GPU hosts). The kernel enforces it at once,
so a memory bomb gets a ``MemoryError`` that the program's result reports. As every
process has its own rlimit, the zygote also sums the resident anonymous memory of the whole tree and
kills it when the sum passes the limit. Processes are counted by the same watchdog, not with
``RLIMIT_NPROC``: the kernel does not enforce that for root, and for other users it counts every
thread of every process of the user, the broker's included.
"""

from __future__ import annotations

import os
import resource
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# The broker flags behind each limit, named in the messages users see.
LIMIT_FLAGS = {
    "memory_bytes": "--memory-limit",
    "processes": "--max-processes",
    "file_size_bytes": "--max-file-bytes",
    "open_files": "--max-open-files",
    "workspace_bytes": "--max-workspace-bytes",
}
# Per-process rlimits; memory and processes are also watched over the whole tree.
RLIMITS = {
    "memory_bytes": resource.RLIMIT_DATA,
    "file_size_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}
# Error texts that mean an rlimit was hit, and which one.
LIMIT_ERROR_MARKERS = {
    "memory_bytes": ("memoryerror", "cannot allocate memory", "can't allocate memory", "bad_alloc", "errno 12"),
    "file_size_bytes": ("file too large", "errno 27"),
    "open_files": ("too many open files", "errno 24"),
}
BLOCK_BYTES = 512  # the unit of st_blocks
UNLINKED_MARK = " (deleted)"  # how /proc names a file that no directory holds any more


@dataclass(frozen=True)
class TreeUsage:
    processes: int
    resident_bytes: int  # every resident page of each process, shared ones counted again each time


def _proc_files(pids: Iterable[int], name: str) -> Iterator[bytes]:
    """The contents of ``/proc/PID/name`` for each of ``pids`` that can still be read."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                data = handle.read()
        except OSError:
            continue  # gone meanwhile
        yield data


def tree_usage(pids: Iterable[int]) -> TreeUsage:
    """How many of ``pids`` are alive and their resident memory: cheap (one small read each)."""
    count = 0
    pages = 0
    for statm in _proc_files(pids, "statm"):
        fields = statm.split()
        if len(fields) < 2 or fields[0] == b"0":
            continue  # a zombie (or a kernel thread) has no memory and counts for nothing
        count += 1
        pages += int(fields[1])
    return TreeUsage(count, pages * PAGE_BYTES)


def private_memory(pids: Iterable[int]) -> int:
    """The anonymous and shared-memory bytes of ``pids``, each page split among its sharers.

    A forked process shares its parent's pages until it writes them; plain resident sizes count
    those once per process. The proportional set size does not, but it costs a walk of the page
    tables (milliseconds for a process that imported torch), so the watchdog reads it only when
    the cheap sum is already over the limit.
    """
    total_kib = 0
    for pid in pids:
        # A process that made itself not dumpable hides its smaps_rollup from us (unless we may
        # trace it); its status stays readable, with the same counts unsplit: never fewer bytes.
        lines = _rollup_or_status(pid)
        for line in lines:
            if line.startswith((b"Pss_Anon:", b"Pss_Shmem:", b"RssAnon:", b"RssShmem:")):
                total_kib += int(line.split()[1])
    return total_kib * 1024


def _rollup_or_status(pid: int) -> list[bytes]:
    for name in ("smaps_rollup", "status"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as handle:
                return handle.read().splitlines()
        except PermissionError:
            continue
        except OSError:
            return []  # gone meanwhile
    return []


def unlinked_file_bytes(pids: Iterable[int]) -> int:
    """The allocated bytes of the files that ``pids`` keep open or map shared while no directory
    holds them any more: deleted files and memfds, each once.

    A walk of the workspace misses them, yet they take the disk (or, memfds, the memory) that files
    in the workspace would, until the last process holding them ends. A file known only by a
    mapping counts for the extent mapped: its size needs ``/proc/PID/map_files``, which wants
    CAP_CHECKPOINT_RESTORE. Shared anonymous memory and System V segments (``/dev/zero``,
    ``/SYSV...``) are memory, which the memory limit counts.
    """
    sizes: dict[tuple[int, int, int], int] = {}
    for pid in pids:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone meanwhile
        for fd in descriptors:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if not os.readlink(path).endswith(UNLINKED_MARK):
                    continue
                info = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                sizes[(os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)] = info.st_blocks * BLOCK_BYTES
    mapped: dict[tuple[int, int, int], int] = {}
    for maps in _proc_files(pids, "maps"):
        for line in maps.splitlines():
            if not line.endswith(UNLINKED_MARK.encode()):
                continue
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[1][3:4] != b"s" or fields[5].startswith((b"/dev/zero", b"/SYSV")):
                continue
            start, end = (int(x, 16) for x in fields[0].split(b"-"))
            major, minor = (int(x, 16) for x in fields[3].split(b":"))
            key = (major, minor, int(fields[4]))
            mapped[key] = max(mapped.get(key, 0), int(fields[2], 16) + end - start)
    for key, extent in mapped.items():
        sizes.setdefault(key, extent)
    return sum(sizes.values())


def rlimit_values(limits: dict[str, int]) -> dict[int, tuple[int, int]]:
    """The (soft, hard) value of each of :data:`RLIMITS` once ``limits`` are applied here.

    Never above the current hard limit: raising that needs privileges we may lack.
    """
    values = {}
    for name, which in RLIMITS.items():
        value = limits.get(name)
        current = resource.getrlimit(which)
        if not value:
            values[which] = current
            continue
        hard = current[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        values[which] = (value, value)
    return values


def apply_rlimits(limits: dict[str, int]) -> None:
    """Set the per-process rlimits for ``limits`` (0 or missing: no limit)."""
    for which, value in rlimit_values(limits).items():
        if resource.getrlimit(which) != value:
            resource.setrlimit(which, value)


# What a fresh worker adds to its zygote's private data before its program runs: the stacks of its
# threads (its sockets' two, its output follower's) and what they allocate.
WORKER_START_BYTES = 64 << 20


def own_data_bytes() -> int | None:
    """This process's private data as ``RLIMIT_DATA`` counts it (``VmData``); None where unknown."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_limit_refusal(limits: dict[str, int], data_bytes: int | None) -> str | None:
    """Why no worker could start under ``limits``' memory limit, in a process (a zygote) that holds
    ``data_bytes`` of private data already; None where one can. A worker starts with its zygote's
    data (the preloaded libraries: about 0.8 GiB with a CUDA build of torch, more with CUPTI) under
    its ``RLIMIT_DATA``, and below that plus WORKER_START_BYTES its first thread cannot start."""
    limit = limits.get("memory_bytes")
    if not limit or data_bytes is None or data_bytes + WORKER_START_BYTES <= limit:
        return None
    suggested = -(-(data_bytes + WORKER_START_BYTES + (1 << 30)) // (1 << 30))
    return (
        f"{LIMIT_FLAGS['memory_bytes']} {format_bytes(limit)} is below what a worker holds before its program runs: "
        f"{format_bytes(data_bytes)} of private data from the preloaded libraries, and about "
        f"{format_bytes(WORKER_START_BYTES)} of its own; give at least {suggested} GiB (or 0 for no limit)"
    )


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.4g} {unit}"
    return f"{count} bytes"


def describe_limit(name: str, value: int) -> str:
    """``"the memory limit of 512 MiB (--memory-limit)"``."""
    what = {
        "memory_bytes": "memory limit",
        "processes": "process limit",
        "file_size_bytes": "file size limit",
        "open_files": "open file limit",
        "workspace_bytes": "workspace quota",
    }[name]
    amount = format_bytes(value) if name.endswith("_bytes") else str(value)
    return f"the worker's {what} of {amount} ({LIMIT_FLAGS[name]})"


def current_limits() -> dict[str, int]:
    """This process's rlimits, under the names of :data:`RLIMITS` (unlimited ones left out)."""
    found = {}
    for name, which in RLIMITS.items():
        soft, _hard = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            found[name] = soft
    return found


def explain_limit_error(message: str, limits: dict[str, int]) -> str | None:
    """When ``message`` reads like an rlimit was hit, the sentence that names the limit."""
    text = message.lower()
    for name, markers in LIMIT_ERROR_MARKERS.items():
        if limits.get(name) and any(marker in text for marker in markers):
            return f"this may be {describe_limit(name, limits[name])}"
    return None


def limit_breach(pids: list[int], limits: dict[str, int], detached_bytes: int = 0) -> str | None:
    """The watchdog's verdict on one sample of a worker's tree: None, or why it must die.
    ``detached_bytes``: memory the program holds outside its processes (System V segments)."""
    usage = tree_usage(pids)
    most = limits.get("processes") or 0
    if most and usage.processes > most:
        return f"{usage.processes} processes, over {describe_limit('processes', most)}"
    memory = limits.get("memory_bytes") or 0
    if memory and usage.resident_bytes + detached_bytes > memory:
        used = private_memory(pids) + detached_bytes
        if used > memory:
            return f"{format_bytes(used)} of memory in use, over {describe_limit('memory_bytes', memory)}"
    return None


__all__ = [
    "LIMIT_FLAGS",
    "RLIMITS",
    "TreeUsage",
    "apply_rlimits",
    "current_limits",
    "describe_limit",
    "explain_limit_error",
    "format_bytes",
    "limit_breach",
    "private_memory",
    "rlimit_values",
    "tree_usage",
    "unlinked_file_bytes",
]
