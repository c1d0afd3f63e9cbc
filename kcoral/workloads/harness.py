"""The trusted side of ``kcoral remote``: runs in the worker, never loads the candidate's code.

For each run: fresh random seeds (the correctness call's, and one base per role for the timed
calls); the reference of the correctness inputs, computed here before the candidate's process
starts; the candidate's process (``kcoral.workloads.runner``) in its own session, reading nothing
from it but the result pipe; then, once that process has finished with the GPU, every output it
sent checked here against this process's own reference for the same seed. Outputs arrive as
bytes and become plain tensors here: a lying tensor subclass, a patched ``assert_close`` or a
corrupted reference in the candidate's process cannot reach this check.

The report: ``correct``, ``check`` (what was checked and what failed), ``timing`` (the candidate's
benchmark report), ``baseline`` (the baseline's), ``speedup`` (baseline median / candidate median),
``integrity`` (``verdict`` and ``reasons``: the candidate's timing findings and this side's own),
``workload``, ``seed``. A candidate whose measurement was tampered with fails the instruction with
``integrity``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.findings import verdict
from kcoral.workloads.channel import ChannelError, MessageReader, deadline_after, tensor_from_wire
from kcoral.workloads.format import Workload, load_workload
from kcoral.workloads.runner import ROLES

OUTPUTS_KEPT: Final = 4
SEED_BITS: Final = 31
# Timed inputs of one role take seeds base .. base + calls; the bases are far apart.
SEED_SPAN: Final = 1 << 24
EXIT_GRACE_SECONDS: Final = 10.0
TIMING_FIELDS: Final = (
    "latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max", "latency_ms_std",
    "host_ms_median", "host_ms_min", "host_ms_max", "method", "cupti_error", "warmup", "repeat",
    "activities_stable", "activities_per_call", "launch_hold", "inputs", "outputs_checked",
    "sm_clock_mhz_after", "throttled", "gpu", "integrity", "integrity_details", "latency_measure",
)  # fmt: skip


@dataclass
class RoleOutcome:
    """What the candidate's process sent for one role."""

    output: tuple[dict[str, Any], bytes] | None = None
    timing: dict[str, Any] | None = None
    kept: list[tuple[dict[str, Any], bytes]] = field(default_factory=list)
    error: dict[str, Any] | None = None


@dataclass
class RunnerOutcome:
    roles: dict[str, RoleOutcome] = field(default_factory=lambda: {role: RoleOutcome() for role in ROLES})
    ready: dict[str, Any] | None = None
    done: bool = False
    failure: str | None = None  # the stream broke, or the process ran out of time
    returncode: int | None = None
    leftovers: bool = False
    workload_error: dict[str, Any] | None = None


def _seeds() -> tuple[int, dict[str, int]]:
    seed = secrets.randbits(SEED_BITS)
    first = secrets.randbelow(1 << 20) * SEED_SPAN
    return seed, {"baseline": first, "candidate": first + SEED_SPAN * 7}


def _collect(reader: MessageReader, outcome: RunnerOutcome) -> None:
    while True:
        message = reader.read()
        if message is None:
            return
        header, payload = message
        kind = header.get("type")
        role = header.get("role")
        if kind == "ready":
            outcome.ready = header
        elif kind == "done":
            outcome.done = True
        elif role == "workload" and kind == "error":
            outcome.workload_error = header
        elif role in outcome.roles:
            target = outcome.roles[role]
            # Each message once, in order: a second one means someone else writes to the pipe.
            if kind == "output" and target.output is None and target.timing is None:
                target.output = (header, payload)
            elif kind == "timing" and target.timing is None and isinstance(header.get("report"), dict):
                target.timing = header["report"]
            elif kind == "kept" and target.timing is not None and len(target.kept) < OUTPUTS_KEPT:
                target.kept.append((header, payload))
            elif kind == "error" and target.error is None:
                target.error = header
            else:
                raise ChannelError(f"unexpected message {kind!r} for {role!r}")
        else:
            raise ChannelError(f"unexpected message {kind!r}")


