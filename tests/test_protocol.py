"""Unit tests of the wire codecs in kcoral.protocol: values, tensors, frames, options."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import threading
import types
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from kcoral import protocol
from kcoral.protocol import (
    BytesFrame,
    FileSpec,
    FolderSpec,
    RefValue,
    TensorSpec,
    WireError,
)

DIGEST = "ab" * 32
NUMPY_LACKS = {name for name, (_, np_name) in protocol.DTYPES.items() if np_name is None}
SHAPES = [(), (0,), (3,), (2, 0, 4), (2, 3)]


def round_trip(obj: Any) -> Any:
    return protocol.unpack(protocol.pack(obj))


def ext(code: int, payload: Any) -> bytes:
    """A body holding one extension value whose payload is ``payload`` packed as plain msgpack."""
    data = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
    return msgpack.packb({"v": msgpack.ExtType(code, data)}, use_bin_type=True)


class Colour(enum.IntEnum):
    RED = 1


class Name(str, enum.Enum):  # noqa: UP042 (str() of this kind, unlike StrEnum, is "Name.A")
    A = "a"


# --- msgpack bodies with extension types ---------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -(1 << 63),
        (1 << 64) - 1,
        1.5,
        "ünïcode",
        b"\x00\xff",
        [1, [2, [3]]],
        {"a": {"b": [None]}, 3: "int key"},
        (1, "two", (3.0,)),
        [(), ((),)],
        {(1, 2): "tuple key"},
        TensorSpec("numpy", "float32", (2, 3), DIGEST),
        TensorSpec("torch", "bfloat16", (), 4),
        RefValue("upload_0"),
        BytesFrame(7),
        FileSpec("out.txt", 0, 0o644),
        FolderSpec((("a/b.txt", 0, 0o755), ("c", 1, 0o600))),
        FolderSpec(()),
        {"mix": [RefValue("x"), (TensorSpec("numpy", "int8", (0,), 0), BytesFrame(1))]},
    ],
)
def test_every_value_kind_round_trips(value: Any) -> None:
    assert round_trip(value) == value
    assert type(round_trip(value)) is type(value)


def test_tuples_stay_tuples_and_lists_stay_lists() -> None:
    back = round_trip({"t": (1, [2, (3,)]), "l": [(4,)]})
    assert type(back["t"]) is tuple and type(back["t"][1]) is list and type(back["t"][1][1]) is tuple
    assert type(back["l"]) is list and type(back["l"][0]) is tuple


def test_extension_payloads_are_the_documented_bytes() -> None:
    # docs/protocol.md section 4 gives these payloads exactly; other languages build them by hand.
    body = protocol.pack(
        {
            "t": TensorSpec("numpy", "float32", (2,), DIGEST),
            "r": RefValue("upload_0"),
            "u": (1, 2),
            "b": BytesFrame(3),
            "f": FileSpec("x", 1, 0o644),
            "d": FolderSpec((("p/q", 2, 0o600),)),
        }
    )
    raw = msgpack.unpackb(body, raw=False)
    assert raw["t"] == msgpack.ExtType(1, msgpack.packb(["numpy", "float32", [2], DIGEST]))
    assert raw["r"] == msgpack.ExtType(2, b"upload_0")
    assert raw["u"] == msgpack.ExtType(3, msgpack.packb([1, 2]))
    assert raw["b"] == msgpack.ExtType(4, msgpack.packb(3))
    assert raw["f"] == msgpack.ExtType(5, msgpack.packb(["x", 1, 0o644]))
    assert raw["d"] == msgpack.ExtType(6, msgpack.packb([["p/q", 2, 0o600]]))


def test_message_and_split_message() -> None:
    frames = protocol.message(protocol.EXECUTE, {"request_id": "r1"}, b"blob", memoryview(b"two"))
    assert frames[0] == b"KC1" and frames[1] == b"\x01"
    command, body, data = protocol.split_message(frames)
    assert (
        command == protocol.EXECUTE and body == {"request_id": "r1"} and [bytes(d) for d in data] == [b"blob", b"two"]
    )


def test_command_bytes_are_distinct_and_named() -> None:
    commands = [value for name, value in vars(protocol).items() if name in protocol.COMMAND_NAMES.values()]
    assert len(commands) == len(set(commands)) == len(protocol.COMMAND_NAMES)
    assert all(isinstance(c, bytes) and len(c) == 1 for c in commands)
    assert protocol.CLIENT_COMMANDS.isdisjoint(protocol.WORKER_COMMANDS)


def test_every_public_name_of_the_package_is_a_protocol_name() -> None:
    # Callers write protocol.X whichever module of the package defines X; __all__ is that list.
    defined: set[str] = set()
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"kcoral.protocol.{info.name}")
        defined |= {name for name, value in vars(module).items() if _defined_in(value, name, module)}
    assert defined <= set(protocol.__all__)
    assert all(hasattr(protocol, name) for name in protocol.__all__)
    assert len(protocol.__all__) == len(set(protocol.__all__))


def _defined_in(value: Any, name: str, module: types.ModuleType) -> bool:
    if name.startswith("_") or isinstance(value, types.ModuleType):
        return False
    if isinstance(value, (type, types.FunctionType)):
        return value.__module__ == module.__name__
    # A constant does not say where it was made: count those the module's source assigns itself.
    return f"\n{name}: " in inspect.getsource(module) or f"\n{name} = " in inspect.getsource(module)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (ext(1, ["numpy", "float32", [2]]), "bad extension value"),  # 3 fields, not 4
        (ext(1, ["jax", "float32", [2], 0]), "framework"),
        (ext(1, ["numpy", "float31", [2], 0]), "unknown dtype"),
        (ext(1, ["numpy", "float32", 2, 0]), "shape must be a list"),
        (ext(1, ["numpy", "float32", [-1], 0]), "bad tensor shape"),
        (ext(1, ["numpy", "float32", [True], 0]), "bad tensor shape"),
        (ext(1, ["numpy", "float32", [1] * 33, 0]), "dimensions"),
        (ext(1, ["numpy", "float32", [2], -1]), "frame index or a blob digest"),
        (ext(1, ["numpy", "float32", [2], 1.5]), "frame index or a blob digest"),
        (ext(1, ["numpy", "float32", [2], "AB" * 32]), "bad blob digest"),  # uppercase
        (ext(1, ["numpy", "float32", [2], "ab" * 32 + "\n"]), "bad blob digest"),
        (ext(1, b"\xc1"), "bad extension value"),  # 0xc1 is never valid msgpack
        (ext(2, b"bad id!"), "bad id"),
        (ext(2, b""), "bad id"),
        (ext(2, b"upload_0\n"), "bad id"),
        (ext(2, b"\xff\xfe"), "bad extension value"),
        (ext(3, 5), "bad extension value"),
        (ext(4, -1), "frame index"),
        (ext(4, "0"), "frame index"),
        (ext(4, True), "frame index"),
        (ext(5, ["x", -2, 0o644]), "frame index"),
        (ext(5, ["x", 0]), "bad extension value"),
        (ext(6, [["a", 0]]), "bad extension value"),
        (ext(6, [["a", -1, 0]]), "frame index"),
        (ext(6, 7), "bad extension value"),
        (ext(9, b""), "unknown msgpack extension type 9"),
        (b"\xd4\xfe\x00", "unknown msgpack extension type -2"),  # a fixext 1 of type -2
        (b"\xc1", "not valid msgpack"),
        (b"\x92\x01", "not valid msgpack"),  # truncated
        (b"\x01\x02", "not valid msgpack"),  # extra data
    ],
)
def test_bad_bodies_raise_wire_error(body: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        protocol.unpack(body)


def test_nesting_limits() -> None:
    # msgpack's own limit on arrays inside one body
    with pytest.raises(WireError, match="not valid msgpack"):
        protocol.unpack(b"\x91" * 2000 + b"\x00")
    # Tuples nest through extension payloads, one unpack per level: bounded so that a small body
    # cannot overflow the C stack (this used to crash the process).
    inner = protocol.pack(0)
    for _ in range(protocol.MAX_NESTING + 1):
        inner = msgpack.packb(msgpack.ExtType(protocol.EXT_TUPLE, b"\x91" + inner))
    with pytest.raises(WireError, match="tuples nested deeper"):
        protocol.unpack(inner)
    for _ in range(3000):  # ~9 KB: far past what once killed the process
        inner = msgpack.packb(msgpack.ExtType(protocol.EXT_TUPLE, b"\x91" + inner))
    errors: list[Exception] = []

    def in_a_thread() -> None:  # threads (the Client's reader) get no bigger stack than the main one
        try:
            protocol.unpack(inner)
        except WireError as exc:
            errors.append(exc)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1
    # MAX_NESTING tuples deep is still fine
    value: Any = 0
    for _ in range(protocol.MAX_NESTING - 1):
        value = (value,)
    assert round_trip(value) == value


def test_value_trees_nested_too_deeply() -> None:
    deep: Any = 0
    for _ in range(protocol.MAX_NESTING + 2):
        deep = [deep]
    with pytest.raises(WireError, match="nested deeper"):
        protocol.encode_value(deep, lambda data: 0)
    with pytest.raises(WireError, match="nested deeper"):
        protocol.decode_value(deep, lambda obj: obj)


def test_oversized_body() -> None:
    with pytest.raises(WireError, match="over the limit"):
        protocol.unpack(bytes(protocol.MAX_BODY_BYTES + 1))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "0 frames"),
        ([b"KC1"], "1 frames"),
        ([b"KC1", b"\x04"], "2 frames"),
        ([b"KC2", b"\x04", protocol.pack({})], "version"),
        ([b"", b"\x04", protocol.pack({})], "version"),
        ([b"KC1", b"\x04", protocol.pack([1, 2])], "must be a map"),
        ([b"KC1", b"\x04", b"\xc1"], "not valid msgpack"),
    ],
)
def test_split_message_refuses_bad_frames(frames: list[bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        protocol.split_message(frames)


def test_split_message_refuses_too_many_frames() -> None:
    frames = [b"KC1", b"\x01", protocol.pack({})] + [b""] * protocol.MAX_FRAMES
    with pytest.raises(WireError, match="at most"):
        protocol.split_message(frames)


@pytest.mark.parametrize("good", ["a", "upload_0", "x.y:z-1", "A" * 200])
def test_check_id_accepts(good: str) -> None:
    assert protocol.check_id(good) == good


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "A" * 201, "id\n", "ü", None, 3, b"id"])
def test_check_id_refuses(bad: object) -> None:
    with pytest.raises(WireError):
        protocol.check_id(bad)


@pytest.mark.parametrize("bad", ["ab" * 31, "AB" * 32, "ab" * 32 + "\n", "g" * 64, None, 64])
def test_check_digest_refuses(bad: object) -> None:
    with pytest.raises(WireError, match="digest"):
        protocol.check_digest(bad)


def test_sha256_hex_matches_check_digest() -> None:
    digest = protocol.sha256_hex(b"abc")
    assert protocol.check_digest(digest) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# --- encode_value / decode_value -----------------------------------------------------------------


def test_encode_value_sends_tensors_and_large_bytes_through_the_sink() -> None:
    sent: list[bytes] = []

    def sink(data: Any) -> int:
        sent.append(bytes(data))
        return len(sent) - 1

    big = b"x" * (protocol.INLINE_BYTES_LIMIT + 1)
    small = b"y" * protocol.INLINE_BYTES_LIMIT
    tree = protocol.encode_value(
        {"a": np.arange(3, dtype=np.int16), "big": big, "small": small, "t": (1, [2])}, sink, bytes_to_frames=True
    )
    assert tree["a"] == TensorSpec("numpy", "int16", (3,), 0)
    assert tree["big"] == BytesFrame(1) and tree["small"] == small and tree["t"] == (1, [2])
    assert sent == [np.arange(3, dtype=np.int16).tobytes(), big]
    # without bytes_to_frames, bytes stay inline whatever their size
    assert protocol.encode_value(big, sink) == big


def test_encode_value_gives_exact_builtin_types() -> None:
    # pack() uses strict_types: numpy scalars and enum members once made the worker fail to
    # send its result at all (np.float64 is a float subclass).
    tree = protocol.encode_value(
        [np.float64(1.5), np.float32(2.5), np.int64(3), np.bool_(True), Colour.RED, Name.A, bytearray(b"z")],
        lambda data: 0,
    )
    assert tree == [1.5, 2.5, 3, True, 1, "a", b"z"]
    assert [type(v) for v in tree] == [float, float, int, bool, int, str, bytes]
    assert round_trip(tree) == tree


@pytest.mark.parametrize("bad", [1 << 64, -(1 << 63) - 1, object(), {1, 2}, 1j, lambda: 0])
def test_encode_value_refuses(bad: object) -> None:
    with pytest.raises(WireError):
        protocol.encode_value(bad, lambda data: 0)


def test_decode_value_converts_every_extension_object() -> None:
    tree = {"t": TensorSpec("numpy", "int8", (1,), 0), "r": [RefValue("a")], "f": (FileSpec("n", 0, 0),)}
    seen: list[Any] = []

    def convert(obj: Any) -> str:
        seen.append(obj)
        return type(obj).__name__

    assert protocol.decode_value(tree, convert) == {"t": "TensorSpec", "r": ["RefValue"], "f": ("FileSpec",)}
    assert len(seen) == 3


def test_program_digests_in_order_without_duplicates() -> None:
    other = "cd" * 32
    program = {
        "instructions": [
            {"op": "upload", "id": "a", "kind": "bytes", "blob": DIGEST, "size": 1},
            {"op": "upload", "id": "b", "kind": "tensor", "tensor": TensorSpec("numpy", "int8", (1,), other)},
            {"op": "upload_folder", "id": "c", "path": "d", "files": [["x", DIGEST, 0o644, 1]]},
            {"op": "run", "id": "r", "fn": "b", "args": [[TensorSpec("numpy", "int8", (1,), "ef" * 32)]]},
        ]
    }
    assert protocol.program_digests(program) == [DIGEST, other, "ef" * 32]
    with pytest.raises(WireError, match="digest"):
        protocol.program_digests({"instructions": [{"op": "upload", "blob": "nope"}]})
    with pytest.raises(WireError, match="must be a list"):
        protocol.program_digests({"instructions": {}})
    with pytest.raises(WireError, match="must be a map"):
        protocol.program_digests({"instructions": [1]})


# --- tensors -------------------------------------------------------------------------------------


def _numpy_value(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    return (np.arange(count) % 2).astype(dtype).reshape(shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", sorted(set(protocol.DTYPES) - NUMPY_LACKS))
def test_numpy_tensors_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    array = _numpy_value(dtype, shape)
    framework, name, wire_shape, raw = protocol.tensor_to_wire(array)
    assert (framework, name, wire_shape) == ("numpy", dtype, shape)
    assert len(raw) == protocol.tensor_nbytes(dtype, shape) == array.nbytes
    spec = TensorSpec(framework, name, wire_shape, 0)
    back = protocol.tensor_from_wire(spec, bytes(raw), prefer_torch=False)
    assert isinstance(back, np.ndarray) and back.dtype == array.dtype and back.shape == shape
    np.testing.assert_array_equal(back, array)
    back.reshape(-1)[:1] = 0  # writable, its own memory
    as_torch = protocol.tensor_from_wire(spec, bytes(raw), prefer_torch=True)
    assert isinstance(as_torch, np.ndarray)  # a numpy tensor stays numpy even where torch is preferred


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", sorted(protocol.DTYPES))
def test_torch_tensors_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    torch_dtype = getattr(torch, dtype)
    tensor = torch.ones(shape, dtype=torch.float32).to(torch_dtype)
    framework, name, wire_shape, raw = protocol.tensor_to_wire(tensor)
    assert (framework, name, wire_shape) == ("torch", dtype, shape)
    assert len(raw) == protocol.tensor_nbytes(dtype, shape)
    spec = TensorSpec(framework, name, wire_shape, 0)
    back = protocol.tensor_from_wire(spec, bytes(raw), prefer_torch=True)
    assert isinstance(back, torch.Tensor) and back.dtype == torch_dtype and tuple(back.shape) == shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    client_side = protocol.tensor_from_wire(spec, bytes(raw), prefer_torch=False)
    if dtype in NUMPY_LACKS:
        assert isinstance(client_side, torch.Tensor) and client_side.dtype == torch_dtype
    else:
        assert isinstance(client_side, np.ndarray) and client_side.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(client_side, back.numpy())


def test_tensor_bytes_are_c_order_little_endian() -> None:
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    expected = np.arange(6, dtype="<f4").tobytes()
    for value in (fortran, big_endian, big_endian.T.T, torch.arange(6, dtype=torch.float32).reshape(3, 2).T.T):
        assert bytes(protocol.tensor_to_wire(value)[3]) == expected
    transposed = protocol.tensor_to_wire(np.arange(6, dtype=np.int8).reshape(2, 3).T)
    assert transposed[2] == (3, 2) and bytes(transposed[3]) == bytes([0, 3, 1, 4, 2, 5])
    bf16 = protocol.tensor_to_wire(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert bytes(bf16[3]) == bytes([0x80, 0x3F, 0x00, 0xC0])  # high halves of float32 1.0 and -2.0


def test_tensor_errors() -> None:
    with pytest.raises(WireError, match="needs 12 bytes, got 11"):
        protocol.tensor_from_wire(TensorSpec("numpy", "float32", (3,), 0), b"x" * 11, prefer_torch=False)
    with pytest.raises(WireError, match="not supported"):
        protocol.tensor_to_wire(np.array(["a"]))
    with pytest.raises(WireError, match="not supported"):
        protocol.tensor_to_wire(np.zeros(2, dtype=np.float128 if hasattr(np, "float128") else "datetime64[s]"))
    with pytest.raises(WireError, match="not a tensor"):
        protocol.tensor_to_wire([1, 2])
    with pytest.raises(WireError, match="unknown dtype"):
        protocol.tensor_nbytes("float31", (1,))
    assert protocol.tensor_nbytes("complex128", ()) == 16
    assert protocol.tensor_nbytes("bfloat16", (4, 0)) == 0


# --- options -------------------------------------------------------------------------------------


def test_parse_options_defaults() -> None:
    for raw in (None, {}, {"timeout_seconds": None, "gpu_count": None, "output_limit_bytes": None}):
        options = protocol.parse_options(raw)
        assert options == protocol.ExecuteOptions()
        assert options.to_wire() == {"timeout_seconds": 300.0, "output_limit_bytes": 1 << 20}


def test_parse_options_accepts_the_edges() -> None:
    options = protocol.parse_options({"timeout_seconds": 900, "gpu_count": 8, "output_limit_bytes": 0})
    assert options == protocol.ExecuteOptions(900.0, 8, 0)
    assert isinstance(options.timeout_seconds, float)
    assert options.to_wire()["gpu_count"] == 8
    assert protocol.parse_options({"timeout_seconds": 0.001, "gpu_count": 1}).gpu_count == 1
    assert protocol.parse_options({"output_limit_bytes": 64 << 20}).output_limit_bytes == 64 << 20


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([], "must be a map"),
        ({"colour": 1}, "unknown options: colour"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": -1}, "timeout_seconds"),
        ({"timeout_seconds": 900.5}, "timeout_seconds"),
        ({"timeout_seconds": "10"}, "timeout_seconds must be a number"),
        ({"timeout_seconds": True}, "timeout_seconds must be a number"),
        ({"gpu_count": 0}, "gpu_count"),
        ({"gpu_count": 9}, "gpu_count"),
        ({"gpu_count": 1.0}, "gpu_count must be an integer"),
        ({"gpu_count": True}, "gpu_count must be an integer"),
        ({"output_limit_bytes": -1}, "output_limit_bytes"),
        ({"output_limit_bytes": (64 << 20) + 1}, "output_limit_bytes"),
        ({"output_limit_bytes": 1.5}, "output_limit_bytes must be an integer"),
    ],
)
def test_parse_options_refuses(raw: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        protocol.parse_options(raw)


def test_final_error_body() -> None:
    command, body, frames = protocol.split_message(protocol.final_error("r-1", "busy", "the queue is full"))
    assert command == protocol.FINAL and frames == []
    assert body == {"request_id": "r-1", "ok": False, "error": {"kind": "busy", "message": "the queue is full"}}


# --- instruction lists ---------------------------------------------------------------------------


def test_check_instructions_names_the_first_bad_instruction() -> None:
    good = {"op": "return", "id": "r", "key": "k", "value": 1}
    assert protocol.check_instructions([good]) == [good]
    cases: list[tuple[Any, int | None, str]] = [
        ("not a list", None, "must be a list"),
        ([good, {"op": "nope", "id": "x"}], 1, "unknown op"),
        ([good, {**good, "id": "s"}], 1, "duplicate return key"),
        ([{"op": "run", "id": "r", "fn": "f"}], 0, "names no earlier instruction"),
        ([{"op": "return_file", "id": "r", "key": "k", "path": "../x"}], 0, "'..'"),
        ([{"op": "return", "id": "r", "key": "k", "value": protocol.RefValue("later")}], 0, "reference"),
    ]
    for instructions, index, words in cases:
        with pytest.raises(protocol.ProgramError, match=words) as caught:
            protocol.check_instructions(instructions)
        assert caught.value.index == index
