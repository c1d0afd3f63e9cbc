"""``compare``'s report of each side and of the clock: the side's kept outputs checked as
``benchmark`` checks them, its latencies and defences described, and the ``clock`` section with the
reasons it gives to distrust the run."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from kcoral.timing.ab_rounds import Side
from kcoral.timing.ab_stats import noise
from kcoral.timing.calibrate import DefenceTime
from kcoral.timing.calls import check_kept
from kcoral.timing.inputs import OutputCheck
from kcoral.timing.nvml import clocks_apart
from kcoral.timing.stats import summarize
from kcoral.timing.timers import UNHELD_MEASURE, CuptiTimer
from kcoral.timing.trust import Trusted


def check_side(torch: Any, trusted: Trusted, side: Side, check: OutputCheck | None, spent: DefenceTime) -> int:
    """Check the side's kept outputs as ``benchmark`` does; the number checked."""
    if check is None and not side.check_again:
        return 0
    with spent.step("outputs"):
        return check_kept(torch, trusted, side.ready.runner, side.reservoir.kept, check)


def describe_side(side: Side, outputs_checked: int) -> dict[str, Any]:
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


def clock_report(
    sides: list[Side],
    max_clock: int | None,
    floor_mhz: float | None,
    max_left_out: float,
    *,
    rounds_kept: int = 0,
    rounds_clock_apart: int = 0,
    clock_tolerance: float = 0.0,
) -> dict[str, Any]:
    """The ``clock`` section, and the reasons (under ``reasons``) it gives to distrust the run.

    Samples taken under the software power cap alone are kept and counted
    (``samples_power_capped``): what tells a steady capped clock from a disturbance is whether A
    and B ran at the same clock, round by round (``rounds_clock_apart``) and over the run
    (``sm_clock_mhz_median_by_side``)."""
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
    by_side = {side.name: float(statistics.median(side.clocks_mhz)) if side.clocks_mhz else None for side in sides}
    judged = rounds_kept + rounds_clock_apart
    if judged and rounds_clock_apart > max_left_out * judged:
        reasons.append(
            f"in {rounds_clock_apart} of {judged} rounds A and B ran at SM clocks more than "
            f"{clock_tolerance:.1%} apart (medians over the run: {by_side}): the clock moved under one side"
        )
    elif len(sides) == 2 and clocks_apart(sides[0].clocks_mhz, sides[1].clocks_mhz, clock_tolerance):
        reasons.append(
            f"A and B ran at SM clocks more than {clock_tolerance:.1%} apart over the run "
            f"(medians {by_side}): the clock was not the same for both"
        )
    return {
        "max_sm_clock_mhz": max_clock,
        "floor_mhz": round(floor_mhz, 1) if floor_mhz is not None else None,
        "sm_clock_mhz_median": float(statistics.median(clocks)) if clocks else None,
        "sm_clock_mhz_min": min(clocks) if clocks else None,
        "sm_clock_mhz_max": max(clocks) if clocks else None,
        "sm_clock_mhz_median_by_side": by_side,
        "samples_used": used,
        "samples_left_out": dict(left),
        "samples_power_capped": sum(side.power_capped for side in sides),
        "clock_tolerance": clock_tolerance,
        "rounds_clock_apart": rounds_clock_apart,
        "filter": "per call" if max_clock is not None else "off: NVML cannot read the clock",
        "reasons": reasons,
    }
