"""The trusted side of ``kcoral remote``: runs in the worker, never loads the candidate's code, and
makes every number of the report itself.

The candidate's process (``kcoral.workloads.runner``) starts with nothing: no argument, no seed, no
path or descriptor of the harness but its standard input, a socket over which the harness says what
to do next (its standard output and error go to the harness's standard error). The harness keeps:

- the seeds (fresh from ``secrets`` for every call) and every call's inputs, made in its own process
  and memory. Just before a call it copies them into buffers shared with the candidate's process
  (``kcoral.workloads.ipc``, one driver allocation each: nothing else of the harness is visible);
- the clock. Each *bracketed* batch: the candidate's process queues its calls behind a gate (a
  stream wait on a shared word) and says so; the harness then records its start event, copies the
  inputs in, flushes the L2 cache, opens the gate, waits (on its own stream) for the candidate's
  completion word, copies the outputs into its own memory and records its end event
  (``kcoral.workloads.bracket`` says why this holds the calls' GPU work). The null role calibrates
  the fixed overhead in the same run;
- the outputs. Each bracketed call's output is committed (copied into the harness's memory) inside
  its bracket; whether it is kept for the check is decided after the call, by the harness's own
  random draw (reservoir sampling of ``OUTPUTS_KEPT`` of the (``WARM_BATCHES`` +
  ``BRACKET_BATCHES``) x ``batch`` calls: 16 of 448 for the shipped workloads), so no call can know
  it. The calls the candidate's own timer makes hand their outputs over too, and 16 of those are
  kept the same way. All kept outputs are checked here, against this process's reference for the
  seed, after the candidate's process is done with the GPU. A candidate whose outputs are stale in
  half of the calls passes with probability 0.5 ** OUTPUTS_KEPT (1.5e-5);
- the judgement. The candidate's own CUPTI figure (``benchmark``'s timer in its process, fed with
  fresh harness inputs) is the reported time only where it agrees with the bracket; otherwise the
  role is ``suspect`` and the bracket is its time. A suspect baseline makes the speedup suspect.

Order: the baseline (correctness call, CUPTI measurement, brackets), then the null role's brackets,
both before the candidate is imported; then the candidate the same way.

The report (``evaluate``): ``correct``, ``check`` and ``baseline_check``, ``timing`` and ``baseline``
(the CUPTI report's fields, ``latency_ms_median`` being the reported time, with
``latency_ms_median_cupti``, ``time_source`` and ``bracket``), ``null``, ``speedup``, ``integrity``
(verdict and reasons), ``workload``, ``seed`` (the correctness call's), ``error``. A candidate's
process that breaks the harness's protocol fails the instruction with ``integrity``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.findings import verdict
from kcoral.workloads import bracket
from kcoral.workloads.format import Workload, load_workload
from kcoral.workloads.session import OUTPUTS_KEPT, RoleResult, Session, fresh_seed, run_role

TIMING_FIELDS: Final = (
    "latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max", "latency_ms_std",
    "host_ms_median", "host_ms_min", "host_ms_max", "method", "cupti_error", "warmup", "repeat",
    "activities_stable", "activities_per_call", "launch_hold", "inputs", "outputs_checked",
    "sm_clock_mhz_after", "throttled", "gpu", "integrity", "integrity_details", "latency_measure",
)  # fmt: skip


def _check(workload: Workload, torch: Any, output: Any, seed: int) -> str | None:
    """None when ``output`` is right for ``seed``; otherwise why not."""
    expected = workload.reference(*workload.inputs(seed))
    try:
        workload.verify(torch, output, expected)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:600]}"
    return None


def check_role(workload: Workload, torch: Any, role: RoleResult, seed: int, first: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"correctness_call": None, "timed_outputs_checked": 0, "failures": []}
    if role.error is not None:
        section["failures"].append(f"{role.error.get('kind')}: {role.error.get('message')}")
    if role.correctness == "committed":
        problem = _check(workload, torch, first, seed)
        section["correctness_call"] = "pass" if problem is None else problem
        if problem is not None:
            section["failures"].append(f"correctness call: {problem}")
    elif role.error is None:
        section["failures"].append("no output of the correctness call was committed")
    for kept_seed, output in role.kept:
        problem = _check(workload, torch, output, kept_seed)
        section["timed_outputs_checked"] += 1
        if problem is not None:
            section["failures"].append(f"a timed call's committed output: {problem}")
    if role.error is None and not role.kept:
        section["failures"].append("no output of a timed call was committed")
    failures = section["failures"]
    if len(failures) > 4:
        section["failures"] = [*failures[:4], f"... and {len(failures) - 4} more"]
    section["failures_total"] = len(failures)
    return section


def _cupti_ms(timing: dict[str, Any] | None) -> float | None:
    value = (timing or {}).get("latency_ms_median")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timing_section(
    role: RoleResult, null: bracket.BracketSummary | None, baseline: dict[str, Any] | None, gated: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's timing section of one role and the reasons that make it suspect."""
    timing = role.timing
    if timing is None or not role.brackets_ms:
        return None, []
    section = {key: timing.get(key) for key in TIMING_FIELDS}
    own = [str(r) for r in ((timing.get("integrity") or {}).get("reasons") or []) if isinstance(r, str)]
    reasons = bracket.timer_reasons(own, timing, baseline if role.name == "candidate" else timing)
    summary = bracket.BracketSummary.of(role.brackets_ms, role.host_ms)
    section["latency_ms_median_cupti"] = _cupti_ms(timing)
    described: dict[str, Any] = {**summary.describe(), "gated": gated, "calls_committed": role.calls}
    section["bracket"] = described
    if null is None:
        reasons.append("the null call was not bracketed: the bracket has no calibration")
        section["latency_ms_median"] = max(summary.median_ms, _cupti_ms(timing) or 0.0)
        section["time_source"] = bracket.TimeSource.BRACKET
    else:
        judgement = bracket.judge(summary, null, _cupti_ms(timing))
        described.update(judgement.describe())
        described["null_median_ms"] = round(null.median_ms, 6)
        section["latency_ms_median"] = judgement.time_ms
        section["time_source"] = judgement.time_source
        if judgement.reason:
            reasons.append(judgement.reason)
    section["integrity"] = verdict(reasons)
    return section, reasons


