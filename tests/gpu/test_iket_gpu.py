"""``kcoral iket`` against NVIDIA's real run-iket on an SM90+ GPU, through a broker with the default
sandbox (bubblewrap where it runs): the CuTe DSL kernel of examples/iket/ with three named IKET
stages comes back as a timeline whose JSON holds those stages, and the same kernel without markers
gets run-iket's own answer and exit status, not a hang.

Needs run-iket (the nvidia-cutlass-dsl 4.8.1 wheels: ``pip install 'kcoral[iket]'``, or
``benchmarks/gpu_batch_iket.sh``). Run on a GPU host::

    python3 -m pytest -q -m gpu -rA tests/gpu/test_iket_gpu.py

``KCORAL_IKET_OUT=DIR`` keeps each run's output and trace files there (the GPU batch collects them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from kcoral.tools.iket_trace import read_summary
from tests.helpers import RunningBroker, start_broker

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "iket" / "row_sum_iket.py"
STAGES = {"accumulate", "warp_reduce", "store"}
ROWS, COLS = 1024, 4096  # 1024 warps, one per row: a small whole-grid trace
RUN_TIMEOUT_S = 300  # run-iket runs the script twice; each imports torch and JIT-compiles the kernel


def _run_iket_installed() -> bool:
    beside = Path(sys.executable).parent / "run-iket"
    return importlib.util.find_spec("cutlass") is not None and (shutil.which("run-iket") is not None or beside.exists())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0), reason="IKET needs SM90 or newer"
    ),
    pytest.mark.skipif(not _run_iket_installed(), reason="needs run-iket (the nvidia-cutlass-dsl wheels)"),
]

try:
    check_bwrap()
    SANDBOX = "bubblewrap"
except SandboxUnavailable:
    SANDBOX = "none"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    running = start_broker(tmp_path_factory.mktemp("iket-broker"), "--sandbox", SANDBOX)
    yield running
    running.stop()


def kcoral_iket(cwd: Path, url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(EXAMPLE, cwd / EXAMPLE.name)
    env = {**os.environ, "KCORAL_URL": url}
    done = subprocess.run(
        [sys.executable, "-m", "kcoral.cli", "iket", "--timeout", str(RUN_TIMEOUT_S), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S + 60,
    )
    keep = os.environ.get("KCORAL_IKET_OUT")
    if keep:
        name = "-".join(a.strip("-") for a in argv if a.startswith("--") and a != "--")[:60] or "run"
        folder = Path(keep) / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "stdout.txt").write_text(done.stdout)
        (folder / "stderr.txt").write_text(f"exit status {done.returncode}\n{done.stderr}")
        for entry in cwd.iterdir():
            if entry.is_dir():
                shutil.copytree(entry, folder / entry.name, dirs_exist_ok=True)
    return done


def test_the_example_s_timeline_comes_back_with_its_three_stages(broker: RunningBroker, tmp_path: Path) -> None:
    done = kcoral_iket(
        tmp_path,
        broker.url,
        "--output-dir",
        "row-sum-trace",
        "--",
        EXAMPLE.name,
        "--rows",
        str(ROWS),
        "--cols",
        str(COLS),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" (ok), pass ") == 2, done.stdout  # the tracker pass and the traced one
    trace = tmp_path / "row-sum-trace"
    jsons = sorted(trace.glob("iket_pid_*.trace.json"))
    assert jsons, f"no trace JSON came back: {sorted(p.name for p in trace.iterdir())}\n{done.stderr}"
    assert sorted(trace.glob("iket_pid_*.pftrace")), done.stderr
    summary = read_summary(jsons[-1])
    ranges = {stage.name: stage for stage in summary.stages if stage.kind == "range"}
    assert STAGES <= set(ranges), (summary, done.stderr)
    for name in STAGES:
        # One range of each stage per warp (a warp per row); the reduction and the store take one
        # or two %globaltimer ticks of 32 ns on the H200, the accumulation microseconds.
        assert ranges[name].count == ROWS, ranges[name]
        assert min(ranges[name].durations) >= 0, ranges[name]
        assert f"stage {name}: {ROWS} ranges, median " in done.stderr
    assert (ranges["accumulate"].median or 0) > max(ranges["store"].median or 0, ranges["warp_reduce"].median or 0)
    assert summary.unit == "ns", summary
    assert f"kcoral iket: trace row-sum-trace/{jsons[-1].name} (" in done.stderr


def test_the_kernel_without_markers_gets_run_iket_s_own_answer(broker: RunningBroker, tmp_path: Path) -> None:
    done = kcoral_iket(
        tmp_path, broker.url, "--output-dir", "no-markers", "--", EXAMPLE.name, "--no-markers", "--rows", "64"
    )
    # run-iket's own status, whatever it is; neither a timeout nor a missing tool.
    assert done.returncode not in (124, 127), done.stdout + done.stderr
    assert "stage accumulate" not in done.stderr
    assert "wrote no trace" in done.stderr or "no named IKET range or marker" in done.stderr, done.stderr
