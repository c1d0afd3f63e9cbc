"""GPU leases through a real broker with fake GPUs: turns on one GPU, parallel GPUs, multi-GPU sets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral import AsyncClient, Client, KCoralError, Program
from tests.helpers import RunningBroker, start_broker

GPU_WORK = """
import os, time

def gpu_work(seconds):
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}

def cpu_work(seconds):
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time()}
"""


def sleeper(seconds: float, *, cpu_only: bool = False) -> Program:
    program = Program()
    module = program.upload(kind="module", source=GPU_WORK)
    name = "cpu_work" if cpu_only else "gpu_work"
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    program.return_(key="span", value=program.run(fn=fn, args=[seconds]))
    return program


async def run_all(url: str, jobs: list[tuple[Program, dict[str, Any]]], stagger: float = 0.0) -> list[Any]:
    async with AsyncClient(url) as client:

        async def one(i: int, program: Program, options: dict[str, Any]) -> Any:
            await asyncio.sleep(i * stagger)
            return await client.execute(program, **options)

        return await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(jobs)))


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_one_gpu_two_workers_take_turns_and_cpu_only_needs_no_lease(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory("--fake-gpus", "1", "--workers-per-gpu", "2")
    first, second = asyncio.run(run_all(broker.url, [(sleeper(1.0), {}), (sleeper(1.0), {})]))
    assert first.completed and second.completed
    assert not overlap(first.results["span"], second.results["span"])
    assert max(first.lease_wait_ms, second.lease_wait_ms) > 400
    assert first.lease_held_ms >= 900 and second.lease_held_ms >= 900
    # A cpu_only run holds no lease: it runs while a GPU run holds the only token.
    gpu, cpu = asyncio.run(run_all(broker.url, [(sleeper(1.0), {}), (sleeper(1.0, cpu_only=True), {})], stagger=0.2))
    assert overlap(gpu.results["span"], cpu.results["span"])
    assert cpu.lease_held_ms == 0 and cpu.lease_wait_ms == 0


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker with two fake GPUs, one worker each, for the tests that only run programs on it."""
    broker = start_broker(tmp_path_factory.mktemp("two-gpus"), "--fake-gpus", "2")
    yield broker
    broker.stop()


def test_two_gpus_run_at_the_same_time(two_gpus: RunningBroker) -> None:
    broker = two_gpus
    a, b = asyncio.run(run_all(broker.url, [(sleeper(1.0), {}), (sleeper(1.0), {})]))
    assert overlap(a.results["span"], b.results["span"])
    assert sorted(a.gpu_ids + b.gpu_ids) == [0, 1]
    assert a.results["span"]["cvd"] == str(a.gpu_ids[0])


def test_multi_gpu_sets_all_or_nothing_and_no_starvation(broker_factory) -> None:  # type: ignore[no-untyped-def]
    broker = broker_factory("--fake-gpus", "4")
    pair_a, pair_b, pair_c = asyncio.run(
        run_all(broker.url, [(sleeper(1.0), {"gpu_count": 2}) for _ in range(3)], stagger=0.1)
    )
    for result in (pair_a, pair_b, pair_c):
        assert result.completed, result.error
        assert len(result.gpu_ids) == 2
        assert result.results["span"]["cvd"] == ",".join(map(str, result.gpu_ids))
    assert overlap(pair_a.results["span"], pair_b.results["span"])
    assert not set(pair_a.gpu_ids) & set(pair_b.gpu_ids)
    third_start = pair_c.results["span"]["start"]
    assert third_start >= min(pair_a.results["span"]["end"], pair_b.results["span"]["end"]) - 0.05

    # A 3-GPU program is not starved by a stream of single-GPU programs arriving after it.
    jobs: list[tuple[Program, dict[str, Any]]] = (
        [(sleeper(0.6), {})] + [(sleeper(0.3), {"gpu_count": 3})] + [(sleeper(0.6), {}) for _ in range(6)]
    )
    results = asyncio.run(run_all(broker.url, jobs, stagger=0.1))
    big = results[1]
    assert big.completed and len(big.gpu_ids) == 3
    late_singles = [r for r in results[4:]]
    # Single-GPU programs that asked after the big one and share one of its GPUs ran after it.
    for single in late_singles:
        if set(single.gpu_ids) & set(big.gpu_ids):
            assert single.results["span"]["start"] >= big.results["span"]["end"] - 0.05


def test_gpu_count_validation(two_gpus: RunningBroker) -> None:
    broker = two_gpus
    with Client(broker.url) as client:
        with pytest.raises(KCoralError) as info:
            client.execute(sleeper(0.0), gpu_count=3)
        assert info.value.kind == "capacity"
        for bad in (0, -1, 1.5, True):
            with pytest.raises((ValueError, TypeError)):
                client.execute(sleeper(0.0), gpu_count=bad)  # type: ignore[arg-type]
        result = client.execute(sleeper(0.0), gpu_count=2)
        assert sorted(result.gpu_ids) == [0, 1]
