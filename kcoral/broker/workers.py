"""The broker's workers: which may take programs, which are idle, which have exited.

:class:`WorkerPool` is the broker's record of the worker processes on its workers' socket. A worker
is taken into the pool only when it says READY under the identity its slot's zygote reported as
forked (identities carry a random token): anything else that reaches the socket, a program say,
must never be handed other clients' work. The zygote's "forked" event and the worker's READY travel
on different paths, so a READY that comes first is kept a while (:data:`EARLY_READY_SECONDS`).
Exits are remembered (a bounded number), so that a READY read after its worker died is ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog

from kcoral.broker.requests import Worker
from kcoral.broker.supervisor import SlotState
from kcoral.protocol.worker_link import WorkerId, worker_name
from kcoral.protocol.zygote_link import WorkerExit

log = structlog.get_logger("kcoral.broker")

WORKER_EXIT_GRACE_SECONDS = 0.5  # a RESULT may still be in the socket when the exit is reported
# A worker that exits cleanly has sent its RESULT towards this broker, but behind whatever it sent
# before: a program that flooded its socket with PROGRESS left up to WORKER_RECEIVE_HIGH_WATER_MARK
# messages ahead of it (milliseconds of reading). A worker that sent it on its own socket waits
# for its kill with that socket open (kcoral.worker.worker._await_retirement): when the flood fills
# this broker's queue for the connection, libzmq stops reading it, and what is still in the kernel
# when the connection closes is lost, RESULT included.
CLEAN_EXIT_RESULT_GRACE_SECONDS = 5.0
MAX_REMEMBERED_EXITS = 10_000
MAX_EARLY_READY = 1024
EARLY_READY_SECONDS = 10.0


def result_grace_seconds(exit: WorkerExit) -> float:
    """How long the RESULT of a worker that exited while running a program may still arrive."""
    clean = exit.returncode == 0 and exit.signal is None and not exit.reason and not exit.zygote_died
    return CLEAN_EXIT_RESULT_GRACE_SECONDS if clean else WORKER_EXIT_GRACE_SECONDS


class WorkerPool:
    """Workers by identity, the idle ones among them, and the exits the zygotes reported."""

    def __init__(self, slots: Mapping[int, SlotState]) -> None:
        self.slots = slots  # the supervisor's slot states: which worker each zygote forked
        self.workers: dict[WorkerId, Worker] = {}
        self.idle: dict[WorkerId, Worker] = {}
        self.exited: dict[WorkerId, WorkerExit] = {}
        # READYs that arrived before their zygote's "forked" event was read.
        self.early_ready: dict[WorkerId, dict[str, Any]] = {}

    def ready(self, identity: WorkerId, body: dict[str, Any]) -> Worker | None:
        """Take a worker that said READY into the pool, idle; None when it may not take programs
        (yet: a READY that came before its zygote's "forked" event is kept a while)."""
        slot = body.get("slot")
        if not isinstance(slot, int) or slot not in self.slots:
            log.warning("bad_ready", worker=worker_name(identity))
            return None
        if identity in self.exited or identity in self.workers:
            return None  # it died before its READY was read, or says READY twice
        if self.slots[slot].worker != identity:
            if len(self.early_ready) < MAX_EARLY_READY:
                self.early_ready[identity] = body
                asyncio.get_running_loop().call_later(EARLY_READY_SECONDS, self._forget_early_ready, identity)
            return None
        gpu = self.slots[slot].spec.gpu
        worker = Worker(identity, slot, gpu, int(body.get("pid") or 0))
        if body.get("gpu_view") == [gpu] and gpu is not None:
            # Its CUDA context was made ahead, on the slot's GPU: it serves that GPU alone. (A worker
            # that says so falsely only narrows what it is given; one that hides it is refused its
            # program's other GPUs by its own check, kcoral.worker.state.cuda_view_mismatch.)
            worker.gpu_view = (gpu,)
        self.workers[identity] = worker
        self.idle[identity] = worker
        log.debug("worker_ready", worker=worker.name, gpu=gpu, slot=slot)
        return worker

    def forked(self, slot: int, worker: WorkerId) -> Worker | None:
        """A zygote reported a fork: a READY that came first now counts."""
        body = self.early_ready.pop(worker, None)
        if body is not None and body.get("slot") == slot:
            return self.ready(worker, body)
        return None

    def _forget_early_ready(self, identity: WorkerId) -> None:
        if self.early_ready.pop(identity, None) is not None:
            log.warning("ready_from_unknown_worker", worker=worker_name(identity))

    def exit(self, exit: WorkerExit) -> Worker | None:
        """Record a worker's exit; the worker if it was running a program (still known, marked
        exited: its RESULT may still be in the socket), else None (forgotten)."""
        identity = exit.worker
        self.exited[identity] = exit
        if len(self.exited) > MAX_REMEMBERED_EXITS:
            self.exited.pop(next(iter(self.exited)))
        self.idle.pop(identity, None)
        worker = self.workers.get(identity)
        if worker is None or worker.request_id is None:
            self.workers.pop(identity, None)
            return None
        worker.exited = True
        return worker

    def pick(self, gpu_count: int, load: Mapping[int, int]) -> Worker | None:
        """Take the least busy idle worker that can run a program on ``gpu_count`` GPUs, if any."""

        def busyness(identity: WorkerId) -> tuple[int, int]:
            worker = self.idle[identity]
            return (load.get(worker.gpu, 0) if worker.gpu is not None else 0, worker.slot)

        fits = [i for i, w in self.idle.items() if w.gpu_view is None or len(w.gpu_view) == gpu_count]
        return self.idle.pop(min(fits, key=busyness)) if fits else None

    def take_any_idle(self) -> Worker:
        """Take an idle worker out of the pool (to be retired)."""
        identity, worker = self.idle.popitem()
        self.workers.pop(identity, None)
        return worker

    def forget(self, worker: Worker) -> None:
        self.workers.pop(worker.identity, None)
        self.idle.pop(worker.identity, None)

    def snapshot(self) -> dict[str, int]:
        return {"idle": len(self.idle), "busy": sum(1 for w in self.workers.values() if w.request_id is not None)}


__all__ = ["WorkerPool", "result_grace_seconds"]
