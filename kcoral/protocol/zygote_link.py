"""The zygote link: the broker's supervisor and a slot's zygote, inside one host.

The broker starts each zygote with a command line (:class:`ZygoteSettings`, written by
:meth:`ZygoteSettings.to_argv` and read back by :meth:`ZygoteSettings.from_argv`), then speaks to
it over its standard streams, one JSON object a line: :class:`ZygoteCommand` on its stdin
(``{"cmd": ..., "worker": ...}``), :class:`ZygoteEvent` on its stdout (``{"event": ..., ...}``).
A worker's end comes as an ``exited`` event, read into a :class:`WorkerExit`.
``docs/protocol.md`` (section 12, "The zygote link") describes the same.

Example::

    argv = ZygoteSettings(connect="ipc:///run/w.sock", slot=0, workspace=Path("/workspace")).to_argv()
    assert ZygoteSettings.from_argv(argv) == ZygoteSettings(...)
    line = zygote_command_line(ZygoteCommand.RETIRE_WORKER, worker=worker_id("w0-1-ab12"))
"""

from __future__ import annotations

import argparse
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from kcoral.protocol.worker_link import WorkerId, worker_id, worker_name

# The zygote's entry point, run as ``python -m ZYGOTE_MODULE ARGV...``.
ZYGOTE_MODULE: Final = "kcoral.worker.zygote"
ZYGOTE_DEFAULT_PRELOAD: Final = ("numpy", "torch")


class ZygoteCommand(StrEnum):
    """Broker -> zygote, ``{"cmd": ...}``; those that take ``worker`` are for that worker alone (one no
    longer current is ignored: sent before it exited, the command must not reach its successor)."""

    # Kill the current worker and all it started (worker); "next": "lazy": the worker after it makes
    # no CUDA context ahead (for a program on other GPUs than the slot's).
    KILL_WORKER = "kill_worker"
    FORK_SPARE = "fork_spare"  # the worker has a program: fork its successor ahead, where it was lost
    # The broker has the worker's last result: kill it and all it started (``gpu_free`` where none of
    # them holds a GPU device) and fork its successor (worker); "gpu": whether the program took its
    # GPU lease (the slot makes its next spares' CUDA contexts ahead only while its programs do).
    RETIRE_WORKER = "retire_worker"
    STOP = "stop"  # kill every worker and exit


class ZygoteEvent(StrEnum):
    """Zygote -> broker, ``{"event": ..., ...}``."""

    READY = "ready"  # pid (inside its sandbox), slot, eager_cuda: the zygote serves
    # worker, pid: the slot's current worker; only it is given programs; memory_cgroup (only where
    # the slot has memory cgroups): whether this worker is in one of its own.
    FORKED = "forked"
    # worker: retired, and none of its processes holds a GPU device, or ("teardown": true, with
    # --gpu-handover quiet) none of them can run code any more, while its context is torn down.
    GPU_FREE = "gpu_free"
    SPARE_DISCARDED = "spare_discarded"  # worker: a spare changed while it waited; killed unannounced
    # worker: a spare that exited, or was killed over the memory limit, before it was announced
    # (killed by the program beside it, say): the broker asks for another with its next program.
    SPARE_GONE = "spare_gone"
    # worker, pid: a spare was forked ahead (unannounced: given nothing until ``forked`` names it);
    # it runs no program, so its CUDA context on the slot's GPU does no work that counts.
    SPARE = "spare"
    EXITED = "exited"  # the fields of WorkerExit: the worker and everything it started are dead
    ALIVE = "alive"  # once a second: the zygote still watches its slot
    # slot, reason: the zygote cannot serve with the broker's settings (no worker of it could start,
    # such as under a --memory-limit below what the preloaded libraries hold); it exits then.
    REFUSED = "refused"


def zygote_command_line(command: ZygoteCommand, worker: WorkerId | None = None, **fields: Any) -> bytes:
    """One command as the zygote reads it (``fields``: the command's own, such as ``next``)."""
    body = {"cmd": command.value, **({"worker": worker_name(worker)} if worker is not None else {}), **fields}
    return (json.dumps(body) + "\n").encode()


def zygote_event_line(event: ZygoteEvent, **fields: Any) -> bytes:
    """One event as the supervisor reads it."""
    return (json.dumps({"event": event.value, **fields}) + "\n").encode()


