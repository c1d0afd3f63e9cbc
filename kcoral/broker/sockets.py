"""Socket helpers shared by the broker, the router and the upstream relay.

Sends go through a blocking-API shadow of the asyncio socket with NOBLOCK: with ROUTER_MANDATORY an
unreachable peer, or a full queue, raises here and now rather than in a future nobody awaits. A send
on the shadow consumes the edge-triggered readiness signal that the asyncio receive waits on, so the
asyncio socket is told to look again, or a message already queued would wait for the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import zmq
import zmq.asyncio

log = structlog.get_logger("kcoral.sockets")

SOCKET_HIGH_WATER_MARK = 100_000


def router_socket(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    """A ROUTER that refuses to drop replies silently (ROUTER_MANDATORY), with bounded queues."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SOCKET_HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, SOCKET_HIGH_WATER_MARK)
    return sock


class ImmediateSender:
    """Sends on an asyncio socket without waiting; failures raise ``zmq.ZMQError`` at once."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self._async = sock
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._sync

    def send(self, frames: Sequence[Any], *, copy: bool = False) -> None:
        self._sync.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        reschedule = getattr(self._async, "_schedule_remaining_events", None)
        if reschedule is not None:  # private to pyzmq; without it a queued message waits for the next
            reschedule()


# While messages are queued, pyzmq's recv returns futures that are already done, and awaiting a
# done future does not give the event loop a turn: 5,000 queued HEALTH requests silenced every
# heartbeat and timer for 8.3 s. So the loop yields after this many messages in a row: at about
# 0.1 ms a message, timers are at most a few ms late under any backlog.
YIELD_EVERY_MESSAGES = 16


async def receive_forever(
    sock: zmq.asyncio.Socket, handle: Callable[[list[zmq.Frame]], None], failure_event: str
) -> None:
    """Hand every message to ``handle``; one that raises is logged and never stops the loop."""
    received = 0
    while True:
        frames = await sock.recv_multipart(copy=False)
        received += 1
        if received % YIELD_EVERY_MESSAGES == 0:
            await asyncio.sleep(0)
        try:
            handle(frames)
        except Exception:
            log.exception(failure_event)
        # Drop this message's frames now, not when the next message arrives: a large upload or
        # result would otherwise stay in memory for as long as the socket is quiet.
        del frames
