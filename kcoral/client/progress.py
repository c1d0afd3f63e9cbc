"""What a program is doing while a client waits for it, and a one-line display of that on a terminal.

``AsyncClient.execute(..., on_progress=callback)`` calls ``callback(ProgressEvent)`` as the service
answers: ``uploading`` (the blobs the service lacks, their bytes), ``queued`` (with the position
when the service tells it), ``running`` (on which GPUs, and which instruction when known), and
``output`` (a piece of the program's stdout or stderr while it runs, where the service streams it).
``Client`` and the adapters draw them with :class:`TerminalProgress` when stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from kcoral.units import format_bytes


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a program on its way through the service."""

    state: str  # "uploading", "uploaded", "queued", "running" or "output"
    request_id: str
    blobs: int = 0  # uploading: how many blobs the service asked for
    bytes_total: int = 0  # uploading: their bytes
    position: int | None = None  # queued: programs ahead of this one, where the service says
    gpu_ids: tuple[int, ...] = ()  # running
    instruction_index: int | None = None  # running: the instruction now executing, where known
    node: str | None = None  # through a router: the node that runs it
    stream: str = ""  # output: "stdout" or "stderr"
    offset: int = 0  # output: characters of that stream sent before this piece
    text: str = ""  # output: the piece of output


ProgressCallback = Callable[[ProgressEvent], None]


def report(on_progress: ProgressCallback, event: ProgressEvent) -> None:
    """Call ``on_progress``; a display that fails must not fail the program it displays."""
    with contextlib.suppress(Exception):
        on_progress(event)


class TerminalProgress:
    """A status line on ``stream`` (a terminal), redrawn in place and wiped when the program ends:
    ``kcoral: uploading 1.0 GiB (3 blobs) 2.1 s``, ``kcoral: queued (4 ahead) 0.3 s``,
    ``kcoral: running on GPU 0 5.2 s``. With ``show_output``, the program's output is written as it
    comes (stdout to ``out``), the status line moved out of its way; ``shown`` counts the characters
    of each stream written, so the rest can be written from the result. A piece that does not follow
    the last one (one was lost) ends the live display of that stream. Safe to call from two threads
    (the client's loop delivers events, the waiting thread ticks the clock)."""

    def __init__(
        self,
        stream: TextIO,
        *,
        out: TextIO | None = None,
        label: str = "kcoral",
        show_status: bool = True,
        show_output: bool = False,
    ) -> None:
        self.stream = stream
        self.out = out if out is not None else stream
        self.label = label
        self.show_status = show_status
        self.show_output = show_output
        self.shown = {"stdout": 0, "stderr": 0}
        self._gaps: set[str] = set()
        self._lock = threading.Lock()
        self._line = ""
        self._since = time.monotonic()
        self._shown = False
        self._uploaded: tuple[int, float] | None = None

    def __call__(self, event: ProgressEvent) -> None:
        with self._lock:
            if event.state == "output":
                self._write_output(event)
                return
            now = time.monotonic()
            if event.state == "uploading":
                self._line = f"uploading {format_bytes(event.bytes_total)} ({event.blobs} blob{_s(event.blobs)})"
                self._uploaded = (event.bytes_total, now)
            elif event.state == "queued":
                self._line = "queued" + (f" ({event.position} ahead)" if event.position else "")
                self._line = self._upload_rate(now) + self._line
            elif event.state == "running":
                where = f" on GPU{_s(len(event.gpu_ids))} {','.join(map(str, event.gpu_ids))}" if event.gpu_ids else ""
                node = f" at {event.node}" if event.node else ""
                step = f", instruction {event.instruction_index}" if event.instruction_index is not None else ""
                self._line = f"running{where}{node}{step}"
            else:
                return
            self._since = now
            self._draw()

    def tick(self) -> None:
        """Redraw with the time spent in the current state."""
        with self._lock:
            self._draw()

    def close(self) -> None:
        """Wipe the line, leaving the terminal as it was."""
        with self._lock:
            self._wipe()
            self._line = ""

    def _write_output(self, event: ProgressEvent) -> None:
        if not self.show_output or event.stream not in self.shown or event.stream in self._gaps:
            return
        if event.offset != self.shown[event.stream]:
            self._gaps.add(event.stream)
            return
        self._wipe()
        target = self.out if event.stream == "stdout" else self.stream
        target.write(event.text)
        target.flush()
        self.shown[event.stream] += len(event.text)
        self._draw()

    def _upload_rate(self, now: float) -> str:
        if self._uploaded is None:
            return ""
        size, started = self._uploaded
        self._uploaded = None
        seconds = max(now - started, 1e-6)
        return f"uploaded {format_bytes(size)} in {seconds:.1f} s ({format_bytes(size / seconds)}/s); "

    def _draw(self) -> None:
        if not self._line or not self.show_status:
            return
        elapsed = time.monotonic() - self._since
        self.stream.write(f"\r{self.label}: {self._line} {elapsed:.1f} s\x1b[K")
        self.stream.flush()
        self._shown = True

    def _wipe(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def _s(count: int) -> str:
    return "" if count == 1 else "s"


__all__ = ["ProgressCallback", "ProgressEvent", "TerminalProgress", "report"]
