"""CPU tests of the benchmark's defences: attribution by time window (synthetic CUPTI records), the
trusted-state snapshot, the timed loop's brackets, inputs and output checks, and the findings."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kcoral.errors import ExecutionError
from kcoral.timing import findings, inputs, timers, trust
from kcoral.timing.calls import timed_calls
from kcoral.timing.cupti import GAP_ID_OFFSET, HOLD_ID_OFFSET, SENTINEL_ID_OFFSET, Activity, reserve_external_ids
from kcoral.timing.findings import EnvironmentWatch, host_gap_reason, verdict
from kcoral.timing.inputs import (
    MODE_FACTORY,
    MODE_NONE,
    MODE_SAME,
    KeptOutput,
    OutputReservoir,
    check_outputs,
    plan_inputs,
)
from kcoral.timing.neighbours import MOST_PIDS, KnownPids
from kcoral.timing.timers import clock_tampering, cupti_reasons, own_records_missing
from kcoral.timing.windows import CallWindow, WindowTimings, attribute, clock_disagreement, role_of

torch = pytest.importorskip("torch")

BASE = 7 << 20
CALLER = 111
HELPER = 222


def kernel(correlation: int, start: int, end: int, name: str = "k") -> Activity:
    return Activity("concurrent_kernel", correlation, start, end, name)


def two_windows() -> list[CallWindow]:
    # Call 0: device idle at 1_000, called at 1_100, returned 1_200, idle again at 5_000.
    # Call 1: 10_000 .. 15_000. Between them (5_000 .. 10_000) the timer flushes the L2.
    return [CallWindow(0, 1_000, 1_100, 1_200, 5_000), CallWindow(1, 10_000, 10_100, 10_200, 15_000)]


# ----------------------------------------------------------------------------- windows


def test_role_of_reads_the_timers_ids_and_nothing_else() -> None:
    assert role_of(BASE + 3, BASE) == ("call", 3)
    assert role_of(BASE + HOLD_ID_OFFSET + 3, BASE) == ("hold", 3)
    assert role_of(BASE + GAP_ID_OFFSET + 2, BASE) == ("gap", 2)
    assert role_of(BASE + SENTINEL_ID_OFFSET, BASE) == ("sentinel", 0)
    assert role_of(None, BASE) is None
    assert role_of(BASE - 1, BASE) is None
    assert role_of(BASE + (1 << 20), BASE) is None  # the next block: another measurement's


def test_work_of_a_helper_thread_inside_the_window_is_counted() -> None:
    """The attack that read 0.0012 ms for a 0.18 ms GEMM: the GEMM carries no external id at all."""
    activities = [
        kernel(1, 1_300, 1_310, "touch"),  # the calling thread's one-element add
        kernel(2, 1_320, 4_800, "gemm"),  # launched by a helper thread: no external id
    ]
    timings = attribute(
        activities,
        {1: BASE},
        two_windows()[:1],
        BASE,
        caller_thread=CALLER,
        api_threads={1: CALLER, 2: HELPER},
    )
    assert timings.spans_ms == [pytest.approx((4_800 - 1_300) / 1e6)]
    assert timings.other_thread_activities == 1
    assert sorted(timings.signatures[0]) == [("concurrent_kernel", "gemm"), ("concurrent_kernel", "touch")]
    assert timings.foreign == []


def test_work_still_running_when_the_call_returned_belongs_to_the_call() -> None:
    # Returned at 1_200; the kernel it launched runs until 4_900, before the device went idle.
    timings = attribute([kernel(1, 1_150, 4_900)], {1: BASE}, two_windows()[:1], BASE)
    assert timings.spans_ms == [pytest.approx(0.00375)]


def test_the_hold_and_the_timers_gap_work_are_not_counted_or_foreign() -> None:
    activities = [
        kernel(1, 1_010, 1_900, "spin"),  # the hold
        kernel(2, 2_000, 3_000, "user"),
        kernel(3, 6_000, 8_000, "flush"),  # the L2 flush before call 1
        kernel(4, 10_500, 11_000, "user"),
        kernel(5, 15_100, 15_200, "mark"),  # the sentinel after the calls
    ]
    external = {
        1: BASE + HOLD_ID_OFFSET,
        2: BASE,
        3: BASE + GAP_ID_OFFSET + 1,
        4: BASE + 1,
        5: BASE + SENTINEL_ID_OFFSET,
    }
    timings = attribute(activities, external, two_windows(), BASE, until_ns=16_000)
    assert timings.spans_ms == [pytest.approx(0.001), pytest.approx(0.0005)]
    assert timings.ready_spans_ms[0] == pytest.approx((3_000 - 1_900) / 1e6)
    assert timings.foreign == []
    assert (timings.holds_seen, timings.gaps_seen) == (1, 1)
    assert timings.sentinels_seen == frozenset({"concurrent_kernel"})
    # Host time: the call itself (1_100 .. 1_200), then from the end of the hold (1_900) to idle (5_000).
    assert timings.host_ms[0] == pytest.approx(0.0032)


def test_work_between_the_calls_that_is_not_the_timers_is_foreign() -> None:
    """A helper that launches after the call returned and the device went idle, before the next."""
    activities = [
        kernel(1, 2_000, 2_100, "touch"),
        kernel(2, 6_000, 9_500, "gemm"),  # no id, between windows
        kernel(3, 10_500, 10_600, "touch"),
        kernel(4, 15_500, 15_700, "late"),  # after the last window, before the trailing end
        kernel(5, 99_000, 99_500, "later"),  # after the measurement ended: not looked at
        kernel(6, 10, 20, "before"),  # warm-up: not looked at
    ]
    timings = attribute(activities, {1: BASE, 3: BASE + 1}, two_windows(), BASE, until_ns=16_000)
    assert [name for _, _, name in timings.foreign] == ["gemm", "late"]
    assert timings.foreign_ms == pytest.approx((3_500 + 200) / 1e6)
    assert "gemm" in timings.foreign_summary()
    reasons = cupti_reasons(timings, None, frozenset())
    assert any("between the timed calls" in reason for reason in reasons)


def test_work_hidden_under_the_timers_own_ids_is_counted_and_named_forged() -> None:
    """A candidate that reads the id block from the timer's frames and launches under its ids."""
    activities = [
        kernel(1, 1_010, 1_900, "spin"),  # the genuine hold, launched at 1_050 (before the call)
        kernel(2, 2_000, 4_500, "gemm"),  # launched inside the call under the hold's id
        kernel(3, 4_600, 4_700, "gemm2"),  # launched inside the call under a gap id
    ]
    external = {1: BASE + HOLD_ID_OFFSET, 2: BASE + HOLD_ID_OFFSET, 3: BASE + GAP_ID_OFFSET + 1}
    api_ends = {1: 1_050, 2: 1_500, 3: 1_600}
    timings = attribute(activities, external, two_windows()[:1], BASE, api_ends=api_ends)
    assert timings.forged_activities == 2
    assert timings.spans_ms == [pytest.approx((4_700 - 2_000) / 1e6)]
    assert timings.holds_seen == 1
    # Where they began against their window (two_windows' first begins at 1_000 ns), for the report.
    assert (
        timings.forged_summary()
        == "ids of gap 1, hold 1; gemm, gemm2; starting 1.0 to 3.6 us (median 3.6) after their window began"
    )


