"""The supervisor: starts one zygote per worker slot, relays its events, restarts it when it dies.

The broker learns of a worker's death from here (the zygote reports each child's exit status at
once), not from a missed heartbeat. The zygote is the trusted side of its slot, but a program can
still stop or kill it (they run as the same user): the supervisor, the broker's own code, is the
backstop. A zygote that goes silent (it says ``alive`` every second) or that does not report a
worker's exit soon after being told to kill it is killed with its whole sandbox, and whatever its
workers left is killed before the broker hears that they exited. Each zygote runs in a session of
its own, so no program can signal the broker's process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import structlog

from kcoral.protocol.worker_link import WorkerId, worker_name
from kcoral.protocol.zygote_link import (
    WorkerExit,
    ZygoteCommand,
    ZygoteEvent,
    event_int,
    event_worker,
    zygote_command_line,
)
from kcoral.service.tasks import cancel_and_wait
from kcoral.worker import processes

log = structlog.get_logger("kcoral.supervisor")

RESTART_BACKOFF_FIRST_SECONDS = 0.2
RESTART_BACKOFF_MAX_SECONDS = 10.0
HEALTHY_AFTER_SECONDS = 30.0  # a zygote alive this long resets its back-off
STOP_GRACE_SECONDS = 5.0
MAX_EVENT_LINE_BYTES = 1 << 16
ORPHAN_COLLECT_SECONDS = 2.0
ORPHAN_POLL_SECONDS = 0.02
# A zygote says "alive" every second; one silent this long is stopped or stuck (a program can send
# it SIGSTOP), and its slot unwatched. Generous, since a loaded 2-core host can starve it for a while.
ZYGOTE_SILENCE_SECONDS = 10.0
# A worker the zygote was told to kill must be reported exited within this time, or the zygote goes.
KILL_GRACE_SECONDS = 5.0
LIVENESS_CHECK_SECONDS = 1.0
# A zygote never stops itself: one found stopped (SIGSTOP from a program, or a tracer) at this many
# checks in a row is frozen, and so is its watchdog. Killed then, long before ZYGOTE_SILENCE_SECONDS
# (measured: a program that froze its zygote ran 11 s unwatched before the silence rule caught it).
STOPPED_CHECKS = 2


@dataclass(frozen=True)
class SlotSpec:
    """One worker slot: its GPU (or None), private workspace and zygote command."""

    slot: int
    gpu: int | None
    workspace: Path
    argv: tuple[str, ...]  # full command, sandbox prefix included
    env: dict[str, str] | None = None
    pass_fds: tuple[int, ...] = ()  # descriptors the zygote inherits (its slot's memory cgroup)


class SlotPhase(StrEnum):
    """Where a slot's zygote is: starting (until it says ready), running, restarting (after it
    died, waiting out the back-off), stopped."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass
class SlotState:
    spec: SlotSpec
    process: asyncio.subprocess.Process | None = None
    zygote_pid: int | None = None
    zygote_host_pid: int | None = None  # the zygote itself (zygote_pid is the bwrap around it, if any)
    stopped_checks: int = 0  # liveness checks in a row that found the zygote stopped
    worker: WorkerId | None = None
    worker_pid: int | None = None
    spare: WorkerId | None = None  # the spare forked ahead (event ``spare``), until announced or discarded
    spare_pid: int | None = None
    # The zygote said its spare was gone (``spare_gone``) and has named none since: the slot's next
    # program asks for one (a zygote forks one ahead as it announces each worker on its own).
    spare_lost: bool = False
    spare_waiters: list[asyncio.Event] = field(default_factory=list)  # spare_named's, set at ``spare``
    # (zygote's host pid, pid in its namespace) -> host pid, for the current worker and spare only:
    # every GRANT names them, and finding one reads /proc for each of the zygote's children.
    host_pids: dict[tuple[int, int], int] = field(default_factory=dict)
    restarts: int = 0
    state: SlotPhase = SlotPhase.STARTING
    last_error: str = ""
    started_at: float = 0.0
    last_heard: float = 0.0  # monotonic time of the zygote's last event
    kill_asked: tuple[WorkerId, float] | None = None  # the worker we asked the zygote to kill, and when
    killed_for: str = ""  # why the supervisor killed the running zygote, when it did
    refused: str = ""  # why the zygote said it cannot serve (ZygoteEvent.REFUSED): not restarted


