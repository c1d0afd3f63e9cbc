"""The zygote: imports the heavy modules once, then forks one fresh worker at a time.

``import torch`` costs seconds on a GPU host; ``os.fork()`` of a process that already imported it
costs milliseconds. The zygote never initialises CUDA, opens no zmq context and starts no threads,
so each forked worker begins clean and makes its own.

It talks to the broker's supervisor through its standard streams, one JSON object a line:
commands on stdin (``{"cmd": "kill", "worker": ID}``, ``{"cmd": "stop"}``), events on stdout
(``ready``, ``forked``, ``exited``). It is a child subreaper, so whatever a worker leaves behind
(double-forked or ``setsid`` daemons included) is re-parented to it and killed when the worker ends.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import resource
import selectors
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_SCAN_ROUNDS = 200
KILL_SCAN_PAUSE_SECONDS = 0.005
EXIT_WORKER_CRASHED = 70
FAST_EXIT_SECONDS = 1.0  # a worker that dies faster than this, repeatedly, slows the forking down
MAX_FORK_BACKOFF_SECONDS = 5.0

RLIMITS = {
    "address_space_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_size_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}


@dataclass
class ZygoteSettings:
    connect: str
    slot: int
    gpu: int | None
    workspace: Path
    max_programs: int = 1
    preload: tuple[str, ...] = ("numpy", "torch")
    limits: dict[str, int] = field(default_factory=dict)


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def emit(event: str, **fields: Any) -> None:
    os.write(1, (json.dumps({"event": event, **fields}) + "\n").encode())


def wipe(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
            except OSError:
                pass


def process_table() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, process group, session) of every visible process."""
    rows = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                raw = handle.read().decode(errors="replace")
        except OSError:
            continue
        # The command name is in parentheses and may itself hold spaces or parentheses.
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) < 4:
            continue
        rows.append((int(name), int(fields[1]), int(fields[2]), int(fields[3])))
    return rows


def kill_leftovers(worker_pid: int) -> int:
    """Kill every process of the worker's session or group, and every orphan re-parented to us."""
    me = os.getpid()
    killed = 0
    for _ in range(KILL_SCAN_ROUNDS):
        victims = [
            pid
            for pid, ppid, pgrp, session in process_table()
            if pid != me and (ppid == me or pgrp == worker_pid or session == worker_pid)
        ]
        reap_all()
        if not victims:
            return killed
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(KILL_SCAN_PAUSE_SECONDS)
        reap_all()
    return killed


def reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def apply_limits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        if value and name in RLIMITS:
            resource.setrlimit(RLIMITS[name], (value, value))


def become_worker(settings: ZygoteSettings, identity: str) -> None:
    """In the forked child: set the process up and run the worker loop; never returns."""
    code = EXIT_WORKER_CRASHED
    try:
        os.setsid()  # its own session and group: one killpg reaches what it starts
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)  # stray output before capture goes to the log, never into the event pipe
        if settings.gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(settings.gpu)
        apply_limits(settings.limits)
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
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class Zygote:
    """Forks workers for one slot, one at a time, and reports their exits."""

    def __init__(self, settings: ZygoteSettings) -> None:
        self.settings = settings
        self.generation = 0
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.pending_input = b""

    def serve(self) -> int:
        for name in self.settings.preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # torch is optional on CPU-only hosts
        importlib.import_module("kcoral.worker.worker")
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1)
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.selector.register(0, selectors.EVENT_READ, "commands")
        emit("ready", pid=os.getpid(), slot=self.settings.slot)
        fast_exits = 0
        while not self.stopping:
            wipe(self.settings.workspace)
            started = time.monotonic()
            self.run_one_worker()
            if time.monotonic() - started < FAST_EXIT_SECONDS:
                fast_exits += 1
                time.sleep(min(MAX_FORK_BACKOFF_SECONDS, 0.05 * 2 ** min(fast_exits, 8)) if fast_exits > 3 else 0)
            else:
                fast_exits = 0
        wipe(self.settings.workspace)
        return 0

    def run_one_worker(self) -> None:
        self.generation += 1
        identity = f"w{self.settings.slot}-{os.getpid()}-{self.generation}"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become_worker(self.settings, identity)
        emit("forked", worker=identity, pid=pid)
        status = self.wait_for(pid)
        killed = kill_leftovers(pid)
        returncode = os.waitstatus_to_exitcode(status) if status is not None else None
        emit(
            "exited",
            worker=identity,
            pid=pid,
            returncode=returncode if returncode is None or returncode >= 0 else None,
            signal=-returncode if returncode is not None and returncode < 0 else None,
            leftovers_killed=killed,
        )

    def wait_for(self, pid: int) -> int | None:
        pidfd = None
        try:
            pidfd = os.pidfd_open(pid)
            self.selector.register(pidfd, selectors.EVENT_READ, "worker")
        except (AttributeError, OSError):
            pidfd = None
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    return status
                for key, _ in self.selector.select(timeout=None if pidfd is not None else 0.01):
                    if key.data == "commands":
                        self.read_commands(pid)
        finally:
            if pidfd is not None:
                self.selector.unregister(pidfd)
                os.close(pidfd)

    def read_commands(self, pid: int) -> None:
        chunk = os.read(0, 65536)
        if not chunk:  # the broker is gone: stop, taking the worker with us
            self.stopping = True
            self.selector.unregister(0)
            _kill_group(pid)
            return
        self.pending_input += chunk
        while b"\n" in self.pending_input:
            line, self.pending_input = self.pending_input.split(b"\n", 1)
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if command.get("cmd") == "kill":
                _kill_group(pid)
            elif command.get("cmd") == "stop":
                self.stopping = True
                _kill_group(pid)


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kcoral-zygote")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--gpu", type=int, default=None)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--max-programs", type=int, default=1)
    parser.add_argument("--preload", default="numpy,torch")
    parser.add_argument("--limits", default="{}", help="JSON map of resource limits")
    args = parser.parse_args(argv)
    settings = ZygoteSettings(
        connect=args.connect,
        slot=args.slot,
        gpu=args.gpu,
        workspace=args.workspace,
        max_programs=args.max_programs,
        preload=tuple(p for p in args.preload.split(",") if p),
        limits={str(k): int(v) for k, v in json.loads(args.limits).items()},
    )
    return Zygote(settings).serve()


if __name__ == "__main__":
    sys.exit(main())
