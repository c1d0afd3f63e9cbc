"""CPU tests of kcoral.builtins: config parsing, the pure timing helpers, and behaviour without a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kcoral.builtins import BenchmarkConfig, GpuAccessGuard, benchmark
from kcoral.errors import ExecutionError
from kcoral.gpu_guard import is_harmless_cuda_call
from kcoral.timing import config as timing_config
from kcoral.timing import stats, timers
from kcoral.timing.config import split_config
from kcoral.timing.cupti import busy_ns
from kcoral.timing.nvml import clock_is_steady, throttle_reason_names
from kcoral.timing.stats import activities_stable, count_from_budget, summarize
from kcoral.timing.timers import initial_hold_us

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
    assert config.repeat == stats.MAX_COUNT
    assert config.warmup == stats.MAX_COUNT
    assert config.repeat_ms == timing_config.MAX_BUDGET_MS
    assert config.warmup_ms == timing_config.MAX_BUDGET_MS


def test_explicit_zero_warmup_is_allowed() -> None:
    assert BenchmarkConfig.from_mapping({"warmup": 0}).warmup == 0


def test_defences_are_on_by_default_and_can_be_turned_off_to_measure_their_cost() -> None:
    assert BenchmarkConfig().defences is True
    assert BenchmarkConfig.from_mapping({"defences": False}).defences is False
    with pytest.raises(ExecutionError) as caught:
        BenchmarkConfig.from_mapping({"defences": "no"})
    assert caught.value.kind == "parse"


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


def test_median_of_samples_on_a_coarse_clock_is_interpolated_within_its_step() -> None:
    # A 256K add on the H200: CUPTI's timestamps move in 32 ns steps, 40% of calls read 1.856 us
    # and 60% 1.888; the plain median would be 1.888 here and 1.856 with the shares swapped.
    samples = [0.001856] * 40 + [0.001888] * 60
    stats = summarize(samples)
    assert stats["clock_resolution_ns"] == 32
    assert stats["latency_ms_median"] == pytest.approx(0.001872 + 0.000032 * (50 - 40) / 60)
    swapped = summarize([0.001856] * 60 + [0.001888] * 40)["latency_ms_median"]
    median = stats["latency_ms_median"]
    assert swapped is not None and median is not None
    assert 0.001856 < swapped < median < 0.001888
    # A few samples off the grid (seen on the H200 through the service) do not hide it.
    strays = summarize([0.001856] * 40 + [0.001888] * 55 + [0.001871, 0.001903, 0.001899])
    assert strays["clock_resolution_ns"] == 32
    strays_median = strays["latency_ms_median"]
    assert strays_median is not None and 0.001872 < strays_median < 0.001888


def test_median_of_samples_on_a_fine_clock_is_the_plain_median() -> None:
    events = [0.047552000731, 0.047520000331, 0.047616001218]  # CUDA events: not whole nanoseconds
    assert summarize(events)["clock_resolution_ns"] is None
    assert summarize(events)["latency_ms_median"] == 0.047552000731
    long_kernel = [0.043616, 0.043648, 0.043584] * 3  # 32 ns steps, but 0.07% of the median: left alone
    assert summarize(long_kernel)["latency_ms_median"] == 0.043616
    one_value = [0.001984] * 9 + [0.001990]  # one value on a grid says nothing of its step
    assert summarize(one_value)["clock_resolution_ns"] is None
    assert summarize(one_value)["latency_ms_median"] == 0.001984


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


def test_count_from_budget() -> None:
    assert count_from_budget(100.0, 1.0, minimum=1) == 100
    assert count_from_budget(100.0, 3.0, minimum=1) == 34
    assert count_from_budget(100.0, 1e6, minimum=1) == 1
    assert count_from_budget(100.0, 1e-6, minimum=1) == stats.MAX_COUNT
    assert count_from_budget(0.0, 1.0, minimum=0) == 0
    assert count_from_budget(10.0, 0.0, minimum=1) == stats.MAX_COUNT


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


def test_initial_hold_us_is_bounded() -> None:
    assert initial_hold_us([]) == timers.MIN_HOLD_US
    assert initial_hold_us([0.001]) == pytest.approx(max(timers.MIN_HOLD_US, 3.0 + timers.HOLD_MARGIN_US))
    assert initial_hold_us([0.1, 0.1, 0.1]) == pytest.approx(timers.HOLD_LAUNCH_FACTOR * 100 + timers.HOLD_MARGIN_US)
    assert initial_hold_us([1000.0]) == timers.MAX_HOLD_US
