"""The router: real ``kcoral router`` and ``kcoral broker --upstream`` processes on loopback, and
fake nodes speaking the node link with raw pyzmq where a test needs to steer a node exactly."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kcoral import AsyncClient, Client, KCoralError, Program, protocol
from kcoral.testing import RunningService as RunningRouter
from kcoral.testing import start_router
from tests.helpers import BrokerFactory, RunningBroker

pytestmark = pytest.mark.timeout(60)

START_TIMEOUT_SECONDS = 20.0
LIVENESS_SECONDS = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS

NAP_SOURCE = "import time\ndef nap(seconds):\n    time.sleep(seconds)\n    return seconds\n"


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator[Callable[..., RunningRouter]]:
    """Start ``kcoral router`` processes; each is stopped at teardown."""
    started: list[RunningRouter] = []

    def factory(*args: str, url: str | None = None, nodes_url: str | None = None) -> RunningRouter:
        router = start_router(tmp_path, *args, url=url, nodes_url=nodes_url, timeout_seconds=START_TIMEOUT_SECONDS)
        started.append(router)
        return router

    yield factory
    for router in started:
        router.stop(timeout_seconds=10)


def node_broker(broker_factory: BrokerFactory, router: RunningRouter, node_id: str) -> RunningBroker:
    return broker_factory("--workers", "1", "--upstream", router.nodes_url, "--node-id", node_id)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` (which may ask the router for its health) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        # A health request that gets no answer in time on a loaded CI machine is asked again.
        with contextlib.suppress(KCoralError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def wait_live(router: RunningRouter, *node_ids: str) -> dict[str, dict[str, Any]]:
    wait_for(lambda: all(router.nodes().get(n, {}).get("state") == "live" for n in node_ids), 10, f"nodes {node_ids}")
    return router.nodes()


def nap_program(seconds: float) -> Program:
    program = Program()
    module = program.upload(kind="module", source=NAP_SOURCE)
    nap = program.get_function(module=module, name="nap")
    program.return_(key="slept", value=program.run(fn=nap, args=[seconds]))
    return program


def test_two_nodes_share_the_work_and_health_lists_both(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    router = router_factory()
    brokers = [node_broker(broker_factory, router, n) for n in ("a", "b")]
    nodes = wait_live(router, "a", "b")
    assert {n["gpus"] for n in nodes.values()} == {0}
    assert all(n["load"]["request_capacity"] == 1 for n in nodes.values())
    health = router.health()
    assert health["status"] == "ok" and health["load"]["request_capacity"] == 2
    assert health["versions"]["protocol"] == "KC1" and "instance_id" in health and "started_at" in health

    async def run_six() -> list[float]:
        async with AsyncClient(router.url) as client:
            results = await asyncio.gather(*(client.execute(nap_program(0.3)) for _ in range(6)))
        assert all(r.status == "COMPLETED" for r in results), [r.error for r in results]
        return [r.results["slept"] for r in results]

    assert asyncio.run(run_six()) == [0.3] * 6
    nodes = router.nodes()
    assert nodes["a"]["dispatched"] > 0 and nodes["b"]["dispatched"] > 0
    assert nodes["a"]["dispatched"] + nodes["b"]["dispatched"] == 6
    for broker in brokers:  # each node's own broker ran some of them
        with Client(broker.url) as client:
            assert client.health()["counters"]["completed"] > 0
    status = subprocess.run(
        [sys.executable, "-m", "kcoral.cli", "status", router.url], capture_output=True, text=True, timeout=30
    )
    assert status.returncode == 0 and "nodes     2 live of 2" in status.stdout
    assert re.search(r"^  b +live ", status.stdout, re.MULTILINE), status.stdout


def test_a_killed_node_fails_its_program_with_node_lost_and_comes_back(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    router = router_factory()
    broker_a = node_broker(broker_factory, router, "a")
    node_broker(broker_factory, router, "b")
    wait_live(router, "a", "b")

    async def scenario() -> None:
        async with AsyncClient(router.url) as client:
            # One slot per node: the two long programs run one on each node.
            long_runs = [asyncio.create_task(client.execute(nap_program(60))) for _ in range(2)]
            try:
                await asyncio.to_thread(
                    wait_for,
                    lambda: all(n["in_flight"] == 1 for n in router.nodes().values()),
                    10,
                    "a program on each node",
                )
                killed_at = time.monotonic()
                broker_a.stop(signal.SIGKILL)
                done, pending = await asyncio.wait(long_runs, timeout=8, return_when=asyncio.FIRST_COMPLETED)
                lost_after = time.monotonic() - killed_at
                assert len(done) == 1 and len(pending) == 1
                error = next(iter(done)).exception()
                assert isinstance(error, KCoralError) and error.kind == "node_lost", error
                assert lost_after < LIVENESS_SECONDS + 2.0
            finally:
                # Cancelling the other frees node b (the CANCEL goes through the router to it).
                for task in long_runs:
                    task.cancel()
                await asyncio.gather(*long_runs, return_exceptions=True)
            await asyncio.to_thread(
                wait_for, lambda: router.nodes()["b"]["in_flight"] == 0, 10, "the cancel to reach node b"
            )
            later = await client.execute(nap_program(0))
            assert later.status == "COMPLETED", later.error

    asyncio.run(scenario())
    nodes = router.nodes()
    assert nodes["a"]["state"] == "lost" and nodes["b"]["dispatched"] == 2
    lost_instance = nodes["a"]["instance_id"]
    # A restarted node registers again under the same id and takes work again.
    node_broker(broker_factory, router, "a")
    nodes = wait_live(router, "a")
    assert nodes["a"]["instance_id"] != lost_instance and nodes["a"]["dispatched"] == 0

    async def run_two() -> None:
        async with AsyncClient(router.url) as client:
            results = await asyncio.gather(*(client.execute(nap_program(0.3)) for _ in range(2)))
        assert all(r.status == "COMPLETED" for r in results)

    asyncio.run(run_two())
    assert router.nodes()["a"]["dispatched"] >= 1
    assert "node_lost" in router.log()


def test_a_program_through_the_router_negotiates_its_blobs_and_survives_a_router_restart(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    router = router_factory()
    node_broker(broker_factory, router, "a")
    wait_live(router, "a")
    data = np.arange(1 << 16, dtype=np.float32)
    program = Program()
    module = program.upload(kind="module", source="def twice(x):\n    return x * 2\n")
    tensor = program.upload(kind="tensor", value=data)
    twice = program.get_function(module=module, name="twice")
    program.return_(key="y", value=program.run(fn=twice, args=[tensor]))
    with Client(router.url) as client:
        first = client.execute(program)
        sent = client.blob_bytes_sent
        second = client.execute(program)
        assert client.blob_bytes_sent == sent  # the node's broker kept the tensor
    assert first.status == second.status == "COMPLETED", first.error
    np.testing.assert_array_equal(first.results["y"], data * 2)
    assert sent == data.nbytes
    node = router.nodes()["a"]
    assert node["dispatched"] == 2 and node["in_flight"] == 0
    # The node registers again with a router restarted on the same endpoints, and still holds
    # the blob: the program runs again without an upload.
    router.stop(signal.SIGKILL)
    restarted = router_factory(url=router.url, nodes_url=router.nodes_url)
    wait_live(restarted, "a")
    with Client(restarted.url) as client:
        third = client.execute(program)
        assert client.blob_bytes_sent == 0
    np.testing.assert_array_equal(third.results["y"], data * 2)


def test_a_router_without_nodes_answers_health_and_refuses_programs_after_node_wait(
    router_factory: Callable[..., RunningRouter],
) -> None:
    node_wait = 2.0
    router = router_factory("--node-wait", str(node_wait))
    with Client(router.url) as client:
        health = client.health()
        assert health["nodes"] == [] and health["gpu_count"] == 0 and health["status"] == "ok"
        assert health["load"]["request_capacity"] == 0
        assert client.target()["device"] == "none"
        # Right after the router starts (the pool is empty since then), a program waits for a
        # node to register...
        assert time.time() < health["started_at"] + node_wait
        with pytest.raises(KCoralError) as waited:
            client.execute(nap_program(0))
        assert waited.value.kind == "busy"
        assert health["started_at"] + node_wait <= time.time() < health["started_at"] + node_wait + 3
        # ...and once the pool has been empty for --node-wait, programs are refused at once.
        started = time.monotonic()
        with pytest.raises(KCoralError) as refused:
            client.execute(nap_program(0))
        assert refused.value.kind == "busy" and time.monotonic() - started < 1
        assert "no host broker" in refused.value.message


# --- fake nodes: the node link driven by hand -------------------------------------------------


class FakeNode:
    """A node that registers and answers programs from a script, over raw pyzmq."""

    def __init__(self, context: zmq.asyncio.Context, url: str, node_id: str, capacity: int = 4) -> None:
        self.node_id, self.capacity = node_id, capacity
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, f"n-{uuid.uuid4().hex}".encode())
        self.socket.connect(url)
        self.blobs: set[str] = set()
        self.load_report = {
            "status": "ok",
            "load": {"request_capacity": capacity, "requests_in_progress": 0, "requests_waiting": 0},
        }
        self.executed: list[str] = []
        self.beating = True
        self.registered = asyncio.Event()
        self.programs: dict[str, list[str]] = {}
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._beat())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.socket.close(linger=0)

    async def send(self, command: bytes, body: dict[str, Any], *frames: Any) -> None:
        await self.socket.send_multipart(protocol.message(command, body, *frames))

    async def _beat(self) -> None:
        await self.send(
            protocol.NODE_REGISTER,
            {"node_id": self.node_id, "instance_id": "fake", "hostname": "fake", "gpu_count": 0,
             **self.load_report, "target": {"device": "cpu", "arch": []}, "versions": {"kcoral": "0"}},
        )  # fmt: skip
        while True:
            await asyncio.sleep(protocol.HEARTBEAT_INTERVAL_SECONDS)
            if self.beating:
                await self.send(protocol.NODE_HEARTBEAT, self.load_report)

    async def _serve(self) -> None:
        while True:
            command, body, _ = protocol.split_message(await self.socket.recv_multipart())
            if command == protocol.NODE_REGISTERED:
                self.registered.set()
            elif command == protocol.EXECUTE:
                request_id = body["request_id"]
                self.executed.append(request_id)
                self.programs[request_id] = protocol.program_digests(body["program"])
                await self._negotiate(request_id)
            elif command == protocol.BLOBS:
                self.blobs.update(body["blobs"])
                await self._negotiate(body["request_id"])

    async def _negotiate(self, request_id: str) -> None:
        missing = [d for d in self.programs[request_id] if d not in self.blobs]
        if missing:
            await self.send(protocol.PARTIAL, {"request_id": request_id, "state": "need_blobs", "blobs": missing})
            return
        await self.send(protocol.PARTIAL, {"request_id": request_id, "state": "queued"})
        if self.beating:  # a node that stopped beating never answers either
            result = {"request_id": request_id, "status": "COMPLETED", "results": {"node": self.node_id}}
            await self.send(protocol.FINAL, {"request_id": request_id, "ok": True, "result": result})


@contextlib.asynccontextmanager
async def fake_nodes(router: RunningRouter, *node_ids: str) -> AsyncIterator[list[FakeNode]]:
    assert router.nodes_url is not None
    context = zmq.asyncio.Context()
    nodes = [FakeNode(context, router.nodes_url, n) for n in node_ids]
    try:
        await asyncio.wait_for(asyncio.gather(*(n.registered.wait() for n in nodes)), 10)
        yield nodes
    finally:
        for node in nodes:
            await node.close()
        context.term()


def tensor_program(seed: int) -> Program:
    program = Program()
    value = program.upload(kind="tensor", value=np.full(1024, seed, dtype=np.int32))
    program.return_(key="v", value=value)
    return program


def test_dispatch_prefers_the_node_that_holds_the_blobs_and_a_silent_node_is_lost(
    router_factory: Callable[..., RunningRouter],
) -> None:
    router = router_factory()

    async def scenario() -> None:
        async with fake_nodes(router, "x", "y") as (x, y), AsyncClient(router.url) as client:
            first = await client.execute(tensor_program(1))
            holder = first.results["node"]
            assert client.blobs_sent == 1
            for _ in range(4):  # the same blob: always the node that has it, never uploaded again
                again = await client.execute(tensor_program(1))
                assert again.results["node"] == holder
            assert client.blobs_sent == 1
            # A node that stops answering is taken out of the pool; its program fails with
            # node_lost. One that said it would be quiet for a while (storing a large upload) stays.
            silent, quiet = (x, y) if holder == "x" else (y, x)
            await quiet.send(protocol.NODE_HEARTBEAT, {**quiet.load_report, "quiet_seconds": 30})
            silent.beating = quiet.beating = False
            started = time.monotonic()
            with pytest.raises(KCoralError) as lost:
                await client.execute(tensor_program(1))  # to the holder, by its blob
            assert lost.value.kind == "node_lost" and time.monotonic() - started < LIVENESS_SECONDS + 2
            await asyncio.sleep(1)
            nodes = (await client.health())["nodes"]
            assert {n["node_id"]: n["state"] for n in nodes} == {silent.node_id: "lost", quiet.node_id: "live"}

    asyncio.run(scenario())


def test_the_router_survives_bad_messages_from_clients_and_nodes(
    router_factory: Callable[..., RunningRouter],
) -> None:
    router = router_factory()
    assert router.nodes_url is not None
    context = zmq.Context()
    try:
        client = context.socket(zmq.DEALER)
        node = context.socket(zmq.DEALER)
        for sock, url in ((client, router.url), (node, router.nodes_url)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(url)
        # Dropped without a reply: too few frames, another version, a body that is not msgpack.
        client.send_multipart([b"x"])
        client.send_multipart([b"KC9", protocol.HEALTH, protocol.pack({"request_id": "r"})])
        client.send_multipart([protocol.VERSION, protocol.EXECUTE, b"\xc1\xc1"])
        # Unreadable, but its request id can still be read: answered parse (docs/protocol.md, section 9).
        unreadable = msgpack.packb({"request_id": "r0", "x": msgpack.ExtType(42, b"")})
        client.send_multipart([protocol.VERSION, protocol.HEALTH, unreadable])
        reply, reply_body, _ = protocol.split_message(client.recv_multipart())
        assert reply == protocol.FINAL and reply_body["request_id"] == "r0"
        assert reply_body["error"]["kind"] == "parse" and "unreadable message" in reply_body["error"]["message"]
        # Answered with parse: an unknown command, BLOBS for nothing, a program that is no map.
        for command, body in (
            (b"\x7f", {"request_id": "r1"}),
            (protocol.BLOBS, {"request_id": "r2", "blobs": []}),
            (protocol.EXECUTE, {"request_id": "r3", "program": [1]}),
            (protocol.NODE_REGISTER, {"request_id": "r4"}),  # a node command on the client socket
        ):
            client.send_multipart(protocol.message(command, body))
            reply, reply_body, _ = protocol.split_message(client.recv_multipart())
            assert reply == protocol.FINAL and reply_body["request_id"] == body["request_id"]
            assert reply_body["error"]["kind"] == "parse"
        # Nodes: garbage is dropped; a bad registration and an unknown node are told to go away.
        node.send_multipart([b"garbage"])
        node.send_multipart(protocol.message(protocol.NODE_REGISTER, {"node_id": "bad id!", "load": {}}))
        command, body, _ = protocol.split_message(node.recv_multipart())
        assert command == protocol.NODE_DISCONNECT and "registration refused" in body["reason"]
        node.send_multipart(protocol.message(protocol.FINAL, {"request_id": "r5", "ok": True}))
        command, body, _ = protocol.split_message(node.recv_multipart())
        assert command == protocol.NODE_DISCONNECT and "unknown node" in body["reason"]
        health = router.health()
        assert health["status"] == "ok" and health["nodes"] == []
        assert router.process.poll() is None
    finally:
        context.destroy(linger=0)


def test_peek_request_id_reads_only_what_it_needs() -> None:
    body = protocol.pack({"ok": True, "result": {"big": b"x" * 100_000}, "request_id": "abc"})
    assert protocol.peek_request_id(body) == "abc"
    for bad in (b"", protocol.pack([1, 2]), protocol.pack({"ok": True}), protocol.pack({"request_id": "no spaces"})):
        with pytest.raises(protocol.WireError):
            protocol.peek_request_id(bad)


def test_session_programs_through_the_router_never_share_a_worker(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    # Every router client reaches the node through its one relay connection, which would key one
    # session for all of them: the node runs them as any other program, each in a fresh worker.
    router = router_factory()
    broker = broker_factory("--workers", "2", "--upstream", router.nodes_url, "--node-id", "a")
    wait_live(router, "a")
    program = Program()
    program.return_(key="v", value=1)
    with Client(router.url, session=True) as alice, Client(router.url, session=True) as bob:
        results = [alice.execute(program), bob.execute(program), alice.execute(program)]
    assert all(r.completed for r in results), [r.error for r in results]
    identities = [r.worker["identity"] for r in results]
    assert len(set(identities)) == 3, identities
    with Client(broker.url) as client:
        assert client.health()["sessions"] == []


def test_a_node_that_loses_its_router_cancels_the_routers_programs_in_its_broker(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    # The router fails them with node_lost and never replays them: the node's relay stops them in
    # its broker (their worker freed), drops their late answers, and registers again.
    router = router_factory()
    broker = node_broker(broker_factory, router, "a")
    wait_live(router, "a")

    def running_on_the_broker() -> int:
        return int(broker.health()["load"]["requests_in_progress"])

    async def lose_the_router() -> None:
        async with AsyncClient(router.url) as client:
            long_run = asyncio.create_task(client.execute(nap_program(60)))
            try:
                await asyncio.to_thread(wait_for, lambda: running_on_the_broker() == 1, 10, "the program to run")
                router.stop(signal.SIGKILL)
                await asyncio.to_thread(
                    wait_for, lambda: running_on_the_broker() == 0, LIVENESS_SECONDS + 5, "the relay's cancel"
                )
            finally:
                long_run.cancel()
                await asyncio.gather(long_run, return_exceptions=True)

    asyncio.run(lose_the_router())
    assert "upstream_cancelling_in_flight" in broker.log()
    assert broker.health()["counters"]["errors_by_kind"].get("cancelled") == 1
    restarted = router_factory(url=router.url, nodes_url=router.nodes_url)
    wait_live(restarted, "a")
    with Client(restarted.url) as client:  # the node's one worker slot is free again
        assert client.execute(nap_program(0)).status == "COMPLETED"
