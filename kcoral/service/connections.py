"""A cap on the TCP connections one peer address may hold to a service's client socket.

Each connection can make libzmq hold one unfinished frame of up to ``--max-frame-bytes``; their
number was bounded only by the file descriptors. With ``--max-connections-per-address N`` the
service watches its client socket's monitor (``EVENT_ACCEPTED`` and ``EVENT_DISCONNECTED``, each
with the connection's descriptor), reads the peer address of each connection accepted from that
descriptor, and shuts down (``shutdown(SHUT_RDWR)`` on a duplicate: libzmq then sees the end of the
stream and closes the connection itself) a connection whose address already holds N. So one
address holds at most ``N x --max-frame-bytes`` in unfinished frames. All local clients share the
loopback address: N bounds them together.

What it cannot do, and why:

* It counts connections, not connections with an unfinished frame: libzmq says nothing of a
  connection's state between its handshake and its end.
* Not per CURVE key: the ZAP handler sees a handshake's key and IP address but not its connection
  (no descriptor, no port), and the monitor sees a descriptor but no key, so no count of a key's
  connections could be taken down when one ends.
* libzmq sends monitor events without waiting: where its queue is full, an event is lost. Each
  connection counted is therefore kept with its socket's inode and checked again (``fstat``)
  before its address is refused, so a lost ``EVENT_DISCONNECTED`` cannot keep an address refused.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kcoral.service.fairness import RateLimit

log = structlog.get_logger("kcoral.service")

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
REFUSAL_LOGS_PER_SECOND = 1.0
REFUSAL_LOG_BURST = 5


@dataclass
class ConnectionCap:
    """The connections of each peer address, counted from the client socket's monitor."""

    most: int  # connections per address; 0: no cap (then nothing is watched)
    ports: set[int] = field(default_factory=set)  # the client socket's TCP ports
    held: dict[int, tuple[str, int]] = field(default_factory=dict)  # descriptor -> (address, inode)
    refused: int = 0
    _log: RateLimit[str] = field(default_factory=lambda: RateLimit(REFUSAL_LOGS_PER_SECOND, REFUSAL_LOG_BURST))

    def watch(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket | None:
        """The monitor of ``sock`` (before it binds), or None without a cap."""
        if not self.most:
            return None
        return sock.get_monitor_socket(EVENTS)

    def bound(self, endpoint: str) -> None:
        """``sock`` is bound at ``endpoint``: its TCP port is one of ours."""
        if endpoint.startswith("tcp://"):
            with contextlib.suppress(ValueError):
                self.ports.add(int(endpoint.rsplit(":", 1)[1]))

    async def run(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
            except (ValueError, TypeError, IndexError):  # not a monitor event: nothing to count
                continue
            self.on_event(int(event["event"]), int(event["value"]))

    def on_event(self, kind: int, fd: int) -> None:
        if kind == zmq.EVENT_DISCONNECTED:
            self.held.pop(fd, None)
        elif kind == zmq.EVENT_ACCEPTED:
            self.on_accepted(fd)

    def on_accepted(self, fd: int) -> None:
        try:
            peer = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # gone already: its EVENT_DISCONNECTED follows
        try:
            # The descriptor may be another's by now (it closed and the number was reused): only a
            # TCP connection to our own port is counted or refused.
            if peer.family not in (socket.AF_INET, socket.AF_INET6) or peer.getsockname()[1] not in self.ports:
                return
            address = str(peer.getpeername()[0])
            inode = os.fstat(peer.fileno()).st_ino
            if self.count(address) >= self.most:
                peer.shutdown(socket.SHUT_RDWR)
                self.refused += 1
                if self._log.allow(address):
                    log.warning("connection_refused", address=address, most=self.most, refused=self.refused)
                return
            self.held[fd] = (address, inode)
        except OSError:
            return
        finally:
            peer.close()

    def count(self, address: str) -> int:
        """The connections of ``address`` still open (those whose descriptor now holds another
        socket, or none, forgotten: their EVENT_DISCONNECTED was lost)."""
        count = 0
        for fd, (held_address, inode) in list(self.held.items()):
            if held_address != address:
                continue
            try:
                same = os.fstat(fd).st_ino == inode
            except OSError:
                same = False
            if same:
                count += 1
            else:
                del self.held[fd]
        return count

    def describe(self) -> dict[str, int]:
        return {"most_per_address": self.most, "held": len(self.held), "refused": self.refused}


__all__ = ["ConnectionCap"]
