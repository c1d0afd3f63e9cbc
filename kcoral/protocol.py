"""The wire protocol: every frame constant, command byte, limit and value codec in one place.

Messages are zmq multipart messages. A client (DEALER) sends::

    [VERSION, command, body, blob frame, ...]

and the broker (ROUTER) answers on the same connection::

    [VERSION, reply command, body, data frame, ...]

``body`` is a msgpack map. Values inside bodies use msgpack extension types for what msgpack does not
carry natively (tensors, references, tuples, returned files and folders); the bytes of tensors,
large byte strings and files travel as their own frames, named by index. ``docs/protocol.md``
describes the same protocol for tools written without this package.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np

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

# worker <-> broker (ipc://, inside one host)
READY: Final = b"\x20"  # worker -> broker: body: slot, pid, gpu
PROGRAM: Final = b"\x21"  # broker -> worker: the program to run, with its blob frames
LEASE: Final = b"\x22"  # worker -> broker: ask for the program's GPU tokens
GRANT: Final = b"\x23"  # broker -> worker: the tokens are held
RELEASE: Final = b"\x24"  # worker -> broker: the GPU work is finished (after synchronize)
PROGRESS: Final = b"\x25"  # worker -> broker: body: index of the instruction now running
RESULT: Final = b"\x26"  # worker -> broker: the outcome, with its data frames
DISCONNECT: Final = b"\x27"  # broker -> worker: exit now

CLIENT_COMMANDS: Final = frozenset({EXECUTE, BLOBS, CANCEL, HEALTH, TARGET})
WORKER_COMMANDS: Final = frozenset({READY, LEASE, RELEASE, PROGRESS, RESULT})

COMMAND_NAMES: Final = {
    EXECUTE: "EXECUTE",
    BLOBS: "BLOBS",
    CANCEL: "CANCEL",
    HEALTH: "HEALTH",
    TARGET: "TARGET",
    PARTIAL: "PARTIAL",
    FINAL: "FINAL",
    HEARTBEAT: "HEARTBEAT",
    READY: "READY",
    PROGRAM: "PROGRAM",
    LEASE: "LEASE",
    GRANT: "GRANT",
    RELEASE: "RELEASE",
    PROGRESS: "PROGRESS",
    RESULT: "RESULT",
    DISCONNECT: "DISCONNECT",
}

# --- timing -----------------------------------------------------------------------------------

HEARTBEAT_INTERVAL_SECONDS: Final = 1.0
HEARTBEAT_LIVENESS: Final = 3  # missed heartbeats before a peer is taken for dead
DEFAULT_TIMEOUT_SECONDS: Final = 300.0
MAX_TIMEOUT_SECONDS: Final = 900.0
CLIENT_MARGIN_SECONDS: Final = 15.0  # how long past a program's timeout a client still waits

# --- limits -----------------------------------------------------------------------------------

MAX_BODY_BYTES: Final = 64 << 20  # one msgpack body
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

# --- value encoding ---------------------------------------------------------------------------

EXT_TENSOR: Final = 1  # [framework, dtype, shape, source]: source = frame index (int) or digest (str)
EXT_REF: Final = 2  # instruction id (str): a value the server created earlier
EXT_TUPLE: Final = 3  # a list packed as a tuple
EXT_BYTES: Final = 4  # frame index of a byte string sent as its own frame
EXT_FILE: Final = 5  # [name, frame index, mode]
EXT_FOLDER: Final = 6  # [[relative path, frame index, mode], ...]

FRAMEWORK_NUMPY: Final = "numpy"
FRAMEWORK_TORCH: Final = "torch"

# dtype name -> (item size, numpy dtype name or None when numpy has none)
DTYPES: Final[dict[str, tuple[int, str | None]]] = {
    "bool": (1, "bool"),
    "uint8": (1, "uint8"),
    "int8": (1, "int8"),
    "int16": (2, "int16"),
    "uint16": (2, "uint16"),
    "int32": (4, "int32"),
    "uint32": (4, "uint32"),
    "int64": (8, "int64"),
    "uint64": (8, "uint64"),
    "float16": (2, "float16"),
    "float32": (4, "float32"),
    "float64": (8, "float64"),
    "complex64": (8, "complex64"),
    "complex128": (16, "complex128"),
    "bfloat16": (2, None),
    "float8_e4m3fn": (1, None),
    "float8_e5m2": (1, None),
}
MAX_TENSOR_DIMS: Final = 32


class WireError(ValueError):
    """Raised when bytes from another process break the protocol; the message says how."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor on the wire: framework, dtype and shape, its bytes in a frame or a blob."""

    framework: str
    dtype: str
    shape: tuple[int, ...]
    source: int | str  # frame index or blob digest

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class RefValue:
    """A reference to the value that instruction ``id`` created."""

    id: str


