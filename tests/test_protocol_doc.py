"""docs/protocol.md is enough to write a client: these tests follow only that document.

They speak to a real broker with raw pyzmq and msgpack and never import ``kcoral`` (the broker is a
subprocess), so a field that the code sends but the document does not describe, or describes
wrongly, shows up here as a failure.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

# Section 2 and 3 of docs/protocol.md.
VERSION = b"KC1"
EXECUTE, BLOBS, CANCEL, HEALTH, TARGET = b"\x01", b"\x02", b"\x03", b"\x04", b"\x05"
PARTIAL, FINAL, HEARTBEAT = b"\x10", b"\x11", b"\x12"
# Section 4: extension codes.
EXT_TENSOR, EXT_REF, EXT_TUPLE, EXT_BYTES, EXT_FILE, EXT_FOLDER = 1, 2, 3, 4, 5, 6

START_TIMEOUT_SECONDS = 60.0
REPLY_TIMEOUT_SECONDS = 30.0
# A broker that loses a request leaves its client waiting: fail such a test in bounded time.
pytestmark = pytest.mark.timeout(120)

MODULE_SOURCE = """
def scale(x, k):
    # x arrives as a numpy array (framework "numpy" in its tensor spec); x.sum() is a numpy scalar,
    # which section 4 says arrives as a plain number
    return x * k, {"sum": x.sum(), "shape": list(x.shape), "dtype": str(x.dtype), "tag": ("a", 1)}
