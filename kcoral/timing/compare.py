"""``compare``: is B faster than A, and can the answer be trusted?

Two callables are timed in interleaved rounds on the same inputs, inside one program (one lease),
with every defence of ``benchmark``: the same calibration (``timing.calibrate``: the trusted state,
the timer, the probe, the clock warm-up, the launch hold), the same timed loop and timers
(``timing.calls``, ``timing.timers``: windows between device-wide synchronisations, the L2 flush,
rotated clones of the inputs, a sample of outputs checked) and the same findings
(``timing.findings``). What ``compare`` adds:

- rounds of four blocks, ``ABBA`` (or ``AABB`` shuffled), so that A and B meet the same
  conditions; the statistics of the rounds are in ``timing.ab_stats`` (the method is stated there);
- an adaptive stop: rounds go on until the interval of B/A is narrow enough (``target_halfwidth``),
  or the time budget (``budget_ms``) or the most rounds are spent, and the report says which;
- the SM clock and clock-event reasons after every timed call (NVML, read in the gap after the
  call's window, where the timer launches nothing): a sample taken throttled or below
  ``clock_floor`` x the GPU's maximum SM clock is left out and counted; a run whose clock never
  settled, or that left out more than ``max_left_out`` of its samples, is ``suspect``;
- the GPU's conditions before and after (``timing.conditions``), and, when asked
  (``wait_cool_ms``), a wait for a cool, idle GPU before measuring. Clocks are never locked.

A ``suspect`` run (any finding of ``benchmark``'s, or of the clock) never says ``faster`` or
``slower``: its ``verdict`` is ``unclear`` and ``verdict_if_trusted`` keeps what the interval said.

NVML refreshes its clock reading every few milliseconds, so for calls shorter than that the
per-call readings repeat: a throttle shows on every call it spans, and on the calls after it until
NVML's next reading. That is the resolution NVML gives; it errs towards leaving samples out.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.ab_config import MAX_BLOCK_CALLS, CompareConfig
from kcoral.timing.ab_stats import (
    BOOTSTRAP_RESAMPLES,
    CHECK_RESAMPLES,
    METHOD,
    STOP_MAX_ROUNDS,
    VERDICT_UNCLEAR,
    Interval,
    block_order,
    decide,
    noise,
    ratio_interval,
    round_ratio,
    stop_reason,
)
from kcoral.timing.calibrate import (
    Calibration,
    DefenceTime,
    calibrate,
    check_subscriber,
    choose_timer,
    fail_on_changes,
    import_torch_with_gpu,
    is_cupti_failure,
    wait_for_cool_gpu,
    warm_up,
)
from kcoral.timing.conditions import gpu_conditions
from kcoral.timing.findings import EnvironmentWatch, host_gap_reason, verdict
from kcoral.timing.inputs import (
    MODE_ROTATED,
    OUTPUTS_KEPT,
    InputFactory,
    KeptOutput,
    OutputCheck,
    OutputReservoir,
    check_outputs,
    plan_inputs,
    snapshot,
)
from kcoral.timing.nvml import Nvml, sample_left_out
from kcoral.timing.seeds import note_seed
from kcoral.timing.stats import MAX_COUNT, count_from_budget, summarize
from kcoral.timing.timers import UNHELD_MEASURE, CuptiTimer, EventTimer
from kcoral.timing.trust import ArmedState, QuietInterpreter, Trusted, armed, describe_changes

SIDES: Final = ("a", "b")
# Distinct findings kept in the report, at most (every block can repeat one).
REASONS_KEPT: Final = 20
SEED_BITS: Final = 63


@dataclass
class ClockReadings:
    """The SM clock and clock-event mask after each timed call of a block (the ``after_call`` hook)."""

    nvml: Nvml | None
    readings: list[tuple[int | None, int | None]] = field(default_factory=list)

    def read(self) -> None:
        if self.nvml is None:
            self.readings.append((None, None))
        else:
            self.readings.append((self.nvml.sm_clock_mhz(), self.nvml.clock_event_reasons()))


@dataclass
class Side:
    """One of the two callables: its calibration, its timer, and what its blocks gave."""

    name: str
    ready: Calibration
    timer: CuptiTimer | EventTimer
    check_again: bool
    reservoir: OutputReservoir
    block: int = 1
    warmup: int = 0
    samples_ms: list[float] = field(default_factory=list)
    all_samples_ms: list[float] = field(default_factory=list)  # the left out too
    host_ms: list[float] = field(default_factory=list)
    clocks_mhz: list[int] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)
    empty_calls: int = 0
    stable: bool = True
    activities: set[int | None] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    late_calls: int = 0

    def run_block(self, nvml: Nvml | None, floor_mhz: float | None) -> tuple[list[float], list[float]]:
        """Time one block of calls; (the samples kept, all of them). Those left out are counted in
        ``left_out``."""
        clocks = ClockReadings(nvml)
        measurement, _ = self.timer.measure(
            self.ready.runner,
            self.block,
            self.ready.hold_cycles,
            nvml,
            hold_ns=self.ready.hold_ns,
            reservoir=self.reservoir,
            busy=self.ready.unheld,
            after_call=clocks.read,
        )
        if measurement.tampering:
            raise ExecutionError("integrity", describe_changes(measurement.tampering))
        kept: list[float] = []
        for sample, index in zip(measurement.samples_ms, measurement.indices):
            sm_mhz, reasons = clocks.readings[index] if index < len(clocks.readings) else (None, None)
            why = sample_left_out(sm_mhz, reasons, floor_mhz)
            if why is not None:
                self.left_out[why] += 1
                continue
            kept.append(sample)
            if sm_mhz is not None:
                self.clocks_mhz.append(sm_mhz)
        self.samples_ms.extend(kept)
        self.host_ms.extend(measurement.host_ms)
        self.empty_calls += measurement.empty_calls
        self.stable = self.stable and measurement.stable
        self.activities.add(measurement.activities_per_call)
        self.late_calls += measurement.late_calls or 0
        self.all_samples_ms.extend(measurement.samples_ms)
        for reason in measurement.reasons:
            if reason not in self.reasons and len(self.reasons) < REASONS_KEPT:
                self.reasons.append(reason)
        return kept, measurement.samples_ms


def compare(
    a: Callable[..., Any],
    b: Callable[..., Any],
    *args: Any,
    config: Mapping[str, Any] | None = None,
    inputs: InputFactory | None = None,
    check: OutputCheck | None = None,
) -> dict[str, Any]:
    """Time ``a`` and ``b`` in interleaved rounds on the same inputs; is B faster than A?

    Both get the same arguments (rotated clones of CUDA tensors, as in ``benchmark``) or the same
    ``inputs=`` factory, and every defence of ``benchmark``. Rounds of four blocks (``ABBA``) run
    until the 95% interval of B/A is within ``target_halfwidth`` of its estimate, or the budget is
    spent. The answer:

    - ``verdict``: ``faster`` (B takes less time than A), ``slower``, ``same`` (the interval lies
      within ``threshold`` of 1) or ``unclear``; a ``suspect`` run says ``unclear``;
    - ``ratio`` (B/A) with ``ratio_low``/``ratio_high``, ``halfwidth``, ``ratio_of_medians``,
      ``method`` of the interval and its ``seed``;
    - ``a`` and ``b``: each side's median, mean, min, max, std and ``noise`` (relative std), the
      samples used and left out (``left_out``: ``throttled``, ``below_clock_floor``), its hold and
      inputs;
    - ``stop``: which ended the sampling (``target``, ``budget`` or ``max_rounds``), the rounds,
      the time spent; ``clock``: the floor, the clocks seen, the samples left out;
      ``conditions_before``/``conditions_after`` (temperature, clocks, power, utilisation) and
      ``cool_wait``; ``integrity`` (``verdict``, ``reasons``) as in ``benchmark``.

    Config keys: ``threshold`` (0.005), ``confidence`` (0.95), ``target_halfwidth`` (0.002),
    ``budget_ms`` (3000), ``min_rounds`` (8), ``max_rounds`` (2000), ``block_ms`` (5) or
    ``block`` (calls per block), ``order`` (``"abba"`` or ``"shuffled"``), ``clock_floor`` (0.75),
    ``max_left_out`` (0.2), ``wait_cool_ms`` (0: no wait), ``cool_temp_c`` (50),
    ``idle_util_pct`` (5), ``seed``; and benchmark's ``warmup_ms``, ``flush_l2``, ``launch_hold``,
    ``clock_warmup_ms``, ``method``.

    Example::

        import torch
        from kcoral.builtins import compare

        x = torch.randn(1 << 24, device="cuda")
        answer = compare(lambda t: t + 1, lambda t: t.add(1).mul_(1), x)
        print(answer["verdict"], answer["ratio"], answer["ratio_low"], answer["ratio_high"])
    """
    settings = CompareConfig.from_mapping(config)
    timing = settings.timing
    state = armed()
    trusted = state.trusted
    began = trusted.perf_counter()
    spent = DefenceTime(trusted.perf_counter)
    torch = import_torch_with_gpu(state)
    with spent.step("trusted_state"):
        fail_on_changes(state, "since the worker started (before the measurement)")
    # One timer per side: a CUPTI timer keeps what its callable's probe launched.
    timers = [choose_timer(timing.method, state) for _ in SIDES]
    cupti_error = timers[0][1]
    with spent.step("trusted_state"):
        check_subscriber(state, timers[0][0])
    with spent.step("inputs"):
        plan = plan_inputs(torch, tuple(args), inputs)
    try:
        report = _run(state, torch, (a, b), [t for t, _ in timers], plan, check, settings, spent)
    except ExecutionError:
        raise
    except Exception as exc:
        if isinstance(timers[0][0], CuptiTimer) and is_cupti_failure(exc):
            raise ExecutionError(
                "integrity", f"CUPTI worked when the worker started but failed during the measurement: {exc!r}"
            ) from exc
        raise
    report["cupti_error"] = cupti_error
    report["wall_ms"] = round((trusted.perf_counter() - began) * 1e3, 3)
    report["integrity_details"]["defences_ms"] = spent.report()
    return report


def _run(
    state: ArmedState,
    torch: Any,
    fns: tuple[Callable[..., Any], Callable[..., Any]],
    timers: list[CuptiTimer | EventTimer],
    plan: Any,
    check: OutputCheck | None,
    settings: CompareConfig,
    spent: DefenceTime,
) -> dict[str, Any]:
    trusted = state.trusted
    timing = settings.timing
    device = torch.cuda.current_device()
    nvml = Nvml.open(torch, device)
    seed = settings.seed if settings.seed is not None else secrets.randbits(SEED_BITS)
    note_seed("compare", seed)
    cool = wait_for_cool_gpu(nvml, timing, trusted)
    conditions_before = gpu_conditions(nvml)
    sides: list[Side] = []
    for name, fn, timer in zip(SIDES, fns, timers):
        ready = calibrate(trusted, torch, fn, plan, timer, nvml, timing, spent)
        check_again = plan.mode == MODE_ROTATED and check is None and not ready.writes_inputs
        keep = OUTPUTS_KEPT if (check is not None or check_again) else 0
        sides.append(Side(name, ready, timer, check_again, OutputReservoir(keep, trusted.randbelow)))
    # The block: calls of about block_ms, the same count for both sides' cost (the slower side's).
    per_call_ms = max(side.ready.per_call_ms for side in sides)
    block = settings.block or min(MAX_COUNT, count_from_budget(settings.block_ms, per_call_ms, minimum=1))
    block = min(block, MAX_BLOCK_CALLS)
    for side in sides:
        side.block = block
        side.warmup = warm_up(side.ready, timing)
    max_clock = nvml.max_sm_clock_mhz() if nvml is not None else None
    floor_mhz = settings.clock_floor * max_clock if max_clock else None

    with spent.step("environment"):
        watch = EnvironmentWatch.start(nvml, trusted.enumerate_threads, state.threads_at_arm, int(time.time() * 1e6))
    done = _rounds(trusted, sides, nvml, floor_mhz, settings, seed)
    ratios = done.ratios
    reasons: list[str] = []
    for side in sides:
        reasons.extend(f"{side.name.upper()}: {reason}" for reason in side.reasons)
        spent.add("outputs", side.reservoir.snapshot_ms)
    with spent.step("environment"):
        reasons.extend(watch.finish())
    with spent.step("trusted_state"):
        fail_on_changes(state, "during the measurement")
        flush_changed = any(side.ready.runner.flush_state() != side.ready.runner.flush_shape for side in sides)
    if flush_changed:
        raise ExecutionError("integrity", "the timer's L2 flush buffer was changed during the measurement")
    checked = {side.name: _check(torch, trusted, side, check, spent) for side in sides}
    if any(checked.values()):
        # The checks called the user's functions again: whatever they changed then is seen now,
        # before anything of the report is made (from here on no user code runs).
        with spent.step("trusted_state"):
            fail_on_changes(state, "while the outputs were checked")
    if not done.unfiltered:
        raise ExecutionError("unavailable", "the calls launched no GPU work in any round: there is nothing to compare")
    clock = _clock_report(sides, max_clock, floor_mhz, settings.max_left_out)
    filtered = bool(ratios) and all(side.samples_ms for side in sides)
    if not filtered:
        # Better a number marked suspect (the clock report says why) than none at all.
        ratios = done.unfiltered
        reasons.append("no round kept samples of both A and B at a steady clock: the interval is of all samples")
        for side in sides:
            side.samples_ms = list(side.all_samples_ms)
    final = ratio_interval(ratios, confidence=settings.confidence, resamples=BOOTSTRAP_RESAMPLES, seed=seed)
    described = {side.name: _describe_side(side, checked[side.name]) for side in sides}
    for side in sides:
        gap = host_gap_reason(described[side.name]["latency_ms_median"], described[side.name]["host_ms_median"])
        if gap is not None:
            reasons.append(f"{side.name.upper()}: {gap}")
    reasons.extend(clock.pop("reasons"))
    statistical = decide(final, settings.threshold)
    integrity = verdict(reasons)
    medians = (described["a"]["latency_ms_median"], described["b"]["latency_ms_median"])
    return {
        "verdict": statistical if integrity["verdict"] == "ok" else VERDICT_UNCLEAR,
        "verdict_if_trusted": statistical,
        "ratio": final.estimate,
        "ratio_low": final.low,
        "ratio_high": final.high,
        "halfwidth": final.halfwidth,
        "contains_one": final.contains(1.0),
        "ratio_of_medians": medians[1] / medians[0] if medians[0] else None,
        "confidence": settings.confidence,
        "threshold": settings.threshold,
        "interval_method": METHOD,
        "seed": seed,
        "a": described["a"],
        "b": described["b"],
        "rounds": len(ratios),
        "rounds_left_out": done.left_out,
        "round_ratios": [round(r, 6) for r in ratios],
        "order": settings.order,
        "block_orders": dict(Counter(done.orders)),
        "block_calls": block,
        "stop": {
            "reason": done.stop,
            "target_halfwidth": settings.target_halfwidth,
            "halfwidth_at_stop": done.interval.halfwidth if done.interval is not None else None,
            "budget_ms": settings.budget_ms,
            "min_rounds": settings.min_rounds,
            "max_rounds": settings.max_rounds,
            "measure_ms": round(done.elapsed_ms, 3),
        },
        "clock": clock,
        "cool_wait": cool.describe(),
        "conditions_before": conditions_before,
        "conditions_after": gpu_conditions(nvml),
        "method": timers[0].method,
        "flush_l2": settings.timing.flush_l2,
        "gpu": str(trusted.device_name(device)) if trusted.device_name is not None else None,
        "device_index": int(device) if isinstance(device, int) else None,
        "inputs": plan.describe(),
        "integrity": integrity,
        "integrity_details": dict(watch.details),
    }


@dataclass
class Rounds:
    """What the rounds gave: the ratio of each kept round, and why and when they stopped."""

    ratios: list[float] = field(default_factory=list)
    unfiltered: list[float] = field(default_factory=list)  # each round's ratio of all its samples
    left_out: int = 0  # rounds in which a side kept no sample
    orders: list[str] = field(default_factory=list)
    stop: str = ""
    interval: Interval | None = None  # the last stop check's
    elapsed_ms: float = 0.0


def _rounds(
    trusted: Trusted, sides: list[Side], nvml: Nvml | None, floor_mhz: float | None, settings: CompareConfig, seed: int
) -> Rounds:
    """Run rounds of four blocks until the adaptive stop says which ends them."""
    by_name = {side.name.upper(): side for side in sides}
    done = Rounds()
    began = trusted.perf_counter()
    stop: str | None = None
    while stop is None:
        order = block_order(settings.order, trusted.randbelow)
        done.orders.append(order)
        kept: dict[str, list[float]] = {"A": [], "B": []}
        every: dict[str, list[float]] = {"A": [], "B": []}
        with QuietInterpreter(trusted):
            for letter in order:
                block_kept, block_all = by_name[letter].run_block(nvml, floor_mhz)
                kept[letter].extend(block_kept)
                every[letter].extend(block_all)
        unfiltered = round_ratio(every["A"], every["B"])
        if unfiltered is not None:
            done.unfiltered.append(unfiltered)
        ratio = round_ratio(kept["A"], kept["B"])
        if ratio is None:
            done.left_out += 1
        else:
            done.ratios.append(ratio)
        if ratio is not None and len(done.ratios) >= settings.min_rounds:
            done.interval = ratio_interval(
                done.ratios, confidence=settings.confidence, resamples=CHECK_RESAMPLES, seed=seed + len(done.ratios)
            )
        done.elapsed_ms = (trusted.perf_counter() - began) * 1e3
        stop = stop_reason(
            rounds=len(done.ratios),
            halfwidth=done.interval.halfwidth if done.interval is not None else None,
            elapsed_ms=done.elapsed_ms,
            min_rounds=settings.min_rounds,
            max_rounds=settings.max_rounds,
            target_halfwidth=settings.target_halfwidth,
            budget_ms=settings.budget_ms,
        )
        # Rounds that keep nothing count against the most rounds too: a throttled GPU ends the run.
        if stop is None and len(done.ratios) + done.left_out >= settings.max_rounds:
            stop = STOP_MAX_ROUNDS
    done.stop = stop
    return done


def _check(torch: Any, trusted: Trusted, side: Side, check: OutputCheck | None, spent: DefenceTime) -> int:
    """Check the side's kept outputs as ``benchmark`` does; the number checked."""
    if check is None and not side.check_again:
        return 0
    runner = side.ready.runner

    def again(kept: KeptOutput) -> Any:
        # The candidate's own output for the same inputs, untimed: what a timed call must return.
        output = runner.call(kept.inputs)
        runner.synchronize()
        with trusted.plain_torch():
            return snapshot(torch, output)

    with spent.step("outputs"):
        return check_outputs(
            torch,
            side.reservoir.kept,
            check=check,
            expected=again if check is None else None,
            assert_close=torch.testing.assert_close,
        )


