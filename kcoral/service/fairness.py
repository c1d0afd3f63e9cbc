"""Limits that keep one client from crowding out the others: request rates and upload bytes.

Pure bookkeeping with an injectable clock, so the rules are tested without sockets; the broker and
the router ask before they do the work (`allow`, `reserve`) and tell when it is over (`release`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

# Per-client state is kept for at most this many clients (least recently seen forgotten first), so
# a flood from ever new identities costs bounded memory; a forgotten client starts with a full
# bucket, which only ever helps an honest client.
MAX_TRACKED_CLIENTS = 100_000
# Without --max-queued-per-client one client may fill this fraction of --max-queued:
# four busy clients together can fill the queue, one alone leaves room for everyone else.
CLIENT_QUEUE_SHARE = 4
# How long a vanished client's running programs go on before they are cancelled: a short network
# blip (the DEALER reconnects under the same identity) costs nothing, a gone client little GPU time.
ORPHAN_GRACE_SECONDS = 10.0


class RateLimit(Generic[K]):
    """A token bucket per key: ``rate`` events per second on average, bursts of up to ``burst``."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_TRACKED_CLIENTS,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limit needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[K, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self.refused = 0

    def allow(self, key: K) -> bool:
        """Take one token for ``key``; False (and nothing taken) when its bucket is empty."""
        now = self.clock()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        else:
            self.refused += 1
        self._buckets[key] = (tokens, now)
        self._buckets.move_to_end(key)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed

    def forget(self, key: K) -> None:
        self._buckets.pop(key, None)


@dataclass(frozen=True)
class UploadRefusal:
    kind: str  # "busy": wait and retry; "request_too_large": never fits this service
    message: str


def client_queue_limit(max_queued: int, max_queued_per_client: int | None) -> int:
    """Programs one client may have waiting: as given, or a fair fraction of the queue."""
    if max_queued_per_client is not None:
        return max_queued_per_client
    return max(1, max_queued // CLIENT_QUEUE_SHARE)


def upload_bounds(max_request_bytes: int, total: int | None, per_client: int | None) -> tuple[int, int]:
    """(in all, per client) bytes of uploads in progress: as given, or by default twice
    ``max_request_bytes`` in all and ``max_request_bytes`` per client."""
    return total or 2 * max_request_bytes, per_client or max_request_bytes


class UploadBudget(Generic[K]):
    """Bytes held by uploads in progress (programs still negotiating their blobs), bounded in
    total and per client. A program reserves the bytes it declares before any is sent, and more as
    frames arrive beyond that; all of it is released when it leaves negotiation (queued, refused,
    cancelled). A program that alone exceeds the per-client bound can never fit."""

    def __init__(self, total_bytes: int, per_client_bytes: int) -> None:
        if total_bytes < 1 or per_client_bytes < 1:
            raise ValueError("upload bounds must be >= 1 byte")
        self.total_bytes = total_bytes
        self.per_client_bytes = per_client_bytes
        self.held = 0
        self._by_client: dict[K, int] = {}
        self._by_request: dict[str, tuple[K, int]] = {}

    def held_by(self, client: K) -> int:
        return self._by_client.get(client, 0)

    def reserve(self, request_id: str, client: K, nbytes: int) -> UploadRefusal | None:
        """Grow ``request_id``'s reservation to at least ``nbytes``; a refusal (nothing changed)
        when that would exceed a bound."""
        _, current = self._by_request.get(request_id, (client, 0))
        extra = nbytes - current
        if extra <= 0:
            return None
        if nbytes > self.per_client_bytes:
            return UploadRefusal(
                "request_too_large",
                f"the program's uploads are {nbytes} bytes; one client may have at most "
                f"{self.per_client_bytes} bytes of uploads in progress",
            )
        if self.held_by(client) + extra > self.per_client_bytes:
            return UploadRefusal(
                "busy",
                f"this client has {self.held_by(client)} bytes of uploads in progress already "
                f"(at most {self.per_client_bytes}); wait for them to finish",
            )
        if self.held + extra > self.total_bytes:
            return UploadRefusal(
                "busy", f"the service holds {self.held} bytes of uploads in progress (at most {self.total_bytes})"
            )
        self._by_request[request_id] = (client, nbytes)
        self._by_client[client] = self.held_by(client) + extra
        self.held += extra
        return None

    def release(self, request_id: str) -> None:
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return
        client, nbytes = entry
        self.held -= nbytes
        left = self._by_client[client] - nbytes
        if left:
            self._by_client[client] = left
        else:
            del self._by_client[client]


class Orphan(Protocol):
    @property
    def client(self) -> bytes: ...


R = TypeVar("R", bound=Orphan)


class OrphanWatch:
    """Clients (connections) found gone at a heartbeat, and since when: their waiting programs
    are cancelled at once, their running ones once ``grace_seconds`` have passed without the
    connection coming back."""

    def __init__(self, grace_seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_seconds = grace_seconds
        self.clock = clock
        self._lost_at: dict[bytes, float] = {}

    def gone(self, clients: Iterable[bytes]) -> dict[bytes, bool]:
        """The clients found gone at this heartbeat, each with whether its grace is over; any
        client not among them is reachable again (or has nothing in flight) and is forgotten."""
        now = self.clock()
        lost = {client: self._lost_at.get(client, now) for client in clients}
        self._lost_at = lost
        return {client: now - since >= self.grace_seconds for client, since in lost.items()}

    def to_cancel(self, requests: Iterable[R], started: Callable[[R], bool]) -> list[tuple[R, bool]]:
        """Of ``requests``, those of gone clients to cancel now (with whether each had started),
        after :meth:`gone` was told who is gone."""
        now = self.clock()
        ending = []
        for request in requests:
            since = self._lost_at.get(request.client)
            if since is None:
                continue
            running = started(request)
            if not running or now - since >= self.grace_seconds:
                ending.append((request, running))
        return ending