def read_command_lines(pending: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """The commands of the whole lines in ``pending`` (a line that is not a JSON object is
    skipped), and what is left after the last newline."""
    *lines, rest = pending.split(b"\n")
    commands = []
    for line in lines:
        try:
            command = json.loads(line)
        except ValueError:
            continue
        if isinstance(command, dict):
            commands.append(command)
    return commands, rest


def event_worker(event: Mapping[str, Any]) -> WorkerId:
    """The worker an event names (``forked``, ``gpu_free``, ``spare_discarded``, ``exited``)."""
    return worker_id(str(event.get("worker")))


@dataclass(frozen=True)
class ZygoteSettings:
    """What the broker tells a slot's zygote: its command line, as data."""

    connect: str  # the broker's worker endpoint
    slot: int
    workspace: Path  # as the zygote sees it (``/workspace`` in a sandbox)
    gpu: int | None = None
    max_programs: int = 1
    preload: tuple[str, ...] = ZYGOTE_DEFAULT_PRELOAD
    limits: dict[str, int] = field(default_factory=dict)  # per worker, by kcoral.worker.limits' names
    gpu_nodes: dict[int, str] | None = None  # sandboxed: GPU index -> node; workers confine to theirs
    sandboxed: bool = False  # in a sandbox of the slot's own (its IPC and user namespaces)
    # "eager": workers on a real GPU make their CUDA context as soon as forked; "lazy": the program.
    cuda_context: str = "lazy"
    # "exit": a worker with a CUDA context holds the GPU lease until it has exited; "quiet": until
    # none of its processes can run code (its context may still be torn down).
    gpu_handover: str = "exit"
    # A descriptor of the slot's directory in the broker's memory cgroup (kcoral.worker.memory_cgroup),
    # open in the zygote; None: no memory cgroups, the watchdog's samples alone.
    memory_cgroup_fd: int | None = None

    def to_argv(self) -> list[str]:
        argv = [
            "--connect",
            self.connect,
            "--slot",
            str(self.slot),
            "--workspace",
            str(self.workspace),
            "--max-programs",
            str(self.max_programs),
            "--preload",
            ",".join(self.preload),
            "--limits",
            json.dumps(self.limits),
        ]
        if self.gpu is not None:
            argv += ["--gpu", str(self.gpu)]
        if self.sandboxed:
            argv.append("--sandboxed")
        if self.gpu_nodes is not None:
            argv += ["--gpu-nodes", json.dumps({str(index): node for index, node in sorted(self.gpu_nodes.items())})]
        argv += ["--cuda-context", self.cuda_context, "--gpu-handover", self.gpu_handover]
        if self.memory_cgroup_fd is not None:
            argv += ["--memory-cgroup-fd", str(self.memory_cgroup_fd)]
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> ZygoteSettings:
        """The settings of ``to_argv``'s command line; argparse's usage error otherwise."""
        parser = argparse.ArgumentParser(prog="kcoral-zygote")
        parser.add_argument("--connect", required=True)
        parser.add_argument("--slot", type=int, required=True)
        parser.add_argument("--gpu", type=int, default=None)
        parser.add_argument("--workspace", type=Path, required=True)
        parser.add_argument("--max-programs", type=int, default=1)
        parser.add_argument("--preload", default=",".join(ZYGOTE_DEFAULT_PRELOAD))
        parser.add_argument("--limits", default="{}", help="JSON map of resource limits")
        parser.add_argument("--gpu-nodes", default=None, help="JSON map: GPU index -> device node (sandboxed)")
        parser.add_argument("--sandboxed", action="store_true", help="in a sandbox of the slot's own")
        parser.add_argument("--cuda-context", choices=("eager", "lazy"), default="lazy")
        parser.add_argument("--gpu-handover", choices=("exit", "quiet"), default="exit")
        parser.add_argument("--memory-cgroup-fd", type=int, default=None, help="the slot's memory cgroup, open")
        # Each flag's dest is the field's name: only the JSON and list values need reading.
        args = vars(parser.parse_args(argv))
        nodes = args["gpu_nodes"]
        return cls(
            **{
                **args,
                "preload": tuple(p for p in args["preload"].split(",") if p),
                "limits": {str(k): int(v) for k, v in json.loads(args["limits"]).items()},
                "gpu_nodes": None if nodes is None else {int(k): str(v) for k, v in json.loads(nodes).items()},
            }
        )


@dataclass(frozen=True)
class WorkerExit:
    """A worker's end, as its zygote reported it (``exited``) or as the supervisor saw its zygote die."""

    slot: int
    worker: WorkerId
    returncode: int | None
    signal: int | None
    leftovers_killed: int = 0
    zygote_died: bool = False
    reason: str = ""  # why the zygote killed it (a limit it broke), when it did
    instruction_index: int | None = None  # what it was executing, as the zygote saw it

    @classmethod
    def from_event(cls, slot: int, event: Mapping[str, Any]) -> WorkerExit:
        """The exit of an ``exited`` event's fields (a field of the wrong type reads as unknown)."""
        return cls(
            slot,
            event_worker(event),
            event.get("returncode"),
            event.get("signal"),
            int(event.get("leftovers_killed") or 0),
            reason=str(event.get("reason") or ""),
            instruction_index=event_int(event.get("instruction_index")),
        )

    def describe(self) -> str:
        if self.zygote_died:
            how = "its zygote died"
        elif self.signal is not None:
            how = f"killed by signal {self.signal} ({_signal_name(self.signal)})"
        else:
            how = f"exit code {self.returncode}"
        return f"{how}; {self.reason}" if self.reason else how


def worker_exit_fields(
    worker: str,
    pid: int,
    returncode: int | None,
    *,
    leftovers_killed: int,
    reason: str,
    instruction_index: int | None,
) -> dict[str, Any]:
    """An ``exited`` event's fields from ``os.waitstatus_to_exitcode``'s value (negative: a signal)."""
    return {
        "worker": worker,
        "pid": pid,
        "returncode": returncode if returncode is None or returncode >= 0 else None,
        "signal": -returncode if returncode is not None and returncode < 0 else None,
        "leftovers_killed": leftovers_killed,
        "reason": reason,
        "instruction_index": instruction_index,
    }


def event_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


__all__ = [
    "ZYGOTE_DEFAULT_PRELOAD",
    "ZYGOTE_MODULE",
    "WorkerExit",
    "ZygoteCommand",
    "ZygoteEvent",
    "ZygoteSettings",
    "event_int",
    "event_worker",
    "read_command_lines",
    "worker_exit_fields",
    "zygote_command_line",
    "zygote_event_line",
]
