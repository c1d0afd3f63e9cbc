"""The host broker: a ROUTER for clients, a ROUTER for workers, and the queue between them.

One asyncio loop (uvloop where installed) owns every piece of state: requests, idle workers, the
lease table and the blob store, so none of it needs locks. Workers live in zygote-forked processes
run by the :class:`~kcoral.broker.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket as stdlib_socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.broker.blobs import BlobStore
from kcoral.broker.intake import NEGOTIATION_TIMEOUT_SECONDS, ProgramIntake
from kcoral.broker.launch import slot_specs
from kcoral.broker.leases import LeaseTable, choose_gpus
from kcoral.broker.provenance import Provenance
from kcoral.broker.requests import Request, RequestState, Worker
from kcoral.broker.sessions import Session, SessionTable
from kcoral.broker.settings import BrokerSettings
from kcoral.broker.supervisor import Supervisor
from kcoral.broker.target import TargetInfo, describe_target
from kcoral.broker.upstream import UpstreamLink, default_node_id
from kcoral.broker.worker_messages import WORKER_RECEIVE_HIGH_WATER_MARK, WorkerMessages
from kcoral.broker.workers import WorkerPool
from kcoral.service.fairness import OrphanWatch, UploadBudget
from kcoral.service.identity import versions
from kcoral.service.metrics import ServiceMetrics, programs_in_flight
from kcoral.service.queue import RequestQueue
from kcoral.service.shell import ClientMessage, ServiceShell, ShellSettings
from kcoral.service.sockets import receive_forever, router_socket, send_now
from kcoral.worker.memory_cgroup import SlotCgroups

log = structlog.get_logger("kcoral.broker")


class Broker:
    """Serves programs from clients to workers on one host.

    It holds a :class:`~kcoral.service.shell.ServiceShell` (the client socket, receive loop,
    replies, requests in flight, tasks and lifecycle), a :class:`ProgramIntake` (EXECUTE and
    BLOBS), a :class:`WorkerPool` (which workers may take programs) and :class:`WorkerMessages`
    (what the workers and their zygotes say: leases, results, exits), and runs the rest of the
    programs' way itself: dispatch to a worker, timeouts, the FINAL, heartbeats and health.
    """

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.target: TargetInfo = describe_target(settings.device, settings.gpus, settings.fake_gpus)
        self.gpu_ids = self.target.lease_gpus
        self.leases = LeaseTable(self.gpu_ids)
        self.run_dir = settings.run_dir or Path(tempfile.mkdtemp(prefix="kcoral-"))
        self._own_run_dir = settings.run_dir is None
        if settings.cache_dir is None:
            # Workers read large blobs from the disk tier, so there always is one.
            settings = dataclasses.replace(settings, cache_dir=self.run_dir / "cache")
            self.settings = settings
        self.blobs = BlobStore(settings.blob_store())
        self.metrics = ServiceMetrics("broker", self.health)
        self.shell: ServiceShell[Request] = ServiceShell(
            "broker",
            ShellSettings.of(settings),
            fail_request=self._finish_error,
            metrics=self.metrics,
        )
        self.requests = self.shell.requests
        self.queue: RequestQueue[Request] = RequestQueue()
        self.trusted_owners: set[bytes] = set()  # the router relay: the router applies the shares
        self.orphans = OrphanWatch(settings.orphan_grace_seconds)
        # What HEALTH and TARGET say that never changes, found once (versions() alone took about
        # 1.6 ms of the loop per HEALTH).
        self.hostname = stdlib_socket.gethostname()
        self.versions = versions()
        self.target_wire = self.target.to_wire()
        self.provenance = Provenance(self.target, self.versions, settings.sandbox, self.hostname, self.instance_id)
        self.intake = ProgramIntake(
            settings.intake(len(self.gpu_ids)),
            blobs=self.blobs,
            requests=self.requests,
            tasks=self.shell.tasks,
            port=self,
            uploads=UploadBudget(*settings.upload_bounds),
            trusted=self.trusted_owners,
        )
        self.shell.handlers.update(
            {
                protocol.EXECUTE: self.intake.on_execute,
                protocol.BLOBS: self.intake.on_blobs,
                protocol.CANCEL: self._on_cancel,
                protocol.HEALTH: self.shell.answer(self.health),
                protocol.TARGET: self.shell.answer(lambda: self.target_wire),
            }
        )
        self.backend = router_socket(self.shell.context)
        # What one worker may queue here: it sends a few messages a program (PROGRESS beyond
        # PROGRESS_PER_SECOND is dropped unread), so more is a flood, whose sends then wait in the
        # worker. Its RESULT, queued behind, is read within milliseconds, not the seconds 100,000
        # queued messages took (tests/test_slot.py, progress floods).
        self.backend.setsockopt(zmq.RCVHWM, WORKER_RECEIVE_HIGH_WATER_MARK)
        self.worker_endpoint = f"ipc://{self.run_dir / 'ipc' / 'workers.sock'}"
        # Made before the zygotes start (each is handed its slot's directory) and removed after.
        self.cgroups = SlotCgroups.make(
            memory_limit=settings.limits.get("memory_bytes") or 0,
            enabled=settings.memory_cgroup == "auto",
        )
        specs = slot_specs(self.settings, self.target, self.run_dir, self.worker_endpoint, self.cgroups)
        # The zygotes' reports go to the worker side, made just below (it needs the supervisor).
        self.supervisor = Supervisor(
            specs,
            lambda exit: self.worker_messages.on_exit(exit),
            lambda s, w: self.worker_messages.on_forked(s, w),
            lambda worker: self.worker_messages.on_gpu_free(worker),
            self._on_slot_refused,
        )
        self.pool = WorkerPool(self.supervisor.states)
        self.sessions = SessionTable(settings.session_idle_seconds, settings.session_max_seconds)
        self.worker_messages = WorkerMessages(
            settings,
            backend=self.backend,
            pool=self.pool,
            requests=self.requests,
            leases=self.leases,
            supervisor=self.supervisor,
            port=self,
            provenance=self.provenance,
            sessions=self.sessions,
        )
        self.upstream: UpstreamLink | None = None
        self.lazy_asked: set[int] = set()  # slots whose next worker was asked to make no CUDA context

    # --- setup ---

    async def serve(self) -> int:
        """Serve until stopped; return the exit code. ``shell.drain()`` (SIGTERM, Ctrl-C: the CLI
        installs the signals) finishes the programs in flight first, ``shell.stop()`` does not."""
        return await self.shell.serve(self._open, self._release, self.metrics.counters)

    async def _open(self) -> None:
        (self.run_dir / "ipc").mkdir(parents=True, exist_ok=True)
        self.backend.bind(self.worker_endpoint)
        await self.supervisor.start()
        self.shell.spawn(
            receive_forever(self.backend, self.worker_messages.on_message, "worker_message_failed"), name="workers"
        )
        self.shell.spawn(self._heartbeat_loop(), name="heartbeats")
        if self.settings.upstream:
            node_id = self.settings.node_id or default_node_id(self.settings.listen)
            self.upstream = UpstreamLink(
                context=self.shell.context,
                upstream=self.settings.upstream,
                node_id=node_id,
                health=self.health,
                to_broker=self.shell.receive_local,
                keys=self.settings.upstream_keys,
            )
            self.trusted_owners.add(self.upstream.local_identity)
            # The relay is a client of this broker in its own process (see kcoral/broker/upstream.py).
            self.shell.attach_local_client(self.upstream.local_identity, self.upstream.on_broker_message)
            self.upstream.start()
        if self.settings.sandbox == "none":
            # Loud: programs then share the broker's user, files and network, and nothing but the
            # process limits stands between them (see docs/operations.md, "Worker limits").
            # Said before broker_listening, the line that tells a watcher the broker is up.
            log.warning("sandbox_none_programs_not_isolated", reason=self.settings.sandbox_reason)
        log.info(
            "broker_listening",
            endpoint=self.settings.listen,
            gpus=list(self.gpu_ids),
            slots=len(self.supervisor.slots),
            sandbox=self.settings.sandbox,
            memory_accounting=self.cgroups.describe(),
            instance_id=self.instance_id,
        )

    def _on_slot_refused(self, slot: int, reason: str) -> None:
        """A zygote cannot serve with this broker's settings: every slot shares them, so the broker
        stops with ``EX_CONFIG`` (78), as a service that cannot start does, rather than restart it
        (and answer nothing) forever."""
        log.error("broker_cannot_serve", slot=slot, reason=reason)
        self.shell.stop(os.EX_CONFIG)

    async def _release(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()  # its sockets must be closed before the context ends
        await self.supervisor.stop()
        made = self.cgroups.describe()
        if not self.cgroups.remove():
            log.warning("memory_cgroup_left", **made)
        self.backend.close(linger=0)
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def draining(self) -> bool:
        return self.shell.draining

    # --- clients (EXECUTE and BLOBS are the intake's) ---

    def _on_cancel(self, message: ClientMessage) -> None:
        request = self.requests.of(message.client, message.request_id)
        if request is None:
            return
        log.info("request_cancelled", request_id=request.id, state=request.state.value)
        self._finish_error(request, "cancelled", "the client cancelled the program")

    # --- dispatch ---

    def enqueue(self, request: Request) -> None:
        self.queue.push(request)
        self.dispatch()

    def dispatch(self) -> None:
        if self.shell.stopping:
            return
        waiting: list[Request] = []  # programs of a session whose worker runs one now
        try:
            self._dispatch(waiting)
        finally:
            for request in reversed(waiting):
                self.queue.push_front(request, serve_client_next=False)

    def _dispatch(self, waiting: list[Request]) -> None:
        while self.pool.idle or self.sessions:
            request = self.queue.pop()
            if request is None:
                return
            session = self.sessions.of(request.client) if request.options.session else None
            if session is not None:
                if session.worker.request_id is not None:
                    waiting.append(request)  # one at a time in a session; others go ahead
                    continue
                if request.gpu_count == len(session.gpu_ids):
                    self._start(request, session.worker)
                    continue
                self.end_session(session, "a program on another number of GPUs")
            if not self.pool.idle:
                self.queue.push_front(request)
                return
            worker = self.pool.pick(request.gpu_count, self._gpu_load())
            if worker is None:
                # Every idle worker serves a different number of GPUs: a reused one confined to
                # them (see kcoral.worker.confinement), or one with its CUDA context made ahead on
                # its slot's GPU. Retire one (unless one is retired already); its slot's next
                # worker, made without a context, takes the program.
                if not self.lazy_asked:
                    self._retire_idle_worker()
                self.queue.push_front(request)
                return
            self._start(request, worker)

    def _retire_idle_worker(self) -> None:
        worker = self.pool.take_any_idle()
        log.info("worker_retired", worker=worker.name, reason="serves other GPUs")
        self.lazy_asked.add(worker.slot)
        self.supervisor.kill_worker(worker.slot, worker.identity, lazy_next=True)

    def end_session(self, session: Session, why: str) -> None:
        """End a session whose worker has no program: its worker is retired (the GPU lease goes back
        at its exit, as any worker's) and its client's next session program starts a new one."""
        self.sessions.end(session)
        log.info("session_ended", worker=session.worker.name, programs=session.programs, reason=why)
        if session.worker.request_id is None and not session.worker.exited:
            self.supervisor.prepare_next_worker(session.worker.slot, session.worker.identity, gpu_used=True)

    def worker_joined(self, worker: Worker) -> None:
        """A worker said READY and may take programs: a slot asked for one without a context has it."""
        self.lazy_asked.discard(worker.slot)
        self.dispatch()

    def _gpu_load(self) -> dict[int, int]:
        """Running programs per GPU, counting every GPU of a multi-GPU program, and the GPUs still
        held by a finished program's worker until it has exited (see WorkerMessages.on_exit): a
        program placed there would wait for that exit while another GPU stood free."""
        load = {g: 0 for g in self.gpu_ids}
        running: set[str] = set()
        for request in self.requests:
            if request.state == RequestState.RUNNING:
                running.add(request.id)
                for gpu in request.gpu_ids:
                    load[gpu] += 1
        for gpu in self.gpu_ids:
            holder = self.leases.holder_of(gpu)
            if holder is not None and holder not in running:
                load[gpu] += 1
        return load

    def _start(self, request: Request, worker: Worker) -> None:
        try:
            sent, frames, paths = self.intake.worker_blobs(request)
        except KeyError:
            # A disk copy turned out corrupt or unreadable and was dropped: the client sends it again.
            log.warning("request_blob_lost", request_id=request.id)
            self.pool.idle[worker.identity] = worker
            self.intake.negotiate(request, progressed=True)
            return
        if request.gpu_count and worker.gpu_view is not None:
            request.gpu_ids = worker.gpu_view  # a reused worker sees these GPUs and no others
        elif request.gpu_count:
            load = self._gpu_load()
            preferred = worker.gpu if worker.gpu in load else None
            # Sorted: CUDA numbers a program's GPUs in PCI (= index) order, so cuda:i is gpu_ids[i].
            request.gpu_ids = tuple(sorted(choose_gpus(load, request.gpu_count, preferred)))
        request.state = RequestState.RUNNING
        request.started_at = time.monotonic()
        request.worker = worker
        worker.request_id = request.id
        worker.programs += 1
        body = {
            "request_id": request.id,
            "program": request.program,
            "options": request.options.to_wire(),
            "gpu_ids": list(request.gpu_ids),
            "blobs": sent,
            "blob_paths": paths,
            "max_response_bytes": self.settings.max_response_bytes,
        }
        if request.gpu_ids and (grant := self.worker_messages.session_grant(request, worker)) is not None:
            body["grant"] = grant  # the session holds the lease: no LEASE round trip for it
        try:
            message = protocol.message(protocol.PROGRAM, body, *frames)
            send_now(self.backend, [worker.identity, *message])
        except zmq.ZMQError as exc:
            log.warning("worker_unreachable", worker=worker.name, error=str(exc))
            self.pool.forget(worker)
            worker.request_id = None
            request.state = RequestState.QUEUED
            self.queue.push_front(request)
            return
        # Made while the worker starts on the program, neither before the PROGRAM goes nor between
        # its RESULT and its FINAL: the provenance known now (the GPUs' conditions, NVML's few
        # calls per GPU; the program's fingerprint); and its successor asked for where it lacks one.
        request.provenance = self.provenance.at_start(
            request_id=request.id,
            program=request.program,
            digests=request.digests,
            options=request.options.to_wire(),
            gpu_ids=request.gpu_ids,
            node_id=self.node_id,
        )
        self.supervisor.program_started(worker.slot)
        request.timer = asyncio.get_running_loop().call_later(
            request.options.timeout_seconds, self._on_timeout, request
        )
        log.info(
            "request_started",
            request_id=request.id,
            worker=worker.name,
            gpu=list(request.gpu_ids),
            queue_ms=round((request.started_at - request.queued_at) * 1000, 2),
            blob_frames=len(frames),
            blob_paths=len(paths),
        )
        queued = request.take_queued_partial()  # where it came straight here: after its PROGRAM
        if queued is not None:
            self.tell(request, queued)
        self.tell(request, {"request_id": request.id, "state": "running", "gpu_ids": list(request.gpu_ids)})

    def _on_timeout(self, request: Request) -> None:
        if self.requests.get(request.id) is not request:
            return
        log.warning(
            "request_timeout",
            request_id=request.id,
            timeout_s=request.options.timeout_seconds,
            worker=request.worker.name if request.worker else None,
        )
        self._finish_error(
            request,
            "timeout",
            f"the program ran past its timeout of {request.options.timeout_seconds:g} s and was killed",
        )

    @property
    def node_id(self) -> str | None:
        """This broker's node id in results, where it serves a router."""
        return self.upstream.node_id if self.upstream is not None else None

    # --- replies ---

    def finish(self, request: Request, body: dict[str, Any], frames: list[Any]) -> None:
        """Answer a request once and forget it."""
        if self.requests.pop(request.id) is None:
            return
        now = time.monotonic()
        # First: the client waits for it, and nothing below changes it (this handler runs to its
        # end before the client's next message is read).
        self.shell.reply(request.client, protocol.FINAL, body, *frames)
        if request.timer is not None:
            request.timer.cancel()
        if request.lease_task is not None:
            request.lease_task.cancel()
        if not self.worker_messages.holds_lease(request.worker, request.id):
            self.leases.reclaim(request.id)  # held by a live worker: it goes back at the exit
        self.blobs.unpin_owner(request.id)
        self.intake.forget(request)
        if request.state == RequestState.QUEUED:
            self.queue.remove(request)
        request.state = RequestState.DONE
        result = body.get("result") or {}
        ran = request.started_at and request.queued_at
        self.metrics.program_finished(
            body,
            end_to_end_seconds=now - request.received_at,
            queue_seconds=(request.started_at - request.queued_at) if ran else None,
        )
        log.info(
            "request_finished",
            request_id=request.id,
            ok=body.get("ok"),
            status=result.get("status"),
            error=(body.get("error") or result.get("error") or {}).get("kind"),
        )

    def _finish_error(self, request: Request, kind: str, message: str) -> None:
        worker = request.worker
        running = request.state == RequestState.RUNNING and worker is not None
        self.finish(request, protocol.final_error_body(request.id, kind, message), [])
        if running and worker is not None:
            self.worker_messages.drop_session(worker)
            # The worker may be anywhere in the user's code: kill it and all it started.
            worker.request_id = None
            self.pool.forget(worker)
            self.supervisor.kill_worker(worker.slot, worker.identity)
        self.dispatch()

    def fail(self, request: Request, kind: str, message: str) -> None:
        self._finish_error(request, kind, message)

    def refuse(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        self.shell.refuse(client, request_id, kind, message)

    def tell(self, request: Request, body: dict[str, Any]) -> None:
        self.shell.reply(request.client, protocol.PARTIAL, body)

    def fail_internal(self, message: ClientMessage, exc: Exception) -> None:
        self.shell.fail_internal(message, exc)

    async def _heartbeat_loop(self) -> None:
        interval = protocol.HEARTBEAT_INTERVAL_SECONDS
        next_beat = time.monotonic()
        while True:
            # On a fixed schedule, so that a beat delayed by a busy loop is not followed by a full
            # interval more: what a client measures is the gap between two beats.
            next_beat = max(next_beat + interval, time.monotonic())
            await asyncio.sleep(next_beat - time.monotonic())
            self.orphans.gone(self.shell.heartbeat_clients())
            self._cancel_orphans()
            for session, why in self.sessions.ending(self._reachable):
                self.end_session(session, why)
            self._expire_queued()

    def _reachable(self, client: bytes) -> bool:
        """Whether a message to ``client`` can be routed (a HEARTBEAT is sent to find out)."""
        return self.shell.send(client, protocol.message(protocol.HEARTBEAT, {}))

    def _cancel_orphans(self) -> None:
        """Programs whose client's connection is gone: nobody will read their answers. Waiting
        ones end at once, running ones once the grace is over (kcoral.service.fairness)."""
        for request, running in self.orphans.to_cancel(self.requests, lambda r: r.state == RequestState.RUNNING):
            log.warning("client_gone_cancelling", request_id=request.id, running=running)
            self._finish_error(request, "cancelled", "the client disconnected")

    def _expire_queued(self) -> None:
        """A program never waits in the queue for ever: past the queue timeout it is refused."""
        now = time.monotonic()
        limit = self.settings.queue_timeout_seconds
        for request in [r for r in self.requests if r.state == RequestState.QUEUED and now - r.queued_at > limit]:
            log.warning("request_queue_timeout", request_id=request.id, waited_s=round(now - request.queued_at, 1))
            self._finish_error(request, "timeout", f"the program waited {limit:g} s in the queue without a free worker")

    # --- status ---

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        running = sum(1 for r in self.requests if r.state == RequestState.RUNNING)
        waiting = len(self.requests) - running
        return {
            "status": "draining" if self.draining else "ok",
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "hostname": self.hostname,
            "gpu_count": len(self.gpu_ids),
            "fake_gpus": self.target.fake,
            "frame_bytes": self.settings.max_frame_bytes,
            "connections": self.shell.connections.describe(),
            "load": {
                "request_capacity": len(self.supervisor.slots),
                "requests_in_progress": running,
                "requests_waiting": waiting,
                "max_queued": self.settings.max_queued,
            },
            "workers": {
                "slots": len(self.supervisor.slots),
                **self.pool.snapshot(),
                "zygotes": self.supervisor.snapshot(),
            },
            "leases": self.leases.snapshot(),
            "cache": {**self.blobs.stats(), "dir": str(self.settings.cache_dir)},
            "counters": self.metrics.counters(),
            **programs_in_flight([r.describe(now) for r in self.requests]),
            "sessions": self.sessions.snapshot(),
            "sandbox": self.settings.sandbox,
            "memory_accounting": self.cgroups.describe(),
            **({"sandbox_reason": self.settings.sandbox_reason} if self.settings.sandbox_reason else {}),
            # Once every worker slot has had a worker ready (the broker_ready line): readiness probes
            # ask for it, and for the upstream link's registration (kcoral status --ready).
            "ready": self.worker_messages.ready_announced,
            **({"upstream": self.upstream.describe()} if self.upstream is not None else {}),
            "target": self.target_wire,
            "versions": self.versions,
        }


__all__ = ["NEGOTIATION_TIMEOUT_SECONDS", "Broker", "BrokerSettings"]
