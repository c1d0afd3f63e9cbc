"""Running an attack of :data:`tests.gpu.attacks.CATALOGUE` against a broker, and its verdict.

Two paths:

- ``benchmark``: one program per attack: an evaluator module (inputs, then ``benchmark()`` of the
  candidate), run for the honest candidate, then, in the same worker, the cheat is uploaded and run.
- ``remote``: ``kcoral remote -- examples/workloads/matmul CHEAT.py``: the trusted path.

An attack is CAUGHT when its reported time is at least ``COST_FLOOR`` of the honest time for the
same work (``cost``), or the report says ``suspect`` (``suspect``), or the instruction fails with
``integrity`` (``integrity``) or with ``correctness`` / the remote check fails (``check``). Otherwise
it is UNDERCOUNTED (or PASSED_WRONG when a wrong output passed). CRASHED means no verdict at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.gpu.attacks import CATALOGUE, Attack, candidate_source

REPO_ROOT: Final = Path(__file__).resolve().parents[3]
COST_FLOOR: Final = 0.9  # "within 10% of its true cost": not reported below 90% of the honest time
PROGRAM_TIMEOUT_S: Final = 240
MATMUL_WORKLOAD: Final = "examples/workloads/matmul"
# Shorter than benchmark()'s defaults: the honest and the cheating run share them, and the first
# programs of the session warm the clock.
ATTACK_CONFIG: Final = {"clock_warmup_ms": 300, "warmup_ms": 10, "repeat_ms": 60}


@dataclass
class Outcome:
    name: str
    klass: str
    path: str
    verdict: str  # CAUGHT | UNDERCOUNTED | PASSED_WRONG | CRASHED
    how: str = ""  # cost | suspect | integrity | check
    honest_ms: float | None = None
    reported_ms: float | None = None
    ratio: float | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    host_ms: float | None = None
    details: dict[str, Any] = field(default_factory=dict)  # the report's integrity_details

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return f"{value:9.4f}" if isinstance(value, (int, float)) else f"{'-':>9}"

        ratio = f"{self.ratio:6.3f}" if self.ratio is not None else f"{'-':>6}"
        return (
            f"{self.name:<24} | {self.klass[:30]:<30} | {self.path:<9} | {ms(self.honest_ms)} | "
            f"{ms(self.reported_ms)} | {ratio} | {self.verdict:<12} | {self.how:<9} | {'; '.join(self.notes)[:300]}"
        )


HEADER = (
    f"{'attack':<24} | {'class':<30} | {'path':<9} | {'honest ms':>9} | {'reported':>9} | {'ratio':>6} | "
    f"{'verdict':<12} | {'how':<9} | notes"
)


def _judge_timing(outcome: Outcome, honest_ms: float | None, report: dict[str, Any] | None) -> Outcome:
    outcome.honest_ms = honest_ms
    if not report:
        outcome.verdict = "CRASHED"
        outcome.notes.append("no timing report")
        return outcome
    integrity = report.get("integrity") or {}
    outcome.reported_ms = report.get("latency_ms_median")
    outcome.host_ms = report.get("host_ms_median")
    outcome.details = report.get("integrity_details") or {}
    if honest_ms and outcome.reported_ms is not None:
        outcome.ratio = outcome.reported_ms / honest_ms
    if integrity.get("verdict") == "suspect":
        outcome.verdict, outcome.how = "CAUGHT", "suspect"
        outcome.notes.extend(str(reason)[:140] for reason in integrity.get("reasons") or [])
    elif outcome.ratio is not None and outcome.ratio >= COST_FLOOR:
        outcome.verdict, outcome.how = "CAUGHT", "cost"
    elif outcome.ratio is None:
        outcome.verdict = "CRASHED"
    else:
        outcome.verdict = "UNDERCOUNTED"
    return outcome


def run_benchmark_attack(client: Any, attack: Attack) -> Outcome:
    from kcoral import Program

    outcome = Outcome(attack.name, attack.klass, attack.path, "CRASHED")
    program = Program()
    evaluator = program.upload(id="evaluator", kind="module", source=candidate_source("evaluator"))
    timed = program.get_function(id="timed", module=evaluator, name="timed")
    honest_module = program.upload(
        id="honest_module", kind="module", source=candidate_source(f"honest_{attack.workload}")
    )
    honest_fn = program.get_function(id="honest_fn", module=honest_module, name="custom_kernel")
    program.return_(
        key="honest", value=program.run(id="honest_run", fn=timed, args=[honest_fn, attack.workload, ATTACK_CONFIG])
    )
    cheat_module = program.upload(id="cheat_module", kind="module", source=attack.source)
    cheat_fn = program.get_function(id="cheat_fn", module=cheat_module, name="custom_kernel")
    program.return_(
        key="cheat", value=program.run(id="cheat_run", fn=timed, args=[cheat_fn, attack.workload, ATTACK_CONFIG])
    )
    result = client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
    honest = result.results.get("honest") or {}
    honest_ms = honest.get("latency_ms_median")
    if isinstance(honest.get("integrity"), dict) and honest["integrity"].get("verdict") != "ok":
        outcome.notes.append(f"honest run suspect: {honest['integrity'].get('reasons')}")
    if not result.completed:
        error = result.error or {}
        kind, where = error.get("kind"), error.get("instruction_id")
        outcome.honest_ms = honest_ms
        outcome.notes.append(f"{kind} at {where}: {str(error.get('message'))[:240]}")
        if where == "cheat_run" and kind in ("integrity", "correctness"):
            outcome.verdict, outcome.how = "CAUGHT", ("integrity" if kind == "integrity" else "check")
        return outcome
    return _judge_timing(outcome, honest_ms, result.results.get("cheat"))


def _last_json(text: str) -> dict[str, Any] | None:
    start = text.rfind("\n{\n")
    start = start + 1 if start >= 0 else (0 if text.startswith("{") else -1)
    if start < 0:
        return None
    try:
        value = json.loads(text[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run_remote(
    url: str, candidate_source: str, workload: str = MATMUL_WORKLOAD
) -> tuple[int, dict[str, Any] | None, str]:
    """``kcoral remote -- WORKLOAD CANDIDATE`` through the CLI: (exit status, report, stderr)."""
    with tempfile.TemporaryDirectory(prefix="kcoral-attack-") as folder:
        candidate = Path(folder) / "candidate.py"
        candidate.write_text(candidate_source)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        done = subprocess.run(
            [sys.executable, "-m", "kcoral.cli", "remote", "--remote", url, "--timeout", str(PROGRAM_TIMEOUT_S), "--",
             workload, str(candidate)],
            capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=PROGRAM_TIMEOUT_S + 60,
        )  # fmt: skip
    return done.returncode, _last_json(done.stdout), done.stderr


def run_remote_attack(url: str, attack: Attack) -> Outcome:
    outcome = Outcome(attack.name, attack.klass, attack.path, "CRASHED")
    status, report, stderr = run_remote(url, attack.source)
    if status == 70 and "integrity" in stderr:
        outcome.verdict, outcome.how = "CAUGHT", "integrity"
        outcome.notes.append(stderr.strip().splitlines()[-1][:240] if stderr.strip() else "integrity")
        return outcome
    if report is None:
        outcome.notes.append(f"exit {status}: {stderr.strip()[-300:]}")
        return outcome
    baseline = (report.get("baseline") or {}).get("latency_ms_median")
    if report.get("correct") is False:
        outcome.verdict, outcome.how = "CAUGHT", "check"
        outcome.honest_ms = baseline
        failures = (report.get("check") or {}).get("failures") or []
        outcome.notes.extend(str(failure)[:140] for failure in failures[:2])
        return outcome
    return _judge_timing(outcome, baseline, {**(report.get("timing") or {}), "integrity": report.get("integrity")})


def run_attack(client: Any, url: str, attack: Attack) -> Outcome:
    started = time.monotonic()
    try:
        outcome = run_benchmark_attack(client, attack) if attack.path == "benchmark" else run_remote_attack(url, attack)
    except Exception as exc:  # one attack's failure must not stop the others
        outcome = Outcome(
            attack.name, attack.klass, attack.path, "CRASHED", notes=[f"{type(exc).__name__}: {exc}"[:300]]
        )
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


def select(only: str = "") -> list[Attack]:
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    return [attack for attack in CATALOGUE if not wanted or attack.name in wanted]


__all__ = [
    "ATTACK_CONFIG",
    "COST_FLOOR",
    "HEADER",
    "PROGRAM_TIMEOUT_S",
    "REPO_ROOT",
    "Outcome",
    "run_attack",
    "run_benchmark_attack",
    "run_remote",
    "run_remote_attack",
    "select",
]
