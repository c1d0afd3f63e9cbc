"""Capture a program's stdout and stderr at the file-descriptor level.

Redirecting fds 1 and 2 (not ``sys.stdout``) catches ``os.write(1, ...)``, C extensions and child
processes too. Output goes to files, so a program that prints gigabytes fills a file (bounded by the
worker's file-size limit), not the worker's memory; only the first ``limit`` bytes are read back.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


@dataclass(frozen=True)
class CapturedOutput:
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool


class OutputCapture:
    """While active, fds 1 and 2 write to files under ``directory``."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self._saved: list[int] = []
        self._paths = (directory / "stdout", directory / "stderr")

    def __enter__(self) -> OutputCapture:
        self.directory.mkdir(parents=True, exist_ok=True)
        _flush_python_streams()
        for fd, path in zip((1, 2), self._paths):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            self._saved.append(os.dup(fd))
            os.dup2(target, fd)
            os.close(target)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _flush_python_streams()
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._saved.clear()

    def read(self) -> CapturedOutput:
        out, out_cut = self._read(self._paths[0])
        err, err_cut = self._read(self._paths[1])
        return CapturedOutput(out, err, out_cut, err_cut)

    def _read(self, path: Path) -> tuple[str, bool]:
        try:
            with open(path, "rb") as handle:
                data = handle.read(self.limit + 1)
        except FileNotFoundError:
            return "", False
        truncated = len(data) > self.limit
        return data[: self.limit].decode("utf-8", errors="replace"), truncated


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
