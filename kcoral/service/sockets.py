"""Socket helpers shared by the broker, the router and the upstream relay.

Every socket :func:`receive_forever` reads, and the upstream relay's link (read with a deadline,
for its heartbeats), has a :class:`kcoral.inbox.Inbox` while it is read: it is read and written
without pyzmq's asyncio futures, and :func:`send_now` sends on it at once, non-blocking, then looks
at the socket's events again (the descriptor is edge-triggered: see the inbox). So with
ROUTER_MANDATORY an unreachable peer, or a full queue, raises ``zmq.ZMQError`` here and now. A
socket without an inbox is sent on through pyzmq's asyncio ``send_multipart`` with NOBLOCK, its
future read at once.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import structlog
import zmq
import zmq.asyncio

from kcoral.inbox import Inbox

log = structlog.get_logger("kcoral.sockets")

SOCKET_HIGH_WATER_MARK = 100_000
# The receive loops hand control back to the event loop after this many messages in a row: a
# flood would otherwise starve heartbeats, timers and the other sockets.
YIELD_EVERY_MESSAGES = 64

MessageHandler = Callable[[list[zmq.Frame]], None]


def router_socket(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    """A ROUTER that refuses to drop replies silently (ROUTER_MANDATORY), with bounded queues."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SOCKET_HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, SOCKET_HIGH_WATER_MARK)
    return sock


# The sockets of the service that have an inbox open: send_now sends through it.
_inboxes: weakref.WeakKeyDictionary[zmq.asyncio.Socket, Inbox] = weakref.WeakKeyDictionary()


def open_inbox(sock: zmq.asyncio.Socket) -> Inbox:
    """An :class:`Inbox` of ``sock``, through which :func:`send_now` sends while it is open."""
    inbox = Inbox(sock)
    _inboxes[sock] = inbox
    return inbox


def close_inbox(inbox: Inbox) -> None:
    if _inboxes.get(inbox.sock) is inbox:
        del _inboxes[inbox.sock]
    inbox.close()


def _open_inbox_of(sock: zmq.asyncio.Socket) -> Inbox | None:
    """``sock``'s inbox while it is open: every read and write of the socket goes through it then."""
    inbox = _inboxes.get(sock)
    return inbox if inbox is not None and not inbox.closed else None


def send_now(sock: zmq.asyncio.Socket, frames: Sequence[Any], *, copy: bool = False) -> None:
    """Send a message without waiting; raise ``zmq.ZMQError`` at once when it cannot go."""
    inbox = _open_inbox_of(sock)
    if inbox is not None:
        inbox.send(frames, copy)
        return
    sent = cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy))
    if not sent.done():  # only when another send is left waiting, which none of ours does
        sent.cancel()
        raise zmq.Again()
    sent.result()  # raises what the send raised


def messages_waiting(sock: zmq.asyncio.Socket) -> bool:
    """Whether a message waits to be read on ``sock``, asked through its inbox where one is open (a
    read of the events outside it could take the edge its reader waits for)."""
    inbox = _open_inbox_of(sock)
    if inbox is not None:
        return inbox.waiting()
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


async def receive_forever(sock: zmq.asyncio.Socket, handle: MessageHandler, failure_event: str) -> None:
    """Hand every message to ``handle`` until the socket's inbox is closed or this is cancelled;
    one that raises is logged and never stops the reading (see :class:`Inbox`: the socket is this
    loop's alone to read). The loop's other work gets a turn after YIELD_EVERY_MESSAGES in a row.

    A task, not :meth:`Inbox.serve`: served from the descriptor's callback, the service's sockets
    gained nothing measurable on the H200 and a session's GPU programs with 8 in flight ran 10 to
    30% fewer a second (benchmarks/RESULTS.md, 2026-12-03); the client's one socket keeps serve."""
    inbox = open_inbox(sock)
    in_a_row = 0
    try:
        while True:
            frames = await inbox.receive()
            if frames is None:
                return  # closed
            try:
                handle(frames)
            except Exception:
                log.exception(failure_event)
            # Drop this message's frames now, not when the next message arrives: a large upload or
            # result would otherwise stay in memory for as long as the socket is quiet.
            del frames
            in_a_row += 1
            if in_a_row >= YIELD_EVERY_MESSAGES:
                in_a_row = 0
                await asyncio.sleep(0)
    finally:
        close_inbox(inbox)


__all__ = [
    "SOCKET_HIGH_WATER_MARK",
    "Inbox",
    "close_inbox",
    "messages_waiting",
    "open_inbox",
    "receive_forever",
    "router_socket",
    "send_now",
]
