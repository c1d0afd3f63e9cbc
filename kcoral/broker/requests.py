"""What the broker knows of each program and worker, and the queue of programs waiting to start."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kcoral import protocol
from kcoral.broker.blobs import BlobAssembly


@dataclass
class Worker:
    """A worker process that said READY: its slot, its GPU, and the program it runs (if any)."""

    identity: bytes
    slot: int
    gpu: int | None
    pid: int
    request_id: str | None = None
    exited: bool = False
    programs: int = 0  # programs sent to it: the broker, not the worker, decides on reuse
    gpu_view: tuple[int, ...] | None = None  # the GPUs a reused sandboxed worker is confined to


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
    state: str = "negotiating"  # negotiating -> queued -> running -> done
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
    conditions_at_start: dict[str, Any] | None = None  # the GPUs' at the start, for the provenance
    # Who the program belongs to for fair share: the client's CURVE key, or its connection
    # (kcoral.service.auth.peer_identity); ``client`` is the connection its answers go to.
    owner: bytes = b""

    def __post_init__(self) -> None:
        self.owner = self.owner or self.client

    def describe(self, now: float) -> dict[str, Any]:
        """A row of health's programs in flight."""
        return {
            "request_id": self.id,
            "client": self.client.decode(errors="replace"),
            "state": self.state,
            "age_s": round(now - self.received_at, 3),
            "gpu_ids": list(self.gpu_ids),
        }


class FromClient(Protocol):
    owner: bytes


QueuedT = TypeVar("QueuedT", bound=FromClient)


class RequestQueue(Generic[QueuedT]):
    """Programs waiting to start, one FIFO per client (its ``owner``: one key, however many
    connections it opens), served round robin across clients so one busy client cannot starve
    the others. The broker queues its requests here, the router its own."""

    def __init__(self) -> None:
        self._by_client: OrderedDict[bytes, deque[QueuedT]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_client.values())

    def queued_by(self, owner: bytes) -> int:
        queue = self._by_client.get(owner)
        return len(queue) if queue is not None else 0

    def push(self, request: QueuedT) -> None:
        self._by_client.setdefault(request.owner, deque()).append(request)

    def push_front(self, request: QueuedT, *, serve_client_next: bool = True) -> None:
        """Put back a request that could not start, first in its client's line; unless told
        otherwise, that client is also served next."""
        self._by_client.setdefault(request.owner, deque()).appendleft(request)
        if serve_client_next:
            self._by_client.move_to_end(request.owner, last=False)

    def pop(self) -> QueuedT | None:
        for client in list(self._by_client):
            queue = self._by_client[client]
            if not queue:
                del self._by_client[client]
                continue
            request = queue.popleft()
            self._by_client.move_to_end(client)
            if not queue:
                del self._by_client[client]
            return request
        return None

    def remove(self, request: QueuedT) -> None:
        queue = self._by_client.get(request.owner)
        if queue is not None and request in queue:
            queue.remove(request)
            if not queue:
                del self._by_client[request.owner]
