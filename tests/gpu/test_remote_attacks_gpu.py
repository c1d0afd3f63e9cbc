"""The attacks of ``tests/gpu/remote_attacks/`` through ``kcoral remote`` against a real broker
(GPU host), with its default sandbox. Each must be CAUGHT (the check failed, the program failed
with ``integrity``, or the verdict is ``suspect``) or pay its TRUE_COST (correct, ``ok``, and at
least half the honest candidate's time), whichever its ``ATTACK["expect"]`` allows; none may be
reported fast and correct (UNDERCOUNTED) or correct with wrong outputs (PASSED_WRONG). The honest
candidates must read correct and ``ok`` at a speedup near 1 (they do what the baseline does).

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_remote_attacks_gpu.py``
(``KCORAL_ATTACK_URL``: a broker already running, rather than one the tests start).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningBroker, start_broker

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(900),
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ATTACKS = sorted(path for path in (HERE / "remote_attacks").glob("*.py") if not path.name.startswith("_"))
BROKE = frozenset({"runtime", "compile", "parse", "unavailable", "gpu_access", "serialization"})


def attack_meta(path: Path) -> dict[str, Any]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ATTACK" for t in node.targets):
            return dict(ast.literal_eval(node.value))
    raise AssertionError(f"{path.name} has no ATTACK")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-suite")
    for name in ("add", "matmul"):
        shutil.copytree(REPO / "examples" / "workloads" / name, root / "workloads" / name)
    shutil.copytree(HERE / "remote_attacks" / "workloads" / "small_mlp", root / "workloads" / "small_mlp")
    (root / "attacks").mkdir()
    for path in ATTACKS:
        shutil.copy(path, root / "attacks" / path.name)
    return root


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("KCORAL_ATTACK_URL")
    if url:
        yield url
        return
    broker: RunningBroker = start_broker(tmp_path_factory.mktemp("remote-broker"), "--sandbox", "auto")
    yield broker.url
    broker.stop()


def remote(url: str, root: Path, workload: str, candidate: str) -> tuple[int, dict[str, Any] | None, str]:
    command = [sys.executable, "-m", "kcoral", "remote", "--remote", url, "--timeout", "120"]
    done = subprocess.run(
        [*command, "--", f"workloads/{workload}", candidate], cwd=root, capture_output=True, text=True, timeout=200
    )
    try:
        report = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        report = None
    return done.returncode, report, done.stderr


_honest: dict[str, dict[str, Any]] = {}


def honest(url: str, root: Path, workload: str) -> dict[str, Any]:
    if workload not in _honest:
        status, report, stderr = remote(url, root, workload, f"workloads/{workload}/candidate.py")
        assert status == 0 and report is not None, stderr[-2000:]
        _honest[workload] = report
    return _honest[workload]


def verdict(meta: dict[str, Any], status: int, report: dict[str, Any] | None, stderr: str, honest_ms: float) -> str:
    if report is None:
        return "CAUGHT" if status == 70 and "integrity" in stderr else "CRASHED"
    if not report.get("correct"):
        kind = (report.get("error") or {}).get("kind")
        return "CRASHED" if kind in BROKE else "CAUGHT"
    if meta.get("wrong"):
        return "PASSED_WRONG"
    if (report.get("integrity") or {}).get("verdict") == "suspect":
        return "CAUGHT"
    median = (report.get("timing") or {}).get("latency_ms_median") or 0.0
    return "UNDERCOUNTED" if median < 0.5 * honest_ms else "TRUE_COST"


@pytest.mark.parametrize("workload", ["add", "matmul", "small_mlp"])
def test_honest_candidates_read_correct_and_ok(workload: str, broker_url: str, suite: Path) -> None:
    report = honest(broker_url, suite, workload)
    assert report["correct"] is True, report["check"]
    assert report["integrity"] == {"verdict": "ok", "reasons": []}, report["integrity"]
    assert report["timing"]["time_source"] == "cupti" and report["timing"]["bracket"]["agrees"] is True
    assert 0.9 < report["speedup"] < 1.1, report["speedup"]


@pytest.mark.parametrize("path", ATTACKS, ids=[path.stem for path in ATTACKS])
def test_attack_is_caught_or_pays(path: Path, broker_url: str, suite: Path) -> None:
    meta = attack_meta(path)
    reference = honest(broker_url, suite, meta["workload"])
    status, report, stderr = remote(broker_url, suite, meta["workload"], f"attacks/{path.name}")
    found = verdict(meta, status, report, stderr, reference["timing"]["latency_ms_median"])
    assert found in str(meta["expect"]).split("|"), (found, status, report, stderr[-2000:])
    if meta.get("judge") == "stdout_forgery":
        assert report is not None and report.get("speedup", 0) < 2.0
