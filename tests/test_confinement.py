"""A sandboxed worker sees exactly the GPUs its program leased (stand-in device nodes of fake GPUs).

The broker runs with ``--sandbox bubblewrap --fake-gpus 3``: every slot's sandbox holds the three
stand-in nodes at ``/dev/nvidia0..2``, and each worker keeps only its program's before the program
runs, then drops every capability (kcoral.worker.confinement).
"""

from __future__ import annotations

import asyncio
import mmap
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral import AsyncClient, Program, ProgramResult
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from kcoral.worker.confinement import DevEntry, capabilities_left, dev_entries_kept, holds_gpu_device
from tests.helpers import RunningBroker, start_broker

PROGRAM_TIMEOUT_S = 60

LOOK_AROUND = """
import ctypes, glob, os

def look(other_cvd):
    seen = {"nodes": sorted(glob.glob("/dev/nvidia*")), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "order": os.environ.get("CUDA_DEVICE_ORDER"), "gpu_ids": os.environ.get("KCORAL_GPU_IDS")}
    os.environ["CUDA_VISIBLE_DEVICES"] = other_cvd  # rewriting it reaches no other node
    opened = []
    for minor in range(4):
        try:
            with open(f"/dev/nvidia{minor}") as node:
                opened.append(node.read().strip())
        except OSError as exc:
            opened.append(type(exc).__name__)
    seen["opened"] = opened
    status = open("/proc/self/status").read()
    seen["status"] = {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines())
                      if k.startswith("Cap") or k == "NoNewPrivs"}
    others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    seen["other_roots"] = [p for p in others if os.path.exists(f"/proc/{p}/root/dev")]
    libc = ctypes.CDLL(None, use_errno=True)
    seen["unshare"] = libc.unshare(0x20000)  # CLONE_NEWNS: needs CAP_SYS_ADMIN, gone
    seen["mount"] = libc.mount(b"none", b"/dev", b"tmpfs", 0, None)
    return seen
"""


def look_program(other_cvd: str) -> Program:
    program = Program()
    module = program.upload(kind="module", source=LOOK_AROUND)
    look = program.get_function(module=module, name="look")
    program.return_(key="seen", value=program.run(fn=look, args=[other_cvd]))
    return program


@pytest.fixture(scope="module")
def confined_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    try:
        check_bwrap()
    except SandboxUnavailable as exc:
        pytest.skip(f"bwrap cannot run here: {exc}")
    broker = start_broker(tmp_path_factory.mktemp("confined"), "--sandbox", "bubblewrap", "--fake-gpus", "3")
    yield broker
    broker.stop()


async def run_all(url: str, counts: list[int]) -> list[ProgramResult]:
    async with AsyncClient(url) as client:
        return list(
            await asyncio.gather(
                *(client.execute(look_program("0,1,2"), gpu_count=n, timeout_seconds=PROGRAM_TIMEOUT_S) for n in counts)
            )
        )


def test_each_program_sees_exactly_its_leased_gpu_nodes(confined_broker: RunningBroker) -> None:
    # One-GPU programs on every slot, then two- and three-GPU programs (wherever they land).
    results = asyncio.run(run_all(confined_broker.url, [1, 1, 1, 2, 3, 1]))
    assert {r.gpu_ids[0] for r in results if len(r.gpu_ids) == 1} == {0, 1, 2}
    for result in results:
        assert result.completed, result.error
        seen = result.results["seen"]
        leased = result.gpu_ids
        assert leased == sorted(leased)
        assert seen["nodes"] == [f"/dev/nvidia{g}" for g in leased]
        # CUDA numbers the GPUs it can open: the program's are 0..k-1, in PCI (= index) order.
        assert seen["cvd"] == ",".join(str(i) for i in range(len(leased)))
        assert seen["order"] == "PCI_BUS_ID"
        assert seen["gpu_ids"] == ",".join(str(g) for g in leased)
        expected = [f"fake GPU {m}" if m in leased else "FileNotFoundError" for m in range(4)]
        assert seen["opened"] == expected


def test_a_program_keeps_no_capability_and_cannot_reach_other_processes_roots(
    confined_broker: RunningBroker,
) -> None:
    (result,) = asyncio.run(run_all(confined_broker.url, [1]))
    assert result.completed, result.error
    seen = result.results["seen"]
    assert seen["status"] == {
        "CapInh": "0000000000000000",
        "CapPrm": "0000000000000000",
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
        "CapAmb": "0000000000000000",
        "NoNewPrivs": "1",
    }
    assert seen["other_roots"] == []  # bubblewrap's init and the zygote: covered
    assert seen["unshare"] == -1
    assert seen["mount"] == -1


