"""Uploads in frames of bounded size: blobs over a service's frame limit travel in pieces (through
the public client, to a broker and through a router), a peer cannot make a service hold more than
one frame per connection (raw ZMTP peers that never finish theirs), and the router bounds upload
bytes as the broker does. Real ``kcoral broker`` and ``kcoral router`` processes on loopback."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from kcoral import Client, KCoralError, Program, protocol
from kcoral.testing import start_router
from tests.helpers import BrokerFactory, RunningBroker, start_broker

FRAME = "1M"  # --max-frame-bytes of these tests: small, so a few MiB is many pieces
PIECES_SOURCE = "def total(x):\n    return float(x.sum()), x[::-1].copy()\n"


@pytest.fixture(scope="module")
def framed_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker with one CPU worker and frames of FRAME at most, for the tests that read it: each
    sends blobs of its own."""
    broker = start_broker(tmp_path_factory.mktemp("frames"), "--workers", "1", "--max-frame-bytes", FRAME)
    yield broker
    broker.stop()


def pieces_program(values: np.ndarray) -> Program:
    program = Program()
    module = program.upload(kind="module", source=PIECES_SOURCE)
    tensor = program.upload(kind="tensor", value=values)
    fn = program.get_function(module=module, name="total", cpu_only=True)
    program.return_(key="out", value=program.run(fn=fn, args=[tensor]))
    return program


def check_round_trip(url: str, size_mib: int) -> None:
    values = np.random.default_rng(size_mib).random(size_mib << 17, dtype=np.float64)  # size_mib MiB
    with Client(url, connect_timeout_seconds=10) as client:
        assert client.health()["frame_bytes"] == 1 << 20
        result = client.execute(pieces_program(values), timeout_seconds=60)
        assert result.status == "COMPLETED", result.error
        total, reversed_values = result.results["out"]
        assert total == pytest.approx(float(values.sum()))
        np.testing.assert_array_equal(reversed_values, values[::-1])
        assert client.blob_bytes_sent == values.nbytes
        # Cached now: a second run sends nothing.
        again = client.execute(pieces_program(values), timeout_seconds=60)
        assert again.status == "COMPLETED", again.error
        assert client.blob_bytes_sent == values.nbytes


def test_a_blob_over_the_frame_limit_goes_in_pieces(framed_broker: RunningBroker) -> None:
    broker = framed_broker
    check_round_trip(broker.url, 5)
    # No piece is left behind in the cache directory.
    assert not [p for p in (broker.run_dir / "cache").iterdir() if p.name.startswith(".")]  # type: ignore[operator]


def test_pieces_through_a_router(tmp_path: Path, broker_factory: BrokerFactory) -> None:
    router = start_router(tmp_path, "--max-frame-bytes", FRAME)
    try:
        assert router.nodes_url is not None
        broker_factory("--workers", "1", "--upstream", router.nodes_url, "--node-id", "n1")
        deadline = time.monotonic() + 30
        while not router.health()["nodes"]:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        check_round_trip(router.url, 3)
    finally:
        router.stop()