def _host_pid(state: SlotState, inside: int | None) -> int | None:
    """The host pid of the zygote's child that has pid ``inside`` in the zygote's namespace: found
    once while that child is the slot's current worker or spare (a pid is not reused while its
    process lives, and one that ended is dropped at the next look-up that finds another)."""
    zygote = state.zygote_host_pid
    if zygote is None or inside is None:
        return None
    key = (zygote, inside)
    found = state.host_pids.get(key)
    if found is None:
        found = processes.child_by_namespace_pid(zygote, inside)
        if found is None:
            return None
        current = {(zygote, pid) for pid in (state.worker_pid, state.spare_pid) if pid is not None}
        state.host_pids = {k: v for k, v in state.host_pids.items() if k in current}
        state.host_pids[key] = found
    return found


@dataclass
class Supervisor:
    """Runs the zygotes; ``on_exit`` hears of every worker that ended."""

    slots: list[SlotSpec]
    on_exit: Callable[[WorkerExit], None]
    on_fork: Callable[[int, WorkerId], None] = lambda slot, worker: None
    # A finished worker's processes are dead or hold no GPU device: its GPU lease may go back.
    on_gpu_free: Callable[[WorkerId], None] = lambda worker: None
    # A zygote said it cannot serve with these settings (ZygoteEvent.REFUSED): slot, reason. It is
    # not restarted; the broker stops.
    on_refused: Callable[[int, str], None] = lambda slot, reason: None
    states: dict[int, SlotState] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False

    async def start(self) -> None:
        # When a zygote dies, its workers and whatever they started come to us rather than to init
        # (which, on some hosts, never reaps them): _collect_orphans then kills and reaps them.
        processes.set_child_subreaper()
        for spec in self.slots:
            self.states[spec.slot] = SlotState(spec)
            self._tasks.append(asyncio.create_task(self._keep_running(spec.slot)))
        self._tasks.append(asyncio.create_task(self._check_liveness()))

    def kill_worker(self, slot: int, worker: WorkerId | None = None, *, lazy_next: bool = False) -> None:
        """Kill the slot's current worker and everything it started; only ``worker``, where named:
        one that has exited meanwhile has a successor, which the command must not reach.
        ``lazy_next``: the worker after it makes no CUDA context ahead (a program on other GPUs
        than the slot's waits for it)."""
        state = self.states.get(slot)
        target = worker if worker is not None else state.worker if state is not None else None
        if state is not None and target is not None and target == state.worker and state.kill_asked is None:
            state.kill_asked = (target, time.monotonic())
        self._command(slot, ZygoteCommand.KILL_WORKER, worker, **({"next": "lazy"} if lazy_next else {}))

    def program_started(self, slot: int) -> None:
        """The slot's worker has a program: where the zygote said its spare was gone, ask for another
        now, off the path from that program's end to the GPU's next holder (see
        kcoral.worker.zygote.Zygote). The zygote forks one ahead as it announces each worker, so
        asking with every fresh worker's program (where the spare's ``spare`` event came after
        the program, 73 of 76 times on the 2-core VM) only cost a command line to write, and one
        for the zygote to read, a program."""
        state = self.states.get(slot)
        if state is not None and state.spare_lost:
            self._command(slot, ZygoteCommand.FORK_SPARE)

    def prepare_next_worker(self, slot: int, worker: WorkerId | None = None, *, gpu_used: bool | None = None) -> None:
        """The slot's worker (``worker``, where named) sent its last result: fork its successor now,
        while it exits. The zygote announces the successor (and the broker uses it) only once the
        worker has exited. ``gpu_used``: whether that program took the GPU lease; the slot makes
        the CUDA contexts of its next spares ahead only while its programs do."""
        self._command(slot, ZygoteCommand.RETIRE_WORKER, worker, **({"gpu": gpu_used} if gpu_used is not None else {}))

    def worker_host_pid(self, slot: int) -> int | None:
        """The host's pid (NVML's outside the sandbox) of the slot's current worker, where the zygote
        named it (None where not, or not found): a child of the zygote, found by the pid the zygote
        gave, read in the zygote's own pid namespace. Its spare's: :meth:`gpu_spares`."""
        state = self.states.get(slot)
        return _host_pid(state, state.worker_pid) if state is not None else None

    def gpu_spares(self, gpus: Iterable[int], holder_slot: int) -> list[int]:
        """The spares of every slot on ``gpus``: their host pids (NVML's outside the sandbox), and for
        ``holder_slot`` also the pid its zygote gave, which is what NVML says inside that slot's
        sandbox (NVML gives a process the lease holder can see by its pid there, one it cannot by its
        host pid; measured on the H200)."""
        wanted = set(gpus)
        pids: list[int] = []
        for slot, state in self.states.items():
            if state.spec.gpu not in wanted or state.spare_pid is None:
                continue
            host = _host_pid(state, state.spare_pid)
            pids += [host] if host is not None else []
            pids += [state.spare_pid] if slot == holder_slot else []
        return pids

    def gpu_workers(self, gpus: Iterable[int], holder_slot: int) -> list[tuple[WorkerId, int]]:
        """The current workers of the other slots on ``gpus`` with their host pids: whether one is
        idle (no program sent to it yet, so it has run nothing but its own code) is the pool's word."""
        wanted = set(gpus)
        found: list[tuple[WorkerId, int]] = []
        for slot, state in self.states.items():
            if slot == holder_slot or state.spec.gpu not in wanted or state.worker is None:
                continue
            host = _host_pid(state, state.worker_pid)
            found += [(state.worker, host)] if host is not None else []
        return found

    async def spares_named(self, gpus: Iterable[int], timeout: float) -> None:
        """:meth:`spare_named` for every slot on ``gpus`` at once: a slot whose worker went just now
        forks its next spare, which makes its CUDA context while the next lease holder measures."""
        wanted = set(gpus)
        slots = [slot for slot, state in self.states.items() if state.spec.gpu in wanted]
        await asyncio.gather(*(self.spare_named(slot, timeout) for slot in slots))

    async def spare_named(self, slot: int, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for the zygote to name the slot's spare where it forks
        one now: it does so right after announcing a worker, so a program that asks for its lease at
        once may come before the spare's ``spare`` event (and the spare then makes its CUDA context
        while the program runs). A slot whose worker has just exited is about to announce its spare
        and fork the next: that one is waited for too (on the H200, 2 of 12 honest programs counted
        a spare forked so, during their measurement, as another process)."""
        state = self.states.get(slot)
        if state is None or state.state != SlotPhase.RUNNING or (state.spare is not None and state.worker is not None):
            return
        waiter = asyncio.Event()
        state.spare_waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), timeout)
        finally:
            state.spare_waiters.remove(waiter)

    async def _check_liveness(self) -> None:
        """Kill a zygote that stopped speaking, or that did not kill its worker when told to."""
        while not self._stopping:
            await asyncio.sleep(LIVENESS_CHECK_SECONDS)
            now = time.monotonic()
            for state in self.states.values():
                process = state.process
                if process is None or process.returncode is not None or state.state != SlotPhase.RUNNING:
                    continue
                why = ""
                if self._stopped(state):
                    why = f"the zygote was found stopped (SIGSTOP, or a tracer) at {STOPPED_CHECKS} checks in a row"
                elif now - state.last_heard > ZYGOTE_SILENCE_SECONDS:
                    why = f"the zygote was silent for {now - state.last_heard:.1f} s"
                elif state.kill_asked is not None and now - state.kill_asked[1] > KILL_GRACE_SECONDS:
                    named = worker_name(state.kill_asked[0])
                    why = f"the zygote did not end worker {named} within {KILL_GRACE_SECONDS:g} s"
                if why:
                    log.error("zygote_unresponsive", slot=state.spec.slot, reason=why)
                    state.killed_for = why
                    _kill_session(process.pid)

    @staticmethod
    def _stopped(state: SlotState) -> bool:
        info = processes.read_process(state.zygote_host_pid) if state.zygote_host_pid is not None else None
        state.stopped_checks = state.stopped_checks + 1 if info is not None and info.state in "Tt" else 0
        return state.stopped_checks >= STOPPED_CHECKS

    async def stop(self) -> None:
        self._stopping = True
        for slot in self.states:
            self._command(slot, ZygoteCommand.STOP)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for state in self.states.values():
            if state.process is not None and state.process.returncode is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(state.process.wait(), max(0.1, deadline - time.monotonic()))
                if state.process.returncode is None:
                    state.process.kill()
                    await state.process.wait()
        await self._collect_orphans()
        await cancel_and_wait(self._tasks)

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "slot": s.spec.slot,
                "gpu": s.spec.gpu,
                "state": s.state.value,
                "zygote_pid": s.zygote_pid,
                "worker": worker_name(s.worker) if s.worker is not None else None,
                "restarts": s.restarts,
                "last_error": s.last_error,
            }
            for s in self.states.values()
        ]

    def _command(self, slot: int, command: ZygoteCommand, worker: WorkerId | None = None, **fields: Any) -> None:
        state = self.states.get(slot)
        if state is None or state.process is None or state.process.stdin is None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            state.process.stdin.write(zygote_command_line(command, worker, **fields))

    async def _keep_running(self, slot: int) -> None:
        state = self.states[slot]
        backoff = RESTART_BACKOFF_FIRST_SECONDS
        while not self._stopping:
            state.started_at = time.monotonic()
            await self._run_zygote(state)
            if self._stopping or state.refused:
                return
            state.restarts += 1
            state.state = SlotPhase.RESTARTING
            await self._collect_orphans()
            if time.monotonic() - state.started_at > HEALTHY_AFTER_SECONDS:
                backoff = RESTART_BACKOFF_FIRST_SECONDS
            log.warning(
                "zygote_restart", slot=slot, restarts=state.restarts, backoff_s=backoff, reason=state.last_error
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_SECONDS)

    async def _run_zygote(self, state: SlotState) -> None:
        spec = state.spec
        spec.workspace.mkdir(parents=True, exist_ok=True)
        try:
            process = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=spec.env if spec.env is not None else dict(os.environ),
                limit=MAX_EVENT_LINE_BYTES,
                pass_fds=spec.pass_fds,
                # Its own session: a terminal's Ctrl-C goes to the foreground process group, and
                # must reach the broker alone (it drains), not bwrap or the zygote under it; and
                # os.killpg(os.getpgid(os.getppid()), ...) in a program reaches its zygote at most.
                start_new_session=True,
            )
        except OSError as exc:
            state.last_error = f"cannot start the zygote: {exc}"
            log.error("zygote_start_failed", slot=spec.slot, error=str(exc))
            return
        state.process = process
        state.zygote_pid = process.pid
        state.state = SlotPhase.STARTING
        state.kill_asked = None
        state.killed_for = ""
        state.zygote_host_pid = None
        state.spare, state.spare_pid, state.spare_lost = None, None, False
        state.stopped_checks = 0
        log.info("zygote_started", slot=spec.slot, gpu=spec.gpu, pid=process.pid)
        assert process.stdout is not None
        while True:
            try:
                line = await process.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not line:
                break
            state.last_heard = time.monotonic()
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self._handle_event(state, event)
        _kill_session(process.pid)  # what is left of its sandbox
        code = await process.wait()
        died = state.killed_for or f"the zygote exited with code {code}"
        if not self._stopping:
            cause = state.killed_for or state.refused
            why = f" ({cause})" if cause else ""
            state.last_error = f"zygote exited with code {code}{why}"
            log.error("zygote_died", slot=spec.slot, gpu=spec.gpu, returncode=code)
        if state.worker is not None:
            # Its worker's processes came to us (the subreaper): they die before the broker hears
            # of the exit, which gives their GPU lease to the next program.
            await self._collect_orphans()
            self.on_exit(WorkerExit(spec.slot, state.worker, None, None, zygote_died=True, reason=died))
            state.worker = None
        state.state = SlotPhase.STOPPED

    def _handle_event(self, state: SlotState, event: dict[str, Any]) -> None:
        try:
            kind = ZygoteEvent(str(event.get("event")))
        except ValueError:
            return
        if kind is ZygoteEvent.READY:
            state.state = SlotPhase.RUNNING
            inside = event_int(event.get("pid"))
            if state.process is not None and inside is not None:
                # Found now, while no program runs in the sandbox to pose as it.
                state.zygote_host_pid = processes.find_in_sandbox(state.process.pid, inside)
        elif kind is ZygoteEvent.FORKED:
            state.worker = event_worker(event)
            state.worker_pid = event_int(event.get("pid"))
            if event.get("memory_cgroup") is False:  # the watchdog's samples alone hold this one
                log.warning("worker_without_memory_cgroup", slot=state.spec.slot, worker=state.worker)
            if state.spare == state.worker:
                state.spare, state.spare_pid = None, None
            self.on_fork(state.spec.slot, state.worker)
        elif kind is ZygoteEvent.SPARE:
            state.spare, state.spare_pid = event_worker(event), event_int(event.get("pid"))
            state.spare_lost = False
            for waiter in state.spare_waiters:
                waiter.set()
        elif kind is ZygoteEvent.GPU_FREE and state.worker is not None and state.worker == event_worker(event):
            if event.get("teardown"):
                name = worker_name(state.worker)
                log.debug("gpu_quiet", slot=state.spec.slot, worker=name, after_ms=event.get("after_ms"))
            self.on_gpu_free(state.worker)
        elif kind is ZygoteEvent.REFUSED:
            state.refused = str(event.get("reason") or "the zygote cannot serve with these settings")[:2000]
            state.last_error = state.refused
            log.error("slot_refused", slot=state.spec.slot, gpu=state.spec.gpu, reason=state.refused)
            self.on_refused(state.spec.slot, state.refused)
        elif kind is ZygoteEvent.SPARE_GONE:
            if state.spare == event_worker(event):
                state.spare, state.spare_pid = None, None
                state.spare_lost = True
        elif kind is ZygoteEvent.SPARE_DISCARDED:
            if state.spare == event_worker(event):
                state.spare, state.spare_pid = None, None
            log.warning("spare_worker_discarded", slot=state.spec.slot, worker=str(event.get("worker")))
        elif kind is ZygoteEvent.EXITED:
            worker = event_worker(event)
            if state.worker == worker:
                state.worker = None
            if state.kill_asked is not None and state.kill_asked[0] == worker:
                state.kill_asked = None
            self.on_exit(WorkerExit.from_event(state.spec.slot, event))

    async def _collect_orphans(self) -> None:
        """Kill and reap what a dead zygote left to us (it comes to us as the subreaper)."""
        deadline = time.monotonic() + ORPHAN_COLLECT_SECONDS
        while True:
            zygotes = {s.process.pid for s in self.states.values() if s.process and s.process.returncode is None}
            found = processes.orphans_from_workers(exclude=zygotes)
            for info in found:
                if info.zombie:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(info.pid, os.WNOHANG)
                else:
                    tree = [info, *filter(None, map(processes.read_process, processes.descendants(info.pid)))]
                    processes.kill_processes(tree)
            if not found or time.monotonic() > deadline:
                return
            await asyncio.sleep(ORPHAN_POLL_SECONDS)


def _kill_session(pid: int) -> None:
    """SIGKILL a zygote's session (it leads one): the zygote itself, or the bwrap around it, whose
    death takes the sandbox's every process with it (--die-with-parent, the pid namespace)."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill()
