"""Tensors on the wire: supported dtypes, the tensor spec, and conversion to and from raw bytes.

The wire is little endian and C ordered. numpy and torch tensors both travel; dtypes numpy lacks
(bfloat16, float8) come back as torch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kcoral.protocol.frames import WireError

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