@dataclass(frozen=True)
class FileSpec:
    """A returned file on the wire."""

    name: str
    frame: int
    mode: int


@dataclass(frozen=True)
class FolderSpec:
    """A returned folder on the wire: relative path, frame index and mode of each file."""

    files: tuple[tuple[str, int, int], ...]


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Byte length of a tensor; raises WireError for an unknown dtype or a bad shape."""
    if dtype not in DTYPES:
        raise WireError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    if len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor has {len(shape)} dimensions; at most {MAX_TENSOR_DIMS}")
    count = 1
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise WireError(f"bad tensor shape {list(shape)!r}: dimensions are integers >= 0")
        count *= dim
    return count * DTYPES[dtype][0]


def check_digest(digest: object) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline.
    if not isinstance(digest, str) or not DIGEST_PATTERN.fullmatch(digest):
        raise WireError(f"bad blob digest {digest!r}: expected 64 lowercase hex characters (sha256)")
    return digest


def sha256_hex(data: bytes | memoryview | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


# --- msgpack with extension types --------------------------------------------------------------


def _ext_default(obj: object) -> msgpack.ExtType:
    if isinstance(obj, TensorSpec):
        return msgpack.ExtType(EXT_TENSOR, _pack_plain([obj.framework, obj.dtype, list(obj.shape), obj.source]))
    if isinstance(obj, RefValue):
        return msgpack.ExtType(EXT_REF, obj.id.encode())
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack(list(obj)))
    if isinstance(obj, FileSpec):
        return msgpack.ExtType(EXT_FILE, _pack_plain([obj.name, obj.frame, obj.mode]))
    if isinstance(obj, FolderSpec):
        return msgpack.ExtType(EXT_FOLDER, _pack_plain([list(f) for f in obj.files]))
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def _pack_plain(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def pack(obj: object) -> bytes:
    """Encode a body: msgpack with KCoral's extension types. Tuples are kept as tuples."""
    return msgpack.packb(  # type: ignore[no-any-return]
        obj, default=_bytes_frame_default, use_bin_type=True, strict_types=True
    )


def _ext_hook(code: int, data: bytes, depth: int = 0) -> object:
    try:
        if code == EXT_TENSOR:
            framework, dtype, shape, source = _unpack_plain(data)
            if framework not in (FRAMEWORK_NUMPY, FRAMEWORK_TORCH):
                raise WireError(f"unknown tensor framework {framework!r}")
            if not isinstance(shape, list):
                raise WireError("tensor shape must be a list")
            tensor_nbytes(dtype, shape)
            if isinstance(source, str):
                check_digest(source)
            elif not isinstance(source, int) or isinstance(source, bool) or source < 0:
                raise WireError("tensor source must be a frame index or a blob digest")
            return TensorSpec(framework, dtype, tuple(shape), source)
        if code == EXT_REF:
            return RefValue(check_id(data.decode()))
        if code == EXT_TUPLE:
            # Each nested tuple is a nested unpackb call, and each call puts a ~40 KiB msgpack
            # context on the C stack: without this bound, a 1 KiB body of ~200 nested tuples
            # overflows an 8 MiB stack and kills the process (a segfault, not an exception).
            if depth >= MAX_NESTING:
                raise WireError(f"tuples nested deeper than {MAX_NESTING} levels")
            return tuple(_unpack(data, depth + 1))
        if code == EXT_BYTES:
            return BytesFrame(_frame_index(_unpack_plain(data)))
        if code == EXT_FILE:
            name, frame, mode = _unpack_plain(data)
            return FileSpec(str(name), _frame_index(frame), int(mode))
        if code == EXT_FOLDER:
            files = _unpack_plain(data)
            return FolderSpec(tuple((str(p), _frame_index(f), int(m)) for p, f, m in files))
    except WireError:
        raise
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise WireError(f"bad extension value (type {code}): {exc}") from exc
    raise WireError(f"unknown msgpack extension type {code}")


def _frame_index(value: object) -> int:
    # A negative index would silently pick a frame from the end of the message.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"frame index must be an integer >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class BytesFrame:
    """A byte string sent as frame ``index`` of the message."""

    index: int


