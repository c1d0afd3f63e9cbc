"""A worker's processes: finding them and killing all of them (what they use and the limits they
are held to: :mod:`kcoral.worker.limits`).

Shared by the zygote (which kills what a worker leaves behind and watches the limits while it runs)
and the worker (which reports the processes a program left running when it returned).

Finding every process a program started, including those that called ``setsid()`` or
double-forked, relies on ``PR_SET_CHILD_SUBREAPER``: the zygote and the worker both set it, so an
orphan is re-parented to them rather than to init, and a walk down the ``children`` lists from the
zygote reaches everything. (Init does not reap orphans on every host: a process that escapes
becomes a zombie for good.)

psutil or /proc. psutil reads the whole process table where a full scan is needed anyway
(:func:`process_table`, the walk on kernels without ``/proc/PID/task/TID/children``, the broker's
search for orphans among its children), and tells a vanished process from a zombie for us. The
watchdog's hot path keeps its own small reads, measured on the 2-core VM (137 processes): a
process's line of the table costs 33 us read here against 339 us through ``psutil.Process`` (which
also reads the process's start time, to know it again), a memory sample 129 us against 519 us, and
a process's children 0.9 ms from its ``children`` files against 14.6 ms for ``children()``, which
scans every process. psutil has no equivalent of :func:`private_memory` either: its ``pss`` counts
the shared libraries too, and its ``uss`` not the pages a process shares with its own forks.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
KILL_PAUSE_SECONDS = 0.002  # between kill rounds: let the dying be re-parented to us
KILL_GIVE_UP_SECONDS = 10.0  # a process stuck in the kernel (state D) is left for later rounds
WALK_MOST = 4096  # processes looked at in one bounded walk of a tree (a kill pass, a GPU check)
SANDBOX_SEARCH_MOST = 16  # processes looked at for a zygote in its sandbox (bwrap, its init, it, a worker)


# Found once, at import (in the zygote, before its forks): a ctypes.CDLL made per call, with its
# function looked up again, cost a fresh worker 0.4 ms and 100 page faults for its four prctl
# calls on the 2-core VM, one of them on the program's path (set_dumpable); this one 0.04 ms.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def set_child_subreaper() -> None:
    """Orphans among our descendants are re-parented to this process, where we can find them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_dumpable(dumpable: bool) -> None:
    """A non-dumpable process's /proc/<pid>/mem cannot be opened by processes of the same user."""
    _prctl(PR_SET_DUMPABLE, int(dumpable))


def is_dumpable() -> bool:
    """Whether this process is dumpable now (see :func:`set_dumpable`)."""
    return bool(_prctl(PR_GET_DUMPABLE, 0))


def thread_ids() -> frozenset[int] | None:
    """Every thread of this process now, by the kernel's ids (threads started in C as well as
    Python's); None where ``/proc`` cannot be read."""
    try:
        return frozenset(int(name) for name in os.listdir("/proc/self/task"))
    except (OSError, ValueError):
        return None


def set_parent_death_signal(sig: int) -> None:
    """Receive ``sig`` when the parent (thread) that started this process ends."""
    _prctl(PR_SET_PDEATHSIG, sig)


# --- the process table --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str
    name: str

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")

    def describe(self) -> str:
        return f"{self.pid} ({self.name})"


def read_process(pid: int) -> ProcessInfo | None:
    """One process's line of the table, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses.
    close = raw.rfind(")")
    fields = raw[close + 2 :].split()
    if len(fields) < 4:
        return None
    name = raw[raw.find("(") + 1 : close]
    return ProcessInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0], name)


def _info(process: psutil.Process) -> ProcessInfo | None:
    """A ProcessInfo from a process that ``psutil.process_iter`` read (ppid, status, name)."""
    try:
        pgrp, session = os.getpgid(process.pid), os.getsid(process.pid)
    except OSError:
        return None
    fields = process.info
    state = _STATES.get(fields["status"], "?")
    return ProcessInfo(process.pid, fields["ppid"] or 0, pgrp, session, state, fields["name"] or "")


# psutil's status names back to the letters of /proc/PID/stat that ProcessInfo keeps.
_STATES = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}


def process_table() -> list[ProcessInfo]:
    """Every process this one can see."""
    rows = (_info(p) for p in psutil.process_iter(["ppid", "status", "name"]))
    return [row for row in rows if row is not None]


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of all its threads: a thread's children are listed apart)."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in threads:
        try:
            fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY)
        except OSError:
            continue
        try:  # no file object: this runs on every program's way to its result
            found.extend(int(p) for p in _read_all(fd).split())
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


_HAS_CHILDREN_LISTS = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def descendants(root: int, most: int | None = None, spare: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Every process below ``root`` but ``spare`` and theirs, parents first; stop after ``most`` + 1.

    The bound matters in a fork bomb: a walk of a tree that grows faster than it can be read
    would never end, and the watchdog only needs to know that the limit is passed.
    """
    if not _HAS_CHILDREN_LISTS:  # kernels without CONFIG_PROC_CHILDREN: build it from the table
        by_parent: dict[int, list[int]] = {}
        for process in psutil.process_iter(["ppid"]):
            by_parent.setdefault(process.info["ppid"] or 0, []).append(process.pid)
        lookup = by_parent.get
    else:
        lookup = None
    found: list[int] = []
    seen = {root, *spare}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child in lookup(pid, []) if lookup is not None else children(pid):
            if child not in seen:
                seen.add(child)
                found.append(child)
                frontier.append(child)
                if most is not None and len(found) > most:
                    return found
    return found


