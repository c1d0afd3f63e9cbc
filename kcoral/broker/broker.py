"""The host broker: a ROUTER for clients, a ROUTER for workers, and the queue between them.

One asyncio loop (uvloop where installed) owns every piece of state: requests, idle workers, the
lease table and the blob store, so none of it needs locks. Workers live in zygote-forked processes
run by the :class:`~kcoral.broker.supervisor.Supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import signal
import socket as stdlib_socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.broker import slots
from kcoral.broker.blobs import BlobStore, BlobStoreSettings
from kcoral.broker.intake import OFF_LOOP_UPLOAD_BYTES, ProgramIntake
from kcoral.broker.leases import LeaseReclaimed, LeaseTable, choose_gpus
from kcoral.broker.requests import Request, RequestQueue, Worker, until_no_requests
from kcoral.broker.sockets import ImmediateSender, receive_forever, router_socket
from kcoral.broker.supervisor import SlotSpec, Supervisor, WorkerExit, zygote_command
from kcoral.broker.target import TargetInfo, describe_target, versions
from kcoral.broker.upstream import UpstreamLink, default_node_id

log = structlog.get_logger("kcoral.broker")

NEGOTIATION_TIMEOUT_SECONDS = 60.0  # a client that never sends its missing blobs is dropped
WORKER_EXIT_GRACE_SECONDS = 0.5  # a RESULT may still be in the socket when the exit is reported
MAX_REMEMBERED_EXITS = 10_000
MAX_EARLY_READY = 1024
EARLY_READY_SECONDS = 10.0
SHUTDOWN_DRAIN_SECONDS = protocol.MAX_TIMEOUT_SECONDS + 60


@dataclass(frozen=True)
class BrokerSettings:
    """Everything ``kcoral broker`` can be told; the CLI fills it from flags."""

    listen: str = "tcp://127.0.0.1:5555"
    device: str = "auto"  # "gpu", "cpu" or "auto"
    gpus: tuple[int, ...] | None = None  # None: every local GPU
    fake_gpus: int = 0
    workers_per_gpu: int = 1
    workers: int = 2  # CPU workers where there are no GPUs
    sandbox: str = "none"
    sandbox_reason: str = ""  # why there is none, when bubblewrap could not run (--sandbox auto)
    sandbox_readonly_paths: tuple[Path, ...] = ()
    max_programs_per_worker: int = 1
    # None: <run_dir>/cache, which a temporary run dir takes with it when the broker stops; give
    # --cache-dir (or --run-dir) for a disk cache that survives a restart.
    cache_dir: Path | None = None
    cache_bytes: int = 1 << 30
    cache_disk_bytes: int = 32 << 30
    max_queued: int = 1024
    queue_timeout_seconds: float = 3600.0
    max_request_bytes: int = protocol.DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = protocol.DEFAULT_MAX_RESPONSE_BYTES
    # How long a program waits for a round of its missing blobs; it must cover their upload time.
    negotiation_timeout_seconds: float = NEGOTIATION_TIMEOUT_SECONDS
    # Blobs at least this large that are in the disk cache reach the worker as a path to map, not
    # as a frame: no copy through the broker's memory and the ipc socket.
    blob_path_min_bytes: int = 1 << 20
    run_dir: Path | None = None
    limits: dict[str, int] = field(default_factory=dict)
    preload: str = "numpy,torch"
    # Join a kcoral router at this nodes endpoint (kcoral/broker/upstream.py), as this node id.
    upstream: str | None = None
    node_id: str | None = None


class Broker(ProgramIntake):
    """Serves programs from clients to workers on one host."""

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
        cache_dir = settings.cache_dir
        self.blobs = BlobStore(
            BlobStoreSettings(
                memory_bytes=settings.cache_bytes,
                disk_dir=cache_dir,
                disk_bytes=settings.cache_disk_bytes,
                disk_writable_by_others=settings.sandbox != "bubblewrap",
            )
        )
        self.requests: dict[str, Request] = {}
        self.queue: RequestQueue[Request] = RequestQueue()
        self.workers: dict[bytes, Worker] = {}
        self.idle: dict[bytes, Worker] = {}
        self.exited: dict[bytes, WorkerExit] = {}
        self.held_leases: dict[bytes, str] = {}  # worker identity -> the request whose lease it holds
        self.draining = False
        self.stopped = asyncio.Event()
        self.context = zmq.asyncio.Context()
        self.frontend = router_socket(self.context)
        self.backend = router_socket(self.context)
        self.frontend_out = ImmediateSender(self.frontend)
        self.backend_out = ImmediateSender(self.backend)
        self.worker_endpoint = f"ipc://{self.run_dir / 'ipc' / 'workers.sock'}"
        self.supervisor = Supervisor(self._slot_specs(), self._on_worker_exit, self._on_worker_forked)
        # READYs that arrived before their zygote's "forked" event was read.
        self.early_ready: dict[bytes, dict[str, Any]] = {}
        self.completed = 0
        self.failed = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.upstream: UpstreamLink | None = None
        self.ready_announced = False

    # --- setup ---

    def _slot_specs(self) -> list[SlotSpec]:
        from kcoral.sandbox.launcher import zygote_launcher

        # Checks once that bwrap runs (SandboxUnavailable otherwise), not once per slot.
        launcher = zygote_launcher(self.settings, self.run_dir)
        slots: list[SlotSpec] = []
        if self.gpu_ids:
            placement: list[int | None] = [g for g in self.gpu_ids for _ in range(self.settings.workers_per_gpu)]
        else:
            placement = [None] * self.settings.workers
        # Every slot's sandbox holds every GPU's node; each worker keeps its program's (confinement).
        gpu_nodes = launcher.gpu_binds(self.target)
        for slot, gpu in enumerate(placement):
            workspace = self.run_dir / "slots" / str(slot)
            argv = zygote_command(
                connect=self.worker_endpoint,
                slot=slot,
                gpu=gpu,
                workspace=launcher.workspace_inside(workspace),
                max_programs=self.settings.max_programs_per_worker,
                limits=self.settings.limits,
                preload=self.settings.preload,
            )
            argv = launcher.wrap(argv, slot=slot, workspace=workspace, gpu_nodes=gpu_nodes)
            slots.append(SlotSpec(slot, gpu, workspace, tuple(argv)))
        return slots

    async def serve(self) -> int:
        """Run until stopped (SIGTERM/SIGINT drain in-flight programs first); return the exit code."""
        (self.run_dir / "ipc").mkdir(parents=True, exist_ok=True)
        self.frontend.setsockopt(zmq.MAXMSGSIZE, max(self.settings.max_request_bytes, protocol.MAX_BODY_BYTES))
        self.frontend.bind(self.settings.listen)
        self.backend.bind(self.worker_endpoint)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.drain)
        await self.supervisor.start()
        self._tasks = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._worker_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]
        if self.settings.upstream:
            node_id = self.settings.node_id or default_node_id(self.settings.listen)
            self.upstream = UpstreamLink(
                context=self.context, upstream=self.settings.upstream, node_id=node_id, health=self.health
            )
            # The relay is a client of this broker over inproc (see kcoral/broker/upstream.py).
            self.frontend.bind(self.upstream.local_endpoint)
            self.upstream.start()
        log.info(
            "broker_listening",
            endpoint=self.settings.listen,
            gpus=list(self.gpu_ids),
            slots=len(self.supervisor.slots),
            sandbox=self.settings.sandbox,
            instance_id=self.instance_id,
        )
        if self.settings.sandbox == "none":
            # Loud: programs then share the broker's user, files and network, and nothing but the
            # process limits stands between them (see the README, "Worker limits").
            log.warning("sandbox_none_programs_not_isolated", reason=self.settings.sandbox_reason)
        await self.stopped.wait()
        await self.close()
        return 0

    def drain(self) -> None:
        """Stop taking programs; finish those in flight, then stop."""
        if self.draining:
            return
        self.draining = True
        log.info("broker_draining", in_flight=len(self.requests))
        asyncio.get_running_loop().create_task(self._finish_draining())

    async def _finish_draining(self) -> None:
        await until_no_requests(self.requests, SHUTDOWN_DRAIN_SECONDS)
        self.stopped.set()

    async def close(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()  # its sockets must be closed before the context ends
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.supervisor.stop()
        self.frontend.close(linger=0)
        self.backend.close(linger=0)
        self.context.term()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("broker_stopped", completed=self.completed, failed=self.failed)

    # --- clients ---

    async def _client_loop(self) -> None:
        await receive_forever(self.frontend, self._handle_client, "client_message_failed")

    def _handle_client(self, frames: list[zmq.Frame]) -> None:
        client = bytes(frames[0].buffer)
        try:
            command, body, data = protocol.split_message([f.buffer for f in frames[1:]])
        except protocol.WireError as exc:
            log.warning("bad_client_message", error=str(exc), frames=len(frames) - 1)
            self._answer_unreadable(client, frames, exc)
            return
        request_id = body.get("request_id")
        try:
            request_id = protocol.check_id(request_id, "request_id")
        except protocol.WireError as exc:
            log.warning("bad_client_message", error=str(exc), command=command.hex())
            return
        try:
            self._dispatch_command(client, command, request_id, body, data)
        except Exception as exc:
            self._fail_internal(client, request_id, command, exc)

    def _fail_internal(self, client: bytes, request_id: str, command: bytes, exc: Exception) -> None:
        """A bug must not leave a request in limbo with its client waiting: answer it."""
        log.exception("client_command_failed", request_id=request_id, command=command.hex())
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_error(request, "engine", f"internal error in the broker: {exc!r}")
        else:
            self._reply_error(client, request_id, "engine", f"internal error in the broker: {exc!r}")

    def _answer_unreadable(self, client: bytes, frames: list[zmq.Frame], exc: protocol.WireError) -> None:
        """Answer a message the broker cannot read, where its request id can still be found, so
        its sender is told why instead of waiting."""
        if len(frames) < 4 or bytes(frames[1].buffer) != protocol.VERSION:
            return
        try:
            request_id = protocol.peek_request_id(frames[3].buffer)
        except protocol.WireError:
            return
        if request_id not in self.requests:
            self._reply_error(client, request_id, "parse", f"unreadable message: {exc}")

    def _dispatch_command(
        self, client: bytes, command: bytes, request_id: str, body: dict[str, Any], data: list[Any]
    ) -> None:
        if command in (protocol.EXECUTE, protocol.BLOBS) and sum(len(f) for f in data) >= OFF_LOOP_UPLOAD_BYTES:
            # Hashing and writing a large upload takes seconds: do it in a thread, so heartbeats,
            # leases and other clients are served meanwhile.
            task = asyncio.get_running_loop().create_task(self._prepare_then(client, command, request_id, body, data))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif command == protocol.EXECUTE:
            self._on_execute(client, request_id, body, data)
        elif command == protocol.BLOBS:
            self._on_blobs(client, request_id, body, data)
        elif command == protocol.CANCEL:
            self._on_cancel(client, request_id)
        elif command == protocol.HEALTH:
            self._reply_ok(client, request_id, self.health())
        elif command == protocol.TARGET:
            self._reply_ok(client, request_id, self.target.to_wire())
        else:
            self._reply_error(client, request_id, "parse", f"unknown command {command.hex()}")

    def _on_cancel(self, client: bytes, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None or request.client != client:
            return
        log.info("request_cancelled", request_id=request_id, state=request.state)
        self._finish_error(request, "cancelled", "the client cancelled the program")

    # --- dispatch ---

    def _dispatch(self) -> None:
        while self.idle:
            request = self.queue.pop()
            if request is None:
                return
            worker = self._pick_worker(request.gpu_count)
            if worker is None:
                # Every idle worker is a reused one confined to a different number of GPUs (see
                # kcoral.worker.confinement): retire one; its slot's fresh worker takes the program.
                self._retire_idle_worker()
                self.queue.push_front(request)
                return
            self._start(request, worker)

    def _retire_idle_worker(self) -> None:
        identity, worker = self.idle.popitem()
        self.workers.pop(identity, None)
        log.info("worker_retired", worker=identity.decode(), reason="confined to other GPUs")
        self.supervisor.kill_worker(worker.slot)

    def _gpu_load(self) -> dict[int, int]:
        """Running programs per GPU, counting every GPU of a multi-GPU program."""
        load = {g: 0 for g in self.gpu_ids}
        for request in self.requests.values():
            if request.state == "running":
                for gpu in request.gpu_ids:
                    load[gpu] += 1
        return load

    def _pick_worker(self, gpu_count: int) -> Worker | None:
        """The least busy idle worker that can run a program on ``gpu_count`` GPUs, if any."""
        load = self._gpu_load()

        def busyness(identity: bytes) -> tuple[int, int]:
            worker = self.idle[identity]
            return (load.get(worker.gpu, 0) if worker.gpu is not None else 0, worker.slot)

        fits = [i for i, w in self.idle.items() if w.gpu_view is None or len(w.gpu_view) == gpu_count]
        return self.idle.pop(min(fits, key=busyness)) if fits else None

    def _start(self, request: Request, worker: Worker) -> None:
        try:
            sent, frames, paths = self._program_blobs(request)
        except KeyError:
            # A disk copy turned out corrupt or unreadable and was dropped: the client sends it again.
            log.warning("request_blob_lost", request_id=request.id)
            self.idle[worker.identity] = worker
            self._negotiate(request, progressed=True)
            return
        if request.gpu_count and worker.gpu_view is not None:
            request.gpu_ids = worker.gpu_view  # a reused worker sees these GPUs and no others
        elif request.gpu_count:
            load = self._gpu_load()
            preferred = worker.gpu if worker.gpu in load else None
            # Sorted: CUDA numbers a program's GPUs in PCI (= index) order, so cuda:i is gpu_ids[i].
            request.gpu_ids = tuple(sorted(choose_gpus(load, request.gpu_count, preferred)))
        request.state = "running"
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
        try:
            message = protocol.message(protocol.PROGRAM, body, *frames)
            self.backend_out.send([worker.identity, *message])
            # The socket's file descriptor is edge-triggered: a send through the shadow can take
            # the edge that announced incoming messages, and the asyncio recv would then sleep
            # until the next one (seconds, with 8 programs in flight). Re-check its events now.
        except zmq.ZMQError as exc:
            log.warning("worker_unreachable", worker=worker.identity.decode(), error=str(exc))
            self.workers.pop(worker.identity, None)
            worker.request_id = None
            request.state = "queued"
            self.queue.push_front(request)
            return
        request.timer = asyncio.get_running_loop().call_later(
            request.options.timeout_seconds, self._on_timeout, request
        )
        log.info(
            "request_started",
            request_id=request.id,
            worker=worker.identity.decode(),
            gpu=list(request.gpu_ids),
            queue_ms=round((request.started_at - request.queued_at) * 1000, 2),
            blob_frames=len(frames),
            blob_paths=len(paths),
        )
        self._send_client(
            request.client,
            protocol.PARTIAL,
            {"request_id": request.id, "state": "running", "gpu_ids": list(request.gpu_ids)},
        )

    def _on_timeout(self, request: Request) -> None:
        if self.requests.get(request.id) is not request:
            return
        log.warning(
            "request_timeout",
            request_id=request.id,
            timeout_s=request.options.timeout_seconds,
            worker=request.worker.identity.decode() if request.worker else None,
        )
        self._finish_error(
            request,
            "timeout",
            f"the program ran past its timeout of {request.options.timeout_seconds:g} s and was killed",
        )

    # --- workers ---

    async def _worker_loop(self) -> None:
        await receive_forever(self.backend, self._handle_worker, "worker_message_failed")

    def _handle_worker(self, frames: list[zmq.Frame]) -> None:
        identity = bytes(frames[0].buffer)
        try:
            oversized = slots.oversized_result([f.buffer for f in frames[1:]])
            command, body, data = protocol.split_message([f.buffer for f in frames[1:]])
        except protocol.WireError as exc:
            log.warning("bad_worker_message", worker=identity.decode(errors="replace"), error=str(exc))
            self._fail_unreadable_result(identity, oversized, exc)
            return
        if oversized is not None:
            self._fail_unreadable_result(identity, oversized, None)
            return
        if command == protocol.READY:
            self._on_ready(identity, body)
            return
        worker = self.workers.get(identity)
        if worker is None:
            return
        request = self.requests.get(worker.request_id or "")
        if request is None or body.get("request_id") != request.id:
            return
        if command == protocol.LEASE:
            if request.lease_task is None or request.lease_task.done():
                request.lease_task = asyncio.create_task(self._grant_lease(request, worker))
        elif command == protocol.PROGRESS:
            index = body.get("index")
            request.instruction_index = index if isinstance(index, int) else None
        elif command == protocol.RESULT:
            self._on_result(request, worker, body, data)

    def _on_ready(self, identity: bytes, body: dict[str, Any]) -> None:
        slot = body.get("slot")
        if not isinstance(slot, int) or slot not in self.supervisor.states:
            log.warning("bad_ready", worker=identity.decode(errors="replace"))
            return
        if identity in self.exited or identity in self.workers:
            return  # it died before its READY was read, or says READY twice
        if self.supervisor.states[slot].worker != identity.decode(errors="replace"):
            # Only the worker its zygote forked may take programs: anything else that reaches the
            # socket (a program, say) must never be handed other clients' work. The forked event
            # may simply not have been read yet: keep the READY a while.
            if len(self.early_ready) < MAX_EARLY_READY:
                self.early_ready[identity] = body
                asyncio.get_running_loop().call_later(EARLY_READY_SECONDS, self._forget_early_ready, identity)
            return
        gpu = self.supervisor.states[slot].spec.gpu
        worker = Worker(identity, slot, gpu, int(body.get("pid") or 0))
        self.workers[identity] = worker
        self.idle[identity] = worker
        log.debug("worker_ready", worker=identity.decode(), gpu=gpu, slot=slot)
        if not self.ready_announced and len(self.idle) >= len(self.supervisor.slots):
            # The line an operator (or a script) waits for: every slot has a worker, programs run now.
            self.ready_announced = True
            log.info("broker_ready", endpoint=self.settings.listen, slots=len(self.idle), gpus=list(self.gpu_ids))
        self._dispatch()

    def _on_worker_forked(self, slot: int, worker: str) -> None:
        body = self.early_ready.pop(worker.encode(), None)
        if body is not None and body.get("slot") == slot:
            self._on_ready(worker.encode(), body)

    def _forget_early_ready(self, identity: bytes) -> None:
        if self.early_ready.pop(identity, None) is not None:
            log.warning("ready_from_unknown_worker", worker=identity.decode(errors="replace"))

    async def _grant_lease(self, request: Request, worker: Worker) -> None:
        try:
            grant = await self.leases.acquire(request.id, request.gpu_ids)
        except (LeaseReclaimed, asyncio.CancelledError):
            return
        if self.requests.get(request.id) is not request or request.state != "running" or worker.identity in self.exited:
            self.leases.release(request.id)
            return
        # Held until the zygote reports this worker's exit (see _on_worker_exit), whatever the
        # worker says: until then its program could still run work on the GPU.
        self.held_leases[worker.identity] = request.id
        request.lease_times = (grant.requested_at, grant.granted_at)
        try:
            self.backend_out.send([worker.identity, *protocol.message(protocol.GRANT, {"request_id": request.id})])
        except zmq.ZMQError:
            self.leases.release(request.id)

    def _on_result(self, request: Request, worker: Worker, body: dict[str, Any], data: list[Any]) -> None:
        worker.request_id = None
        if worker.exited:
            self.workers.pop(worker.identity, None)
        raw_info = body.get("worker")
        info: dict[str, Any] = raw_info if isinstance(raw_info, dict) else {}
        reusable = slots.reusable(worker, self.settings.max_programs_per_worker)
        if info.get("reusable") and reusable and worker.identity in self.workers:
            holder = self.held_leases.pop(worker.identity, None)
            if holder is not None:  # a worker reused is trusted between programs (slots.reusable)
                self.leases.release(holder)
            view = info.get("gpu_view")
            if isinstance(view, list) and all(isinstance(g, int) and g in self.leases.gpus for g in view):
                worker.gpu_view = tuple(sorted(view))
            self.idle[worker.identity] = worker
        else:
            if info.get("retire_reason"):
                log.info("worker_retired", worker=worker.identity.decode(), reason=info.get("retire_reason"))
            if not worker.exited:
                self.supervisor.prepare_next_worker(worker.slot)
        response_bytes = sum(len(f) for f in data)
        error = body.get("error")
        # The worker stops at the limit (error kind response_too_large) instead of sending it all.
        stopped = isinstance(error, dict) and error.get("kind") == "response_too_large"
        if stopped or response_bytes > self.settings.max_response_bytes:
            self._finish_error(
                request,
                "response_too_large",
                f"the results are over {self.settings.max_response_bytes} bytes, the most this broker returns",
            )
            self._dispatch()
            return
        queue_ms = (request.started_at - request.queued_at) * 1000
        result = protocol.with_broker_fields(
            body, request_id=request.id, queue_ms=queue_ms, gpu_ids=request.gpu_ids, node_id=self._node_id()
        )
        result.update(slots.lease_times(request.lease_times, time.monotonic()))
        self._finish(request, protocol.final_body(request.id, result), data)
        self._dispatch()

    def _on_worker_exit(self, exit: WorkerExit) -> None:
        identity = exit.worker.encode()
        self.exited[identity] = exit
        if len(self.exited) > MAX_REMEMBERED_EXITS:
            self.exited.pop(next(iter(self.exited)))
        self.idle.pop(identity, None)
        holder = self.held_leases.pop(identity, None)
        if holder is not None:
            # The worker and all it started are gone (the zygote says so only then): the GPU is free.
            self.leases.reclaim(holder)
        worker = self.workers.get(identity)
        if worker is None or worker.request_id is None:
            self.workers.pop(identity, None)
            return
        request = self.requests.get(worker.request_id)
        if request is None:
            self.workers.pop(identity, None)
            return
        # Keep the worker known for a moment: its RESULT may still be queued in the socket.
        worker.exited = True
        asyncio.get_running_loop().call_later(WORKER_EXIT_GRACE_SECONDS, self._fail_crashed, request, worker, exit)

    def _fail_crashed(self, request: Request, worker: Worker, exit: WorkerExit) -> None:
        self.workers.pop(worker.identity, None)
        if self.requests.get(request.id) is not request or request.worker is not worker:
            return
        index = exit.instruction_index if exit.instruction_index is not None else request.instruction_index
        log.warning("worker_died", request_id=request.id, worker=exit.worker, how=exit.describe())
        message = f"worker exited while executing the instruction ({exit.describe()})"
        self._finish_failed(request, "runtime", message, index)

    def _fail_unreadable_result(
        self, identity: bytes, oversized: str | None, exc: protocol.WireError | None
    ) -> None:
        """A message from a running worker that cannot become a FINAL: fail its program clearly."""
        worker = self.workers.get(identity)
        request = self.requests.get(worker.request_id or "") if worker is not None else None
        if request is None or worker is None:
            return
        log.warning("unreadable_result", request_id=request.id, worker=identity.decode(), error=oversized or str(exc))
        if oversized is not None:
            self._finish_error(request, "response_too_large", oversized)
        else:
            self._finish_failed(request, "serialization", f"the worker's result could not be read: {exc}", None)

    def _finish_failed(self, request: Request, kind: str, message: str, index: int | None) -> None:
        """Answer a running program with a FAILED result the broker writes itself."""
        instructions = request.program.get("instructions", [])
        ins = instructions[index] if index is not None and index < len(instructions) else {}
        lease = slots.lease_times(request.lease_times, time.monotonic())
        result = protocol.program_result(
            request.id,
            error=protocol.instruction_error(kind, message, index, ins),
            queue_ms=(request.started_at - request.queued_at) * 1000,
            elapsed_ms=(time.monotonic() - request.started_at) * 1000,
            lease_wait_ms=lease["lease_wait_ms"],
            lease_held_ms=lease["lease_held_ms"],
            gpu_ids=request.gpu_ids,
            node_id=self._node_id(),
        )
        worker = request.worker
        self._finish(request, protocol.final_body(request.id, result), [])
        if worker is not None and not worker.exited:
            worker.request_id = None
            self.workers.pop(worker.identity, None)
            self.supervisor.kill_worker(worker.slot)
        self._dispatch()

    def _node_id(self) -> str | None:
        """This broker's node id in results, where it serves a router."""
        return self.upstream.node_id if self.upstream is not None else None

    # --- replies ---

    def _finish(self, request: Request, body: dict[str, Any], frames: list[Any]) -> None:
        """Answer a request once and forget it."""
        if self.requests.pop(request.id, None) is None:
            return
        if request.timer is not None:
            request.timer.cancel()
        if request.lease_task is not None:
            request.lease_task.cancel()
        if request.worker is None or self.held_leases.get(request.worker.identity) != request.id:
            self.leases.reclaim(request.id)  # held by a live worker: it goes back at the exit
        self.blobs.unpin_owner(request.id)
        if request.state == "queued":
            self.queue.remove(request)
        result = body.get("result") or {}
        if body.get("ok") and result.get("status") == "COMPLETED":
            self.completed += 1
        else:
            self.failed += 1
        request.state = "done"
        self._send_client(request.client, protocol.FINAL, body, *frames)
        log.info(
            "request_finished",
            request_id=request.id,
            ok=body.get("ok"),
            status=result.get("status"),
            error=(body.get("error") or result.get("error") or {}).get("kind"),
        )

    def _finish_error(self, request: Request, kind: str, message: str) -> None:
        worker = request.worker
        running = request.state == "running" and worker is not None
        self._finish(request, protocol.final_error_body(request.id, kind, message), [])
        if running and worker is not None:
            # The worker may be anywhere in the user's code: kill it and all it started.
            worker.request_id = None
            self.workers.pop(worker.identity, None)
            self.supervisor.kill_worker(worker.slot)
        self._dispatch()

    def _reply_ok(self, client: bytes, request_id: str, result: dict[str, Any]) -> None:
        self._send_client(client, protocol.FINAL, protocol.final_body(request_id, result))

    def _reply_error(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        log.info("request_refused", request_id=request_id, kind=kind, reason=message)
        self._send_client(client, protocol.FINAL, protocol.final_error_body(request_id, kind, message))

    def _send_client(self, client: bytes, command: bytes, body: dict[str, Any], *frames: Any) -> None:
        try:
            self.frontend_out.send([client, *protocol.message(command, body, *frames)])
        except zmq.ZMQError as exc:
            # ROUTER_MANDATORY: the client is gone; nothing is waiting for this reply.
            log.info("client_unreachable", request_id=body.get("request_id"), error=str(exc))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(protocol.HEARTBEAT_INTERVAL_SECONDS)
            for client in {r.client for r in self.requests.values()}:
                self._send_client(client, protocol.HEARTBEAT, {})
            self._expire_queued()

    def _expire_queued(self) -> None:
        """A program never waits in the queue for ever: past the queue timeout it is refused."""
        now = time.monotonic()
        limit = self.settings.queue_timeout_seconds
        for request in [r for r in self.requests.values() if r.state == "queued" and now - r.queued_at > limit]:
            log.warning("request_queue_timeout", request_id=request.id, waited_s=round(now - request.queued_at, 1))
            self._finish_error(request, "timeout", f"the program waited {limit:g} s in the queue without a free worker")

    # --- status ---

    def health(self) -> dict[str, Any]:
        running = sum(1 for r in self.requests.values() if r.state == "running")
        waiting = len(self.requests) - running
        return {
            "status": "draining" if self.draining else "ok",
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "hostname": stdlib_socket.gethostname(),
            "gpu_count": len(self.gpu_ids),
            "fake_gpus": self.target.fake,
            "load": {
                "request_capacity": len(self.supervisor.slots),
                "requests_in_progress": running,
                "requests_waiting": waiting,
                "max_queued": self.settings.max_queued,
            },
            "workers": {
                "slots": len(self.supervisor.slots),
                "idle": len(self.idle),
                "busy": sum(1 for w in self.workers.values() if w.request_id is not None),
                "zygotes": self.supervisor.snapshot(),
            },
            "leases": self.leases.snapshot(),
            "cache": {**self.blobs.stats(), "dir": str(self.settings.cache_dir)},
            "counters": {"completed": self.completed, "failed": self.failed},
            "sandbox": self.settings.sandbox,
            **({"sandbox_reason": self.settings.sandbox_reason} if self.settings.sandbox_reason else {}),
            "target": self.target.to_wire(),
            "versions": versions(),
        }


async def run_broker(settings: BrokerSettings) -> int:
    broker = Broker(settings)
    return await broker.serve()


def install_event_loop_policy() -> None:
    """Use uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


__all__ = ["Broker", "BrokerSettings", "install_event_loop_policy", "run_broker"]
