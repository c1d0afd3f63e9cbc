"""``compare``'s rounds: the two sides (each callable's calibration, timer and what its blocks
gave), one block of timed calls with the SM clock read after each call and the samples taken
throttled or below the clock floor left out, and the rounds of four blocks until the adaptive stop
(``timing.ab_stats``) ends them. A round whose A and B samples ran at SM clocks further apart than
``clock_tolerance`` is set aside: a power cap both sides share is the steady state of a heavy
kernel, a clock that moved under one side only is a disturbance."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from kcoral.errors import ExecutionError
from kcoral.timing.ab_config import CompareConfig
from kcoral.timing.ab_stats import (
    CHECK_RESAMPLES,
    Interval,
    StopReason,
    block_order,
    ratio_interval,
    round_ratio,
    stop_reason,
)
from kcoral.timing.calibrate import Calibration
from kcoral.timing.calls import CountedCalls
from kcoral.timing.inputs import OutputReservoir
from kcoral.timing.nvml import Nvml, clocks_apart, power_capped, sample_left_out
from kcoral.timing.timers import CuptiTimer, EventTimer
from kcoral.timing.trust import QuietInterpreter, Trusted, describe_changes

# Distinct findings kept in the report, at most (every block can repeat one).
REASONS_KEPT: Final = 20


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
    power_capped: int = 0  # samples kept that NVML read under the software power cap
    empty_calls: int = 0
    stable: bool = True
    activities: set[int | None] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    late_calls: int = 0

    def run_block(self, nvml: Nvml | None, floor_mhz: float | None) -> tuple[list[float], list[float], list[int]]:
        """Time one block of calls; (the samples kept, all of them, the SM clocks of those kept).
        Those left out are counted in ``left_out``."""
        clocks = ClockReadings(nvml)
        ready = self.ready
        counted = CountedCalls(
            ready.runner, self.block, ready.hold_cycles, ready.hold_ns, ready.unheld, self.reservoir, clocks.read
        )
        measurement, _ = self.timer.measure(counted, nvml)
        if measurement.tampering:
            raise ExecutionError("integrity", describe_changes(measurement.tampering))
        kept: list[float] = []
        kept_clocks: list[int] = []
        for sample, index in zip(measurement.samples_ms, measurement.indices):
            sm_mhz, reasons = clocks.readings[index] if index < len(clocks.readings) else (None, None)
            why = sample_left_out(sm_mhz, reasons, floor_mhz)
            if why is not None:
                self.left_out[why] += 1
                continue
            kept.append(sample)
            self.power_capped += int(power_capped(reasons))
            if sm_mhz is not None:
                kept_clocks.append(sm_mhz)
        self.clocks_mhz.extend(kept_clocks)
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
        return kept, measurement.samples_ms, kept_clocks


@dataclass
class Rounds:
    """What the rounds gave: the ratio of each kept round, and why and when they stopped."""

    ratios: list[float] = field(default_factory=list)
    unfiltered: list[float] = field(default_factory=list)  # each round's ratio of all its samples
    left_out: int = 0  # rounds in which a side kept no sample
    clock_apart: int = 0  # rounds set aside: A's and B's samples ran at clocks apart (clocks_apart)
    orders: list[str] = field(default_factory=list)
    stop: str = ""
    interval: Interval | None = None  # the last stop check's
    elapsed_ms: float = 0.0


def run_rounds(
    trusted: Trusted, sides: list[Side], nvml: Nvml | None, floor_mhz: float | None, settings: CompareConfig, seed: int
) -> Rounds:
    """Run rounds of four blocks until the adaptive stop says which ends them."""
    by_name = {side.name.upper(): side for side in sides}
    done = Rounds()
    began = trusted.perf_counter()
    stop: str | None = None
    while stop is None:
        order = block_order(settings.order, trusted.randbelow, len(done.orders))
        done.orders.append(order)
        kept: dict[str, list[float]] = {"A": [], "B": []}
        every: dict[str, list[float]] = {"A": [], "B": []}
        clocks: dict[str, list[int]] = {"A": [], "B": []}
        with QuietInterpreter(trusted):
            for letter in order:
                block_kept, block_all, block_clocks = by_name[letter].run_block(nvml, floor_mhz)
                kept[letter].extend(block_kept)
                every[letter].extend(block_all)
                clocks[letter].extend(block_clocks)
        unfiltered = round_ratio(every["A"], every["B"])
        if unfiltered is not None:
            done.unfiltered.append(unfiltered)
        ratio = round_ratio(kept["A"], kept["B"])
        if ratio is None:
            done.left_out += 1
        elif clocks_apart(clocks["A"], clocks["B"], settings.clock_tolerance):
            done.clock_apart += 1
            ratio = None
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
        if stop is None and len(done.ratios) + done.left_out + done.clock_apart >= settings.max_rounds:
            stop = StopReason.MAX_ROUNDS
    done.stop = stop
    return done
