"""``kcoral remote -- WORKLOAD A.py B.py``: two candidates compared through the trusted path.

Each candidate runs in a process of its own (``kcoral.workloads.runner``, started with nothing, as
for one candidate: ``kcoral.workloads.harness``), and the harness times both with its own clock:
bracketed batches of calls on inputs it makes from fresh seeds and copies in just before each call.
The two are compared in paired rounds as ``compare()`` does in a program (``kcoral.timing.ab_stats``
states the method): each round brackets four batches, ``ABBA`` and ``BAAB`` in turn, A's and B's on
the *same* seeds (the same inputs); a round's ratio is B's median net bracket over A's (a batch's per-call bracket
less the null call's median, calibrated in A's process in the same run); rounds go on until the
95% interval of B/A is within ``target_halfwidth`` or the budget is spent, and the verdict is
``faster``, ``slower``, ``same`` or ``unclear`` against the threshold (0.5%).

Both candidates' outputs are committed inside their brackets and a sample of each, drawn by the
harness after the calls, is checked here, as for one candidate. A candidate that fails its checks
makes the comparison ``unclear`` (a wrong kernel is not faster). The time compared is the bracket:
the candidates' own CUPTI figures are not asked for here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.ab_stats import (
    BOOTSTRAP_RESAMPLES,
    CHECK_RESAMPLES,
    DEFAULT_THRESHOLD,
    METHOD,
    Interval,
    StopReason,
    answer,
    block_order,
    noise,
    ratio_interval,
    round_ratio,
    stop_reason,
)
from kcoral.timing.findings import verdict
from kcoral.workloads import bracket
from kcoral.workloads.format import load_workload
from kcoral.workloads.harness import check_role
from kcoral.workloads.session import OUTPUTS_KEPT, WARM_BATCHES, Reservoir, RoleResult, Session, fresh_seed

SIDES: Final = ("a", "b")
NULL_BATCHES: Final = 6


@dataclass(frozen=True)
class PairSettings:
    """The remote pair's verdict threshold (``compare``'s) and its adaptive stop: sampling ends at a
    relative half-width of 0.5%, after 20 s, or after 200 rounds (6 at least)."""

    threshold: float = DEFAULT_THRESHOLD
    target_halfwidth: float = 0.005
    budget_s: float = 20.0
    min_rounds: int = 6
    max_rounds: int = 200


@dataclass
class PairRounds:
    """What the paired rounds gave: each side's per-call net times, the round ratios, the stop."""

    net_ms: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})
    ratios: list[float] = field(default_factory=list)
    stop: str = ""
    interval: Interval | None = None
    elapsed_s: float = 0.0


def paired_rounds(
    bracket_batch: Callable[[str, list[int]], float],
    *,
    batch: int,
    null_ms: float,
    settings: PairSettings,
    seed: int,
    clock: Callable[[], float] = time.monotonic,
    new_seed: Callable[[], int] = fresh_seed,
) -> PairRounds:
    """Rounds of ABBA and BAAB batches in turn, on the same seeds; ``bracket_batch(side, seeds)`` is
    one batch's per-call bracket (ms). Pure but for what it calls: CPU-testable with a stand-in."""
    done = PairRounds()
    began = clock()
    stop: str | None = None
    rounds_run = 0
    while stop is None:
        seeds = [new_seed() for _ in range(batch)]
        got: dict[str, list[float]] = {side: [] for side in SIDES}
        for side in block_order("abba", None, rounds_run).lower():  # ABBA and BAAB in turn
            got[side].append(bracket_batch(side, seeds) - null_ms)
        rounds_run += 1
        for side in SIDES:
            done.net_ms[side].extend(got[side])
        ratio = round_ratio(got["a"], got["b"])
        if ratio is not None:
            done.ratios.append(ratio)
        if ratio is not None and len(done.ratios) >= settings.min_rounds:
            done.interval = ratio_interval(done.ratios, resamples=CHECK_RESAMPLES, seed=seed + len(done.ratios))
        done.elapsed_s = clock() - began
        stop = stop_reason(
            rounds=len(done.ratios),
            halfwidth=done.interval.halfwidth if done.interval is not None else None,
            elapsed_ms=done.elapsed_s * 1e3,
            min_rounds=settings.min_rounds,
            max_rounds=settings.max_rounds,
            target_halfwidth=settings.target_halfwidth,
            budget_ms=settings.budget_s * 1e3,
        )
        if stop is None and len(done.net_ms["a"]) >= 2 * settings.max_rounds:
            stop = StopReason.MAX_ROUNDS
    done.stop = stop
    return done


class _Side:
    """One candidate's process and what the harness kept of its calls."""

    def __init__(self, session: Session, role: RoleResult, torch: Any) -> None:
        self.session = session
        self.role = role
        self.torch = torch
        self.scratch: list[Any] = []
        self.slots: list[Any] = []
        self.seeds: list[int | None] = [None] * OUTPUTS_KEPT
        self.reservoir = Reservoir(OUTPUTS_KEPT)

    def prepare(self, batch: int) -> None:
        output = self.session.output
        assert output is not None
        self.scratch = [self.torch.empty_like(output.tensor) for _ in range(batch)]
        self.slots = [self.torch.empty_like(output.tensor) for _ in range(OUTPUTS_KEPT)]

    def batch(self, seeds: list[int]) -> float:
        bracket_ms, host_ms = self.session.bracketed(seeds, self.scratch[: len(seeds)])
        # Which outputs are kept is drawn only now, after the calls: each one was committed the same way.
        for seed, committed in zip(seeds, self.scratch, strict=False):
            slot = self.reservoir.slot()
            if slot is not None:
                self.slots[slot].copy_(committed)
                self.seeds[slot] = seed
        self.role.brackets_ms.append(bracket_ms)
        self.role.host_ms.append(host_ms)
        return bracket_ms

    def keep(self) -> None:
        self.role.kept.extend((s, slot) for s, slot in zip(self.seeds, self.slots, strict=True) if s is not None)
        self.role.calls += self.reservoir.seen


