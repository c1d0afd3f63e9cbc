"""One zmq socket read and written without pyzmq's asyncio futures, by the service and the client.

The event loop watches the socket's file descriptor itself; every queued message is taken with a
non-blocking receive, and every send is made at once (or, with :meth:`Inbox.send_waiting`, once
there is room), after which the socket's events are read again. The futures cost more of the
broker's loop than anything of its own: about a fifth of its busy time with 8 programs in flight,
in their event handler, their re-arming and the enum flags they build (``benchmarks/RESULTS.md``,
"The loop's own sockets").

The file descriptor is edge-triggered, and any operation on the socket (a send as well) can take
the edge that announced incoming messages: after each send the inbox looks at the socket's events
again and wakes its reader where a message waits, so that a queued message never waits for the
next one to arrive (without it, 8 programs in flight stalled for seconds; see zeromq/pyzmq#1208
for the same in pyzmq's own futures).

A socket's reader either awaits :meth:`Inbox.receive` (one message at a time, with a deadline where
it needs one) or hands :meth:`Inbox.serve` a handler, which the inbox calls with each message from
the loop's own callback for the descriptor: no task is woken per message, so a message is handled
in the loop iteration that found it, not the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

# The socket's events as plain ints: pyzmq's are enum flags, and each ``&`` of one builds an enum
# member (0.6 us against 0.03 us an int's, several times for every message read or sent).
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
NOBLOCK = int(zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)


class Inbox:
    """One socket's reading without pyzmq's futures: a plain socket over the same zmq socket, its
    file descriptor watched by the event loop, and the event that wakes the reader.

    The socket is the inbox's alone to read and write from the start (no pyzmq future may wait on
    it): :meth:`send` at once or not at all, :meth:`send_waiting` when there is room. Closed with
    :meth:`close`, before the socket; the plain socket is only a view of the zmq socket and is
    never used once it is closed.
    """

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._raw: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        self._wake = asyncio.Event()  # a message may wait
        self._room = asyncio.Event()  # a send may go
        self._loop = asyncio.get_running_loop()
        self._descriptor = int(self._raw.get(zmq.FD))
        self._loop.add_reader(self._descriptor, self._on_descriptor)
        self.closed = False
        # serve(): the handler, the messages it takes before other callbacks get a turn, whether
        # it is being called now or is to be called soon, and what serve() returned.
        self._handler: Callable[[list[zmq.Frame]], None] | None = None
        self._batch = 0
        self._draining = False
        self._drain_soon: asyncio.Handle | None = None
        self._served: asyncio.Future[None] | None = None

    def _on_descriptor(self) -> None:
        self._wake.set()
        self._room.set()
        if self._handler is not None:
            self._drain()

    def _events(self) -> int:
        """The socket's events now (0 once it is closed). Reading them may take the edge that
        would have woken the reader or a waiting sender: whichever they concern is woken here."""
        if self.closed or self.sock.closed:
            return 0
        events = int(self._raw.get(EVENTS))
        if events & POLLIN:
            self._wake.set()
            if self._handler is not None and not self._draining and self._drain_soon is None:
                # Not from inside another message's handling (a send may find this one): next.
                self._drain_soon = self._loop.call_soon(self._drain)
        if events & POLLOUT:
            self._room.set()
        return events

    def waiting(self) -> bool:
        """Whether a message waits to be received (False once the socket is closed)."""
        return bool(self._events() & POLLIN)

    def look_again(self) -> None:
        """Wake the reader where a message waits, and a waiting sender where there is room (an
        operation may have taken the edge)."""
        self._events()

    def send(self, frames: Sequence[Any], copy: bool = False) -> None:
        """Send at once; raise ``zmq.ZMQError`` (``zmq.Again`` where the queue is full) where it
        cannot go."""
        if self.closed or self.sock.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        try:
            self._raw.send_multipart(frames, flags=NOBLOCK, copy=copy)
        finally:
            self.look_again()

    async def send_waiting(self, frames: Sequence[Any], copy: bool = False) -> None:
        """Send once the queue has room (a client's large upload waits for its pieces to go)."""
        while True:
            try:
                self.send(frames, copy)
                return
            except zmq.Again:
                pass
            self._room.clear()
            if self.closed or self.sock.closed or self._events() & POLLOUT:
                continue  # send again (and raise, where the socket is gone)
            await self._room.wait()

    async def receive(self, timeout_seconds: float | None = None) -> list[zmq.Frame] | None:
        """The next message, at once where one waits; None after ``timeout_seconds`` without one,
        or once the inbox is closed."""
        deadline = None if timeout_seconds is None else self._loop.time() + timeout_seconds
        while True:
            if self.waiting():
                try:
                    return self._raw.recv_multipart(NOBLOCK, copy=False)
                except zmq.Again:
                    pass
            self._wake.clear()
            if self.waiting():
                continue
            if self.closed:
                return None
            if deadline is None:
                await self._wake.wait()
                continue
            left = deadline - self._loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._wake.wait()

    def serve(self, handler: Callable[[list[zmq.Frame]], None], batch: int) -> asyncio.Future[None]:
        """Call ``handler`` with every message, those waiting now first, until the inbox is closed
        (the future returned is then done), at most ``batch`` in a row before the loop's other
        callbacks get their turn. ``handler`` must not raise; it may send on this or any socket."""
        if self._handler is not None or self._served is not None:
            raise RuntimeError("this inbox is already served")
        self._handler, self._batch = handler, max(1, batch)
        self._served = self._loop.create_future()
        if self.closed:
            self._served.set_result(None)
        else:
            self._drain_soon = self._loop.call_soon(self._drain)
        return self._served

    def _drain(self) -> None:
        """Hand the handler what waits, until the socket says nothing does (its descriptor is
        edge-triggered: what is left unread wakes nobody) or the batch is taken."""
        self._drain_soon = None
        if self._draining or self._handler is None:
            return
        self._draining = True
        try:
            for _ in range(self._batch):
                if self.closed or not self._events() & POLLIN:
                    return
                try:
                    frames = self._raw.recv_multipart(NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:  # the socket or its context is gone: serve() raises it
                    self._handler = None
                    if self._served is not None and not self._served.done():
                        self._served.set_exception(exc)
                    return
                self._handler(frames)
                # Dropped now, not with the next message: a large upload or result would otherwise
                # stay in memory for as long as the socket is quiet.
                del frames
            if not self.closed and self._drain_soon is None:
                self._drain_soon = self._loop.call_soon(self._drain)  # more may wait: after the others
        finally:
            self._draining = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._wake.set()  # a reader waiting wakes, and finds the inbox closed
        self._room.set()
        if self._drain_soon is not None:
            self._drain_soon.cancel()
            self._drain_soon = None
        if self._served is not None and not self._served.done():
            self._served.set_result(None)
        if not self.sock.closed and not self._loop.is_closed():
            self._loop.remove_reader(self._descriptor)


__all__ = ["Inbox"]
