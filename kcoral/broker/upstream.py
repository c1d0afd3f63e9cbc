"""The node side of federation: a relay inside a host broker that joins a ``kcoral router``.

A broker started with ``--upstream URL --node-id NAME`` runs one :class:`UpstreamLink` in its event
loop. The link holds one DEALER socket, connected OUT to the router's nodes endpoint, so a host
behind NAT or a firewall needs no open port, and the router needs no list of hosts. To its broker
the relay is a local client of the broker's service shell (:meth:`ServiceShell.receive_local
<kcoral.service.shell.ServiceShell.receive_local>`), under its own identity: an ordinary client,
whose messages the shell takes as it takes a socket's, without a socket in between.

Client messages from the router (EXECUTE, BLOBS, CANCEL) go to the broker unchanged, and the
broker's replies (PARTIAL, FINAL) go back to the router unchanged, frame for frame and without
copies: the router keeps the request_id -> client map, because request ids are unique per broker
anyway, so the relay needs none. Each goes on at once, in the call that brought it: a reply leaves
for the router from inside the broker's send, before the broker goes on with its bookkeeping.
Until this relay was a client over ``inproc://``, each message crossed one more socket (a send, a
wake-up of the loop, a receive), and a FINAL waited for whatever the broker's loop did after
sending it (``benchmarks/RESULTS.md``, the router's section). Why a relay and not a federation-aware
broker: the broker stays one program with one client protocol, and everything it does for clients
(negotiation of blobs, queue, leases, cancellation, timeouts) works through a router without a
second code path.

What the relay keeps: the set of request ids it has forwarded and not yet seen a FINAL for. When
the link to the router is lost (no message for HEARTBEAT_LIVENESS intervals, or the router says it
does not know this node) the router fails those requests with ``node_lost`` and never replays them,
so the relay cancels them in its broker (their workers stop using GPUs nobody waits for), drops
their late replies, opens a new socket under a new identity and registers again. HEARTBEATs from
the broker are dropped: the router heartbeats its own clients.
"""

from __future__ import annotations

import asyncio
import socket as stdlib_socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.keys import ClientKeys
from kcoral.service.sockets import YIELD_EVERY_MESSAGES, Inbox, close_inbox, open_inbox, send_now
from kcoral.service.tasks import TaskSet

log = structlog.get_logger("kcoral.upstream")

LINK_HIGH_WATER_MARK = 100_000
# After a link that never registered is dropped, wait this long before the next attempt, so that
# a router that refuses this node is not asked again in a tight loop.
RETRY_DELAY_SECONDS = protocol.HEARTBEAT_INTERVAL_SECONDS
GOODBYE_LINGER_MS = 200  # time a closing link gives its NODE_DISCONNECT to leave
# The broker checks and stores an upload on its event loop, which then cannot heartbeat: about
# 3 s per GiB on a small CI machine, more on a slow disk. Before it gets a message with at least
# QUIET_ANNOUNCE_BYTES of data, the relay tells the router how long to expect silence, at this
# (deliberately low) rate, so that the router does not take the node for lost meanwhile.
QUIET_ANNOUNCE_BYTES = 64 << 20
INGEST_BYTES_PER_SECOND = 64 << 20

HealthSource = Callable[[], dict[str, Any]]
# How the relay hands its broker a client message: (the relay's identity, the frames).
BrokerIntake = Callable[[bytes, list[zmq.Frame]], None]


def default_node_id(listen: str) -> str:
    """``hostname:port`` of a broker's tcp endpoint, or the hostname: stable across restarts."""
    host = stdlib_socket.gethostname()
    port = listen.rsplit(":", 1)[-1] if listen.startswith("tcp://") else ""
    return f"{host}:{port}" if port.isdigit() else host


def load_report(health: dict[str, Any]) -> dict[str, Any]:
    """The NODE_HEARTBEAT body: the node's status and load, from its broker's health."""
    return {"status": health.get("status"), "load": health.get("load")}


def registration(node_id: str, health: dict[str, Any]) -> dict[str, Any]:
    """The NODE_REGISTER body: who this node is and what it serves, from its broker's health."""
    return {
        "node_id": node_id,
        "instance_id": health.get("instance_id"),
        "hostname": health.get("hostname"),
        "gpu_count": health.get("gpu_count"),
        "fake_gpus": health.get("fake_gpus", 0),
        **load_report(health),
        "target": health.get("target"),
        "versions": health.get("versions"),
    }