def _summary(net_ms: list[float]) -> dict[str, Any]:
    if not net_ms:
        return {"latency_ms_median": None, "noise": None, "batches": 0}
    return {
        "latency_ms_median": float(statistics.median(net_ms)),
        "latency_ms_min": float(min(net_ms)),
        "latency_ms_max": float(max(net_ms)),
        "noise": noise(net_ms),
        "batches": len(net_ms),
    }


def evaluate_pair(
    folder: str,
    a: str,
    b: str,
    timeout_s: float,
    settings: PairSettings | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """Compare candidates ``a`` and ``b`` (files in the working directory) on the workload in ``folder``."""
    import torch

    settings = settings or PairSettings()
    workload = load_workload(folder)
    paths = {}
    for label, given in zip(SIDES, (a, b)):
        path = Path(given).resolve()
        if not path.is_file():
            raise ExecutionError("parse", f"the candidate {given} was not sent (no such file)")
        paths[label] = path
    seed = fresh_seed()
    first_inputs = workload.inputs(seed)
    expected = workload.reference(*first_inputs)
    roles = {name: RoleResult("candidate") for name in SIDES}
    null = RoleResult("null")
    sessions = {name: Session(torch, workload, paths[name], timeout_s, command) for name in SIDES}
    sides = {name: _Side(sessions[name], roles[name], torch) for name in SIDES}
    firsts = {name: torch.empty_like(expected) for name in SIDES}
    interval_seed = fresh_seed()
    done = PairRounds()
    try:
        for one in sides.values():
            one.session.start(first_inputs, expected)
        del first_inputs
        batch = min(one.session.batch for one in sides.values())
        # The null call, in A's process before its candidate is loaded: the bracket's fixed overhead.
        first = sides["a"].session
        first.set_role("null")
        null_scratch = [torch.empty_like(expected) for _ in range(batch)]
        for _ in range(NULL_BATCHES):
            null.brackets_ms.append(first.bracketed([fresh_seed() for _ in range(batch)], null_scratch)[0])
        null_summary = bracket.BracketSummary.of(null.brackets_ms)
        for name, one in sides.items():
            one.session.set_role("candidate")
            one.session.bracketed([seed], [firsts[name]])
            one.role.correctness = "committed"
            one.prepare(batch)
            for _ in range(WARM_BATCHES):
                one.batch([fresh_seed() for _ in range(batch)])
            one.role.brackets_ms.clear()
            one.role.host_ms.clear()
        done = paired_rounds(
            lambda name, seeds: sides[name].batch(seeds),
            batch=batch,
            null_ms=null_summary.median_ms,
            settings=settings,
            seed=interval_seed,
        )
        for one in sides.values():
            one.keep()
            one.session.finish()
    finally:
        for one in sides.values():
            one.session.close()
    torch.cuda.synchronize()
    checks = {name: check_role(workload, torch, roles[name], seed, firsts[name]) for name in SIDES}
    reasons: list[str] = []
    for name in SIDES:
        if checks[name]["failures"]:
            reasons.append(f"{name.upper()} failed its checks: {checks[name]['failures'][0]}")
        if sides[name].session.leftovers:
            reasons.append(f"{name.upper()}'s process left processes running; they were killed")
        if not sides[name].session.gated:
            reasons.append(
                f"{name.upper()}: the gate is not available here ({sides[name].session.gate_error}): "
                "the brackets include the host's launch time"
            )
    if not done.ratios:
        raise ExecutionError("unavailable", "no round of the comparison gave a ratio (a net time was not positive)")
    final = ratio_interval(done.ratios, resamples=BOOTSTRAP_RESAMPLES, seed=interval_seed)
    integrity = verdict(reasons)
    a_ms, b_ms = (_summary(done.net_ms[name])["latency_ms_median"] for name in SIDES)
    return {
        "workload": workload.name,
        "evaluated": "pair",
        "correct": all(not checks[name]["failures"] for name in SIDES),
        **answer(final, settings.threshold, integrity["verdict"]),
        "ratio_of_medians": b_ms / a_ms if a_ms and b_ms else None,
        "threshold": settings.threshold,
        "interval_method": METHOD,
        "interval_seed": interval_seed,
        "time_source": "bracket less the null call's median",
        "a": {**_summary(done.net_ms["a"]), "check": checks["a"]},
        "b": {**_summary(done.net_ms["b"]), "check": checks["b"]},
        "null": null_summary.describe(),
        "rounds": len(done.ratios),
        "batch_calls": batch,
        "stop": {
            "reason": done.stop,
            "target_halfwidth": settings.target_halfwidth,
            "halfwidth_at_stop": done.interval.halfwidth if done.interval is not None else None,
            "budget_s": settings.budget_s,
            "elapsed_s": round(done.elapsed_s, 3),
        },
        "seed": seed,
        "outputs_kept": OUTPUTS_KEPT,
        "integrity": integrity,
    }
