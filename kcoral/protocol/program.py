"""A program as the service receives it: the EXECUTE body, its run options, its blob digests, and
the rule for the paths it names.

The client checks options and paths with the same code (``parse_options``, ``check_relative_path``)
before it sends them, and the worker checks them again before it places or returns a file.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kcoral.protocol.codec import decode_value
from kcoral.protocol.frames import (
    DEFAULT_OUTPUT_LIMIT_BYTES,
    DEFAULT_TIMEOUT_SECONDS,
    MAX_GPU_COUNT,
    MAX_INSTRUCTIONS,
    MAX_OUTPUT_LIMIT_BYTES,
    MAX_TIMEOUT_SECONDS,
    WireError,
    check_digest,
)
from kcoral.protocol.tensors import TensorSpec


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
