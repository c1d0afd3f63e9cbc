"""What the broker knows of each program and worker (the queue they wait in is the services'
:class:`kcoral.service.queue.RequestQueue`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kcoral import protocol
from kcoral.broker.incoming import BlobAssembly
from kcoral.protocol.worker_link import WorkerId, worker_name


class RequestState(StrEnum):
    """Where a program is on its way: negotiating (its blobs) -> queued -> running -> done."""

    NEGOTIATING = "negotiating"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass
class Worker:
    """A worker process that said READY: its slot, its GPU, and the program it runs (if any)."""

    identity: WorkerId
    slot: int
    gpu: int | None
    pid: int
    request_id: str | None = None
    exited: bool = False
    programs: int = 0  # programs sent to it: the broker, not the worker, decides on reuse
    # The only GPUs it can serve: those a reused sandboxed worker is confined to, or the slot's GPU
    # where it made its CUDA context ahead. None: any.
    gpu_view: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        """The identity as text, for logs."""
        return worker_name(self.identity)


@dataclass
class Request:
    """One program from a client, from EXECUTE to FINAL."""

    id: str
    client: bytes
    program: dict[str, Any]
    options: protocol.ExecuteOptions
    digests: list[str]
    gpu_count: int
    received_at: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.NEGOTIATING
    queued_at: float = 0.0
    started_at: float = 0.0
    worker: Worker | None = None
    gpu_ids: tuple[int, ...] = ()
    instruction_index: int | None = None
    timer: asyncio.TimerHandle | None = None
    lease_task: asyncio.Task[None] | None = None
    lease_times: tuple[float, float] | None = None  # when the lease was asked for and granted (monotonic)
    bytes_received: int = 0
    # Blobs arriving in pieces (BLOBS with ``offset``), by digest, until their last piece.
    pieces: dict[str, BlobAssembly] = field(default_factory=dict)
    provenance: dict[str, Any] | None = None  # its provenance as known at its start (kcoral.broker.provenance)
    # Who the program belongs to for fair share: the client's CURVE key, or its connection
    # (kcoral.service.auth.peer_identity); ``client`` is the connection its answers go to.
    owner: bytes = b""
    # The ``queued`` PARTIAL's position until it is sent: after the PROGRAM where the program goes
    # to a worker at once (Broker._start), so that the worker does not wait for a message to its
    # client; before the ``running`` one all the same.
    untold_position: int | None = None

    def __post_init__(self) -> None:
        self.owner = self.owner or self.client

    def take_queued_partial(self) -> dict[str, Any] | None:
        """The ``queued`` PARTIAL's body where it is still to be sent (once), else None."""
        if self.untold_position is None:
            return None
        body = {"request_id": self.id, "state": "queued", "position": self.untold_position}
        self.untold_position = None
        return body

    def timeline(self, result_at: float) -> dict[str, float]:
        """The result's ``timeline``: wall-clock times (seconds since the epoch) of the program's way
        through the broker, from its monotonic records: EXECUTE read, queued, sent to its worker,
        RESULT read (``result_at``). For finding where a program's milliseconds go."""
        offset = time.time() - time.monotonic()
        points = (
            ("received_at", self.received_at),
            ("queued_at", self.queued_at),
            ("started_at", self.started_at),
            ("result_at", result_at),
        )
        return {name: round(at + offset, 6) for name, at in points if at}

    def describe(self, now: float) -> dict[str, Any]:
        """A row of health's programs in flight."""
        return {
            "request_id": self.id,
            "client": self.client.decode(errors="replace"),
            "state": self.state.value,
            "age_s": round(now - self.received_at, 3),
            "gpu_ids": list(self.gpu_ids),
        }
