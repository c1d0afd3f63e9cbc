"""A memory cgroup per worker: the kernel holds all of a program's processes to ``--memory-limit``.

The zygote's watchdog samples the program's tree every 50 ms; memory taken and given back between
two samples (children made with ``CLONE_PARENT``, each under its own ``RLIMIT_DATA``, in bursts)
went unseen. A cgroup counts every page its processes charge, at the moment they charge it, and a
child is in its parent's cgroup from its fork on, however it was made.

Where the broker runs with the cgroup v1 memory controller writable (as root on a host whose
``/sys/fs/cgroup/memory`` is mounted), it makes ``kcoral-PID-TOKEN`` below its own memory cgroup
and one directory per slot in it (:class:`SlotCgroups`), and hands each slot's zygote a descriptor
of its directory (the zygote's settings' ``memory_cgroup_fd``; bubblewrap passes it through, and
the sandbox has no ``/sys``, so a program has no path to any cgroup). The zygote makes one cgroup
per worker in it before the fork (:class:`WorkerCgroup`), with ``memory.limit_in_bytes`` at the
memory limit and the OOM killer off (``memory.oom_control``), and moves the worker in right after
the fork, before it has a program. A process that asks for memory over the limit (page cache is
reclaimed first: files written or read do not count against it) then stops in the kernel, and the
kernel says so at once on an eventfd (``cgroup.event_control``): the zygote wakes and kills the
whole program, reason ``... (--memory-limit)``, as the watchdog does. The program's worker is killed
with its children, so a stopped child cannot let its parent go on to a COMPLETED result, unless the
parent sends its result in the moment between the child's stop and the zygote's kill (the zygote's
wake-up: microseconds on an idle host, a scheduling delay on a loaded one). After the worker's exit
the zygote keeps its cgroup, empty, for a later worker of the slot (its peak reset): a removed
memory cgroup lingers in the kernel while pages it was charged for stay cached, hundreds of them
after a day of programs. The zygote removes them at its stop, the broker its directory at its own.

Without the controller (cgroup v2 only, no root, ``--memory-cgroup off``) nothing changes: the
watchdog's samples alone, and the broker's HEALTH says so (``memory_accounting``). cgroup v2
(``memory.max``, ``memory.events``) is not used yet.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kcoral.worker import limits

MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUPS = Path("/proc/self/cgroup")
LIMIT_FILE = "memory.limit_in_bytes"
MEMSW_LIMIT_FILE = "memory.memsw.limit_in_bytes"  # memory and swap: present where swap is accounted
OOM_CONTROL_FILE = "memory.oom_control"
PEAK_FILE = "memory.max_usage_in_bytes"
EVENT_CONTROL_FILE = "cgroup.event_control"
PROCS_FILE = "cgroup.procs"
# How long the broker keeps trying to remove its cgroups at its stop (a process's exit leaves its
# cgroup a moment after the parent has reaped it).
REMOVE_TRIES = 50
REMOVE_PAUSE_SECONDS = 0.02
BROKER_DIRECTORY = re.compile(r"kcoral-(\d+)-[0-9a-f]{8}")  # kcoral-PID-TOKEN


class CgroupUnavailable(RuntimeError):
    """The memory controller cannot be used here; the message says why."""


def memory_v1_directory(mountinfo: str | None = None, own: str | None = None) -> Path:
    """The directory of this process's own cgroup in the v1 memory hierarchy (raises
    :class:`CgroupUnavailable` when there is none mounted)."""
    mountinfo = MOUNTINFO.read_text() if mountinfo is None else mountinfo
    own = OWN_CGROUPS.read_text() if own is None else own
    mount: tuple[str, str] | None = None  # (root within the hierarchy, mount point)
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mount = (fields[3], fields[4])
            break
    if mount is None:
        raise CgroupUnavailable("no cgroup v1 memory controller is mounted (cgroup v2 is not used yet)")
    path = ""
    for line in own.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            path = parts[2]
    root, point = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return Path(point, path.lstrip("/"))


def _write(directory: int, name: str, value: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=directory)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def join_directory(directory: int, pid: int) -> None:
    """Move ``pid`` into the cgroup of the open ``directory`` (a worker joins its own this way)."""
    _write(directory, PROCS_FILE, str(pid))


def _read(directory: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=directory)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> bool:
    """Remove a cgroup directory and those below it (their files go with them); whether it went."""
    for _ in range(REMOVE_TRIES):
        with contextlib.suppress(FileNotFoundError):
            for child in sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: -len(p.parts)):
                _remove_tree(child)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(REMOVE_PAUSE_SECONDS)  # a task still leaving it
    return False


@dataclass
class SlotCgroups:
    """The broker's cgroups: one directory, and one per slot in it, each open for its zygote.

    ``describe()`` is what HEALTH says (``memory_accounting``)."""

    base: Path | None = None
    fds: dict[int, int] = field(default_factory=dict)
    reason: str = ""  # why there are none, where there are none

    @classmethod
    def make(cls, *, memory_limit: int, enabled: bool = True) -> SlotCgroups:
        """The broker's directory, tried once for what each worker's cgroup needs; without one (the
        reason said) where the controller cannot be used."""
        if not enabled:
            return cls(reason="--memory-cgroup off")
        if not memory_limit:
            return cls(reason="no memory limit (--memory-limit 0)")
        try:
            own = memory_v1_directory()
            remove_dead_brokers(own)
            base = own / f"kcoral-{os.getpid()}-{secrets.token_hex(4)}"
            base.mkdir()
        except (CgroupUnavailable, OSError) as exc:
            return cls(reason=str(exc))
        made = cls(base=base)
        try:
            probe = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # what each worker's cgroup needs, tried once on the broker's own
                _write(probe, LIMIT_FILE, str(memory_limit))
                _write(probe, OOM_CONTROL_FILE, "1")
                _write(probe, OOM_CONTROL_FILE, "0")
                _write(probe, LIMIT_FILE, "-1")
            finally:
                os.close(probe)
        except OSError as exc:
            made.remove()
            return cls(reason=f"cannot set up a memory cgroup in {base.parent}: {exc}")
        return made

    def fd(self, slot: int) -> int | None:
        """A descriptor of the slot's directory (made at the first call), or None without cgroups."""
        if self.base is None:
            return None
        if slot not in self.fds:
            directory = self.base / f"slot-{slot}"
            directory.mkdir(exist_ok=True)
            self.fds[slot] = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self.fds[slot]

    def describe(self) -> dict[str, str]:
        if self.base is not None:
            return {"kind": "cgroup-v1", "cgroup": str(self.base)}
        return {"kind": "sampled", "reason": self.reason}

    def remove(self) -> bool:
        """Close the slots' descriptors and remove every cgroup made (the zygotes have stopped)."""
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        base, self.base = self.base, None
        return base is None or _remove_tree(base)


