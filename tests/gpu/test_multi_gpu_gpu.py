"""Every GPU of a multi-GPU host, inside bubblewrap (the broker's default), through a real broker.

Run on a host with two or more GPUs: ``python3 -m pytest -q -m gpu tests/gpu/test_multi_gpu_gpu.py``
(skipped with fewer). The broker serves every GPU with two worker slots each, in bubblewrap; each
program must see exactly the GPUs it leased: the seed example on each GPU, a two-GPU NCCL
all-reduce, leases taken in turns and all-or-nothing, and a program that reaches for a GPU it did
not lease finds none. NVLink multicast stays off everywhere (NCCL_NVLS_ENABLE=0 and friends): the
broker is started with them, the sandbox passes them on, and the programs set them again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral import AsyncClient, Client, Program, ProgramResult
from tests.helpers import RunningBroker, start_broker

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROGRAM_TIMEOUT_S = 180
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TURN_SECONDS = 2.0  # how long each program of the lease tests holds its GPUs
SLACK_MS = 600.0  # scheduling and CUDA start-up around a TURN_SECONDS hold, at most
IDLE_WAIT_S = 30.0  # for the slots' fresh workers to be READY between tests

# The seed's uploaded module, unchanged.
SEED_SOURCE = """
import torch
from kcoral.builtins import benchmark

def evaluate(n):
    x = torch.arange(n, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)

    def candidate():
        torch.add(x, 1.0, out=y)

    candidate()
    torch.testing.assert_close(y, x + 1.0)
    return {"correct": True, "timing": benchmark(candidate)}
"""

# What a program sees of the GPUs: CUDA's devices (by UUID and PCI bus id) and the device nodes.
SEEN_SOURCE = """
import glob, os

def seen(rewrite_cvd, open_nodes):
    if rewrite_cvd is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = rewrite_cvd  # before CUDA starts
    opened = {}
    for node in open_nodes:
        try:
            os.close(os.open(node, os.O_RDWR))
            opened[node] = "opened"
        except OSError as exc:
            opened[node] = type(exc).__name__
    import torch
    try:
        count = torch.cuda.device_count()
    except RuntimeError:
        count = 0
    devices = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)  # torch 2.5 and later
        pci = None if bus is None else "%04x:%02x:%02x.0" % (props.pci_domain_id, bus, props.pci_device_id)
        devices.append({"uuid": str(getattr(props, "uuid", "")), "pci": pci})
        torch.ones(1, device=f"cuda:{index}").sum().item()  # usable, not merely listed
    return {"count": count, "devices": devices, "opened": opened,
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "nodes": sorted(glob.glob("/dev/nvidia[0-9]*"))}
"""

ALL_REDUCE_SOURCE = """
import os
for name, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[name] = value

import torch
import torch.cuda.nccl as nccl

def all_reduce(n):
    count = torch.cuda.device_count()
    tensors = [torch.full((n,), float(i + 1), device=f"cuda:{i}") for i in range(count)]
    nccl.all_reduce(tensors)
    torch.cuda.synchronize()
    return {"count": count, "sums": [float(t.sum().item()) for t in tensors],
            "first": [float(t[0].item()) for t in tensors]}
"""

HOLD_SOURCE = """
import time
import torch

def hold(seconds):
    start = time.time()
    x = torch.ones(1 << 20, device="cuda")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x.mul_(1.0)
        torch.cuda.synchronize()
        time.sleep(0.01)
    return {"start": start, "end": time.time(), "devices": torch.cuda.device_count()}
"""


def _sandbox() -> str:
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap

    try:
        check_bwrap()
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap cannot run here ({exc}): these tests are about GPUs inside it")
    return "bubblewrap"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """GPUs 0 and 1 (of however many the host has), two worker slots each, in bubblewrap."""
    running = start_broker(
        tmp_path_factory.mktemp("multi-gpu"),
        *("--sandbox", _sandbox(), "--gpus", "0,1", "--workers-per-gpu", "2"),
        env=NO_MULTICAST,
    )
    yield running
    running.stop()
    if os.environ.get("OUT"):  # the GPU batch keeps the broker's log beside its own
        Path(os.environ["OUT"], "test-multi-gpu-broker.log").write_text(running.log())


@pytest.fixture(scope="module")
def gpus(broker: RunningBroker) -> list[dict[str, Any]]:
    """The broker's GPUs as health() names them, by index."""
    with Client(broker.url) as client:
        health = client.health()
    listed = health["target"]["gpus"]
    assert [g["index"] for g in listed] == [0, 1]
    assert health["gpu_count"] == 2
    return list(listed)


