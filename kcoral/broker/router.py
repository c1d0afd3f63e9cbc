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
  reads only the ``request_id`` of a FINAL, whose result tree may be large. The node relay's
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
- Sends never wait: ROUTER_MANDATORY sockets written through blocking shadows with NOBLOCK, so an
  unreachable client or node shows up as an error here and now.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import random
import signal
import socket as stdlib_socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.broker.requests import RequestQueue, until_no_requests
from kcoral.broker.sockets import ImmediateSender, receive_forever, router_socket
from kcoral.broker.target import versions

log = structlog.get_logger("kcoral.router")

NODE_WAIT_SECONDS = 10.0
NODE_BLOB_MEMORY = 100_000  # digests remembered per node for blob affinity
MAX_REMEMBERED_LOST_NODES = 256
# The liveness of nodes is checked this many times per heartbeat interval, so that a dead node is
# noticed soon after its HEARTBEAT_LIVENESS intervals are up, not up to an interval later.
CHECKS_PER_INTERVAL = 4
GOODBYE_LINGER_MS = 200
MAX_QUIET_SECONDS = protocol.MAX_TIMEOUT_SECONDS  # the most silence a node may announce
SHUTDOWN_DRAIN_SECONDS = protocol.MAX_TIMEOUT_SECONDS + 60
NODE_STATUSES = ("ok", "draining")


@dataclass(frozen=True)
class RouterSettings:
    """Everything ``kcoral router`` can be told; the CLI fills it from flags."""

    listen: str = "tcp://127.0.0.1:6000"
    nodes_listen: str = "tcp://127.0.0.1:6001"
    max_queued: int = 1024
    queue_timeout_seconds: float = 3600.0
    # How long programs wait for a node while none is registered (see the module docstring).
    node_wait_seconds: float = NODE_WAIT_SECONDS
    max_request_bytes: int = protocol.DEFAULT_MAX_REQUEST_BYTES
    node_blob_memory: int = NODE_BLOB_MEMORY


@dataclass(eq=False)
class RouterRequest:
    id: str
    client: bytes
    gpu_count: int  # 0: the node's default, which any node can serve
    digests: list[str]
    frames: list[Any] | None  # the EXECUTE as received, kept until it goes to a node
    received_at: float = field(default_factory=time.monotonic)
    node: Node | None = None


@dataclass(eq=False)
class Node:
    """A registered host broker, known by the identity of its current link."""

    identity: bytes
    node_id: str
    instance_id: str
    hostname: str
    gpu_count: int
    fake_gpus: int
    status: str
    load: dict[str, int]
    target: dict[str, Any]
    versions: dict[str, str]
    registered_at: float = field(default_factory=time.time)
    last_heard: float = field(default_factory=time.monotonic)
    # Until then the node may be silent: it announced that it is storing a large upload.
    quiet_until: float = 0.0
    state: str = "live"
    # False after a send to it failed; true again at its next message.
    reachable: bool = True
    requests: dict[str, RouterRequest] = field(default_factory=dict)
    blobs: OrderedDict[str, None] = field(default_factory=OrderedDict)
    dispatched: int = 0
    lost_reason: str | None = None

    @property
    def capacity(self) -> int:
        return self.load.get("request_capacity", 0)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.requests)

    @property
    def dispatchable(self) -> bool:
        return self.state == "live" and self.status == "ok" and self.reachable and self.free_slots > 0

    def busyness(self) -> float:
        return len(self.requests) / max(1, self.capacity)

    def remember_blobs(self, digests: list[str], limit: int) -> None:
        for digest in digests:
            self.blobs[digest] = None
            self.blobs.move_to_end(digest)
        while len(self.blobs) > limit:
            self.blobs.popitem(last=False)

    def missing_blobs(self, digests: list[str]) -> int:
        return sum(1 for d in digests if d not in self.blobs)

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "state": self.state if self.state != "live" else ("draining" if self.status == "draining" else "live"),
            "hostname": self.hostname,
            "instance_id": self.instance_id,
            "gpus": self.gpu_count,
            "fake_gpus": self.fake_gpus,
            "load": dict(self.load),
            "in_flight": len(self.requests),
            "dispatched": self.dispatched,
            "last_heard_s": round(now - self.last_heard, 3),
            "registered_at": self.registered_at,
            "arch": list(self.target.get("arch") or []),
            "versions": {k: v for k, v in self.versions.items() if k in ("kcoral", "protocol", "torch")},
            "lost_reason": self.lost_reason,
        }


