"""How ``benchmark`` runs the counted calls: the runner and the timed loop.

``Runner`` runs the user's call with its inputs, the L2 flush, the launch hold and synchronisation
around it, through references captured at arm (``kcoral.timing.trust``); ``CountedCalls`` is a
batch a timer times, and ``timed_calls`` runs a batch of calls, each between two device-wide
synchronisations that it stamps on CUPTI's clock (the call's *window*), with the timer's own work
marked by external ids. The timers that turn a batch into latencies are in ``kcoral.timing.timers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.timing.cupti import GAP_ID_OFFSET, HOLD_ID_OFFSET, SENTINEL_ID_OFFSET, CuptiTracer
from kcoral.timing.inputs import InputPlan, KeptOutput, OutputCheck, OutputReservoir, check_outputs, snapshot
from kcoral.timing.trust import Trusted
from kcoral.timing.windows import CallWindow

# Flush buffer size as a multiple of the L2 size; used when torch does not report the L2 size.
L2_FLUSH_FACTOR: Final = 2
FALLBACK_L2_BYTES: Final = 64 * 1024 * 1024
HOLD_CALIBRATION_CYCLES: Final = 100_000


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

    def wall_offset_ns(self) -> int:
        """The host's wall clock less its monotonic one (``clock_ns``), read between two readings of
        the latter, the tightest of three tries (a reading pre-empted between them is not taken):
        it moves only where the wall clock is stepped (NTP slews both alike)."""
        best: tuple[int, int] | None = None
        for _ in range(3):
            before = self.clock_ns()
            wall = self.trusted.wall_ns()
            after = self.clock_ns()
            if best is None or after - before < best[0]:
                best = (after - before, wall - (before + after) // 2)
        assert best is not None
        return best[1]

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


def check_kept(
    torch: Any, trusted: Trusted, runner: Runner, kept: Sequence[KeptOutput], check: OutputCheck | None
) -> int:
    """Check the kept outputs of ``runner``'s timed calls (``check_outputs``): by ``check`` where
    given, otherwise each against the candidate's own output for the same inputs; the number checked."""

    def again(kept: KeptOutput) -> Any:
        # The candidate's own output for the same inputs, untimed: what a timed call must return.
        output = runner.call(kept.inputs)
        runner.synchronize()
        with trusted.plain_torch():
            return snapshot(torch, output)

    return check_outputs(
        torch,
        kept,
        check=check,
        expected=again if check is None else None,
        assert_close=torch.testing.assert_close,
    )


@dataclass
class TimedCalls:
    """What ``timed_calls`` saw: event times, each call's window, and the correlation stack's state."""

    event_ms: list[float]
    windows: list[CallWindow]
    stack_changes: list[str] = field(default_factory=list)
    trailing_end_ns: int | None = None
    first_input_index: int = 0
    # The largest step of the host's wall clock seen while the calls ran, read against the monotonic
    # clock before them and after each window (Runner.wall_offset_ns; 0 where CUPTI's clock was not
    # read): CUPTI's timestamps follow that clock. After each window, not only at the end, so that
    # a step and its reverse inside one measurement are seen too.
    wall_step_ns: int = 0


@dataclass(frozen=True)
class CountedCalls:
    """The counted calls a timer times (``measure`` of ``kcoral.timing.timers``' timers): ``repeat``
    calls of ``runner``, each behind a hold of ``hold_cycles`` (``hold_ns`` long). ``busy``: report
    each call's busy time (the union of its activities) rather than its span, for calls whose work
    no hold could hold (``timers.UNHELD_MEASURE``); ``reservoir``, ``after_call``: as in
    :func:`timed_calls`."""

    runner: Runner
    repeat: int
    hold_cycles: int
    hold_ns: int = 0
    busy: bool = False
    reservoir: OutputReservoir | None = None
    after_call: Callable[[], None] | None = None

    def run(self, tracer: CuptiTracer | None = None, base: int = 0) -> TimedCalls:
        return timed_calls(
            self.runner,
            self.repeat,
            hold_cycles=self.hold_cycles,
            tracer=tracer,
            base=base,
            hold_ns=self.hold_ns,
            reservoir=self.reservoir,
            after_call=self.after_call,
        )


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
    after_call: Callable[[], None] | None = None,
) -> TimedCalls:
    """Run ``count`` calls, each in its own window between two device-wide synchronisations.

    Per call: the next inputs and the L2 flush (the timer's gap work), a synchronisation and the
    window's start on CUPTI's clock; a one-thread spin kernel that holds the current stream while
    the host records the start event and launches the call behind it; the call; the end event; a
    synchronisation and the window's end. The previous call's output and inputs are let go inside
    the next window, so whatever their release sets off is counted. A sample of outputs is
    snapshotted after the window (``reservoir``). ``after_call``, when given, runs after each
    window, before anything else of the gap (``compare`` reads the SM clock there: host work
    only, it launches nothing).
    """
    event = runner.trusted.event
    clock = tracer.timestamp if tracer is not None else runner.clock_ns
    # CUPTI's clock is checked against the host's over the windows (windows.clock_disagreement): the
    # runner's clock, time.perf_counter as captured at arm, which no program can replace.
    host_clock = runner.clock_ns if tracer is not None else None
    brackets = _Brackets(tracer)
    events = [(event(enable_timing=True), event(enable_timing=True)) for _ in range(count)] if event else []
    windows: list[CallWindow] = []
    previous: tuple[Any, Any] | None = None
    first_index = runner.next_index
    runner.synchronize()
    wall_before = runner.wall_offset_ns() if host_clock else 0
    wall_offsets: list[int] = []  # after each window, then after the calls
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
            before_begin = host_clock() if host_clock else 0
            begin_ns = clock()
            after_begin = host_clock() if host_clock else 0
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
            before_end = host_clock() if host_clock else 0
            end_ns = clock()
            host_ns = (before_begin, after_begin, before_end, host_clock()) if host_clock else None
            windows.append(CallWindow(index, begin_ns, call_ns, return_ns, end_ns, hold_ns, host_ns))
            if host_clock:  # in the gap, off the window: 1.7 us of host time a call on the 2-core VM
                wall_offsets.append(runner.wall_offset_ns())
            if after_call is not None:
                after_call()
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
        if host_clock:
            wall_offsets.append(runner.wall_offset_ns())
    finally:
        if tracer is not None:
            tracer.disable()
    del previous
    event_ms = [float(start.elapsed_time(end)) for start, end in events] if events else []
    wall_step_ns = max((offset - wall_before for offset in wall_offsets), key=abs, default=0)
    return TimedCalls(event_ms, windows, brackets.changes, trailing_end_ns, first_index, wall_step_ns)
