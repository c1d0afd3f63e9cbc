"""AsyncClient: submit programs to a KCoral broker or router over ZeroMQ.

Example::

    async with AsyncClient("tcp://127.0.0.1:5555") as client:
        result = await client.execute(program)

One connection (a DEALER socket) carries many requests, told apart by request id: a read loop hands
each reply to the request that waits for it. What a reply becomes (a ProgramResult, a progress
event, an error) is :mod:`kcoral.client.replies`; ``Client`` (:mod:`kcoral.client.blocking`) is the
same with blocking calls, driving an AsyncClient, so both share one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from kcoral import protocol
from kcoral.client.program import Program
from kcoral.client.progress import ProgressCallback, ProgressEvent, report
from kcoral.client.reach import Unresolvable, check_resolves, silence_reason
from kcoral.client.replies import build_result, final_result, progress_event, result_map
from kcoral.client.result import ProgramResult
from kcoral.errors import KCoralError, ProtocolError, TransportError
from kcoral.inbox import Inbox
from kcoral.keys import ClientKeys

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
# How long a closing client waits for each CANCEL to be sent (and Client, after Ctrl-C, for its
# cancelled call to send its CANCEL) before going on.
INTERRUPT_WAIT_SECONDS = 2.0
# Pieces of a blob sent ahead of the service's answers (docs/protocol.md, section 7): the upload
# waits for no round trip, and holds at most this many frame limits in flight.
PIECES_IN_FLIGHT = 4
# Replies handled in a row before the client's other callbacks (its calls' timers) get a turn.
REPLIES_IN_A_ROW = 64


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
    timeout_seconds: float | None, gpu_count: int | None, output_limit_bytes: int | None, session: bool = False
) -> dict[str, Any]:
    raw = {
        "timeout_seconds": timeout_seconds,
        "gpu_count": gpu_count,
        "output_limit_bytes": output_limit_bytes,
        "session": session,
    }
    try:
        return protocol.parse_options(raw).to_wire()
    except protocol.WireError as exc:
        raise ValueError(str(exc)) from None


class AsyncClient:
    """An asyncio client; many programs may be in flight over its one connection.

    ``keys`` (:class:`kcoral.keys.ClientKeys`) make the connection CurveZMQ: encrypted, the
    server checked against its public key, and this client known to it by its own key.

    ``session=True`` asks a broker to run this client's consecutive programs in one worker, which
    keeps its CUDA context and holds its GPU's lease between them (no context made and torn down
    per program); its workspace and process state are wiped between programs, no other client's
    program ever enters it, and a failed program, the client going away or the broker's idle and
    length bounds end it (the next program then starts a new one). Programs of one session run
    one at a time. The default is a fresh process per program.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connect_timeout_seconds: float = 10.0,
        keys: ClientKeys | None = None,
        session: bool = False,
    ) -> None:
        self.url = resolve_url(url)
        self.keys = keys
        self.session = session
        if connect_timeout_seconds <= 0:
            raise ValueError("connect_timeout_seconds must be > 0")
        self.connect_timeout_seconds = connect_timeout_seconds
        self._state = ClientState.UNOPENED
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._inbox: Inbox | None = None  # the socket's reading and writing, without pyzmq's futures
        self._pending: dict[str, asyncio.Queue[tuple[bytes, dict[str, Any], list[Any]]]] = {}
        self._executing: set[str] = set()  # EXECUTEs sent and not yet answered by a FINAL
        self._cancels_sent = 0
        self._last_heard = time.monotonic()
        self._send_lock = asyncio.Lock()
        # The largest frame the service takes (HEALTH ``frame_bytes``); None: a service that names
        # none takes blobs only whole, each in one frame.
        self.frame_bytes: int | None = None
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
        self._inbox = Inbox(socket)
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
            return self._note_limits(await self.health())
        monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILURES)
        health = asyncio.ensure_future(self.health())
        refused = asyncio.ensure_future(monitor.recv_multipart())
        try:
            done, _ = await asyncio.wait({health, refused}, return_when=asyncio.FIRST_COMPLETED)
            if health in done:
                return self._note_limits(health.result())
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

    def _note_limits(self, health: dict[str, Any]) -> dict[str, Any]:
        frame_bytes = health.get("frame_bytes")
        if isinstance(frame_bytes, int) and not isinstance(frame_bytes, bool) and frame_bytes >= 1:
            self.frame_bytes = frame_bytes
        return health

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
        if self._inbox is not None:
            self._inbox.close()  # before the socket
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
        options = check_execute_options(timeout_seconds, gpu_count, output_limit_bytes, self.session)
        body, blobs = program.to_wire()
        request_id = os.urandom(16).hex()
        timeout = options.get("timeout_seconds", protocol.DEFAULT_TIMEOUT_SECONDS)
        queue = self._register(request_id)
        try:
            self._executing.add(request_id)
            await self._send(
                protocol.EXECUTE,
                {"request_id": request_id, "program": body, "options": options, "blobs": []},
            )
            deadline: float | None = None
            pieces_sent: dict[str, int] = {}
            while True:
                command, reply, frames = await self._next_reply(request_id, queue, deadline)
                if command == protocol.FINAL:
                    self._executing.discard(request_id)
                    return final_result(request_id, reply, frames)
                state = reply.get("state")
                if state == "need_blobs":
                    await self._send_blobs(request_id, reply, blobs, pieces_sent, on_progress)
                elif state == "running" and deadline is None:
                    deadline = time.monotonic() + timeout + protocol.CLIENT_MARGIN_SECONDS
                if on_progress is not None and state != "need_blobs":
                    report(on_progress, progress_event(request_id, reply))
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
        request_id = os.urandom(16).hex()
        queue = self._register(request_id)
        try:
            await self._send(command, {"request_id": request_id})
            deadline = time.monotonic() + self.connect_timeout_seconds
            _, reply, _ = await self._next_reply(request_id, queue, deadline, watch_liveness=False)
            return result_map(request_id, reply)
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
        message = protocol.message(command, body, *frames)
        if self.frame_bytes is not None:
            largest = max(memoryview(frame).nbytes for frame in message)
            if largest > self.frame_bytes:
                # The service's libzmq would drop the connection for it, with no answer.
                raise KCoralError(
                    "request_too_large",
                    f"a frame of {largest} bytes is over the service's frame limit of {self.frame_bytes} "
                    "bytes (its --max-frame-bytes); send large values as uploads",
                    request_id=body.get("request_id"),
                )
        with map_zmq_errors(body.get("request_id")):
            async with self._send_lock:
                assert self._inbox is not None
                await self._inbox.send_waiting(message, copy=False)

    async def _send_blobs(
        self,
        request_id: str,
        reply: dict[str, Any],
        blobs: dict[str, Any],
        sent: dict[str, int],
        on_progress: ProgressCallback | None = None,
    ) -> None:
        """Answer a ``need_blobs``: with every blob it names in one BLOBS where the service takes
        blobs only whole; else with the next pieces of its first blob when that one is over the
        frame limit (``sent``: how far each blob in pieces has gone), or the blobs before the
        first such one, up to a frame limit of bytes."""
        digests, offsets = reply.get("blobs"), reply.get("offsets") or {}
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise ProtocolError("need_blobs without a list of digests", request_id=request_id)
        if not isinstance(offsets, dict):
            raise ProtocolError("need_blobs with offsets that are not a map", request_id=request_id)
        unknown = [d for d in digests if d not in blobs]
        if unknown:
            raise ProtocolError(f"service asked for blobs this program lacks: {unknown[:3]}", request_id=request_id)
        views = {d: memoryview(blobs[d]).cast("B") for d in digests}
        if on_progress is not None and digests and digests[0] not in offsets:
            size = sum(views[d].nbytes for d in digests)
            report(on_progress, ProgressEvent("uploading", request_id, blobs=len(digests), bytes_total=size))
        limit = self.frame_bytes
        if limit is not None and digests and (views[digests[0]].nbytes > limit or digests[0] in offsets):
            digest, view = digests[0], views[digests[0]]
            offset = offsets.get(digest, 0)
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < view.nbytes:
                raise ProtocolError(f"need_blobs with a bad offset {offset!r}", request_id=request_id)
            # Up to PIECES_IN_FLIGHT pieces past what the service has: one more for each answer.
            start = max(offset, sent.get(digest, 0))
            while start < view.nbytes and start - offset < PIECES_IN_FLIGHT * limit:
                piece = view[start : start + limit]
                self.blob_bytes_sent += piece.nbytes
                self.blobs_sent += start + piece.nbytes == view.nbytes
                body = {"request_id": request_id, "blobs": [digest], "offset": start, "size": view.nbytes}
                await self._send(protocol.BLOBS, body, piece)
                start += piece.nbytes
            sent[digest] = start
            return
        batch = digests
        if limit is not None:
            batch, total = [], 0
            for digest in digests:
                size = views[digest].nbytes
                if size > limit or (batch and total + size > limit):
                    break
                batch.append(digest)
                total += size
        frames = [blobs[d] for d in batch]
        self.blob_bytes_sent += sum(views[d].nbytes for d in batch)
        self.blobs_sent += len(frames)
        await self._send(protocol.BLOBS, {"request_id": request_id, "blobs": batch}, *frames)

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
                # A timeout scope, not wait_for: Python 3.11's wraps the get in a task of its own.
                async with asyncio.timeout(wait):
                    command, reply, frames = await queue.get()
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
        assert self._inbox is not None
        with contextlib.suppress(zmq.ZMQError):  # the socket is gone: so is its reading
            await self._inbox.serve(self._on_reply, REPLIES_IN_A_ROW)

    def _on_reply(self, raw: list[zmq.Frame]) -> None:
        """One message from the service, handed to the request that waits for it (in the loop's
        callback for the socket: see :meth:`kcoral.inbox.Inbox.serve`)."""
        self._last_heard = time.monotonic()
        try:
            command, body, frames = protocol.split_message([f.buffer for f in raw])
        except protocol.WireError:
            return  # a reply we cannot read is dropped; the request times out visibly
        if command == protocol.HEARTBEAT:
            return
        if self._state is ClientState.CLOSED:
            # Closing cancels what runs; the broker's answer to that CANCEL is not the caller's:
            # its call ends with "the client was closed" once the socket is gone.
            return
        queue = self._pending.get(str(body.get("request_id")))
        if queue is not None:
            queue.put_nowait((command, body, frames))


__all__ = ["AsyncClient", "ClientState", "build_result", "check_execute_options", "map_zmq_errors", "resolve_url"]
