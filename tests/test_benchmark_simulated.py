"""benchmark() end to end on the CPU, with stand-ins for what needs a GPU: torch.cuda's entry points
run on the CPU, and a CUPTI tracer that writes one activity record for each span between the
timer's push and pop of an external id (as CUPTI would for the work launched inside it).

This runs the real loop, windows, trusted-state checks, inputs, output checks and findings; what it
cannot show (real records, real timing) the GPU tests do.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral.errors import ExecutionError
from kcoral.timing import timers, trust
from kcoral.timing.benchmark import benchmark
from kcoral.timing.cupti import GAP_ID_OFFSET, SENTINEL_ID_OFFSET, Activity, TraceRecords, cupti_thread_id
from tests.helpers import called_from

torch = pytest.importorskip("torch")

CONFIG = {"clock_warmup_ms": 0, "warmup": 2, "repeat": 12}


class SimulatedTracer:
    """Writes a kernel record for every push..pop span (a memcpy too for the sentinel)."""

    def __init__(self) -> None:
        self._correlations = itertools.count(1)
        self._stack: list[tuple[int, int]] = []
        self._records = TraceRecords()
        self._enabled: list[Any] = []
        self.popped_wrong: list[int] = []  # a list, changed in place: the tracer's own state is watched
        self.between_calls: list[int] = []  # a duration: record foreign work after each gap
        self.device_ahead_ns: list[int] = []  # the device's records this far ahead of the host's clock
        self.launches_recorded: list[bool] = []  # also record the launch calls of the timer's gap work
        # A timestamp source of the program's own (CUPTI's activity_register_timestamp_callback):
        # from the moment it is given (rate, host ns, own ns), its clock runs at that rate.
        self.clock_given: list[tuple[float, int, int]] = []
        # Steps of the host's wall clock (an operator's, NTP's), ns: CUPTI's timestamps follow it.
        self.wall_steps_ns: list[int] = []

    def wall_ns(self) -> int:
        """The host's wall clock, with its steps: the trusted wall clock of the simulated state."""
        return time.time_ns() + sum(self.wall_steps_ns)

    def timestamp(self) -> int:
        now = time.perf_counter_ns() + sum(self.wall_steps_ns)
        if not self.clock_given:
            return now
        rate, host_at, own_at = self.clock_given[-1]
        return own_at + int((now - host_at) * rate)

    def give_clock(self, rate: float) -> None:
        """The program's own timestamp source, from now on at ``rate`` times the host's."""
        self.clock_given.append((rate, time.perf_counter_ns(), self.timestamp()))

    def enable(self, *, correlation: bool) -> None:
        self._enabled.append("on")

    def disable(self) -> None:
        self._enabled.clear()

    def push(self, external_id: int) -> None:
        self._stack.append((external_id, self.timestamp()))

    def pop(self) -> int | None:
        external_id, started = self._stack.pop()
        ended = self.timestamp()
        if self._enabled:
            kinds = ["concurrent_kernel"]
            if (external_id % (1 << 20)) >= SENTINEL_ID_OFFSET:
                kinds.append("memcpy")
            ahead = self.device_ahead_ns[0] if self.device_ahead_ns else 0
            for kind in kinds:
                correlation = next(self._correlations)
                self._records.activities.append(
                    Activity(kind, correlation, started + ahead, max(ended, started + 1) + ahead, "k")
                )
                self._records.external[correlation] = external_id
                if self.launches_recorded and external_id % (1 << 20) >= GAP_ID_OFFSET:
                    # Launched as the span began, on the host's clock, by this thread.
                    self._records.api_ends[correlation] = started
                    self._records.api_threads[correlation] = cupti_thread_id()
        if self.between_calls and self._enabled and GAP_ID_OFFSET <= external_id % (1 << 20) < SENTINEL_ID_OFFSET:
            self.launch(self.between_calls[0])
        return self.popped_wrong[0] if self.popped_wrong else external_id

    def launch(self, duration_ns: int) -> None:
        """Work launched by code that pushed no id (another thread): recorded, with no external id."""
        started = self.timestamp()
        self._records.activities.append(
            Activity("concurrent_kernel", next(self._correlations), started, started + duration_ns, "gemm")
        )

    def drain(self) -> TraceRecords:
        records, self._records = self._records, TraceRecords()
        return records

    def foreign_subscriber(self) -> str | None:
        return None


class Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Event) -> float:
        return (other.at - self.at) * 1e3


@pytest.fixture
def simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedTracer]:
    # The process's armed state, taken before the stand-ins: other tests verify against it.
    base = trust.arm(use_cupti=False)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: type("P", (), {"L2_cache_size": 1 << 16})())
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "simulated")
    monkeypatch.setattr(cuda, "mem_get_info", lambda: (1 << 34, 1 << 34))
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(cuda, "Event", Event)
    monkeypatch.setattr("kcoral.timing.inputs._is_cuda_tensor", lambda torch, value: isinstance(value, torch.Tensor))
    tracer = SimulatedTracer()
    state = trust.ArmedState(
        tracer=tracer,  # type: ignore[arg-type]
        cupti_error=None,
        trusted=dataclasses.replace(trust._capture_trusted(), wall_ns=tracer.wall_ns),
        modules={},
        snapshot=trust.Snapshot(),
        threads_at_arm=frozenset(),
        armed_at=time.time(),
        in_worker=False,
    )
    # The simulated state's own snapshot is taken with the stand-ins in place.
    state = dataclasses.replace(state, modules=base.modules, snapshot=trust.take_snapshot(base.modules, tracer))  # type: ignore[arg-type]
    # The threads at the program's start, as arm_in_worker takes them: the process-wide arm may be
    # older than a thread a test before this one left running.
    state = dataclasses.replace(state, threads_at_arm=frozenset(threading.enumerate()))
    monkeypatch.setattr(trust, "_ARMED", state)
    yield tracer


def test_a_closure_is_timed_and_reads_ok(simulated_gpu: SimulatedTracer) -> None:
    x = torch.ones(1024)

    def candidate() -> None:
        x.add_(1.0)

    result = benchmark(candidate, config=CONFIG)
    assert result["method"] == "cupti" and result["samples"] == 12
    assert result["integrity"] == {"verdict": "ok", "reasons": []}, result["integrity"]
    assert result["inputs"]["mode"] == "none" and result["outputs_checked"] == 0
    assert result["host_ms_median"] is not None and result["latency_ms_median"] > 0


def test_arguments_are_rotated_and_outputs_checked(simulated_gpu: SimulatedTracer) -> None:
    seen: set[int] = set()

    def double(a: Any) -> Any:
        seen.add(a.data_ptr())
        return a * 2

    result = benchmark(double, torch.ones(4096), config=CONFIG)
    assert result["inputs"]["mode"] == "rotated_clones" and result["inputs"]["sets"] > 1
    assert result["outputs_checked"] >= 1
    assert len(seen) > 1
    assert result["integrity"]["verdict"] == "ok", result["integrity"]


def test_a_stale_output_when_timed_fails_the_check(simulated_gpu: SimulatedTracer) -> None:
    last: dict[str, Any] = {}

    def stale(a: Any) -> Any:
        timed = any(frame.function == "timed_calls" for frame in __import__("inspect").stack())
        if timed and "out" in last:
            return last["out"]
        last["out"] = a * 2
        return last["out"]

    with pytest.raises(ExecutionError) as caught:
        benchmark(stale, torch.ones(4096), config=CONFIG)
    assert caught.value.kind == "correctness"


def test_a_factory_and_a_check(simulated_gpu: SimulatedTracer) -> None:
    result = benchmark(
        lambda a: a + 1,
        inputs=lambda index: (torch.full((8,), float(index)),),
        check=lambda out, args: bool(torch.equal(out, args[0] + 1)),
        config=CONFIG,
    )
    assert result["inputs"]["mode"] == "factory" and result["outputs_checked"] >= 1


def test_a_patched_timer_fails_with_integrity(simulated_gpu: SimulatedTracer, monkeypatch: pytest.MonkeyPatch) -> None:
    original = timers.CuptiTimer.measure

    def candidate(a: Any) -> Any:
        timers.CuptiTimer.measure = lambda self, *args, **kwargs: original(self, *args, **kwargs)  # type: ignore[method-assign]
        return a * 2

    try:
        with pytest.raises(ExecutionError) as caught:
            benchmark(candidate, torch.ones(16), config=CONFIG)
    finally:
        timers.CuptiTimer.measure = original  # type: ignore[method-assign]
    assert caught.value.kind == "integrity"
    assert "CuptiTimer.measure was replaced" in caught.value.message


