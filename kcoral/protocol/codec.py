"""Bodies and values: msgpack with KCoral's extension types, messages, and value trees.

Values inside bodies use msgpack extension types for what msgpack does not carry natively
(tensors, references, tuples, returned files and folders); the bytes of tensors, large byte
strings and files travel as their own frames, named by index. ``docs/protocol.md`` describes the
same encoding for tools written without this package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np

from kcoral.protocol.frames import (
    INLINE_BYTES_LIMIT,
    MAX_BODY_BYTES,
    MAX_FRAMES,
    MAX_NESTING,
    VERSION,
    WireError,
    check_digest,
    check_id,
)
from kcoral.protocol.tensors import (
    FRAMEWORK_NUMPY,
    FRAMEWORK_TORCH,
    TensorSpec,
    is_tensor,
    tensor_nbytes,
    tensor_to_wire,
)

# --- value encoding ---------------------------------------------------------------------------

EXT_TENSOR: Final = 1  # [framework, dtype, shape, source]: source = frame index (int) or digest (str)
EXT_REF: Final = 2  # instruction id (str): a value the server created earlier
EXT_TUPLE: Final = 3  # a list packed as a tuple
EXT_BYTES: Final = 4  # frame index of a byte string sent as its own frame
EXT_FILE: Final = 5  # [name, frame index, mode]
EXT_FOLDER: Final = 6  # [[relative path, frame index, mode], ...]


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
