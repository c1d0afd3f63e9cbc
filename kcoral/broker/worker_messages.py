"""What the workers say and what their zygotes report, and how each moves a program on.

:class:`WorkerMessages` reads the workers' socket for the broker (READY, LEASE, PROGRESS, RESULT)
and takes the supervisor's reports of the zygotes (a worker forked, a worker exited): it admits
workers to the pool, grants GPU leases and holds them until the worker's exit, passes output on
to the client, and ends programs from their results, crashes and unreadable answers. It is built
with what it uses (settings, the workers' socket, the pool, the requests in flight, the lease
table, the supervisor) and talks back to the broker through a small port, :class:`WorkerPort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.broker import slots
from kcoral.broker.gpu_pids import GpuPids
from kcoral.broker.leases import LeaseReclaimed, LeaseTable
from kcoral.broker.provenance import Provenance
from kcoral.broker.requests import Request, RequestState, Worker
from kcoral.broker.sessions import SessionTable
from kcoral.broker.settings import BrokerSettings
from kcoral.broker.supervisor import Supervisor
from kcoral.broker.workers import WorkerPool, result_grace_seconds
from kcoral.protocol.worker_link import WorkerId, worker_name
from kcoral.protocol.zygote_link import WorkerExit
from kcoral.service.fairness import RateLimit
from kcoral.service.shell import InFlightTable
from kcoral.service.sockets import send_now

log = structlog.get_logger("kcoral.broker")

# Messages per worker but RESULT (mostly PROGRESS: the last instruction index is all the broker
# keeps): beyond this rate they are dropped before they are decoded; a program that floods its
# worker's socket costs the loop little.
PROGRESS_PER_SECOND = 50.0
PROGRESS_BURST = 100.0
# The messages one worker may have queued on the broker's socket (libzmq counts them per connection).
WORKER_RECEIVE_HIGH_WATER_MARK = 1_000
COMMAND_BYTES_MOST = 32  # a command frame is a short name: more is never read
# The longest a GRANT waits for the slot's spare to be named (its fork: milliseconds).
SPARE_WAIT_SECONDS = 0.25


class WorkerPort(Protocol):
    """What the worker side asks of the broker that holds it."""

    @property
    def node_id(self) -> str | None:
        """This broker's node id in results, where it serves a router."""

    def finish(self, request: Request, body: dict[str, Any], frames: list[Any]) -> None:
        """Answer a request with this FINAL body and its frames, once, and forget it."""

    def fail(self, request: Request, kind: str, message: str) -> None:
        """End a request with an error (FINAL), killing its worker if it runs, and forget it."""

    def dispatch(self) -> None:
        """Give queued programs to idle workers."""

    def worker_joined(self, worker: Worker) -> None:
        """A worker joined the pool, idle: give it a program."""

    def tell(self, request: Request, body: dict[str, Any]) -> None:
        """Send the request's client a PARTIAL."""


