"""CPU tests of kcoral.builtins: config parsing, the pure timing helpers, and behaviour without a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kcoral import builtins
from kcoral.builtins import (
    Activity,
    BenchmarkConfig,
    GpuAccessGuard,
    activities_stable,
    benchmark,
    busy_ns,
    clock_is_steady,
    count_from_budget,
    hold_ends_by_call,
    initial_hold_us,
    is_harmless_cuda_call,
    spans_by_call,
    split_config,
    summarize,
    throttle_reason_names,
)
from kcoral.errors import ExecutionError
from kcoral.timing.cupti import EXTERNAL_ID_BLOCK
from kcoral.timing.timers import timed_calls

torch = pytest.importorskip("torch")
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour of a host without a GPU")


def noop(*args: object) -> None:
    return None


# ----------------------------------------------------------------------------- config


def test_defaults_without_config() -> None:
    args, config = split_config((1, 2), None)
    assert args == (1, 2)
    assert config == BenchmarkConfig()
    assert (config.warmup_ms, config.repeat_ms, config.flush_l2) == (25.0, 100.0, True)
    assert config.warmup is None and config.repeat is None


def test_trailing_dict_of_config_keys_is_config() -> None:
    args, config = split_config((1, {"repeat": 7, "flush_l2": False}), None)
    assert args == (1,)
    assert config.repeat == 7
    assert config.flush_l2 is False


def test_config_keyword_leaves_a_trailing_dict_as_argument() -> None:
    payload = {"repeat": 3}
    args, config = split_config((payload,), {"warmup": 2})
    assert args == (payload,)
    assert config.warmup == 2 and config.repeat is None


def test_trailing_dict_of_other_keys_is_an_argument() -> None:
    args, config = split_config(({"alpha": 1},), None)
    assert args == ({"alpha": 1},)
    assert config == BenchmarkConfig()


def test_empty_trailing_dict_is_an_argument() -> None:
    args, _ = split_config(({},), None)
    assert args == ({},)


def test_unknown_key_in_config_keyword_is_a_parse_error() -> None:
    with pytest.raises(ExecutionError) as caught:
        benchmark(noop, config={"repeats": 10})
    assert caught.value.kind == "parse"
    assert "repeats" in caught.value.message


def test_trailing_dict_mixing_config_and_unknown_keys_is_a_parse_error() -> None:
    with pytest.raises(ExecutionError) as caught:
        benchmark(noop, {"repeat": 10, "warmpu": 3})
    assert caught.value.kind == "parse"
    assert "warmpu" in caught.value.message


@pytest.mark.parametrize(
    "values",
    [
        {"repeat": 0},
        {"repeat": 2.5},
        {"warmup": -1},
        {"warmup": True},
        {"repeat_ms": -5},
        {"warmup_ms": float("nan")},
        {"flush_l2": "yes"},
        {"method": "nvtx"},
    ],
)
def test_bad_values_are_parse_errors(values: dict[str, object]) -> None:
    with pytest.raises(ExecutionError) as caught:
        BenchmarkConfig.from_mapping(values)
    assert caught.value.kind == "parse"


def test_counts_and_budgets_are_capped() -> None:
    config = BenchmarkConfig.from_mapping({"repeat": 10**9, "warmup": 10**9, "repeat_ms": 1e9, "warmup_ms": 1e9})
    assert config.repeat == builtins.MAX_COUNT
    assert config.warmup == builtins.MAX_COUNT
    assert config.repeat_ms == builtins.MAX_BUDGET_MS
    assert config.warmup_ms == builtins.MAX_BUDGET_MS


def test_explicit_zero_warmup_is_allowed() -> None:
    assert BenchmarkConfig.from_mapping({"warmup": 0}).warmup == 0


def test_launch_hold_is_on_by_default_and_can_be_turned_off() -> None:
    assert BenchmarkConfig().launch_hold is True
    assert BenchmarkConfig.from_mapping({"launch_hold": False}).launch_hold is False
    with pytest.raises(ExecutionError) as caught:
        BenchmarkConfig.from_mapping({"launch_hold": 0})
    assert caught.value.kind == "parse"


# ----------------------------------------------------------------------------- no GPU


@needs_no_gpu
def test_benchmark_without_gpu_is_unavailable() -> None:
    with pytest.raises(ExecutionError) as caught:
        benchmark(noop, 1, 2)
    assert caught.value.kind == "unavailable"
    assert "GPU" in caught.value.message


@needs_no_gpu
def test_config_is_checked_before_the_gpu() -> None:
    with pytest.raises(ExecutionError) as caught:
        benchmark(noop, config={"bogus": 1})
    assert caught.value.kind == "parse"


# ----------------------------------------------------------------------------- pure helpers


def test_summarize() -> None:
    stats = summarize([1.0, 2.0, 3.0, 10.0])
    assert stats["latency_ms_median"] == 2.5
    assert stats["latency_ms_mean"] == 4.0
    assert stats["latency_ms_min"] == 1.0
    assert stats["latency_ms_max"] == 10.0
    assert stats["latency_ms_std"] == pytest.approx(4.0826, rel=1e-4)


def test_summarize_one_sample_has_zero_std() -> None:
    assert summarize([0.5])["latency_ms_std"] == 0.0


def test_summarize_refuses_no_samples() -> None:
    with pytest.raises(ValueError):
        summarize([])


def test_activities_stable_ignores_order_but_not_kind_or_count() -> None:
    kernel_a = ("concurrent_kernel", "add")
    kernel_b = ("concurrent_kernel", "mul")
    memset = ("memset", "")
    assert activities_stable([[kernel_a, kernel_b], [kernel_b, kernel_a]])
    assert activities_stable([])
    assert not activities_stable([[kernel_a], [kernel_a, kernel_a]])
    assert not activities_stable([[kernel_a], [memset]])
    assert not activities_stable([[kernel_a], [kernel_b]])


def test_spans_by_call_takes_first_start_to_last_end_across_streams() -> None:
    activities = [
        Activity("concurrent_kernel", 10, 1_000, 3_000, "main"),
        Activity("concurrent_kernel", 11, 2_000, 9_000, "side"),  # another stream, ends last
        Activity("memset", 12, 500, 600, ""),  # starts first
        Activity("concurrent_kernel", 20, 20_000, 21_000, "main"),
        Activity("concurrent_kernel", 30, 0, 99_999, "flush"),  # not inside any timed call
    ]
    external = {10: 100, 11: 100, 12: 100, 20: 101}
    timings = spans_by_call(activities, external, [100, 101, 102])
    assert timings.spans_ms == [pytest.approx(0.0085), pytest.approx(0.001)]
    assert timings.empty_calls == 1
    assert sorted(timings.signatures[0]) == [
        ("concurrent_kernel", "main"),
        ("concurrent_kernel", "side"),
        ("memset", ""),
    ]


def test_spans_by_call_ignores_ids_of_other_runs() -> None:
    activities = [Activity("concurrent_kernel", 1, 0, 10, "k")]
    timings = spans_by_call(activities, {1: 7}, [8])
    assert timings.spans_ms == [] and timings.empty_calls == 1


def test_count_from_budget() -> None:
    assert count_from_budget(100.0, 1.0, minimum=1) == 100
    assert count_from_budget(100.0, 3.0, minimum=1) == 34
    assert count_from_budget(100.0, 1e6, minimum=1) == 1
    assert count_from_budget(100.0, 1e-6, minimum=1) == builtins.MAX_COUNT
    assert count_from_budget(0.0, 1.0, minimum=0) == 0
    assert count_from_budget(10.0, 0.0, minimum=1) == builtins.MAX_COUNT


def test_clock_is_steady() -> None:
    assert not clock_is_steady([1980.0] * 4)
    assert clock_is_steady([345.0, 900.0, 1980.0, 1980.0, 1975.0, 1980.0, 1980.0])
    assert not clock_is_steady([345.0, 900.0, 1500.0, 1800.0, 1980.0])
    assert not clock_is_steady([0.0] * 5)


def test_throttle_reason_names() -> None:
    assert throttle_reason_names(None) is None
    assert throttle_reason_names(0) == []
    assert throttle_reason_names(0x1) == ["gpu_idle"]
    assert throttle_reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert throttle_reason_names(0x1000) == ["other_0x1000"]


def test_harmless_cuda_calls() -> None:
    assert is_harmless_cuda_call("cudaGetDeviceCount")
    assert is_harmless_cuda_call("cuCtxGetDevice_v2")
    assert not is_harmless_cuda_call("cudaMalloc")
    assert not is_harmless_cuda_call("cuMemAlloc_v2")
    assert not is_harmless_cuda_call("cuDevicePrimaryCtxRetain")


# ----------------------------------------------------------------------------- GPU access guard


def test_guard_refuses_torch_cuda_initialisation_and_restores_it() -> None:
    original = torch.cuda._lazy_init
    with GpuAccessGuard(use_cupti=False) as guard:
        with pytest.raises(ExecutionError) as caught:
            torch.cuda._lazy_init()
    assert caught.value.kind == "gpu_access"
    assert guard.violation is not None
    with pytest.raises(ExecutionError) as checked:
        guard.check()
    assert checked.value.kind == "gpu_access"
    assert torch.cuda._lazy_init is original


def test_guard_without_cuda_use_has_no_violation() -> None:
    with GpuAccessGuard(use_cupti=False) as guard:
        torch.ones(4).sum()
    assert guard.violation is None
    guard.check()


def test_guard_restores_torch_after_an_exception() -> None:
    original = torch.cuda._lazy_init
    with pytest.raises(ZeroDivisionError), GpuAccessGuard(use_cupti=False):
        _ = 1 / 0
    assert torch.cuda._lazy_init is original


def test_guard_catches_a_cuda_tensor_in_a_fresh_process() -> None:
    """In a process where CUDA is not initialised, torch's own CUDA entry points hit the guard."""
    script = textwrap.dedent(
        """
        import torch
        from kcoral.builtins import GpuAccessGuard
        from kcoral.errors import ExecutionError
        with GpuAccessGuard(use_cupti=False) as guard:
            try:
                torch.zeros(1, device="cuda")
            except ExecutionError as exc:
                print("KIND", exc.kind)
        print("VIOLATION", guard.violation is not None)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "KIND gpu_access" in done.stdout
    assert "VIOLATION True" in done.stdout


# ----------------------------------------------------------------------------- launch hold


def test_busy_ns_counts_overlaps_once_and_skips_gaps() -> None:
    assert busy_ns([]) == 0
    assert busy_ns([(0, 10)]) == 10
    assert busy_ns([(0, 10), (5, 20)]) == 20  # overlapping: one stretch
    assert busy_ns([(0, 10), (30, 35)]) == 15  # the gap between them is not busy
    assert busy_ns([(30, 35), (0, 10), (2, 4)]) == 15  # order and nesting do not matter


def test_ready_span_starts_when_the_hold_ends() -> None:
    # Call 100: the hold ends at 1_000; the kernel starts 700 ns later (the GPU taking up the launch).
    # Call 101: a side-stream kernel started during the hold, at 1_500, before the hold ended.
    activities = [
        Activity("concurrent_kernel", 10, 1_700, 5_700, "main"),
        Activity("concurrent_kernel", 20, 1_500, 9_500, "side"),
    ]
    external = {10: 100, 20: 101}
    timings = spans_by_call(activities, external, [100, 101], hold_ends={100: 1_000, 101: 2_000})
    assert timings.spans_ms == [pytest.approx(0.004), pytest.approx(0.008)]
    assert timings.ready_spans_ms == [pytest.approx(0.0047), pytest.approx(0.008)]
    assert timings.busy_ms == [pytest.approx(0.004), pytest.approx(0.008)]
    assert timings.indices == [0, 1]
    assert timings.unheld_calls == 1  # the side-stream call: its work did not wait for the hold


def test_ready_span_is_the_span_without_a_hold() -> None:
    activities = [Activity("concurrent_kernel", 10, 1_000, 2_000, "k"), Activity("memset", 11, 5_000, 5_500, "")]
    timings = spans_by_call(activities, {10: 7, 11: 7}, [7])
    assert timings.ready_spans_ms == timings.spans_ms == [pytest.approx(0.0045)]
    assert timings.busy_ms == [pytest.approx(0.0015)]  # the host gap between the two is not busy
    assert timings.late_calls == 0


def test_calls_still_launching_after_the_hold_are_late() -> None:
    activities = [
        Activity("concurrent_kernel", 10, 3_000, 4_000, "k"),
        Activity("concurrent_kernel", 20, 3_000, 4_000, "k"),
    ]
    # API records: call 7's last launch returned at 2_500, after its hold ended at 2_000.
    api_ends = {10: 2_500, 11: 1_200, 20: 1_900}
    external = {10: 7, 11: 7, 20: 8}
    timings = spans_by_call(activities, external, [7, 8], hold_ends={7: 2_000, 8: 2_000}, api_ends=api_ends)
    assert timings.late_calls == 1


def test_hold_ends_by_call_reads_the_hold_ids() -> None:
    base = 5 * EXTERNAL_ID_BLOCK
    activities = [
        Activity("concurrent_kernel", 1, 0, 900, "spin"),
        Activity("concurrent_kernel", 2, 1_000, 2_000, "user"),
    ]
    external = {1: base + builtins.HOLD_ID_OFFSET + 3, 2: base + 3}
    assert hold_ends_by_call(activities, external) == {base + 3: 900}


def test_initial_hold_us_is_bounded() -> None:
    assert initial_hold_us([]) == builtins.MIN_HOLD_US
    assert initial_hold_us([0.001]) == pytest.approx(max(builtins.MIN_HOLD_US, 3.0 + builtins.HOLD_MARGIN_US))
    assert initial_hold_us([0.1, 0.1, 0.1]) == pytest.approx(
        builtins.HOLD_LAUNCH_FACTOR * 100 + builtins.HOLD_MARGIN_US
    )
    assert initial_hold_us([1000.0]) == builtins.MAX_HOLD_US


class _Recorder:
    """Stands in for torch, the runner and the CUPTI tracer, writing down what is done in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        recorder = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.name = f"event{len(recorder.log)}"

            def record(self) -> None:
                recorder.log.append("event")

            def elapsed_time(self, other: object) -> float:
                return 0.25

        class Cuda:
            pass

        cuda = Cuda()
        cuda.Event = Event  # type: ignore[attr-defined]

        class Torch:
            pass

        self.torch = Torch()
        self.torch.cuda = cuda  # type: ignore[attr-defined]

    # runner
    def flush(self) -> None:
        self.log.append("flush")

    def synchronize(self) -> None:
        self.log.append("sync")

    def hold(self, cycles: int) -> None:
        self.log.append(f"hold({cycles})")

    def call(self) -> None:
        self.log.append("call")

    # tracer
    def enable(self, *, correlation: bool) -> None:
        self.log.append("enable")

    def disable(self) -> None:
        self.log.append("disable")

    def push(self, external_id: int) -> None:
        self.log.append(f"push({external_id})")

    def pop(self) -> None:
        self.log.append("pop")


def test_each_call_is_launched_behind_its_hold_inside_its_own_bracket() -> None:
    recorder = _Recorder()
    times = timed_calls(recorder, 2, hold_cycles=500, tracer=recorder, base=1000)  # type: ignore[arg-type]
    assert times == [0.25, 0.25]
    hold_id = 1000 + builtins.HOLD_ID_OFFSET
    one_call = [
        "flush",
        "sync",
        f"push({hold_id})",
        "hold(500)",
        "pop",
        "event",
        "push(1000)",
        "call",
        "pop",
        "event",
        "sync",
    ]
    second = [step.replace(str(hold_id), str(hold_id + 1)).replace("push(1000)", "push(1001)") for step in one_call]
    assert recorder.log == ["sync", "enable", *one_call, *second, "disable"]


def test_without_a_tracer_the_calls_are_bracketed_by_events_only() -> None:
    recorder = _Recorder()
    timed_calls(recorder, 1, hold_cycles=0)  # type: ignore[arg-type]
    assert recorder.log == ["sync", "flush", "sync", "hold(0)", "event", "call", "event", "sync"]