class UpstreamLink:
    """Relays a router's client messages to this broker and its replies back."""

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        upstream: str,
        node_id: str,
        health: HealthSource,
        to_broker: BrokerIntake,
        keys: ClientKeys | None = None,
    ) -> None:
        protocol.check_id(node_id, "node id")
        self.context = context
        self.upstream = upstream
        self.node_id = node_id
        self.health = health
        # The broker's shell takes the router's client messages here (ServiceShell.receive_local),
        # and hands this relay's replies to on_broker_message.
        self.to_broker = to_broker
        self.keys = keys  # CURVE on the link: the router checks this node's key (its nodes domain)
        # The relay's identity at its broker, which trusts it with the router's clients' shares.
        self.local_identity = f"u-{uuid.uuid4().hex}".encode()
        self.registered = False
        self.router_instance: str | None = None
        self.in_flight: set[str] = set()
        self.closed = False
        self._link: zmq.asyncio.Socket | None = None  # to the router
        self._tasks = TaskSet()

    # --- lifecycle ---

    def start(self) -> None:
        """Start joining the router (call once the broker hands this relay its replies)."""
        # Opened here, not in the task, so that a bad --upstream endpoint fails the start (ZMQError).
        link = self._open_link()
        self._tasks.spawn(self._link_loop(link))
        log.info("upstream_starting", upstream=self.upstream, node=self.node_id)

    async def close(self) -> None:
        """Tell the router this node leaves, stop relaying and close the sockets; idempotent."""
        if self.registered:
            self._send_link(protocol.NODE_DISCONNECT, {"node_id": self.node_id})
            if self._link is not None:
                # Give the goodbye a moment on the wire; the router would otherwise wait for
                # HEARTBEAT_LIVENESS intervals before taking the node out of its pool.
                self._link.setsockopt(zmq.LINGER, GOODBYE_LINGER_MS)
        await self._tasks.cancel_all()
        self.closed = True  # the broker's replies to this relay fail from now on

    def describe(self) -> dict[str, Any]:
        """The link as the broker's HEALTH reports it (``upstream``)."""
        return {
            "url": self.upstream,
            "node_id": self.node_id,
            "registered": self.registered,
            "router_instance_id": self.router_instance,
        }

    # --- the link to the router ---

    def _open_link(self) -> zmq.asyncio.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, LINK_HIGH_WATER_MARK)
        sock.setsockopt(zmq.RCVHWM, LINK_HIGH_WATER_MARK)
        # Queue nothing while the router is unreachable: a message for a router that is gone
        # would reach the next one, which knows nothing of it.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        # A fresh identity per link: the router tells an old link's late messages from the new one's.
        sock.setsockopt(zmq.IDENTITY, f"n-{uuid.uuid4().hex}".encode())
        if self.keys is not None:
            self.keys.apply(sock)
        sock.connect(self.upstream)
        self._link = sock
        return sock

    async def _link_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            was_registered = False
            try:
                reason = await self._serve_link(sock)
                was_registered = self.registered
            finally:
                self._drop_link(sock)
            log.warning("upstream_link_reset", node=self.node_id, reason=reason, upstream=self.upstream)
            if not was_registered:
                await asyncio.sleep(RETRY_DELAY_SECONDS)
            sock = self._open_link()

    async def _serve_link(self, sock: zmq.asyncio.Socket) -> str:
        """Register, heartbeat and relay until the link is lost; return why it was."""
        inbox = open_inbox(sock)  # closed before the socket (_drop_link comes after)
        try:
            return await self._serve_inbox(inbox)
        finally:
            close_inbox(inbox)

    async def _serve_inbox(self, inbox: Inbox) -> str:
        interval = protocol.HEARTBEAT_INTERVAL_SECONDS
        liveness = interval * protocol.HEARTBEAT_LIVENESS
        last_heard = time.monotonic()
        next_beat = 0.0  # register at once
        in_a_row = 0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + interval
            frames = await inbox.receive(max(0.001, next_beat - now))
            if frames is not None:
                last_heard = time.monotonic()
                reason = self._on_router_message(frames)
                if reason is not None:
                    return reason
                in_a_row += 1
                if in_a_row >= YIELD_EVERY_MESSAGES:  # a flood from the router starves nothing here
                    in_a_row = 0
                    await asyncio.sleep(0)
                continue
            in_a_row = 0
            # Checked only when nothing is waiting to be read: after this loop was blocked (by the
            # broker storing a large upload), the router's heartbeats are still in the socket.
            silent = time.monotonic() - last_heard
            if self.registered and silent > liveness:
                return f"no message from the router for {silent:.1f} s"

    def _drop_link(self, sock: zmq.asyncio.Socket) -> None:
        self.registered = False
        self._link = None
        sock.close()  # with the socket's own LINGER: 0, or a moment for a goodbye (see close)
        if self.in_flight:
            # The router has failed these with node_lost (or is gone): stop them here too. Emptied
            # first: the broker answers each CANCEL at once, and those late replies are dropped.
            cancelled, self.in_flight = self.in_flight, set()
            log.warning("upstream_cancelling_in_flight", node=self.node_id, requests=len(cancelled))
            for request_id in cancelled:
                cancel = protocol.message(protocol.CANCEL, {"request_id": request_id})
                self._pass_to_broker([zmq.Frame(frame) for frame in cancel])  # as received frames are

    def _beat(self) -> None:
        try:
            health = self.health()
        except Exception:
            log.exception("upstream_health_failed", node=self.node_id)
            return
        if self.registered:
            self._send_link(protocol.NODE_HEARTBEAT, load_report(health))
        else:
            self._send_link(protocol.NODE_REGISTER, registration(self.node_id, health))

    def _on_router_message(self, frames: list[zmq.Frame]) -> str | None:
        """Handle one message from the router; a reason when the link must be dropped."""
        try:
            command = protocol.check_header(frames)
            if command in (protocol.EXECUTE, protocol.BLOBS, protocol.CANCEL):
                self._relay_to_broker(command, frames)
                return None
            body = protocol.unpack_map(frames[2].buffer)
        except protocol.WireError as exc:
            log.warning("bad_router_message", node=self.node_id, error=str(exc))
            return None
        if command == protocol.NODE_REGISTERED:
            if not self.registered:
                self.router_instance = str(body.get("instance_id"))
                log.info("upstream_registered", node=self.node_id, router=self.router_instance)
            self.registered = True
        elif command == protocol.NODE_DISCONNECT:
            return f"the router dropped this node: {body.get('reason', 'unknown node')}"
        elif command != protocol.NODE_HEARTBEAT:
            log.warning("bad_router_message", node=self.node_id, command=command.hex())
        return None

    def _relay_to_broker(self, command: bytes, frames: list[zmq.Frame]) -> None:
        if not self.registered:
            return  # a stale message from before a reset: its request was already failed
        request_id = protocol.peek_request_id(frames[2].buffer)
        if command == protocol.EXECUTE:
            self.in_flight.add(request_id)
        data_bytes = sum(len(frame) for frame in frames[3:])
        if data_bytes >= QUIET_ANNOUNCE_BYTES:
            # Sent before the broker sees the upload: libzmq's I/O thread delivers it even while
            # this event loop is busy hashing and storing.
            quiet = data_bytes / INGEST_BYTES_PER_SECOND
            self._send_link(protocol.NODE_HEARTBEAT, {**load_report(self.health()), "quiet_seconds": quiet})
            log.info("upstream_announced_quiet", node=self.node_id, request_id=request_id, seconds=round(quiet, 1))
        if not self._pass_to_broker(frames) and command == protocol.EXECUTE and request_id in self.in_flight:
            self.in_flight.discard(request_id)
            self._send_link_frames(
                protocol.final_error(request_id, "engine", f"node {self.node_id} could not pass the program on")
            )

    def _pass_to_broker(self, frames: list[zmq.Frame]) -> bool:
        """Hand the broker a client message; False where that raised (a bug, logged): the link
        must outlive it. Its replies may come back (to on_broker_message) before this returns."""
        try:
            self.to_broker(self.local_identity, frames)
        except Exception:
            log.exception("upstream_broker_failed", node=self.node_id)
            return False
        return True

    def _send_link(self, command: bytes, body: dict[str, Any]) -> bool:
        return self._send_link_frames(protocol.message(command, body))

    def _send_link_frames(self, frames: list[Any]) -> bool:
        # IMMEDIATE: with no connection to the router right now (routine while it restarts), what
        # it would get is lost anyway.
        if self._link is None:
            return False
        try:
            send_now(self._link, frames)
        except zmq.ZMQError as exc:
            log.debug("upstream_send_failed", node=self.node_id, error=str(exc))
            return False
        return True

    # --- the broker ---

    def on_broker_message(self, message: list[Any]) -> bool:
        """What the broker sends this relay (the frames after the identity): a reply for the
        router, passed on now; True unless the relay is closed (a client gone, to the broker)."""
        if self.closed:
            return False
        try:
            command = protocol.check_header(message)
            if command == protocol.HEARTBEAT:
                return True
            body = message[2]
            request_id = protocol.peek_request_id(body.buffer if isinstance(body, zmq.Frame) else body)
        except protocol.WireError as exc:
            log.warning("bad_broker_message", node=self.node_id, error=str(exc))
            return True
        if request_id not in self.in_flight:
            return True  # the answer to a request cancelled when an earlier link was lost
        if command == protocol.FINAL:
            self.in_flight.discard(request_id)
        if not self._send_link_frames(message):
            log.warning("upstream_reply_lost", node=self.node_id, request_id=request_id, command=command.hex())
        return True


__all__ = ["BrokerIntake", "UpstreamLink", "default_node_id", "registration"]
