"""Fresh GPU programs on a real GPU: each program's worker made its CUDA context before the program
came (``--cuda-context eager``, the default), a new context per program and on the program's GPU
alone; ``--cuda-context lazy`` leaves it to the program; with ``--gpu-handover quiet`` the next
program still never shares the GPU with a running one.

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_fresh_gpu.py``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral import Client, Program
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from tests.gpu.programs import GPU_BUSY, overlapped
from tests.helpers import RunningBroker, run_function, start_broker

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

try:
    check_bwrap()
    SANDBOX = "bubblewrap"
except SandboxUnavailable:
    SANDBOX = "none"

PROGRAM_TIMEOUT_S = 120
PROGRAMS = 6

PROBE = """
import os
import torch

def probe():
    made_ahead = torch.cuda.is_initialized()
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    return {
        "made_ahead": made_ahead,
        "pid": os.getpid(),
        "devices": torch.cuda.device_count(),
        "sum": float(x.sum()),
    }
"""


def _broker(tmp: Path, *flags: str) -> RunningBroker:
    return start_broker(tmp, "--sandbox", SANDBOX, "--device", "gpu", "--gpus", "0", *flags)


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    running = _broker(tmp_path_factory.mktemp("fresh-eager"))  # the defaults: eager, 4 slots
    yield running
    running.stop()


def test_each_program_finds_a_fresh_context_made_ahead_on_its_gpu(eager: RunningBroker) -> None:
    results = [run_function(eager.url, PROBE, "probe") for _ in range(PROGRAMS)]
    for result in results:
        assert result.completed, result.error
        out = result.results["out"]
        assert out["made_ahead"] and out["devices"] == 1 and out["sum"] == float(1 << 20)
        assert result.gpu_ids == [0]
    # A fresh process each time (pids repeat inside a sandbox's own pid namespace; identities never).
    assert len({r.worker["identity"] for r in results}) == PROGRAMS
    # Made ahead: the worker's context was ready before its program was sent.
    assert all(r.worker["context_at"] <= r.worker["ready_at"] for r in results)


def test_a_lazy_broker_leaves_the_context_to_the_program(tmp_path: Path) -> None:
    lazy = _broker(tmp_path, "--cuda-context", "lazy", "--workers-per-gpu", "1")
    try:
        result = run_function(lazy.url, PROBE, "probe")
    finally:
        lazy.stop()
    assert result.completed, result.error
    assert result.results["out"]["made_ahead"] is False


def test_with_the_quiet_handover_two_programs_never_share_the_gpu(tmp_path: Path) -> None:
    quiet = _broker(tmp_path, "--gpu-handover", "quiet", "--workers-per-gpu", "2")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(run_function, quiet.url, GPU_BUSY, "busy", 1.0)
            time.sleep(0.3)
            second = pool.submit(run_function, quiet.url, GPU_BUSY, "span")
            before, after = first.result(), second.result()
    finally:
        quiet.stop()
    assert before.completed and after.completed, (before.error, after.error)
    assert not overlapped(before.results["out"], after.results["out"]), "two programs used the GPU at once"
    assert after.lease_wait_ms > 0


def test_a_session_keeps_one_worker_and_its_context_for_its_client_alone(eager: RunningBroker) -> None:
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=PROBE), name="probe")
    program.return_(key="out", value=program.run(fn=fn))
    with Client(eager.url, session=True) as client, Client(eager.url) as other:
        mine = [client.execute(program) for _ in range(PROGRAMS)]
        theirs = other.execute(program)
    for result in [*mine, theirs]:
        assert result.completed, result.error
    assert len({r.worker["identity"] for r in mine}) == 1  # one worker, its CUDA context kept
    assert all(r.results["out"]["made_ahead"] for r in mine)
    assert theirs.worker["identity"] != mine[0].worker["identity"]
    assert max(r.lease_wait_ms for r in mine[1:]) < 5  # the session holds its GPU's lease