def test_a_changed_correlation_stack_fails_with_integrity(simulated_gpu: SimulatedTracer) -> None:
    simulated_gpu.popped_wrong.append(12345)
    with pytest.raises(ExecutionError) as caught:
        benchmark(lambda: None, config=CONFIG)
    assert caught.value.kind == "integrity" and "12345" in caught.value.message


def test_defences_off_is_marked_suspect(simulated_gpu: SimulatedTracer) -> None:
    x = torch.ones(8)
    result = benchmark(lambda: x.add_(1.0), config={**CONFIG, "defences": False})
    assert result["integrity"]["verdict"] == "suspect"
    assert "defences were turned off" in result["integrity"]["reasons"][0]


def test_work_another_thread_launches_inside_the_window_is_counted(simulated_gpu: SimulatedTracer) -> None:
    import queue
    import threading

    jobs: queue.Queue[threading.Event | None] = queue.Queue()

    def serve() -> None:
        while (done := jobs.get()) is not None:
            simulated_gpu.launch(2_000_000)  # a 2 ms GEMM, recorded with no external id
            done.set()

    helper = threading.Thread(target=serve, daemon=True)
    helper.start()

    def through_helper() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait()

    try:
        result = benchmark(through_helper, config=CONFIG)
    finally:
        jobs.put(None)
        helper.join()
    assert result["latency_ms_median"] >= 2.0, result
    assert result["integrity_details"]["foreign_activities"] == 0


def test_records_on_a_device_clock_ahead_of_the_hosts_read_ok(simulated_gpu: SimulatedTracer) -> None:
    """The device's records 100 us ahead of the host's clock (about a window and a gap here) put the
    timer's own gap work inside the windows, an integrity failure of an honest call (as the windows'
    own tests show, by the records alone). The timer's own launches between the windows tell the
    offset, and the records are moved back by it."""
    x = torch.ones(8)
    simulated_gpu.device_ahead_ns.append(100_000)
    simulated_gpu.launches_recorded.append(True)
    result = benchmark(lambda: x.add_(1.0), config=CONFIG)
    assert result["integrity"] == {"verdict": "ok", "reasons": []}, result["integrity"]
    assert 0 < result["integrity_details"]["clock_offset_us"] <= 100


@pytest.mark.parametrize("when", ["from-the-first-call", "inside-each-call", "outside-each-call"])
def test_a_cupti_clock_replaced_by_the_program_fails_with_integrity(simulated_gpu: SimulatedTracer, when: str) -> None:
    """The program gives CUPTI a timestamp source of its own that runs at a tenth of the host's
    pace: from its first call on (every window, record and host time of the measurement on it),
    only while each of its calls runs, or all but while they run (the call's own records then at
    the host's pace, the windows around them not). The host's own clock around each window
    disagrees."""
    x = torch.ones(8)
    slow, fast = (1.0, 0.1) if when == "outside-each-call" else (0.1, 1.0)

    def replaces_the_clock() -> Any:
        if when != "from-the-first-call" or not simulated_gpu.clock_given:
            simulated_gpu.give_clock(slow)
        time.sleep(0.0002)
        out = x.add_(1.0)
        if when != "from-the-first-call":
            simulated_gpu.give_clock(fast)
        return out

    with pytest.raises(ExecutionError) as failure:
        benchmark(replaces_the_clock, config=CONFIG)
    assert failure.value.kind == "integrity"
    assert "CUPTI's clock made the" in str(failure.value), failure.value