class Router:
    """Queues clients' programs and dispatches them to registered host brokers."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.instance_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.context = zmq.asyncio.Context()
        self.frontend = router_socket(self.context)
        self.backend = router_socket(self.context)
        self.frontend_out = ImmediateSender(self.frontend)
        self.backend_out = ImmediateSender(self.backend)
        self.requests: dict[str, RouterRequest] = {}
        self.queue: RequestQueue[RouterRequest] = RequestQueue()
        self.nodes: dict[bytes, Node] = {}  # live nodes by link identity
        self.lost_nodes: OrderedDict[str, Node] = OrderedDict()  # by node id, for health
        self.pool_empty_since: float | None = time.monotonic()
        self.counters = {"finished": 0, "node_lost": 0, "refused": 0}
        self.draining = False
        self.stopped = asyncio.Event()
        self.random = random.Random()
        # What does not change while the router runs, found once: HEALTH may be polled often.
        self.hostname = stdlib_socket.gethostname()
        self.versions = versions()
        self.platform = platform.platform()
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ---

    async def serve(self) -> int:
        """Run until stopped (SIGTERM/SIGINT drain in-flight programs first); return the exit code."""
        self.frontend.setsockopt(zmq.MAXMSGSIZE, max(self.settings.max_request_bytes, protocol.MAX_BODY_BYTES))
        self.frontend.bind(self.settings.listen)
        self.backend.bind(self.settings.nodes_listen)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.drain)
        self._tasks = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._node_loop()),
            asyncio.create_task(self._tick_loop()),
        ]
        log.info(
            "router_listening",
            endpoint=self.settings.listen,
            nodes_endpoint=self.settings.nodes_listen,
            instance_id=self.instance_id,
        )
        await self.stopped.wait()
        await self.close()
        return 0

    def drain(self) -> None:
        """Stop taking programs; finish those in flight, then stop."""
        if self.draining:
            return
        self.draining = True
        log.info("router_draining", in_flight=len(self.requests))
        asyncio.get_running_loop().create_task(self._finish_draining())

    async def _finish_draining(self) -> None:
        await until_no_requests(self.requests, SHUTDOWN_DRAIN_SECONDS)
        self.stopped.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Nodes register again at once with whichever router comes next, instead of waiting for
        # HEARTBEAT_LIVENESS intervals of silence.
        for node in list(self.nodes.values()):
            self._send_node(node.identity, protocol.message(protocol.NODE_DISCONNECT, {"reason": "router stopping"}))
        self.frontend.close(linger=0)
        self.backend.close(linger=GOODBYE_LINGER_MS)
        self.context.term()
        log.info("router_stopped", **self.counters)

    # --- clients ---

    async def _client_loop(self) -> None:
        await receive_forever(self.frontend, self._handle_client, "client_message_failed")

    def _handle_client(self, frames: list[zmq.Frame]) -> None:
        client = bytes(frames[0].buffer)
        message = frames[1:]
        try:
            command, body, _ = protocol.split_message([f.buffer for f in message])
            request_id = protocol.check_id(body.get("request_id"), "request_id")
        except protocol.WireError as exc:
            log.warning("bad_client_message", error=str(exc), frames=len(message))
            return
        try:
            if command == protocol.EXECUTE:
                self._on_execute(client, request_id, body, message)
            elif command == protocol.BLOBS:
                self._on_blobs(client, request_id, body, message)
            elif command == protocol.CANCEL:
                self._on_cancel(client, request_id)
            elif command == protocol.HEALTH:
                self._reply(client, protocol.final_body(request_id, self.health()))
            elif command == protocol.TARGET:
                self._reply(client, protocol.final_body(request_id, self.target()))
            else:
                self._refuse(client, request_id, "parse", f"unknown command {command.hex()}")
        except Exception as exc:
            # A bug must not leave a client waiting for ever: answer it.
            log.exception("client_command_failed", request_id=request_id, command=command.hex())
            request = self.requests.get(request_id)
            if request is not None and request.client == client:
                self._finish_error(request, "engine", f"internal error in the router: {exc!r}")
            else:
                self._refuse(client, request_id, "engine", f"internal error in the router: {exc!r}")

    def _on_execute(self, client: bytes, request_id: str, body: dict[str, Any], message: list[Any]) -> None:
        if request_id in self.requests:
            self._refuse(client, request_id, "parse", "a request with this id is already in flight")
            return
        if self.draining:
            self._refuse(client, request_id, "busy", "the router is shutting down")
            return
        if len(self.queue) >= self.settings.max_queued:
            self._refuse(client, request_id, "busy", f"the queue is full ({self.settings.max_queued} programs)")
            return
        try:
            _, options, digests = protocol.parse_execute(body)
        except protocol.WireError as exc:
            self._refuse(client, request_id, "parse", str(exc))
            return
        gpu_count = options.gpu_count or 0
        refusal = self._unservable(gpu_count, queued_for=None)
        if refusal is not None:
            self._refuse(client, request_id, *refusal)
            return
        request = RouterRequest(request_id, client, gpu_count, digests, message)
        self.requests[request_id] = request
        self.queue.push(request)
        log.info("request_received", request_id=request_id, blobs=len(digests), gpu_count=gpu_count or None)
        self._dispatch()

    def _unservable(self, gpu_count: int, queued_for: float | None) -> tuple[str, str] | None:
        """(kind, message) when a program needing ``gpu_count`` GPUs should be refused now;
        ``queued_for`` is how long it has waited in the queue, None for one just arrived."""
        if not self.nodes:
            empty_for = time.monotonic() - (self.pool_empty_since or time.monotonic())
            if empty_for >= self.settings.node_wait_seconds:
                return "busy", f"no host broker has been registered with this router for {empty_for:.0f} s"
            return None
        most = max(node.gpu_count for node in self.nodes.values())
        # A queued program gets node_wait seconds for a larger node (one restarting) to come back.
        if gpu_count > most and (queued_for is None or queued_for >= self.settings.node_wait_seconds):
            return "capacity", f"the program asks for {gpu_count} GPUs; the largest node has {most}"
        return None

    def _on_blobs(self, client: bytes, request_id: str, body: dict[str, Any], message: list[Any]) -> None:
        request = self.requests.get(request_id)
        if request is None or request.client != client or request.node is None:
            self._refuse(client, request_id, "parse", "BLOBS for no request that is waiting for blobs")
            return
        node = request.node
        if not self._send_node(node.identity, message):
            self._finish_error(request, "node_lost", f"node {node.node_id} cannot be reached")
            return
        sent = body.get("blobs")
        if isinstance(sent, list):
            node.remember_blobs([d for d in sent if isinstance(d, str)], self.settings.node_blob_memory)

    def _on_cancel(self, client: bytes, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None or request.client != client:
            return
        log.info("request_cancelled", request_id=request_id, node=request.node.node_id if request.node else None)
        node = request.node
        cancel = protocol.message(protocol.CANCEL, {"request_id": request_id})
        if node is None or not self._send_node(node.identity, cancel):
            # Still here, or its node cannot be told (the node cancels what it holds when it finds
            # its link gone): the program is cancelled for the client either way.
            self._finish_error(request, "cancelled", "the client cancelled the program")

    # --- nodes ---

    async def _node_loop(self) -> None:
        await receive_forever(self.backend, self._handle_node, "node_message_failed")

    def _handle_node(self, frames: list[zmq.Frame]) -> None:
        identity = bytes(frames[0].buffer)
        message = frames[1:]
        node = self.nodes.get(identity)
        try:
            command = protocol.check_header(message)
            if command == protocol.NODE_REGISTER:
                self._on_register(identity, protocol.unpack_map(message[2].buffer))
                return
            if node is None:
                # Unknown (the router restarted, or took the node for lost): it must register.
                if command != protocol.NODE_DISCONNECT:
                    body = {"reason": "unknown node; register again"}
                    self._send_node(identity, protocol.message(protocol.NODE_DISCONNECT, body))
                return
            node.last_heard = time.monotonic()
            node.reachable = True
            if command == protocol.NODE_HEARTBEAT:
                self._on_node_heartbeat(node, protocol.unpack_map(message[2].buffer))
            elif command == protocol.PARTIAL:
                self._on_partial(node, protocol.unpack_map(message[2].buffer), message)
            elif command == protocol.FINAL:
                self._on_node_final(node, protocol.peek_request_id(message[2].buffer), message)
            elif command == protocol.NODE_DISCONNECT:
                self._lose_node(node, "left the pool")
            else:
                raise protocol.WireError(f"unexpected command {command.hex()} from a node")
        except protocol.WireError as exc:
            node_id = node.node_id if node is not None else identity.decode(errors="replace")
            log.warning("bad_node_message", node=node_id, error=str(exc))

    def _on_register(self, identity: bytes, body: dict[str, Any]) -> None:
        try:
            node_id = protocol.check_id(body.get("node_id"), "node id")
            gpu_count = _count(body.get("gpu_count"), "gpu_count")
            fake_gpus = _count(body.get("fake_gpus", 0), "fake_gpus")
            status = _status(body.get("status"))
            load = _load(body.get("load"))
            target = body.get("target") or {}
            node_versions = body.get("versions") or {}
            if not isinstance(target, dict) or not isinstance(node_versions, dict):
                raise protocol.WireError("target and versions must be maps")
        except protocol.WireError as exc:
            log.warning("bad_registration", link=identity.decode(errors="replace"), error=str(exc))
            body = {"reason": f"registration refused: {exc}"}
            self._send_node(identity, protocol.message(protocol.NODE_DISCONNECT, body))
            return
        node = self.nodes.get(identity)
        if node is None:
            for other in [n for n in self.nodes.values() if n.node_id == node_id]:
                # The same node on a new link: it restarted, or dropped its old link; what the old
                # link carried is lost on the node's side (or a second node uses the same id).
                self._lose_node(other, "registered again on a new link")
            node = Node(
                identity=identity,
                node_id=node_id,
                instance_id=str(body.get("instance_id")),
                hostname=str(body.get("hostname")),
                gpu_count=gpu_count,
                fake_gpus=fake_gpus,
                status=status,
                load=load,
                target=target,
                versions={str(k): str(v) for k, v in node_versions.items()},
            )
            self.nodes[identity] = node
            self.lost_nodes.pop(node_id, None)
            self.pool_empty_since = None
            log.info(
                "node_registered",
                node=node_id,
                hostname=node.hostname,
                gpus=gpu_count,
                slots=node.capacity,
                arch=target.get("arch"),
                version=node.versions.get("kcoral"),
            )
        else:
            node.status, node.load, node.last_heard, node.reachable = status, load, time.monotonic(), True
        self._send_node(identity, protocol.message(protocol.NODE_REGISTERED, {"instance_id": self.instance_id}))
        self._dispatch()

    def _on_node_heartbeat(self, node: Node, body: dict[str, Any]) -> None:
        node.status = _status(body.get("status"))
        node.load = _load(body.get("load"))
        quiet = body.get("quiet_seconds")
        if quiet is not None:
            if isinstance(quiet, bool) or not isinstance(quiet, (int, float)) or not quiet >= 0:
                raise protocol.WireError(f"quiet_seconds must be a number >= 0, not {quiet!r}")
            node.quiet_until = time.monotonic() + min(float(quiet), MAX_QUIET_SECONDS)
            log.info("node_quiet", node=node.node_id, seconds=round(quiet, 1))
        self._dispatch()

    def _on_partial(self, node: Node, body: dict[str, Any], message: list[Any]) -> None:
        request_id = protocol.check_id(body.get("request_id"), "request_id")
        request = node.requests.get(request_id)
        if request is None:
            return  # the answer to a request already failed (node_lost) or cancelled here
        if body.get("state") == "queued":
            # The node's broker holds every blob of the program now.
            node.remember_blobs(request.digests, self.settings.node_blob_memory)
        self._send_client(request.client, message, request_id)

    def _on_node_final(self, node: Node, request_id: str, message: list[Any]) -> None:
        request = node.requests.get(request_id)
        if request is None:
            log.debug("late_final", request_id=request_id, node=node.node_id)
            return
        self._finish(request, message)
        self._dispatch()

    def _lose_node(self, node: Node, reason: str) -> None:
        self.nodes.pop(node.identity, None)
        node.state = "lost"
        node.lost_reason = reason
        lost = list(node.requests.values())
        log.warning("node_lost", node=node.node_id, reason=reason, requests=len(lost))
        for request in lost:
            self.counters["node_lost"] += 1
            self._finish_error(
                request,
                "node_lost",
                f"node {node.node_id} {reason} while it had the program; it is not run again",
            )
        self.lost_nodes[node.node_id] = node
        self.lost_nodes.move_to_end(node.node_id)
        while len(self.lost_nodes) > MAX_REMEMBERED_LOST_NODES:
            self.lost_nodes.popitem(last=False)
        if not self.nodes:
            self.pool_empty_since = time.monotonic()

    # --- dispatch ---

    def _dispatch(self) -> None:
        ready = [n for n in self.nodes.values() if n.dispatchable]
        if not ready or not self.queue:
            return
        deferred: list[RouterRequest] = []
        while ready:
            request = self.queue.pop()
            if request is None:
                break
            node = self._choose_node(request, ready)
            if node is None or not self._start(request, node):
                deferred.append(request)
            ready = [n for n in ready if n.dispatchable]
        # Those that fit no free node keep their place at the head of their client's queue.
        for request in reversed(deferred):
            self.queue.push_front(request, serve_client_next=False)

    def _choose_node(self, request: RouterRequest, ready: list[Node]) -> Node | None:
        fits = [n for n in ready if n.gpu_count >= request.gpu_count]
        if len(fits) > 1 and request.digests:
            missing = {n.identity: n.missing_blobs(request.digests) for n in fits}
            fewest = min(missing.values())
            fits = [n for n in fits if missing[n.identity] == fewest]
        if len(fits) > 2:
            fits = self.random.sample(fits, 2)
        if not fits:
            return None
        return min(fits, key=lambda n: (n.busyness(), self.random.random()))

    def _start(self, request: RouterRequest, node: Node) -> bool:
        assert request.frames is not None
        if not self._send_node(node.identity, request.frames):
            node.reachable = False  # not chosen again until it is heard from
            return False
        request.node = node
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

    def _finish(self, request: RouterRequest, message: list[Any]) -> None:
        """Send a request's FINAL and forget it."""
        if self.requests.pop(request.id, None) is None:
            return
        if request.node is not None:
            request.node.requests.pop(request.id, None)
        else:
            self.queue.remove(request)
        self.counters["finished"] += 1
        self._send_client(request.client, message, request.id)
        log.info("request_finished", request_id=request.id, node=request.node.node_id if request.node else None)

    def _finish_error(self, request: RouterRequest, kind: str, text: str) -> None:
        log.info("request_failed", request_id=request.id, kind=kind, reason=text)
        self._finish(request, protocol.final_error(request.id, kind, text))

    def _refuse(self, client: bytes, request_id: str, kind: str, text: str) -> None:
        self.counters["refused"] += 1
        log.info("request_refused", request_id=request_id, kind=kind, reason=text)
        self._send_client(client, protocol.final_error(request_id, kind, text), request_id)

    def _reply(self, client: bytes, body: dict[str, Any]) -> None:
        self._send_client(client, protocol.message(protocol.FINAL, body), body.get("request_id"))

    def _send_client(self, client: bytes, message: list[Any], request_id: str | None) -> None:
        try:
            self.frontend_out.send([client, *message])
        except zmq.ZMQError as exc:
            # ROUTER_MANDATORY: the client is gone; nothing is waiting for this reply.
            log.info("client_unreachable", request_id=request_id, error=str(exc))

    def _send_node(self, identity: bytes, message: list[Any]) -> bool:
        try:
            self.backend_out.send([identity, *message])
        except zmq.ZMQError as exc:
            log.info("node_unreachable", link=identity.decode(errors="replace"), error=str(exc))
            return False
        return True

    # --- time ---

    async def _tick_loop(self) -> None:
        interval = protocol.HEARTBEAT_INTERVAL_SECONDS
        next_heartbeat = time.monotonic()
        while True:
            await asyncio.sleep(interval / CHECKS_PER_INTERVAL)
            now = time.monotonic()
            self._expire_nodes(now)
            if now >= next_heartbeat:
                next_heartbeat = now + interval
                self._heartbeat()
                self._expire_queued(now)
                self._dispatch()

    def _expire_nodes(self, now: float) -> None:
        if cast(int, self.backend_out.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            return  # messages are waiting to be read (this loop was busy): they may be heartbeats
        liveness = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS
        for node in [n for n in self.nodes.values() if now - n.last_heard > liveness and now > n.quiet_until]:
            self._lose_node(node, f"stopped answering ({now - node.last_heard:.1f} s without a message)")

    def _heartbeat(self) -> None:
        beat = protocol.message(protocol.NODE_HEARTBEAT, {})
        for node in self.nodes.values():
            self._send_node(node.identity, beat)
        client_beat = protocol.message(protocol.HEARTBEAT, {})
        for client in {r.client for r in self.requests.values()}:
            self._send_client(client, client_beat, None)

    def _expire_queued(self, now: float) -> None:
        """A queued program never waits for ever: see the module docstring for the rules."""
        limit = self.settings.queue_timeout_seconds
        for request in [r for r in self.requests.values() if r.node is None]:
            waited = now - request.received_at
            if waited > limit:
                self._finish_error(request, "timeout", f"the program waited {limit:g} s without a free node")
                continue
            refusal = self._unservable(request.gpu_count, queued_for=waited)
            if refusal is not None:
                self._finish_error(request, *refusal)

    # --- status ---

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        live = list(self.nodes.values())
        queued = len(self.queue)
        return {
            "status": "draining" if self.draining else "ok",
            "role": "router",
            "instance_id": self.instance_id,
            "started_at": self.started_at,
            "hostname": self.hostname,
            "gpu_count": sum(n.gpu_count for n in live),
            "fake_gpus": sum(n.fake_gpus for n in live),
            "load": {
                "request_capacity": sum(n.capacity for n in live),
                "requests_in_progress": sum(n.load.get("requests_in_progress", 0) for n in live),
                "requests_waiting": queued + sum(n.load.get("requests_waiting", 0) for n in live),
                "max_queued": self.settings.max_queued,
                "queued_at_router": queued,
            },
            "counters": dict(self.counters),
            "target": self.target(),
            "versions": self.versions,
            "nodes": [n.describe(now) for n in live] + [n.describe(now) for n in self.lost_nodes.values()],
        }

    def target(self) -> dict[str, Any]:
        """The live nodes' targets merged: every GPU (with its node), the union of archs."""
        live = list(self.nodes.values())
        gpus = [
            {**gpu, "node": n.node_id} for n in live for gpu in (n.target.get("gpus") or []) if isinstance(gpu, dict)
        ]
        arch = sorted({str(a) for n in live for a in (n.target.get("arch") or [])})
        devices = {n.target.get("device") for n in live}
        return {
            "device": "gpu" if "gpu" in devices else ("cpu" if live else "none"),
            "fake_gpus": sum(n.fake_gpus for n in live),
            "gpus": gpus,
            "arch": arch,
            "platform": self.platform,
            "python": platform.python_version(),
            "nodes": {n.node_id: n.target for n in live},
        }


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise protocol.WireError(f"{what} must be an integer >= 0, not {value!r}")
    return value


def _status(value: object) -> str:
    if value not in NODE_STATUSES:
        raise protocol.WireError(f"node status must be one of {NODE_STATUSES}, not {value!r}")
    return str(value)


def _load(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        raise protocol.WireError("load must be a map")
    return {
        key: _count(value.get(key, 0), key) for key in ("request_capacity", "requests_in_progress", "requests_waiting")
    }


async def run_router(settings: RouterSettings) -> int:
    router = Router(settings)
    return await router.serve()


__all__ = ["Router", "RouterSettings", "run_router"]
