"""The router's node side without a router: registration, a node's answers passed on, an unknown
node told to register again, and a silent node lost with its programs, in milliseconds.

:class:`NodeMessages` talks back to its router through a small port; here a recording port stands in
for the router, with a real ROUTER socket and a DEALER as the node, on loopback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from kcoral import protocol
from kcoral.router.node_messages import NodeMessages
from kcoral.router.nodes import RouterRequest
from kcoral.router.settings import RouterSettings
from tests.links import Link, loopback_link

pytestmark = pytest.mark.timeout(60)

LIVENESS = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS


@dataclass
class RecordingRouter:
    """The router's side of the port: it records what the node side asks for."""

    dispatches: int = 0
    finished: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, kind)
    relayed: list[tuple[bytes, str]] = field(default_factory=list)  # (client, request_id)
    uploaded: list[str] = field(default_factory=list)  # requests whose node holds every blob

    def dispatch(self) -> None:
        self.dispatches += 1

    def finish(self, request: RouterRequest, message: list[Any]) -> None:
        self.finished.append(request.id)

    def fail(self, request: RouterRequest, kind: str, text: str) -> None:
        if request.node is not None:
            request.node.requests.pop(request.id, None)
        self.failed.append((request.id, kind))

    def relay(self, client: bytes, message: list[Any], request_id: str) -> None:
        self.relayed.append((client, request_id))

    def uploads_asked(self, request: RouterRequest, body: dict[str, Any]) -> bool:
        return True  # no upload bounds here: the node's ask goes on to the client

    def uploads_done(self, request: RouterRequest) -> None:
        self.uploaded.append(request.id)


@dataclass
class Harness:
    side: NodeMessages
    router: RecordingRouter
    link: Link

    async def deliver(self, command: bytes, body: dict[str, Any]) -> None:
        await self.link.deliver(self.side.on_message, command, body)

    async def answer(self) -> tuple[bytes, dict[str, Any]]:
        return await self.link.answer()


@asynccontextmanager
async def node_side() -> AsyncIterator[Harness]:
    async with loopback_link(b"link-1") as link:
        router = RecordingRouter()
        side = NodeMessages(RouterSettings(), backend=link.backend, router_instance_id="router-1", port=router)
        yield Harness(side, router, link)


def registration(node_id: str = "gpu-host-1", capacity: int = 2) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "instance_id": "broker-1",
        "hostname": "gpu-host-1",
        "gpu_count": 1,
        "fake_gpus": 1,
        "status": "ok",
        "load": {"request_capacity": capacity},
        "target": {},
        "versions": {},
    }


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def test_a_node_registers_and_its_answers_reach_their_clients() -> None:
    async def main() -> None:
        async with node_side() as t:
            await t.deliver(protocol.NODE_REGISTER, registration())
            assert await t.answer() == (protocol.NODE_REGISTERED, {"instance_id": "router-1"})
            (node,) = t.side.nodes.values()
            assert (node.node_id, node.capacity, t.side.pool_empty_since) == ("gpu-host-1", 2, None)
            assert t.router.dispatches == 1  # a new node may take queued programs

            request = RouterRequest("r1", b"alice", 0, ["d" * 64], None, node=node)
            node.requests["r1"] = request
            await t.deliver(protocol.PARTIAL, {"request_id": "r1", "state": "queued"})
            assert t.router.relayed == [(b"alice", "r1")] and request.state == "queued"
            assert node.missing_blobs(["d" * 64]) == 0  # its broker holds the program's blobs now
            await t.deliver(protocol.PARTIAL, {"request_id": "gone", "state": "running"})
            assert t.router.relayed == [(b"alice", "r1")]  # an answer for no request here is dropped
            await t.deliver(protocol.FINAL, {"request_id": "r1", "ok": True, "result": {}})
            assert t.router.finished == ["r1"]

    run(main)


def test_an_unknown_node_is_told_to_register_and_a_bad_registration_is_refused() -> None:
    async def main() -> None:
        async with node_side() as t:
            await t.deliver(protocol.NODE_HEARTBEAT, {"status": "ok", "load": {}})
            command, body = await t.answer()
            assert command == protocol.NODE_DISCONNECT and "register again" in body["reason"]
            await t.deliver(protocol.NODE_REGISTER, {**registration(), "status": "asleep"})
            command, body = await t.answer()
            assert command == protocol.NODE_DISCONNECT and body["reason"].startswith("registration refused")
            assert t.side.nodes == {}

    run(main)


def test_a_silent_node_is_lost_with_its_programs_unless_it_announced_quiet() -> None:
    async def main() -> None:
        async with node_side() as t:
            await t.deliver(protocol.NODE_REGISTER, registration())
            await t.answer()
            (node,) = t.side.nodes.values()
            node.requests["r1"] = RouterRequest("r1", b"alice", 0, [], None, node=node)
            await t.deliver(protocol.NODE_HEARTBEAT, {"status": "ok", "load": {}, "quiet_seconds": 60})
            t.side.expire(time.monotonic() + LIVENESS + 1)
            assert t.side.nodes and t.router.failed == []  # storing a large upload: not lost yet

            t.side.expire(time.monotonic() + 61)
            assert t.side.nodes == {} and t.router.failed == [("r1", "node_lost")]
            assert t.side.programs_lost == 1 and t.side.pool_empty_since is not None
            lost = t.side.lost_nodes["gpu-host-1"]
            assert lost.state == "lost" and lost.lost_reason is not None and "stopped answering" in lost.lost_reason

    run(main)
