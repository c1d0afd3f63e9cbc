"""The queue of programs waiting to start, the same for the broker and the router: one FIFO per
client, served round robin."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, Protocol, TypeVar


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


__all__ = ["FromClient", "RequestQueue"]