@dataclass(eq=False)
class WorkerMessages:
    """The broker's side of its workers' messages and of its zygotes' reports."""

    settings: BrokerSettings
    backend: zmq.asyncio.Socket
    pool: WorkerPool
    requests: InFlightTable[Request]
    leases: LeaseTable
    supervisor: Supervisor
    port: WorkerPort
    held_leases: dict[WorkerId, str] = field(default_factory=dict)  # worker -> the request whose lease it holds
    # worker -> its host pid and the GPUs of the lease it holds (for gpu_pids when the lease goes back)
    holder_pids: dict[WorkerId, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    gpu_pids: GpuPids = field(default_factory=GpuPids)
    progress_limit: RateLimit[WorkerId] = field(default_factory=lambda: RateLimit(PROGRESS_PER_SECOND, PROGRESS_BURST))
    ready_announced: bool = False
    provenance: Provenance | None = None  # None: results carry an empty provenance map
    sessions: SessionTable = field(default_factory=lambda: SessionTable(0.0, 0.0))

    def holds_lease(self, worker: Worker | None, request_id: str) -> bool:
        """Whether ``worker`` holds ``request_id``'s lease: it then goes back at the worker's exit."""
        return worker is not None and self.held_leases.get(worker.identity) == request_id

    def on_message(self, frames: list[zmq.Frame]) -> None:
        identity = WorkerId(bytes(frames[0].buffer))
        command = bytes(frames[2].buffer[:COMMAND_BYTES_MOST]) if len(frames) > 2 else b""
        worker_identity, separator, _ = identity.partition(protocol.RESULT_IDENTITY_SEPARATOR)
        if separator:
            # A worker's connection for its RESULT (protocol.RESULT_IDENTITY_SEPARATOR): that alone.
            if command != protocol.RESULT:
                return
            identity = WorkerId(worker_identity)
        elif command != protocol.RESULT:  # dropped before decoding: PROGRESS_PER_SECOND, MAX_CONTROL_MESSAGE_BYTES
            if not self.progress_limit.allow(identity) or slots.oversized_control(command, frames[1:]):
                return
        sender = self.pool.workers.get(identity)
        if command != protocol.READY and (sender is None or sender.request_id is None):
            return  # from a worker with no program: none of it counts, so none of it is decoded
        try:
            oversized = slots.oversized_result([f.buffer for f in frames[1:]])
            command, body, data = protocol.split_message([f.buffer for f in frames[1:]])
        except protocol.WireError as exc:
            log.warning("bad_worker_message", worker=worker_name(identity), error=str(exc))
            self._fail_unreadable_result(identity, oversized, exc)
            return
        if oversized is not None:
            self._fail_unreadable_result(identity, oversized, None)
            return
        if command == protocol.READY:
            self._on_ready(identity, body)
            return
        worker = self.pool.workers.get(identity)
        if worker is None:
            return
        request = self.requests.get(worker.request_id or "")
        if request is None or body.get("request_id") != request.id:
            return
        if command == protocol.LEASE:
            if request.lease_task is None or request.lease_task.done():
                request.lease_task = asyncio.create_task(self._grant_lease(request, worker))
        elif command == protocol.PROGRESS:
            self._on_progress(request, body)
        elif command == protocol.RESULT:
            malformed = protocol.malformed_result(body)
            if malformed is not None:  # a program wrote it: fail that program, not its client
                self._fail_unreadable_result(identity, None, protocol.WireError(malformed))
            else:
                self._on_result(request, worker, body, data)

    def _on_progress(self, request: Request, body: dict[str, Any]) -> None:
        """The instruction now running, or a piece of the program's output, which goes on to the
        client as PARTIAL ``output`` (a client shows it live; the result repeats all of it)."""
        index, stream, offset, text = body.get("index"), body.get("stream"), body.get("offset"), body.get("text")
        if isinstance(index, int):
            request.instruction_index = index
        elif stream in ("stdout", "stderr") and isinstance(offset, int) and isinstance(text, str):
            if request.state == RequestState.RUNNING and len(text) <= protocol.OUTPUT_PIECE_BYTES:
                piece = {"request_id": request.id, "state": "output", "stream": stream, "offset": offset, "text": text}
                self.port.tell(request, piece)

    def _on_ready(self, identity: WorkerId, body: dict[str, Any]) -> None:
        worker = self.pool.ready(identity, body)
        if worker is not None:
            self._worker_joined(worker)

    def on_forked(self, slot: int, worker: WorkerId) -> None:
        joined = self.pool.forked(slot, worker)
        if joined is not None:
            self._worker_joined(joined)

    def _worker_joined(self, worker: Worker) -> None:
        if not self.ready_announced and len(self.pool.idle) >= len(self.supervisor.slots):
            # The line an operator (or a script) waits for: every slot has a worker, programs run now.
            self.ready_announced = True
            log.info(
                "broker_ready", endpoint=self.settings.listen, slots=len(self.pool.idle), gpus=list(self.leases.gpus)
            )
        self.port.worker_joined(worker)

    async def _grant_lease(self, request: Request, worker: Worker) -> None:
        # Granted at once where the worker holds the lease already: the holder asking again (its
        # timer, after a measurement that saw a process it was not told of), or a session's worker,
        # which holds its GPUs' lease between its programs. The GPU's quiet processes as they are now.
        if self.held_leases.get(worker.identity) == request.id:
            body: dict[str, Any] | None = self._grant_body(request, worker)
        else:
            body = self.session_grant(request, worker)
        if body is not None:
            with contextlib.suppress(zmq.ZMQError):
                send_now(self.backend, [worker.identity, *protocol.message(protocol.GRANT, body)])
            return
        try:
            grant = await self.leases.acquire(request.id, request.gpu_ids)
        except (LeaseReclaimed, asyncio.CancelledError):
            return
        try:
            # The holder is told the spares on its GPUs (kcoral.broker.gpu_pids): one forked just now
            # is named a few milliseconds after its worker was announced.
            await self.supervisor.spares_named(request.gpu_ids, SPARE_WAIT_SECONDS)
        except asyncio.CancelledError:
            self.leases.release(request.id)
            return
        if self.requests.get(request.id) is not request or request.state != RequestState.RUNNING or worker.exited:
            self.leases.release(request.id)
            return
        # Held until the zygote reports this worker's exit (see on_exit), whatever the
        # worker says: until then its program could still run work on the GPU.
        self.held_leases[worker.identity] = request.id
        request.lease_times = (grant.requested_at, grant.granted_at)
        try:
            send_now(self.backend, [worker.identity, *self._grant(request, worker)])
        except zmq.ZMQError:
            self.leases.release(request.id)

    def session_grant(self, request: Request, worker: Worker) -> dict[str, Any] | None:
        """GRANT's body for a program of a session whose worker holds its GPUs' lease (it is
        granted at once: the broker also sends it with the PROGRAM), or None for any other."""
        if worker.identity not in self.held_leases or self.sessions.of_worker(worker.identity) is None:
            return None
        if request.lease_times is None:  # a second ask keeps the first grant's times
            now = time.monotonic()
            request.lease_times = (now, now)
        return self._grant_body(request, worker)

    def _grant(self, request: Request, worker: Worker) -> list[Any]:
        return protocol.message(protocol.GRANT, self._grant_body(request, worker))

    def _grant_body(self, request: Request, worker: Worker) -> dict[str, Any]:
        """GRANT: the request, and the GPU's processes known to run nothing (kcoral.broker.gpu_pids)."""
        own = self.supervisor.worker_host_pid(worker.slot)
        self.holder_pids[worker.identity] = (own, tuple(request.gpu_ids))
        spares = self.supervisor.gpu_spares(request.gpu_ids, worker.slot)
        spares += self._idle_workers(request.gpu_ids, worker.slot)
        gpu_pids = self.gpu_pids.grant(request.gpu_ids, own, spares, time.monotonic())
        return {"request_id": request.id, "gpu_pids": gpu_pids}

    def _idle_workers(self, gpus: Iterable[int], holder_slot: int) -> list[int]:
        """Host pids of the other slots' current workers on ``gpus`` that were never sent a
        program: such a one has run only its own code (its CUDA context made ahead, say) since it
        was forked, as a spare does. One reused between programs is not named."""
        return [
            pid
            for identity, pid in self.supervisor.gpu_workers(gpus, holder_slot)
            if (known := self.pool.workers.get(identity)) is not None and known.programs == 0
        ]

    def _lease_gone(self, worker: WorkerId) -> None:
        """The worker's lease went back because it can run no more work: name it to the next holders."""
        own, gpus = self.holder_pids.pop(worker, (None, ()))
        self.gpu_pids.lease_gone(gpus, own, time.monotonic())

    def _on_result(self, request: Request, worker: Worker, body: dict[str, Any], data: list[Any]) -> None:
        worker.request_id = None
        if worker.exited:
            self.pool.forget(worker)
        raw_info = body.get("worker")
        info: dict[str, Any] = raw_info if isinstance(raw_info, dict) else {}
        reusable = slots.reusable(worker, self.settings.max_programs_per_worker)
        retire: Callable[[], None] | None = None  # told the zygote once the client has its answer
        if self._session_goes_on(request, worker, body, info):
            pass  # kept for its client's next program: not idle for others, its lease held
        elif info.get("reusable") and reusable and worker.identity in self.pool.workers:
            holder = self.held_leases.pop(worker.identity, None)
            self.holder_pids.pop(worker.identity, None)  # alive, and idle for the next program
            if holder is not None:  # a worker reused is trusted between programs (slots.reusable)
                self.leases.release(holder)
            view = info.get("gpu_view")
            if isinstance(view, list) and all(isinstance(g, int) and g in self.leases.gpus for g in view):
                worker.gpu_view = tuple(sorted(view))
            self.pool.idle[worker.identity] = worker
        else:
            if info.get("retire_reason"):
                log.info("worker_retired", worker=worker.name, reason=info.get("retire_reason"))
            if not worker.exited:
                gpu_used = request.lease_times is not None  # its worker asked for and got the lease
                retire = functools.partial(
                    self.supervisor.prepare_next_worker, worker.slot, worker.identity, gpu_used=gpu_used
                )
        response_bytes = sum(len(f) for f in data)
        error = body.get("error")
        # The worker stops at the limit (error kind response_too_large) instead of sending it all.
        stopped = isinstance(error, dict) and error.get("kind") == "response_too_large"
        if stopped or response_bytes > self.settings.max_response_bytes:
            if retire is not None:
                retire()  # before the failure's kill, as every kill of a worker that sent its RESULT
            self.port.fail(
                request,
                "response_too_large",
                f"the results are over {self.settings.max_response_bytes} bytes, the most this broker returns",
            )
            self.port.dispatch()
            return
        queue_ms = (request.started_at - request.queued_at) * 1000
        result = protocol.with_broker_fields(
            body, request_id=request.id, queue_ms=queue_ms, gpu_ids=request.gpu_ids, node_id=self.port.node_id
        )
        now = time.monotonic()
        result["lease_wait_ms"], result["lease_held_ms"] = slots.lease_times(request.lease_times, now)
        result["timeline"] = request.timeline(now)
        result["provenance"] = self._provenance(request, body.get("provenance"))
        self.port.finish(request, protocol.final_body(request.id, result), data)
        if retire is not None:
            # After the FINAL: the zygote's command line took 15 to 20% of a busy broker's time on
            # the H200, on each program's way to its answer.
            retire()
        self.port.dispatch()

    def _provenance(self, request: Request, claims: Any) -> dict[str, Any]:
        """The result's ``provenance`` (kcoral.broker.provenance); ``claims``: the worker's own."""
        if self.provenance is None:
            return {}
        # Made as its PROGRAM was sent (Broker._start, the one place a request gets a worker), so
        # before any RESULT of it can be read.
        return self.provenance.for_result(request.provenance or {}, request.gpu_ids, claims)

    def _session_goes_on(self, request: Request, worker: Worker, body: dict[str, Any], info: dict[str, Any]) -> bool:
        """Whether ``worker`` stays its client's session's after this result (kcoral.broker.sessions):
        a session program that completed, in a worker that says it can go on and has not exited, and
        a session within its length. Otherwise a session of that worker ends here."""
        completed = body.get("status") == protocol.COMPLETED and body.get("error") is None
        if (
            request.options.session
            and completed
            and info.get("reusable") is True
            and not worker.exited
            and worker.identity in self.pool.workers
            and self.sessions.keep(request.client, worker, request.gpu_ids) is not None
        ):
            worker.gpu_view = tuple(request.gpu_ids) if request.gpu_ids else None
            return True
        self.drop_session(worker)
        return False

    def drop_session(self, worker: Worker | None) -> None:
        """End the session of ``worker``, if it has one (it failed, is killed, or exited)."""
        session = self.sessions.of_worker(worker.identity) if worker is not None else None
        if session is not None:
            self.sessions.end(session)
            log.info("session_ended", worker=worker.name if worker else None, programs=session.programs)

    def on_gpu_free(self, worker: WorkerId) -> None:
        """The zygote killed a finished worker that had no GPU device open or mapped (nor had
        anything it started): it can run no more work on the GPU, whose lease goes back now."""
        holder = self.held_leases.pop(worker, None)
        if holder is not None:
            self._lease_gone(worker)
            self.leases.reclaim(holder)

    def on_exit(self, exit: WorkerExit) -> None:
        holder = self.held_leases.pop(exit.worker, None)
        if holder is not None:
            # The worker and all it started are gone (the zygote says so only then): the GPU is free.
            self._lease_gone(exit.worker)
            self.leases.reclaim(holder)
        self.holder_pids.pop(exit.worker, None)
        session = self.sessions.of_worker(exit.worker)
        if session is not None:
            self.sessions.end(session)
        worker = self.pool.exit(exit)
        if worker is None or worker.request_id is None:
            if exit.reason:  # its program was answered: what it left (children) broke a limit after
                log.warning("worker_killed_after_result", worker=exit.worker, reason=exit.reason)
            return
        request = self.requests.get(worker.request_id)
        if request is None:
            self.pool.forget(worker)
            return
        # The worker stays known for a moment: its RESULT may still be queued in the socket.
        asyncio.get_running_loop().call_later(result_grace_seconds(exit), self._fail_crashed, request, worker, exit)

    def _fail_crashed(self, request: Request, worker: Worker, exit: WorkerExit) -> None:
        self.pool.forget(worker)
        if self.requests.get(request.id) is not request or request.worker is not worker:
            return
        index = exit.instruction_index if exit.instruction_index is not None else request.instruction_index
        log.warning("worker_died", request_id=request.id, worker=worker.name, how=exit.describe())
        message = f"worker exited while executing the instruction ({exit.describe()})"
        self._finish_failed(request, "runtime", message, index)

    def _fail_unreadable_result(
        self, identity: WorkerId, oversized: str | None, exc: protocol.WireError | None
    ) -> None:
        """A message from a running worker that cannot become a FINAL: fail its program clearly."""
        worker = self.pool.workers.get(identity)
        request = self.requests.get(worker.request_id or "") if worker is not None else None
        if request is None or worker is None:
            return
        log.warning("unreadable_result", request_id=request.id, worker=worker.name, error=oversized or str(exc))
        if oversized is not None:
            self.port.fail(request, "response_too_large", oversized)
        else:
            self._finish_failed(request, "serialization", f"the worker's result could not be read: {exc}", None)

    def _finish_failed(self, request: Request, kind: str, message: str, index: int | None) -> None:
        """Answer a running program with a FAILED result the broker writes itself."""
        instructions = request.program.get("instructions", [])
        ins = instructions[index] if index is not None and index < len(instructions) else {}
        lease_wait_ms, lease_held_ms = slots.lease_times(request.lease_times, time.monotonic())
        result = protocol.program_result(
            request.id,
            error=protocol.instruction_error(kind, message, index, ins),
            queue_ms=(request.started_at - request.queued_at) * 1000,
            elapsed_ms=(time.monotonic() - request.started_at) * 1000,
            lease_wait_ms=lease_wait_ms,
            lease_held_ms=lease_held_ms,
            gpu_ids=request.gpu_ids,
            node_id=self.port.node_id,
            timeline=request.timeline(time.monotonic()),
        )
        result["provenance"] = self._provenance(request, None)
        worker = request.worker
        self.drop_session(worker)
        self.port.finish(request, protocol.final_body(request.id, result), [])
        if worker is not None and not worker.exited:
            worker.request_id = None
            self.pool.forget(worker)
            self.supervisor.kill_worker(worker.slot, worker.identity)
        self.port.dispatch()


__all__ = ["PROGRESS_BURST", "PROGRESS_PER_SECOND", "WORKER_RECEIVE_HIGH_WATER_MARK", "WorkerMessages", "WorkerPort"]
