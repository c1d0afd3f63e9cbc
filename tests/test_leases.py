"""Tests of the GPU lease table: exclusion, FIFO order, all-or-nothing, no starvation, no leaks.

Each test runs its own event loop with ``asyncio.run`` so it needs no pytest plugin or config.
The scheduling is driven by ``asyncio.sleep(0)`` ticks, so the tests are deterministic and fast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import pytest

from kcoral.broker.leases import LeaseGrant, LeaseReclaimed, LeaseTable, choose_gpus


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def settle(ticks: int = 5) -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(ticks):
        await asyncio.sleep(0)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def spawn(table: LeaseTable, holder: str, gpus: Sequence[int]) -> asyncio.Task[LeaseGrant]:
    return asyncio.get_running_loop().create_task(table.acquire(holder, gpus))


def test_one_gpu_is_exclusive_and_granted_in_fifo_order() -> None:
    async def main() -> None:
        table = LeaseTable([0])
        granted: list[str] = []
        inside = 0

        async def job(holder: str) -> None:
            nonlocal inside
            await table.acquire(holder, [0])
            inside += 1
            assert inside == 1, "two holders on one GPU"
            granted.append(holder)
            await settle(3)
            inside -= 1
            assert table.release(holder) is not None

        names = [f"req-{i}" for i in range(6)]
        tasks = []
        for name in names:
            tasks.append(asyncio.create_task(job(name)))
            await asyncio.sleep(0)  # arrival order = creation order
        await asyncio.gather(*tasks)
        assert granted == names
        assert table.holder_of(0) is None
        assert table.waiting() == 0

    run(main())


def test_disjoint_gpus_are_held_in_parallel() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1, 2])
        await table.acquire("a", [0])
        queued = spawn(table, "b", [0])
        await settle()
        assert not queued.done()
        # A waiter on GPU 0 does not hold back requests for other GPUs.
        c = await asyncio.wait_for(table.acquire("c", [1]), timeout=1)
        d = await asyncio.wait_for(table.acquire("d", [2]), timeout=1)
        assert (c.gpus, d.gpus) == ((1,), (2,))
        assert [table.holder_of(g) for g in table.gpus] == ["a", "c", "d"]
        table.release("a")
        assert (await queued).gpus == (0,)

    run(main())


def test_multi_gpu_waiter_gets_all_tokens_at_once_or_none() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1])
        await table.acquire("a", [0])
        pair = spawn(table, "pair", [1, 0])
        await settle()
        # GPU 1 is free, but the waiter must not sit on it while GPU 0 is busy ...
        assert not pair.done()
        assert table.holder_of(1) is None
        # ... and a later single-GPU request for GPU 1 queues behind it (FIFO per GPU).
        late = spawn(table, "late", [1])
        await settle()
        assert not late.done()

        table.release("a")
        grant = await pair
        assert grant.gpus == (0, 1)
        assert (table.holder_of(0), table.holder_of(1)) == ("pair", "pair")
        await settle()
        assert not late.done()
        table.release("pair")
        assert (await late).gpus == (1,)

    run(main())


def test_three_gpu_waiter_is_not_starved_by_a_stream_of_single_gpu_acquirers() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1, 2, 3])
        order: list[str] = []  # grant order
        arrived: dict[str, int] = {}  # holder -> arrival number
        big_arrival = 0
        big_started = asyncio.Event()

        async def job(holder: str, gpus: list[int], hold_ticks: int) -> None:
            arrived[holder] = len(arrived)
            await table.acquire(holder, gpus)
            order.append(holder)
            await settle(hold_ticks)
            table.release(holder)

        async def stream() -> None:
            nonlocal big_arrival
            tasks = []
            for i in range(60):
                if i == 10:
                    big_arrival = len(arrived)
                    tasks.append(asyncio.create_task(job("big", [0, 1, 2], 2)))
                    big_started.set()
                # Overlapping single-GPU leases keep every one of GPUs 0-2 busy all the time.
                tasks.append(asyncio.create_task(job(f"s{i}", [i % 4], 4)))
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)

        await asyncio.wait_for(stream(), timeout=1)
        assert big_started.is_set()
        big_at = order.index("big")
        later_on_big_gpus = [h for h, n in arrived.items() if h != "big" and n > big_arrival and int(h[1:]) % 4 != 3]
        # Nobody who asked for GPUs 0-2 after the big waiter was served before it.
        assert all(order.index(h) > big_at for h in later_on_big_gpus)
        # GPU 3 is not part of its request, so GPU 3 traffic went on while it waited.
        assert any(
            order.index(h) < big_at
            for h, n in arrived.items()
            if h != "big" and n > big_arrival and int(h[1:]) % 4 == 3
        )
        assert table.waiting() == 0
        assert all(table.holder_of(g) is None for g in table.gpus)

    run(main())


def test_cancelled_waiter_leaves_the_queue_and_wakes_those_behind_it() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1])
        await table.acquire("a", [0])
        pair = spawn(table, "pair", [0, 1])
        behind = spawn(table, "behind", [1])
        await settle()
        assert table.waiting() == 2 and not behind.done()

        pair.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pair
        # With the pair gone, GPU 1 is free and nobody earlier waits for it.
        assert (await asyncio.wait_for(behind, timeout=1)).gpus == (1,)
        assert table.waiting() == 0
        table.release("a")
        table.release("behind")
        assert all(table.holder_of(g) is None for g in table.gpus)

        # A timeout is a cancellation too.
        await table.acquire("a", [0])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(table.acquire("slow", [0]), timeout=0.01)
        assert table.waiting() == 0
        assert table.release("slow") is None

    run(main())


def test_grant_cancelled_in_the_same_tick_gives_the_tokens_back() -> None:
    async def main() -> None:
        table = LeaseTable([0])
        await table.acquire("a", [0])
        first = spawn(table, "first", [0])
        second = spawn(table, "second", [0])
        await settle()

        table.release("a")  # hands the token to "first" ...
        assert table.holder_of(0) == "first"
        first.cancel()  # ... which is cancelled before it could resume
        with pytest.raises(asyncio.CancelledError):
            await first
        # The token was not leaked: it went on to the next waiter.
        assert (await asyncio.wait_for(second, timeout=1)).holder == "second"
        table.release("second")
        assert table.holder_of(0) is None
        assert table.waiting() == 0

    run(main())


def test_reclaim_frees_a_dead_holder_and_fails_a_dead_waiter() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1])
        await table.acquire("dead-holder", [0, 1])
        dead_waiter = spawn(table, "dead-waiter", [0])
        alive = spawn(table, "alive", [0])
        await settle()

        table.reclaim("dead-waiter")
        with pytest.raises(LeaseReclaimed):
            await dead_waiter
        assert table.waiting() == 1

        table.reclaim("dead-holder")
        assert (await asyncio.wait_for(alive, timeout=1)).gpus == (0,)
        assert table.holder_of(1) is None

        # Granted but reclaimed before the task resumed: the acquire fails, the token is free.
        granted_late = spawn(table, "granted-late", [0])
        await settle()
        table.release("alive")
        assert table.holder_of(0) == "granted-late"
        table.reclaim("granted-late")
        with pytest.raises(LeaseReclaimed):
            await granted_late
        assert table.holder_of(0) is None

        table.reclaim("nobody")  # unknown holders are ignored
        assert table.waiting() == 0

    run(main())


def test_invalid_arguments_are_refused() -> None:
    async def main() -> None:
        table = LeaseTable([0, 1])
        with pytest.raises(ValueError, match="at least one"):
            await table.acquire("x", [])
        with pytest.raises(ValueError, match="duplicate"):
            await table.acquire("x", [1, 1])
        with pytest.raises(ValueError, match="unknown"):
            await table.acquire("x", [0, 7])
        await table.acquire("x", [0])
        with pytest.raises(ValueError, match="already holds"):
            await table.acquire("x", [1])
        waiter = spawn(table, "y", [0])
        await settle()
        with pytest.raises(ValueError, match="already waiting"):
            await table.acquire("y", [1])
        # The refused calls changed nothing.
        assert table.holder_of(1) is None and table.waiting() == 1
        table.release("x")
        await waiter

    run(main())
    with pytest.raises(ValueError, match="duplicate"):
        LeaseTable([0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        LeaseTable([-1])
    with pytest.raises(ValueError, match="unknown"):
        LeaseTable([0]).holder_of(3)
    assert LeaseTable([0]).release("never-held") is None


def test_snapshot_and_grant_times() -> None:
    async def main() -> None:
        clock = FakeClock()
        table = LeaseTable([2, 0, 1], clock=clock)
        assert table.gpus == (0, 1, 2)
        a = await table.acquire("a", [0, 1])
        assert (a.requested_at, a.granted_at) == (100.0, 100.0)
        b = spawn(table, "b", [1])
        c = spawn(table, "c", [0, 1])
        await settle()
        clock.now = 100.25

        assert table.snapshot() == {
            "0": {"holder": "a", "held_for_ms": 250.0, "waiters": ["c"]},
            "1": {"holder": "a", "held_for_ms": 250.0, "waiters": ["b", "c"]},
            "2": {"holder": None, "held_for_ms": None, "waiters": []},
        }
        table.release("a")
        grant_b = await b
        assert grant_b.granted_at - grant_b.requested_at == pytest.approx(0.25)
        table.release("b")
        await c
        table.release("c")

    run(main())


def test_choose_gpus() -> None:
    load = {0: 2, 1: 0, 2: 1, 3: 0}
    assert choose_gpus(load, 1, preferred=0) == (0,)
    assert choose_gpus(load, 3, preferred=2) == (2, 1, 3)
    assert choose_gpus(load, 2, preferred=None) == (1, 3)  # ties by id
    assert choose_gpus(load, 4, preferred=None) == (1, 3, 2, 0)
    for bad_count in (0, 5):
        with pytest.raises(ValueError, match="count"):
            choose_gpus(load, bad_count, preferred=None)
    with pytest.raises(ValueError, match="preferred"):
        choose_gpus(load, 1, preferred=9)
