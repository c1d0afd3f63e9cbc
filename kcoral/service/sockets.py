"""Socket helpers shared by the broker, the router and the upstream relay.

Every send is pyzmq's asyncio ``send_multipart`` with NOBLOCK, and its future is read at once:
with nothing else waiting to send (we never leave a send waiting), pyzmq tries the send on the
spot and hands back a future that is already done. So with ROUTER_MANDATORY an unreachable peer, or
a full queue, raises ``zmq.ZMQError`` here and now rather than in a future nobody awaits. That path
also re-arms a receive that is waiting on the socket (the file descriptor is edge-triggered, and a
send can take the edge that announced incoming messages; pyzmq 17.1.2 and later look again, see
zeromq/pyzmq#1208), so a queued message never waits for the next one to arrive: without that, 8
programs in flight stalled for seconds.
"""

from __future__ import annotations

import asyncio
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


def send_now(sock: zmq.asyncio.Socket, frames: Sequence[Any], *, copy: bool = False) -> None:
    """Send a message without waiting; raise ``zmq.ZMQError`` at once when it cannot go."""
    sent = cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy))
    if not sent.done():  # only when another send is left waiting, which none of ours does
        sent.cancel()
        raise zmq.Again()
    sent.result()  # raises what the send raised


async def receive_forever(sock: zmq.asyncio.Socket, handle: MessageHandler, failure_event: str) -> None:
    """Hand every message to ``handle``; one that raises is logged and never stops the loop."""
    in_a_row = 0
    while True:
        frames = await sock.recv_multipart(copy=False)
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


__all__ = ["SOCKET_HIGH_WATER_MARK", "receive_forever", "router_socket", "send_now"]