"""


class Tensor:
    """A decoded tensor ext value (section 4, code 1)."""

    def __init__(self, framework: str, dtype: str, shape: list[int], source: int | str) -> None:
        self.framework, self.dtype, self.shape, self.source = framework, dtype, shape, source


def ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TENSOR:
        return Tensor(*msgpack.unpackb(data))
    if code == EXT_TUPLE:
        return tuple(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False))
    if code in (EXT_BYTES, EXT_FILE, EXT_FOLDER):
        return (code, msgpack.unpackb(data))
    raise ValueError(f"unknown extension type {code}")


def decode(body: bytes) -> Any:
    return msgpack.unpackb(body, ext_hook=ext_hook, strict_map_key=False)


def tensor_ext(framework: str, dtype: str, shape: list[int], digest: str) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([framework, dtype, shape, digest]))


def ref(instruction_id: str) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_REF, instruction_id.encode("utf-8"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RawClient:
    """A DEALER that sends [VERSION, command, body, frames...] with no delimiter (section 1)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(url)

    def send(self, command: bytes, body: dict[str, Any], *frames: bytes) -> None:
        self.socket.send_multipart([VERSION, command, msgpack.packb(body, use_bin_type=True), *frames])

    def receive(self, timeout: float) -> tuple[bytes, Any, list[bytes]] | None:
        if not self.socket.poll(int(timeout * 1000)):
            return None
        version, command, body, *frames = self.socket.recv_multipart()
        assert version == VERSION
        return command, decode(body), frames

    def request(self, command: bytes, timeout: float = REPLY_TIMEOUT_SECONDS) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        self.send(command, {"request_id": request_id})
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None and message[0] == FINAL and message[1]["request_id"] == request_id:
                return dict(message[1])
        raise TimeoutError(f"no FINAL for {command!r} within {timeout} s")

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory: pytest.TempPathFactory, context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("protocol-doc")
    url = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp / "broker.log"
    argv = [sys.executable, "-m", "kcoral.cli", "broker", "--listen", url, "--workers", "1"]
    argv += ["--sandbox", "none", "--run-dir", str(tmp / "run")]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_for_health(context, url, process, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_health(
    context: zmq.Context[zmq.Socket[bytes]], url: str, process: subprocess.Popen[bytes], log_path: Path
) -> None:
    """Section 3: a HEALTH round trip is how to tell that a broker is up."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"broker exited with {process.returncode}:\n{log_path.read_text()}")
        client = RawClient(context, url)
        try:
            reply = client.request(HEALTH, timeout=1.0)
            if reply["ok"]:
                return
        except TimeoutError:
            pass
        finally:
            client.close()
    raise RuntimeError(f"broker did not answer HEALTH:\n{log_path.read_text()}")


@pytest.fixture
def client(context: zmq.Context[zmq.Socket[bytes]], broker_url: str) -> Iterator[RawClient]:
    raw = RawClient(context, broker_url)
    yield raw
    raw.close()


def run_program(
    client: RawClient,
    instructions: list[dict[str, Any]],
    blobs: dict[str, bytes],
    *,
    attach: list[str] = (),  # type: ignore[assignment]
) -> tuple[dict[str, Any], list[bytes], list[dict[str, Any]]]:
    """Section 7: EXECUTE, answer need_blobs with BLOBS, collect PARTIALs until the FINAL."""
    request_id = uuid.uuid4().hex
    body = {
        "request_id": request_id,
        "program": {"instructions": instructions},
        "options": {"timeout_seconds": 60},
        "blobs": list(attach),
    }
    client.send(EXECUTE, body, *[blobs[d] for d in attach])
    partials: list[dict[str, Any]] = []
    deadline = time.monotonic() + REPLY_TIMEOUT_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        message = client.receive(left)
        if message is None:
            break
        command, reply, frames = message
        if command == HEARTBEAT:
            assert reply == {}
            continue
        assert reply["request_id"] == request_id
        if command == FINAL:
            return reply, frames, partials
        assert command == PARTIAL
        partials.append(reply)
        if reply["state"] == "need_blobs":
            wanted = reply["blobs"]
            client.send(BLOBS, {"request_id": request_id, "blobs": wanted}, *[blobs[d] for d in wanted])
    raise TimeoutError("no FINAL")


def tensor_from_frame(spec: Tensor, frames: list[bytes]) -> list[float]:
    """Section 5: C order, little endian; a float32 is 4 bytes."""
    assert isinstance(spec.source, int)
    data = frames[spec.source]
    count = 1
    for dim in spec.shape:
        count *= dim
    assert len(data) == count * 4
    return list(struct.unpack(f"<{count}f", data))


def check_provenance(provenance: dict[str, Any], request_id: str, blobs: list[str]) -> None:
    """Section 8, "Provenance", of a CPU-only broker on its own, started with --sandbox none."""
    assert provenance["request_id"] == request_id and provenance["node_id"] is None
    assert provenance["sandbox"] == "none" and provenance["device"] == "cpu" and provenance["fake_gpus"] == 0
    assert isinstance(provenance["hostname"], str) and isinstance(provenance["broker_instance_id"], str)
    versions = provenance["versions"]
    assert versions["protocol"] == "KC1" and isinstance(versions["kcoral"], str)
    assert {"python", "torch", "cupti-python", "numpy", "driver", "cuda_driver"} <= set(versions)
    assert provenance["gpus"] == [] and provenance["gpu_conditions"] == {"start": None, "end": None}
    program = provenance["program"]
    # The module came as a blob: named by that blob's digest, which is among the program's blobs.
    assert len(program["digest"]) == 64 and len(program["modules"]) == 1
    assert program["blobs"] == blobs and set(program["modules"].values()) <= set(blobs)
    assert provenance["options"]["timeout_seconds"] == 60
    assert provenance["program_claims"]["seeds"] == {}


def test_program_with_blob_negotiation_returns_a_tensor_and_a_map(client: RawClient) -> None:
    data = struct.pack("<6f", 1.0, 2.0, 3.0, 4.0, 5.0, 6.5)
    source = MODULE_SOURCE.encode()
    blobs = {sha256(data): data, sha256(source): source}
    instructions = [
        # The module travels as a blob too (section 6: `blob` + `size` instead of `source`).
        {"op": "upload", "id": "mod", "kind": "module", "blob": sha256(source), "size": len(source)},
        {"op": "upload", "id": "x", "kind": "tensor", "tensor": tensor_ext("numpy", "float32", [2, 3], sha256(data))},
        {"op": "get_function", "id": "fn", "module": "mod", "name": "scale", "cpu_only": False},
        {"op": "run", "id": "out", "fn": "fn", "args": [ref("x"), 2]},
        {"op": "return", "id": "r0", "key": "pair", "value": ref("out")},
        {"op": "return", "id": "r1", "key": "literal", "value": {"n": 7, "raw": b"\x00\x01"}},
    ]
    reply, frames, partials = run_program(client, instructions, blobs)

    states = [p["state"] for p in partials]
    assert states[0] == "need_blobs"
    assert sorted(partials[0]["blobs"]) == sorted(blobs)  # a fresh broker lacks both
    assert states[1:] == ["queued", "running"]
    assert partials[2]["gpu_ids"] == []  # a CPU-only broker

    assert reply["ok"] is True, reply.get("error")
    result = reply["result"]
    assert result["status"] == "COMPLETED", result["error"]
    assert result["error"] is None
    assert result["request_id"] == reply["request_id"]
    for field in ("queue_ms", "elapsed_ms", "lease_wait_ms", "lease_held_ms"):
        assert isinstance(result[field], float)
    assert result["stdout"] == "" and result["stdout_truncated"] is False
    assert result["node_id"] is None  # a broker on its own, not behind a router
    check_provenance(result["provenance"], reply["request_id"], sorted(blobs))

    scaled, info = result["results"]["pair"]  # the function returned a tuple (ext 3)
    assert isinstance(scaled, Tensor)
    assert (scaled.framework, scaled.dtype, scaled.shape) == ("numpy", "float32", [2, 3])
    assert tensor_from_frame(scaled, frames) == [2.0, 4.0, 6.0, 8.0, 10.0, 13.0]
    assert info == {"sum": 21.5, "shape": [2, 3], "dtype": "float32", "tag": ("a", 1)}
    assert result["results"]["literal"] == {"n": 7, "raw": b"\x00\x01"}


def test_blobs_attached_to_execute_skip_negotiation(client: RawClient) -> None:
    data = struct.pack("<3f", 0.5, -1.0, 8.0)
    digest = sha256(data)
    instructions = [
        {"op": "upload", "id": "mod", "kind": "module", "source": "def first(x):\n    return x[:1]\n"},
        {"op": "upload", "id": "x", "kind": "tensor", "tensor": tensor_ext("numpy", "float32", [3], digest)},
        {"op": "get_function", "id": "fn", "module": "mod", "name": "first", "cpu_only": True},
        {"op": "run", "id": "out", "fn": "fn", "args": [ref("x")]},
        {"op": "return", "id": "r", "key": "first", "value": ref("out")},
    ]
    reply, frames, partials = run_program(client, instructions, {digest: data}, attach=[digest])
    assert [p["state"] for p in partials] == ["queued", "running"]
    assert reply["ok"] and reply["result"]["status"] == "COMPLETED"
    first = reply["result"]["results"]["first"]
    assert tensor_from_frame(first, frames) == [0.5]


def test_a_failed_instruction_is_data(client: RawClient) -> None:
    instructions: list[dict[str, Any]] = [
        {"op": "upload", "id": "mod", "kind": "module", "source": "def boom():\n    raise KeyError('no')\n"},
        {"op": "return", "id": "early", "key": "early", "value": [1, 2]},
        {"op": "get_function", "id": "fn", "module": "mod", "name": "boom", "cpu_only": True},
        {"op": "run", "id": "out", "fn": "fn", "args": []},
    ]
    reply, _, _ = run_program(client, instructions, {})
    assert reply["ok"] is True
    result = reply["result"]
    assert result["status"] == "FAILED"
    assert result["results"] == {"early": [1, 2]}
    error = result["error"]
    assert (error["kind"], error["instruction_index"], error["instruction_op"], error["instruction_id"]) == (
        "runtime",
        3,
        "run",
        "out",
    )
    assert "KeyError" in error["message"] and "KeyError" in error["traceback"]


def test_request_errors_and_health(client: RawClient) -> None:
    health = client.request(HEALTH)
    assert health["ok"] is True
    assert health["result"]["status"] == "ok"
    assert health["result"]["versions"]["protocol"] == "KC1"
    assert health["result"]["load"]["request_capacity"] == 1
    target = client.request(TARGET)
    assert target["ok"] is True and target["result"]["device"] == "cpu"

    bad = {"request_id": uuid.uuid4().hex, "program": {"instructions": []}, "options": {"colour": "red"}}
    client.send(EXECUTE, bad)
    message = client.receive(REPLY_TIMEOUT_SECONDS)
    assert message is not None
    command, reply, frames = message
    assert command == FINAL and reply["ok"] is False and frames == []
    assert reply["error"]["kind"] == "parse" and "colour" in reply["error"]["message"]