def test_pieces_out_of_order_or_of_another_size_are_refused(framed_broker: RunningBroker) -> None:
    broker = framed_broker
    data = bytes(range(256)) * 8192  # 2 MiB
    digest = protocol.sha256_hex(data)
    tensor = msgpack.ExtType(protocol.EXT_TENSOR, msgpack.packb(["numpy", "uint8", [len(data)], digest]))
    program = {"instructions": [{"op": "upload", "id": "x", "kind": "tensor", "tensor": tensor}]}
    with raw_socket(broker.url) as sock:

        def execute() -> str:
            request_id = uuid.uuid4().hex
            send(sock, protocol.EXECUTE, {"request_id": request_id, "program": program})
            assert answer(sock, request_id)["state"] == "need_blobs"
            return request_id

        request_id = execute()  # a second piece before the first
        send_piece(sock, request_id, digest, 4096, len(data), data[:4096])
        assert "offset" in answer(sock, request_id)["error"]["message"]
        request_id = execute()  # a size other than the declared one
        send_piece(sock, request_id, digest, 0, 99, data[:9])
        assert answer(sock, request_id)["error"]["kind"] == "parse"
        request_id = execute()  # pieces whose bytes do not hash to the digest
        half = len(data) // 2
        for offset in (0, half):
            send_piece(sock, request_id, digest, offset, len(data), bytes(half))
            reply = answer(sock, request_id)
        assert "mismatch" in reply["error"]["message"]
        request_id = execute()  # in order: accepted piece by piece, each answered with the next offset
        for offset in range(0, len(data), 1 << 19):
            piece = data[offset : offset + (1 << 19)]
            send_piece(sock, request_id, digest, offset, len(data), piece)
            reply = answer(sock, request_id)
            if offset + len(piece) < len(data):
                assert reply["state"] == "need_blobs" and reply["offsets"] == {digest: offset + len(piece)}
        assert reply["state"] == "queued"
        assert answer(sock, request_id, final=True)["ok"]


def test_a_frame_over_the_limit_is_refused_by_libzmq_and_the_client_says_so(framed_broker: RunningBroker) -> None:
    broker = framed_broker
    with raw_socket(broker.url) as sock:
        request_id = uuid.uuid4().hex
        send(sock, protocol.HEALTH, {"request_id": request_id}, bytes(2 << 20))
        assert not sock.poll(1000)  # dropped with its connection, unanswered
    program = Program()
    program.return_(key="big", value=b"x" * (2 << 20))  # an inline value: the body is over the limit
    with Client(broker.url) as client:
        with pytest.raises(KCoralError) as refused:
            client.execute(program)
        assert refused.value.kind == "request_too_large"
        assert client.health()["status"] == "ok"


def test_partial_frames_of_raw_peers_hold_at_most_a_frame_each(broker_factory: BrokerFactory) -> None:
    """4 raw ZMTP peers each declare a 6 GiB frame and send 64 MiB of it (refused at the header),
    then 4 each send all but the last byte of a frame at the limit: the broker's memory grows by
    less than 64 MiB, and it serves on."""
    broker = broker_factory("--workers", "1")  # the default frame limit
    host, port = broker.url.removeprefix("tcp://").rsplit(":", 1)
    process = psutil.Process(broker.process.pid)
    with Client(broker.url) as client:
        assert client.execute(Program()).status == "COMPLETED"
    before = process.memory_info().rss
    peers = [raw_zmtp_peer(host, int(port)) for _ in range(4)]
    try:
        for peer in peers:
            peer.sendall(struct.pack(">BQ", 0x02, 6 << 30))
        chunk = bytes(64 << 20)
        for peer in peers:
            peer.settimeout(10)  # a service that takes it all takes it at once on loopback
            with contextlib.suppress(OSError):  # refused at the header: the connection is reset
                peer.sendall(chunk)
        time.sleep(0.5)
        growth_big = process.memory_info().rss - before
        almost = protocol.DEFAULT_MAX_FRAME_BYTES
        held = [raw_zmtp_peer(host, int(port)) for _ in range(4)]
        peers += held
        for peer in held:
            peer.sendall(struct.pack(">BQ", 0x02, almost) + bytes(almost - 1))
        time.sleep(1.0)
        growth = process.memory_info().rss - before
        with Client(broker.url) as client:
            assert client.execute(Program()).status == "COMPLETED"
    finally:
        for peer in peers:
            peer.close()
    assert growth_big < 16 << 20, f"6 GiB frames: {growth_big >> 20} MiB"
    assert growth < 64 << 20, f"frames held whole: {growth >> 20} MiB"