def report_reasons(
    reasons: list[str],
    baseline_reasons: list[str],
    *,
    null_error: dict[str, Any] | None = None,
    gate_error: str | None = None,
    leftovers: bool = False,
) -> list[str]:
    """The report's integrity reasons: the evaluated role's, then what makes its comparison or the
    whole run suspect (a suspect baseline makes the speedup suspect)."""
    combined = list(reasons)
    if baseline_reasons:
        combined.append(f"the baseline's measurement is suspect, and with it the speedup: {baseline_reasons[0]}")
    if null_error is not None:
        combined.append(f"the null call failed: {null_error.get('message')}")
    if gate_error is not None:
        combined.append(
            f"the gate (a stream wait on shared memory) is not available here ({gate_error}): "
            "the brackets include the host's launch time"
        )
    if leftovers:
        combined.append("the candidate's process left processes running; they were killed")
    return combined


def evaluate(folder: str, candidate: str | None, timeout_s: float, command: list[str] | None = None) -> dict[str, Any]:
    """Evaluate ``candidate`` (a file in the working directory; None: the baseline alone)."""
    import torch

    workload = load_workload(folder)
    candidate_path = Path(candidate).resolve() if candidate else None
    if candidate_path is not None and not candidate_path.is_file():
        raise ExecutionError("parse", f"the candidate {candidate} was not sent (no such file)")
    seed = fresh_seed()
    first_inputs = workload.inputs(seed)
    expected = workload.reference(*first_inputs)
    session = Session(torch, workload, candidate_path, timeout_s, command)
    roles = {name: RoleResult(name) for name in ("baseline", "null", "candidate")}
    try:
        session.start(first_inputs, expected)
        firsts = {name: torch.empty_like(expected) for name in ("baseline", "candidate")}
        del first_inputs
        run_role(session, roles["baseline"], seed, firsts["baseline"])
        run_role(session, roles["null"], seed, None)
        if candidate_path is not None and roles["baseline"].error is None:
            run_role(session, roles["candidate"], seed, firsts["candidate"])
        session.finish()
    finally:
        session.close()
    torch.cuda.synchronize()
    evaluated = "candidate" if candidate_path is not None else "baseline"
    mine = roles[evaluated]
    if mine.error is not None and mine.error.get("kind") == "integrity":
        raise ExecutionError("integrity", f"{evaluated}: {mine.error.get('message')}")
    checks = {
        name: check_role(workload, torch, roles[name], seed, firsts[name])
        for name in ("baseline", "candidate")
        if name == "baseline" or candidate_path is not None
    }
    null = bracket.BracketSummary.of(roles["null"].brackets_ms) if roles["null"].brackets_ms else None
    baseline_timing, baseline_reasons = timing_section(roles["baseline"], null, None, session.gated)
    timing, reasons = (
        timing_section(mine, null, roles["baseline"].timing, session.gated)
        if evaluated == "candidate"
        else (baseline_timing, list(baseline_reasons))
    )
    reasons = report_reasons(
        reasons,
        baseline_reasons if evaluated == "candidate" else [],
        null_error=roles["null"].error,
        gate_error=None if session.gated else session.gate_error or "unknown",
        leftovers=session.leftovers,
    )
    baseline_ms = (baseline_timing or {}).get("latency_ms_median")
    candidate_ms = (timing or {}).get("latency_ms_median")
    correct = all(not section["failures"] for section in checks.values()) and timing is not None
    return {
        "workload": workload.name,
        "seed": seed,
        "evaluated": evaluated,
        "correct": correct,
        "check": checks[evaluated],
        "baseline_check": checks["baseline"] if evaluated != "baseline" else None,
        "timing": timing,
        "baseline": baseline_timing,
        "null": bracket.BracketSummary.describe(null) if null is not None else None,
        "speedup": bracket.speedup(baseline_ms, candidate_ms),
        "outputs_kept": OUTPUTS_KEPT,
        "integrity": verdict(reasons),
        "error": mine.error,
    }
