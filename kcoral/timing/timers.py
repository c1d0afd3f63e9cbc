"""How ``benchmark`` times the counted calls (run by ``kcoral.timing.calls``).

``CuptiTimer`` and ``EventTimer`` turn a batch of timed calls into latencies, from CUPTI activity
records attributed by window (``kcoral.timing.windows``) or from CUDA events alone. The package
docstring (``kcoral.timing``) says why each step is there.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.calls import CountedCalls, Runner, TimedCalls, timed_calls
from kcoral.timing.cupti import (
    CuptiTracer,
    cupti_thread_id,
    reserve_external_ids,
)
from kcoral.timing.inputs import KeptOutput
from kcoral.timing.nvml import Nvml, clock_state
from kcoral.timing.stats import activities_stable
from kcoral.timing.windows import (
    WALL_CLOCK_STEP_NS,
    ClockDisagreement,
    WindowTimings,
    attribute,
    clock_disagreement,
)

# The launch hold: a one-thread GPU spin before each counted call, long enough for the host to
# launch the whole call behind it. First guess: this multiple of the untraced launch time plus the
# margin (tracing slows launches down), then doubled while traced calls still launch late.
HOLD_LAUNCH_FACTOR: Final = 3.0
HOLD_MARGIN_US: Final = 30.0
MIN_HOLD_US: Final = 30.0
MAX_HOLD_US: Final = 5_000.0
HOLD_FIT_ROUNDS: Final = 4
HOLD_FIT_CALLS: Final = 3
# Spin length used to measure how many SM cycles the spin counts per microsecond (~50 us at 2 GHz).
# Calls with work on another stream get no hold, so their span includes the host's launch gaps (a
# side-stream cuBLAS matmul launches a memset, then the GEMM some microseconds later): their latency
# is the time any of their activities ran. Measured on the H200: span 180-187 us over ten programs,
# busy 174.9 us, Nsight Compute 175.7 us. Every activity is still counted, so this hides no work.
UNHELD_MEASURE: Final = "busy"
UNHELD_STATE: Final = "off: the call runs work on another stream"
# Records of the timer's own flush that may go missing before that counts as tampering (CUPTI may
# drop a record under pressure; a candidate that turns kinds off loses every later one).
OWN_RECORDS_SLACK: Final = 0.01


@dataclass
class Measurement:
    """What a timer made of the counted calls: the samples and what else it could tell."""

    samples_ms: list[float]
    stable: bool
    empty_calls: int
    activities_per_call: int | None
    by_estimate: dict[str, float | None] = field(default_factory=dict)
    late_calls: int | None = None
    host_ms: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # findings: make the verdict suspect
    tampering: list[str] = field(default_factory=list)  # integrity failures
    details: dict[str, Any] = field(default_factory=dict)
    kept: list[KeptOutput] = field(default_factory=list)
    first_input_index: int = 0
    # The index of the timed call each sample came from (calls that launched nothing have none).
    indices: list[int] = field(default_factory=list)


def _timings(tracer: CuptiTracer, calls: TimedCalls, base: int) -> tuple[WindowTimings, list[str]]:
    records = tracer.drain()
    timings = attribute(
        records.activities,
        records.external,
        calls.windows,
        base,
        caller_thread=cupti_thread_id(),
        api_threads=records.api_threads,
        api_ends=records.api_ends,
        until_ns=calls.trailing_end_ns,
    )
    return timings, records.errors


class CuptiTimer:
    """Times each call from the CUPTI activity records of all the process ran inside its window."""

    method = "cupti"

    def __init__(self, tracer: CuptiTracer) -> None:
        self._tracer = tracer
        self.probe_kinds: frozenset[str] = frozenset()
        self.probe_signature: list[tuple[str, str]] | None = None

    def probe(self, runner: Runner) -> None:
        """Run one traced call; a call that launches no GPU work cannot be timed. Notes which of the
        sentinel's activity kinds CUPTI records here, the baseline for the checks after measuring."""
        base = reserve_external_ids()
        calls = timed_calls(runner, 1, hold_cycles=0, tracer=self._tracer, base=base)
        timings, _ = _timings(self._tracer, calls, base)
        self.probe_kinds = timings.sentinels_seen
        tampering = list(calls.stack_changes)
        if "concurrent_kernel" not in timings.sentinels_seen:
            # CUPTI worked when the timer was armed; now not even the timer's own kernel is recorded.
            tampering.append(
                "CUPTI recorded none of the timer's own work in the first traced call: "
                "its activity callbacks or kinds were changed since the worker started"
            )
        if tampering:
            raise ExecutionError("integrity", "; ".join(tampering))
        if timings.empty_calls:
            raise ExecutionError(
                "unavailable",
                "the benchmarked call launched no GPU work (no kernel, memcpy or memset was recorded); "
                "there is nothing to time",
            )
        self.probe_signature = timings.signatures[0]

    def fit_hold(self, runner: Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        """Lengthen the hold until traced calls finish launching before it ends (bounded).

        Returns the hold (0 for none) and why. A call with work on another stream gets no hold:
        that work starts at once, beside the spin kernel, and a kernel that wants every SM (a
        persistent GEMM) then waits for the spin's SM; measured on the H200, a side-stream 4096^3
        matmul read 211 us with the hold and 184-188 us without.
        """
        for _ in range(HOLD_FIT_ROUNDS):
            base = reserve_external_ids()
            cycles = int(hold_us * cycles_per_us)
            calls = timed_calls(
                runner, HOLD_FIT_CALLS, hold_cycles=cycles, tracer=self._tracer, base=base, hold_ns=int(hold_us * 1e3)
            )
            timings, _ = _timings(self._tracer, calls, base)
            if timings.unheld_calls:
                return 0.0, f"{UNHELD_STATE}, which a hold cannot hold"
            if timings.late_calls == 0:
                return hold_us, "on"
            if hold_us >= MAX_HOLD_US:
                return hold_us, "on, but the host launches more slowly than the longest hold"
            hold_us = min(MAX_HOLD_US, hold_us * 2)
        return hold_us, "on, but the host still launched late after the last lengthening"

    def measure(self, counted: CountedCalls, nvml: Nvml | None) -> tuple[Measurement, dict[str, Any]]:
        """Time the counted calls; the clock state after them beside the measurement."""
        base = reserve_external_ids()
        calls = counted.run(self._tracer, base)
        after = clock_state(nvml)
        repeat, hold_cycles, reservoir = counted.repeat, counted.hold_cycles, counted.reservoir
        timings, record_errors = _timings(self._tracer, calls, base)
        tampering = list(calls.stack_changes)
        tampering.extend(f"CUPTI record processing failed: {error}" for error in record_errors[:3])
        # What the records say of the timer's own work, read on CUPTI's clock.
        on_cuptis_clock: list[str] = []
        if timings.forged_activities:
            on_cuptis_clock.append(
                f"{timings.forged_activities} GPU activities carried the timer's own external ids without being "
                f"its work (the ids were read from the timer and reused to hide work): {timings.forged_summary()}"
            )
        on_cuptis_clock.extend(
            own_records_missing(timings, repeat, hold_cycles > 0, counted.runner.flush_shape is not None)
        )
        disagreement = clock_disagreement(calls.windows)
        if disagreement is not None and disagreement.too_far:
            on_cuptis_clock.append(clock_tampering(disagreement))
        for kind in sorted(self.probe_kinds - timings.sentinels_seen):
            on_cuptis_clock.append(
                f"CUPTI recorded the timer's own {kind} before the timed calls but not after them: "
                "its activity kinds or callbacks were changed"
            )
        reasons = cupti_reasons(timings, self.probe_signature, self.probe_kinds)
        if abs(calls.wall_step_ns) > WALL_CLOCK_STEP_NS:
            # The host's wall clock was stepped meanwhile (no program in the sandbox can): CUPTI's
            # timestamps jumped with it, and records may sit in the wrong windows. Not tampering
            # then, but nothing to trust either: suspect, with what the records seemed to say.
            reasons.append(wall_clock_stepped(calls.wall_step_ns))
            reasons.extend(on_cuptis_clock)
        else:
            tampering.extend(on_cuptis_clock)
        if not timings.spans_ms:
            raise ExecutionError("unavailable", "the benchmarked call launched no GPU work during the counted calls")
        counts = {len(signature) for signature in timings.signatures}
        events = [calls.event_ms[index] for index in timings.indices] if calls.event_ms else []
        by_estimate: dict[str, float | None] = {
            "span": _median(timings.spans_ms),
            "ready_span": _median(timings.ready_spans_ms),
            "busy": _median(timings.busy_ms),
            "cuda_event": _median(events),
        }
        details = {
            "other_thread_activities": timings.other_thread_activities,
            "foreign_activities": len(timings.foreign),
            "foreign_ms": round(timings.foreign_ms, 6),
            # The device's records moved onto the host's clock by this much (kcoral.timing.windows).
            "clock_offset_us": round(timings.clock_offset_ns / 1e3, 3),
            # How much of what the clock check allows CUPTI's clock used (windows.clock_disagreement):
            # 0 where it kept time with the host's inside every bracket; past 1 fails the measurement.
            "clock_stray_share": None if disagreement is None else round(disagreement.used, 4),
            # How far the host's wall clock, which CUPTI's timestamps follow, was stepped meanwhile.
            "wall_clock_step_us": round(calls.wall_step_ns / 1e3, 3),
        }
        return (
            Measurement(
                samples_ms=timings.busy_ms if counted.busy else timings.spans_ms,
                stable=timings.empty_calls == 0 and activities_stable(timings.signatures),
                empty_calls=timings.empty_calls,
                activities_per_call=counts.pop() if len(counts) == 1 else None,
                by_estimate=by_estimate,
                late_calls=timings.late_calls if hold_cycles > 0 else None,
                host_ms=timings.host_ms,
                reasons=reasons,
                tampering=tampering,
                details=details,
                kept=list(reservoir.kept) if reservoir is not None else [],
                first_input_index=calls.first_input_index,
                indices=list(timings.indices),
            ),
            after,
        )


def wall_clock_stepped(step_ns: int) -> str:
    """The reason a measurement is suspect when the host's wall clock was stepped while it ran."""
    way = "forward" if step_ns > 0 else "back"
    return (
        f"the host's wall clock was stepped {way} by {abs(step_ns) / 1e3:.1f} us during the measurement; "
        "CUPTI's timestamps follow it, so the timed windows cannot be trusted: measure again"
    )


def clock_tampering(disagreement: ClockDisagreement) -> str:
    """The integrity failure of a CUPTI clock that did not keep time with the host's."""
    where, stray = (
        ("timed windows", disagreement.windows)
        if disagreement.windows.too_far
        else ("gaps between the timed calls", disagreement.gaps)
    )
    shorter = stray.short_ns >= stray.long_ns
    way, off = ("shorter", stray.short_ns) if shorter else ("longer", stray.long_ns)
    return (
        f"CUPTI's clock made the {stray.intervals} {where} {off / 1e3:.1f} us {way} in all than the host's own "
        f"clock read them ({stray.host_ns / 1e3:.1f} us): its timestamp source was replaced or changed during "
        "the measurement"
    )


def own_records_missing(timings: WindowTimings, calls: int, held: bool, flushed: bool) -> list[str]:
    """Integrity failures: the timer's own hold and flush records that CUPTI should have delivered."""
    missing: list[str] = []
    slack = max(1, int(calls * OWN_RECORDS_SLACK))
    if held and calls - timings.holds_seen > slack:
        missing.append(
            f"CUPTI recorded the timer's own hold before only {timings.holds_seen} of {calls} calls: "
            "activity records were lost or activity kinds changed"
        )
    if flushed and calls - timings.gaps_seen > slack:
        missing.append(
            f"CUPTI recorded the timer's own L2 flush before only {timings.gaps_seen} of {calls} calls: "
            "activity records were lost or activity kinds changed"
        )
    if "concurrent_kernel" not in timings.sentinels_seen:
        missing.append(
            "CUPTI recorded no kernel of the timer's own sentinel after the timed calls: "
            "the kernel activity kind or the activity callbacks were changed"
        )
    return missing


def cupti_reasons(
    timings: WindowTimings, probe_signature: Sequence[tuple[str, str]] | None, probe_kinds: frozenset[str]
) -> list[str]:
    """Findings from the records (they make the verdict suspect; they do not fail the instruction)."""
    reasons: list[str] = []
    if timings.foreign:
        reasons.append(
            f"GPU work ran between the timed calls that none of them launched and that is not the timer's: "
            f"{timings.foreign_summary()}"
        )
    if timings.empty_calls and timings.spans_ms:
        reasons.append(f"{timings.empty_calls} timed call(s) launched no GPU work while the others did")
    if not activities_stable(timings.signatures):
        reasons.append("the timed calls did not all launch the same GPU work")
    if probe_signature is not None and timings.signatures:
        probe = sorted(probe_signature)
        if all(sorted(signature) != probe for signature in timings.signatures):
            reasons.append("no timed call launched the same GPU work as the untimed first traced call")
    if "memcpy" in probe_kinds - timings.sentinels_seen:
        reasons.append("CUPTI stopped recording the timer's own memcpy during the measurement")
    return reasons


class EventTimer:
    """Times each call with a pair of CUDA events on the current stream (where CUPTI never worked,
    or ``method="cuda_event"``)."""

    method = "cuda_event"

    def probe(self, runner: Runner) -> None:
        runner.iteration()

    def fit_hold(self, runner: Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        return hold_us, "on"  # without CUPTI neither lateness nor other streams can be seen

    def measure(self, counted: CountedCalls, nvml: Nvml | None) -> tuple[Measurement, dict[str, Any]]:
        calls = counted.run()
        after = clock_state(nvml)
        reservoir = counted.reservoir
        host_ms = [
            (
                max(0, window.return_ns - window.call_ns)
                + max(0, window.end_ns - max(window.return_ns, window.begin_ns + window.hold_ns))
            )
            / 1e6
            for window in calls.windows
        ]
        measurement = Measurement(
            samples_ms=calls.event_ms,
            stable=True,
            empty_calls=0,
            activities_per_call=None,
            by_estimate={"cuda_event": _median(calls.event_ms)},
            host_ms=host_ms,
            kept=list(reservoir.kept) if reservoir is not None else [],
            first_input_index=calls.first_input_index,
            indices=list(range(len(calls.event_ms))),
        )
        return measurement, after


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def initial_hold_us(launch_ms: Sequence[float]) -> float:
    """A first guess at the hold: a multiple of the call's untraced host launch time, bounded."""
    launch_us = float(statistics.median(launch_ms)) * 1e3 if launch_ms else 0.0
    return min(MAX_HOLD_US, max(MIN_HOLD_US, HOLD_LAUNCH_FACTOR * launch_us + HOLD_MARGIN_US))
