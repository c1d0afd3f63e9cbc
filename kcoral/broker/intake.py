"""How a program comes in: admission, blob negotiation, and how its blobs reach the worker.

:class:`ProgramIntake` is the part of the broker that takes EXECUTE and BLOBS: it checks a program and
its options, refuses what cannot run (busy, capacity, request_too_large, parse), stores the blobs
that came with it (hashed off the event loop when large), asks the client for those the cache
lacks, and queues the program once all are there. It is a base class of
:class:`kcoral.broker.broker.Broker`, whose state and replies it uses.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog

from kcoral import protocol
from kcoral.broker.blobs import BlobDigestMismatch, BlobStore, PreparedBlob
from kcoral.broker.requests import Request, RequestQueue
from kcoral.sandbox.bubblewrap import BLOBS as SANDBOX_BLOBS_DIR

if TYPE_CHECKING:
    from kcoral.broker.broker import BrokerSettings

log = structlog.get_logger("kcoral.broker")

# Received frames at least this large are kept by the blob store as they are, not copied: smaller
# ones may share one of libzmq's receive buffers (8 KiB), which a kept view would pin whole.
ADOPT_FRAME_BYTES = 64 << 10
OFF_LOOP_UPLOAD_BYTES = 16 << 20  # uploads at least this large are hashed and written in a thread


class ProgramIntake:
    """EXECUTE and BLOBS handling; the broker supplies the state and the replies."""

    settings: BrokerSettings
    blobs: BlobStore
    requests: dict[str, Request]
    queue: RequestQueue[Request]
    draining: bool
    gpu_ids: tuple[int, ...]

    def _finish_error(self, request: Request, kind: str, message: str) -> None:
        raise NotImplementedError

    def _reply_error(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        raise NotImplementedError

    def _send_client(self, client: bytes, command: bytes, body: dict[str, Any], *frames: Any) -> None:
        raise NotImplementedError

    def _dispatch(self) -> None:
        raise NotImplementedError

    def _fail_internal(self, client: bytes, request_id: str, command: bytes, exc: Exception) -> None:
        raise NotImplementedError

    async def _prepare_then(
        self, client: bytes, command: bytes, request_id: str, body: dict[str, Any], data: list[Any]
    ) -> None:
        digests = body.get("blobs")
        prepared: dict[str, PreparedBlob] = {}
        if isinstance(digests, list) and len(digests) == len(data):

            def prepare_all() -> None:
                for digest, frame in zip(digests, data):
                    try:
                        prepared[digest] = self.blobs.prepare(digest, frame)
                    except (BlobDigestMismatch, ValueError):
                        pass  # the ordinary path below refuses it with the reason

            await asyncio.to_thread(prepare_all)
        try:
            if command == protocol.EXECUTE:
                self._on_execute(client, request_id, body, data, prepared)
            else:
                self._on_blobs(client, request_id, body, data, prepared)
        except Exception as exc:
            self._fail_internal(client, request_id, command, exc)

    def _on_execute(
        self,
        client: bytes,
        request_id: str,
        body: dict[str, Any],
        data: list[Any],
        prepared: dict[str, PreparedBlob] | None = None,
    ) -> None:
        if request_id in self.requests:
            self._reply_error(client, request_id, "parse", "a request with this id is already in flight")
            return
        if self.draining:
            self._reply_error(client, request_id, "busy", "the broker is shutting down")
            return
        waiting = sum(1 for r in self.requests.values() if r.state in ("negotiating", "queued"))
        if waiting >= self.settings.max_queued:
            self._reply_error(client, request_id, "busy", f"the queue is full ({self.settings.max_queued} programs)")
            return
        try:
            program, options, digests = protocol.parse_execute(body)
            declared = declared_bytes(program)
        except protocol.WireError as exc:
            self._reply_error(client, request_id, "parse", str(exc))
            return
        if declared > self.settings.max_request_bytes:
            self._reply_error(
                client,
                request_id,
                "request_too_large",
                f"the program's uploads are {declared} bytes; "
                f"this broker takes at most {self.settings.max_request_bytes}",
            )
            return
        gpu_count = options.gpu_count if options.gpu_count is not None else (1 if self.gpu_ids else 0)
        if gpu_count > len(self.gpu_ids):
            self._reply_error(
                client,
                request_id,
                "capacity",
                f"the program asks for {gpu_count} GPUs; this host has {len(self.gpu_ids)}",
            )
            return
        request = Request(request_id, client, program, options, digests, gpu_count)
        self.requests[request_id] = request
        # Pinned before anything is stored, so no eviction can fall between a blob's arrival (or
        # its being found in the cache) and the program's end.
        for digest in digests:
            self.blobs.pin(digest, request_id)
        # One hit or miss per blob and program, on what the cache held when the program arrived;
        # later rounds check without counting, so a cold blob is not also counted as a hit.
        absent = self.blobs.missing(digests)
        log.info(
            "request_received",
            request_id=request_id,
            instructions=len(program["instructions"]),
            blobs=len(digests),
            missing=len(absent),
        )
        if self._store_blobs(request, body, data, prepared):
            self._negotiate(request, progressed=True)

    def _on_blobs(
        self,
        client: bytes,
        request_id: str,
        body: dict[str, Any],
        data: list[Any],
        prepared: dict[str, PreparedBlob] | None = None,
    ) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.client == client and request.state != "negotiating":
            # A late or repeated BLOBS for this client's own program: the program goes on, and a
            # FINAL here would end the client's wait for its real result.
            log.info("late_blobs_ignored", request_id=request_id, state=request.state)
            return
        if request is None or request.client != client:
            self._reply_error(client, request_id, "parse", "BLOBS for no request that is waiting for blobs")
            return
        if self._store_blobs(request, body, data, prepared):
            # An empty BLOBS does not extend the deadline: a client that sends nothing is dropped.
            self._negotiate(request, progressed=bool(data))

    def _store_blobs(
        self, request: Request, body: dict[str, Any], data: list[Any], prepared: dict[str, PreparedBlob] | None = None
    ) -> bool:
        """Check and store the blobs attached to EXECUTE or BLOBS; False when the request was
        refused (and answered) instead. ``prepared`` holds blobs already hashed off the loop."""
        digests = body.get("blobs") or []
        wanted = set(request.digests)
        try:
            if not isinstance(digests, list) or len(digests) != len(data):
                raise protocol.WireError("the blobs list must name each attached frame")
            for digest, frame in zip(digests, data):
                protocol.check_digest(digest)
                if digest not in wanted:
                    raise protocol.WireError(f"blob {digest[:12]}... is not used by the program")
                # Counted before hashing, so an oversized upload costs no more work than this.
                request.bytes_received += len(frame)
                if request.bytes_received > self.settings.max_request_bytes:
                    self._finish_error(
                        request,
                        "request_too_large",
                        f"the program's uploads exceed {self.settings.max_request_bytes} bytes",
                    )
                    return False
                # A received frame is never written to again, so a large one is kept as it is.
                ready = (prepared or {}).get(digest)
                if ready is not None:
                    self.blobs.commit(ready, adopt=len(frame) >= ADOPT_FRAME_BYTES)
                else:
                    self.blobs.put(digest, frame, adopt=len(frame) >= ADOPT_FRAME_BYTES)
        except BlobDigestMismatch as exc:
            self._finish_error(request, "parse", f"blob digest mismatch: {exc}")
            return False
        except (protocol.WireError, ValueError) as exc:
            self._finish_error(request, "parse", str(exc))
            return False
        return True

    def _negotiate(self, request: Request, *, progressed: bool) -> None:
        """Ask the client for the blobs still missing, or queue the program when none are.

        The deadline for the next round restarts only when this round brought blobs.
        """
        missing = [digest for digest in request.digests if not self.blobs.has(digest)]
        if missing:
            request.state = "negotiating"
            if progressed or request.timer is None:
                if request.timer is not None:
                    request.timer.cancel()
                timeout = self.settings.negotiation_timeout_seconds
                request.timer = asyncio.get_running_loop().call_later(
                    timeout,
                    self._finish_error,
                    request,
                    "timeout",
                    f"the client did not send the program's missing blobs within {timeout:g} s",
                )
            self._send_client(
                request.client, protocol.PARTIAL, {"request_id": request.id, "state": "need_blobs", "blobs": missing}
            )
            return
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        request.state = "queued"
        request.queued_at = time.monotonic()
        self.queue.push(request)
        self._send_client(request.client, protocol.PARTIAL, {"request_id": request.id, "state": "queued"})
        self._dispatch()

    def _program_blobs(self, request: Request) -> tuple[list[str], list[memoryview], dict[str, str]]:
        """How the worker gets each blob: (digests sent as frames, those frames, digest -> path).

        Large blobs in the disk cache go as paths the worker maps read-only, so their bytes pass
        through neither the broker's memory nor the socket; only inside bubblewrap, where the
        cache is mounted read-only: elsewhere a program could rewrite a file that another program
        maps, so blobs go as frames, read (and hashed) by the broker. Raises KeyError for a lost
        blob.
        """
        sent: list[str] = []
        frames: list[memoryview] = []
        paths: dict[str, str] = {}
        mapped = self.settings.sandbox == "bubblewrap"
        for digest in request.digests:
            path = None
            if mapped and self.blobs.size_of(digest) >= self.settings.blob_path_min_bytes:
                path = self.blobs.disk_path(digest)
            if path is None:
                sent.append(digest)
                frames.append(self.blobs.get(digest))
            else:
                # Inside the sandbox the cache directory is mounted read-only at /blobs.
                paths[digest] = str(SANDBOX_BLOBS_DIR / path.name)
        return sent, frames, paths


def declared_bytes(program: dict[str, Any]) -> int:
    """The bytes of a program's blobs as its instructions declare them, each digest once.

    Counts tensors wherever they appear (uploads, run arguments, returned literals), so a program
    over the limit is refused before any of its bytes are sent.
    """
    sizes: dict[str, int] = {}

    def visit(obj: Any) -> Any:
        if isinstance(obj, protocol.TensorSpec) and isinstance(obj.source, str):
            sizes[obj.source] = obj.nbytes
        return obj

    for ins in program.get("instructions", []):
        if not isinstance(ins, dict):
            continue
        size, blob = ins.get("size"), ins.get("blob")
        if isinstance(blob, str) and isinstance(size, int) and size > 0:
            sizes[blob] = size
        for entry in ins.get("files") or []:
            if isinstance(entry, list) and len(entry) >= 4 and isinstance(entry[1], str):
                if isinstance(entry[3], int) and entry[3] > 0:
                    sizes[entry[1]] = entry[3]
        for key in ("tensor", "args", "value"):
            if key in ins:
                protocol.decode_value(ins[key], visit)
    return sum(sizes.values())