def run_candidate(
    folder: Path,
    candidate: Path | None,
    seed: int,
    bases: dict[str, int],
    timeout_s: float,
    command: list[str] | None = None,
) -> RunnerOutcome:
    """Start the candidate's process, read what it sends until it ends, then clean up after it.

    ``command`` replaces ``python -m kcoral.workloads.runner`` (tests); it gets the config as its
    last argument."""
    read_end, write_end = os.pipe()
    config = {
        "folder": str(folder),
        "candidate": str(candidate) if candidate is not None else None,
        "seed": seed,
        "bases": bases,
        "fd": write_end,
        "keep": OUTPUTS_KEPT,
    }
    process = subprocess.Popen(
        [*(command or [sys.executable, "-m", "kcoral.workloads.runner"]), json.dumps(config)],
        stdin=subprocess.DEVNULL,
        pass_fds=(write_end,),
        start_new_session=True,  # its own process group: whatever it leaves behind is found and killed
    )
    os.close(write_end)
    outcome = RunnerOutcome()
    reader = MessageReader(read_end, deadline_after(timeout_s))
    try:
        _collect(reader, outcome)
    except ChannelError as exc:
        outcome.failure = str(exc)
    finally:
        reader.close()
    try:
        outcome.returncode = process.wait(EXIT_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        outcome.failure = outcome.failure or "the candidate's process did not exit after it finished"
    try:
        os.killpg(process.pid, 0)
        outcome.leftovers = True
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if process.poll() is None:
        process.kill()
        outcome.returncode = process.wait()
    return outcome


def _check(workload: Workload, torch: Any, message: tuple[dict[str, Any], bytes], seed: int) -> str | None:
    """None when the output for ``seed`` is right; otherwise why not."""
    header, payload = message
    try:
        output = tensor_from_wire(torch, header, payload)
    except ChannelError as exc:
        return str(exc)
    expected = workload.reference(*workload.inputs(seed))
    if isinstance(expected, torch.Tensor):
        output = output.to(expected.device)
    try:
        workload.verify(torch, output, expected)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:600]}"
    return None


def _judge_role(workload: Workload, torch: Any, role: RoleOutcome, seed: int) -> dict[str, Any]:
    """Check the correctness output and every kept timed output; the role's check section."""
    section: dict[str, Any] = {"correctness_call": None, "timed_outputs_checked": 0, "failures": []}
    if role.error is not None:
        section["failures"].append(f"{role.error.get('kind')}: {role.error.get('message')}")
        return section
    if role.output is None:
        section["failures"].append("no output of the correctness call arrived")
        return section
    problem = _check(workload, torch, role.output, seed)
    section["correctness_call"] = "pass" if problem is None else problem
    if problem is not None:
        section["failures"].append(f"correctness call (seed {seed}): {problem}")
    for header, payload in role.kept:
        kept_seed = header.get("seed")
        if not isinstance(kept_seed, int):
            section["failures"].append("a timed output came without its seed")
            continue
        problem = _check(workload, torch, (header, payload), kept_seed)
        section["timed_outputs_checked"] += 1
        if problem is not None:
            section["failures"].append(f"timed call {header.get('call')} (seed {kept_seed}): {problem}")
    if role.timing is not None and not role.kept:
        section["failures"].append("no output of a timed call arrived to be checked")
    return section


def _timing(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {key: report.get(key) for key in TIMING_FIELDS}


def evaluate(folder: str, candidate: str | None, timeout_s: float) -> dict[str, Any]:
    """Evaluate ``candidate`` (a file in the working directory; None: the baseline alone)."""
    import torch

    workload = load_workload(folder)
    candidate_path = Path(candidate).resolve() if candidate else None
    if candidate_path is not None and not candidate_path.is_file():
        raise ExecutionError("parse", f"the candidate {candidate} was not sent (no such file)")
    seed, bases = _seeds()
    # The reference and its inputs are made now, so the harness leaves the GPU alone while the
    # candidate's process measures (its check sees other busy processes).
    workload.reference(*workload.inputs(seed))
    torch.cuda.synchronize()
    outcome = run_candidate(workload.folder, candidate_path, seed, bases, timeout_s)
    if outcome.workload_error is not None:
        error = outcome.workload_error
        raise ExecutionError(str(error.get("kind") or "runtime"), f"the workload failed: {error.get('message')}")
    roles = ("baseline", "candidate") if candidate_path is not None else ("baseline",)
    evaluated = roles[-1]
    mine = outcome.roles[evaluated]
    if mine.error is not None and mine.error.get("kind") == "integrity":
        raise ExecutionError("integrity", f"{evaluated}: {mine.error.get('message')}")
    checks = {role: _judge_role(workload, torch, outcome.roles[role], seed) for role in roles}
    reasons: list[str] = []
    timing = outcome.roles[evaluated].timing
    if timing is not None:
        reasons.extend((timing.get("integrity") or {}).get("reasons") or [])
    if outcome.failure:
        reasons.append(f"the candidate's process: {outcome.failure}")
    if outcome.leftovers:
        reasons.append("the candidate's process left processes running; they were killed")
    if outcome.returncode not in (0, None):
        reasons.append(f"the candidate's process exited with status {outcome.returncode}")
    if not outcome.done:
        reasons.append("the candidate's process ended before it said it was done")
    baseline_ms = (outcome.roles["baseline"].timing or {}).get("latency_ms_median")
    candidate_ms = (timing or {}).get("latency_ms_median")
    correct = all(not section["failures"] for section in checks.values()) and timing is not None and not outcome.failure
    return {
        "workload": workload.name,
        "seed": seed,
        "evaluated": evaluated,
        "correct": correct,
        "check": checks[evaluated],
        "baseline_check": checks["baseline"] if evaluated != "baseline" else None,
        "timing": _timing(timing),
        "baseline": _timing(outcome.roles["baseline"].timing),
        "speedup": (baseline_ms / candidate_ms) if baseline_ms and candidate_ms else None,
        "integrity": verdict(reasons),
        "error": mine.error,
    }
