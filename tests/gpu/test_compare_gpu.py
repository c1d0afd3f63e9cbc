"""GPU tests of compare() and of the provenance of a real result (issue 22's H200 checks; skipped
without a CUDA GPU).

Run on a GPU host (the `gpu` extra installed, for CUPTI and NVML)::

    python3 -m pytest -q -m gpu tests/gpu/test_compare_gpu.py

The comparisons run in this process (the cases are in ``tests/gpu/compare_cases.py``; the table
printer ``benchmarks/compare_gpu.py`` runs the same); the provenance through a real broker on the
host's GPUs (bubblewrap where it runs) and through a router in front of it.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral import Client, Program
from kcoral.testing import start_router
from tests.helpers import RunningBroker, start_broker

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python"),
    pytest.mark.timeout(600),
]

CASES = Path(__file__).with_name("compare_cases.py")


@pytest.fixture(scope="module")
def cases() -> Any:
    from tests.gpu import compare_cases

    return compare_cases


def test_a_kernel_against_itself_is_same_in_10_of_10(cases: Any) -> None:
    rows = cases.self_vs_self(runs=10)
    assert [row["verdict"] for row in rows] == ["same"] * 10, rows
    assert all(row["contains_one"] for row in rows), rows


def test_three_percent_more_work_is_slower_in_9_of_10(cases: Any) -> None:
    rows = cases.more_work(runs=10)
    slower = [row for row in rows if row["verdict"] == "slower" and row["ratio_low"] > 1.0]
    assert len(slower) >= 9, rows
    assert all(1.01 < row["ratio"] < 1.06 for row in rows), rows


def test_the_matmul_against_a_slower_variant_agrees_with_the_medians_apart(cases: Any) -> None:
    for row in cases.matmul_vs_slower(runs=3):
        assert row["verdict"] == "slower", row
        assert 1.3 < row["ratio"] < 1.7, row
        assert abs(row["ratio_vs_apart"]) <= 0.02, row


def test_the_adaptive_stop_on_the_honest_workloads(cases: Any) -> None:
    for name, row in cases.adaptive_stop().items():
        assert row["stop"] in ("target", "budget"), (name, row)
        if row["stop"] == "target":
            assert row["halfwidth"] <= 0.002, (name, row)
        assert row["verdict"] in ("same", "unclear"), (name, row)
        assert row["samples"] > 0, (name, row)
        if name != "small_mlp":  # host-bound: its host time may read far above its GPU time
            assert row["integrity"] == "ok", (name, row)


def test_a_gpu_held_busy_by_another_process_is_never_faster(cases: Any) -> None:
    busy = cases.busy_process(60)
    try:
        rows = cases.self_vs_self(runs=3)
    finally:
        busy.kill()
        busy.wait()
    for row in rows:
        assert row["verdict"] != "faster", row
        assert row["integrity"] == "suspect" or row["verdict"] == "unclear", row


@pytest.fixture(scope="module")
def gpu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    # One run of the broker's defaults on this host's GPUs, as a server would be started.
    broker = start_broker(tmp_path_factory.mktemp("compare-broker"), "--sandbox", "auto")
    yield broker
    broker.stop()


def compare_program() -> Program:
    program = Program()
    module = program.upload(kind="module", source=CASES.read_text())
    run = program.get_function(module=module, name="self_vs_self")
    program.return_(key="rows", value=program.run(fn=run, args=[1]))
    return program


def check_gpu_provenance(result: Any, node_id: str | None) -> None:
    assert result.status == "COMPLETED", result.error
    assert result.results["rows"][0]["verdict"] in ("same", "unclear")
    provenance = result.provenance
    assert provenance["request_id"] == result.request_id and provenance["node_id"] == node_id
    assert provenance["device"] == "gpu" and provenance["sandbox"] in ("bubblewrap", "none")
    (gpu,) = provenance["gpus"]
    assert gpu["index"] == result.gpu_ids[0] and gpu["uuid"].startswith("GPU-")
    assert gpu["name"] and gpu["pci_bus_id"]
    versions = provenance["versions"]
    for name in ("kcoral", "python", "torch", "cupti-python", "driver", "cuda_driver"):
        assert versions[name], (name, versions)
    for when in ("start", "end"):
        reading = provenance["gpu_conditions"][when][str(gpu["index"])]
        assert reading["temperature_c"] > 0 and reading["sm_clock_mhz"] > 0, reading
    assert provenance["program"]["modules"] and len(provenance["program"]["digest"]) == 64
    claims = provenance["program_claims"]
    assert isinstance(claims["seeds"]["compare"], int) and claims["torch_cuda"]


def test_provenance_of_a_real_result_and_through_a_router(gpu_broker: RunningBroker, tmp_path: Path) -> None:
    with Client(gpu_broker.url) as client:
        check_gpu_provenance(client.execute(compare_program(), timeout_seconds=300), None)
    gpu_broker.stop()  # the node below takes the GPU
    router = start_router(tmp_path)
    assert router.nodes_url is not None
    try:
        node = start_broker(tmp_path, "--sandbox", "auto", "--upstream", router.nodes_url, "--node-id", "h200")
        try:
            deadline = time.monotonic() + 30
            while router.nodes().get("h200", {}).get("state") != "live":
                assert time.monotonic() < deadline, router.nodes()
                time.sleep(0.2)
            with Client(router.url) as client:
                check_gpu_provenance(client.execute(compare_program(), timeout_seconds=300), "h200")
        finally:
            node.stop()
    finally:
        router.stop()


def test_kcoral_remote_compares_two_candidates(tmp_path: Path) -> None:
    """The trusted path's two-candidate form: the add against itself and against 1.03x its work."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    workload = repo / "examples" / "workloads" / "add"
    (tmp_path / "same.py").write_text("import torch\n\ndef custom_kernel(a, b):\n    return torch.add(a, b)\n")
    (tmp_path / "more.py").write_text(
        "import torch\n\ndef custom_kernel(a, b):\n"
        "    n = int(a.numel() * 0.03)\n"
        "    out = torch.add(a, b)\n"
        "    torch.add(a[:n], b[:n])  # 3% more work, the same output\n"
        "    return out\n"
    )
    broker = start_broker(tmp_path / "broker", "--sandbox", "auto")
    try:
        for other, expected in (("same.py", ("same", "unclear")), ("more.py", ("slower",))):
            done = subprocess.run(
                [sys.executable, "-m", "kcoral.cli", "remote", "--remote", broker.url, "--timeout", "300", "--",
                 str(workload), str(workload / "candidate.py"), other],
                capture_output=True, text=True, timeout=400, cwd=tmp_path,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            report = json.loads(done.stdout)
            assert report["correct"] is True and report["verdict"] in expected, report
    finally:
        broker.stop()
