"""How a program comes in: admission, blob negotiation, and how its blobs reach the worker.

:class:`ProgramIntake` takes EXECUTE and BLOBS for the broker: it checks a program and its options,
refuses what cannot run (busy, capacity, request_too_large, parse: the checks shared with the
router are the pure functions of :mod:`kcoral.service.admission`), stores the blobs that came with
it (hashed off the event loop when large), asks the client for those the cache lacks, and hands
the program to the broker once all are there. It is built with what it uses (settings, the blob
store, the requests in flight, a task set) and talks back to the broker through a small port,
:class:`IntakePort`, so that it runs, and is tested, without a broker (tests/test_intake.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import structlog

from kcoral import protocol
from kcoral.broker.blobs import BlobStore
from kcoral.broker.incoming import BlobDigestMismatch, PreparedBlob
from kcoral.broker.requests import Request, RequestState
from kcoral.sandbox.bubblewrap import BLOBS as SANDBOX_BLOBS_DIR
from kcoral.service.admission import AdmissionPolicy, Refusal, admit_execute, declared_sizes, refuse_gpu_count
from kcoral.service.fairness import UploadBudget
from kcoral.service.shell import ClientMessage, InFlightTable
from kcoral.service.tasks import TaskSet

log = structlog.get_logger("kcoral.broker")

# Received frames at least this large are kept by the blob store as they are, not copied: smaller
# ones may share one of libzmq's receive buffers (8 KiB), which a kept view would pin whole.
ADOPT_FRAME_BYTES = 64 << 10
OFF_LOOP_UPLOAD_BYTES = 16 << 20  # uploads at least this large are hashed and written in a thread
NEGOTIATION_TIMEOUT_SECONDS = 60.0  # a client that never sends its missing blobs is dropped


@dataclass(frozen=True)
class IntakeSettings:
    """The broker's settings that intake reads."""

    gpu_count: int  # GPUs of this host; 0: CPU workers only
    max_queued: int = 1024
    max_request_bytes: int = protocol.DEFAULT_MAX_REQUEST_BYTES
    # How long a program waits for a round of its missing blobs; it must cover their upload time.
    negotiation_timeout_seconds: float = NEGOTIATION_TIMEOUT_SECONDS
    # Blobs at least this large that are in the disk cache reach the worker as a path to map, not
    # as a frame: no copy through the broker's memory and the ipc socket.
    blob_path_min_bytes: int = 1 << 20
    sandboxed: bool = False  # workers see the cache directory at SANDBOX_BLOBS_DIR
    max_queued_per_client: int = 1024  # programs one client (owner) may have waiting