def past_user_code(pid: int) -> bool:
    """Whether no thread of process ``pid`` can run code of its own again: each one has left its
    address space (the kernel drops it early on a thread's way out, so a killed process gets here
    before its descriptors are closed), or the process is gone. False where a thread cannot be
    read. Only meaningful for a process that was killed: a live one always has its address space.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as handle:
                # The Vm* lines are there exactly while the thread has an address space.
                if b"\nVmSize:" in handle.read():
                    return False
        except FileNotFoundError:
            continue  # that thread is gone
        except OSError:
            return False
    return True


def namespace_pids(pid: int) -> list[int] | None:
    """The pids that process ``pid`` has in each pid namespace it is in, ours first (``NSpid``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"NSpid:"):
                    return [int(field) for field in line.split()[1:]] or None
    except (OSError, ValueError):
        pass
    return None


def namespace_pid(pid: int) -> int | None:
    """The pid that process ``pid`` has in its own pid namespace (inside a sandbox), or None."""
    pids = namespace_pids(pid)
    return pids[-1] if pids else None


def child_by_namespace_pid(parent: int, inside: int) -> int | None:
    """Our pid of the child of ``parent`` that is ``inside`` in ``parent``'s own pid namespace (a
    zygote's worker or spare, as the zygote names it). Pids are unique within one namespace, and
    the pid is read at the parent's level, so a child that made a namespace below it (where its own
    pid could be anything) is not taken for another."""
    level = namespace_pids(parent)
    if level is None:
        return None
    if _HAS_CHILDREN_LISTS:
        kids = children(parent)
    else:
        try:
            kids = [child.pid for child in psutil.Process(parent).children()]
        except psutil.Error:
            return None
    for child in kids:
        pids = namespace_pids(child)
        if pids is not None and len(pids) >= len(level) and pids[len(level) - 1] == inside:
            return child
    return None


def find_in_sandbox(root: int, inside: int) -> int | None:
    """Our pid of the process that is ``inside`` in its own pid namespace: ``root`` itself, or a
    process below it (the zygote under the bwrap started as ``root``, say). Call it before any
    program runs there: the first match wins."""
    for pid in [root, *descendants(root, SANDBOX_SEARCH_MOST)]:
        if namespace_pid(pid) == inside:
            return pid
    return None


def orphans_from_workers(exclude: set[int]) -> list[ProcessInfo]:
    """Our children in another session than ours, other than ``exclude``: for the broker.

    Every worker calls ``setsid()``, so what its tree leaves to the broker (the broker is their
    subreaper once their zygote has died) runs in a session of its own, while the zygotes and
    anything else the broker starts share the broker's session.
    """
    me = os.getpid()
    session = os.getsid(0)
    found: list[ProcessInfo] = []
    try:
        mine = psutil.Process(me).children()
    except psutil.Error:
        return found
    for process in mine:
        if process.pid in exclude:
            continue
        try:
            with process.oneshot():
                process.info = {"ppid": process.ppid(), "status": process.status(), "name": process.name()}
        except psutil.Error:
            continue
        info = _info(process)
        if info is not None and info.ppid == me and info.session != session:
            found.append(info)
    return found


def kill_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_processes(infos: Iterable[ProcessInfo], *, spare_groups: Iterable[int] = ()) -> None:
    """SIGKILL each process, and first each process group they are in (except ours and
    ``spare_groups``).

    A group kill reaches every member at once, those being forked at that moment included, where
    kills by pid race a fork bomb. Only processes in sessions of their own (a worker's, or those
    its programs made) can share those groups, so no process outside the tree is hit; but a dead
    group leader's pid can be reused, by a new worker that then leads a group of that number, so
    the groups of the processes being spared are never killed.
    """
    chosen = list(infos)
    skipped = {os.getpgrp(), 0, *spare_groups}
    for group in {info.pgrp for info in chosen if info.pgrp not in skipped}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    kill_all(info.pid for info in chosen)


