"""Socket helpers shared by the broker, the router and the upstream relay.

A socket with an :class:`Inbox` (every socket :func:`receive_forever` reads) is read and written
without pyzmq's asyncio futures: the loop watches the socket's file descriptor itself and takes
every queued message with a non-blocking receive, and :func:`send_now` sends on it at once,
non-blocking. The futures cost more of the broker's loop than anything of ours: about a fifth of
its busy time with 8 programs in flight, in their event handler, their re-arming and the enum
flags they build (``benchmarks/RESULTS.md``, "The loop's own sockets"). So with ROUTER_MANDATORY
an unreachable peer, or a full queue, raises ``zmq.ZMQError`` here and now.

The file descriptor is edge-triggered, and any operation on the socket (a send as well) can take
the edge that announced incoming messages: after each send, :func:`send_now` looks at the socket's
events again and wakes its reader where a message waits, so that a queued message never waits for
the next one to arrive (without it, 8 programs in flight stalled for seconds; see
zeromq/pyzmq#1208 for the same in pyzmq's own futures). The upstream relay's link, which it
reads with a deadline (its heartbeats), has an :class:`Inbox` of its own. A socket without one is
sent on through pyzmq's asyncio ``send_multipart`` with NOBLOCK, its future read at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import structlog
import zmq
import zmq.asyncio

log = structlog.get_logger("kcoral.sockets")

SOCKET_HIGH_WATER_MARK = 100_000
# The receive loops hand control back to the event loop after this many messages in a row: with
# messages queued, pyzmq's receive futures are done at once and an ``await`` never yields, so a
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


class Inbox:
    """One socket's reading without pyzmq's futures: a plain socket over the same zmq socket, its
    file descriptor watched by the event loop, and the event that wakes the reader.

    The socket is the inbox's alone to read from the start (no pyzmq future may wait on it), and is
    sent on through :func:`send_now` while the inbox is open. Closed with :meth:`close`, before the
    socket; the plain socket is only a view of the zmq socket and is never used once it is closed.
    """

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._raw: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._descriptor = int(self._raw.get(zmq.FD))
        self._loop.add_reader(self._descriptor, self._wake.set)
        _inboxes[sock] = self
        self.closed = False

    def waiting(self) -> bool:
        """Whether a message waits to be received (False once the socket is closed)."""
        return not self.closed and not self.sock.closed and bool(int(self._raw.get(zmq.EVENTS)) & zmq.POLLIN)

    def look_again(self) -> None:
        """Wake the reader where a message waits (an operation may have taken the edge)."""
        if self.waiting():
            self._wake.set()

    def send(self, frames: Sequence[Any], copy: bool) -> None:
        if self.closed or self.sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            self._raw.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        finally:
            self.look_again()

    async def receive(self, timeout_seconds: float | None = None) -> list[zmq.Frame] | None:
        """The next message, at once where one waits; None after ``timeout_seconds`` without one."""
        deadline = None if timeout_seconds is None else self._loop.time() + timeout_seconds
        while True:
            if self.waiting():
                try:
                    return self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
            self._wake.clear()
            if self.waiting():
                continue
            if deadline is None:
                await self._wake.wait()
                continue
            left = deadline - self._loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._wake.wait()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if _inboxes.get(self.sock) is self:
            del _inboxes[self.sock]
        if not self.sock.closed and not self._loop.is_closed():
            self._loop.remove_reader(self._descriptor)


_inboxes: weakref.WeakKeyDictionary[zmq.asyncio.Socket, Inbox] = weakref.WeakKeyDictionary()


def send_now(sock: zmq.asyncio.Socket, frames: Sequence[Any], *, copy: bool = False) -> None:
    """Send a message without waiting; raise ``zmq.ZMQError`` at once when it cannot go."""
    inbox = _inboxes.get(sock)
    if inbox is not None:
        inbox.send(frames, copy)
        return
    sent = cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy))
    if not sent.done():  # only when another send is left waiting, which none of ours does
        sent.cancel()
        raise zmq.Again()
    sent.result()  # raises what the send raised


async def receive_forever(sock: zmq.asyncio.Socket, handle: MessageHandler, failure_event: str) -> None:
    """Hand every message to ``handle``; one that raises is logged and never stops the loop (see
    :class:`Inbox`: the socket is this loop's alone to read)."""
    inbox = Inbox(sock)
    in_a_row = 0
    try:
        while True:
            if not inbox.waiting():
                in_a_row = 0
            frames = await inbox.receive()
            if frames is None:
                continue
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
        inbox.close()


__all__ = ["SOCKET_HIGH_WATER_MARK", "Inbox", "receive_forever", "router_socket", "send_now"]