def _program(source: str, name: str, args: list[Any]) -> Program:
    program = Program()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name)
    program.return_(key="value", value=program.run(fn=fn, args=args))
    return program


def _seed() -> Program:
    program = Program()
    module = program.upload(kind="module", source=SEED_SOURCE)
    evaluate = program.get_function(module=module, name="evaluate")
    report = program.run(fn=evaluate, args=[4096])
    program.return_(key="report", value=report)
    return program


def _all_idle(url: str) -> None:
    """Wait until every slot has a READY worker: which GPUs programs submitted together land on
    depends on which slots are idle (the broker takes the least loaded GPU's idle worker)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    with Client(url) as client:
        while True:
            workers = client.health()["workers"]
            if workers["idle"] >= workers["slots"]:
                return
            assert time.monotonic() < deadline, f"slots not all idle after {IDLE_WAIT_S} s: {workers}"
            time.sleep(0.05)


def _together(url: str, jobs: list[tuple[Program, int]]) -> list[ProgramResult]:
    """Submit ``(program, gpu_count)`` jobs at once, once every slot is idle; their results in order."""
    _all_idle(url)
    return asyncio.run(_gather(url, jobs))


async def _gather(url: str, jobs: list[tuple[Program, int]]) -> list[ProgramResult]:
    async with AsyncClient(url) as client:
        return list(
            await asyncio.gather(*(client.execute(p, gpu_count=n, timeout_seconds=PROGRAM_TIMEOUT_S) for p, n in jobs))
        )


def _uuid(text: str) -> str:
    return text.lower().removeprefix("gpu-")


def _names_the_leased_gpus(result: ProgramResult, gpus: list[dict[str, Any]]) -> None:
    """The CUDA devices the program saw are exactly its gpu_ids, in order, as health() names them."""
    value = result.results["value"]
    leased = [gpus[i] for i in result.gpu_ids]
    assert value["count"] == len(leased), (value, result.gpu_ids)
    assert [_uuid(d["uuid"]) for d in value["devices"]] == [_uuid(g["uuid"]) for g in leased], value
    if all(d["pci"] is not None for d in value["devices"]):
        assert [d["pci"] for d in value["devices"]] == [g["pci_bus_id"] for g in leased], value
    assert value["nodes"] == sorted(g["device_node"] for g in leased), value


def test_seed_example_runs_on_each_gpu(broker: RunningBroker, gpus: list[dict[str, Any]]) -> None:
    covered: set[int] = set()
    for _ in range(3):  # two at once land on two GPUs; a third round at most, should they not
        for result in _together(broker.url, [(_seed(), 1) for _ in gpus]):
            assert result.completed, (result.error, result.stderr[-2000:])
            assert result.results["report"]["correct"] is True
            assert result.results["report"]["timing"]["latency_ms_median"] > 0
            assert len(result.gpu_ids) == 1
            covered.add(result.gpu_ids[0])
        if covered == set(range(len(gpus))):
            break
    assert covered == set(range(len(gpus)))


def test_each_program_sees_exactly_the_gpus_it_leased(broker: RunningBroker, gpus: list[dict[str, Any]]) -> None:
    jobs = [(_program(SEEN_SOURCE, "seen", [None, []]), n) for n in (1, 1, 2)]
    results = _together(broker.url, jobs)
    for result in results:
        assert result.completed, (result.error, result.stderr[-2000:])
        _names_the_leased_gpus(result, gpus)
    assert {tuple(r.gpu_ids) for r in results if len(r.gpu_ids) == 1} <= {(0,), (1,)}


def test_two_gpu_nccl_all_reduce_returns_the_sum_on_each(broker: RunningBroker) -> None:
    n = 1 << 20
    (result,) = _together(broker.url, [(_program(ALL_REDUCE_SOURCE, "all_reduce", [n]), 2)])
    assert result.completed, (result.error, result.stderr[-2000:])
    value = result.results["value"]
    assert result.gpu_ids == [0, 1]
    assert value["count"] == 2
    assert value["first"] == [3.0, 3.0]  # 1 + 2 on each GPU
    assert value["sums"] == [3.0 * n, 3.0 * n]


def test_three_one_gpu_programs_two_at_once_the_third_waits(broker: RunningBroker) -> None:
    jobs = [(_program(HOLD_SOURCE, "hold", [TURN_SECONDS]), 1) for _ in range(3)]
    results = _together(broker.url, jobs)
    for result in results:
        assert result.completed, (result.error, result.stderr[-2000:])
        assert result.results["value"]["devices"] == 1
        assert result.lease_held_ms >= TURN_SECONDS * 1000
    by_wait = sorted(results, key=lambda r: r.lease_wait_ms)
    first, second, third = by_wait
    assert {first.gpu_ids[0], second.gpu_ids[0]} == {0, 1}  # two at once, one on each GPU
    assert first.lease_wait_ms < SLACK_MS and second.lease_wait_ms < SLACK_MS
    assert third.lease_wait_ms > TURN_SECONDS * 1000 - SLACK_MS  # waited for a token
    span = {id(r): r.results["value"] for r in results}
    shared = next(r for r in (first, second) if r.gpu_ids == third.gpu_ids)
    assert span[id(third)]["start"] >= span[id(shared)]["end"] - 0.05


def test_a_two_gpu_program_and_two_one_gpu_programs_are_all_or_nothing(broker: RunningBroker) -> None:
    jobs = [(_program(HOLD_SOURCE, "hold", [TURN_SECONDS]), n) for n in (2, 1, 1)]
    pair, one, other = _together(broker.url, jobs)
    for result in (pair, one, other):
        assert result.completed, (result.error, result.stderr[-2000:])
    assert pair.gpu_ids == [0, 1] and pair.results["value"]["devices"] == 2

    def overlap(a: ProgramResult, b: ProgramResult) -> bool:
        x, y = a.results["value"], b.results["value"]
        return bool(x["start"] < y["end"] - 0.05 and y["start"] < x["end"] - 0.05)

    # Every one-GPU program shares a GPU with the pair: never at the same time as it.
    assert not overlap(pair, one) and not overlap(pair, other)
    # The pair waited for both tokens, or both singles waited for the pair: never a part of it.
    assert pair.lease_wait_ms > TURN_SECONDS * 1000 - SLACK_MS or min(one.lease_wait_ms, other.lease_wait_ms) > (
        TURN_SECONDS * 1000 - SLACK_MS
    )


def test_a_program_reaching_for_a_gpu_it_did_not_lease_gets_none(
    broker: RunningBroker, gpus: list[dict[str, Any]]
) -> None:
    nodes = [g["device_node"] for g in gpus]
    jobs = [
        (_program(SEEN_SOURCE, "seen", [",".join(str(i) for i in range(len(gpus))), nodes]), 1),
        (_program(SEEN_SOURCE, "seen", [str(len(gpus) - 1), nodes]), 1),
    ]
    for result in _together(broker.url, jobs):
        assert result.completed, (result.error, result.stderr[-2000:])
        value = result.results["value"]
        (leased,) = result.gpu_ids
        own = gpus[leased]["device_node"]
        assert value["opened"] == {n: "opened" if n == own else "FileNotFoundError" for n in nodes}, value
        # Rewriting CUDA_VISIBLE_DEVICES finds at most the program's own GPU, never another.
        assert value["count"] <= 1, value
        assert all(_uuid(d["uuid"]) == _uuid(gpus[leased]["uuid"]) for d in value["devices"]), value


def test_health_and_status_name_the_gpus_programs_see(broker: RunningBroker, gpus: list[dict[str, Any]]) -> None:
    import subprocess
    import sys

    for gpu in gpus:
        assert gpu["device_node"] and gpu["pci_bus_id"] and gpu["uuid"].startswith("GPU-")
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    )
    by_bus = {}
    for line in smi.stdout.strip().splitlines():
        bus, uuid = (p.strip() for p in line.split(","))
        by_bus[bus.lower()[-12:]] = uuid
    assert [by_bus[g["pci_bus_id"]] for g in gpus] == [g["uuid"] for g in gpus]
    status = subprocess.run(
        [sys.executable, "-m", "kcoral.cli", "status", broker.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=dict(os.environ),
    )
    for gpu in gpus:
        assert gpu["pci_bus_id"] in status.stdout, status.stdout