def _describe_side(side: Side, outputs_checked: int) -> dict[str, Any]:
    described: dict[str, Any] = summarize(side.samples_ms)
    ready = side.ready
    described.update(
        {
            "noise": noise(side.samples_ms),
            "samples": len(side.samples_ms),
            "left_out": dict(side.left_out),
            "empty_calls": side.empty_calls,
            "host_ms_median": float(statistics.median(side.host_ms)) if side.host_ms else None,
            "warmup": side.warmup,
            "activities_stable": side.stable and len(side.activities) <= 1,
            "activities_per_call": next(iter(side.activities)) if len(side.activities) == 1 else None,
            "latency_measure": UNHELD_MEASURE if ready.unheld and isinstance(side.timer, CuptiTimer) else "span",
            "launch_hold": ready.hold_state,
            "launch_hold_us": round(ready.hold_us, 1) if ready.hold_cycles else 0.0,
            "launch_late_calls": side.late_calls if ready.hold_cycles else None,
            "clock_steady": ready.clock_steady,
            "clock_warmup_ms": round(ready.clock_warmup_ms, 3),
            "outputs_checked": outputs_checked,
        }
    )
    return described


def _clock_report(
    sides: list[Side], max_clock: int | None, floor_mhz: float | None, max_left_out: float
) -> dict[str, Any]:
    """The ``clock`` section, and the reasons (under ``reasons``) it gives to distrust the run."""
    reasons: list[str] = []
    clocks = [mhz for side in sides for mhz in side.clocks_mhz]
    left = Counter[str]()
    for side in sides:
        left.update(side.left_out)
    used = sum(len(side.samples_ms) for side in sides)
    total = used + sum(left.values())
    for side in sides:
        if side.ready.clock_steady is False:
            reasons.append(
                f"{side.name.upper()}: the SM clock did not settle within the clock warm-up "
                f"({side.ready.clock_warmup_ms:.0f} ms)"
            )
    if total and sum(left.values()) > max_left_out * total:
        reasons.append(
            f"{sum(left.values())} of {total} samples were taken throttled or below the clock floor "
            f"({dict(left)}): the GPU did not hold a steady clock"
        )
    return {
        "max_sm_clock_mhz": max_clock,
        "floor_mhz": round(floor_mhz, 1) if floor_mhz is not None else None,
        "sm_clock_mhz_median": float(statistics.median(clocks)) if clocks else None,
        "sm_clock_mhz_min": min(clocks) if clocks else None,
        "sm_clock_mhz_max": max(clocks) if clocks else None,
        "samples_used": used,
        "samples_left_out": dict(left),
        "filter": "per call" if max_clock is not None else "off: NVML cannot read the clock",
        "reasons": reasons,
    }
