"""The zygote's children: how a forked child becomes a worker, and what the zygote keeps of each.

:func:`preload_for_workers` runs in the zygote before its first fork (what every worker would import,
imported once, its objects made immortal where the interpreter allows: :mod:`kcoral.worker.immortal`);
:func:`become_worker` runs in the child right after the fork: it closes every descriptor it
inherited but the read end of its go pipe, takes a session of its own, dies with the zygote,
resets signals, confines nothing yet (that comes with the program) and sets its limits and seeds,
then runs the worker loop. The go pipe is how the zygote announces it (:func:`let_go`): a spare
forked ahead of its turn says READY to the broker only then. :class:`SpareState` is what another
process of the same user could change in a spare and the spare could not undo; the zygote
compares it before it lets a spare serve.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import resource
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from kcoral.protocol.zygote_link import ZygoteSettings
from kcoral.timing.trust import arm_in_zygote
from kcoral.worker import confinement, immortal, limits, memory_cgroup, processes
from kcoral.worker.memory_cgroup import WorkerCgroup
from kcoral.worker.rehearsal import rehearse
from kcoral.worker.state import reseed_generators

EXIT_WORKER_CRASHED = 70
PARENT_DEATH_SIGNAL = signal.SIGUSR2
NVIDIA_CONTROL_DEVICE = Path("/dev/nvidiactl")
FIRST_INHERITED_FD = 3  # descriptors from here on were inherited, not chosen: closed


# Imported by the zygote so that no worker pays for them (see preload_for_workers).
TIMER_MODULES = ("cupti.cupti", "pynvml")
ZYGOTE_REHEARSALS = 8  # walks of a program's path in the zygote before its first fork


def preload_for_workers(preload: tuple[str, ...]) -> None:
    """In the zygote, before the first fork: import what every worker would import (``preload``,
    the worker, the timer's modules), arm the timer once and freeze the collector's view, so that
    each worker starts with these pages shared and paid for."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # torch is optional on CPU-only hosts
    worker = importlib.import_module("kcoral.worker.worker")
    if "numpy" in sys.modules:
        # numpy loads numpy.random on first use; every worker reseeds it (and many programs
        # use it), and importing it after the fork costs each worker about 10 ms.
        importlib.import_module("numpy.random")
    # What the timer arms with in every GPU worker before its program (kcoral.timing.trust):
    # importing cupti-python after the fork cost each worker 54 to 77 ms on the H200, which
    # held fresh workers to 15 a second. Importing loads the libraries and initialises no
    # CUDA. Either may be missing (no gpu extra): the worker then reports why, as before.
    for name in TIMER_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # ImportError, or a missing libcupti raised inside the import
            continue
    arm_in_zygote()  # once, for every worker (see kcoral.timing.trust.arm_in_zygote)
    # The spare's rehearsal (kcoral.worker.rehearsal), walked here first: the instructions the
    # interpreter specialises on a program's path and the caches the path fills are then the
    # zygote's, shared by every worker, which copies fewer pages on its own walk. ZYGOTE_REHEARSALS
    # times: CPython 3.11 quickens a function at its eighth call, 3.12 specialises an instruction
    # at its second run.
    for _ in range(ZYGOTE_REHEARSALS):
        rehearse(worker.program_claims)
    # Move everything imported so far out of the collector's sight: a worker's garbage
    # collections then leave these pages alone, and they stay shared with the zygote. Made
    # immortal first (where the interpreter has immortal objects), a worker's references to
    # them no longer write to those pages either (kcoral.worker.immortal).
    gc.collect()
    immortal.immortalize()
    gc.freeze()


@dataclass
class Child:
    """A worker the zygote forked, and the descriptor its exit is seen through."""

    pid: int
    identity: str
    pidfd: int | None  # readable when it has ended
    started: float
    board: processes.ProgressBoard  # its own: another worker's program cannot write it
    kill_reason: str = ""  # why we killed it, when we did
    kill_requested: bool = False  # the broker asked for the kill
    done_at: float | None = None  # when the broker said it had its last result: now it only exits
    # The write end of its go pipe, until the zygote announces it: only then does it say READY.
    go: int | None = None
    eager: bool = False  # it makes its CUDA context as soon as it is forked, before READY
    # Killed holding a GPU device: the zygote watches for the moment none of its processes can run
    # code any more (see Zygote.check_quiet), when the lease may go back before the exit is through.
    quiet_watch: bool = False
    # Its memory cgroup (kcoral.worker.memory_cgroup), where the slot has them.
    cgroup: WorkerCgroup | None = None


def let_go(child: Child) -> None:
    """Announce ``child`` to itself: it says READY to the broker now."""
    if child.go is not None:
        with contextlib.suppress(OSError):  # it died meanwhile: its exit is reported as any other
            os.write(child.go, b"g")
    close_go(child)


def close_go(child: Child) -> None:
    if child.go is not None:
        os.close(child.go)
        child.go = None


def close_inherited_descriptors(keep: int | None = None) -> None:
    """Close every descriptor above the standard streams (but ``keep``, moved to the first of them).

    In the zygote: what its starter left open by mistake (the broker's event loop hands each
    child copies of its pipe ends). In a new worker: the zygote's epoll set, pidfds and any copy
    of its event and command pipes, none of which a program may touch (a program that could add a
    descriptor to the zygote's epoll set, or write an event line, would blind or fool it).
    """
    first = FIRST_INHERITED_FD
    if keep == FIRST_INHERITED_FD:
        os.set_inheritable(keep, False)  # already there (dup2 onto itself would fail)
        first += 1
    elif keep is not None:
        os.dup2(keep, FIRST_INHERITED_FD, inheritable=False)
        first += 1
    os.closerange(first, os.sysconf("SC_OPEN_MAX"))


def become_worker(
    settings: ZygoteSettings,
    identity: str,
    zygote_pid: int,
    board: processes.ProgressBoard,
    go: int,
    *,
    eager_cuda: bool = False,
    cgroup_directory: int | None = None,
) -> None:
    """In the forked child: set the process up and run the worker loop; never returns.

    ``go`` is the read end of the pipe on which the zygote announces it (see Zygote); the worker
    closes it before any program runs. ``eager_cuda``: make the CUDA context of the slot's GPU at
    once, while it waits for its turn, so that its program does not wait for the context.
    ``cgroup_directory``: the directory descriptor of the memory cgroup it joins first of all
    (the zygote checks before its go)."""
    code = EXIT_WORKER_CRASHED
    try:
        processes.set_process_name("kcoral-worker")  # first: the join below can take milliseconds
        if cgroup_directory is not None:
            with contextlib.suppress(OSError):  # the zygote's check joins it, or says it has none
                memory_cgroup.join_directory(cgroup_directory, os.getpid())
        close_inherited_descriptors(keep=go)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # not the zygote's command pipe
        os.close(devnull)
        os.dup2(2, 1)  # not the zygote's event pipe: stray output before capture goes to the log
        processes.BOARD = board
        # Not dumpable, like the zygote, until it gets a program (see run_worker): a spare forked
        # while the previous program still runs can be neither read nor written by that program.
        os.setsid()  # its own session and group: one killpg reaches what it starts
        processes.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != zygote_pid:  # the zygote died before the line above took effect
            os._exit(code)
        processes.set_child_subreaper()  # a program's orphans come back to the worker, to be found
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, PARENT_DEATH_SIGNAL):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python program
        # SIGXFSZ stays ignored, as Python sets it: a write past the file size limit then fails
        # with EFBIG, which the program's result reports, instead of killing the worker.
        confinement.configure(settings.gpu_nodes)
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices are then the broker's
        if settings.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(settings.gpu)
        # Fresh seeds: a forked worker would otherwise draw the same "random" numbers as every
        # other worker of its slot, all having inherited the zygote's generator states.
        reseed_generators()
        limits.apply_rlimits(settings.limits)
        from kcoral.worker.worker import WorkerSettings, run_worker

        code = run_worker(
            WorkerSettings(
                connect=settings.connect,
                identity=identity,
                slot=settings.slot,
                gpu=settings.gpu,
                workspace=settings.workspace,
                max_programs=settings.max_programs,
                go_fd=FIRST_INHERITED_FD,
                eager_cuda=eager_cuda and settings.gpu is not None,
            )
        )
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


