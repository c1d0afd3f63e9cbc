"""The router: one endpoint for the host brokers (nodes) of many GPU machines.

Clients speak the same protocol to a router as to a broker (docs/protocol.md), so
``Client(router_url)`` works unchanged. Host brokers started with ``--upstream`` connect OUT to the
router's nodes endpoint (kcoral/broker/upstream.py), register, and then exchange NODE_HEARTBEATs
with it every HEARTBEAT_INTERVAL_SECONDS; the command bytes are in kcoral/protocol/node_link.py.

What the router does, and why:

- It answers HEALTH and TARGET itself (sums and the ``nodes`` list; TARGET merges the nodes'
  targets), and keeps EXECUTEs in a bounded queue (``--max-queued``: ``busy`` when full) until a
  node has a free worker slot. Holding work here instead of in the nodes' queues lets whichever
  node frees up first take it.
- Dispatch: among the nodes with a free slot and enough GPUs for the program, those missing the
  fewest of its blobs (digests the node was sent, or had when it said ``queued``: a bounded set per
  node, an approximation because a node's cache may have evicted them); then the less loaded
  (running / slots) of two picked at random, which spreads load as well as a full scan with far
  less herding onto one node when many routers' views are stale.
- The EXECUTE and the node's answers travel unchanged, frame for frame and without copies: the
  router decodes EXECUTE (to validate it and learn its blobs and gpu_count) and PARTIAL bodies, but
  routes a FINAL, whose result tree may be large, by its ``request_id`` alone; its body is decoded
  for the metrics once it has gone on. A node's answer goes on before the router's own bookkeeping
  (counts, log, the request's state), which its client does not wait for. The node relay's
  negotiation of blobs thus runs end to end between the client and the node's broker: BLOBS and
  CANCEL go to the node that has the request.
- A node that is silent for HEARTBEAT_LIVENESS intervals, says it leaves, or registers again
  under a new link (it restarted) leaves the pool; its in-flight programs fail with ``node_lost``
  and are never replayed (a program may have had side effects). It rejoins when it registers.
  A node about to store a large upload (its broker hashes and writes it on its event loop, about
  3 s per GiB, and cannot heartbeat meanwhile) announces ``quiet_seconds`` first, and is not taken
  for lost before they are up; nor is any node while node messages wait unread in this router.
- A router without nodes answers HEALTH (``nodes: []``) and queues programs for up to
  ``--node-wait`` seconds (default 10) after the pool became empty, so that a router restart or a
  node restart does not fail the programs submitted meanwhile; once the pool has been empty that
  long, queued and new programs are refused at once with ``busy``. A program that asks for more
  GPUs than any registered node has is refused with ``capacity``.
- Sends never wait: ROUTER_MANDATORY sockets written with NOBLOCK (kcoral/service/sockets.py), so
  an unreachable client or node shows up as an error here and now.
"""

from __future__ import annotations

import asyncio
import platform
import random
import socket as stdlib_socket
import time
import uuid
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.router.node_messages import NodeMessages
from kcoral.router.nodes import (
    Node,
    RouterRequest,
    RouterRequestState,
    choose_node,
    merged_target,
)
from kcoral.router.settings import NODE_WAIT_SECONDS, RouterSettings
from kcoral.service import auth
from kcoral.service.admission import AdmissionPolicy, Refusal, admit_execute, refuse_gpu_count
from kcoral.service.fairness import OrphanWatch, UploadBudget, client_queue_limit
from kcoral.service.identity import versions
from kcoral.service.metrics import ServiceMetrics, programs_in_flight
from kcoral.service.queue import RequestQueue
from kcoral.service.shell import ClientMessage, ServiceShell, ShellSettings
from kcoral.service.sockets import receive_forever, router_socket

log = structlog.get_logger("kcoral.router")

# The liveness of nodes is checked this many times per heartbeat interval, so that a dead node is
# noticed soon after its HEARTBEAT_LIVENESS intervals are up, not up to an interval later.
CHECKS_PER_INTERVAL = 4
GOODBYE_LINGER_MS = 200


