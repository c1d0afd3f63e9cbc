"""Hypothesis sends thousands of generated and mutated messages, valid ones among them, to a
broker, to a router and to the router's nodes endpoint; afterwards both still serve a normal
program and their memory is back under a bound.

In CI the example count is bounded (KCORAL_FUZZ_EXAMPLES, default 400: some 3,000 messages in
well under a minute); by hand, e.g. ``KCORAL_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcoral import Client, KCoralError, Program, protocol
from tests.helpers import RunningBroker, free_port, start_broker

FUZZ_EXAMPLES = int(os.environ.get("KCORAL_FUZZ_EXAMPLES", "400"))
# Growth of each service's resident memory allowed after the fuzzing: its caches and libzmq's
# buffers settle well below this; a leak per message (or a length bomb taken at its word) would not.
MEMORY_GROWTH_BOUND_BYTES = 256 << 20

pytestmark = pytest.mark.timeout(max(120, FUZZ_EXAMPLES))


@dataclass
class Services:
    broker: RunningBroker
    router_url: str
    nodes_url: str
    router: subprocess.Popen[bytes]
    router_log: Path


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    tmp = tmp_path_factory.mktemp("fuzz")
    router_url, nodes_url = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    router_log = tmp / "router.log"
    with open(router_log, "wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "kcoral.cli", "router", "--listen", router_url, "--nodes-listen", nodes_url],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    broker = start_broker(tmp, "--fake-gpus", "1", "--upstream", nodes_url, "--node-id", "fuzz-node")
    try:
        deadline = time.monotonic() + 30
        while True:
            with Client(router_url, connect_timeout_seconds=5) as client:
                if client.health()["nodes"]:
                    break
            assert time.monotonic() < deadline, router_log.read_text()
            time.sleep(0.2)
        yield Services(broker, router_url, nodes_url, router, router_log)
    finally:
        broker.stop()
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()


# --- what gets sent ---

ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-"
request_ids = st.one_of(
    st.text(ID_ALPHABET, min_size=1, max_size=12),
    st.sampled_from(["dup", "dup", "x" * 200, "x" * 201, "", "bad id", "ü"]),
    st.integers(),
    st.none(),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
COMMANDS = [
    protocol.EXECUTE,
    protocol.BLOBS,
    protocol.CANCEL,
    protocol.HEALTH,
    protocol.TARGET,
    protocol.READY,
    protocol.NODE_REGISTER,
    protocol.NODE_HEARTBEAT,
    protocol.FINAL,
]


def constant_program_body() -> dict[str, Any]:
    program = Program()
    program.return_(key="v", value=1)
    body, _ = program.to_wire()
    return body


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": draw(request_ids)}
    if draw(st.booleans()):
        body["program"] = draw(st.one_of(st.just(constant_program_body()), values))
    if draw(st.booleans()):
        body["options"] = draw(
            st.one_of(
                st.fixed_dictionaries({"timeout_seconds": st.one_of(st.floats(), st.integers(), values)}),
                st.fixed_dictionaries({"gpu_count": st.integers(-3, 100)}),
                values,
            )
        )
    if draw(st.booleans()):
        body["blobs"] = draw(st.one_of(st.lists(st.text("0123456789abcdef", min_size=64, max_size=64)), values))
    body.update(draw(st.dictionaries(st.text(max_size=6), values, max_size=2)))
    return body


# Extension values that claim more than they carry: a tensor of a huge shape, a ref to nowhere, a
# tuple nested deep, an unknown code.
EXT_BOMBS = [
    msgpack.ExtType(1, msgpack.packb(["numpy", "float32", [2**40, 2**40], "0" * 64])),
    msgpack.ExtType(1, msgpack.packb(["numpy", "float32", [-1], 3])),
    msgpack.ExtType(2, b"nowhere"),
    msgpack.ExtType(3, b"\xdd\xff\xff\xff\xff"),  # an array header claiming 4 billion items
    msgpack.ExtType(99, b""),
]
# Raw msgpack that lies about its length: maps and arrays of 2**32 - 1 entries, a bin of 4 GiB.
LENGTH_BOMBS = [b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x91" * 100_000]


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["valid", "valid", "generated", "mutated", "garbage", "bomb"]))
    command = draw(st.sampled_from(COMMANDS))
    if kind == "valid":
        request_id = uuid.uuid4().hex
        command = draw(st.sampled_from([protocol.EXECUTE, protocol.HEALTH, protocol.TARGET, protocol.CANCEL]))
        body: dict[str, Any] = {"request_id": request_id}
        if command == protocol.EXECUTE:
            body["program"] = constant_program_body()
        return protocol.message(command, body)
    if kind == "garbage":
        return draw(st.lists(st.binary(max_size=40), max_size=6))
    if kind == "bomb":
        packed = draw(st.sampled_from(LENGTH_BOMBS))
        if draw(st.booleans()):
            packed = msgpack.packb({"request_id": "bomb", "program": draw(st.sampled_from(EXT_BOMBS))})
        return [protocol.VERSION, command, packed]
    body = draw(bodies())
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        packed = b"\x80"
    frames = [draw(st.sampled_from([protocol.VERSION, protocol.VERSION, b"KC2", b""])), command, packed]
    frames += draw(st.lists(st.binary(max_size=64), max_size=3))
    if kind == "mutated":
        index = draw(st.integers(0, len(frames) - 1))
        frame = bytearray(frames[index])
        if frame and draw(st.booleans()):
            cut = draw(st.integers(0, len(frame) - 1))
            frame = frame[:cut]  # truncated
        elif frame:
            position = draw(st.integers(0, len(frame) - 1))
            frame[position] ^= draw(st.integers(1, 255))  # one byte flipped
        frames[index] = bytes(frame)
    return frames


def drain(sock: zmq.Socket[Any]) -> None:
    while sock.poll(0):
        sock.recv_multipart()


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def router_pid(services: Services) -> int:
    return services.router.pid


def test_fuzzed_messages_leave_broker_and_router_serving(services: Services) -> None:
    context: zmq.Context[Any] = zmq.Context()
    targets = {
        "broker": services.broker.url,
        "router": services.router_url,
        "nodes": services.nodes_url,
    }
    memory_before = {"broker": rss(services.broker.process.pid), "router": rss(router_pid(services))}
    sent = {"messages": 0}

    def connect(url: str) -> zmq.Socket[Any]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        return sock

    sockets = {name: connect(url) for name, url in targets.items()}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=os.environ.get("KCORAL_FUZZ_RANDOM") is None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        target=st.sampled_from(["broker", "broker", "router", "router", "nodes"]),
        batch=st.lists(messages(), min_size=5, max_size=30),
        reconnect=st.booleans(),
    )
    def send(target: str, batch: list[list[bytes]], reconnect: bool) -> None:
        sock = sockets[target]
        for frames in batch:
            if not frames:
                continue
            sock.send_multipart(frames)
            sent["messages"] += 1
        drain(sock)
        if reconnect:  # a peer that vanishes mid-conversation (mid-upload, with programs queued)
            sock.close(linger=0)
            sockets[target] = connect(targets[target])

    try:
        send()
    finally:
        for sock in sockets.values():
            sock.close(linger=0)
        context.term()
    print(f"fuzz: {sent['messages']} messages in {FUZZ_EXAMPLES} examples")
    assert sent["messages"] >= FUZZ_EXAMPLES

    for process in (services.broker.process, services.router):
        assert process.poll() is None, "a service died"
    program = Program()
    program.return_(key="v", value=5)
    for url in (services.broker.url, services.router_url):
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(url, connect_timeout_seconds=10) as client:
                    assert client.execute(program, timeout_seconds=30).results == {"v": 5}
                break
            except KCoralError as exc:  # busy while the fuzzer's programs drain
                assert exc.kind == "busy" and time.monotonic() < deadline, exc
                time.sleep(0.5)
    memory_after = {"broker": rss(services.broker.process.pid), "router": rss(router_pid(services))}
    for name in memory_before:
        growth = memory_after[name] - memory_before[name]
        print(f"{name}: resident memory grew {growth / (1 << 20):.1f} MiB")
        assert growth < MEMORY_GROWTH_BOUND_BYTES, (name, growth)
