"""The messages between the harness and the candidate's process: data only, never pickled.

They travel both ways over one socket (the candidate's process's standard input). Each message
is a 4-byte little-endian header length, a JSON header (a map, at most
``MAX_HEADER_BYTES``), then ``payload_bytes`` raw bytes. A tensor travels as its dtype and shape
in the header and its contiguous bytes as the payload; the harness rebuilds it with
``torch.frombuffer``, so what it checks is always a plain tensor made from bytes, whatever object
the candidate returned. The harness validates every header; a malformed stream is the candidate's
failure, never the harness's.
"""

from __future__ import annotations

import json
import os
import selectors
import struct
import time
from collections.abc import Callable
from typing import Any, BinaryIO, Final

MAX_HEADER_BYTES: Final = 1 << 20
MAX_PAYLOAD_BYTES: Final = 16 << 30
LENGTH: Final = struct.Struct("<I")
READ_CHUNK: Final = 1 << 20
# Dtypes that may cross, by torch name: those a workload's output can sensibly have.
DTYPES: Final = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)


class ChannelError(Exception):
    """Raised when the stream breaks the format, runs past its deadline or ends early."""


def write_message(stream: BinaryIO, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    head = json.dumps({**header, "payload_bytes": len(payload)}).encode()
    stream.write(LENGTH.pack(len(head)))
    stream.write(head)
    if len(payload):
        stream.write(payload)
    stream.flush()


def send_message(fd: int, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Write one message to ``fd`` (a socket or pipe), whole."""
    head = json.dumps({**header, "payload_bytes": len(payload)}).encode()
    view = memoryview(LENGTH.pack(len(head)) + head + bytes(payload))
    while len(view):
        view = view[os.write(fd, view) :]


def tensor_to_wire(torch: Any, tensor: Any) -> tuple[dict[str, Any], bytes]:
    """(header fields, bytes) of a tensor, read as plain data on the host."""
    if type(tensor) is not torch.Tensor:
        # A subclass's methods are the candidate's code: it could compute its values lazily here,
        # after the timed window, or hand over other bytes than it holds.
        raise TypeError(f"the output is a {type(tensor).__name__}, not a plain tensor")
    with torch._C.DisableTorchFunction():
        plain = torch.Tensor.detach(tensor)
        dtype = str(plain.dtype).removeprefix("torch.")
        host = torch.Tensor.cpu(torch.Tensor.contiguous(plain))
        data = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return {"dtype": dtype, "shape": [int(d) for d in host.shape]}, data


def tensor_from_wire(torch: Any, header: dict[str, Any], payload: bytes) -> Any:
    """A plain CPU tensor from a message made by ``tensor_to_wire``; ChannelError if inconsistent."""
    dtype_name = header.get("dtype")
    shape = header.get("shape")
    if dtype_name not in DTYPES:
        raise ChannelError(f"a tensor of dtype {dtype_name!r} cannot cross (allowed: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) or len(shape) > 8:
        raise ChannelError(f"bad tensor shape {shape!r}")
    dtype = getattr(torch, dtype_name)
    count = 1
    for dim in shape:
        count *= dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    if count * itemsize != len(payload):
        raise ChannelError(f"{len(payload)} bytes do not hold a {dtype_name} tensor of shape {shape}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class MessageReader:
    """Reads messages from a pipe's read end, each within the time ``remaining()`` gives (seconds)."""

    def __init__(self, fd: int, remaining: Callable[[], float]) -> None:
        self._fd = fd
        self._remaining = remaining
        self._buffer = bytearray()
        self._selector = selectors.DefaultSelector()
        self._selector.register(fd, selectors.EVENT_READ)
        self.closed = False

    def close(self) -> None:
        self._selector.close()
        os.close(self._fd)

    def _fill(self, size: int) -> bool:
        """Read until ``size`` bytes are buffered; False at end of stream."""
        while len(self._buffer) < size:
            left = self._remaining()
            if left <= 0:
                raise ChannelError("the candidate's process ran past the time limit")
            if not self._selector.select(min(left, 1.0)):
                continue
            chunk = os.read(self._fd, min(READ_CHUNK, max(size - len(self._buffer), 4096)))
            if not chunk:
                self.closed = True
                return False
            self._buffer += chunk
        return True

    def ready(self, seconds: float) -> bool:
        """Whether a message (or the start of one) is there to read within ``seconds``."""
        return bool(self._buffer) or bool(self._selector.select(max(0.0, seconds)))

    def _take(self, size: int) -> bytes:
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def read(self) -> tuple[dict[str, Any], bytes] | None:
        """The next message; None when the stream ended cleanly between messages."""
        if not self._fill(LENGTH.size):
            if self._buffer:
                raise ChannelError("the stream ended inside a message")
            return None
        (length,) = LENGTH.unpack(self._take(LENGTH.size))
        if length > MAX_HEADER_BYTES:
            raise ChannelError(f"a message header of {length} bytes is over the limit")
        if not self._fill(length):
            raise ChannelError("the stream ended inside a message header")
        try:
            header = json.loads(self._take(length))
        except ValueError as exc:
            raise ChannelError(f"a message header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ChannelError("a message header is not a map")
        size = header.get("payload_bytes", 0)
        if not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD_BYTES:
            raise ChannelError(f"bad payload size {size!r}")
        if size and not self._fill(size):
            raise ChannelError("the stream ended inside a message payload")
        return header, self._take(size)


def deadline_after(seconds: float) -> Callable[[], float]:
    end = time.monotonic() + seconds
    return lambda: end - time.monotonic()