def closed_by_peer(peer: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the service ends ``peer``'s connection within ``timeout_s`` (reads to its end)."""
    peer.settimeout(timeout_s)
    try:
        while peer.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True  # reset
    return True


def test_connections_per_address_are_capped(broker_factory: BrokerFactory) -> None:
    """With --max-connections-per-address 4, 4 raw peers from the loopback each hold all but the
    last byte of a frame at the limit; a 5th connection is shut at once, and a client too while
    they hold, and HEALTH counts the refusals; once 2 peers go, a client is served again."""
    broker = broker_factory("--workers", "1", "--max-connections-per-address", "4")
    host, port = broker.url.removeprefix("tcp://").rsplit(":", 1)
    almost = protocol.DEFAULT_MAX_FRAME_BYTES
    peers = [raw_zmtp_peer(host, int(port)) for _ in range(3)]  # the 4th: the health check's own
    try:
        for peer in peers:
            peer.sendall(struct.pack(">BQ", 0x02, almost) + bytes(almost - 1))
        with Client(broker.url) as client:  # the 4th connection
            assert client.health()["connections"]["held"] == 4
            peers.append(raw_zmtp_peer(host, int(port)))  # the 5th
            assert closed_by_peer(peers[-1]), "a 5th connection from the loopback was kept"
            assert client.health()["connections"]["refused"] == 1
        peers.append(raw_zmtp_peer(host, int(port)))
        peers[-1].sendall(struct.pack(">BQ", 0x02, almost) + bytes(almost - 1))
        with pytest.raises(KCoralError):  # over the cap: its connection is shut, it never hears back
            with Client(broker.url, connect_timeout_seconds=2.0) as client:
                client.health()
        for peer in peers[:2]:
            peer.close()
        time.sleep(0.5)
        with Client(broker.url) as client:
            assert client.execute(Program()).status == "COMPLETED"
    finally:
        for peer in peers:
            peer.close()


def test_the_router_bounds_upload_bytes_per_client(tmp_path: Path, broker_factory: BrokerFactory) -> None:
    router = start_router(tmp_path, "--max-upload-bytes-per-client", "1M")
    try:
        assert router.nodes_url is not None
        broker_factory("--workers", "1", "--upstream", router.nodes_url, "--node-id", "n1")
        deadline = time.monotonic() + 30
        while not router.health()["nodes"]:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        values = np.ones(2 << 17, dtype=np.float64)  # 2 MiB
        with Client(router.url) as client:
            with pytest.raises(KCoralError) as refused:
                client.execute(pieces_program(values), timeout_seconds=30)
            assert refused.value.kind == "request_too_large"
            assert client.blob_bytes_sent == 0  # refused at the node's need_blobs, before any byte
            small = client.execute(pieces_program(values[:1000]), timeout_seconds=30)
            assert small.status == "COMPLETED", small.error
    finally:
        router.stop()


# --- raw peers ---


@contextlib.contextmanager
def raw_socket(url: str) -> Iterator[zmq.Socket[Any]]:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close(linger=0)
        context.term()


def send(sock: zmq.Socket[Any], command: bytes, body: dict[str, Any], *frames: bytes) -> None:
    sock.send_multipart([protocol.VERSION, command, msgpack.packb(body), *frames])


def send_piece(sock: zmq.Socket[Any], request_id: str, digest: str, offset: int, size: int, piece: bytes) -> None:
    send(sock, protocol.BLOBS, {"request_id": request_id, "blobs": [digest], "offset": offset, "size": size}, piece)


def answer(sock: zmq.Socket[Any], request_id: str, *, final: bool = False) -> dict[str, Any]:
    """The next PARTIAL (other than heartbeats) or FINAL for ``request_id``; only a FINAL with ``final``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not sock.poll(1000):
            continue
        _, command, raw, *_ = sock.recv_multipart()
        body = protocol.unpack_map(raw)
        if body.get("request_id") != request_id or (final and command != protocol.FINAL):
            continue
        if command == protocol.FINAL or command == protocol.PARTIAL:
            return body
    raise AssertionError(f"no answer for {request_id}")


def raw_zmtp_peer(host: str, port: int) -> socket.socket:
    """A TCP connection that has done ZMTP 3.0's NULL handshake as a DEALER, ready for frames."""
    peer = socket.create_connection((host, port))
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    name, value = b"Socket-Type", b"DEALER"
    ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    peer.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return peer