def test_the_timers_own_flush_read_at_a_shifted_clock_is_told_apart_in_the_message() -> None:
    """On the H200 an honest side-stream matmul once failed with 710 activities under the timer's
    gap ids: whether they were the flush read at a shifted clock (all at one offset, inside the
    windows) the message now says."""
    windows = two_windows()
    activities = [
        kernel(index + 1, window.begin_ns + 200, window.begin_ns + 300, "flush") for index, window in enumerate(windows)
    ]
    external = {index + 1: BASE + GAP_ID_OFFSET + index for index in range(len(windows))}
    timings = attribute(activities, external, windows, BASE)
    assert timings.forged_activities == len(windows)
    assert (
        timings.forged_summary()
        == f"ids of gap {len(windows)}; flush; starting 0.2 to 0.2 us (median 0.2) after their window began"
    )


def shifted_trace(offset_ns: int) -> tuple[list[Activity], dict[int, int], dict[int, int], dict[int, int]]:
    """Two calls with the timer's flush between them and its sentinel after, recorded on a device
    clock ``offset_ns`` ahead of the host's; the activities, external ids, API ends and threads."""
    true_times = {
        1: (2_000, 3_000, "user"),  # call 0, launched at 1_150
        2: (6_000, 8_000, "flush"),  # the flush before call 1, launched at 5_500
        3: (10_500, 11_000, "user"),  # call 1, launched at 10_150
        4: (15_100, 15_200, "mark"),  # the sentinel, launched at 15_050
    }
    activities = [kernel(c, start + offset_ns, end + offset_ns, name) for c, (start, end, name) in true_times.items()]
    external = {1: BASE, 2: BASE + GAP_ID_OFFSET + 1, 3: BASE + 1, 4: BASE + SENTINEL_ID_OFFSET}
    api_ends = {1: 1_150, 2: 5_500, 3: 10_150, 4: 15_050}
    return activities, external, api_ends, dict.fromkeys(true_times, CALLER)


def attribute_with_launches(
    activities: list[Activity], external: dict[int, int], api_ends: dict[int, int], threads: dict[int, int]
) -> WindowTimings:
    """two_windows' attribution with the launch calls' records, the calling thread's among them."""
    return attribute(
        activities,
        external,
        two_windows(),
        BASE,
        caller_thread=CALLER,
        api_threads=threads,
        api_ends=api_ends,
        until_ns=16_000,
    )


