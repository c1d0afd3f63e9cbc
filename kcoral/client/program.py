"""The Program builder: an ordered list of instructions that the server executes.

Example::

    program = Program()
    module = program.upload(kind="module", source="def add(a, b):\\n    return a + b\\n")
    add = program.get_function(module=module, name="add")
    total = program.run(fn=add, args=[2, 3])
    program.return_(key="total", value=total)

Every method checks its arguments at once and raises ``ValueError`` or ``TypeError`` before
anything is sent. Uploaded bytes are hashed when they are added: change an array after uploading it
and the service refuses the program (its digest no longer matches).
"""

from __future__ import annotations

import itertools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kcoral import protocol
from kcoral.protocol import check_relative_path

UPLOAD_KINDS = ("module", "tensor", "bytes", "library")
# Not id(): a dead Program's address is reused at once, and its references would pass as ours.
_PROGRAM_SERIALS = itertools.count()


@dataclass(frozen=True)
class Ref:
    """A reference to the value that an instruction will create on the server."""

    id: str
    op: str
    _program: int  # serial number of the owning Program, to refuse references across programs

    def __repr__(self) -> str:
        return f"Ref({self.id!r})"


class Program:
    """An ordered sequence of instructions: upload, get_function, run and the returns."""

    def __init__(self) -> None:
        self._instructions: list[dict[str, Any]] = []
        self._ids: set[str] = set()
        self._return_keys: set[str] = set()
        self._blobs: dict[str, memoryview | bytes] = {}
        self._serial = next(_PROGRAM_SERIALS)

    # --- building ---

    def upload(
        self,
        *,
        id: str | None = None,
        kind: str,
        source: str | None = None,
        value: Any = None,
        dtype: str | None = None,
        shape: list[int] | tuple[int, ...] | None = None,
    ) -> Ref:
        """Supply code or data: ``kind`` is ``module`` (Python ``source``), ``tensor`` (a numpy
        array or torch tensor as ``value``, or raw bytes with ``dtype`` and ``shape``), ``bytes``,
        or ``library`` (a compiled shared library's bytes, loaded with ctypes on the server)."""
        if kind not in UPLOAD_KINDS:
            raise ValueError(f"upload kind must be one of {UPLOAD_KINDS}, got {kind!r}")
        if kind != "tensor" and (dtype is not None or shape is not None):
            raise ValueError(f"dtype= and shape= are only for upload(kind='tensor'), not kind={kind!r}")
        if kind == "module":
            if not isinstance(source, str):
                raise TypeError("upload(kind='module') needs source= as a str of Python code")
            if value is not None:
                raise ValueError("upload(kind='module') takes source=, not value=")
            encoded = source.encode()
            if len(encoded) <= protocol.INLINE_SOURCE_BYTES:
                fields: dict[str, Any] = {"source": source}
            else:
                fields = {"blob": self._add_blob(encoded), "size": len(encoded)}
        elif kind == "tensor":
            if source is not None:
                raise ValueError("upload(kind='tensor') takes value=, not source=")
            fields = {"tensor": self._tensor_spec(value, dtype, shape)}
        else:
            if source is not None:
                raise ValueError(f"upload(kind={kind!r}) takes value=, not source=")
            data = _as_bytes(value, f"upload(kind={kind!r}) value")
            fields = {"blob": self._add_blob(data), "size": len(data)}
        return self._add("upload", id, kind=kind, **fields)

    def upload_file(self, *, id: str | None = None, blob: Any, path: str) -> Ref:
        """Place a file at ``path`` (relative to the working directory). ``blob`` is the file's
        bytes, or a local file given as ``pathlib.Path`` or ``str``. The reference's value is the
        path."""
        dest = check_relative_path(path)
        mode = 0o644
        if isinstance(blob, (str, os.PathLike)):
            local = Path(blob)
            st = protocol.check_regular_file(local)
            data: bytes | memoryview = local.read_bytes()
            mode = stat.S_IMODE(st.st_mode) & 0o755
        else:
            data = _as_bytes(blob, "upload_file blob")
        return self._add("upload_file", id, path=dest, blob=self._add_blob(data), size=len(data), mode=mode)

    def upload_folder(self, folder: str | os.PathLike[str], *, id: str | None = None, path: str) -> Ref:
        """Place a local folder's files under ``path``. Symlinks and special files are refused."""
        dest = check_relative_path(path)
        root = Path(folder)
        if not root.is_dir() or root.is_symlink():
            raise ValueError(f"{root} is not a folder")
        files: list[list[Any]] = []
        for current, dirnames, filenames in os.walk(root, followlinks=False):
            for name in sorted(dirnames):
                if (Path(current) / name).is_symlink():
                    raise ValueError(f"{Path(current) / name} is a symlink; folders may hold only regular files")
            dirnames.sort()
            for name in sorted(filenames):
                local = Path(current) / name
                st = protocol.check_regular_file(local)
                rel = local.relative_to(root).as_posix()
                data = local.read_bytes()
                files.append([rel, self._add_blob(data), stat.S_IMODE(st.st_mode) & 0o755, len(data)])
        return self._add("upload_folder", id, path=dest, files=files)

    def get_function(self, *, id: str | None = None, module: Ref, name: str, cpu_only: bool = False) -> Ref:
        """Select ``name`` from an uploaded module or library. A ``cpu_only`` function runs without
        the GPU lease and may not touch the GPU."""
        self._check_ref(module, "module")
        if module.op != "upload" and module.op != "run":
            raise ValueError(f"get_function module must be an upload or a run result, not {module.op}")
        if not isinstance(name, str) or not name:
            raise ValueError("get_function name must be a non-empty string")
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"get_function name {name!r} is not a (dotted) Python identifier")
        if not isinstance(cpu_only, bool):
            raise TypeError("cpu_only must be a bool")
        return self._add("get_function", id, module=module.id, name=name, cpu_only=cpu_only)

    def run(self, *, id: str | None = None, fn: Ref, args: list[Any] | tuple[Any, ...] | None = None) -> Ref:
        """Call ``fn`` with ``args``: literals or references to earlier values."""
        self._check_ref(fn, "fn")
        if args is None:
            args = []
        if not isinstance(args, (list, tuple)):
            raise TypeError(f"run args must be a list, got {type(args).__name__}")
        encoded = [self._encode_literal(a) for a in args]
        return self._add("run", id, fn=fn.id, args=encoded)

    def return_(self, *, key: str, value: Any) -> None:
        """Return ``value`` (a reference or a literal) as ``result.results[key]``."""
        self._check_key(key)
        self._add("return", None, key=key, value=self._encode_literal(value))

    def return_file(self, *, key: str, path: str) -> None:
        """Return the file at ``path`` (relative to the working directory) as a ``ReturnedFile``."""
        self._check_key(key)
        self._add("return_file", None, key=key, path=check_relative_path(path))

    def return_folder(self, *, key: str, path: str) -> None:
        """Return the folder at ``path`` as a ``ReturnedFolder``."""
        self._check_key(key)
        self._add("return_folder", None, key=key, path=check_relative_path(path))

    # --- inspection ---

    @property
    def instructions(self) -> list[dict[str, Any]]:
        return [dict(i) for i in self._instructions]

    def __len__(self) -> int:
        return len(self._instructions)

    def to_wire(self) -> tuple[dict[str, Any], dict[str, memoryview | bytes]]:
        """The program's body and its blobs by digest."""
        return {"instructions": list(self._instructions)}, dict(self._blobs)

    # --- helpers ---

    def _add(self, op: str, id: str | None, **fields: Any) -> Ref:
        if len(self._instructions) >= protocol.MAX_INSTRUCTIONS:
            raise ValueError(f"a program holds at most {protocol.MAX_INSTRUCTIONS} instructions")
        if id is None:
            id = f"{op}_{len(self._instructions)}"
            while id in self._ids:
                id += "_"
        else:
            try:
                protocol.check_id(id)
            except protocol.WireError as exc:
                raise ValueError(str(exc)) from None
        if id in self._ids:
            raise ValueError(f"duplicate instruction id {id!r}")
        self._ids.add(id)
        self._instructions.append({"op": op, "id": id, **fields})
        return Ref(id, op, id_of(self))

    def _check_ref(self, ref: object, what: str) -> None:
        if not isinstance(ref, Ref):
            raise TypeError(f"{what} must be a reference returned by this Program, got {type(ref).__name__}")
        if ref._program != id_of(self):
            raise ValueError(f"{what} {ref.id!r} is a reference from another Program")
        if ref.id not in self._ids:
            raise ValueError(f"{what} {ref.id!r} refers to no earlier instruction")

    def _check_key(self, key: object) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError("a return key must be a non-empty string")
        if key in self._return_keys:
            raise ValueError(f"duplicate return key {key!r}")
        self._return_keys.add(key)

    def _encode_literal(self, value: Any) -> Any:
        def walk(v: Any, depth: int = 0) -> Any:
            if depth > protocol.MAX_NESTING:
                raise ValueError(f"argument nested deeper than {protocol.MAX_NESTING} levels")
            if isinstance(v, Ref):
                self._check_ref(v, "reference")
                return protocol.RefValue(v.id)
            if isinstance(v, list):
                return [walk(x, depth + 1) for x in v]
            if isinstance(v, tuple):
                return tuple(walk(x, depth + 1) for x in v)
            if isinstance(v, dict):
                return {walk(k, depth + 1): walk(x, depth + 1) for k, x in v.items()}
            return v

        try:
            return protocol.encode_value(walk(value), self._add_blob_sink)
        except protocol.WireError as exc:
            raise TypeError(str(exc)) from None

    def _add_blob_sink(self, data: memoryview | bytes) -> str:
        return self._add_blob(data)

    def _add_blob(self, data: memoryview | bytes) -> str:
        digest = protocol.sha256_hex(data)
        self._blobs.setdefault(digest, data)
        return digest

    def _tensor_spec(self, value: Any, dtype: str | None, shape: Any) -> protocol.TensorSpec:
        if isinstance(value, (bytes, bytearray, memoryview)):
            if dtype is None or shape is None:
                raise ValueError("a tensor given as raw bytes needs dtype= and shape=")
            shape_t = tuple(shape)
            try:
                nbytes = protocol.tensor_nbytes(dtype, shape_t)
            except protocol.WireError as exc:
                raise ValueError(str(exc)) from None
            data = memoryview(value).cast("B")
            if len(data) != nbytes:
                raise ValueError(
                    f"tensor bytes are {len(data)} long but dtype {dtype} and shape {list(shape_t)} need {nbytes}"
                )
            return protocol.TensorSpec(protocol.FRAMEWORK_NUMPY, dtype, shape_t, self._add_blob(data))
        if dtype is not None or shape is not None:
            raise ValueError("dtype= and shape= are only for tensors given as raw bytes")
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if not protocol.is_tensor(value):
            raise TypeError(f"upload(kind='tensor') needs a numpy array or torch tensor, got {type(value).__name__}")
        try:
            framework, dtype_name, shape_t, raw = protocol.tensor_to_wire(value)
        except protocol.WireError as exc:
            raise TypeError(str(exc)) from None
        return protocol.TensorSpec(framework, dtype_name, shape_t, self._add_blob(raw))


def id_of(program: Program) -> int:
    return program._serial


def _as_bytes(value: Any, what: str) -> bytes | memoryview:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return memoryview(value).cast("B")
    raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
