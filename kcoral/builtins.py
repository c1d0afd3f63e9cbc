"""Helpers for uploaded code: GPU timing (``benchmark``) and the CPU-only guard (``GpuAccessGuard``).

Uploaded code imports this module (``from kcoral.builtins import benchmark``), so its top level
imports nothing heavy: torch, cupti-python and pynvml are imported inside the functions that need
them, here and in the modules this one draws on.

This module is the public face: ``benchmark``, its config (``BenchmarkConfig``, ``split_config``)
and the steps it takes. How a call is timed, and why, is told in ``kcoral.timing``, which holds the
machinery (CUPTI tracing, NVML, the runner and timers, the statistics); ``GpuAccessGuard`` lives in
``kcoral.gpu_guard``. The helpers tests and tools use are re-exported here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.gpu_guard import GpuAccessGuard, gpu_access_guard
from kcoral.gpu_guard import is_harmless_cuda_call as is_harmless_cuda_call
from kcoral.timing.cupti import HOLD_ID_OFFSET as HOLD_ID_OFFSET
from kcoral.timing.cupti import Activity as Activity
from kcoral.timing.cupti import CuptiTracer, CuptiUnavailable
from kcoral.timing.cupti import busy_ns as busy_ns
from kcoral.timing.cupti import hold_ends_by_call as hold_ends_by_call
from kcoral.timing.cupti import spans_by_call as spans_by_call
from kcoral.timing.nvml import (
    CLOCK_SAMPLE_INTERVAL_S,
    SLOWDOWN_MASK,
    Nvml,
    clock_is_steady,
    clock_state,
    throttle_reason_names,
)
from kcoral.timing.stats import MAX_COUNT, count_from_budget, summarize
from kcoral.timing.stats import activities_stable as activities_stable
from kcoral.timing.timers import HOLD_LAUNCH_FACTOR as HOLD_LAUNCH_FACTOR
from kcoral.timing.timers import HOLD_MARGIN_US as HOLD_MARGIN_US
from kcoral.timing.timers import MAX_HOLD_US as MAX_HOLD_US
from kcoral.timing.timers import MIN_HOLD_US as MIN_HOLD_US
from kcoral.timing.timers import CuptiTimer, EventTimer, Runner, initial_hold_us

__all__ = ["CONFIG_KEYS", "BenchmarkConfig", "GpuAccessGuard", "benchmark", "gpu_access_guard"]

# Limits: a single benchmark() stays bounded even with careless configs (counts: MAX_COUNT).
MAX_BUDGET_MS: Final = 10_000.0
MAX_CLOCK_WARMUP_MS: Final = 10_000.0

DEFAULT_WARMUP_MS: Final = 25.0
DEFAULT_REPEAT_MS: Final = 100.0
DEFAULT_CLOCK_WARMUP_MS: Final = 1_000.0

# Calls run to estimate one iteration's wall time when no clock warm-up ran.
ESTIMATE_CALLS: Final = 5

METHODS: Final = frozenset({"auto", "cupti", "cuda_event"})
CONFIG_KEYS: Final = frozenset(
    {"warmup_ms", "repeat_ms", "warmup", "repeat", "flush_l2", "launch_hold", "clock_warmup_ms", "method"}
)


@dataclass(frozen=True)
class BenchmarkConfig:
    """Settings of one ``benchmark`` run; build it with ``BenchmarkConfig.from_mapping``."""

    warmup_ms: float = DEFAULT_WARMUP_MS
    repeat_ms: float = DEFAULT_REPEAT_MS
    warmup: int | None = None
    repeat: int | None = None
    flush_l2: bool = True
    launch_hold: bool = True
    clock_warmup_ms: float = DEFAULT_CLOCK_WARMUP_MS
    method: str = "auto"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BenchmarkConfig:
        """Validate a user's config dict; any problem raises ``ExecutionError("parse", ...)``."""
        if not isinstance(values, Mapping):
            raise ExecutionError("parse", f"benchmark config must be a dict, not {type(values).__name__}")
        unknown = sorted(str(key) for key in values if key not in CONFIG_KEYS)
        if unknown:
            raise ExecutionError(
                "parse",
                f"unknown benchmark config key(s) {unknown}; known keys: {sorted(CONFIG_KEYS)}",
            )
        method = values.get("method", "auto")
        if method not in METHODS:
            raise ExecutionError("parse", f"benchmark method must be one of {sorted(METHODS)}, not {method!r}")
        flags = {key: values.get(key, True) for key in ("flush_l2", "launch_hold")}
        for key, flag in flags.items():
            if not isinstance(flag, bool):
                raise ExecutionError("parse", f"{key} must be true or false, not {flag!r}")
        return cls(
            warmup_ms=_budget(values, "warmup_ms", DEFAULT_WARMUP_MS, MAX_BUDGET_MS),
            repeat_ms=_budget(values, "repeat_ms", DEFAULT_REPEAT_MS, MAX_BUDGET_MS),
            warmup=_count(values, "warmup", minimum=0),
            repeat=_count(values, "repeat", minimum=1),
            flush_l2=flags["flush_l2"],
            launch_hold=flags["launch_hold"],
            clock_warmup_ms=_budget(values, "clock_warmup_ms", DEFAULT_CLOCK_WARMUP_MS, MAX_CLOCK_WARMUP_MS),
            method=method,
        )


