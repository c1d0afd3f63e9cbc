"""The router's side of its nodes: the table of live and lost nodes, and what the nodes say.

:class:`NodeMessages` reads the nodes' socket (NODE_REGISTER, NODE_HEARTBEAT, NODE_DISCONNECT, and
the PARTIALs and FINALs of the programs a node runs, passed on to their clients unchanged), keeps
the live nodes by link identity and the lost ones by node id (for health), and loses a node that
leaves, registers again on a new link or falls silent: its programs fail with ``node_lost`` and are
never run again (see kcoral/router/router.py). It is built with the nodes' socket and the
settings, and talks back to the router through a small port, :class:`NodePort`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.router.nodes import (
    Node,
    NodeState,
    RouterRequest,
    RouterRequestState,
    parse_load_report,
    parse_quiet_seconds,
    parse_registration,
)
from kcoral.router.settings import RouterSettings
from kcoral.service.sockets import messages_waiting, send_now

log = structlog.get_logger("kcoral.router")

MAX_REMEMBERED_LOST_NODES = 256


class NodePort(Protocol):
    """What the node side asks of the router that holds it."""

    def dispatch(self) -> None:
        """Give queued programs to nodes with a free slot."""

    def finish(self, request: RouterRequest, message: list[Any]) -> None:
        """Send a request's FINAL (these frames) to its client, once, and forget it."""

    def fail(self, request: RouterRequest, kind: str, text: str) -> None:
        """End a request with an error (FINAL), and forget it."""

    def relay(self, client: bytes, message: list[Any], request_id: str) -> None:
        """Pass a node's message on to the request's client unchanged."""

    def uploads_asked(self, request: RouterRequest, body: dict[str, Any]) -> bool:
        """The node asked for blobs (``need_blobs``): hold their bytes against the upload bounds;
        False when that refused the request (it was failed)."""

    def uploads_done(self, request: RouterRequest) -> None:
        """The node holds every blob of the request: its upload bytes go."""


class NodeMessages:
    """The live and lost nodes, and the router's handling of their messages."""

    def __init__(
        self, settings: RouterSettings, *, backend: zmq.asyncio.Socket, router_instance_id: str, port: NodePort
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.router_instance_id = router_instance_id  # in NODE_REGISTERED: the node logs which router it joined
        self.port = port
        self.nodes: dict[bytes, Node] = {}  # live nodes by link identity
        self.lost_nodes: OrderedDict[str, Node] = OrderedDict()  # by node id, for health
        self.pool_empty_since: float | None = time.monotonic()
        self.programs_lost = 0  # programs failed with node_lost

    def on_message(self, frames: list[zmq.Frame]) -> None:
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
                    self.send(identity, protocol.message(protocol.NODE_DISCONNECT, body))
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
                self.lose(node, "left the pool")
            else:
                raise protocol.WireError(f"unexpected command {command.hex()} from a node")
        except protocol.WireError as exc:
            node_id = node.node_id if node is not None else identity.decode(errors="replace")
            log.warning("bad_node_message", node=node_id, error=str(exc))

    def _on_register(self, identity: bytes, body: dict[str, Any]) -> None:
        try:
            registered = parse_registration(identity, body)
        except protocol.WireError as exc:
            log.warning("bad_registration", link=identity.decode(errors="replace"), error=str(exc))
            body = {"reason": f"registration refused: {exc}"}
            self.send(identity, protocol.message(protocol.NODE_DISCONNECT, body))
            return
        node = self.nodes.get(identity)
        if node is None:
            for other in [n for n in self.nodes.values() if n.node_id == registered.node_id]:
                # The same node on a new link: it restarted, or dropped its old link; what the old
                # link carried is lost on the node's side (or a second node uses the same id).
                self.lose(other, "registered again on a new link")
            self.nodes[identity] = node = registered
            self.lost_nodes.pop(node.node_id, None)
            self.pool_empty_since = None
            log.info(
                "node_registered",
                node=node.node_id,
                hostname=node.hostname,
                gpus=node.gpu_count,
                slots=node.capacity,
                arch=node.target.get("arch"),
                version=node.versions.get("kcoral"),
            )
        else:
            node.status, node.load = registered.status, registered.load
            node.last_heard, node.reachable = time.monotonic(), True
        self.send(identity, protocol.message(protocol.NODE_REGISTERED, {"instance_id": self.router_instance_id}))
        self.port.dispatch()

    def _on_node_heartbeat(self, node: Node, body: dict[str, Any]) -> None:
        node.status, node.load = parse_load_report(body)
        quiet = parse_quiet_seconds(body.get("quiet_seconds"))
        if quiet is not None:
            node.quiet_until = time.monotonic() + quiet
            log.info("node_quiet", node=node.node_id, seconds=round(quiet, 1))
        self.port.dispatch()

    def _on_partial(self, node: Node, body: dict[str, Any], message: list[Any]) -> None:
        request_id = protocol.check_id(body.get("request_id"), "request_id")
        request = node.requests.get(request_id)
        if request is None:
            return  # the answer to a request already failed (node_lost) or cancelled here
        state = body.get("state")
        if state == "need_blobs" and not self.port.uploads_asked(request, body):
            return
        # Passed on before the router's own bookkeeping, which the client does not wait for.
        self.port.relay(request.client, message, request_id)
        if state == "queued":
            # The node's broker holds every blob of the program now.
            node.remember_blobs(request.digests, self.settings.node_blob_memory)
            self.port.uploads_done(request)
        if state in (RouterRequestState.QUEUED, RouterRequestState.RUNNING):
            request.state = RouterRequestState(state)
            gpu_ids = body.get("gpu_ids")
            if isinstance(gpu_ids, list):
                request.gpu_ids = tuple(g for g in gpu_ids if isinstance(g, int))

    def _on_node_final(self, node: Node, request_id: str, message: list[Any]) -> None:
        request = node.requests.get(request_id)
        if request is None:
            log.debug("late_final", request_id=request_id, node=node.node_id)
            return
        self.port.finish(request, message)
        self.port.dispatch()

    def lose(self, node: Node, reason: str) -> None:
        self.nodes.pop(node.identity, None)
        node.state = NodeState.LOST
        node.lost_reason = reason
        lost = list(node.requests.values())
        log.warning("node_lost", node=node.node_id, reason=reason, requests=len(lost))
        for request in lost:
            self.programs_lost += 1
            self.port.fail(
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

    def send(self, identity: bytes, message: list[Any]) -> bool:
        try:
            send_now(self.backend, [identity, *message])
        except zmq.ZMQError as exc:
            log.info("node_unreachable", link=identity.decode(errors="replace"), error=str(exc))
            return False
        return True

    def expire(self, now: float) -> None:
        if messages_waiting(self.backend):
            return  # messages are waiting to be read (this loop was busy): they may be heartbeats
        liveness = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS
        for node in [n for n in self.nodes.values() if now - n.last_heard > liveness and now > n.quiet_until]:
            self.lose(node, f"stopped answering ({now - node.last_heard:.1f} s without a message)")


__all__ = ["MAX_REMEMBERED_LOST_NODES", "NodeMessages", "NodePort"]
