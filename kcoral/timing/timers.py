"""How ``benchmark`` runs and times the counted calls.

``Runner`` runs the user's call with its inputs, the L2 flush, the launch hold and synchronisation
around it, through references captured at arm (``kcoral.timing.trust``); ``timed_calls`` runs a
batch of calls, each between two device-wide synchronisations that it stamps on CUPTI's clock (the
call's *window*), with the timer's own work marked by external ids; ``CuptiTimer`` and
``EventTimer`` turn a batch into latencies, from CUPTI activity records attributed by window
(``kcoral.timing.windows``) or from CUDA events alone. The package docstring (``kcoral.timing``)
says why each step is there.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.cupti import (
    GAP_ID_OFFSET,
    HOLD_ID_OFFSET,
    SENTINEL_ID_OFFSET,
    CuptiTracer,
    reserve_external_ids,
)
from kcoral.timing.inputs import InputPlan, KeptOutput, OutputReservoir, snapshot
from kcoral.timing.nvml import Nvml, clock_state
from kcoral.timing.stats import activities_stable
from kcoral.timing.trust import Trusted
from kcoral.timing.windows import CallWindow, WindowTimings, attribute

# Flush buffer size as a multiple of the L2 size; used when torch does not report the L2 size.
L2_FLUSH_FACTOR: Final = 2
FALLBACK_L2_BYTES: Final = 64 * 1024 * 1024
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
HOLD_CALIBRATION_CYCLES: Final = 100_000
# Calls with work on another stream get no hold, so their span includes the host's launch gaps (a
# side-stream cuBLAS matmul launches a memset, then the GEMM some microseconds later): their latency
# is the time any of their activities ran. Measured on the H200: span 180-187 us over ten programs,
# busy 174.9 us, Nsight Compute 175.7 us. Every activity is still counted, so this hides no work.
UNHELD_MEASURE: Final = "busy"
UNHELD_STATE: Final = "off: the call runs work on another stream"
# Records of the timer's own flush that may go missing before that counts as tampering (CUPTI may
# drop a record under pressure; a candidate that turns kinds off loses every later one).
OWN_RECORDS_SLACK: Final = 0.01


class Runner:
    """Runs the user's call with its inputs, the L2 flush, the launch hold and synchronisation."""

    def __init__(self, trusted: Trusted, fn: Callable[..., Any], plan: InputPlan, flush_l2: bool) -> None:
        torch = trusted.torch
        self.torch = torch
        self.trusted = trusted
        self.plan = plan
        self._fn = fn
        self._sync = trusted.synchronize
        self._perf_counter = trusted.perf_counter
        self.next_index = 0
        self._flush_buffer: Any = None
        self.flush_shape: tuple[int, int] | None = None
        # torch's one-thread spin kernel (clock64 loop) on the current stream; private but present
        # since torch 1.x. Without it there is no hold and spans include host launch gaps.
        self._spin: Callable[[int], None] | None = trusted.spin
        device = torch.cuda.current_device()
        if flush_l2:
            l2_bytes = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
            l2_bytes = l2_bytes if l2_bytes > 0 else FALLBACK_L2_BYTES
            # float32 so the read-reduction runs at full bandwidth; zeroed once so sums stay finite.
            elements = L2_FLUSH_FACTOR * l2_bytes // 4
            self._flush_buffer = torch.zeros(elements, dtype=torch.float32, device=device)
            self.flush_shape = self.flush_state()
        # The sentinel: a one-element kernel and a small device-to-device copy of the timer's own,
        # whose records prove the activity kinds are still on.
        self._mark = torch.zeros(64, dtype=torch.float32, device=device)
        self._mark_copy = torch.zeros(64, dtype=torch.float32, device=device)

    @property
    def can_hold(self) -> bool:
        return self._spin is not None

    def flush_state(self) -> tuple[int, int] | None:
        """(elements, address) of the flush buffer: a candidate that shrinks it skips the flush."""
        buffer = self._flush_buffer
        if buffer is None:
            return None
        return int(buffer.untyped_storage().nbytes()), int(buffer.data_ptr())

    def flush(self) -> None:
        if self._flush_buffer is not None:
            with self.trusted.plain_torch():
                self._flush_buffer.sum()

    def next_inputs(self) -> tuple[int, tuple[Any, ...]]:
        index = self.next_index
        self.next_index += 1
        return index, self.plan.inputs(index)

    def call(self, inputs: tuple[Any, ...]) -> Any:
        return self._fn(*inputs)

    def hold(self, cycles: int) -> None:
        if self._spin is not None and cycles > 0:
            self._spin(cycles)

    def synchronize(self) -> None:
        if self._sync is not None:
            self._sync()

    def sentinel(self) -> None:
        with self.trusted.plain_torch():
            self._mark.add_(1.0)
            self._mark_copy.copy_(self._mark)

    def clock_ns(self) -> int:
        return int(self._perf_counter() * 1e9)

    def iteration(self) -> float:
        """Inputs, flush, call, synchronise; return the host time the call took to launch its work (ms)."""
        _, inputs = self.next_inputs()
        self.flush()
        tick = self._perf_counter()
        self.call(inputs)
        launched = self._perf_counter()
        self.synchronize()
        return (launched - tick) * 1e3

    def spin_cycles_per_us(self) -> float | None:
        """SM cycles the spin kernel counts per microsecond now (calibrated with CUDA events)."""
        if self._spin is None or self.trusted.event is None:
            return None
        # The first launch of the spin kernel loads its module (lazy loading) and takes milliseconds:
        # timed cold, it made the hold ~100 times too short on the H200.
        self._spin(1)
        start = self.trusted.event(enable_timing=True)
        end = self.trusted.event(enable_timing=True)
        self.synchronize()
        start.record()
        self._spin(HOLD_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        elapsed_us = float(start.elapsed_time(end)) * 1e3
        return HOLD_CALIBRATION_CYCLES / elapsed_us if elapsed_us > 0 else None


@dataclass
class TimedCalls:
    """What ``timed_calls`` saw: event times, each call's window, and the correlation stack's state."""

    event_ms: list[float]
    windows: list[CallWindow]
    stack_changes: list[str] = field(default_factory=list)
    trailing_end_ns: int | None = None
    first_input_index: int = 0


class _Brackets:
    """Pushes and pops the timer's external ids, and notes any pop that does not give back its push."""

    def __init__(self, tracer: CuptiTracer | None) -> None:
        self._tracer = tracer
        self.changes: list[str] = []

    def push(self, external_id: int) -> None:
        if self._tracer is not None:
            self._tracer.push(external_id)

    def pop(self, external_id: int, where: str) -> None:
        if self._tracer is None:
            return
        try:
            popped = self._tracer.pop()
        except Exception as exc:
            self.changes.append(
                f"popping the timer's external id after {where} failed ({exc}): it was popped by someone else"
            )
            return
        if popped is not None and popped != external_id:
            self.changes.append(
                f"the external correlation stack changed during {where}: "
                f"popped {popped}, the timer pushed {external_id}"
            )


def timed_calls(
    runner: Runner,
    count: int,
    *,
    hold_cycles: int,
    tracer: CuptiTracer | None = None,
    base: int = 0,
    hold_ns: int = 0,
    reservoir: OutputReservoir | None = None,
) -> TimedCalls:
    """Run ``count`` calls, each in its own window between two device-wide synchronisations.

    Per call: the next inputs and the L2 flush (the timer's gap work), a synchronisation and the
    window's start on CUPTI's clock; a one-thread spin kernel that holds the current stream while
    the host records the start event and launches the call behind it; the call; the end event; a
    synchronisation and the window's end. The previous call's output and inputs are let go inside
    the next window, so whatever their release sets off is counted. A sample of outputs is
    snapshotted after the window (``reservoir``).
    """
    event = runner.trusted.event
    clock = tracer.timestamp if tracer is not None else runner.clock_ns
    brackets = _Brackets(tracer)
    events = [(event(enable_timing=True), event(enable_timing=True)) for _ in range(count)] if event else []
    windows: list[CallWindow] = []
    previous: tuple[Any, Any] | None = None
    first_index = runner.next_index
    runner.synchronize()
    if tracer is not None:
        tracer.enable(correlation=True)
    try:
        for index in range(count):
            brackets.push(base + GAP_ID_OFFSET + index)
            try:
                input_index, inputs = runner.next_inputs()
                runner.flush()
            finally:
                brackets.pop(base + GAP_ID_OFFSET + index, f"the timer's flush before call {index}")
            runner.synchronize()
            begin_ns = clock()
            if hold_cycles > 0:
                brackets.push(base + HOLD_ID_OFFSET + index)
                try:
                    runner.hold(hold_cycles)
                finally:
                    brackets.pop(base + HOLD_ID_OFFSET + index, f"the hold before call {index}")
            if events:
                events[index][0].record()
            call_ns = clock()
            brackets.push(base + index)
            try:
                previous = None  # released inside this call's window
                output = runner.call(inputs)
            finally:
                brackets.pop(base + index, f"timed call {index}")
            return_ns = clock()
            if events:
                events[index][1].record()
            runner.synchronize()
            end_ns = clock()
            windows.append(CallWindow(index, begin_ns, call_ns, return_ns, end_ns, hold_ns))
            if reservoir is not None:
                slot = reservoir.slot_for_next()
                if slot is not None:
                    kept_at = runner.trusted.perf_counter()
                    brackets.push(base + GAP_ID_OFFSET + index)
                    try:
                        with runner.trusted.plain_torch():
                            kept = KeptOutput(index, input_index, snapshot(runner.torch, output), inputs)
                    finally:
                        brackets.pop(base + GAP_ID_OFFSET + index, f"the snapshot of call {index}'s output")
                    reservoir.put(slot, kept)
                    reservoir.snapshot_ms += (runner.trusted.perf_counter() - kept_at) * 1e3
            previous = (output, inputs)
            del output, inputs
        brackets.push(base + SENTINEL_ID_OFFSET)
        try:
            runner.sentinel()
        finally:
            brackets.pop(base + SENTINEL_ID_OFFSET, "the timer's sentinel")
        previous = None
        runner.synchronize()
        trailing_end_ns = clock()
    finally:
        if tracer is not None:
            tracer.disable()
    del previous
    event_ms = [float(start.elapsed_time(end)) for start, end in events] if events else []
    return TimedCalls(event_ms, windows, brackets.changes, trailing_end_ns, first_index)


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


def _timings(tracer: CuptiTracer, calls: TimedCalls, base: int) -> tuple[WindowTimings, list[str]]:
    records = tracer.drain()
    timings = attribute(
        records.activities,
        records.external,
        calls.windows,
        base,
        caller_thread=threading.get_native_id(),
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

    def measure(
        self,
        runner: Runner,
        repeat: int,
        hold_cycles: int,
        nvml: Nvml | None,
        *,
        hold_ns: int = 0,
        reservoir: OutputReservoir | None = None,
        busy: bool = False,
    ) -> tuple[Measurement, dict[str, Any]]:
        """Time ``repeat`` calls. ``busy``: report each call's busy time (the union of its activities)
        rather than its span, for calls whose work no hold could hold (see ``UNHELD_MEASURE``)."""
        base = reserve_external_ids()
        calls = timed_calls(
            runner,
            repeat,
            hold_cycles=hold_cycles,
            tracer=self._tracer,
            base=base,
            hold_ns=hold_ns,
            reservoir=reservoir,
        )
        after = clock_state(nvml)
        timings, record_errors = _timings(self._tracer, calls, base)
        tampering = list(calls.stack_changes)
        tampering.extend(f"CUPTI record processing failed: {error}" for error in record_errors[:3])
        if timings.forged_activities:
            tampering.append(
                f"{timings.forged_activities} GPU activities carried the timer's own external ids without being "
                "its work (the ids were read from the timer and reused to hide work)"
            )
        tampering.extend(own_records_missing(timings, repeat, hold_cycles > 0, runner.flush_shape is not None))
        for kind in sorted(self.probe_kinds - timings.sentinels_seen):
            tampering.append(
                f"CUPTI recorded the timer's own {kind} before the timed calls but not after them: "
                "its activity kinds or callbacks were changed"
            )
        reasons = cupti_reasons(timings, self.probe_signature, self.probe_kinds)
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
        }
        return (
            Measurement(
                samples_ms=timings.busy_ms if busy else timings.spans_ms,
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
            ),
            after,
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

    def measure(
        self,
        runner: Runner,
        repeat: int,
        hold_cycles: int,
        nvml: Nvml | None,
        *,
        hold_ns: int = 0,
        reservoir: OutputReservoir | None = None,
        busy: bool = False,
    ) -> tuple[Measurement, dict[str, Any]]:
        calls = timed_calls(runner, repeat, hold_cycles=hold_cycles, hold_ns=hold_ns, reservoir=reservoir)
        after = clock_state(nvml)
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
        )
        return measurement, after


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def initial_hold_us(launch_ms: Sequence[float]) -> float:
    """A first guess at the hold: a multiple of the call's untraced host launch time, bounded."""
    launch_us = float(statistics.median(launch_ms)) * 1e3 if launch_ms else 0.0
    return min(MAX_HOLD_US, max(MIN_HOLD_US, HOLD_LAUNCH_FACTOR * launch_us + HOLD_MARGIN_US))