def _bytes_frame_default(obj: object) -> msgpack.ExtType:
    if isinstance(obj, BytesFrame):
        return msgpack.ExtType(EXT_BYTES, _pack_plain(obj.index))
    return _ext_default(obj)


def _unpack_plain(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def unpack(data: bytes | memoryview) -> Any:
    """Decode a body; raises WireError on anything that is not valid KCoral msgpack."""
    return _unpack(data, 0)


def _unpack(data: bytes | memoryview, depth: int) -> Any:
    if len(data) > MAX_BODY_BYTES:
        raise WireError(f"body of {len(data)} bytes is over the limit of {MAX_BODY_BYTES}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            ext_hook=lambda code, payload: _ext_hook(code, payload, depth),
        )
    except WireError:
        raise
    except RecursionError as exc:
        raise WireError("body nested too deeply") from exc
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"body is not valid msgpack: {exc}") from exc


def unpack_map(data: bytes | memoryview) -> dict[str, Any]:
    body = unpack(data)
    if not isinstance(body, dict):
        raise WireError(f"body must be a map, not {type(body).__name__}")
    return body


def check_id(value: object, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise WireError(f"bad {what} {value!r}: 1 to {MAX_ID_LENGTH} characters of letters, digits, '_.:-'")
    return value


def split_message(frames: Sequence[bytes | memoryview]) -> tuple[bytes, dict[str, Any], list[Any]]:
    """Check a message's version and command; return (command, body, data frames)."""
    if len(frames) < 3:
        raise WireError(f"message has {len(frames)} frames; expected at least 3")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"message has {len(frames)} frames; at most {MAX_FRAMES}")
    version = bytes(frames[0])
    if version != VERSION:
        raise WireError(f"protocol version {version[:16]!r} not supported; this side speaks {VERSION!r}")
    command = bytes(frames[1])
    return command, unpack_map(frames[2]), list(frames[3:])


def message(command: bytes, body: dict[str, Any], *frames: Any) -> list[Any]:
    return [VERSION, command, pack(body), *frames]


# --- tensors ----------------------------------------------------------------------------------


def numpy_dtype(dtype: str) -> np.dtype[Any] | None:
    name = DTYPES[dtype][1]
    return None if name is None else np.dtype(name)


def tensor_to_wire(value: Any) -> tuple[str, str, tuple[int, ...], memoryview]:
    """(framework, dtype name, shape, raw bytes) of a numpy array or torch tensor, C order."""
    if isinstance(value, np.ndarray):
        # np.ascontiguousarray would turn a 0-d array into a 1-d one.
        array = value if value.flags.c_contiguous else value.copy(order="C")
        if array.dtype.byteorder == ">":
            # The wire is little endian, and a big-endian '>f4' is still named float32.
            array = array.astype(array.dtype.newbyteorder("<"))
        dtype = array.dtype.name
        if dtype not in DTYPES or DTYPES[dtype][1] is None:
            raise WireError(f"numpy dtype {array.dtype} is not supported on the wire")
        return FRAMEWORK_NUMPY, dtype, tuple(array.shape), array.reshape(-1).view(np.uint8).data
    torch = _torch_if_loaded()
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WireError(f"torch dtype {tensor.dtype} is not supported on the wire")
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)
        return FRAMEWORK_TORCH, dtype, tuple(tensor.shape), raw.data
    raise WireError(f"{type(value).__name__} is not a tensor")


