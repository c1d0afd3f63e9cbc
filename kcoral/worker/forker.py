"""The slot's forker: a copy of the zygote that forks its workers and writes nothing in between.

A fork copies the forking process's page table entries and marks its pages copy-on-write; the
worker's exit tears its copies down again. The zygote's own work between two forks (reading
commands, reaping, wiping the workspace, its events) writes about 275 of its pages each time
(2-core VM, Python 3.12 with torch): every one is copied while the spare and the running worker
share it, and each write into a huge page splits that page's mapping into 512 small ones for
good. After a few hundred programs a zygote held 27,000 small entries where its collapse had
left about 13,000, and each fork copied them all (``benchmarks/RESULTS.md``, "The forker").

The zygote forks its forker once it has collapsed its memory into huge pages (after its first
few workers, see ``HUGE_PAGES_AFTER_FORKS`` in :mod:`kcoral.worker.zygote`). The forker collapses
again what the zygote's writes split meanwhile (those pieces are then its own copies, the rest
stays shared with the zygote), says it is ready, and from then on only reads a request, forks and
answers, so its huge pages stay whole and its few writes stay few. The zygote hands it, with
each request, the descriptors the worker needs (its go pipe, its progress board, its memory
cgroup); the forker passes them on and closes them.

A worker is still the zygote's own child: the forker makes it with ``clone(CLONE_PARENT)``, so the
zygote reaps it, reads its exit status, sees its end through a pidfd and is the parent its death
signal is tied to, exactly as with ``os.fork``. The clone is made as glibc's ``fork`` makes one
(the child's thread id written into its thread descriptor by the kernel, its robust futex list
registered again) and as CPython's ``os.fork`` surrounds one (``PyOS_BeforeFork`` and the
``PyOS_AfterFork_*`` handlers). glibc's own at-fork handlers, and those of the libraries, ran once
in the forker when the zygote forked it, and the forker starts no thread: every worker starts from
the state they left, as a fork of the forker would.

A program runs as the same user as the forker, so it can signal it. A forker that is gone or does
not answer within FORKER_ANSWER_SECONDS is killed, and the zygote forks its workers itself until
it starts another (see :meth:`kcoral.worker.zygote.Zygote.retire_forker`). Where the clone cannot
be made as glibc makes it (an architecture not listed below, a kernel without
``PR_GET_TID_ADDRESS``), there is no forker.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import platform
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from kcoral.worker import huge_pages, processes

FORKER_ANSWER_SECONDS = 1.0  # a fork takes milliseconds; a stopped or starved forker is given up (the
# zygote waits for the answer, its watchdog sampling meanwhile: a stopped forker costs the slot this once)
FORKER_READY_SECONDS = 60.0  # its collapse takes a second or less; one not ready by then is given up
REQUEST_BYTES = 4096
READY = b"ready"
MAX_DESCRIPTORS = 4

CLONE_PARENT = 0x00008000
CLONE_CHILD_CLEARTID = 0x00200000
CLONE_CHILD_SETTID = 0x01000000
PR_GET_TID_ADDRESS = 40


@dataclass(frozen=True)
class _Syscalls:
    clone: int
    set_robust_list: int
    get_robust_list: int
    tls_before_child_tid: bool  # the clone's argument order (x86-64: child_tid, then tls)


_SYSCALLS = {
    "x86_64": _Syscalls(56, 273, 274, tls_before_child_tid=False),
    "aarch64": _Syscalls(220, 99, 100, tls_before_child_tid=True),
}


@dataclass(frozen=True)
class ForkRequest:
    """What the forker's child needs besides the descriptors that come with it."""

    identity: str
    eager_cuda: bool
    descriptors: tuple[str, ...]  # the names of the descriptors, in the order they are sent

    def encode(self) -> bytes:
        return json.dumps({"identity": self.identity, "eager": self.eager_cuda, "fds": self.descriptors}).encode()

    @classmethod
    def decode(cls, data: bytes) -> ForkRequest:
        body = json.loads(data)
        return cls(str(body["identity"]), bool(body["eager"]), tuple(str(name) for name in body["fds"]))


WorkerStart = Callable[[ForkRequest, dict[str, int]], None]  # in the child: never returns