@pytest.mark.parametrize("offset_ns", [4_500, -3_000, 0])
def test_records_on_a_device_clock_off_the_hosts_are_moved_back_and_read_as_on_time(offset_ns: int) -> None:
    """An honest matmul failed `integrity` on an H100 with every flush of the timer read hundreds of
    microseconds inside the windows: the device's records disagreed with the host's clock. The
    timer's own gap work, launched between two windows, bounds the disagreement, and the records are
    moved back by the least of it, so that the flush and the sentinel lie between the windows again."""
    activities, external, api_ends, threads = shifted_trace(offset_ns)
    unaligned = attribute(activities, external, two_windows(), BASE, until_ns=16_000)
    timings = attribute_with_launches(activities, external, api_ends, threads)
    assert timings.forged_activities == 0 and timings.foreign == []
    assert timings.spans_ms == [pytest.approx(0.001), pytest.approx(0.0005)]
    assert (timings.gaps_seen, timings.sentinels_seen) == (1, frozenset({"concurrent_kernel"}))
    if offset_ns:
        assert unaligned.forged_activities >= 1  # read on the device's clock as it came
        assert 0 < timings.clock_offset_ns * offset_ns  # moved the way the device's clock was off
        assert abs(timings.clock_offset_ns) <= abs(offset_ns)  # and never further than it was off
    else:
        assert timings.clock_offset_ns == 0 and unaligned == timings


def test_work_hidden_under_the_timers_ids_is_still_forged_on_a_clock_that_is_off() -> None:
    """The alignment reads only the caller's launches between the windows: a candidate that launches
    under a gap id inside its call, or from another thread between the calls, moves nothing and is
    still told apart."""
    activities, external, api_ends, threads = shifted_trace(4_500)
    activities += [
        kernel(5, 3_200 + 4_500, 4_800 + 4_500, "hidden"),  # inside call 0, under the flush's id
        kernel(6, 5_100 + 4_500, 5_200 + 4_500, "helper"),  # another thread, between the calls, under it too
    ]
    external.update({5: BASE + GAP_ID_OFFSET + 1, 6: BASE + GAP_ID_OFFSET + 1})
    api_ends.update({5: 1_180, 6: 5_050})
    threads.update({5: CALLER, 6: HELPER})
    timings = attribute_with_launches(activities, external, api_ends, threads)
    assert timings.forged_activities == 1
    assert [name for _, name, _ in timings.forged] == ["hidden"]
    assert timings.spans_ms[0] == pytest.approx((4_800 - 2_000) / 1e6)  # counted in call 0


def test_a_clock_that_drifts_is_moved_back_by_the_offset_of_each_time() -> None:
    """Where no one offset agrees with every gap (a clock that drifts faster than the gaps leave
    room for), each stretch of the measurement is moved back by the offset of the gap it begins
    with."""
    windows = [
        CallWindow(
            index, 10_000 * index + 1_000, 10_000 * index + 1_100, 10_000 * index + 1_200, 10_000 * index + 5_000
        )
        for index in range(3)
    ]

    def drift(time_ns: int) -> int:
        return 3_000 + time_ns // 2

    true_times: dict[int, tuple[int, int, str, int, int]] = {}  # correlation: start, end, name, id, API end
    for index, window in enumerate(windows):
        true_times[10 + index] = (
            window.begin_ns + 500,
            window.begin_ns + 1_500,
            "user",
            BASE + index,
            window.call_ns + 50,
        )
        if index:
            true_times[20 + index] = (
                window.begin_ns - 3_000,
                window.begin_ns - 1_000,
                "flush",
                BASE + GAP_ID_OFFSET + index,
                window.begin_ns - 4_000,
            )
    activities = [kernel(c, s + drift(s), e + drift(s), name) for c, (s, e, name, _, _) in true_times.items()]
    external = {c: entry[3] for c, entry in true_times.items()}
    assert attribute(activities, external, windows, BASE).forged_activities == 1  # as the records came
    timings = attribute(
        activities,
        external,
        windows,
        BASE,
        caller_thread=CALLER,
        api_threads=dict.fromkeys(true_times, CALLER),
        api_ends={c: entry[4] for c, entry in true_times.items()},
    )
    assert timings.clock_offset_ns == 11_001  # the later gap's; the earlier one's was 6_001
    assert timings.forged_activities == 0
    assert timings.spans_ms == [pytest.approx(0.001)] * 3
    assert timings.indices == [0, 1, 2]


def test_a_call_that_launched_nothing_is_empty_and_still_has_a_host_time() -> None:
    timings = attribute([kernel(1, 2_000, 2_100)], {1: BASE}, two_windows(), BASE)
    assert timings.empty_calls == 1
    assert timings.indices == [0]
    assert len(timings.host_ms) == 2
    assert any("launched no GPU work" in reason for reason in cupti_reasons(timings, None, frozenset()))


def test_host_time_without_a_hold_record_starts_at_the_estimated_end_of_the_hold() -> None:
    window = CallWindow(0, 1_000, 1_100, 1_200, 9_000, hold_ns=3_000)
    timings = attribute([kernel(1, 4_100, 8_900)], {1: BASE}, [window], BASE)
    assert timings.host_ms == [pytest.approx((100 + 9_000 - 4_000) / 1e6)]


