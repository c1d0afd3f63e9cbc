"""Client and AsyncClient: submit programs to a KCoral broker or router over ZeroMQ.

Example::

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        result = await client.execute(program)

``Client`` is the same with blocking calls; it drives an ``AsyncClient`` on a private event loop in
a background thread, so both share one implementation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import zmq
import zmq.asyncio
import zmq.utils.monitor

from kcoral import protocol
from kcoral.client.program import Program
from kcoral.client.progress import ProgressCallback, ProgressEvent, TerminalProgress
from kcoral.client.reach import Unresolvable, check_resolves, silence_reason
from kcoral.client.result import ProgramResult, ReturnedFile, ReturnedFolder
from kcoral.errors import KCoralError, ProtocolError, TransportError
from kcoral.keys import ClientKeys

T = TypeVar("T")
URL_SCHEMES = ("tcp://", "ipc://", "inproc://")
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
RECEIVE_HIGH_WATER_MARK = 10_000
SEND_HIGH_WATER_MARK = 10_000
# A client closed with programs in flight (Ctrl-C, an exception in a `with` block) cancels them on
# the service, so nobody's GPU stays held for a program no one waits for. The CANCEL is only queued
# inside libzmq when close() runs; this long a linger lets it reach the wire (on loopback it takes
# well under a millisecond; the bound only matters when the service is gone).
CANCEL_LINGER_MS = 2000
# How long Client waits, after Ctrl-C, for its cancelled call to send its CANCEL before re-raising.
INTERRUPT_WAIT_SECONDS = 2.0
PROGRESS_TICK_SECONDS = 0.5  # how often a progress line on a terminal redraws its clock


class ClientState(enum.Enum):
    UNOPENED = 1
    OPENED = 2
    CLOSED = 3


def resolve_url(url: str | None) -> str:
    if url is None:
        url = os.environ.get("KCORAL_URL")
        if not url:
            raise ValueError("no service URL: pass one, or set KCORAL_URL (e.g. tcp://127.0.0.1:5555)")
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise ValueError(f"bad service URL {url!r}: expected tcp://host:port or ipc://path")
    return url


@contextlib.contextmanager
def map_zmq_errors(request_id: str | None = None) -> Iterator[None]:
    """Translate pyzmq's errors into KCoral's own."""
    try:
        yield
    except zmq.ZMQError as exc:
        raise TransportError(f"zmq: {exc}", request_id=request_id) from exc


def check_execute_options(
    timeout_seconds: float | None, gpu_count: int | None, output_limit_bytes: int | None
) -> dict[str, Any]:
    raw = {"timeout_seconds": timeout_seconds, "gpu_count": gpu_count, "output_limit_bytes": output_limit_bytes}
    try:
        return protocol.parse_options(raw).to_wire()
    except protocol.WireError as exc:
        raise ValueError(str(exc)) from None


class AsyncClient:
    """An asyncio client; many programs may be in flight over its one connection.

    ``keys`` (:class:`kcoral.keys.ClientKeys`) make the connection CurveZMQ: encrypted, the
    server checked against its public key, and this client known to it by its own key.
    """

    def __init__(
        self, url: str | None = None, *, connect_timeout_seconds: float = 10.0, keys: ClientKeys | None = None
    ) -> None:
        self.url = resolve_url(url)
        self.keys = keys
        if connect_timeout_seconds <= 0:
            raise ValueError("connect_timeout_seconds must be > 0")
        self.connect_timeout_seconds = connect_timeout_seconds
        self._state = ClientState.UNOPENED
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Queue[tuple[bytes, dict[str, Any], list[Any]]]] = {}
        self._executing: set[str] = set()  # EXECUTEs sent and not yet answered by a FINAL
        self._cancels_sent = 0
        self._last_heard = time.monotonic()
        self._send_lock = asyncio.Lock()
        # Counters that show what crossed the wire (tests and benchmarks read them).
        self.blob_bytes_sent = 0
        self.blobs_sent = 0

    # --- lifecycle ---

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._state is ClientState.OPENED:
            return
        if self._state is ClientState.CLOSED:
            raise RuntimeError("this client was closed; make a new one")
        try:
            await check_resolves(self.url)
        except Unresolvable as exc:
            self._state = ClientState.CLOSED
            raise TransportError(str(exc)) from None
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        socket.setsockopt(zmq.IDENTITY, f"c-{uuid.uuid4().hex}".encode())
        if self.keys is not None:
            self.keys.apply(socket)
        self._socket = socket
        try:
            with map_zmq_errors():
                socket.connect(self.url)
        except TransportError:
            await self.aclose()
            raise
        self._state = ClientState.OPENED
        self._reader = asyncio.create_task(self._read_loop())
        try:
            await asyncio.wait_for(self._first_health(), self.connect_timeout_seconds)
        except (TimeoutError, TransportError) as exc:
            await self.aclose()
            reason = await silence_reason(self.url, self.connect_timeout_seconds)
            raise TransportError(reason) from exc
        except BaseException:
            await self.aclose()
            raise

    async def _first_health(self) -> dict[str, Any]:
        """health(); with CURVE keys, a handshake the service refuses ends it at once with
        ``unauthorized`` rather than after the connect timeout (libzmq would retry for ever)."""
        if self.keys is None or self._socket is None:
            return await self.health()
        monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILURES)
        health = asyncio.ensure_future(self.health())
        refused = asyncio.ensure_future(monitor.recv_multipart())
        try:
            done, _ = await asyncio.wait({health, refused}, return_when=asyncio.FIRST_COMPLETED)
            if health in done:
                return health.result()
            event = zmq.utils.monitor.parse_monitor_message(refused.result())["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                message = f"{self.url} refused this client's key (not among its authorized keys)"
            else:
                message = f"the CurveZMQ handshake with {self.url} failed: is the server key the service's?"
            raise KCoralError("unauthorized", message)
        finally:
            for future in (health, refused):
                future.cancel()
            self._socket.disable_monitor()
            monitor.close(linger=0)

    async def aclose(self) -> None:
        """Close the connection; idempotent."""
        if self._state is ClientState.CLOSED:
            return
        self._state = ClientState.CLOSED
        for request_id in list(self._executing):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send_cancel(request_id), INTERRUPT_WAIT_SECONDS)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._socket is not None:
            self._socket.close(linger=CANCEL_LINGER_MS if self._cancels_sent else 0)
        if self._context is not None:
            self._context.term()
        for queue in self._pending.values():
            queue.put_nowait((b"", {"closed": True}, []))

    # --- requests ---

    async def execute(
        self,
        program: Program,
        *,
        timeout_seconds: float | None = None,
        gpu_count: int | None = None,
        output_limit_bytes: int | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> ProgramResult:
        """Run ``program`` and return its result. Raises KCoralError when it cannot run.

        ``on_progress`` is called with a :class:`~kcoral.client.progress.ProgressEvent` at each
        step the service reports (uploading, queued, running, output)."""
        if not isinstance(program, Program):
            raise TypeError(f"execute needs a Program, got {type(program).__name__}")
        options = check_execute_options(timeout_seconds, gpu_count, output_limit_bytes)
        body, blobs = program.to_wire()
        request_id = uuid.uuid4().hex
        timeout = options.get("timeout_seconds", protocol.DEFAULT_TIMEOUT_SECONDS)
        queue = self._register(request_id)
        try:
            self._executing.add(request_id)
            await self._send(
                protocol.EXECUTE,
                {"request_id": request_id, "program": body, "options": options, "blobs": []},
            )
            deadline: float | None = None
            while True:
                command, reply, frames = await self._next_reply(request_id, queue, deadline)
                if command == protocol.FINAL:
                    self._executing.discard(request_id)
                    return self._final_result(request_id, reply, frames)
                state = reply.get("state")
                if state == "need_blobs":
                    await self._send_blobs(request_id, reply.get("blobs"), blobs, on_progress)
                elif state == "running" and deadline is None:
                    deadline = time.monotonic() + timeout + protocol.CLIENT_MARGIN_SECONDS
                if on_progress is not None and state != "need_blobs":
                    _report(on_progress, _progress_event(request_id, reply))
        except asyncio.CancelledError:
            # Tell the service, so a program nobody waits for stops using a GPU.
            with contextlib.suppress(Exception):
                await self._send_cancel(request_id)
            raise
        finally:
            self._executing.discard(request_id)
            self._pending.pop(request_id, None)

    async def health(self) -> dict[str, Any]:
        """The service's status: capacity, load, versions (and nodes, through a router)."""
        return await self._simple_request(protocol.HEALTH)

    async def target(self) -> dict[str, Any]:
        """What the programs run on: GPU names, compute capability, torch and CUDA versions."""
        return await self._simple_request(protocol.TARGET)

    # --- internals ---

    def _register(self, request_id: str) -> asyncio.Queue[tuple[bytes, dict[str, Any], list[Any]]]:
        if self._state is not ClientState.OPENED:
            raise RuntimeError("the client is not open: use it as an (async) context manager")
        queue: asyncio.Queue[tuple[bytes, dict[str, Any], list[Any]]] = asyncio.Queue()
        self._pending[request_id] = queue
        return queue

    async def _simple_request(self, command: bytes) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        queue = self._register(request_id)
        try:
            await self._send(command, {"request_id": request_id})
            deadline = time.monotonic() + self.connect_timeout_seconds
            _, reply, _ = await self._next_reply(request_id, queue, deadline, watch_liveness=False)
            if not reply.get("ok"):
                raise _request_error(request_id, reply)
            result = reply.get("result")
            if not isinstance(result, dict):
                raise ProtocolError("reply without a result map", request_id=request_id)
            return result
        finally:
            self._pending.pop(request_id, None)

    async def _send_cancel(self, request_id: str) -> None:
        if request_id not in self._executing:
            return  # answered, or cancelled already
        self._executing.discard(request_id)
        self._cancels_sent += 1
        await self._send(protocol.CANCEL, {"request_id": request_id})

    async def _send(self, command: bytes, body: dict[str, Any], *frames: Any) -> None:
        assert self._socket is not None
        with map_zmq_errors(body.get("request_id")):
            async with self._send_lock:
                await self._socket.send_multipart(protocol.message(command, body, *frames), copy=False)

    async def _send_blobs(
        self, request_id: str, digests: Any, blobs: dict[str, Any], on_progress: ProgressCallback | None = None
    ) -> None:
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise ProtocolError("need_blobs without a list of digests", request_id=request_id)
        unknown = [d for d in digests if d not in blobs]
        if unknown:
            raise ProtocolError(f"service asked for blobs this program lacks: {unknown[:3]}", request_id=request_id)
        frames = [blobs[d] for d in digests]
        size = sum(memoryview(f).nbytes for f in frames)
        if on_progress is not None and frames:
            _report(on_progress, ProgressEvent("uploading", request_id, blobs=len(frames), bytes_total=size))
        self.blob_bytes_sent += sum(len(f) for f in frames)
        self.blobs_sent += len(frames)
        await self._send(protocol.BLOBS, {"request_id": request_id, "blobs": digests}, *frames)

    async def _next_reply(
        self,
        request_id: str,
        queue: asyncio.Queue[tuple[bytes, dict[str, Any], list[Any]]],
        deadline: float | None,
        *,
        watch_liveness: bool = True,
    ) -> tuple[bytes, dict[str, Any], list[Any]]:
        liveness = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS
        while True:
            wait = liveness
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise KCoralError(
                        "timeout", "no result within the program's timeout plus margin", request_id=request_id
                    )
            try:
                command, reply, frames = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if watch_liveness and time.monotonic() - self._last_heard > liveness:
                    raise TransportError(
                        f"the service at {self.url} stopped answering", request_id=request_id
                    ) from None
                continue
            if reply.get("closed"):
                raise TransportError("the client was closed", request_id=request_id)
            return command, reply, frames

    async def _read_loop(self) -> None:
        assert self._socket is not None
        while True:
            try:
                raw = await self._socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            self._last_heard = time.monotonic()
            try:
                command, body, frames = protocol.split_message([f.buffer for f in raw])
            except protocol.WireError:
                continue  # a reply we cannot read is dropped; the request times out visibly
            if command == protocol.HEARTBEAT:
                continue
            queue = self._pending.get(str(body.get("request_id")))
            if queue is not None:
                queue.put_nowait((command, body, frames))

    def _final_result(self, request_id: str, reply: dict[str, Any], frames: list[Any]) -> ProgramResult:
        if not reply.get("ok"):
            raise _request_error(request_id, reply)
        result = reply.get("result")
        if not isinstance(result, dict):
            raise ProtocolError("FINAL without a result map", request_id=request_id)
        try:
            return build_result(result, frames)
        except (protocol.WireError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise ProtocolError(f"unreadable result: {exc}", request_id=request_id) from exc


def build_result(result: dict[str, Any], frames: list[Any]) -> ProgramResult:
    """A ProgramResult from a FINAL reply's result map and its data frames."""

    def frame(index: int) -> memoryview:
        return memoryview(frames[index])

    def convert(obj: Any) -> Any:
        if isinstance(obj, protocol.TensorSpec):
            if not isinstance(obj.source, int):
                raise protocol.WireError("a returned tensor must name a frame")
            return protocol.tensor_from_wire(obj, frame(obj.source), prefer_torch=False)
        if isinstance(obj, protocol.BytesFrame):
            return bytes(frame(obj.index))
        if isinstance(obj, protocol.FileSpec):
            return ReturnedFile(obj.name, bytes(frame(obj.frame)), obj.mode)
        if isinstance(obj, protocol.FolderSpec):
            return ReturnedFolder(
                {rel: ReturnedFile(rel.rsplit("/", 1)[-1], bytes(frame(i)), mode) for rel, i, mode in obj.files}
            )
        raise protocol.WireError(f"unexpected {type(obj).__name__} in a result")

    results = protocol.decode_value(result.get("results") or {}, convert)
    return ProgramResult(
        status=str(result["status"]),
        results=dict(results),
        error=result.get("error"),
        stdout=str(result.get("stdout", "")),
        stderr=str(result.get("stderr", "")),
        stdout_truncated=bool(result.get("stdout_truncated", False)),
        stderr_truncated=bool(result.get("stderr_truncated", False)),
        request_id=str(result.get("request_id", "")),
        queue_ms=float(result.get("queue_ms", 0.0)),
        elapsed_ms=float(result.get("elapsed_ms", 0.0)),
        lease_wait_ms=float(result.get("lease_wait_ms", 0.0)),
        lease_held_ms=float(result.get("lease_held_ms", 0.0)),
        gpu_ids=[int(g) for g in result.get("gpu_ids", [])],
        worker=dict(result.get("worker") or {}),
        node_id=str(result["node_id"]) if result.get("node_id") is not None else None,
    )


def _progress_event(request_id: str, reply: dict[str, Any]) -> ProgressEvent:
    """A PARTIAL as a ProgressEvent; fields of the wrong type are left out (PARTIAL is informative)."""
    state = str(reply.get("state"))
    gpu_ids = reply.get("gpu_ids")
    position = reply.get("position")
    index = reply.get("instruction_index")
    node = reply.get("node")
    stream = reply.get("stream")
    offset = reply.get("offset")
    text = reply.get("text")
    return ProgressEvent(
        state,
        request_id,
        position=position if isinstance(position, int) else None,
        gpu_ids=tuple(g for g in gpu_ids if isinstance(g, int)) if isinstance(gpu_ids, list) else (),
        instruction_index=index if isinstance(index, int) else None,
        node=node if isinstance(node, str) else None,
        stream=stream if stream in ("stdout", "stderr") else "",
        offset=offset if isinstance(offset, int) else -1,
        text=text if isinstance(text, str) else "",
    )


def _report(on_progress: ProgressCallback, event: ProgressEvent) -> None:
    # A display that fails must not fail the program it displays.
    with contextlib.suppress(Exception):
        on_progress(event)


def _request_error(request_id: str, reply: dict[str, Any]) -> KCoralError:
    error = reply.get("error")
    if not isinstance(error, dict):
        return ProtocolError("error reply without an error map", request_id=request_id)
    return KCoralError(str(error.get("kind", "engine")), str(error.get("message", "")), request_id=request_id)


class Client:
    """A blocking client: ``with Client(url) as client: client.execute(program)``.

    ``progress``: draw a status line on stderr while ``execute`` waits (uploading, queued, running),
    wiped when it returns. ``None`` (the default): only when stderr is a terminal.
    ``show_output``: write the program's stdout and stderr here as it runs (where the service streams
    them); ``output_shown`` then counts the characters of each written during the last ``execute``,
    so the rest can be written from the result (the command-line adapters do this)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        connect_timeout_seconds: float = 10.0,
        progress: bool | None = None,
        show_output: bool = False,
        keys: ClientKeys | None = None,
    ) -> None:
        self._async = AsyncClient(url, connect_timeout_seconds=connect_timeout_seconds, keys=keys)
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
        loop = asyncio.new_event_loop()
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


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
