"""The per-host GPU lease table: one token per GPU, all-or-nothing grants, FIFO waiters.

A program that does GPU work holds the tokens of the GPUs it uses while it measures, so that
programs on one GPU take turns and programs on different GPUs run in parallel. The broker runs one
:class:`LeaseTable` on its asyncio event loop (no threads, so no locks: every state change below
happens between two ``await`` points).

Rules:

- **All or nothing.** :meth:`LeaseTable.acquire` grants every requested token at once, or none: a
  waiter never holds part of its request, so two multi-GPU programs cannot deadlock.
- **FIFO per GPU.** A waiter is granted only when all its GPUs are free *and* no earlier waiter
  still waits for any of them. A 3-GPU waiter therefore blocks later 1-GPU waiters on its GPUs (no
  starvation), while waiters on disjoint GPUs go ahead in parallel.
- **No leak.** A cancelled ``acquire`` leaves the queue; if its grant landed in the same tick the
  tokens go back. :meth:`LeaseTable.reclaim` frees the tokens of a dead holder and fails its wait
  with :class:`LeaseReclaimed`.

Example::

    table = LeaseTable([0, 1, 2, 3])
    grant = await table.acquire("req-1", [0, 1])
    try:
        ...  # run on GPUs 0 and 1
    finally:
        table.release("req-1")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LeaseGrant", "LeaseReclaimed", "LeaseTable", "choose_gpus"]

_MS_PER_S = 1000.0


class LeaseReclaimed(Exception):
    """Raised in acquire() when the holder was reclaimed while waiting."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"lease of {holder!r} was reclaimed before it was granted")
        self.holder = holder


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """The tokens one holder got: which GPUs, and when it asked and got them (monotonic clock).

    ``granted_at - requested_at`` is the time spent waiting (the result's ``lease_wait_ms``).
    """

    holder: str
    gpus: tuple[int, ...]
    requested_at: float
    granted_at: float


@dataclass(eq=False, slots=True)
class _Waiter:
    holder: str
    gpus: frozenset[int]
    requested_at: float
    future: asyncio.Future[LeaseGrant] = field(repr=False)