class ParentClone:
    """``clone(CLONE_PARENT)`` made as glibc's ``fork`` and CPython's ``os.fork`` make a child."""

    def __init__(self, syscalls: _Syscalls, tid_address: int, robust_head: int, robust_length: int) -> None:
        self.syscalls = syscalls
        self.tid_address = tid_address
        self.robust_head = robust_head
        self.robust_length = robust_length
        libc = ctypes.PyDLL(None, use_errno=True)  # the GIL stays held: the child goes on holding it
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        # The clone's arguments, made once: each fork of the forker's loop allocates (and so
        # writes) as little as it can (see _serve).
        flags = CLONE_PARENT | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | signal.SIGCHLD
        tid = ctypes.c_void_p(tid_address)
        null = ctypes.c_void_p(0)
        last = (null, tid) if syscalls.tls_before_child_tid else (tid, null)
        self._arguments = (ctypes.c_long(syscalls.clone), ctypes.c_ulong(flags), null, null, *last)

    @classmethod
    def of_this_process(cls) -> ParentClone | None:
        """For this thread, where it can be made as glibc makes a fork; None elsewhere."""
        syscalls = _SYSCALLS.get(platform.machine())
        if syscalls is None or not hasattr(ctypes, "pythonapi"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        tid_address = ctypes.c_void_p()
        head, length = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            if libc.prctl(PR_GET_TID_ADDRESS, ctypes.byref(tid_address), 0, 0, 0) != 0 or not tid_address.value:
                return None
            if libc.syscall(syscalls.get_robust_list, 0, ctypes.byref(head), ctypes.byref(length)) != 0:
                return None
        except AttributeError:
            return None
        return cls(syscalls, tid_address.value, head.value or 0, length.value)

    def clone(self) -> int:
        """The child's pid in the parent (the forker), 0 in the child; OSError where it failed."""
        ctypes.pythonapi.PyOS_BeforeFork()
        pid = self._syscall(*self._arguments)
        if pid == 0:
            if self.robust_head:
                self._syscall(
                    ctypes.c_long(self.syscalls.set_robust_list),
                    ctypes.c_void_p(self.robust_head),
                    ctypes.c_size_t(self.robust_length),
                )
            ctypes.pythonapi.PyOS_AfterFork_Child()
            return 0
        error = ctypes.get_errno()
        ctypes.pythonapi.PyOS_AfterFork_Parent()
        if pid < 0:
            raise OSError(error, os.strerror(error))
        return int(pid)


class Forker:
    """The zygote's side: its forker's pid and the socket it asks on."""

    def __init__(self, pid: int, link: socket.socket) -> None:
        self.pid = pid
        self.link = link
        self.ready = False  # it says so once its memory is collapsed (read_ready)
        self.started = time.monotonic()

    @classmethod
    def start(cls, start_worker: WorkerStart) -> Forker | None:
        """Fork the forker (from the zygote, once its memory is collapsed); None where there can be
        none (see :meth:`ParentClone.of_this_process`)."""
        zygote_pid = os.getpid()
        if ParentClone.of_this_process() is None:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                _serve(theirs, zygote_pid, start_worker)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    def read_ready(self) -> bool:
        """Its first word, once the link is readable: whether it is ready to fork."""
        try:
            self.ready = self.link.recv(64) == READY
        except OSError:
            self.ready = False
        return self.ready

    def fork(
        self,
        request: ForkRequest,
        descriptors: list[int],
        *,
        meanwhile: Callable[[], None] = lambda: None,
        every: float = FORKER_ANSWER_SECONDS,
    ) -> int | None:
        """The new worker's pid; None where the forker did not answer within FORKER_ANSWER_SECONDS
        (it is then killed: see :meth:`close`, and the module's docstring). ``meanwhile`` is
        called every ``every`` seconds while the answer is not in."""
        try:
            socket.send_fds(self.link, [request.encode()], descriptors)
            deadline = time.monotonic() + FORKER_ANSWER_SECONDS
            while True:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([self.link], [], [], max(0.0, min(left, every)))
                if ready or left <= 0:
                    break
                meanwhile()
            answer = self.link.recv(64) if ready else b""
            return int(answer) if answer.isdigit() else None
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """End the forker and reap it."""
        self.link.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _serve(link: socket.socket, zygote_pid: int, start_worker: WorkerStart) -> None:
    """The forker's loop: a request, a clone, its pid back; returns when the zygote is gone."""
    processes.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != zygote_pid:
        return
    processes.set_dumpable(False)  # as the zygote: no program may read or write its memory
    for number in (signal.SIGINT, signal.SIGTERM, *_handled_signals()):
        signal.signal(number, signal.SIG_IGN)  # the zygote's handlers are the zygote's
    # Nothing of the zygote's but what a worker gets anyway: its standard error. Not its command
    # pipe or its events (the broker sees the zygote's end by them), nor its other descriptors.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    kept = link.fileno()
    os.closerange(3, kept)
    os.closerange(kept + 1, os.sysconf("SC_OPEN_MAX"))
    clone = ParentClone.of_this_process()  # this thread's descriptor: the zygote's copy, here
    if clone is None:
        return
    # What the zygote's writes split since its own collapse, whole again before the first fork:
    # shared with the zygote where it was still whole, a copy of the forker's own where not.
    huge_pages.collapse_anonymous_memory()
    processes.set_process_name("kcoral-forker")  # by this name once ready (the zygote's before)
    try:
        link.send(READY)
    except OSError:
        return
    # Between two forks the loop writes into the memory it shares with the live workers, and each
    # write into a huge page splits that page's mapping for good (the module's docstring). So the
    # request is read into one buffer and decoded only in the child, and the parent allocates
    # only what the socket calls return: the same few pages each time.
    buffer = bytearray(REQUEST_BYTES)
    space = socket.CMSG_SPACE(MAX_DESCRIPTORS * array.array("i").itemsize)
    while True:
        try:
            size, ancillary, _, _ = link.recvmsg_into((buffer,), space)
        except OSError:
            return
        if not size:
            return
        descriptors = _descriptors(ancillary)
        try:
            pid = clone.clone()
        except OSError:
            pid = -1
        if pid == 0:
            _start_child(bytes(buffer[:size]), descriptors, start_worker)  # never returns
        for descriptor in descriptors:
            os.close(descriptor)
        try:
            link.send(str(pid).encode() if pid > 0 else b"failed")
        except OSError:
            return


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors passed in ``recvmsg``'s ancillary data (as ``socket.recv_fds`` reads them)."""
    found = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            found.frombytes(data[: len(data) - len(data) % found.itemsize])
    return found.tolist()


def _start_child(request: bytes, descriptors: list[int], start_worker: WorkerStart) -> None:
    """In the forker's child: its request decoded, the worker started; never returns."""
    try:
        decoded = ForkRequest.decode(request)
        named = dict(zip(decoded.descriptors, descriptors, strict=True))
    except (ValueError, KeyError, TypeError):
        os._exit(1)
    start_worker(decoded, named)
    os._exit(1)


def _handled_signals() -> list[signal.Signals]:
    """The signals this process has a Python handler for."""
    return [number for number in signal.Signals if callable(_handler_of(number))]


def _handler_of(number: signal.Signals) -> object:
    try:
        return signal.getsignal(number)
    except (OSError, ValueError):
        return None
