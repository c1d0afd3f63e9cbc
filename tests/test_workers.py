"""The broker's worker pool without a broker: only the worker a zygote forked joins, an early READY
waits for its fork, exits are remembered, and the least busy fitting worker is picked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from kcoral.broker.supervisor import SlotSpec, SlotState
from kcoral.broker.workers import WorkerPool
from kcoral.protocol.worker_link import WorkerId
from kcoral.protocol.zygote_link import WorkerExit


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def pool_of(*gpus: int | None) -> tuple[WorkerPool, dict[int, SlotState]]:
    slots = {i: SlotState(SlotSpec(i, gpu, Path(f"/tmp/slot-{i}"), ("zygote",))) for i, gpu in enumerate(gpus)}
    return WorkerPool(slots), slots


def test_only_the_forked_worker_joins_and_an_early_ready_waits_for_its_fork() -> None:
    async def main() -> None:
        pool, slots = pool_of(0, 1)
        slots[0].worker = WorkerId(b"w0-1")
        assert pool.ready(WorkerId(b"w0-1"), {"slot": 0, "pid": 10}) is not None
        assert pool.ready(WorkerId(b"w0-1"), {"slot": 0}) is None  # twice
        assert pool.ready(WorkerId(b"intruder"), {"slot": 0}) is None  # not what slot 0 forked
        assert pool.ready(WorkerId(b"w9"), {"slot": 9}) is None  # no such slot
        assert pool.ready(WorkerId(b"w1-1"), {"slot": 1}) is None  # its fork not reported yet: kept
        assert b"w1-1" in pool.early_ready
        slots[1].worker = WorkerId(b"w1-1")
        joined = pool.forked(1, WorkerId(b"w1-1"))
        assert joined is not None and joined.gpu == 1
        assert pool.forked(0, WorkerId(b"intruder")) is None  # a fork of another identity lets nobody in
        assert set(pool.idle) == {b"w0-1", b"w1-1"} and pool.snapshot() == {"idle": 2, "busy": 0}

    run(main)


def test_an_exit_is_remembered_and_a_running_worker_stays_known() -> None:
    async def main() -> None:
        pool, slots = pool_of(0, 0)
        slots[0].worker, slots[1].worker = WorkerId(b"a"), WorkerId(b"b")
        a = pool.ready(WorkerId(b"a"), {"slot": 0})
        b = pool.ready(WorkerId(b"b"), {"slot": 1})
        assert a is not None and b is not None
        pool.idle.pop(WorkerId(b"b"))
        b.request_id = "r1"
        assert pool.exit(WorkerExit(0, WorkerId(b"a"), 0, None)) is None  # idle: forgotten
        assert b"a" not in pool.workers and pool.ready(WorkerId(b"a"), {"slot": 0}) is None  # a late READY
        running = pool.exit(WorkerExit(1, WorkerId(b"b"), None, 9))
        assert running is b and b.exited and b"b" in pool.workers  # its RESULT may still come
        pool.forget(b)
        assert not pool.workers and not pool.idle

    run(main)


def test_the_least_busy_fitting_worker_is_picked() -> None:
    async def main() -> None:
        pool, slots = pool_of(0, 1, 1)
        for slot in slots.values():
            slot.worker = WorkerId(f"w{slot.spec.slot}".encode())
            pool.ready(slot.worker, {"slot": slot.spec.slot})
        pool.workers[WorkerId(b"w2")].gpu_view = (0, 1)  # a reused worker confined to two GPUs
        picked = pool.pick(1, {0: 3, 1: 0})
        assert picked is not None and picked.identity == b"w1"  # GPU 1 is the less busy
        assert pool.pick(1, {0: 0, 1: 0}) is not None  # w0; w2 fits only two-GPU programs
        assert pool.pick(1, {0: 0, 1: 0}) is None
        two = pool.pick(2, {})
        assert two is not None and two.identity == b"w2"

    run(main)


def test_a_worker_with_its_cuda_context_made_ahead_serves_its_slots_gpu_alone() -> None:
    async def main() -> None:
        pool, slots = pool_of(0, 1)
        slots[0].worker, slots[1].worker = WorkerId(b"warm"), WorkerId(b"odd")
        warm = pool.ready(WorkerId(b"warm"), {"slot": 0, "gpu": 0, "gpu_view": [0]})
        odd = pool.ready(WorkerId(b"odd"), {"slot": 1, "gpu": 1, "gpu_view": [0]})  # not its slot's GPU: not taken
        assert warm is not None and warm.gpu_view == (0,)
        assert odd is not None and odd.gpu_view is None
        assert pool.pick(2, {0: 0, 1: 0}) is odd  # a two-GPU program: only the one without a context
        assert pool.pick(2, {0: 0, 1: 0}) is None
        assert pool.pick(1, {0: 0, 1: 0}) is warm

    run(main)