class LeaseTable:
    """GPU lease tokens of one host, shared by every worker slot of the broker.

    Not thread-safe: use it from the one event loop that runs the broker.
    """

    def __init__(self, gpus: Sequence[int], *, clock: Callable[[], float] = time.monotonic) -> None:
        """Make one token per GPU id in ``gpus``; ``clock`` is injectable for tests."""
        ids = tuple(gpus)
        for gpu in ids:
            if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
                raise ValueError(f"GPU ids must be non-negative integers, got {gpu!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate GPU ids in {list(ids)}")
        self._gpus: tuple[int, ...] = tuple(sorted(ids))
        self._clock = clock
        self._token_holder: dict[int, str | None] = dict.fromkeys(self._gpus)
        self._grants: dict[str, LeaseGrant] = {}
        # Every pending waiter in arrival order; the dict keys give per-holder lookup and the
        # insertion order *is* the FIFO order (a holder can wait only once at a time).
        self._waiters: dict[str, _Waiter] = {}

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPU ids of this table, sorted."""
        return self._gpus

    async def acquire(self, holder: str, gpus: Sequence[int]) -> LeaseGrant:
        """Wait until ``holder`` gets the tokens of every GPU in ``gpus`` at once; return the grant.

        Raises :class:`ValueError` for an empty, duplicated or unknown GPU list, or for a holder
        that already holds or waits; :class:`LeaseReclaimed` when :meth:`reclaim` ends the wait.
        Cancelling the caller removes the wait and returns any tokens granted in the same tick.
        """
        wanted = self._check_request(holder, gpus)
        requested_at = self._clock()
        if self._eligible(wanted, blocked=self._waited_gpus()):
            return self._grant(holder, wanted, requested_at)

        waiter = _Waiter(holder, wanted, requested_at, asyncio.get_running_loop().create_future())
        self._waiters[holder] = waiter
        try:
            grant = await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if self._grants.get(holder) is not grant:
            # Granted, then released or reclaimed before this task resumed: the tokens are gone.
            raise LeaseReclaimed(holder)
        return grant

    def release(self, holder: str) -> LeaseGrant | None:
        """Free every token of ``holder`` and wake the waiters that can now go, in FIFO order.

        Returns the grant that was freed, or ``None`` if ``holder`` held nothing. A pending wait
        of ``holder`` is left alone (use :meth:`reclaim` to end it).
        """
        grant = self._grants.pop(holder, None)
        if grant is None:
            return None
        for gpu in grant.gpus:
            self._token_holder[gpu] = None
        self._dispatch()
        return grant

    def reclaim(self, holder: str) -> None:
        """Take everything back from a dead ``holder``: free its tokens and fail its pending wait.

        A pending :meth:`acquire` of ``holder`` raises :class:`LeaseReclaimed`. Unknown holders are
        ignored, so a supervisor may call this for every worker that exits.
        """
        waiter = self._waiters.pop(holder, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(LeaseReclaimed(holder))
        # release() dispatches; dispatch anyway for the waiter that left the queue.
        if self.release(holder) is None and waiter is not None:
            self._dispatch()

    def holder_of(self, gpu: int) -> str | None:
        """The holder of ``gpu``'s token, or ``None`` if it is free (ValueError if unknown)."""
        if gpu not in self._token_holder:
            raise ValueError(f"unknown GPU id {gpu!r}; this host has {list(self._gpus)}")
        return self._token_holder[gpu]

    def waiting(self) -> int:
        """How many acquirers are waiting."""
        return len(self._waiters)

    def snapshot(self) -> dict[str, object]:
        """The table for ``health()``: per GPU id (a string), its holder, since when, its waiters.

        Example::

            {"0": {"holder": "req-1", "held_for_ms": 12.5, "waiters": ["req-2", "req-3"]},
             "1": {"holder": None, "held_for_ms": None, "waiters": []}}
        """
        now = self._clock()
        state: dict[str, object] = {}
        for gpu in self._gpus:
            holder = self._token_holder[gpu]
            held_for_ms = None if holder is None else round((now - self._grants[holder].granted_at) * _MS_PER_S, 3)
            state[str(gpu)] = {
                "holder": holder,
                "held_for_ms": held_for_ms,
                "waiters": [w.holder for w in self._waiters.values() if gpu in w.gpus],
            }
        return state

    def _check_request(self, holder: str, gpus: Sequence[int]) -> frozenset[int]:
        ids = tuple(gpus)
        if not ids:
            raise ValueError("a lease needs at least one GPU")
        wanted = frozenset(ids)
        if len(wanted) != len(ids):
            raise ValueError(f"duplicate GPU ids in {list(ids)}")
        unknown = sorted(g for g in ids if g not in self._token_holder)
        if unknown:
            raise ValueError(f"unknown GPU ids {unknown}; this host has {list(self._gpus)}")
        if holder in self._grants:
            raise ValueError(f"{holder!r} already holds GPUs {list(self._grants[holder].gpus)}")
        if holder in self._waiters:
            raise ValueError(f"{holder!r} is already waiting for a lease")
        return wanted

    def _waited_gpus(self) -> set[int]:
        return {gpu for waiter in self._waiters.values() for gpu in waiter.gpus}

    def _eligible(self, wanted: Iterable[int], *, blocked: set[int]) -> bool:
        return all(self._token_holder[g] is None and g not in blocked for g in wanted)

    def _grant(self, holder: str, wanted: frozenset[int], requested_at: float) -> LeaseGrant:
        grant = LeaseGrant(holder, tuple(sorted(wanted)), requested_at, self._clock())
        for gpu in grant.gpus:
            self._token_holder[gpu] = holder
        self._grants[holder] = grant
        return grant

    def _dispatch(self) -> None:
        """Grant, in arrival order, each waiter whose GPUs are free and unclaimed by earlier ones.

        Tokens are assigned here, before any waiter resumes, so a newcomer cannot slip in between.
        """
        blocked: set[int] = set()
        for waiter in list(self._waiters.values()):
            if self._eligible(waiter.gpus, blocked=blocked):
                del self._waiters[waiter.holder]
                waiter.future.set_result(self._grant(waiter.holder, waiter.gpus, waiter.requested_at))
            else:
                blocked |= waiter.gpus

    def _abandon(self, waiter: _Waiter) -> None:
        """Clean up after a cancelled acquire: leave the queue, or give back a same-tick grant."""
        if self._waiters.get(waiter.holder) is waiter:
            del self._waiters[waiter.holder]
            self._dispatch()
        elif (
            waiter.future.done()
            and not waiter.future.cancelled()
            and waiter.future.exception() is None
            and self._grants.get(waiter.holder) is waiter.future.result()
        ):
            self.release(waiter.holder)


def choose_gpus(table_load: Mapping[int, int], count: int, preferred: int | None) -> tuple[int, ...]:
    """Pick ``count`` GPU ids for a program: ``preferred`` first, then the least loaded others.

    ``table_load`` maps every GPU id of the host to its load (holders plus waiters, say); ties go
    to the lower id. ``preferred`` is the worker's own GPU, where its CUDA context already lives.

    Example::

        >>> choose_gpus({0: 2, 1: 0, 2: 1, 3: 0}, 3, preferred=2)
        (2, 1, 3)
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if count > len(table_load):
        raise ValueError(f"count {count} exceeds the {len(table_load)} GPUs of this host")
    if preferred is not None and preferred not in table_load:
        raise ValueError(f"preferred GPU {preferred!r} is not one of {sorted(table_load)}")
    chosen = [] if preferred is None else [preferred]
    others = sorted((load, gpu) for gpu, load in table_load.items() if gpu != preferred)
    chosen.extend(gpu for _, gpu in others[: count - len(chosen)])
    return tuple(chosen)
