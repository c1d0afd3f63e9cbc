"""Capture a program's stdout and stderr at the file-descriptor level.

Redirecting fds 1 and 2 (not ``sys.stdout``) catches ``os.write(1, ...)``, C extensions and child
processes too. Output goes to files, so a program that prints gigabytes fills a file (bounded by the
worker's file-size limit), not the worker's memory; only the first ``limit`` bytes are read back.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kcoral import protocol

# How often a running program's new output is sent on (a client shows it live). With at most
# protocol.OUTPUT_PIECE_BYTES per stream each time: 512 KiB/s per worker at most, and never more
# than the output limit in all.
FOLLOW_INTERVAL_SECONDS = 0.25
OUTPUT_FILES = ("stdout", "stderr")  # in the run directory's ``output``: fds 1 and 2, in this order
OUTPUT_FILE_MODE = 0o600
READ_PIECE_BYTES = 1 << 20  # the output read back a piece at a time: no buffer of the whole limit up front


def prepare_output_files(directory: Path) -> None:
    """Make the empty output files in ``directory`` ahead of the program that will write them (the
    zygote, for its next worker's run directory): creating two files on the program's path cost a
    fresh worker 0.18 ms of its constant program on the 2-core VM (ext4), opening them once made
    0.01 ms (``benchmarks/RESULTS.md``, "A fresh worker's program path trimmed"). The capture
    truncates them as it opens them, and makes any that are missing, so a failure here costs only
    that."""
    for name in OUTPUT_FILES:
        with contextlib.suppress(OSError):
            os.close(os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, OUTPUT_FILE_MODE))


@dataclass(frozen=True)
class CapturedOutput:
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool


class OutputCapture:
    """While active, fds 1 and 2 write to files under ``directory``; afterwards to /dev/null.

    Before, a worker's fds 1 and 2 lead to the broker's log, where its stray output goes. No copy
    of them is kept while the program runs: the program may write to any descriptor its process
    holds, and with one it forged lines of the broker's log and filled its disk (20 MiB in 0.1 s,
    inside bubblewrap too). So what a worker writes after a program goes nowhere; the broker still
    logs how each worker ended.
    """

    def __init__(self, directory: Path, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self._paths = (directory / OUTPUT_FILES[0], directory / OUTPUT_FILES[1])

    def __enter__(self) -> OutputCapture:
        if not self.directory.is_dir():  # a worker's run directory has it made: no mkdir that fails
            self.directory.mkdir(parents=True, exist_ok=True)
        _flush_python_streams()
        for fd, path in zip((1, 2), self._paths):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, OUTPUT_FILE_MODE)
            os.dup2(target, fd)
            os.close(target)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _flush_python_streams()
        nowhere = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(nowhere, fd)
        os.close(nowhere)

    def read(self) -> CapturedOutput:
        out, out_cut = self._read(self._paths[0])
        err, err_cut = self._read(self._paths[1])
        return CapturedOutput(out, err, out_cut, err_cut)

    def _read(self, path: Path) -> tuple[str, bool]:
        # A descriptor and its reads, not a file object: on every program's path, and cold there in
        # a fresh worker.
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "", False
        pieces: list[bytes] = []
        left = self.limit + 1
        try:
            while left > 0 and (piece := os.read(descriptor, min(left, READ_PIECE_BYTES))):
                pieces.append(piece)
                left -= len(piece)
        finally:
            os.close(descriptor)
        data = b"".join(pieces)
        truncated = len(data) > self.limit
        return data[: self.limit].decode("utf-8", errors="replace"), truncated


class OutputFollower:
    """A thread that sends what the program wrote to stdout and stderr since the last look:
    ``send(stream, offset, text)``, where ``offset`` counts the characters of that stream sent
    before. It stops at the capture's limit; the program's result still carries the whole output,
    so a piece lost on the way costs only its live display.

    One thread serves every program of its worker (``following(capture, send)`` while each runs),
    started with ``start()`` before the first: a worker's own thread, there before any program (so
    neither the leftover-thread check nor ``benchmark()`` takes it for the program's). Starting and
    joining a thread per program cost 0.3 ms of a session's constant program on the quiet 2-core VM
    and 2 ms under load. It looks every FOLLOW_INTERVAL_SECONDS, attached or not, rather than being
    woken when a program is attached: woken then, it wanted the interpreter's lock on the program's
    own path, at its start (with it, arming the timer and entering the capture took 0.36 ms of a
    fresh worker on the 2-core VM at the p50, 0.30 ms without, in a run otherwise 15% slower).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while a piece is read and sent, and to detach
        self._job: _FollowJob | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="kcoral-output", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def following(self, capture: OutputCapture, send: Callable[[str, int, str], None]) -> Iterator[None]:
        """Follow ``capture`` while the block runs; nothing of it is sent once the block is left."""
        self.start()
        job = _FollowJob(capture, send)
        with self._lock:
            self._job = job
        try:
            yield
        finally:
            with self._lock:  # a piece being sent goes out first; none after this
                self._job = None
            job.close()

    def _follow(self) -> None:
        while True:
            time.sleep(FOLLOW_INTERVAL_SECONDS)
            with self._lock:
                job = self._job
                if job is None:
                    continue
                try:
                    job.look()
                except Exception:  # the live display is a convenience: never let it disturb the program
                    self._job = None


def rehearse_following(capture: OutputCapture) -> None:
    """Make and close the follow job of ``capture`` as a program's run does, without attaching
    it to a follower: no file is opened (a followed file is opened at the follower's first look)
    and no thread is woken. For a spare's rehearsal (:mod:`kcoral.worker.rehearsal`): the pages
    this writes in a fresh worker are then copied before its program, not on its path (0.1 ms of
    a constant program on the 2-core VM, ``benchmarks/RESULTS.md``, "A fresh worker's program
    path trimmed")."""
    _FollowJob(capture, _send_nothing).close()


def rehearse_capture(limit: int) -> None:
    """The steps of a capture that change nothing, as a program's run takes them, on ``/dev/null``
    (no descriptor is redirected, no file of the workspace is opened): Python's streams flushed,
    the output's directory looked at, an output read back. For a spare's rehearsal, as
    :func:`rehearse_following`."""
    capture = OutputCapture(Path(os.devnull), limit)
    _flush_python_streams()
    capture.directory.is_dir()
    capture._read(capture.directory)


def _send_nothing(stream: str, offset: int, text: str) -> None:
    pass


class _FollowJob:
    """One program's two followed streams."""

    def __init__(self, capture: OutputCapture, send: Callable[[str, int, str], None]) -> None:
        self.capture = capture
        self.send = send
        self.streams = [_FollowedFile("stdout", capture._paths[0]), _FollowedFile("stderr", capture._paths[1])]

    def look(self) -> None:
        for followed in self.streams:
            piece = followed.next_piece(self.capture.limit)
            if piece:
                self.send(followed.name, followed.sent_chars, piece)
                followed.sent_chars += len(piece)

    def close(self) -> None:
        for followed in self.streams:
            followed.close()


class _FollowedFile:
    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.fd: int | None = None
        self.offset = 0
        self.sent_chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next_piece(self, limit: int) -> str:
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return ""
        size = min(protocol.OUTPUT_PIECE_BYTES, limit - self.offset)
        if size <= 0:
            return ""
        data = os.pread(self.fd, size, self.offset)
        self.offset += len(data)
        return self.decoder.decode(data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