def test_health_names_the_fake_gpus_served(confined_broker: RunningBroker) -> None:
    from kcoral import Client

    with Client(confined_broker.url) as client:
        health = client.health()
    assert health["sandbox"] == "bubblewrap"
    assert sorted(health["leases"]) == ["0", "1", "2"]


# --- the pure parts ---


def test_dev_entries_kept_per_lease_set() -> None:
    entries = [
        DevEntry("fd", "symlink"),
        DevEntry("null", "node"),
        DevEntry("nvidia-uvm", "node"),
        DevEntry("nvidia0", "node"),
        DevEntry("nvidia1", "node"),
        DevEntry("nvidia2", "node"),
        DevEntry("nvidia5", "node"),  # a GPU the broker does not serve
        DevEntry("nvidiactl", "node"),
        DevEntry("shm", "dir"),
    ]
    # GPU index -> node: the minors are not the indices.
    nodes = {0: "/dev/nvidia2", 1: "/dev/nvidia0", 2: "/dev/nvidia1"}
    shared = ["fd", "null", "nvidia-uvm", "nvidiactl", "shm"]

    def kept(gpu_ids: list[int]) -> list[str]:
        return [e.name for e in dev_entries_kept(entries, nodes, gpu_ids)]

    assert kept([0]) == sorted([*shared, "nvidia2"])
    assert kept([1]) == sorted([*shared, "nvidia0"])
    assert kept([0, 2]) == sorted([*shared, "nvidia1", "nvidia2"])
    assert kept([0, 1, 2]) == sorted([*shared, "nvidia0", "nvidia1", "nvidia2"])
    assert kept([]) == shared
    assert kept([7]) == shared  # unknown: nothing


def test_capabilities_left_reads_the_status_text() -> None:
    status = "Name:\tpython3\nCapInh:\t0000000000000000\nCapPrm:\t0000000000200000\nCapEff:\t0000000000200000\n"
    status += "CapBnd:\t0000000000200100\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\n"
    assert capabilities_left(status) == {
        "CapPrm": "0000000000200000",
        "CapEff": "0000000000200000",
        "CapBnd": "0000000000200100",
    }


def test_a_reused_worker_serves_only_its_gpu_set_and_is_retired_for_another(tmp_path) -> None:  # type: ignore[no-untyped-def]
    try:
        check_bwrap()
    except SandboxUnavailable as exc:
        pytest.skip(f"bwrap cannot run here: {exc}")
    broker = start_broker(tmp_path, "--sandbox", "bubblewrap", "--fake-gpus", "2", "--max-programs-per-worker", "0")
    try:
        ones = [r for _ in range(2) for r in asyncio.run(run_all(broker.url, [1, 1]))]
        pair = asyncio.run(run_all(broker.url, [2]))
        after = asyncio.run(run_all(broker.url, [1]))
    finally:
        broker.stop()
    for result in [*ones, *pair, *after]:
        assert result.completed, result.error
        assert result.results["seen"]["nodes"] == [f"/dev/nvidia{g}" for g in result.gpu_ids]
    # Reused: the same worker ran its slot's one-GPU programs, on the same GPU each time.
    by_worker: dict[str, set[int]] = {}
    for result in ones:
        by_worker.setdefault(result.worker["identity"], set()).update(result.gpu_ids)
    assert len(by_worker) <= 2 and all(len(gpus) == 1 for gpus in by_worker.values())
    assert pair[0].gpu_ids == [0, 1] and pair[0].worker["identity"] not in by_worker


def test_a_process_holding_a_gpu_device_is_told_from_one_that_holds_none(tmp_path: Path) -> None:
    # Stand-ins for /dev/nvidia0 (a real one cannot be opened without the driver): what counts is
    # the path a descriptor or a mapping leads to.
    node = tmp_path / "dev" / "nvidia0"
    node.parent.mkdir()
    node.write_bytes(b"\0" * mmap.PAGESIZE)
    holder = "import sys, time; f = open(sys.argv[1], 'rb'); print('ready', flush=True); time.sleep(30)"
    mapper = (
        "import mmap, sys, time; f = open(sys.argv[1], 'rb');"
        " m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); f.close();"
        " print('ready', flush=True); time.sleep(30)"
    )
    idle = "import time; print('ready', flush=True); time.sleep(30)"
    found = {}
    for name, code in (("fd", holder), ("mapping", mapper), ("none", idle)):
        process = subprocess.Popen([sys.executable, "-c", code, str(node)], stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
            found[name] = holds_gpu_device(process.pid)
        finally:
            process.kill()
            process.wait()
        assert holds_gpu_device(process.pid) is False  # gone: holds nothing
    assert found == {"fd": True, "mapping": True, "none": False}
