"""Framing: the version, the client commands, timing, limits and the checks every side makes.

Messages are zmq multipart messages. A client (DEALER) sends::

    [VERSION, command, body, blob frame, ...]

and the broker (ROUTER) answers on the same connection::

    [VERSION, reply command, body, data frame, ...]

``body`` is a msgpack map (``kcoral.protocol.codec``). The worker link and the node link have
commands of their own (``kcoral.protocol.worker_link``, ``kcoral.protocol.node_link``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

# --- framing ----------------------------------------------------------------------------------

VERSION: Final = b"KC1"

# client -> broker (and router)
EXECUTE: Final = b"\x01"  # body: request_id, program, options, blobs (digests of attached frames)
BLOBS: Final = b"\x02"  # body: request_id, blobs (digests of the attached frames)
CANCEL: Final = b"\x03"  # body: request_id
HEALTH: Final = b"\x04"  # body: request_id
TARGET: Final = b"\x05"  # body: request_id

# broker -> client
PARTIAL: Final = b"\x10"  # body: request_id, state ("need_blobs", "queued", "running"), ...
FINAL: Final = b"\x11"  # body: request_id, ok, result | error
HEARTBEAT: Final = b"\x12"  # body: {} (to clients with requests waiting, every HEARTBEAT_INTERVAL)

CLIENT_COMMANDS: Final = frozenset({EXECUTE, BLOBS, CANCEL, HEALTH, TARGET})


def command_names(scope: Mapping[str, Any], *names: str) -> dict[bytes, str]:
    """Each named command's bytes -> its name (for logs and errors), from the constants of that name
    in ``scope`` (the defining module's ``globals()``): each name is written once, and a name
    without its constant fails at import."""
    return {scope[name]: name for name in names}


CLIENT_COMMAND_NAMES: Final = command_names(
    globals(), "EXECUTE", "BLOBS", "CANCEL", "HEALTH", "TARGET", "PARTIAL", "FINAL", "HEARTBEAT"
)

# --- timing -----------------------------------------------------------------------------------

HEARTBEAT_INTERVAL_SECONDS: Final = 1.0
HEARTBEAT_LIVENESS: Final = 3  # missed heartbeats before a peer is taken for dead
DEFAULT_TIMEOUT_SECONDS: Final = 300.0
MAX_TIMEOUT_SECONDS: Final = 900.0
CLIENT_MARGIN_SECONDS: Final = 15.0  # how long past a program's timeout a client still waits

# --- limits -----------------------------------------------------------------------------------

MAX_BODY_BYTES: Final = 64 << 20  # one msgpack body
# The largest frame a service takes from a client (libzmq's MAXMSGSIZE, which it applies to each
# frame): libzmq holds a frame whole until its last byte, so this is what one connection can make a
# service hold with a frame it never finishes. Blobs over it travel in pieces (BLOBS ``offset``).
DEFAULT_MAX_FRAME_BYTES: Final = 8 << 20
MIN_FRAME_BYTES: Final = 1 << 20  # below this an ordinary program's body would not fit
MAX_FRAMES: Final = 100_000  # frames in one message
MAX_INSTRUCTIONS: Final = 10_000
MAX_ID_LENGTH: Final = 200
MAX_NESTING: Final = 64  # depth of a value tree
DEFAULT_MAX_REQUEST_BYTES: Final = 8 << 30  # a program with all its blobs
DEFAULT_MAX_RESPONSE_BYTES: Final = 8 << 30  # a result with all its frames
DEFAULT_OUTPUT_LIMIT_BYTES: Final = 1 << 20  # stdout and stderr, each
OUTPUT_PIECE_BYTES: Final = 64 << 10  # the most output one PROGRESS (and PARTIAL output) carries
MAX_OUTPUT_LIMIT_BYTES: Final = 64 << 20
INLINE_SOURCE_BYTES: Final = 4096  # module sources above this travel as blobs
INLINE_BYTES_LIMIT: Final = 64 << 10  # returned bytes above this travel as frames
MAX_GPU_COUNT: Final = 8
DIGEST_PATTERN: Final = re.compile(r"^[0-9a-f]{64}$")
ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class WireError(ValueError):
    """Raised when bytes from another process break the protocol; the message says how."""


def check_id(value: object, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise WireError(f"bad {what} {value!r}: 1 to {MAX_ID_LENGTH} characters of letters, digits, '_.:-'")
    return value


def check_digest(digest: object) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline.
    if not isinstance(digest, str) or not DIGEST_PATTERN.fullmatch(digest):
        raise WireError(f"bad blob digest {digest!r}: expected 64 lowercase hex characters (sha256)")
    return digest


def sha256_hex(data: bytes | memoryview | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def check_header(frames: Sequence[Any]) -> bytes:
    """Check a message's frame count, version and command byte, leaving its body unread; return
    the command. For the router and the node relay, which forward most bodies as they are."""
    if not 3 <= len(frames) <= MAX_FRAMES:
        raise WireError(f"message has {len(frames)} frames; expected 3 to {MAX_FRAMES}")
    version = bytes(frames[0])
    if version != VERSION:
        raise WireError(f"protocol version {version[:16]!r} not supported; this side speaks {VERSION!r}")
    command = bytes(frames[1])
    if len(command) != 1:
        raise WireError(f"a command is one byte, not {len(command)}")
    return command
