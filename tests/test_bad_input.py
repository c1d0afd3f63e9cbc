"""A broker survives whatever a client sends: each malformed message is answered with a FINAL error or
dropped with a log line, and the broker keeps serving normal programs afterwards."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kcoral import Client, KCoralError, Program, protocol
from tests.helpers import BrokerFactory, RunningBroker, start_broker

LOG_TIMEOUT_SECONDS = 10.0
REPLY_TIMEOUT_SECONDS = 10.0
NO_REPLY_SECONDS = 0.2  # how long a dropped message is given to (wrongly) produce a reply
DIGEST = "ab" * 32
# A broker that loses a request leaves its client waiting: fail such a test in bounded time.
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def one_worker_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker with one CPU worker, for the tests that send it bad messages and check that it
    serves on: what each test reads of its log is counted from where the test began."""
    broker = start_broker(tmp_path_factory.mktemp("bad-input"), "--workers", "1")
    yield broker
    broker.stop()


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def dealer(context: zmq.Context[zmq.Socket[bytes]], broker: RunningBroker) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.url)
    return sock


def receive(sock: zmq.Socket[bytes], timeout: float) -> tuple[bytes, dict[str, Any], list[Any]] | None:
    """The next message that is not a HEARTBEAT, or None."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        command, body, frames = protocol.split_message(sock.recv_multipart())
        if command != protocol.HEARTBEAT:
            return command, body, frames
    return None


def wait_for_log(broker: RunningBroker, text: str, before: int) -> None:
    """Wait until ``text`` occurs in the broker's log more often than ``before`` times."""
    deadline = time.monotonic() + LOG_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if broker.log().count(text) > before:
            return
        time.sleep(0.02)
    raise AssertionError(f"no new log line with {text!r}; log:\n{broker.log()[-3000:]}")


def assert_serves_programs(broker: RunningBroker) -> None:
    program = Program()
    module = program.upload(kind="module", source="def double(x):\n    return x * 2, {'n': int(x.size)}\n")
    fn = program.get_function(module=module, name="double")
    x = program.upload(kind="tensor", value=np.arange(4, dtype=np.float32))
    program.return_(key="out", value=program.run(fn=fn, args=[x]))
    with Client(broker.url, connect_timeout_seconds=5.0) as client:
        result = client.execute(program, timeout_seconds=30)
    assert result.completed, result.error
    doubled, info = result.results["out"]
    np.testing.assert_array_equal(doubled, np.arange(4, dtype=np.float32) * 2)
    assert info == {"n": 4}
    assert broker.process.poll() is None


