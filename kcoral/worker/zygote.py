"""The zygote: imports the heavy modules once, then forks one fresh worker at a time.

``import torch`` costs seconds on a GPU host; ``os.fork()`` of a process that already imported it
costs milliseconds. The zygote never initialises CUDA, opens no zmq context and starts no threads,
so each forked worker begins clean and makes its own.

It talks to the broker's supervisor through its standard streams, one JSON object a line:
commands on stdin (``{"cmd": "kill"}``: kill the current worker and all it started;
``{"cmd": "stop"}``), events on stdout (``ready``, ``forked``, ``exited``). An ``exited`` event
carries the worker's ``returncode`` or ``signal``, ``leftovers_killed`` (processes still alive when
it ended), ``reason`` (why the zygote killed it: a broken limit, say) and ``instruction_index``
(the instruction it was executing, read from a page shared with it: a worker that dies at once
takes its unsent progress messages with it).

A worker that has sent its last result says so through a pipe and the zygote forks the
replacement while the old one is still exiting (the exit of a process with a CUDA context takes a
hundred milliseconds or more): the slot's next worker is READY sooner.

Nothing a worker starts outlives it: the zygote is a child subreaper, so whatever a worker leaves
behind (``setsid`` children, double-forked daemons) is re-parented to the zygote, found by a walk
of its descendants and killed, before the next worker is forked. While a worker runs, a watchdog
samples its whole process tree and kills it when the tree passes the process or memory limit
(see :mod:`kcoral.worker.processes` for why those two are not rlimits alone).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcoral.worker import confinement, processes
from kcoral.worker.state import reseed_generators

EXIT_WORKER_CRASHED = 70
FAST_EXIT_SECONDS = 1.0
CRASH_LOOP_AFTER = 3  # this many fast, unexplained deaths in a row slow the forking down
CRASH_BACKOFF_FIRST_SECONDS = 0.1
MAX_FORK_BACKOFF_SECONDS = 5.0
RETIRE_GRACE_SECONDS = 5.0  # a worker that said it was done has this long to exit
KILL_WALK_MOST = 4096  # processes looked at in one kill pass; later passes find the rest
WATCH_INTERVAL_SECONDS = 0.05  # how often the watchdog samples a worker's tree
EAGER_CUDA_ENV = "KCORAL_EAGER_CUDA"
NVIDIA_CONTROL_DEVICE = Path("/dev/nvidiactl")
PARENT_DEATH_SIGNAL = signal.SIGUSR2


@dataclass
class ZygoteSettings:
    connect: str
    slot: int
    gpu: int | None
    workspace: Path
    max_programs: int = 1
    preload: tuple[str, ...] = ("numpy", "torch")
    limits: dict[str, int] = field(default_factory=dict)
    eager_cuda: bool = False  # workers create their CUDA context before READY (real GPUs only)
    gpu_nodes: dict[int, str] | None = None  # sandboxed: GPU index -> node; workers confine to theirs

    @property
    def watched(self) -> bool:
        return bool(self.limits.get("processes") or self.limits.get("memory_bytes"))


def emit(event: str, **fields: Any) -> None:
    os.write(1, (json.dumps({"event": event, **fields}) + "\n").encode())


def wipe(directory: Path) -> None:
    """Empty the slot's workspace, including directories a program made unreadable (mode 0),
    which a plain rmtree would leave behind for the next program to open again."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
        else:
            try:
                entry.unlink()
            except OSError:
                pass


def remove_tree(path: Path) -> None:
    """rmtree that first makes every directory of the tree accessible again (top down)."""
    pending = [path]
    while pending:
        current = pending.pop()
        try:
            os.chmod(current, stat.S_IRWXU)
            with os.scandir(current) as entries:
                pending.extend(
                    Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)
                )
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