def is_tensor(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return True
    torch = _torch_if_loaded()
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_from_wire(spec: TensorSpec, data: bytes | memoryview, *, prefer_torch: bool, copy: bool = True) -> Any:
    """Rebuild a tensor. Dtypes numpy lacks (bfloat16, float8) always come back as torch tensors.

    The tensor owns a copy of ``data``, unless ``copy`` is False: that is for writable memory that
    belongs to this tensor alone (a private copy-on-write mapping), which the tensor is built over.
    """
    if len(data) != spec.nbytes:
        raise WireError(f"tensor {spec.dtype}{list(spec.shape)} needs {spec.nbytes} bytes, got {len(data)}")
    np_dtype = numpy_dtype(spec.dtype)
    if np_dtype is not None and not (prefer_torch and spec.framework == FRAMEWORK_TORCH):
        array = (
            np.frombuffer(data, dtype=np_dtype).reshape(spec.shape)
            if spec.nbytes
            else np.empty(spec.shape, dtype=np_dtype)
        )
        return array.copy() if copy else array  # own writable memory, independent of the zmq frame
    import torch

    torch_dtype = getattr(torch, spec.dtype)
    owned = bytearray(data) if copy else data
    raw = torch.frombuffer(owned, dtype=torch.uint8) if spec.nbytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(torch_dtype).reshape(spec.shape)


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


# --- results and errors as data ---------------------------------------------------------------


def error_body(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "message": message, **extra}


def final_error(request_id: str, kind: str, text: str) -> list[Any]:
    """A FINAL reply for a request that could not run."""
    return message(FINAL, {"request_id": request_id, "ok": False, "error": error_body(kind, text)})


# --- value trees ------------------------------------------------------------------------------

WireSink = Callable[[memoryview | bytes], "int | str"]


def encode_value(value: Any, sink: WireSink, *, bytes_to_frames: bool = False, depth: int = 0) -> Any:
    """Turn a Python value into a msgpack-able tree.

    Tensors become :class:`TensorSpec` whose ``source`` is what ``sink`` returns for their bytes (a
    frame index for replies, a digest for programs); with ``bytes_to_frames`` large byte strings
    travel through ``sink`` too. Anything else that is not plain data raises WireError.
    """
    if depth > MAX_NESTING:
        raise WireError(f"value nested deeper than {MAX_NESTING} levels")
    # pack() uses strict_types, so subclasses (np.float64 is a float, IntEnum an int, StrEnum a str)
    # must become the exact builtin type here or packing the body fails.
    if value is None or isinstance(value, RefValue):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)  # the characters themselves: str() of a str Enum gives "Cls.NAME"
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise WireError(f"integer {value} does not fit in 64 bits")
        return int(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = value if type(value) is bytes else bytes(value)
        if bytes_to_frames and len(data) > INLINE_BYTES_LIMIT:
            index = sink(data)
            assert isinstance(index, int)
            return BytesFrame(index)
        return data
    if isinstance(value, np.generic):
        return encode_value(value.item(), sink, bytes_to_frames=bytes_to_frames, depth=depth + 1)
    if isinstance(value, list):
        return [encode_value(v, sink, bytes_to_frames=bytes_to_frames, depth=depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(encode_value(v, sink, bytes_to_frames=bytes_to_frames, depth=depth + 1) for v in value)
    if isinstance(value, dict):
        return {
            encode_value(k, sink, depth=depth + 1): encode_value(
                v, sink, bytes_to_frames=bytes_to_frames, depth=depth + 1
            )
            for k, v in value.items()
        }
    if is_tensor(value):
        framework, dtype, shape, raw = tensor_to_wire(value)
        return TensorSpec(framework, dtype, shape, sink(raw))
    raise WireError(f"cannot send a value of type {type(value).__module__}.{type(value).__qualname__}")


def decode_value(tree: Any, convert: Callable[[Any], Any], depth: int = 0) -> Any:
    """Walk a decoded tree, replacing each extension object (tensor, bytes frame, file, folder,
    reference) by what ``convert`` returns for it."""
    if depth > MAX_NESTING:
        raise WireError(f"value nested deeper than {MAX_NESTING} levels")
    if isinstance(tree, (TensorSpec, BytesFrame, FileSpec, FolderSpec, RefValue)):
        return convert(tree)
    if isinstance(tree, list):
        return [decode_value(v, convert, depth + 1) for v in tree]
    if isinstance(tree, tuple):
        return tuple(decode_value(v, convert, depth + 1) for v in tree)
    if isinstance(tree, dict):
        return {decode_value(k, convert, depth + 1): decode_value(v, convert, depth + 1) for k, v in tree.items()}
    return tree


# --- execute options --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecuteOptions:
    """A program's run options, checked the same way by the client and the broker."""

    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    gpu_count: int | None = None
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "timeout_seconds": self.timeout_seconds,
            "output_limit_bytes": self.output_limit_bytes,
        }
        if self.gpu_count is not None:
            body["gpu_count"] = self.gpu_count
        return body


def parse_options(raw: Any) -> ExecuteOptions:
    """Check a map of options (from a caller or the wire); raises WireError with the reason."""
    if raw is None:
        return ExecuteOptions()
    if not isinstance(raw, dict):
        raise WireError("options must be a map")
    unknown = set(raw) - {"timeout_seconds", "gpu_count", "output_limit_bytes"}
    if unknown:
        raise WireError(f"unknown options: {', '.join(sorted(map(str, unknown)))}")
    timeout = raw.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_SECONDS
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise WireError("timeout_seconds must be a number")
    if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise WireError(f"timeout_seconds must be in (0, {MAX_TIMEOUT_SECONDS:g}]")
    gpu_count = raw.get("gpu_count")
    if gpu_count is not None:
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int):
            raise WireError("gpu_count must be an integer")
        if not 1 <= gpu_count <= MAX_GPU_COUNT:
            raise WireError(f"gpu_count must be between 1 and {MAX_GPU_COUNT}")
    limit = raw.get("output_limit_bytes", DEFAULT_OUTPUT_LIMIT_BYTES)
    if limit is None:
        limit = DEFAULT_OUTPUT_LIMIT_BYTES
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise WireError("output_limit_bytes must be an integer")
    if not 0 <= limit <= MAX_OUTPUT_LIMIT_BYTES:
        raise WireError(f"output_limit_bytes must be between 0 and {MAX_OUTPUT_LIMIT_BYTES}")
    return ExecuteOptions(float(timeout), gpu_count, limit)


def parse_execute(body: dict[str, Any]) -> tuple[dict[str, Any], ExecuteOptions, list[str]]:
    """The program, its options and its blob digests from an EXECUTE body; WireError if bad."""
    program = body.get("program")
    if not isinstance(program, dict):
        raise WireError("EXECUTE needs a program map")
    return program, parse_options(body.get("options")), program_digests(program)


def program_digests(program: dict[str, Any]) -> list[str]:
    """Every blob digest a program's instructions name, in order, without duplicates."""
    found: dict[str, None] = {}

    def visit(obj: Any) -> Any:
        if isinstance(obj, TensorSpec) and isinstance(obj.source, str):
            found[obj.source] = None
        return obj

    instructions = program.get("instructions")
    if not isinstance(instructions, list):
        raise WireError("program.instructions must be a list")
    if len(instructions) > MAX_INSTRUCTIONS:
        raise WireError(f"a program holds at most {MAX_INSTRUCTIONS} instructions")
    for ins in instructions:
        if not isinstance(ins, dict):
            raise WireError("each instruction must be a map")
        if "blob" in ins:
            found[check_digest(ins["blob"])] = None
        for entry in ins.get("files") or []:
            if isinstance(entry, list) and len(entry) >= 2:
                found[check_digest(entry[1])] = None
        for key in ("tensor", "args", "value"):
            if key in ins:
                decode_value(ins[key], visit)
    return list(found)


# --- federation: host broker (node) <-> router ------------------------------------------------
# A host broker started with --upstream runs a relay (kcoral/broker/upstream.py) that connects a
# DEALER to the router's nodes endpoint. Besides the commands below, that link carries client
# messages unchanged: router -> node EXECUTE, BLOBS, CANCEL; node -> router PARTIAL, FINAL. Both
# sides send NODE_HEARTBEAT every HEARTBEAT_INTERVAL_SECONDS and take the other for dead after
# HEARTBEAT_LIVENESS intervals of silence; the node then registers again, under a new identity.

# node -> router, repeated every interval until answered: node_id, instance_id, hostname,
# gpu_count, fake_gpus, status, load, target, versions (the fields of the broker's health)
NODE_REGISTER: Final = b"\x30"
NODE_REGISTERED: Final = b"\x31"  # router -> node: instance_id (the router's)
# node -> router: status, load, and quiet_seconds (optional: how long the node may be silent, as
# it is about to store a large upload on its event loop); router -> node: {}
NODE_HEARTBEAT: Final = b"\x32"
NODE_DISCONNECT: Final = b"\x33"  # router -> node: "unknown node, register again"; node -> router: leaving

NODE_COMMANDS: Final = frozenset({NODE_REGISTER, NODE_REGISTERED, NODE_HEARTBEAT, NODE_DISCONNECT})
COMMAND_NAMES.update(
    {
        NODE_REGISTER: "NODE_REGISTER",
        NODE_REGISTERED: "NODE_REGISTERED",
        NODE_HEARTBEAT: "NODE_HEARTBEAT",
        NODE_DISCONNECT: "NODE_DISCONNECT",
    }
)


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


def peek_request_id(body: bytes | memoryview) -> str:
    """The ``request_id`` of a body, read without decoding the rest of it.

    The router and the node relay pass FINAL bodies through (their result trees may be large), and
    need only this field to route them; msgpack skips the other values without building them.
    """
    if len(body) > MAX_BODY_BYTES:
        raise WireError(f"body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}")
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(body), 1))
    try:
        unpacker.feed(body)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "request_id":
                return check_id(unpacker.unpack(), "request_id")
            unpacker.skip()
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"body is not a valid msgpack map: {exc}") from exc
    raise WireError("body has no request_id")
