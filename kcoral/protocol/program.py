"""A program as the service receives it: the EXECUTE body, its run options, its blob digests, the
shape of its instruction list (checked by the worker before anything runs), and the rule for the
paths it names.

The client checks options and paths with the same code (``parse_options``, ``check_relative_path``)
before it sends them, and the worker checks them again before it places or returns a file.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

from kcoral.protocol.codec import RefValue, decode_value
from kcoral.protocol.frames import (
    DEFAULT_OUTPUT_LIMIT_BYTES,
    DEFAULT_TIMEOUT_SECONDS,
    MAX_GPU_COUNT,
    MAX_INSTRUCTIONS,
    MAX_OUTPUT_LIMIT_BYTES,
    MAX_TIMEOUT_SECONDS,
    WireError,
    check_digest,
    check_id,
)
from kcoral.protocol.tensors import TensorSpec


@dataclass(frozen=True)
class ExecuteOptions:
    """A program's run options, checked the same way by the client and the broker."""

    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    gpu_count: int | None = None
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES
    # Run in this client's session: its consecutive programs share one worker (and its CUDA
    # context), never another client's; see the broker's kcoral.broker.sessions.
    session: bool = False

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "timeout_seconds": self.timeout_seconds,
            "output_limit_bytes": self.output_limit_bytes,
        }
        if self.gpu_count is not None:
            body["gpu_count"] = self.gpu_count
        if self.session:
            body["session"] = True
        return body


def parse_options(raw: Any) -> ExecuteOptions:
    """Check a map of options (from a caller or the wire); raises WireError with the reason."""
    if raw is None:
        return ExecuteOptions()
    if not isinstance(raw, dict):
        raise WireError("options must be a map")
    unknown = set(raw) - {"timeout_seconds", "gpu_count", "output_limit_bytes", "session"}
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
    session = raw.get("session", False)
    if not isinstance(session, bool):
        raise WireError("session must be true or false")
    return ExecuteOptions(float(timeout), gpu_count, limit, session)


def parse_execute(body: dict[str, Any]) -> tuple[dict[str, Any], ExecuteOptions, list[str]]:
    """The program, its options and its blob digests from an EXECUTE body; WireError if bad."""
    program = body.get("program")
    if not isinstance(program, dict):
        raise WireError("EXECUTE needs a program map")
    return program, parse_options(body.get("options")), program_digests(program)


@dataclass(frozen=True)
class BlobPiece:
    """Where a BLOBS that carries one piece of a blob puts it: at ``offset`` of ``size`` bytes."""

    offset: int
    size: int


def blob_piece(body: dict[str, Any], frames: int) -> BlobPiece | None:
    """The piece a BLOBS body announces (``offset`` and ``size``), or None for whole blobs;
    raises WireError for a bad one. A piece is the one data frame of its message."""
    if "offset" not in body and "size" not in body:
        return None
    offset, size = body.get("offset"), body.get("size")
    for name, value in (("offset", offset), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"a BLOBS piece needs an integer {name}")
    assert isinstance(offset, int) and isinstance(size, int)
    if frames != 1:
        raise WireError(f"a BLOBS piece carries one frame, not {frames}")
    if not 0 <= offset < size:
        raise WireError(f"a piece's offset {offset} is not within the blob's {size} bytes")
    return BlobPiece(offset, size)


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


# --- instructions -----------------------------------------------------------------------------

OPS: Final = ("upload", "upload_file", "upload_folder", "get_function", "run", "return", "return_file", "return_folder")


class ProgramError(WireError):
    """Raised when a program's instruction list is malformed; ``index`` is the bad instruction's
    (None when the list itself is bad). The worker reports it as a ``parse`` error there."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def check_instructions(instructions: Any) -> list[dict[str, Any]]:
    """Validate a program's instruction list before anything runs; ProgramError names the first
    bad instruction."""
    if not isinstance(instructions, list):
        raise ProgramError("program.instructions must be a list")
    if len(instructions) > MAX_INSTRUCTIONS:
        raise ProgramError(f"more than {MAX_INSTRUCTIONS} instructions")
    seen: set[str] = set()
    keys: set[str] = set()
    for index, ins in enumerate(instructions):
        try:
            _check_instruction(index, ins, seen, keys)
        except WireError as exc:
            raise ProgramError(str(exc), index) from exc
    return instructions


def _check_instruction(index: int, ins: Any, seen: set[str], keys: set[str]) -> None:
    where = f"instruction {index}"
    if not isinstance(ins, dict):
        raise WireError(f"{where} is not a map")
    op = ins.get("op")
    if op not in OPS:
        raise WireError(f"{where}: unknown op {op!r}")
    ident = check_id(ins.get("id"), f"{where} id")
    for name in ("module", "fn"):
        if name in ins:
            ref = check_id(ins[name], f"{where} {name}")
            if ref not in seen:
                raise WireError(f"{where}: {name} {ref!r} names no earlier instruction")
    for name in ("path",):
        if name in ins or op in ("upload_file", "upload_folder", "return_file", "return_folder"):
            check_relative_path(ins.get(name))
    if op in ("upload_file", "upload_folder", "upload") and "blob" in ins:
        check_digest(ins["blob"])
    if op == "upload_folder":
        files = ins.get("files")
        if not isinstance(files, list):
            raise WireError(f"{where}: upload_folder without a files list")
        for entry in files:
            if not isinstance(entry, list) or len(entry) < 3:
                raise WireError(f"{where}: bad folder entry")
            check_relative_path(entry[0])
            check_digest(entry[1])
    if op in ("return", "return_file", "return_folder"):
        key = ins.get("key")
        if not isinstance(key, str) or not key or key in keys:
            raise WireError(f"{where}: missing or duplicate return key {key!r}")
        keys.add(key)
    for ref in _references(ins.get("args", [])) + _references(ins.get("value")):
        if ref not in seen:
            raise WireError(f"{where}: reference {ref!r} names no earlier instruction")
    if ident in seen:
        raise WireError(f"{where}: duplicate id {ident!r}")
    if op == "run" and not isinstance(ins.get("args", []), (list, tuple)):
        raise WireError(f"{where}: run args must be a list")
    seen.add(ident)


def _references(tree: Any) -> list[str]:
    found: list[str] = []

    def convert(obj: Any) -> Any:
        if isinstance(obj, RefValue):
            found.append(obj.id)
        return obj

    decode_value(tree, convert)
    return found


# --- paths ------------------------------------------------------------------------------------


def check_relative_path(path: object, what: str = "path") -> str:
    """A path relative to the execution's working directory, normalised: no absolute paths, no
    ``..``, not the directory itself; WireError (a ValueError) says which rule it broke."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise WireError(f"{what} must be a non-empty string, got {path!r}")
    posix = PurePosixPath(path)
    if posix.is_absolute():
        raise WireError(f"{what} {path!r} is absolute; give a path relative to the working directory")
    parts = [p for p in posix.parts if p != "."]
    if ".." in parts:
        raise WireError(f"{what} {path!r} contains '..'")
    if not parts:
        raise WireError(f"{what} {path!r} names the working directory itself")
    return "/".join(parts)


def check_regular_file(path: Path) -> os.stat_result:
    """The ``lstat`` of a file that may travel: a regular file, not a symlink (it could point
    anywhere) nor a special file; WireError otherwise."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise WireError(f"{path} is not a regular file (symlinks and special files are refused)")
    return st