def become_worker(settings: ZygoteSettings, identity: str, zygote_pid: int, done_fd: int) -> None:
    """In the forked child: set the process up and run the worker loop; never returns.

    When the loop ends normally (its last result sent), the worker writes a byte to ``done_fd``
    before it exits: the zygote forks the replacement at once instead of waiting for the exit,
    which takes a while for a process with a CUDA context.
    """
    code = EXIT_WORKER_CRASHED
    try:
        # The zygote is not dumpable (see serve); its worker must be, so that the zygote's
        # watchdog can read the worker's memory use in /proc.
        processes.set_dumpable(True)
        os.setsid()  # its own session and group: one killpg reaches what it starts
        processes.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != zygote_pid:  # the zygote died before the line above took effect
            os._exit(code)
        processes.set_process_name("kcoral-worker")
        processes.set_child_subreaper()  # a program's orphans come back to the worker, to be found
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, PARENT_DEATH_SIGNAL):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python program
        # SIGXFSZ stays ignored, as Python sets it: a write past the file size limit then fails
        # with EFBIG, which the program's result reports, instead of killing the worker.
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)  # stray output before capture goes to the log, never into the event pipe
        confinement.configure(settings.gpu_nodes)
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices are then the broker's
        if settings.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(settings.gpu)
        if settings.eager_cuda:
            os.environ[EAGER_CUDA_ENV] = "1"
        else:
            os.environ.pop(EAGER_CUDA_ENV, None)
        # Fresh seeds: a forked worker would otherwise draw the same "random" numbers as every
        # other worker of its slot, all having inherited the zygote's generator states.
        reseed_generators()
        processes.apply_rlimits(settings.limits)
        from kcoral.worker.worker import WorkerSettings, run_worker

        code = run_worker(
            WorkerSettings(
                connect=settings.connect,
                identity=identity,
                slot=settings.slot,
                gpu=settings.gpu,
                workspace=settings.workspace,
                max_programs=settings.max_programs,
            )
        )
        if code == 0:
            os.write(done_fd, b"\x01")
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


@dataclass
class Child:
    """A worker the zygote forked, and the descriptors it is watched through."""

    pid: int
    identity: str
    pidfd: int | None  # readable when it has ended
    done_fd: int | None  # readable when it has sent its last result (or ended)
    started: float
    kill_reason: str = ""  # why we killed it, when we did
    kill_requested: bool = False  # the broker asked for the kill
    retired_at: float | None = None  # when it said it was done: now it is only exiting