@pytest.mark.parametrize("step_us", [500, -500])
def test_a_step_of_the_hosts_wall_clock_reads_suspect_not_tampering(
    simulated_gpu: SimulatedTracer, step_us: int
) -> None:
    """The host's wall clock, which CUPTI's timestamps follow, is stepped (by an operator or NTP,
    here inside the seventh timed call): the window around it disagrees with the host's monotonic clock,
    which is the step's doing, not the program's; the measurement is suspect and says why."""
    x = torch.ones(8)
    calls = itertools.count()

    def honest() -> Any:
        if next(calls) == 18:  # CONFIG: 24 calls in all, the last 12 of them timed
            simulated_gpu.wall_steps_ns.append(step_us * 1000)
        return x.add_(1.0)

    result = benchmark(honest, config=CONFIG)
    assert result["integrity"]["verdict"] == "suspect", result["integrity"]
    (reason,) = [r for r in result["integrity"]["reasons"] if "wall clock was stepped" in r]
    stepped = re.search(r"stepped (forward|back) by ([0-9.]+) us", reason)
    assert stepped is not None, reason
    assert stepped[1] == ("forward" if step_us > 0 else "back")
    assert float(stepped[2]) == pytest.approx(abs(step_us), abs=5)  # two clocks read a moment apart
    assert result["integrity_details"]["wall_clock_step_us"] == pytest.approx(step_us, abs=5)
    assert result["integrity_details"]["clock_stray_share"] > 1


def test_an_honest_call_on_a_simulated_gpu_reads_its_clock_agreeing(simulated_gpu: SimulatedTracer) -> None:
    x = torch.ones(8)
    result = benchmark(lambda: x.add_(1.0), config=CONFIG)
    assert result["integrity"] == {"verdict": "ok", "reasons": []}, result["integrity"]
    assert 0 <= result["integrity_details"]["clock_stray_share"] <= 1


def test_work_launched_between_the_calls_is_foreign(simulated_gpu: SimulatedTracer) -> None:
    """Another thread's launch that lands between two timed calls (here: whenever the timer's own
    gap work ends, so that the test does not depend on a race)."""
    simulated_gpu.between_calls.append(1_000_000)
    x = torch.ones(8)
    result = benchmark(lambda: x.add_(1.0), config=CONFIG)
    assert result["integrity"]["verdict"] == "suspect"
    assert any("between the timed calls" in reason for reason in result["integrity"]["reasons"]), result["integrity"]
    assert result["integrity_details"]["foreign_activities"] >= CONFIG["repeat"] - 1  # not before call 0


def test_a_change_made_during_the_untimed_output_check_fails_with_integrity(simulated_gpu: SimulatedTracer) -> None:
    """The kept outputs are checked by calling the function again, untimed, after the measurement's
    own check: a change the function makes then (here: the summary the report is made with) is
    caught before the report is made (the GPU twin is in tests/gpu/test_snapshot_gaps_gpu.py)."""
    import kcoral.timing.benchmark as module

    real = module.summarize
    replaced: list[str] = []

    def scaled(samples: Any) -> dict[str, Any]:
        return {k: (v * 0.05 if isinstance(v, float) else v) for k, v in real(samples).items()}

    def double(a: Any) -> Any:
        if not replaced and called_from("again"):
            module.summarize = scaled  # type: ignore[assignment]
            replaced.append("summarize")
        return a * 2

    try:
        with pytest.raises(ExecutionError) as caught:
            benchmark(double, torch.ones(4096), config=CONFIG)
    finally:
        module.summarize = real
    assert replaced, "the untimed output check never called the function"
    assert caught.value.kind == "integrity"
    assert "summarize" in caught.value.message and "while the outputs were checked" in caught.value.message


def test_a_step_of_the_wall_clock_and_its_reverse_in_one_measurement_read_suspect(
    simulated_gpu: SimulatedTracer,
) -> None:
    """Stepped forward inside the seventh timed call and back inside the ninth: the net step is 0,
    but the windows between were read on a clock 500 us off the host's; suspect, not tampering."""
    x = torch.ones(8)
    calls = itertools.count()

    def honest() -> Any:
        index = next(calls)
        if index == 18:
            simulated_gpu.wall_steps_ns.append(500_000)
        elif index == 20:
            simulated_gpu.wall_steps_ns.append(-500_000)
        return x.add_(1.0)

    result = benchmark(honest, config=CONFIG)
    assert result["integrity"]["verdict"] == "suspect", result["integrity"]
    assert any("wall clock was stepped forward by" in r for r in result["integrity"]["reasons"])
    assert result["integrity_details"]["wall_clock_step_us"] == pytest.approx(500, abs=5)
