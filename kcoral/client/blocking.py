"""Client: the blocking client, ``with Client(url) as client: client.execute(program)``.

It drives an :class:`~kcoral.client.client.AsyncClient` on a private event loop, so both share one
implementation; what it adds is the caller's side of blocking: a status line on a terminal while it
waits, and Ctrl-C that cancels the program on the service.

The loop runs in the calling thread, only while a call is in progress: handing each call to a loop
on a thread of its own and its answer back cost 0.07 to 0.09 ms of a constant program's round trip
(two threads woken; ``benchmarks/RESULTS.md``, "The blocking Client drives its loop in the caller's
thread"). Calls made from other threads meanwhile join the loop; those still unanswered when the
caller's call is are driven on by a thread of the client's, until none is left. A caller whose
thread already runs an event loop (a notebook's) cannot run another there: such a thread drives
the loop for it.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's own functions, without its enums: see below
import asyncio
import concurrent.futures
import contextlib
import signal
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
CLOSE_SECONDS = 10.0  # the most close() waits for the connection to end and the loop to stop


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
        # Who drives the loop: ``_driving`` while a thread runs it, ``_calls`` the calls not yet
        # answered (see the module's docstring); ``_settled`` wakes the driver as each ends.
        self._state = threading.Condition()
        self._driving = False
        self._calls = 0
        self._settled: asyncio.Event | None = None

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
        self._loop = _new_loop()
        self._settled = asyncio.Event()  # bound to the loop when first awaited there
        try:
            self._call(self._async.open())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection; idempotent."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(Exception):
            self._call(asyncio.wait_for(self._async.aclose(), CLOSE_SECONDS))
        with self._state:
            driven_still = not self._state.wait_for(lambda: not self._driving, CLOSE_SECONDS)
        if not driven_still:  # a loop still running (a call that would not end) is left to its thread
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
        loop = self._loop
        if loop is None:
            coroutine.close()
            raise RuntimeError("the client is not open: use it as a context manager")
        in_a_loop = _loop_runs_here()
        with self._state:
            self._calls += 1
            lead = not self._driving
            self._driving = True
        if lead and not in_a_loop:
            return self._drive(loop, self._counted(coroutine, [1]), tick)
        # A joined call is counted out once its coroutine has ended (a cancelled one has told the
        # service) and its answer is in its future: the future is set by a callback of the loop's
        # next iteration, and a loop stopped in between (its driver's own call answered) would
        # leave it unset, with no call left to drive the loop on; a future cancelled by its caller
        # is done before its coroutine has ended.
        parts = [2]
        future = asyncio.run_coroutine_threadsafe(self._counted(coroutine, parts), loop)
        future.add_done_callback(lambda _: self._settle(parts, loop))
        if lead:  # this thread runs an event loop of its own: a thread of ours drives this one
            self._drive_on_a_thread(loop)
        return self._wait(future, tick)

    async def _counted(self, coroutine: Coroutine[Any, Any, T], parts: list[int]) -> T:
        try:
            return await coroutine
        finally:
            self._settle(parts, None)

    def _settle(self, parts: list[int], loop: asyncio.AbstractEventLoop | None) -> None:
        """One part of a call is over (``parts``: how many are left, of _call's); once all are, the
        call is counted out and the loop's driver told. ``loop``: told from outside the loop's
        callbacks (a future's done callback runs in its caller's thread where it cancels it)."""
        with self._state:
            parts[0] -= 1
            if parts[0] > 0:
                return
            self._calls -= 1
        settled = self._settled
        assert settled is not None
        if loop is None:
            settled.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits on it
            loop.call_soon_threadsafe(settled.set)

    def _drive(
        self, loop: asyncio.AbstractEventLoop, call: Coroutine[Any, Any, T], tick: Callable[[], None] | None
    ) -> T:
        """Run the loop in this thread until this call is answered; calls joined meanwhile and not
        yet answered go on, on a thread of ours."""
        task = loop.create_task(call)
        interrupted = False

        def on_interrupt(signum: int, frame: Any) -> None:
            # Ctrl-C: the call is cancelled, which sends CANCEL for a program in flight, and
            # KeyboardInterrupt is raised once it has; a second Ctrl-C raises it at once.
            nonlocal interrupted
            if interrupted:
                raise KeyboardInterrupt
            interrupted = True
            loop.call_soon_threadsafe(task.cancel)

        previous = _take_interrupts(on_interrupt)
        try:
            # The task itself where nothing ticks: a task around it cost 0.06 ms a call (VM).
            loop.run_until_complete(task if tick is None else _until_done(task, tick))
        except BaseException:
            if not task.done():  # a second Ctrl-C, or anything else out of the loop: as above, bounded
                task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(asyncio.wait([task], timeout=INTERRUPT_WAIT_SECONDS))
                raise
            # else the call's own exception (or its cancellation, by Ctrl-C): task.result() below
        finally:
            if previous is not None:
                _signal.signal(SIGINT, previous)
            self._hand_over(loop)
        if interrupted:
            raise KeyboardInterrupt
        return task.result()

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """After driving: the calls still unanswered (other threads') to a thread of ours."""
        with self._state:
            self._driving = self._calls > 0
            self._state.notify_all()
            if not self._driving:
                return
        self._drive_on_a_thread(loop)

    def _drive_on_a_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        thread = threading.Thread(target=self._drive_until_settled, args=(loop,), name="kcoral-client", daemon=True)
        thread.start()

    def _drive_until_settled(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the loop until no call is left; then it is nobody's to drive."""
        while True:
            loop.run_until_complete(self._until_settled())
            with self._state:  # a call may have joined as the loop stopped: drive it too
                if self._calls == 0:
                    self._driving = False
                    self._state.notify_all()
                    return

    async def _until_settled(self) -> None:
        settled = self._settled
        assert settled is not None
        while True:
            settled.clear()  # before the count is read: a call that ends after it sets it again
            with self._state:
                if self._calls == 0:
                    return
            await settled.wait()

    def _wait(self, future: concurrent.futures.Future[T], tick: Callable[[], None] | None) -> T:
        """The answer of a call another thread drives."""
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
            # As in _drive: the program in flight is cancelled on the service before this returns.
            future.cancel()
            with contextlib.suppress(BaseException):
                concurrent.futures.wait([future], INTERRUPT_WAIT_SECONDS)
            raise


async def _until_done(task: asyncio.Task[Any], tick: Callable[[], None]) -> None:
    """Wait for ``task``; ``tick`` every PROGRESS_TICK_SECONDS meanwhile."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=PROGRESS_TICK_SECONDS)
        if not done:
            tick()


# Ctrl-C's handler is swapped twice a call: through ``_signal``, which ``signal`` wraps to turn
# its ints into enums (0.013 ms a call on the 2-core VM, most of it a ValueError caught there).
SIGINT = int(signal.SIGINT)


def _take_interrupts(handler: Callable[[int, Any], None]) -> Any:
    """Ctrl-C to ``handler`` while this thread drives the loop, where it would raise
    KeyboardInterrupt (the main thread, Python's own handler); the handler it replaces, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if _signal.getsignal(SIGINT) is not signal.default_int_handler:
        return None
    return _signal.signal(SIGINT, handler)


def _loop_runs_here() -> bool:
    """Whether this thread runs an event loop now (a notebook's, an async program's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _new_loop() -> asyncio.AbstractEventLoop:
    """The client's own event loop: asyncio's, not uvloop's. The caller's thread runs it for each
    call, and uvloop makes and closes a socket pair for signals each time the main thread runs it:
    with asyncio's, a constant program's round trip against a server that answers at once took
    0.21 against 0.26 ms of the client's CPU (2-core VM, Python 3.11; ``benchmarks/RESULTS.md``,
    "The blocking `Client`'s own time"). No other code runs on it."""
    return asyncio.new_event_loop()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


__all__ = ["Client"]
