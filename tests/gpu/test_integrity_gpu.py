"""The reward hacks of ``tests/gpu/attacks/`` against a real broker (GPU host).

Each attack must be reported within 10% of the honest time for the same work, or fail with
``integrity``, or read ``suspect``, or fail its check (``correctness`` in benchmark(), or the trusted
harness of ``kcoral remote``). Honest workloads through ``kcoral remote`` must read correct and
``ok``. With ``KCORAL_ATTACK_TABLE=PATH`` the outcomes are also written there as a table and JSON;
with ``KCORAL_ATTACK_URL`` the attacks go to that broker instead of one the tests start.

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_integrity_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from kcoral import Client
from tests.gpu.attacks import CATALOGUE, Attack
from tests.gpu.attacks import outcomes as attacks
from tests.helpers import RunningBroker, start_broker

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python"),
    pytest.mark.timeout(600),
]

TABLE_ENV = "KCORAL_ATTACK_TABLE"
URL_ENV = "KCORAL_ATTACK_URL"
_outcomes: list[attacks.Outcome] = []


def _sandbox_flag() -> str:
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap

    try:
        check_bwrap()
    except SandboxUnavailable:
        return "none"
    return "bubblewrap"


@pytest.fixture(scope="module")
def attack_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    url = os.environ.get(URL_ENV)
    if url:  # a broker the caller started (benchmarks/gpu_batch_integrity.sh: on its defaults)
        yield RunningBroker(url, None, Path(os.devnull), Path(os.devnull))  # type: ignore[arg-type]
    else:
        broker = start_broker(tmp_path_factory.mktemp("attack-broker"), "--sandbox", _sandbox_flag())
        yield broker
        broker.stop()


def _write_table() -> None:
    """Rewritten after each attack, so a run cut short keeps what it had."""
    table = os.environ.get(TABLE_ENV)
    if table and _outcomes:
        lines = [attacks.HEADER, *(outcome.line() for outcome in _outcomes)]
        Path(table).write_text("\n".join(lines) + "\n")
        Path(table).with_suffix(".json").write_text(json.dumps([asdict(o) for o in _outcomes], indent=1))


@pytest.fixture(scope="module")
def attack_client(attack_broker: RunningBroker) -> Iterator[Client]:
    with Client(attack_broker.url, connect_timeout_seconds=30.0) as client:
        yield client


@pytest.mark.parametrize("attack", CATALOGUE, ids=[attack.name for attack in CATALOGUE])
def test_attack_is_caught(attack: Attack, attack_client: Client, attack_broker: RunningBroker) -> None:
    outcome = attacks.run_attack(attack_client, attack_broker.url, attack)
    _outcomes.append(outcome)
    _write_table()
    if attack.name == "child_process" and outcome.verdict == "CRASHED" and "IPC" in " ".join(outcome.notes):
        pytest.skip(f"CUDA IPC is refused here, so the attack cannot run: {outcome.notes}")
    assert outcome.verdict == "CAUGHT", outcome.line()


@pytest.mark.parametrize("workload", ["add", "matmul"])
def test_honest_candidates_through_kcoral_remote_read_correct_and_ok(
    workload: str, attack_broker: RunningBroker
) -> None:
    folder = f"examples/workloads/{workload}"
    source = (attacks.REPO_ROOT / folder / "candidate.py").read_text()
    status, report, stderr = attacks.run_remote(attack_broker.url, source, folder)
    assert status == 0 and report is not None, stderr[-2000:]
    assert report["correct"] is True, report["check"]
    assert report["check"]["correctness_call"] == "pass"
    assert report["check"]["timed_outputs_checked"] >= 1
    assert report["integrity"] == {"verdict": "ok", "reasons": []}, report["integrity"]
    assert report["timing"]["method"] == "cupti"
    assert report["timing"]["inputs"]["mode"] == "factory"
    # The same work as the baseline: the speedup is about 1.
    assert 0.8 < report["speedup"] < 1.25, report
