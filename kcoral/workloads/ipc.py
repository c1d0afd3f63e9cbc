"""GPU memory and a gate shared between the harness and the candidate's process (CUDA IPC).

The harness allocates each shared buffer with the driver (``cuMemAlloc``), one allocation per
buffer, so the handle it exports (``cuIpcGetMemHandle``) opens exactly that buffer and nothing of the
harness's own memory (torch's allocator would export the whole segment a tensor sits in, with the
harness's private tensors beside it). The candidate's process opens the handles
(``cuIpcOpenMemHandle``) once, before any timed call, and sees each buffer as a torch tensor.

Two shared 32-bit words order the two processes' GPU work, with no event shared (CUDA's IPC events
were refused on the H200 host): the *gate*, on which the candidate's process queues its call behind
a stream wait (``cuStreamWaitValue32``, greater or equal) and which the harness opens by writing the
call's sequence number from its own stream, after its start event and the call's inputs (so the
candidate's host launches everything before the harness starts its clock, and none of its GPU work
can start before); and the *completion* word, which the candidate's process sets after the copy of
the call's output and on which the harness's stream waits before its commit. Where the driver
refuses stream memory operations (``StreamWait.available``) the gate is not used and the harness
polls the completion word from the host.

Only the standard library and torch: ``ctypes`` on ``libcuda.so.1`` (the driver, present wherever
CUDA runs). Nothing here runs before a CUDA context exists in the process.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Final

HANDLE_BYTES: Final = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 1
CU_STREAM_WAIT_VALUE_GEQ: Final = 0
CU_STREAM_WRITE_VALUE_DEFAULT: Final = 0
FLAG_BYTES: Final = 4
# Dtypes that may be shared, by torch name (the same as may cross the message channel).
SHAREABLE_DTYPES: Final = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
MAX_SHARED_BYTES: Final = 16 << 30


class IpcError(Exception):
    """Raised when the driver refuses a shared-memory operation."""


class _Handle(ctypes.Structure):
    # Bytes, not chars: a c_char array reads back only up to its first zero byte.
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


# The loaded driver, in a dict that stays the same object (the timer's snapshot watches this
# module's names in the candidate's process).
_DRIVER: Final[dict[str, Any]] = {}


def _driver() -> Any:
    if "cuda" not in _DRIVER:
        try:
            _DRIVER["cuda"] = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise IpcError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from exc
    return _DRIVER["cuda"]


def _function(*names: str) -> Any:
    driver = _driver()
    for name in names:
        function = getattr(driver, name, None)
        if function is not None:
            return function
    raise IpcError(f"the CUDA driver has none of {', '.join(names)}")


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        with_name = _driver().cuGetErrorString
        with_name(result, ctypes.byref(text))
        raise IpcError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def _ensure_context() -> None:
    """The calling thread's current context: torch's primary one (torch made it when it initialised)."""
    current = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        raise IpcError("no CUDA context is current on this thread (initialise torch's CUDA first)")


@dataclass(frozen=True)
class BufferMeta:
    """What one shared buffer holds: a tensor's dtype and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def nbytes(self, torch: Any) -> int:
        return self.count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def describe(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, torch: Any, tensor: Any) -> BufferMeta:
        return cls(str(tensor.dtype).removeprefix("torch."), tuple(int(d) for d in tensor.shape))

    @classmethod
    def parse(cls, value: Any) -> BufferMeta:
        """From a message; ValueError when it is not a shareable tensor's description."""
        if not isinstance(value, dict):
            raise ValueError("a buffer description is not a map")
        dtype, shape = value.get("dtype"), value.get("shape")
        if dtype not in SHAREABLE_DTYPES:
            raise ValueError(f"a buffer of dtype {dtype!r} cannot be shared")
        if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad buffer shape {shape!r}")
        return cls(dtype, tuple(shape))


class _Interface:
    """A ``__cuda_array_interface__`` over raw device memory, as bytes (torch then views the dtype)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 2,
        }


def _view(torch: Any, pointer: int, meta: BufferMeta, device: int) -> Any:
    nbytes = meta.nbytes(torch)
    if nbytes == 0:
        return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=f"cuda:{device}")
    raw = torch.as_tensor(_Interface(pointer, nbytes), device=f"cuda:{device}")
    return raw.view(getattr(torch, meta.dtype)).reshape(meta.shape)


class SharedBuffer:
    """A buffer the harness allocated for sharing; ``tensor`` is the harness's view of it."""

    def __init__(self, torch: Any, meta: BufferMeta, device: int) -> None:
        _ensure_context()
        nbytes = max(meta.nbytes(torch), FLAG_BYTES)
        if nbytes > MAX_SHARED_BYTES:
            raise IpcError(f"a shared buffer of {nbytes} bytes is over the limit")
        pointer = ctypes.c_uint64()
        _check(_function("cuMemAlloc_v2", "cuMemAlloc")(ctypes.byref(pointer), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        self.pointer = int(pointer.value)
        self.meta = meta
        handle = _Handle()
        _check(_function("cuIpcGetMemHandle")(ctypes.byref(handle), ctypes.c_uint64(self.pointer)), "cuIpcGetMemHandle")
        self.handle = bytes(handle.reserved).hex()
        self.tensor = _view(torch, self.pointer, meta, device)

    def close(self) -> None:
        if self.pointer:
            self.tensor = None
            _function("cuMemFree_v2", "cuMemFree")(ctypes.c_uint64(self.pointer))
            self.pointer = 0


class OpenedBuffer:
    """A buffer of the harness, opened in the candidate's process from its handle."""

    def __init__(self, torch: Any, handle_hex: str, meta: BufferMeta, device: int) -> None:
        _ensure_context()
        raw = bytes.fromhex(handle_hex)
        if len(raw) != HANDLE_BYTES:
            raise IpcError(f"an IPC handle has {len(raw)} bytes, not {HANDLE_BYTES}")
        handle = _Handle.from_buffer_copy(raw)
        pointer = ctypes.c_uint64()
        opener = _function("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        flags = ctypes.c_uint(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        _check(opener(ctypes.byref(pointer), handle, flags), "cuIpcOpenMemHandle")
        self.pointer = int(pointer.value)
        self.meta = meta
        self.tensor = _view(torch, self.pointer, meta, device)


class StreamWait:
    """Queue, on the current stream, a wait until a shared 32-bit word is at least a value.

    The candidate's process waits on the gate's word this way; the harness on the completion word,
    which the candidate's process sets after the copy of each call's output."""

    def __init__(self, torch: Any, pointer: int) -> None:
        self._torch = torch
        self._address = pointer
        self._wait: Any = None
        self.available = False
        self.why_not: str | None = None
        try:
            self._wait = _function("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
            self.wait(0)  # the word starts at 0: this returns at once where stream waits work
            torch.cuda.synchronize()
            self.available = True
        except (IpcError, RuntimeError) as exc:
            self.why_not = str(exc)

    def wait(self, value: int) -> None:
        stream = ctypes.c_void_p(int(self._torch.cuda.current_stream().cuda_stream))
        address, flags = ctypes.c_uint64(self._address), ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ)
        result = self._wait(stream, address, ctypes.c_uint32(value), flags)
        _check(result, "cuStreamWaitValue32")