class WorkerCgroup:
    """One worker's cgroup, made by its zygote in the slot's directory (a descriptor)."""

    def __init__(self, slot_fd: int, name: str, memory_limit: int) -> None:
        self.slot_fd = slot_fd
        self.name = name
        self.memory_limit = memory_limit
        os.mkdir(name, dir_fd=slot_fd)
        self.fd = -1
        self.oom_fd = -1
        self.events = -1
        try:
            self.fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=slot_fd)
            _write(self.fd, LIMIT_FILE, str(memory_limit))
            with contextlib.suppress(OSError):  # no swap accounting: no swap to hide memory in
                _write(self.fd, MEMSW_LIMIT_FILE, str(memory_limit))
            _write(self.fd, OOM_CONTROL_FILE, "1")  # stop at the limit rather than kill one process
            self.events = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self.oom_fd = os.open(OOM_CONTROL_FILE, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
            _write(self.fd, EVENT_CONTROL_FILE, f"{self.events} {self.oom_fd}")
        except OSError:
            self.remove()
            raise

    def join(self, pid: int) -> None:
        join_directory(self.fd, pid)

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in this cgroup now."""
        try:
            return str(pid) in _read(self.fd, PROCS_FILE).split()
        except OSError:
            return False

    def oom_events(self) -> int:
        """How often its processes asked for memory over the limit since the last read (the
        eventfd's count)."""
        try:
            return os.eventfd_read(self.events)
        except OSError:  # BlockingIOError: none
            return 0

    def out_of_memory(self) -> bool:
        """Whether its processes asked for memory over the limit since the last call, or one is
        stopped there now."""
        if self.oom_events():
            return True
        try:
            return "under_oom 1" in _read(self.fd, OOM_CONTROL_FILE)
        except OSError:
            return False

    def peak(self) -> int | None:
        try:
            return int(_read(self.fd, PEAK_FILE))
        except (OSError, ValueError):
            return None

    def breach(self) -> str:
        """The reason a program over the limit is killed, said for its result."""
        peak = self.peak()
        counted = f" ({limits.format_bytes(peak)} at its peak)" if peak is not None else ""
        return (
            f"its processes asked for memory over {limits.describe_limit('memory_bytes', self.memory_limit)}, "
            f"by the kernel's count of its memory cgroup{counted}"
        )

    def empty(self) -> bool:
        """Whether no task is left in it."""
        try:
            return not _read(self.fd, PROCS_FILE).strip()
        except OSError:
            return False

    def reuse(self) -> bool:
        """Ready it for the next worker (it is empty): its OOM events read, its peak reset to what
        it holds now (page cache the last worker's files left, which the kernel reclaims at the
        limit). False where that fails."""
        self.oom_events()
        try:
            _write(self.fd, PEAK_FILE, "0")
        except OSError:
            return False
        return True

    def remove(self) -> bool:
        """Close its descriptors and remove it (no process may be left in it); whether it went."""
        for name in ("events", "oom_fd", "fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)
        try:
            os.rmdir(self.name, dir_fd=self.slot_fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


class WorkerCgroupPool:
    """A slot's worker cgroups, kept by its zygote: one taken for each fork, given back at the
    worker's exit.

    Reused, not removed between workers: a removed memory cgroup lingers in the kernel while pages
    it was charged for stay cached (num_cgroups in /proc/cgroups grew by hundreds over a day of
    programs). Free: those of exited workers, empty, for the next forks (at most ``keep_free``);
    retired: one a task was still leaving, or beyond ``keep_free``, removed at the next ``tidy``."""

    def __init__(self, slot_fd: int, memory_limit: int, *, keep_free: int) -> None:
        self.slot_fd = slot_fd
        self.memory_limit = memory_limit
        self.keep_free = keep_free
        self.free: list[WorkerCgroup] = []
        self.retired: list[WorkerCgroup] = []
        self.unchecked = True  # a zygote that died may have left cgroups in the slot

    def take(self, identity: str) -> WorkerCgroup | None:
        """The cgroup of the worker about to be forked; None where it cannot be made (the
        watchdog's samples alone then, as without cgroups)."""
        while self.free:
            cgroup = self.free.pop()
            if cgroup.reuse():
                return cgroup
            self.retired.append(cgroup)
        try:
            return WorkerCgroup(self.slot_fd, identity, self.memory_limit)
        except OSError:
            return None

    def give_back(self, cgroup: WorkerCgroup) -> None:
        """The cgroup of a worker that has exited with all it started: free where no task is left
        in it, else retired."""
        if len(self.free) < self.keep_free and cgroup.empty():
            self.free.append(cgroup)
        else:
            self.retired.append(cgroup)

    def tidy(self) -> None:
        """Free or remove the retired cgroups; one that a task is still leaving is tried again at
        the next call."""
        retired, self.retired = self.retired, []
        for cgroup in retired:
            if len(self.free) < self.keep_free and cgroup.empty():
                self.free.append(cgroup)
            elif not cgroup.remove():
                self.retired.append(cgroup)

    def remove_leftovers(self, in_use: set[str]) -> None:
        """Once, at the slot's first clearing: remove what a zygote before this one left."""
        if self.unchecked:
            remove_leftovers(self.slot_fd, in_use)
            self.unchecked = False

    def remove_all(self) -> None:
        """At the zygote's stop (its workers are gone): remove every cgroup it kept."""
        self.retired += self.free
        self.free = []
        self.keep_free = 0
        self.tidy()


def remove_dead_brokers(parent: Path) -> None:
    """Remove what brokers that were killed (SIGKILL: no stop of theirs ran) left in ``parent``:
    the directories of brokers whose process is gone, once no task is left in them."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        found = BROKER_DIRECTORY.fullmatch(entry.name)
        if found is None or not entry.is_dir() or psutil.pid_exists(int(found.group(1))):
            continue
        for directory in sorted(entry.rglob("*"), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                if directory.is_dir():
                    directory.rmdir()
        with contextlib.suppress(OSError):
            entry.rmdir()


def remove_leftovers(slot_fd: int, keep: set[str]) -> None:
    """Remove the worker cgroups of the slot but ``keep`` that no process holds any more (those of
    a zygote that died, or whose removal found a task still leaving)."""
    try:
        entries = [entry.name for entry in os.scandir(slot_fd) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in entries:
        if name not in keep:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=slot_fd)


__all__ = [
    "CgroupUnavailable",
    "SlotCgroups",
    "WorkerCgroup",
    "WorkerCgroupPool",
    "join_directory",
    "memory_v1_directory",
    "remove_dead_brokers",
    "remove_leftovers",
]