def _budget(values: Mapping[str, Any], key: str, default: float, cap: float) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ExecutionError("parse", f"{key} must be a non-negative number of milliseconds, not {value!r}")
    return min(float(value), cap)


def _count(values: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ExecutionError("parse", f"{key} must be an integer >= {minimum}, not {value!r}")
    return min(value, MAX_COUNT)


def split_config(args: Sequence[Any], config: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], BenchmarkConfig]:
    """Separate the call's arguments from the benchmark config.

    The config is ``config=`` when given; otherwise a trailing non-empty dict whose keys are all
    config keys. A trailing dict that mixes config keys with other keys is taken for a mistyped
    config (a parse error) rather than silently passed on to the function.
    """
    call_args = tuple(args)
    if config is not None:
        return call_args, BenchmarkConfig.from_mapping(config)
    if call_args and isinstance(call_args[-1], dict) and call_args[-1]:
        last: dict[Any, Any] = call_args[-1]
        known = [key for key in last if key in CONFIG_KEYS]
        if len(known) == len(last):
            return call_args[:-1], BenchmarkConfig.from_mapping(last)
        if known:
            BenchmarkConfig.from_mapping(last)  # raises the parse error naming the unknown keys
    return call_args, BenchmarkConfig()


# ----------------------------------------------------------------------------- benchmark


def _import_torch_with_gpu() -> Any:
    try:
        import torch
    except Exception as exc:
        raise ExecutionError(
            "unavailable", f"benchmark needs PyTorch with CUDA; torch is not importable: {exc}"
        ) from exc
    if not torch.cuda.is_available():
        raise ExecutionError(
            "unavailable",
            "benchmark needs a CUDA GPU, and torch.cuda.is_available() is False on this host "
            "(no GPU assigned to this program, or a CPU-only torch build)",
        )
    return torch


def _warm_clock(
    runner: Runner, nvml: Nvml | None, budget_ms: float, launch_ms: list[float]
) -> tuple[bool | None, float, list[float]]:
    """Run the call until the SM clock is steady or the budget is spent.

    Returns (steady, milliseconds spent, wall time of each iteration in ms); steady is None when
    NVML cannot read the clock or the budget is zero. Each call's host launch time is appended to
    ``launch_ms``.
    """
    if nvml is None or budget_ms <= 0 or nvml.sm_clock_mhz() is None:
        return None, 0.0, []
    began = time.perf_counter()
    deadline = began + budget_ms / 1e3
    next_sample = began
    samples: list[float] = []
    iterations: list[float] = []
    steady = False
    while True:
        tick = time.perf_counter()
        launch_ms.append(runner.iteration())
        now = time.perf_counter()
        iterations.append((now - tick) * 1e3)
        if now >= next_sample:
            clock = nvml.sm_clock_mhz()
            if clock is not None:
                samples.append(float(clock))
            next_sample = now + CLOCK_SAMPLE_INTERVAL_S
            if clock_is_steady(samples):
                steady = True
                break
        if now >= deadline:
            break
    return steady, (time.perf_counter() - began) * 1e3, iterations


def _choose_timer(method: str) -> tuple[CuptiTimer | EventTimer, str | None]:
    if method == "cuda_event":
        return EventTimer(), None
    try:
        return CuptiTimer(CuptiTracer.get()), None
    except CuptiUnavailable as exc:
        if method == "cupti":
            raise ExecutionError("unavailable", f"CUPTI timing was requested but is unavailable: {exc}") from exc
        return EventTimer(), str(exc)