def test_a_call_that_waits_on_the_host_inside_its_hold_shows_in_the_host_time() -> None:
    """The child-process attack: the call blocks 300 us for another process's GEMM while its hold,
    sized from that long call, still spins; the GPU sees only a one-element add after the hold."""
    window = CallWindow(0, 1_000, 1_100, 301_100, 900_100)
    activities = [kernel(1, 1_010, 900_000, "spin"), kernel(2, 900_010, 900_050, "touch")]
    timings = attribute(activities, {1: BASE + HOLD_ID_OFFSET, 2: BASE}, [window], BASE)
    assert timings.spans_ms == [pytest.approx(0.00004)]
    assert timings.host_ms[0] > 0.3
    assert host_gap_reason(timings.spans_ms[0], timings.host_ms[0]) is not None


def test_launches_after_the_hold_ended_make_a_call_late() -> None:
    activities = [kernel(1, 1_010, 1_500, "spin"), kernel(2, 2_000, 3_000)]
    external = {1: BASE + HOLD_ID_OFFSET, 2: BASE, 9: BASE}
    timings = attribute(activities, external, two_windows()[:1], BASE, api_ends={2: 1_400, 9: 1_800})
    assert timings.late_calls == 1


def test_missing_records_of_the_timers_own_work_are_tampering() -> None:
    timings = attribute([kernel(1, 2_000, 2_100)], {1: BASE}, two_windows(), BASE)
    missing = own_records_missing(timings, 2, True, True)
    assert any("hold" in text for text in missing)
    assert any("L2 flush" in text for text in missing)
    assert any("sentinel" in text for text in missing)


def bracketed(
    begin: int, end: int, read_ns: int = 200, host_rate: float = 1.0, host_begin: int | None = None
) -> CallWindow:
    """A window of CUPTI's clock from ``begin`` to ``end``, with the host's readings around both
    ends (each reading ``read_ns`` long), the host's clock running ``host_rate`` times CUPTI's;
    ``host_begin``: the host's clock at the begin, where it is not ``begin * host_rate``."""
    first = int(begin * host_rate) if host_begin is None else host_begin
    last = first + int((end - begin) * host_rate)
    readings = (first - read_ns, first + read_ns, last - read_ns, last + read_ns)
    return CallWindow(0, begin, begin + 100, end - 100, end, host_ns=readings)


def test_a_cupti_clock_that_keeps_time_with_the_hosts_passes() -> None:
    windows = [bracketed(1_000_000 * i, 1_000_000 * i + 50_000) for i in range(100)]
    disagreement = clock_disagreement(windows)
    assert disagreement is not None and not disagreement.too_far
    assert (disagreement.windows.intervals, disagreement.gaps.intervals) == (100, 99)
    for stray in (disagreement.windows, disagreement.gaps):
        assert stray.short_ns == stray.long_ns == 0
    assert disagreement.used == 0
    # NTP's slewing (500 ppm), and a pre-empted reading (the bracket 2 ms wide): still in.
    slewed = [bracketed(1_000_000 * i, 1_000_000 * i + 50_000, host_rate=1.0005) for i in range(100)]
    assert not clock_disagreement(slewed).too_far  # type: ignore[union-attr]
    window = bracketed(0, 50_000)
    pre_empted = CallWindow(
        0, 1_000_000, 1_000_100, 1_049_900, 1_050_000, host_ns=(-2_000_000, 1_000_200, 1_049_800, 1_050_200)
    )
    assert not clock_disagreement([window, pre_empted]).too_far  # type: ignore[union-attr]
    assert clock_disagreement([CallWindow(0, 0, 1, 2, 3)]) is None  # stamped on the host's clock itself


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9, 1.5])
def test_a_cupti_clock_that_runs_at_another_rate_is_tampering(rate: float) -> None:
    """A program that gave CUPTI a timestamp source of its own that runs slow (every window, record
    and host time then reads short) or fast: the host's own readings around each window disagree."""
    windows = [bracketed(1_000_000 * i, 1_000_000 * i + 50_000, host_rate=1 / rate) for i in range(20)]
    disagreement = clock_disagreement(windows)
    assert disagreement is not None and disagreement.too_far and disagreement.used > 1
    assert disagreement.windows.too_far and disagreement.gaps.too_far
    message = clock_tampering(disagreement)
    assert ("shorter" if rate < 1 else "longer") in message and "timed windows" in message
    assert "timestamp source" in message


def test_a_cupti_clock_slowed_only_inside_each_call_is_tampering() -> None:
    """Slow only while the candidate's own work runs: 2 us of each 20 us window read as none."""
    windows = []
    for i in range(145):
        begin = 1_000_000 * i
        window = bracketed(begin, begin + 20_000)
        windows.append(CallWindow(0, begin, begin + 100, begin + 17_900, begin + 18_000, host_ns=window.host_ns))
    disagreement = clock_disagreement(windows)
    assert disagreement is not None and disagreement.windows.too_far, disagreement


