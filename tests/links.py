"""A service's ROUTER socket and one peer on loopback, for the tests of the collaborators that read
such a socket without their service (tests/test_worker_messages.py, tests/test_node_messages.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.service.sockets import router_socket
from tests.helpers import free_port


@dataclass
class Link:
    backend: zmq.asyncio.Socket  # the service's side, made as the services make it
    peer: zmq.asyncio.Socket  # a worker's or a node's DEALER

    async def deliver(
        self, on_message: Callable[[list[zmq.Frame]], None], command: bytes, body: dict[str, Any]
    ) -> None:
        """The peer sends a message; ``on_message`` reads it as the service's receive loop would."""
        await self.peer.send_multipart(protocol.message(command, body))
        on_message(await asyncio.wait_for(self.backend.recv_multipart(copy=False), 5))

    async def answer(self) -> tuple[bytes, dict[str, Any]]:
        """The next message the peer got: (command, body)."""
        command, body, _ = protocol.split_message(await asyncio.wait_for(self.peer.recv_multipart(), 5))
        return command, body


@asynccontextmanager
async def loopback_link(identity: bytes) -> AsyncIterator[Link]:
    context = zmq.asyncio.Context()
    url = f"tcp://127.0.0.1:{free_port()}"
    backend = router_socket(context)
    backend.bind(url)
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, identity)
    peer.connect(url)
    try:
        yield Link(backend, peer)
    finally:
        peer.close(linger=0)
        backend.close(linger=0)
        context.term()
