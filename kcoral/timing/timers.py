"""How ``benchmark`` runs and times the counted calls.

``Runner`` runs the user's call with the L2 flush, the launch hold and synchronisation around it;
``timed_calls`` runs a batch of calls, each bracketed by CUDA events and (with a tracer) CUPTI
external ids; ``CuptiTimer`` and ``EventTimer`` turn a batch into latencies, from CUPTI activity
records or from the events alone. The package docstring (``kcoral.timing``) says why each step is
there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.cupti import HOLD_ID_OFFSET, CuptiTracer, hold_ends_by_call, reserve_external_ids, spans_by_call
from kcoral.timing.nvml import Nvml, clock_state
from kcoral.timing.stats import activities_stable

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


class Runner:
    """Runs the user's call with the L2 flush, the launch hold and synchronisation around it."""

    def __init__(self, torch: Any, fn: Callable[..., Any], args: tuple[Any, ...], flush_l2: bool) -> None:
        self.torch = torch
        self._fn = fn
        self._args = args
        self._flush_buffer: Any = None
        # torch's one-thread spin kernel (clock64 loop) on the current stream; private but present
        # since torch 1.x. Without it there is no hold and spans include host launch gaps.
        self._spin: Callable[[int], None] | None = getattr(torch.cuda, "_sleep", None)
        if flush_l2:
            device = torch.cuda.current_device()
            l2_bytes = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
            l2_bytes = l2_bytes if l2_bytes > 0 else FALLBACK_L2_BYTES
            # float32 so the read-reduction runs at full bandwidth; zeroed once so sums stay finite.
            elements = L2_FLUSH_FACTOR * l2_bytes // 4
            self._flush_buffer = torch.zeros(elements, dtype=torch.float32, device=device)

    @property
    def can_hold(self) -> bool:
        return self._spin is not None

    def flush(self) -> None:
        if self._flush_buffer is not None:
            self._flush_buffer.sum()

    def call(self) -> None:
        self._fn(*self._args)

    def hold(self, cycles: int) -> None:
        if self._spin is not None and cycles > 0:
            self._spin(cycles)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def iteration(self) -> float:
        """Flush, call, synchronise; return the host time the call took to launch its work (ms)."""
        self.flush()
        tick = time.perf_counter()
        self.call()
        launched = time.perf_counter()
        self.synchronize()
        return (launched - tick) * 1e3

    def spin_cycles_per_us(self) -> float | None:
        """SM cycles the spin kernel counts per microsecond now (calibrated with CUDA events)."""
        if self._spin is None:
            return None
        torch = self.torch
        # The first launch of the spin kernel loads its module (lazy loading) and takes milliseconds:
        # timed cold, it made the hold ~100 times too short on the H200.
        self._spin(1)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.synchronize()
        start.record()
        self._spin(HOLD_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        elapsed_us = float(start.elapsed_time(end)) * 1e3
        return HOLD_CALIBRATION_CYCLES / elapsed_us if elapsed_us > 0 else None


@dataclass
class Measurement:
    """What a timer made of the counted calls: the samples and what else it could tell."""

    samples_ms: list[float]
    stable: bool
    empty_calls: int
    activities_per_call: int | None
    by_estimate: dict[str, float | None] = field(default_factory=dict)
    late_calls: int | None = None


def timed_calls(
    runner: Runner,
    count: int,
    *,
    hold_cycles: int,
    tracer: CuptiTracer | None = None,
    base: int = 0,
) -> list[float]:
    """Run ``count`` calls, each after a flush, a synchronisation and a hold; return event times (ms).

    The host synchronises after the flush so no work of the call (on any stream) overlaps it. Then
    a one-thread spin kernel holds the current stream while the host records the start event and
    launches the call behind it: when the hold ends, the call's work is already queued, so the
    host's launch overhead stays out of the measurement, as it does for Nsight Compute. Work on
    other streams is not held and may start during the spin, which occupies one SM only.
    """
    torch = runner.torch
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    runner.synchronize()
    if tracer is not None:
        tracer.enable(correlation=True)
    try:
        for index, (start, end) in enumerate(events):
            runner.flush()
            runner.synchronize()
            if tracer is not None and hold_cycles > 0:
                tracer.push(base + HOLD_ID_OFFSET + index)
                try:
                    runner.hold(hold_cycles)
                finally:
                    tracer.pop()
            else:
                runner.hold(hold_cycles)
            start.record()
            if tracer is not None:
                tracer.push(base + index)
            try:
                runner.call()
            finally:
                if tracer is not None:
                    tracer.pop()
            end.record()
            runner.synchronize()
    finally:
        if tracer is not None:
            tracer.disable()
    return [float(start.elapsed_time(end)) for start, end in events]


class CuptiTimer:
    """Times each call from the CUPTI activity records of all it launched, on any stream."""

    method = "cupti"

    def __init__(self, tracer: CuptiTracer) -> None:
        self._tracer = tracer

    def probe(self, runner: Runner) -> None:
        """Run one traced call; a call that launches no GPU work cannot be timed."""
        base = reserve_external_ids()
        timed_calls(runner, 1, hold_cycles=0, tracer=self._tracer, base=base)
        records = self._tracer.drain()
        if spans_by_call(records.activities, records.external, [base]).empty_calls:
            raise ExecutionError(
                "unavailable",
                "the benchmarked call launched no GPU work (no kernel, memcpy or memset was recorded); "
                "there is nothing to time",
            )

    def fit_hold(self, runner: Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        """Lengthen the hold until traced calls finish launching before it ends (bounded).

        Returns the hold (0 for none) and why. A call with work on another stream gets no hold:
        that work starts at once, beside the spin kernel, and a kernel that wants every SM (a
        persistent GEMM) then waits for the spin's SM; measured on the H200, a side-stream 4096^3
        matmul read 211 us with the hold and 184-188 us without.
        """
        for _ in range(HOLD_FIT_ROUNDS):
            base = reserve_external_ids()
            timed_calls(
                runner, HOLD_FIT_CALLS, hold_cycles=int(hold_us * cycles_per_us), tracer=self._tracer, base=base
            )
            records = self._tracer.drain()
            holds = hold_ends_by_call(records.activities, records.external)
            timings = spans_by_call(
                records.activities,
                records.external,
                [base + index for index in range(HOLD_FIT_CALLS)],
                hold_ends=holds,
                api_ends=records.api_ends,
            )
            if timings.unheld_calls:
                return 0.0, "off: the call runs work on another stream, which a hold cannot hold"
            if timings.late_calls == 0:
                return hold_us, "on"
            if hold_us >= MAX_HOLD_US:
                return hold_us, "on, but the host launches more slowly than the longest hold"
            hold_us = min(MAX_HOLD_US, hold_us * 2)
        return hold_us, "on, but the host still launched late after the last lengthening"

    def measure(
        self, runner: Runner, repeat: int, hold_cycles: int, nvml: Nvml | None
    ) -> tuple[Measurement, dict[str, Any]]:
        base = reserve_external_ids()
        call_ids = [base + index for index in range(repeat)]
        event_ms = timed_calls(runner, repeat, hold_cycles=hold_cycles, tracer=self._tracer, base=base)
        after = clock_state(nvml)
        records = self._tracer.drain()
        holds = hold_ends_by_call(records.activities, records.external) if hold_cycles > 0 else {}
        timings = spans_by_call(
            records.activities, records.external, call_ids, hold_ends=holds, api_ends=records.api_ends
        )
        if not timings.spans_ms:
            raise ExecutionError("unavailable", "the benchmarked call launched no GPU work during the counted calls")
        counts = {len(signature) for signature in timings.signatures}
        events = [event_ms[index] for index in timings.indices]
        by_estimate: dict[str, float | None] = {
            "span": _median(timings.spans_ms),
            "ready_span": _median(timings.ready_spans_ms),
            "busy": _median(timings.busy_ms),
            "cuda_event": _median(events),
        }
        return (
            Measurement(
                samples_ms=timings.spans_ms,
                stable=timings.empty_calls == 0 and activities_stable(timings.signatures),
                empty_calls=timings.empty_calls,
                activities_per_call=counts.pop() if len(counts) == 1 else None,
                by_estimate=by_estimate,
                late_calls=timings.late_calls if hold_cycles > 0 else None,
            ),
            after,
        )


class EventTimer:
    """Times each call with a pair of CUDA events on the current stream (the fallback without CUPTI)."""

    method = "cuda_event"

    def probe(self, runner: Runner) -> None:
        runner.iteration()

    def fit_hold(self, runner: Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        return hold_us, "on"  # without CUPTI neither lateness nor other streams can be seen

    def measure(
        self, runner: Runner, repeat: int, hold_cycles: int, nvml: Nvml | None
    ) -> tuple[Measurement, dict[str, Any]]:
        samples = timed_calls(runner, repeat, hold_cycles=hold_cycles)
        after = clock_state(nvml)
        measurement = Measurement(
            samples_ms=samples,
            stable=True,
            empty_calls=0,
            activities_per_call=None,
            by_estimate={"cuda_event": _median(samples)},
        )
        return measurement, after


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def initial_hold_us(launch_ms: Sequence[float]) -> float:
    """A first guess at the hold: a multiple of the call's untraced host launch time, bounded."""
    launch_us = float(statistics.median(launch_ms)) * 1e3 if launch_ms else 0.0
    return min(MAX_HOLD_US, max(MIN_HOLD_US, HOLD_LAUNCH_FACTOR * launch_us + HOLD_MARGIN_US))