def test_a_cupti_clock_slowed_only_between_the_calls_is_tampering() -> None:
    """Every window the length the host saw, the gaps between them (1 ms each on the host) read a
    tenth of that on CUPTI's clock: whatever CUPTI sets from its clock there is off."""
    windows = [bracketed(100_000 * i, 100_000 * i + 50_000, host_begin=1_000_000 * i) for i in range(20)]
    disagreement = clock_disagreement(windows)
    assert disagreement is not None and not disagreement.windows.too_far and disagreement.gaps.too_far
    message = clock_tampering(disagreement)
    assert "19 gaps between the timed calls" in message and "shorter" in message


def test_external_id_blocks_are_unpredictable() -> None:
    blocks = {reserve_external_ids() for _ in range(50)}
    assert len(blocks) == 50
    assert all(block % (1 << 20) == 0 for block in blocks)


# ----------------------------------------------------------------------------- the timed loop


class FakeTracer:
    """Stands in for the CUPTI tracer: a clock and a real stack of external ids (per test)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.stack: list[int] = []
        self.now = 0

    def timestamp(self) -> int:
        self.now += 100
        return self.now

    def enable(self, *, correlation: bool) -> None:
        self.log.append("enable")

    def disable(self) -> None:
        self.log.append("disable")

    def push(self, external_id: int) -> None:
        self.stack.append(external_id)

    def pop(self) -> int | None:
        return self.stack.pop()


class FakeRunner:
    """Stands in for the runner: writes down what is done, in order; ``fn`` is the candidate."""

    def __init__(self, log: list[str], fn: Any) -> None:
        self.log = log
        self.fn = fn
        self.next_index = 0
        self.torch = torch
        self.trusted = SimpleNamespace(event=None, plain_torch=contextlib.nullcontext, perf_counter=time.perf_counter)

    def next_inputs(self) -> tuple[int, tuple[Any, ...]]:
        self.next_index += 1
        self.log.append(f"inputs({self.next_index - 1})")
        return self.next_index - 1, (torch.full((2,), float(self.next_index - 1)),)

    def flush(self) -> None:
        self.log.append("flush")

    def synchronize(self) -> None:
        self.log.append("sync")

    def hold(self, cycles: int) -> None:
        self.log.append(f"hold({cycles})")

    def call(self, args: tuple[Any, ...]) -> Any:
        self.log.append("call")
        return self.fn(*args)

    def sentinel(self) -> None:
        self.log.append("sentinel")

    def clock_ns(self) -> int:
        return 0

    def wall_offset_ns(self) -> int:
        return 0


def test_each_call_runs_in_its_own_window_between_device_syncs() -> None:
    log: list[str] = []
    tracer = FakeTracer(log)
    runner = FakeRunner(log, lambda x: x * 2)
    calls = timed_calls(runner, 2, hold_cycles=500, tracer=tracer, base=BASE)  # type: ignore[arg-type]
    one_call = ["inputs({i})", "flush", "sync", "hold(500)", "call", "sync"]
    expected = ["sync", "enable"]
    for index in range(2):
        expected += [step.format(i=index) for step in one_call]
    assert log == [*expected, "sentinel", "sync", "disable"]
    assert [window.index for window in calls.windows] == [0, 1]
    assert all(w.begin_ns < w.call_ns < w.return_ns < w.end_ns for w in calls.windows)
    assert calls.windows[0].end_ns < calls.windows[1].begin_ns
    assert calls.stack_changes == [] and tracer.stack == []
    assert all(w.host_ns is not None and w.host_ns == tuple(sorted(w.host_ns)) for w in calls.windows)


def test_a_candidate_that_pushes_or_pops_external_ids_is_noticed() -> None:
    log: list[str] = []
    tracer = FakeTracer(log)

    def pushes(x: Any) -> Any:
        tracer.push(424242)  # left on the stack: the timer's pop gets it back
        return x

    calls = timed_calls(FakeRunner(log, pushes), 1, hold_cycles=0, tracer=tracer, base=BASE)  # type: ignore[arg-type]
    assert any("424242" in change for change in calls.stack_changes)


def test_kept_outputs_are_snapshots_taken_when_the_call_ended() -> None:
    log: list[str] = []
    buffer = torch.zeros(2)

    def reuses_one_buffer(x: Any) -> Any:
        buffer.copy_(x)
        return buffer

    reservoir = OutputReservoir(8, lambda n: 0)
    runner = FakeRunner(log, reuses_one_buffer)
    timed_calls(runner, 3, hold_cycles=0, tracer=FakeTracer(log), base=BASE, reservoir=reservoir)  # type: ignore[arg-type]
    assert [float(kept.output[0]) for kept in reservoir.kept] == [0.0, 1.0, 2.0]
    assert [kept.input_index for kept in reservoir.kept] == [0, 1, 2]


# ----------------------------------------------------------------------------- inputs and outputs


def test_plans_without_cuda_tensors() -> None:
    assert plan_inputs(torch, (), None).mode == MODE_NONE
    assert plan_inputs(torch, (torch.ones(2), 3), None).mode == MODE_SAME  # CPU tensors: not cloned
    plan = plan_inputs(torch, (), lambda index: (torch.full((1,), float(index)),))
    assert plan.mode == MODE_FACTORY
    assert float(plan.inputs(5)[0][0]) == 5.0
    assert plan_inputs(torch, (), lambda index: torch.ones(1)).inputs(0)[0].shape == (1,)
    with pytest.raises(ExecutionError) as caught:
        plan_inputs(torch, (torch.ones(1),), lambda index: ())
    assert caught.value.kind == "parse"


def test_the_reservoir_keeps_a_uniform_sample_of_bounded_size() -> None:
    import random

    rng = random.Random(3)
    counts = [0] * 20
    for _ in range(2000):
        reservoir = OutputReservoir(4, rng.randrange)
        for call in range(20):
            slot = reservoir.slot_for_next()
            if slot is not None:
                reservoir.put(slot, KeptOutput(call, call, None, ()))
        assert len(reservoir.kept) == 4
        for kept in reservoir.kept:
            counts[kept.call] += 1
    # Each call is kept with probability 4/20: 400 of 2000 runs, within a few standard deviations.
    assert all(300 < count < 500 for count in counts), counts


def test_a_timed_output_must_equal_the_candidates_own_untimed_output() -> None:
    good = KeptOutput(0, 10, torch.ones(3), ())
    wrong = KeptOutput(1, 11, torch.zeros(3), ())
    close = torch.testing.assert_close

    def again(kept: KeptOutput) -> Any:
        return torch.ones(3)

    assert check_outputs(torch, [good], check=None, expected=again, assert_close=close) == 1
    with pytest.raises(ExecutionError) as caught:
        check_outputs(torch, [good, wrong], check=None, expected=again, assert_close=close)
    assert caught.value.kind == "correctness"
    assert "timed call 1" in caught.value.message


def test_rotated_clones_differ_in_value_and_the_writes_of_a_call_show(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "_is_cuda_tensor", lambda torch, value: isinstance(value, torch.Tensor))
    plan = inputs.plan_inputs(torch, (torch.ones(4), torch.arange(4), 2.0), None)
    assert plan.mode == inputs.MODE_ROTATED and len(plan.sets) == inputs.MAX_ROTATED_SETS
    assert len({float(s[0][0]) for s in plan.sets}) == len(plan.sets)  # floats: a value per set
    assert all(torch.equal(s[1], torch.arange(4)) and s[2] == 2.0 for s in plan.sets)  # ints untouched
    x = torch.ones(4)
    scaled = inputs._scaled_clone(torch, x, 1.0 + 3 * inputs.ROTATION_SCALE_STEP)
    assert scaled.data_ptr() != x.data_ptr() and float(scaled[0]) == pytest.approx(1.046875)
    assert inputs._scaled_clone(torch, 7, 2.0) == 7
    before = inputs.versions(torch, (x, 3))
    x.add_(1.0)
    assert inputs.versions(torch, (x, 3)) != before


def test_a_user_check_sees_each_kept_output_with_its_inputs() -> None:
    seen: list[tuple[float, float]] = []

    def check(output: Any, args: tuple[Any, ...]) -> bool:
        seen.append((float(output[0]), float(args[0][0])))
        return bool(torch.equal(output, args[0] * 2))

    kept = [KeptOutput(0, 0, torch.full((2,), 2.0), (torch.ones(2),))]
    assert check_outputs(torch, kept, check=check, expected=None, assert_close=torch.testing.assert_close) == 1
    bad = [KeptOutput(3, 9, torch.full((2,), 5.0), (torch.ones(2),))]
    with pytest.raises(ExecutionError) as caught:
        check_outputs(torch, bad, check=check, expected=None, assert_close=torch.testing.assert_close)
    assert caught.value.kind == "correctness" and "returned False" in caught.value.message


def test_snapshots_are_plain_tensors_and_subclasses_are_refused() -> None:
    value = torch.ones(2)
    copied = inputs.snapshot(torch, (value, [value], {"a": value}))
    assert type(copied[0]) is torch.Tensor and type(copied[1][0]) is torch.Tensor
    assert type(copied[2]["a"]) is torch.Tensor
    assert copied[0].data_ptr() != value.data_ptr()

    class Lying(torch.Tensor):  # type: ignore[name-defined]  # torch: importorskip's module, a variable to mypy
        pass

    with pytest.raises(ExecutionError) as caught:
        inputs.snapshot(torch, [value.as_subclass(Lying)])
    assert caught.value.kind == "correctness" and "Lying" in caught.value.message


# ----------------------------------------------------------------------------- trusted state


@pytest.fixture
def armed_state() -> trust.ArmedState:
    return trust.arm(use_cupti=False)


def test_an_untouched_timer_verifies_clean(armed_state: trust.ArmedState) -> None:
    assert trust.verify(armed_state) == []


def test_a_replaced_method_is_named(armed_state: trust.ArmedState, monkeypatch: pytest.MonkeyPatch) -> None:
    original = timers.CuptiTimer.measure

    def measure(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    monkeypatch.setattr(timers.CuptiTimer, "measure", measure)
    assert trust.verify(armed_state) == ["kcoral.timing.timers.CuptiTimer.measure was replaced"]


def test_replaced_code_of_the_same_function_is_named(
    armed_state: trust.ArmedState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(findings.host_gap_reason, "__code__", (lambda gpu_ms, host_ms: None).__code__)
    changes = trust.verify(armed_state)
    assert "kcoral.timing.findings.host_gap_reason had its code replaced" in changes
    assert all("host_gap_reason had its code replaced" in change for change in changes)


def test_replaced_module_globals_and_library_functions_are_named(
    armed_state: trust.ArmedState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(timers, "attribute", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    changes = trust.verify(armed_state)
    assert "kcoral.timing.timers.attribute was replaced" in changes
    assert "torch.cuda.synchronize was replaced" in changes
    assert "time.perf_counter was replaced" in changes


def test_a_reset_fallback_switch_is_named(armed_state: trust.ArmedState, monkeypatch: pytest.MonkeyPatch) -> None:
    """The force_event_fallback attack: make the old lookup say CUPTI cannot be imported."""
    from kcoral.timing.cupti import CuptiTracer

    monkeypatch.setattr(CuptiTracer, "_instance_error", "cupti-python is not importable: simulated")
    assert trust.verify(armed_state) == ["kcoral.timing.cupti.CuptiTracer._instance_error was replaced"]


def test_the_trusted_references_are_taken_at_arm(armed_state: trust.ArmedState) -> None:
    assert armed_state.trusted.perf_counter is time.perf_counter or callable(armed_state.trusted.perf_counter)
    assert armed_state.cupti_ok is False and armed_state.cupti_error
    assert trust.arm() is armed_state  # once per process


def test_the_quiet_interpreter_stops_gc_and_trace_hooks_and_restores_them(armed_state: trust.ArmedState) -> None:
    import gc

    def tracer(*args: Any) -> None:
        return None

    sys.setprofile(tracer)
    try:
        with trust.QuietInterpreter(armed_state.trusted):
            assert not gc.isenabled()
            assert sys.getprofile() is None
        assert gc.isenabled()
        assert sys.getprofile() is tracer
    finally:
        sys.setprofile(None)


def test_describe_changes_is_bounded() -> None:
    text = trust.describe_changes([f"x{i} was replaced" for i in range(20)])
    assert text.count("was replaced") == trust.CHANGES_SHOWN and "14 more" in text


# ----------------------------------------------------------------------------- findings


def test_verdicts() -> None:
    assert verdict([]) == {"verdict": "ok", "reasons": []}
    assert verdict(["x"]) == {"verdict": "suspect", "reasons": ["x"]}


def test_host_gap() -> None:
    assert host_gap_reason(0.176, 0.19) is None  # an honest GEMM
    assert host_gap_reason(0.004, 0.02) is None  # an honest 4 us add
    assert host_gap_reason(0.003, 0.25) is not None  # the GEMM ran in a child process
    assert host_gap_reason(None, 0.3) is None


def test_threads_and_processes_the_program_left_running_are_reasons() -> None:
    # The threads at the program's start, as arm_in_worker takes them: the process-wide arm may
    # be older than a thread another test in this process left running.
    stop = threading.Event()
    watch = EnvironmentWatch.start(None, threading.enumerate, frozenset(threading.enumerate()), 0)
    helper = threading.Thread(target=stop.wait, name="kernel-helper", daemon=True)
    helper.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        reasons = watch.finish()
    finally:
        stop.set()
        child.kill()
        child.wait()
        helper.join()
    assert any("kernel-helper" in reason for reason in reasons), reasons
    assert any(f"{child.pid} (" in reason for reason in reasons), reasons
    assert watch.details["program_threads"] == ["kernel-helper"]


class FakeNvml:
    def __init__(self, pids: set[int] | None, busy: dict[int, int] | None) -> None:
        self._pids, self._busy = pids, busy

    def running_pids(self) -> set[int] | None:
        return self._pids

    def busy_pids(self, since_us: int) -> dict[int, int] | None:
        return self._busy


@pytest.mark.parametrize(
    ("pids", "busy", "suspect"),
    [
        ({1000}, {1000: 40}, False),  # we cannot see our own PID (a PID namespace): one busy is us
        ({1000, 1001}, {1000: 40, 1001: 90}, True),  # two busy: one was not us
        (None, {}, False),
        (None, None, False),
    ],
)
def test_another_process_busy_on_the_gpu(
    armed_state: trust.ArmedState, pids: set[int] | None, busy: dict[int, int] | None, suspect: bool
) -> None:
    watch = EnvironmentWatch.start(FakeNvml(pids, busy), threading.enumerate, armed_state.threads_at_arm, 0)  # type: ignore[arg-type]
    reasons = watch.finish()
    assert any("another process used the GPU" in reason for reason in reasons) is suspect


OWN, SPARE, GONE, STRANGER = 5000, 5001, 5002, 4242


@pytest.mark.parametrize(
    ("known", "pids", "busy", "counted"),
    [
        # The slot's spare making or holding its context beside the program: not contention.
        (KnownPids(OWN, idle=frozenset({SPARE})), {OWN, SPARE}, {OWN: 40, SPARE: 12}, []),
        # A previous holder, exited (NVML lists no context of it), still in NVML's samples.
        (KnownPids(OWN, exited=frozenset({GONE})), {OWN, SPARE}, {OWN: 40, GONE: 38}, []),
        # That pid with a context again (reused by a live process): counted.
        (KnownPids(OWN, exited=frozenset({GONE})), {OWN, GONE}, {OWN: 40, GONE: 38}, [GONE]),
        # A process the service knows nothing of, busy beside an idle spare: counted, alone.
        (KnownPids(OWN, idle=frozenset({SPARE})), {OWN, SPARE, STRANGER}, {OWN: 4, SPARE: 3, STRANGER: 60}, [STRANGER]),
        # Our own pid named by the broker: one busy process that is not us is counted (it was not
        # before: with our pid unknown, one busy process was taken for us).
        (KnownPids(OWN), {STRANGER}, {STRANGER: 50}, [STRANGER]),
        (KnownPids(OWN), {OWN}, {OWN: 70}, []),
        # Without the broker's word (outside a worker): as before, two busy mean one was not us.
        (None, {OWN, GONE}, {OWN: 40, GONE: 38}, [OWN, GONE]),
    ],
)
def test_the_services_own_idle_processes_are_not_counted_and_a_stranger_is(
    armed_state: trust.ArmedState,
    known: KnownPids | None,
    pids: set[int],
    busy: dict[int, int],
    counted: list[int],
) -> None:
    watch = EnvironmentWatch.start(FakeNvml(pids, busy), threading.enumerate, armed_state.threads_at_arm, 0, known)  # type: ignore[arg-type]
    reasons = [reason for reason in watch.finish() if "another process used the GPU" in reason]
    named = sorted(int(part.split()[0]) for part in reasons[0].split("pid ")[1:]) if reasons else []
    assert named == counted, reasons
    excused = watch.details["gpu_processes"]["excused"]
    assert set(excused) == {str(pid) for pid in busy if pid not in counted and pid != (known.own if known else OWN)}


def test_the_grant_s_pids_are_validated_and_kept_for_the_program(armed_state: trust.ArmedState) -> None:
    body = {"own": OWN, "idle": [SPARE], "exited": [GONE]}
    assert KnownPids.from_wire(body) == KnownPids(OWN, frozenset({SPARE}), frozenset({GONE}))
    assert KnownPids.from_wire(body).to_wire() == body  # type: ignore[union-attr]
    too_many = {"exited": list(range(1, MOST_PIDS + 2))}
    for bad in ({"own": "5000"}, {"idle": [True]}, {"exited": [0]}, too_many, [OWN], None):
        assert KnownPids.from_wire(bad) is None, bad
    before = armed_state.known_pids
    try:
        trust.note_grant(body)
        assert trust.armed().known_pids == KnownPids.from_wire(body)
        trust.note_grant({"own": -1})  # malformed: nothing is taken
        assert trust.armed().known_pids is None
    finally:
        armed_state.known_pids = before


def test_a_busy_process_that_is_not_ours_is_a_reason_when_we_know_our_pid(armed_state: trust.ArmedState) -> None:
    import os

    nvml = FakeNvml({os.getpid(), 4242}, {4242: 70})
    watch = EnvironmentWatch.start(nvml, threading.enumerate, armed_state.threads_at_arm, 0)  # type: ignore[arg-type]
    assert any("pid 4242" in reason for reason in watch.finish())


def test_in_a_pid_namespace_nvml_s_name_for_us_is_our_pid_there(armed_state: trust.ArmedState) -> None:
    """On the H200, NVML told a program in the bubblewrap sandbox its own pid there (os.getpid(),
    18) and its slot's spare by its pid there (19), the other slots' spares by their host pids; the
    broker names us by our host pid (OWN) and the spares by both. None of it is contention."""
    here, spare_inside, other_spare = os.getpid(), 19, 5003
    known = KnownPids(OWN, idle=frozenset({SPARE, spare_inside, other_spare}))
    nvml = FakeNvml({here, spare_inside}, {here: 8, spare_inside: 2, other_spare: 14})
    watch = EnvironmentWatch.start(nvml, threading.enumerate, armed_state.threads_at_arm, 0, known)  # type: ignore[arg-type]
    assert not [reason for reason in watch.finish() if "another process used the GPU" in reason]
    # A stranger beside us is still counted.
    nvml = FakeNvml({here}, {here: 8, STRANGER: 60})
    watch = EnvironmentWatch.start(nvml, threading.enumerate, armed_state.threads_at_arm, 0, known)  # type: ignore[arg-type]
    (reason,) = [reason for reason in watch.finish() if "another process used the GPU" in reason]
    assert f"pid {STRANGER} (60% SM)" in reason and f"pid {here} " not in reason
