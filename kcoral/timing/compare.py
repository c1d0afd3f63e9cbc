"""``compare``: is B faster than A, and can the answer be trusted?

Two callables are timed in interleaved rounds on the same inputs, inside one program (one lease),
with every defence of ``benchmark``: the same calibration (``timing.calibrate``: the trusted state,
the timer, the probe, the clock warm-up, the launch hold), the same timed loop and timers
(``timing.calls``, ``timing.timers``: windows between device-wide synchronisations, the L2 flush,
rotated clones of the inputs, a sample of outputs checked) and the same findings
(``timing.findings``). What ``compare`` adds:

- rounds of four blocks, ``ABBA`` and ``BAAB`` in turn (or ``AABB`` shuffled), so that A and B
  meet the same conditions; the statistics of the rounds are in ``timing.ab_stats`` (the method
  is stated there);
- an adaptive stop: rounds go on until the interval of B/A is narrow enough (``target_halfwidth``),
  or the time budget (``budget_ms``) or the most rounds are spent, and the report says which;
- the SM clock and clock-event reasons after every timed call (NVML, read in the gap after the
  call's window, where the timer launches nothing): a sample taken throttled (hardware or thermal
  slowdown, the power brake) or below ``clock_floor`` x the GPU's maximum SM clock is left out and
  counted; one taken under the software power cap alone is kept and counted (the steady state of
  a heavy GEMM), and a round whose A and B ran at clocks more than ``clock_tolerance`` apart is set
  aside; a run whose clock never settled, that left out more than ``max_left_out`` of its samples
  or set aside more than that share of its rounds, or whose A and B clocks differ over the run, is
  ``suspect``;
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
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.ab_config import MAX_BLOCK_CALLS, CompareConfig
from kcoral.timing.ab_report import check_side, clock_report, describe_side
from kcoral.timing.ab_rounds import Side, run_rounds
from kcoral.timing.ab_stats import (
    BOOTSTRAP_RESAMPLES,
    METHOD,
    answer,
    ratio_interval,
)
from kcoral.timing.calibrate import DefenceTime, calibrate, fail_on_changes, start, wait_for_cool_gpu, warm_up
from kcoral.timing.conditions import gpu_conditions
from kcoral.timing.findings import EnvironmentWatch, host_gap_reason, verdict
from kcoral.timing.inputs import (
    MODE_ROTATED,
    OUTPUTS_KEPT,
    InputFactory,
    OutputCheck,
    OutputReservoir,
    plan_inputs,
)
from kcoral.timing.nvml import Nvml
from kcoral.timing.seeds import note_seed
from kcoral.timing.stats import MAX_COUNT, count_from_budget
from kcoral.timing.timers import CuptiTimer, EventTimer
from kcoral.timing.trust import ArmedState, ask_again

SIDES: Final = ("a", "b")
SEED_BITS: Final = 63


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
    ``inputs=`` factory, and every defence of ``benchmark``. Rounds of four blocks (``ABBA``,
    ``BAAB``) run until the 95% interval of B/A is within ``target_halfwidth`` of its estimate, or the
    budget is spent. The answer:

    - ``verdict``: ``faster`` (B takes less time than A), ``slower``, ``same`` (the interval lies
      within ``threshold`` of 1, or holds 1 at a half-width of at most ``threshold``) or
      ``unclear``; a ``suspect`` run says ``unclear``;
    - ``ratio`` (B/A) with ``ratio_low``/``ratio_high``, ``halfwidth``, ``ratio_of_medians``,
      ``method`` of the interval and its ``seed``;
    - ``a`` and ``b``: each side's median, mean, min, max, std and ``noise`` (relative std), the
      samples used and left out (``left_out``: ``throttled``, ``below_clock_floor``), its hold and
      inputs;
    - ``stop``: which ended the sampling (``target``, ``budget`` or ``max_rounds``), the rounds,
      the time spent; ``clock``: the floor, the clocks seen (each side's median too), the samples
      left out and those power capped, the rounds set aside for clocks apart;
      ``conditions_before``/``conditions_after`` (temperature, clocks, power, utilisation) and
      ``cool_wait``; ``integrity`` (``verdict``, ``reasons``) as in ``benchmark``.

    Config keys: ``threshold`` (0.005), ``confidence`` (0.95), ``target_halfwidth`` (0.002),
    ``budget_ms`` (3000), ``min_rounds`` (8), ``max_rounds`` (2000), ``block_ms`` (5) or
    ``block`` (calls per block), ``order`` (``"abba"`` or ``"shuffled"``), ``clock_floor`` (0.75),
    ``max_left_out`` (0.2), ``clock_tolerance`` (0.03), ``wait_cool_ms`` (0: no wait), ``cool_temp_c`` (50),
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
    begun = start(settings.timing.method, len(SIDES))
    with begun.spent.step("inputs"):
        plan = plan_inputs(begun.torch, tuple(args), inputs)
    with begun.measuring():
        report = _run(begun.state, begun.torch, (a, b), begun.timers, plan, check, settings, begun.spent)
    begun.finish(report)
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
        watch = EnvironmentWatch.start(
            nvml,
            trusted.enumerate_threads,
            state.threads_at_arm,
            int(time.time() * 1e6),
            state.known_pids,
            ask_again(state),
        )
    done = run_rounds(trusted, sides, nvml, floor_mhz, settings, seed)
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
    checked = {side.name: check_side(torch, trusted, side, check, spent) for side in sides}
    if any(checked.values()):
        # The checks called the user's functions again: whatever they changed then is seen now,
        # before anything of the report is made (from here on no user code runs).
        with spent.step("trusted_state"):
            fail_on_changes(state, "while the outputs were checked")
    if not done.unfiltered:
        raise ExecutionError("unavailable", "the calls launched no GPU work in any round: there is nothing to compare")
    clock = clock_report(
        sides,
        max_clock,
        floor_mhz,
        settings.max_left_out,
        rounds_kept=len(done.ratios),
        rounds_clock_apart=done.clock_apart,
        clock_tolerance=settings.clock_tolerance,
    )
    filtered = bool(ratios) and all(side.samples_ms for side in sides)
    if not filtered:
        # Better a number marked suspect (the clock report says why) than none at all.
        ratios = done.unfiltered
        reasons.append("no round kept samples of both A and B at a steady clock: the interval is of all samples")
        for side in sides:
            side.samples_ms = list(side.all_samples_ms)
    final = ratio_interval(ratios, confidence=settings.confidence, resamples=BOOTSTRAP_RESAMPLES, seed=seed)
    described = {side.name: describe_side(side, checked[side.name]) for side in sides}
    for side in sides:
        gap = host_gap_reason(described[side.name]["latency_ms_median"], described[side.name]["host_ms_median"])
        if gap is not None:
            reasons.append(f"{side.name.upper()}: {gap}")
    reasons.extend(clock.pop("reasons"))
    integrity = verdict(reasons)
    medians = (described["a"]["latency_ms_median"], described["b"]["latency_ms_median"])
    return {
        **answer(final, settings.threshold, integrity["verdict"]),
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
        "rounds_clock_apart": done.clock_apart,
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
