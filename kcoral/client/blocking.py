"""Client: the blocking client, ``with Client(url) as client: client.execute(program)``.

It drives an :class:`~kcoral.client.client.AsyncClient` on a private event loop in a background
thread, so both share one implementation; what it adds is the caller's side of blocking: a status
line on a terminal while it waits, and Ctrl-C that cancels the program on the service.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kcoral.client.client import INTERRUPT_WAIT_SECONDS, AsyncClient
from kcoral.client.program import Program
from kcoral.client.progress import TerminalProgress
from kcoral.client.result import ProgramResult
from kcoral.keys import ClientKeys

T = TypeVar("T")
PROGRESS_TICK_SECONDS = 0.5  # how often a progress line on a terminal redraws its clock


class Client:
    """A blocking client: ``with Client(url) as client: client.execute(program)``.

    ``progress``: draw a status line on stderr while ``execute`` waits (uploading, queued, running),
    wiped when it returns. ``None`` (the default): only when stderr is a terminal.
    ``show_output``: write the program's stdout and stderr here as it runs (where the service streams
    them); ``output_shown`` then counts the characters of each written during the last ``execute``,
    so the rest can be written from the result (the command-line adapters do this).
    ``session``: run this client's consecutive programs in one worker (see AsyncClient)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        connect_timeout_seconds: float = 10.0,
        progress: bool | None = None,
        show_output: bool = False,
        keys: ClientKeys | None = None,
        session: bool = False,
    ) -> None:
        self._async = AsyncClient(url, connect_timeout_seconds=connect_timeout_seconds, keys=keys, session=session)
        self.progress = progress
        self.show_output = show_output
        self.output_shown = {"stdout": 0, "stderr": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def blob_bytes_sent(self) -> int:
        return self._async.blob_bytes_sent

    def __enter__(self) -> Client:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if self._loop is not None:
            return
        loop = _new_loop()
        thread = threading.Thread(target=loop.run_forever, name="kcoral-client", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._async.open())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection; idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._async.aclose(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = None

    def execute(
        self,
        program: Program,
        *,
        timeout_seconds: float | None = None,
        gpu_count: int | None = None,
        output_limit_bytes: int | None = None,
    ) -> ProgramResult:
        """Run ``program`` and return its result. Raises KCoralError when it cannot run."""
        show_status = bool(self.progress or (self.progress is None and _is_terminal(sys.stderr)))
        display = None
        if show_status or self.show_output:
            display = TerminalProgress(
                sys.stderr, out=sys.stdout, show_status=show_status, show_output=self.show_output
            )
        try:
            return self._call(
                self._async.execute(
                    program,
                    timeout_seconds=timeout_seconds,
                    gpu_count=gpu_count,
                    output_limit_bytes=output_limit_bytes,
                    on_progress=display,
                ),
                tick=display.tick if display is not None and show_status else None,
            )
        finally:
            if display is not None:
                display.close()
                self.output_shown = dict(display.shown)

    def health(self) -> dict[str, Any]:
        return self._call(self._async.health())

    def target(self) -> dict[str, Any]:
        return self._call(self._async.target())

    def _call(self, coroutine: Coroutine[Any, Any, T], *, tick: Callable[[], None] | None = None) -> T:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the client is not open: use it as a context manager")
        finished = threading.Event()

        async def call() -> T:
            try:
                return await coroutine
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        try:
            while tick is not None and not future.done():
                try:
                    return future.result(PROGRESS_TICK_SECONDS)
                except concurrent.futures.TimeoutError:
                    if future.done():
                        break  # the call itself raised TimeoutError: re-raised below
                    tick()
            return future.result()
        except KeyboardInterrupt:
            # Cancelling the call sends CANCEL for a program in flight; wait (briefly) until it
            # has, so that a script that exits on Ctrl-C does not leave its program running.
            future.cancel()
            finished.wait(INTERRUPT_WAIT_SECONDS)
            raise


def _new_loop() -> asyncio.AbstractEventLoop:
    """The client's own event loop, on its own thread: uvloop's where it is installed (it hands a
    call from the caller's thread to the loop's, and a reply back, in less time than asyncio's:
    ``benchmarks/RESULTS.md``, "The loop's own sockets"), else asyncio's. No other code runs on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


__all__ = ["Client"]
