"""Client sessions: a client's consecutive programs in one worker, which keeps its CUDA context.

A program whose options ask for the client's session (``ExecuteOptions.session``) starts one, or
runs in the one its client has: the same worker, never another client's (a session belongs to one
connection). The worker wipes its workspace and puts back the process state a program may change
between programs (``kcoral.worker.state``), and the session holds its GPU's lease while it lasts:
its worker could launch GPU work at any moment. A failed program, an answer the broker cannot
use, the worker's exit or the client's connection found gone end it, and so do the operator's
bounds, so that one client cannot keep a GPU from the others: ``--session-idle`` seconds without a
program, and ``--session-max`` seconds from its first program (a session past it ends with its
program then running). Programs of one session run one at a time; the next program after the end
starts a new one in a fresh worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kcoral.broker.requests import Worker
from kcoral.protocol.worker_link import WorkerId


@dataclass(eq=False)
class Session:
    """One client's session: its worker, the GPUs its programs run on, when it began and was last used."""

    client: bytes
    worker: Worker
    gpu_ids: tuple[int, ...]
    started_at: float
    last_used: float
    programs: int = 1

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "client": self.client.decode(errors="replace"),
            "worker": self.worker.name,
            "slot": self.worker.slot,
            "gpu_ids": list(self.gpu_ids),
            "programs": self.programs,
            "running": self.worker.request_id is not None,
            "age_s": round(now - self.started_at, 3),
            "idle_s": round(now - self.last_used, 3) if self.worker.request_id is None else 0.0,
        }


@dataclass
class SessionTable:
    """The broker's sessions, by client connection; the idle and length bounds the operator set."""

    idle_seconds: float
    max_seconds: float
    clock: Callable[[], float] = time.monotonic
    by_client: dict[bytes, Session] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_client)

    def of(self, client: bytes) -> Session | None:
        return self.by_client.get(client)

    def of_worker(self, identity: WorkerId) -> Session | None:
        return next((s for s in self.by_client.values() if s.worker.identity == identity), None)

    def keep(self, client: bytes, worker: Worker, gpu_ids: tuple[int, ...]) -> Session | None:
        """After a program of ``client`` completed in ``worker``: the session it goes on in, or None
        where it may not (past its length, or a different worker than the client's session's)."""
        now = self.clock()
        session = self.by_client.get(client)
        if session is None:
            session = self.by_client[client] = Session(client, worker, tuple(gpu_ids), now, now)
            return session
        if session.worker is not worker or now - session.started_at >= self.max_seconds:
            return None
        session.last_used = now
        session.programs += 1
        return session

    def end(self, session: Session) -> None:
        if self.by_client.get(session.client) is session:
            del self.by_client[session.client]

    def expired(self, gone_clients: set[bytes] | frozenset[bytes] = frozenset()) -> list[Session]:
        """Idle sessions past a bound, or whose client is gone (a running program ends them itself)."""
        now = self.clock()

        def over(s: Session) -> bool:
            idle, age = now - s.last_used, now - s.started_at
            return idle >= self.idle_seconds or age >= self.max_seconds or s.client in gone_clients

        return [s for s in self.by_client.values() if s.worker.request_id is None and over(s)]

    def ending(self, reachable: Callable[[bytes], bool]) -> list[tuple[Session, str]]:
        """The sessions to end now, with why: idle past a bound, or their client's connection gone
        (``reachable``: whether a message to it can be routed, a HEARTBEAT say)."""
        if not self.by_client:
            return []
        gone = {client for client in list(self.by_client) if not reachable(client)}
        return [(s, "its client is gone" if s.client in gone else "idle or at its length") for s in self.expired(gone)]

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [s.describe(now) for s in self.by_client.values()]


__all__ = ["Session", "SessionTable"]