@dataclass(frozen=True)
class SpareState:
    """What another process of the same user can change in a worker and the worker cannot undo."""

    priority: int
    policy: int
    cpus: frozenset[int]
    rlimits: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, pid: int) -> SpareState | None:
        try:
            return cls(
                os.getpriority(os.PRIO_PROCESS, pid),
                os.sched_getscheduler(pid),
                frozenset(os.sched_getaffinity(pid)),
                tuple(resource.prlimit(pid, which) for which in limits.RLIMITS.values()),
            )
        except OSError:
            return None

    @classmethod
    def of_this_process(cls, bounds: dict[str, int]) -> SpareState:
        """What a new worker has: this process's scheduling, the rlimits apply_rlimits sets."""
        return cls(
            os.getpriority(os.PRIO_PROCESS, 0),
            os.sched_getscheduler(0),
            frozenset(os.sched_getaffinity(0)),
            tuple(limits.rlimit_values(bounds).values()),
        )


def fit_to_serve(spare: Child, expected: SpareState) -> bool:
    """Whether the spare is as forked: the program that ran beside it (the same user) could have
    stopped it, or changed its priority, scheduling, CPUs or limits, none of which it could undo.
    It could not read or write it (a worker is not dumpable until it has a program)."""
    try:
        os.kill(spare.pid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    info = processes.read_process(spare.pid)
    return info is not None and info.state not in "TtZX" and SpareState.of(spare.pid) == expected


def eager_cuda_possible(gpu: int | None) -> bool:
    """Whether a worker of this slot can make its CUDA context while idle: only on a real GPU
    (the broker asks for it on slots with one; a worker with a context can run programs on its
    own GPU alone, see ``kcoral.worker.state.cuda_view_mismatch``)."""
    return gpu is not None and NVIDIA_CONTROL_DEVICE.exists()