class IntakePort(Protocol):
    """What intake asks of the broker that holds it."""

    @property
    def draining(self) -> bool: ...

    def refuse(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        """Answer a request that was not taken (FINAL with an error)."""

    def tell(self, request: Request, body: dict[str, Any]) -> None:
        """Send the request's client a PARTIAL."""

    def fail(self, request: Request, kind: str, message: str) -> None:
        """End a request that was taken with an error (FINAL), and forget it."""

    def enqueue(self, request: Request) -> None:
        """Every blob of the request is here: queue it for a worker."""

    def fail_internal(self, message: ClientMessage, exc: Exception) -> None:
        """Answer a message whose handling raised (a bug), so its client does not wait."""


class ProgramIntake:
    """EXECUTE and BLOBS handling, and the blob half of a program's delivery to its worker."""

    def __init__(
        self,
        settings: IntakeSettings,
        *,
        blobs: BlobStore,
        requests: InFlightTable[Request],
        tasks: TaskSet,
        port: IntakePort,
        uploads: UploadBudget[bytes] | None = None,
        trusted: frozenset[bytes] | set[bytes] = frozenset(),
    ) -> None:
        self.settings = settings
        self.blobs = blobs
        self.requests = requests
        self.tasks = tasks
        self.port = port
        # Bytes of uploads in progress, per client and in all (unbounded unless given).
        self.uploads: UploadBudget[bytes] = uploads or UploadBudget(1 << 62, 1 << 62)
        # Owners exempt from the per-client share: the broker's own router relay, whose clients
        # the router holds to their shares.
        self.trusted = trusted
        self.admission = AdmissionPolicy(
            "broker", settings.max_queued, settings.max_queued_per_client, settings.max_request_bytes
        )

    # --- the two commands ---

    def on_execute(self, message: ClientMessage) -> None:
        if not self._off_loop(message, self._execute):
            self._execute(message, None)

    def on_blobs(self, message: ClientMessage) -> None:
        if not self._off_loop(message, self._blobs):
            self._blobs(message, None)

    def _off_loop(self, message: ClientMessage, then: Callable[[ClientMessage, dict[str, PreparedBlob]], None]) -> bool:
        """Hashing and writing a large upload takes seconds: do it in a thread, so heartbeats,
        leases and other clients are served meanwhile; then go on with ``then``."""
        if message.data_bytes < OFF_LOOP_UPLOAD_BYTES:
            return False
        self.tasks.spawn(self._prepare_then(message, then), name="prepare-blobs")
        return True

    async def _prepare_then(
        self, message: ClientMessage, then: Callable[[ClientMessage, dict[str, PreparedBlob]], None]
    ) -> None:
        digests = message.body.get("blobs")
        prepared: dict[str, PreparedBlob] = {}
        if isinstance(digests, list) and len(digests) == len(message.data):

            def prepare_all() -> None:
                for digest, frame in zip(digests, message.data):
                    try:
                        prepared[digest] = self.blobs.prepare(digest, frame)
                    except (BlobDigestMismatch, ValueError):
                        pass  # the ordinary path refuses it with the reason

            await asyncio.to_thread(prepare_all)
        try:
            then(message, prepared)
        except Exception as exc:
            self.port.fail_internal(message, exc)

    def _execute(self, message: ClientMessage, prepared: dict[str, PreparedBlob] | None) -> None:
        client, request_id, owner = message.client, message.request_id, message.owner or message.client
        waiting = mine = 0
        for r in self.requests:
            if r.state in (RequestState.NEGOTIATING, RequestState.QUEUED):
                waiting += 1
                mine += r.owner == owner
        admitted = admit_execute(
            message.body,
            self.admission,
            already_in_flight=request_id in self.requests,
            draining=self.port.draining,
            waiting=waiting,
            client_waiting=0 if owner in self.trusted else mine,
            capacity=self._capacity,
        )
        if isinstance(admitted, Refusal):
            self.port.refuse(client, request_id, *admitted)
            return
        program, options, digests, sizes = admitted.program, admitted.options, admitted.digests, admitted.sizes
        if options.session and owner in self.trusted:
            # Through the router relay every client of the router is this one connection, which
            # keys a session (kcoral.broker.sessions): one router client's program would enter
            # another's session worker. Such a program runs as any other, in a fresh worker.
            options = replace(options, session=False)
        # One hit or miss per blob and program, on what the cache held when the program arrived;
        # later rounds check without counting, so a cold blob is not also counted as a hit.
        absent = self.blobs.missing(digests)
        # The bytes this upload will hold before the program is queued, reserved before any is sent.
        refusal = self.uploads.reserve(request_id, owner, sum(sizes.get(d, 0) for d in set(absent)))
        if refusal is not None:
            self.port.refuse(client, request_id, refusal.kind, refusal.message)
            return
        gpu_count = self._gpu_count(options)
        request = Request(request_id, client, program, options, digests, gpu_count, owner=owner)
        self.requests.add(request)
        # Pinned before anything is stored, so no eviction can fall between a blob's arrival (or
        # its being found in the cache) and the program's end.
        for digest in digests:
            self.blobs.pin(digest, request_id)
        log.info(
            "request_received",
            request_id=request_id,
            instructions=len(program["instructions"]),
            blobs=len(digests),
            missing=len(absent),
        )
        if self._store_blobs(request, message, prepared):
            self.negotiate(request, progressed=True)

    def _capacity(self, options: protocol.ExecuteOptions) -> Refusal | None:
        return refuse_gpu_count(self._gpu_count(options), self.settings.gpu_count, where="this host")

    def _gpu_count(self, options: protocol.ExecuteOptions) -> int:
        """The GPUs a program gets: as many as it asks for; one by default where there are any."""
        if options.gpu_count is not None:
            return options.gpu_count
        return 1 if self.settings.gpu_count else 0

    def _blobs(self, message: ClientMessage, prepared: dict[str, PreparedBlob] | None) -> None:
        request = self.requests.of(message.client, message.request_id)
        if request is None:
            text = "BLOBS for no request that is waiting for blobs"
            self.port.refuse(message.client, message.request_id, "parse", text)
            return
        if request.state != RequestState.NEGOTIATING:
            # A late or repeated BLOBS for this client's own program: the program goes on, and a
            # FINAL here would end the client's wait for its real result.
            log.info("late_blobs_ignored", request_id=request.id, state=request.state.value)
            return
        if self._store_blobs(request, message, prepared):
            # An empty BLOBS does not extend the deadline: a client that sends nothing is dropped.
            self.negotiate(request, progressed=bool(message.data))

    # --- blobs ---

    def _store_blobs(self, request: Request, message: ClientMessage, prepared: dict[str, PreparedBlob] | None) -> bool:
        """Check and store the blobs attached to EXECUTE or BLOBS; False when the request was
        failed (and answered) instead. ``prepared`` holds blobs already hashed off the loop."""
        digests = message.body.get("blobs") or []
        wanted = set(request.digests)
        limit = self.settings.max_request_bytes
        try:
            if not isinstance(digests, list) or len(digests) != len(message.data):
                raise protocol.WireError("the blobs list must name each attached frame")
            piece = protocol.blob_piece(message.body, len(digests))
            for digest, frame in zip(digests, message.data):
                protocol.check_digest(digest)
                if digest not in wanted:
                    raise protocol.WireError(f"blob {digest[:12]}... is not used by the program")
                # Counted before hashing, so an oversized upload costs no more work than this.
                request.bytes_received += len(frame)
                if request.bytes_received > limit:
                    self.port.fail(request, "request_too_large", f"the program's uploads exceed {limit} bytes")
                    return False
                # More than it declared: held against the client's upload bounds all the same.
                refusal = self.uploads.reserve(request.id, request.owner, request.bytes_received)
                if refusal is not None:
                    self.port.fail(request, refusal.kind, refusal.message)
                    return False
                if piece is not None:
                    self._store_piece(request, digest, piece, frame)
                    continue
                self._drop_pieces(request, digest)
                # A received frame is never written to again, so a large one is kept as it is.
                adopt = len(frame) >= ADOPT_FRAME_BYTES
                ready = (prepared or {}).get(digest)
                if ready is not None:
                    self.blobs.commit(ready, adopt=adopt)
                else:
                    self.blobs.put(digest, frame, adopt=adopt)
        except BlobDigestMismatch as exc:
            self.port.fail(request, "parse", f"blob digest mismatch: {exc}")
            return False
        except (protocol.WireError, ValueError) as exc:
            self.port.fail(request, "parse", str(exc))
            return False
        except OSError as exc:
            # Only a blob in pieces needs the disk (the others are kept in memory when it fails).
            log.warning("blob_pieces_not_stored", request_id=request.id, error=str(exc))
            self.port.fail(request, "busy", f"the service cannot store the blob's pieces now: {exc.strerror}")
            return False
        return True

    def _store_piece(self, request: Request, digest: str, piece: protocol.BlobPiece, frame: memoryview) -> None:
        """Add one piece of a blob uploaded in pieces; file the blob once its last piece is here.
        Raises WireError for a piece out of order or of another size than the program declares."""
        declared = declared_sizes(request.program).get(digest)
        if declared is not None and declared != piece.size:
            raise protocol.WireError(
                f"blob {digest[:12]}... is {piece.size} bytes in its pieces, {declared} in the program"
            )
        assembly = request.pieces.get(digest)
        if assembly is None or assembly.size != piece.size:
            self._drop_pieces(request, digest)
            if piece.offset != 0:
                raise protocol.WireError(f"the first piece of blob {digest[:12]}... is at offset {piece.offset}, not 0")
            assembly = request.pieces[digest] = self.blobs.begin(digest, piece.size)
        if piece.offset != assembly.received:
            raise protocol.WireError(
                f"piece of blob {digest[:12]}... at offset {piece.offset}; expected {assembly.received}"
            )
        if not len(frame):
            raise protocol.WireError(f"an empty piece of blob {digest[:12]}...")
        assembly.add(frame)
        if assembly.complete:
            del request.pieces[digest]
            self.blobs.finish(assembly)

    @staticmethod
    def _drop_pieces(request: Request, digest: str | None = None) -> None:
        """Discard the unfinished blobs in pieces of ``request`` (only ``digest``'s, when given)."""
        for name in [digest] if digest is not None else list(request.pieces):
            assembly = request.pieces.pop(name, None)
            if assembly is not None:
                assembly.discard()

    def forget(self, request: Request) -> None:
        """The request ended: what it holds of uploads goes."""
        self._drop_pieces(request)
        self.uploads.release(request.id)

    def negotiate(self, request: Request, *, progressed: bool) -> None:
        """Ask the client for the blobs still missing, or queue the program when none are.

        The deadline for the next round restarts only when this round brought blobs.
        """
        missing = [digest for digest in request.digests if not self.blobs.has(digest)]
        if missing:
            request.state = RequestState.NEGOTIATING
            if progressed or request.timer is None:
                if request.timer is not None:
                    request.timer.cancel()
                timeout = self.settings.negotiation_timeout_seconds
                request.timer = asyncio.get_running_loop().call_later(
                    timeout,
                    self.port.fail,
                    request,
                    "timeout",
                    f"the client did not send the program's missing blobs within {timeout:g} s",
                )
            body: dict[str, Any] = {"request_id": request.id, "state": "need_blobs", "blobs": missing}
            if request.pieces:
                # Where each blob that comes in pieces goes on: the client sends from there.
                body["offsets"] = {d: a.received for d, a in request.pieces.items() if d in missing}
            self.port.tell(request, body)
            return
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        self.uploads.release(request.id)  # its blobs are all in the store now, pinned until it ends
        ahead = sum(1 for r in self.requests if r.state == RequestState.QUEUED)  # for a client's progress line
        request.state = RequestState.QUEUED
        request.queued_at = time.monotonic()
        request.untold_position = ahead
        self.port.enqueue(request)
        # Told now where no worker took it at once (one that did was told after its PROGRAM went);
        # not where its start found a blob lost and asked for it again (need_blobs instead).
        queued = request.take_queued_partial()
        if queued is not None and request.state == RequestState.QUEUED and self.requests.get(request.id) is request:
            self.port.tell(request, queued)

    def worker_blobs(self, request: Request) -> tuple[list[str], list[memoryview], dict[str, str]]:
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
        for digest in request.digests:
            path: Path | None = None
            if self.settings.sandboxed and self.blobs.size_of(digest) >= self.settings.blob_path_min_bytes:
                path = self.blobs.disk_path(digest)
            if path is None:
                sent.append(digest)
                frames.append(self.blobs.get(digest))
            else:
                # Inside the sandbox the cache directory is mounted read-only at /blobs.
                paths[digest] = str(SANDBOX_BLOBS_DIR / path.name)
        return sent, frames, paths


__all__ = [
    "ADOPT_FRAME_BYTES",
    "NEGOTIATION_TIMEOUT_SECONDS",
    "OFF_LOOP_UPLOAD_BYTES",
    "IntakePort",
    "IntakeSettings",
    "ProgramIntake",
]