class Router:
    """Queues clients' programs and dispatches them to registered host brokers.

    It holds a :class:`~kcoral.service.shell.ServiceShell` (the client side, as the broker does) and
    :class:`~kcoral.router.node_messages.NodeMessages` (the node table and what the nodes say), and
    runs the rest itself: admission, the queue, dispatch to a node, timeouts, the FINAL, health.
    """

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.metrics = ServiceMetrics("router", self.health)
        self.shell: ServiceShell[RouterRequest] = ServiceShell(
            "router", ShellSettings.of(settings), fail_request=self.fail, metrics=self.metrics
        )
        self.orphans = OrphanWatch(settings.orphan_grace_seconds)
        per_client = client_queue_limit(settings.max_queued, settings.max_queued_per_client)
        self.admission = AdmissionPolicy("router", settings.max_queued, per_client, settings.max_request_bytes)
        # Bytes of uploads passing through to the nodes, per client and in all, as a broker bounds
        # its own: what the nodes asked for, or the bytes received if more.
        self.uploads: UploadBudget[bytes] = UploadBudget(*settings.upload_bounds)
        self.shell.handlers.update(
            {
                protocol.EXECUTE: self._on_execute,
                protocol.BLOBS: self._on_blobs,
                protocol.CANCEL: self._on_cancel,
                protocol.HEALTH: self.shell.answer(self.health),
                protocol.TARGET: self.shell.answer(self.target),
            }
        )
        self.requests = self.shell.requests
        self.backend = router_socket(self.shell.context)
        self.queue: RequestQueue[RouterRequest] = RequestQueue()
        self.node_messages = NodeMessages(
            settings, backend=self.backend, router_instance_id=self.instance_id, port=self
        )
        self.nodes = self.node_messages.nodes  # the node side's table of live nodes, by link identity
        self.finished = 0
        self.random = random.Random()
        # What does not change while the router runs, found once: HEALTH may be polled often.
        self.hostname = stdlib_socket.gethostname()
        self.versions = versions()
        self.platform = platform.platform()

    # --- lifecycle ---

    async def serve(self) -> int:
        """Serve until stopped; return the exit code. ``shell.drain()`` (SIGTERM, Ctrl-C: the CLI
        installs the signals) finishes the programs in flight first, ``shell.stop()`` does not."""
        auth.check_listen(
            self.settings.nodes_listen,
            secured=self.settings.security is not None,
            insecure_listen_any=self.settings.insecure_listen_any,
            flag="--nodes-listen",
        )
        return await self.shell.serve(self._open, self._release, self._counters)

    async def _open(self) -> None:
        if self.settings.security is not None:
            # Only the host brokers whose keys are listed may register: anyone else could pose as
            # a node and be sent other people's programs.
            self.settings.security.apply(self.backend, auth.NODES_DOMAIN)
        self.backend.bind(self.settings.nodes_listen)
        nodes = receive_forever(self.backend, self.node_messages.on_message, "node_message_failed")
        self.shell.spawn(nodes, name="nodes")
        self.shell.spawn(self._tick_loop(), name="ticks")
        log.info(
            "router_listening",
            endpoint=self.settings.listen,
            nodes_endpoint=self.settings.nodes_listen,
            instance_id=self.instance_id,
        )

    async def _release(self) -> None:
        # Nodes register again at once with whichever router comes next, instead of waiting for
        # HEARTBEAT_LIVENESS intervals of silence.
        goodbye = protocol.message(protocol.NODE_DISCONNECT, {"reason": "router stopping"})
        for node in list(self.nodes.values()):
            self.node_messages.send(node.identity, goodbye)
        self.backend.close(linger=GOODBYE_LINGER_MS)

    def _counters(self) -> dict[str, Any]:
        lost = self.node_messages.programs_lost
        return {**self.metrics.counters(), "finished": self.finished, "node_lost": lost, "refused": self.shell.refused}

    # --- clients ---

    def _on_execute(self, message: ClientMessage) -> None:
        client, request_id, owner = message.client, message.request_id, message.owner or message.client
        admitted = admit_execute(
            message.body,
            self.admission,
            already_in_flight=request_id in self.requests,
            draining=self.shell.draining,
            waiting=len(self.queue),
            client_waiting=self.queue.queued_by(owner),
            capacity=lambda options: self._unservable(options.gpu_count or 0, queued_for=None),
        )
        if isinstance(admitted, Refusal):
            self.shell.refuse(client, request_id, *admitted)
            return
        gpu_count, digests = admitted.options.gpu_count or 0, admitted.digests
        request = RouterRequest(request_id, client, gpu_count, digests, message.frames, owner=owner)
        request.sizes = admitted.sizes
        request.bytes_received = message.data_bytes
        refusal = self.uploads.reserve(request_id, owner, request.bytes_received)
        if refusal is not None:
            self.shell.refuse(client, request_id, refusal.kind, refusal.message)
            return
        self.requests.add(request)
        self.queue.push(request)
        log.info("request_received", request_id=request_id, blobs=len(digests), gpu_count=gpu_count or None)
        self.dispatch()

    def _unservable(self, gpu_count: int, queued_for: float | None) -> Refusal | None:
        """(kind, message) when a program needing ``gpu_count`` GPUs should be refused now;
        ``queued_for`` is how long it has waited in the queue, None for one just arrived."""
        if not self.nodes:
            empty_for = time.monotonic() - (self.node_messages.pool_empty_since or time.monotonic())
            if empty_for >= self.settings.node_wait_seconds:
                return Refusal("busy", f"no host broker has been registered with this router for {empty_for:.0f} s")
            return None
        most = max(node.gpu_count for node in self.nodes.values())
        # A queued program gets node_wait seconds for a larger node (one restarting) to come back.
        if queued_for is None or queued_for >= self.settings.node_wait_seconds:
            return refuse_gpu_count(gpu_count, most, where="the largest node")
        return None

    def _on_blobs(self, message: ClientMessage) -> None:
        request = self.requests.of(message.client, message.request_id)
        if request is None or request.node is None:
            text = "BLOBS for no request that is waiting for blobs"
            self.shell.refuse(message.client, message.request_id, "parse", text)
            return
        node = request.node
        request.bytes_received += message.data_bytes
        if request.bytes_received > self.settings.max_request_bytes:
            limit = self.settings.max_request_bytes
            self._refuse_upload(request, "request_too_large", f"the program's uploads exceed {limit} bytes")
            return
        refusal = self.uploads.reserve(request.id, request.owner, request.bytes_received)
        if refusal is not None:
            self._refuse_upload(request, refusal.kind, refusal.message)
            return
        if not self.node_messages.send(node.identity, message.frames):
            self.fail(request, "node_lost", f"node {node.node_id} cannot be reached")
            return
        sent = message.body.get("blobs")
        if isinstance(sent, list):
            node.remember_blobs([d for d in sent if isinstance(d, str)], self.settings.node_blob_memory)

    def uploads_asked(self, request: RouterRequest, body: dict[str, Any]) -> bool:
        blobs, offsets = body.get("blobs"), body.get("offsets")
        offsets = offsets if isinstance(offsets, dict) else {}
        if not isinstance(blobs, list):
            return True  # the client reads the node's message and finds it bad
        asked = 0
        for digest in {d for d in blobs if isinstance(d, str)}:
            offset = offsets.get(digest, 0)
            asked += max(0, request.sizes.get(digest, 0) - (offset if isinstance(offset, int) else 0))
        refusal = self.uploads.reserve(request.id, request.owner, request.bytes_received + asked)
        if refusal is None:
            return True
        self._refuse_upload(request, refusal.kind, refusal.message)
        return False

    def uploads_done(self, request: RouterRequest) -> None:
        self.uploads.release(request.id)

    def _refuse_upload(self, request: RouterRequest, kind: str, text: str) -> None:
        """End a request whose upload went past a bound, at its node too."""
        if request.node is not None:
            cancel = protocol.message(protocol.CANCEL, {"request_id": request.id})
            self.node_messages.send(request.node.identity, cancel)
        self.fail(request, kind, text)

    def _on_cancel(self, message: ClientMessage) -> None:
        request = self.requests.of(message.client, message.request_id)
        if request is None:
            return
        log.info("request_cancelled", request_id=request.id, node=request.node.node_id if request.node else None)
        node = request.node
        cancel = protocol.message(protocol.CANCEL, {"request_id": request.id})
        if node is None or not self.node_messages.send(node.identity, cancel):
            # Still here, or its node cannot be told (the node cancels what it holds when it finds
            # its link gone): the program is cancelled for the client either way.
            self.fail(request, "cancelled", "the client cancelled the program")

    # --- dispatch ---

    def dispatch(self) -> None:
        ready = [n for n in self.nodes.values() if n.dispatchable]
        if not ready or not self.queue:
            return
        deferred: list[RouterRequest] = []
        while ready:
            request = self.queue.pop()
            if request is None:
                break
            node = choose_node(request, ready, self.random)
            if node is None or not self._start(request, node):
                deferred.append(request)
            ready = [n for n in ready if n.dispatchable]
        # Those that fit no free node keep their place at the head of their client's queue.
        for request in reversed(deferred):
            self.queue.push_front(request, serve_client_next=False)

    def _start(self, request: RouterRequest, node: Node) -> bool:
        assert request.frames is not None
        if not self.node_messages.send(node.identity, request.frames):
            node.reachable = False  # not chosen again until it is heard from
            return False
        request.node = node
        request.state = RouterRequestState.DISPATCHED
        request.frames = None  # the node has the program and its attached blobs now
        node.requests[request.id] = request
        node.dispatched += 1
        log.info(
            "request_dispatched",
            request_id=request.id,
            node=node.node_id,
            queue_ms=round((time.monotonic() - request.received_at) * 1000, 2),
            missing_blobs=node.missing_blobs(request.digests),
        )
        return True

    # --- replies ---

    def finish(self, request: RouterRequest, message: list[Any]) -> None:
        """Send a request's FINAL and forget it."""
        if self.requests.pop(request.id) is None:
            return
        answered_at = time.monotonic()
        # Sent first: the client waits for it, while the counts and the log wait for nobody (they
        # cost a FINAL 0.1 to 0.2 ms on a loaded 2-core VM, where the router's code runs cold).
        self.shell.send(request.client, message, request.id)
        self.uploads.release(request.id)
        if request.node is not None:
            request.node.requests.pop(request.id, None)
        else:
            self.queue.remove(request)
        self.finished += 1
        self._count_finished(request, message, answered_at - request.received_at)
        log.info("request_finished", request_id=request.id, node=request.node.node_id if request.node else None)

    def _count_finished(self, request: RouterRequest, message: list[Any], end_to_end_seconds: float) -> None:
        try:
            body = message[2]
            final = protocol.unpack_map(body.buffer if isinstance(body, zmq.Frame) else body)
        except (IndexError, protocol.WireError):
            final = protocol.final_error_body(request.id, "engine", "the node's FINAL could not be read")
        self.metrics.program_finished(final, end_to_end_seconds=end_to_end_seconds)

    def fail(self, request: RouterRequest, kind: str, text: str) -> None:
        """End a request with an error (FINAL), and forget it."""
        log.info("request_failed", request_id=request.id, kind=kind, reason=text)
        self.finish(request, protocol.final_error(request.id, kind, text))

    def relay(self, client: bytes, message: list[Any], request_id: str) -> None:
        self.shell.send(client, message, request_id)

    # --- time ---

    async def _tick_loop(self) -> None:
        interval = protocol.HEARTBEAT_INTERVAL_SECONDS
        next_heartbeat = time.monotonic()
        while True:
            await asyncio.sleep(interval / CHECKS_PER_INTERVAL)
            now = time.monotonic()
            self.node_messages.expire(now)
            if now >= next_heartbeat:
                next_heartbeat = now + interval
                self._heartbeat()
                self._expire_queued(now)
                self.dispatch()

    def _heartbeat(self) -> None:
        beat = protocol.message(protocol.NODE_HEARTBEAT, {})
        for node in self.nodes.values():
            self.node_messages.send(node.identity, beat)
        self.orphans.gone(self.shell.heartbeat_clients())
        # Programs whose client's connection is gone: waiting ones end at once, those on a node
        # once the grace is over, cancelled there too (kcoral.service.fairness).
        for request, running in self.orphans.to_cancel(self.requests, lambda r: r.node is not None):
            log.warning("client_gone_cancelling", request_id=request.id, running=running)
            if request.node is not None:
                cancel = protocol.message(protocol.CANCEL, {"request_id": request.id})
                self.node_messages.send(request.node.identity, cancel)
            self.fail(request, "cancelled", "the client disconnected")

    def _expire_queued(self, now: float) -> None:
        """A queued program never waits for ever: see the module docstring for the rules."""
        limit = self.settings.queue_timeout_seconds
        for request in [r for r in self.requests if r.node is None]:
            waited = now - request.received_at
            if waited > limit:
                self.fail(request, "timeout", f"the program waited {limit:g} s without a free node")
                continue
            refusal = self._unservable(request.gpu_count, queued_for=waited)
            if refusal is not None:
                self.fail(request, *refusal)

    # --- status ---

    def _program_rows(self, now: float) -> list[dict[str, Any]]:
        return [
            {
                "request_id": r.id,
                "client": r.client.decode(errors="replace"),
                "state": r.state.value,
                "age_s": round(now - r.received_at, 3),
                "gpu_ids": list(r.gpu_ids),
                "node": r.node.node_id if r.node is not None else None,
            }
            for r in self.requests
        ]

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        live = list(self.nodes.values())
        lost = list(self.node_messages.lost_nodes.values())
        queued = len(self.queue)
        return {
            "status": "draining" if self.shell.draining else "ok",
            "role": "router",
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "hostname": self.hostname,
            "gpu_count": sum(n.gpu_count for n in live),
            "fake_gpus": sum(n.fake_gpus for n in live),
            "frame_bytes": self.settings.max_frame_bytes,
            "connections": self.shell.connections.describe(),
            "load": {
                "request_capacity": sum(n.capacity for n in live),
                "requests_in_progress": sum(n.load.get("requests_in_progress", 0) for n in live),
                "requests_waiting": queued + sum(n.load.get("requests_waiting", 0) for n in live),
                "max_queued": self.settings.max_queued,
                "queued_at_router": queued,
            },
            "counters": self._counters(),
            **programs_in_flight(self._program_rows(now)),
            "target": self.target(),
            "versions": self.versions,
            "nodes": [n.describe(now) for n in live + lost],
        }

    def target(self) -> dict[str, Any]:
        return merged_target(list(self.nodes.values()), self.platform)


__all__ = ["NODE_WAIT_SECONDS", "Router", "RouterSettings"]