def kill_group(pid: int) -> None:
    """SIGKILL the process group that ``pid`` leads, then ``pid`` itself (gone already: nothing)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def kill_below(root: int, *, spare: set[int]) -> None:
    """One bounded pass (``WALK_MOST``) that kills the processes below ``root`` but ``spare`` and
    their groups: those a group kill does not reach (other groups, children made with
    ``CLONE_PARENT``); :func:`kill_descendants` gets whatever is left."""
    tree = descendants(root, WALK_MOST, spare=spare)
    kill_processes((info for info in map(read_process, tree) if info is not None), spare_groups=spare)


def kill_descendants(root: int, *, spare: frozenset[int] | set[int] = frozenset()) -> list[ProcessInfo]:
    """Kill every process below ``root`` until none is left; return those that were alive.

    ``root`` must be this process, a subreaper: a process killed mid-tree re-parents its children
    to us, and the next round finds them; we reap our children among them (by pid, so that the
    exit status of another child is not taken). ``spare`` and their trees are left alone.
    """
    me = os.getpid()
    killed: dict[int, ProcessInfo] = {}
    deadline = time.monotonic() + KILL_GIVE_UP_SECONDS
    while True:
        alive = []
        remaining = False
        for pid in descendants(root, spare=spare):
            info = read_process(pid)
            if info is None:
                continue
            if info.zombie:
                if info.ppid == me:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                    continue
            else:
                alive.append(info)
                killed.setdefault(pid, info)
            remaining = True
        if not remaining or time.monotonic() > deadline:
            return list(killed.values())
        kill_processes(alive, spare_groups=spare)
        time.sleep(KILL_PAUSE_SECONDS)


# --- what a worker was doing when it died ----------------------------------------------------------


class ProgressBoard:
    """Eight bytes shared by the zygote and its workers: the index of the instruction running now.

    A worker also reports its progress to the broker over zmq, but a worker that dies at once
    (``os._exit``, a signal) takes its unsent messages with it; this shared mapping, made by the
    zygote before it forks, survives the worker, so the zygote can say in its
    ``exited`` event which instruction the worker was executing. It is a memory file's, so that
    the zygote can hand it to the forker (:mod:`kcoral.worker.forker`) by its ``descriptor``,
    which it closes (:meth:`let_go`) once the worker is forked; a worker of the forker maps it
    again (:meth:`attach`).
    """

    def __init__(self, descriptor: int | None = None) -> None:
        if descriptor is None:
            descriptor = os.memfd_create("kcoral-board", os.MFD_CLOEXEC)
            os.ftruncate(descriptor, 8)
            self.descriptor: int | None = descriptor
            self._map = mmap.mmap(descriptor, 8)  # MAP_SHARED: the worker writes here
            self.note(None)
        else:
            self.descriptor = None
            self._map = mmap.mmap(descriptor, 8)

    @classmethod
    def attach(cls, descriptor: int) -> ProgressBoard:
        """In a worker: the board the zygote made, by the descriptor it was handed."""
        return cls(descriptor)

    def let_go(self) -> None:
        """Close the memory file's descriptor (the mapping stays)."""
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None

    def note(self, index: int | None) -> None:
        self._map[:8] = struct.pack("<q", -1 if index is None else index)

    def read(self) -> int | None:
        (index,) = struct.unpack("<q", self._map[:8])
        return None if index < 0 else int(index)


BOARD: ProgressBoard | None = None  # made by the zygote for each worker, set in the worker


def note_progress(index: int | None) -> None:
    """In a worker: record the instruction that starts now (None: between programs)."""
    if BOARD is not None:
        BOARD.note(index)


def set_process_name(name: str) -> None:
    """The name ``ps`` and ``/proc/PID/comm`` show (15 bytes at most)."""
    _prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


__all__ = [
    "BOARD",
    "ProcessInfo",
    "ProgressBoard",
    "child_by_namespace_pid",
    "children",
    "descendants",
    "find_in_sandbox",
    "kill_all",
    "kill_below",
    "kill_descendants",
    "kill_group",
    "kill_processes",
    "namespace_pid",
    "namespace_pids",
    "note_progress",
    "orphans_from_workers",
    "process_table",
    "read_process",
    "set_child_subreaper",
    "set_parent_death_signal",
    "set_process_name",
]