def raw_body(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def tuple_bomb(depth: int) -> bytes:
    """A small body whose tuples nest ``depth`` deep (each level one more nested unpack)."""
    inner = raw_body(0)
    for _ in range(depth):
        inner = raw_body(msgpack.ExtType(protocol.EXT_TUPLE, b"\x91" + inner))
    return raw_body({"request_id": "bomb", "x": msgpack.ExtType(protocol.EXT_TUPLE, b"\x91" + inner)})


# Messages the broker cannot read: logged with the reason; dropped, unless their body still names a
# request id (read without decoding the rest), which then gets a FINAL parse error (ANSWERED).
DROPPED: list[tuple[str, list[bytes], str]] = [
    ("one frame", [b"KC1"], "message has 1 frames"),
    ("two frames", [b"KC1", protocol.HEALTH], "message has 2 frames"),
    ("wrong version", [b"KC9", protocol.HEALTH, raw_body({"request_id": "v"})], "protocol version b'KC9'"),
    ("empty version", [b"", protocol.HEALTH, raw_body({"request_id": "v"})], "protocol version b''"),
    ("garbage body", [b"KC1", protocol.HEALTH, b"\xc1\xc1\xc1"], "body is not valid msgpack"),
    ("truncated body", [b"KC1", protocol.HEALTH, b"\x82\xaarequest_id"], "body is not valid msgpack"),
    ("body not a map", [b"KC1", protocol.HEALTH, raw_body(["request_id", "x"])], "body must be a map, not list"),
    ("nested arrays", [b"KC1", protocol.HEALTH, b"\x91" * 100_000 + b"\x00"], "body is not valid msgpack"),
    ("nested tuples", [b"KC1", protocol.EXECUTE, tuple_bomb(5000)], "tuples nested deeper"),
    (
        "unknown extension",
        [b"KC1", protocol.HEALTH, raw_body({"request_id": "e", "x": msgpack.ExtType(42, b"")})],
        "unknown msgpack extension type 42",
    ),
    (
        "bad digest in a tensor",
        [
            b"KC1",
            protocol.EXECUTE,
            raw_body({"request_id": "t", "x": msgpack.ExtType(1, raw_body(["numpy", "int8", [1], "XY"]))}),
        ],
        "bad blob digest",
    ),
    ("no request id", [b"KC1", protocol.HEALTH, raw_body({})], "bad request_id None"),
    ("bad request id", [b"KC1", protocol.HEALTH, raw_body({"request_id": "a b/../c"})], "bad request_id"),
    ("request id not a str", [b"KC1", protocol.HEALTH, raw_body({"request_id": 12})], "bad request_id 12"),
    ("request id too long", [b"KC1", protocol.HEALTH, raw_body({"request_id": "r" * 201})], "bad request_id"),
    ("request id with newline", [b"KC1", protocol.HEALTH, raw_body({"request_id": "r\n"})], "bad request_id"),
]


ANSWERED = {"nested tuples": "bomb", "unknown extension": "e", "bad digest in a tensor": "t"}


def test_malformed_messages_are_dropped_with_a_log_line(
    one_worker_broker: RunningBroker, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    broker = one_worker_broker
    sock = dealer(context, broker)
    for index, (name, frames, logged) in enumerate(DROPPED):
        before_event = broker.log().count("bad_client_message")
        before = broker.log().count(logged)
        sock.send_multipart(frames)
        # The broker handles one connection's messages in order, so a reply to the bad message
        # would come before the answer to this HEALTH.
        sock.send_multipart(protocol.message(protocol.HEALTH, {"request_id": f"after-{index}"}))
        reply = receive(sock, REPLY_TIMEOUT_SECONDS)
        assert reply is not None, f"{name}: the broker stopped answering"
        if name in ANSWERED:
            assert reply[0] == protocol.FINAL and reply[1]["request_id"] == ANSWERED[name], f"{name}: {reply}"
            assert reply[1]["ok"] is False and reply[1]["error"]["kind"] == "parse", f"{name}: {reply}"
            reply = receive(sock, REPLY_TIMEOUT_SECONDS)
            assert reply is not None, f"{name}: the broker stopped answering"
        assert reply[1]["request_id"] == f"after-{index}", f"{name}: a dropped message got a reply: {reply}"
        assert reply[1]["ok"] is True
        wait_for_log(broker, logged, before)
        assert broker.log().count("bad_client_message") > before_event, name
        assert broker.process.poll() is None, f"{name}: the broker died"
        assert_serves_programs(broker)
    assert receive(sock, NO_REPLY_SECONDS) is None


def _execute(request_id: str, instructions: list[dict[str, Any]], blobs: list[str]) -> dict[str, Any]:
    return {"request_id": request_id, "program": {"instructions": instructions}, "blobs": blobs}


def _upload_bytes(digest: str, size: int) -> dict[str, Any]:
    return {"op": "upload", "id": "b", "kind": "bytes", "blob": digest, "size": size}


def test_bad_requests_are_answered_with_a_parse_error(
    one_worker_broker: RunningBroker, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    broker = one_worker_broker
    sock = dealer(context, broker)
    payload = b"the real bytes"
    good = hashlib.sha256(payload).hexdigest()
    other = hashlib.sha256(b"other bytes").hexdigest()
    cases: list[tuple[str, bytes, dict[str, Any], list[bytes], str]] = [
        ("unknown command", b"\x7f", {"request_id": "u"}, [], "unknown command 7f"),
        ("worker command from a client", protocol.READY, {"request_id": "w"}, [], "unknown command 20"),
        (
            "BLOBS for an unknown request",
            protocol.BLOBS,
            {"request_id": "nobody", "blobs": [good]},
            [payload],
            "BLOBS for no request",
        ),
        (
            "digest mismatch",
            protocol.EXECUTE,
            _execute("mismatch", [_upload_bytes(good, len(payload))], [good]),
            [b"not the real bytes"],
            "blob digest mismatch",
        ),
        (
            "attached blob the program does not use",
            protocol.EXECUTE,
            _execute("unused", [_upload_bytes(good, len(payload))], [other]),
            [b"other bytes"],
            "not used by the program",
        ),
        (
            "fewer frames than digests",
            protocol.EXECUTE,
            _execute("count", [_upload_bytes(good, len(payload))], [good]),
            [],
            "must name each attached frame",
        ),
        ("no program", protocol.EXECUTE, {"request_id": "np"}, [], "needs a program map"),
        (
            "instructions not a list",
            protocol.EXECUTE,
            {"request_id": "nl", "program": {"instructions": 5}},
            [],
            "must be a list",
        ),
        (
            "bad digest in a program",
            protocol.EXECUTE,
            _execute("bd", [_upload_bytes("nothex", 1)], []),
            [],
            "bad blob digest",
        ),
        (
            "unknown option",
            protocol.EXECUTE,
            {**_execute("opt", [], []), "options": {"timeout_seconds": 1, "priority": 9}},
            [],
            "unknown options: priority",
        ),
        (
            "timeout over the limit",
            protocol.EXECUTE,
            {**_execute("to", [], []), "options": {"timeout_seconds": 901}},
            [],
            "timeout_seconds",
        ),
        (
            "more GPUs than the host has",
            protocol.EXECUTE,
            {**_execute("gpu", [], []), "options": {"gpu_count": 2}},
            [],
            "capacity",
        ),
    ]
    for name, command, body, frames, expected in cases:
        sock.send_multipart(protocol.message(command, body, *frames))
        reply = receive(sock, REPLY_TIMEOUT_SECONDS)
        assert reply is not None, f"{name}: no reply"
        reply_command, reply_body, reply_frames = reply
        assert reply_command == protocol.FINAL, name
        assert reply_body["request_id"] == body["request_id"], name
        assert reply_body["ok"] is False and reply_frames == [], name
        kind = "capacity" if expected == "capacity" else "parse"
        assert reply_body["error"]["kind"] == kind, f"{name}: {reply_body['error']}"
        assert expected in reply_body["error"]["message"] or expected == kind, f"{name}: {reply_body['error']}"
        assert broker.process.poll() is None, f"{name}: the broker died"
        assert_serves_programs(broker)
    # A request refused for a bad blob leaves nothing behind: the same id runs cleanly now.
    sock.send_multipart(
        protocol.message(protocol.EXECUTE, _execute("mismatch", [_upload_bytes(good, len(payload))], [good]), payload)
    )
    states = []
    while (reply := receive(sock, REPLY_TIMEOUT_SECONDS)) is not None and reply[0] == protocol.PARTIAL:
        states.append(reply[1]["state"])
    assert states == ["queued", "running"]
    assert reply is not None and reply[1]["ok"] is True and reply[1]["result"]["status"] == "COMPLETED"
    assert_serves_programs(broker)


def test_request_size_limits(broker_factory: BrokerFactory, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    broker = broker_factory("--workers", "1", "--max-request-bytes", "1M")
    # Declared sizes over the limit: refused before any byte is uploaded.
    program = Program()
    program.upload(kind="bytes", value=bytes(600 << 10))
    program.upload(kind="tensor", value=np.ones(600 << 10, dtype=np.uint8))  # other bytes: counted apart
    with Client(broker.url, connect_timeout_seconds=5.0) as client:
        with pytest.raises(KCoralError) as caught:
            client.execute(program)
        assert client.blob_bytes_sent == 0
    assert caught.value.kind == "request_too_large"
    assert caught.value.request_id
    assert "1048576" in caught.value.message

    # A client that under-declares its sizes is stopped by the bytes it actually sends.
    sock = dealer(context, broker)
    data = bytes(2 << 20)
    digest = hashlib.sha256(data).hexdigest()
    sock.send_multipart(protocol.message(protocol.EXECUTE, _execute("liar", [_upload_bytes(digest, 1)], [])))
    reply = receive(sock, REPLY_TIMEOUT_SECONDS)
    assert reply is not None and reply[1]["state"] == "need_blobs" and reply[1]["blobs"] == [digest]
    sock.send_multipart(protocol.message(protocol.BLOBS, {"request_id": "liar", "blobs": [digest]}, data))
    reply = receive(sock, REPLY_TIMEOUT_SECONDS)
    assert reply is not None and reply[0] == protocol.FINAL
    assert reply[1]["error"]["kind"] == "request_too_large"

    # A frame over the socket's MAXMSGSIZE (64 MiB here): libzmq drops the connection, not the broker.
    big = dealer(context, broker)
    monitor = big.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    frame = bytes((64 << 20) + 1)
    big.send_multipart([b"KC1", protocol.BLOBS, protocol.pack({"request_id": "big", "blobs": [DIGEST]}), frame])
    events = []
    deadline = time.monotonic() + REPLY_TIMEOUT_SECONDS
    while zmq.EVENT_DISCONNECTED not in events and monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        events.append(recv_monitor_message(monitor)["event"])
    assert zmq.EVENT_DISCONNECTED in events, "the broker did not drop the connection"
    big.disable_monitor()
    monitor.close(linger=0)
    big.close(linger=0)
    assert broker.process.poll() is None
    assert_serves_programs(broker)
    sock.send_multipart(protocol.message(protocol.HEALTH, {"request_id": "still-here"}))
    reply = receive(sock, REPLY_TIMEOUT_SECONDS)
    assert reply is not None and reply[1]["ok"] is True
    sock.close(linger=0)