def benchmark(fn: Callable[..., Any], *args: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Time ``fn(*args)`` on the GPU and return latency statistics in milliseconds.

    Each counted call is timed from CUPTI activity records of every kernel, memcpy and memset it
    launches, on any stream: from the first activity's start to the last one's end. Before each
    call the L2 cache is flushed and the device synchronised; then, unless the call runs work on
    another stream, a short GPU spin holds the current stream while the host launches the call
    behind it, so host launch gaps between the call's kernels stay out of the time (as they do in
    Nsight Compute). Before counting, the call runs until the SM clock is steady (at most
    ``clock_warmup_ms``), then for the warm-up budget.

    Config keys (``config={...}`` or a trailing dict argument): ``warmup_ms`` (25), ``repeat_ms``
    (100), ``warmup`` and ``repeat`` (counts; they override the budgets), ``flush_l2`` (True),
    ``launch_hold`` (True; False times from the first activity's start after a host
    synchronisation, host launch gaps included), ``clock_warmup_ms`` (1000; 0 skips the clock
    warm-up), ``method`` (``"auto"``, ``"cupti"`` or ``"cuda_event"``). Counts are capped at 10000
    and budgets at 10 s.

    The result holds ``latency_ms_median``/``_mean``/``_min``/``_max``/``_std``, ``warmup`` and
    ``repeat`` (counts used), ``flush_l2``, ``activities_stable`` (False when calls launched
    different activities; always True with CUDA events, which cannot tell), ``method``
    (``"cupti"`` or ``"cuda_event"``), ``latency_ms_median_by`` (the median by each way of
    measuring: ``span``, the one reported; ``ready_span``, from the end of the hold; ``busy``, the
    time any activity ran; ``cuda_event``), ``launch_hold`` (on, or off and why), ``launch_hold_us``,
    ``launch_late_calls``, ``sm_clock_mhz_before``/``_after``, ``throttle_reasons_before``/``_after``,
    ``throttled`` (None where NVML is missing) and ``gpu``.

    Raises ``ExecutionError("parse")`` for a bad config and ``ExecutionError("unavailable")`` when
    there is no GPU or the call launches no GPU work.

    Example::

        import torch
        from kcoral.builtins import benchmark

        a = torch.randn(1 << 24, device="cuda")
        b = torch.randn_like(a)
        out = torch.empty_like(a)
        result = benchmark(lambda x, y: torch.add(x, y, out=out), a, b, {"repeat": 200})
        print(result["latency_ms_median"], result["method"])   # e.g. 0.0437 cupti
    """
    call_args, settings = split_config(args, config)
    torch = _import_torch_with_gpu()
    device = torch.cuda.current_device()
    timer, cupti_error = _choose_timer(settings.method)
    runner = Runner(torch, fn, call_args, settings.flush_l2)
    nvml = Nvml.open(torch, device)

    # The first call pays one-off costs (compilation, autotuning, handles); keep it out of the probe.
    launch_ms = [runner.iteration()]
    if isinstance(timer, CuptiTimer):
        try:
            timer.probe(runner)
        except ExecutionError:
            raise
        except Exception as exc:
            if settings.method == "cupti" or _is_user_error(exc):
                raise
            # CUPTI loaded but refused to trace (e.g. another profiler owns it): fall back.
            cupti_error = f"CUPTI tracing failed: {exc!r}"
            timer = EventTimer()

    clock_steady, clock_warmup_ms, iteration_ms = _warm_clock(runner, nvml, settings.clock_warmup_ms, launch_ms)
    if len(iteration_ms) < ESTIMATE_CALLS:
        for _ in range(ESTIMATE_CALLS - len(iteration_ms)):
            tick = time.perf_counter()
            launch_ms.append(runner.iteration())
            iteration_ms.append((time.perf_counter() - tick) * 1e3)

    hold_us = 0.0
    hold_state = "off: launch_hold is false"
    cycles_per_us = runner.spin_cycles_per_us() if settings.launch_hold else None
    if cycles_per_us:
        hold_us, hold_state = timer.fit_hold(runner, initial_hold_us(launch_ms[1:] or launch_ms), cycles_per_us)
    elif settings.launch_hold:
        hold_state = "off: torch has no spin kernel (torch.cuda._sleep)"
    hold_cycles = int(hold_us * cycles_per_us) if cycles_per_us else 0

    # The median of the latest iterations: early ones can still include clock ramp-up.
    per_call_ms = float(statistics.median(iteration_ms[-max(ESTIMATE_CALLS, len(iteration_ms) // 2) :]))
    per_call_ms += hold_us / 1e3
    warmup = (
        settings.warmup
        if settings.warmup is not None
        else count_from_budget(settings.warmup_ms, per_call_ms, minimum=1)
    )
    repeat = (
        settings.repeat
        if settings.repeat is not None
        else count_from_budget(settings.repeat_ms, per_call_ms, minimum=1)
    )
    for _ in range(warmup):
        runner.iteration()

    before = clock_state(nvml)
    measurement, after = timer.measure(runner, repeat, hold_cycles, nvml)

    result: dict[str, Any] = summarize(measurement.samples_ms)
    reasons_after = after["reasons"]
    result.update(
        {
            "warmup": warmup,
            "repeat": repeat,
            "samples": len(measurement.samples_ms),
            "empty_calls": measurement.empty_calls,
            "flush_l2": settings.flush_l2,
            "activities_stable": measurement.stable,
            "activities_per_call": measurement.activities_per_call,
            "method": timer.method,
            "cupti_error": cupti_error,
            "latency_ms_median_by": measurement.by_estimate,
            "launch_hold": hold_state,
            "launch_hold_us": round(hold_us, 1) if hold_cycles else 0.0,
            "launch_late_calls": measurement.late_calls,
            "clock_steady": clock_steady,
            "clock_warmup_ms": round(clock_warmup_ms, 3),
            "sm_clock_mhz_before": before["sm_clock_mhz"],
            "sm_clock_mhz_after": after["sm_clock_mhz"],
            "throttle_reasons_before": throttle_reason_names(before["reasons"]),
            "throttle_reasons_after": throttle_reason_names(reasons_after),
            "throttled": None if reasons_after is None else bool(reasons_after & SLOWDOWN_MASK),
            "gpu": str(torch.cuda.get_device_name(device)),
            "device_index": int(device),
        }
    )
    return result


def _is_user_error(exc: BaseException) -> bool:
    """True when the exception came from the user's function rather than from CUPTI."""
    module = type(exc).__module__ or ""
    return not module.startswith("cupti")