class Zygote:
    """Forks workers for one slot, one at a time, and reports their exits.

    One worker of the slot at a time serves: the ``current`` one. A worker that has sent its last
    result becomes ``retiring`` while it exits, and its replacement is forked meanwhile; a retiring
    worker that does not exit within RETIRE_GRACE_SECONDS is killed.
    """

    def __init__(self, settings: ZygoteSettings) -> None:
        self.settings = settings
        self.generation = 0
        self.stopping = False
        self.current: Child | None = None
        self.retiring: dict[int, Child] = {}
        self.selector = selectors.DefaultSelector()
        self.pending_input = b""
        self.crashes = 0
        self.next_watch = 0.0

    def serve(self) -> int:
        for name in self.settings.preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # torch is optional on CPU-only hosts
        importlib.import_module("kcoral.worker.worker")
        if "numpy" in sys.modules:
            # numpy loads numpy.random on first use; every worker reseeds it (and many programs
            # use it), and importing it after the fork costs each worker about 10 ms.
            importlib.import_module("numpy.random")
        # Move everything imported so far out of the collector's sight: a worker's garbage
        # collections then leave these pages alone, and they stay shared with the zygote.
        gc.collect()
        gc.freeze()
        processes.set_process_name("kcoral-zygote")
        # Workers run as the same user: without this one of them could write the zygote's memory
        # through /proc/<zygote>/mem and so take over every later worker of the slot.
        processes.set_dumpable(False)
        processes.BOARD = processes.ProgressBoard()
        processes.set_child_subreaper()
        # Not SIGKILL when the broker dies: we first take the worker's tree with us. Not SIGTERM
        # either: that one (and SIGINT, from a terminal) also reaches the whole process group when
        # a service manager stops the broker, and the broker, draining, still needs its workers.
        # The broker stops us through our stdin.
        processes.set_parent_death_signal(PARENT_DEATH_SIGNAL)
        signal.signal(PARENT_DEATH_SIGNAL, self._on_broker_death)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.selector.register(0, selectors.EVENT_READ, "commands")
        emit("ready", pid=os.getpid(), slot=self.settings.slot, eager_cuda=self.settings.eager_cuda)
        while not self.stopping:
            if self.current is None:
                if self.crashes > CRASH_LOOP_AFTER:
                    time.sleep(
                        min(
                            MAX_FORK_BACKOFF_SECONDS,
                            CRASH_BACKOFF_FIRST_SECONDS * 2 ** (self.crashes - CRASH_LOOP_AFTER),
                        )
                    )
                wipe(self.settings.workspace)
                self.fork_worker()
            self.wait_for_event()
        for child in self.children():
            self.kill(child, "")
        while self.current is not None or self.retiring:
            self.wait_for_event()
        wipe(self.settings.workspace)
        return 0

    def children(self) -> list[Child]:
        return ([self.current] if self.current is not None else []) + list(self.retiring.values())

    def fork_worker(self) -> None:
        self.generation += 1
        # Unguessable and never reused: inside a sandbox every zygote is pid 2, and the broker only
        # takes work-carrying READYs from the identity this zygote reports as forked.
        identity = f"w{self.settings.slot}-{self.generation}-{secrets.token_hex(8)}"
        done_read, done_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(done_read)
            become_worker(self.settings, identity, zygote_pid, done_write)
        os.close(done_write)
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None  # old kernels: wait_for_event polls instead
        child = Child(pid, identity, pidfd, done_read, time.monotonic())
        if pidfd is not None:
            self.selector.register(pidfd, selectors.EVENT_READ, ("exit", child))
        self.selector.register(done_read, selectors.EVENT_READ, ("done", child))
        if processes.BOARD is not None:
            processes.BOARD.note(None)
        self.current = child
        emit("forked", worker=identity, pid=pid)

    def wait_for_event(self) -> None:
        """Handle what happens next: a command, a worker done or ended, a watchdog sample."""
        children = self.children()
        polled = any(c.pidfd is None for c in children) or self.retiring
        timeout = WATCH_INTERVAL_SECONDS if (self.settings.watched and children) or polled else None
        for key, _ in self.selector.select(timeout=timeout):
            if key.data == "commands":
                self.read_commands()
                continue
            what, child = key.data
            if what == "done":
                self.on_done(child)
            else:
                self.on_exit(child)
        now = time.monotonic()
        for child in self.children():
            if child.pidfd is None:
                self.on_exit(child)
            elif child.retired_at is not None and now - child.retired_at > RETIRE_GRACE_SECONDS:
                self.kill(child, "it did not exit after its last result")
        if self.settings.watched and now >= self.next_watch:
            self.next_watch = now + WATCH_INTERVAL_SECONDS
            self.watch()

    def on_done(self, child: Child) -> None:
        if child.done_fd is None:  # closed by on_exit in the same round of events
            return
        try:
            said = os.read(child.done_fd, 1)
        except OSError:
            said = b""
        self.selector.unregister(child.done_fd)
        os.close(child.done_fd)
        child.done_fd = None
        if said and child is self.current:  # an empty read is an exit: on_exit reports it
            self.current = None
            child.retired_at = time.monotonic()
            self.retiring[child.pid] = child
            self.crashes = 0
            # A process that a thread of the program started after the worker's last look must not
            # live on beside the next worker (through /proc/PID/root it would see that one's GPUs).
            found = processes.descendants(child.pid, KILL_WALK_MOST)
            tree = [info for info in map(processes.read_process, found) if info is not None]
            if tree:
                child.kill_reason = "its program left processes running after its result"
                processes.kill_processes(tree)

    def on_exit(self, child: Child) -> None:
        if child is not self.current and child.pid not in self.retiring:
            return  # reported already, in the same round of events
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = child.pid, None
        if pid == 0:
            return  # not yet
        for fd in (child.pidfd, child.done_fd):
            if fd is not None:
                self.selector.unregister(fd)
                os.close(fd)
        child.pidfd = child.done_fd = None
        serving = child is self.current
        if serving:
            self.current = None
        self.retiring.pop(child.pid, None)
        # What it left behind came to us (we are the subreaper): kill it, sparing the others.
        leftovers = processes.kill_descendants(os.getpid(), spare={c.pid for c in self.children()})
        returncode = os.waitstatus_to_exitcode(status) if status is not None else None
        emit(
            "exited",
            worker=child.identity,
            pid=child.pid,
            returncode=returncode if returncode is None or returncode >= 0 else None,
            signal=-returncode if returncode is not None and returncode < 0 else None,
            leftovers_killed=len(leftovers),
            reason=child.kill_reason,
            instruction_index=processes.BOARD.read() if serving and processes.BOARD is not None else None,
        )
        if serving:
            # Only workers that die fast, unasked and unexplained (a broken install, a crash at
            # start-up) count: programs end workers all the time, and that must not slow us.
            crashed = (
                returncode not in (None, 0)
                and not child.kill_requested
                and not child.kill_reason
                and time.monotonic() - child.started < FAST_EXIT_SECONDS
            )
            self.crashes = self.crashes + 1 if crashed else 0

    def watch(self) -> None:
        """One watchdog sample of each worker's tree: kill a tree that breaks a limit."""
        most = self.settings.limits.get("processes") or None
        for child in self.children():
            if child.kill_reason:
                continue
            tree = [child.pid, *processes.descendants(child.pid, most)]
            breach = processes.limit_breach(tree, self.settings.limits)
            if breach is not None:
                self.kill(child, f"the zygote killed it: {breach}")

    def kill(self, child: Child, reason: str) -> None:
        """Kill a worker and everything it started; on_exit reaps it and reports."""
        if not child.kill_reason:
            child.kill_reason = reason
        _kill_group(child.pid)
        # The group kill got the bulk; this bounded walk gets those in other groups, and
        # kill_descendants in on_exit whatever is left once the worker is gone.
        tree = processes.descendants(child.pid, KILL_WALK_MOST)
        processes.kill_processes(info for info in map(processes.read_process, tree) if info is not None)

    def read_commands(self) -> None:
        chunk = os.read(0, 65536)
        if not chunk:  # the broker is gone: stop, taking the workers with us
            self.selector.unregister(0)
            self.stop("the broker went away")
            return
        self.pending_input += chunk
        while b"\n" in self.pending_input:
            line, self.pending_input = self.pending_input.split(b"\n", 1)
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if command.get("cmd") == "kill" and self.current is not None:
                self.current.kill_requested = True
                self.kill(self.current, "")
            elif command.get("cmd") == "stop":
                self.stop("")

    def stop(self, reason: str) -> None:
        self.stopping = True
        for child in self.children():
            child.kill_requested = True
            self.kill(child, reason)

    def _on_broker_death(self, signum: int, frame: Any) -> None:
        self.stop("the broker went away")


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def eager_cuda_wanted(gpu: int | None, environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this slot's workers should create their CUDA context while idle.

    Only for a slot with a real GPU, and only when ``KCORAL_EAGER_CUDA=1`` is in the zygote's
    environment: a worker with a context can run programs on its own GPU alone (see
    ``kcoral.worker.worker``), so hosts that serve programs on several GPUs leave it off.
    """
    return gpu is not None and environ.get(EAGER_CUDA_ENV) == "1" and NVIDIA_CONTROL_DEVICE.exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kcoral-zygote")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--gpu", type=int, default=None)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--max-programs", type=int, default=1)
    parser.add_argument("--preload", default="numpy,torch")
    parser.add_argument("--limits", default="{}", help="JSON map of resource limits")
    parser.add_argument("--gpu-nodes", default=None, help="JSON map: GPU index -> device node (sandboxed)")
    args = parser.parse_args(argv)
    limits = {str(k): int(v) for k, v in json.loads(args.limits).items()}
    if "address_space_bytes" in limits:  # the name older brokers send
        limits.setdefault("memory_bytes", limits.pop("address_space_bytes"))
    settings = ZygoteSettings(
        connect=args.connect,
        slot=args.slot,
        gpu=args.gpu,
        workspace=args.workspace,
        max_programs=args.max_programs,
        preload=tuple(p for p in args.preload.split(",") if p),
        limits=limits,
        eager_cuda=eager_cuda_wanted(args.gpu, os.environ),
        gpu_nodes=None if args.gpu_nodes is None else {int(k): str(v) for k, v in json.loads(args.gpu_nodes).items()},
    )
    return Zygote(settings).serve()


if __name__ == "__main__":
    sys.exit(main())
