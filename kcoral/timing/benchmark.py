"""``benchmark``: time a callable on the GPU, with the defences that keep its numbers honest.

The steps, and which module holds each: the config (``timing.config``); the trusted state armed
before uploaded code ran (``timing.trust``); the inputs of each call and the sample of outputs
checked (``timing.inputs``); what runs before the counted calls (``timing.calibrate``); the runner
and the timed loop (``timing.calls``); the two timers (``timing.timers``);
attribution of GPU work to calls by time window (``timing.windows``); the clock (``timing.nvml``);
the ``integrity`` section (``timing.findings``). ``kcoral.builtins`` re-exports ``benchmark``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.calibrate import (
    Calibration,
    DefenceTime,
    calibrate,
    fail_on_changes,
    start,
    wait_for_cool_gpu,
    warm_up,
)
from kcoral.timing.calls import CountedCalls, check_kept
from kcoral.timing.conditions import CoolWait, gpu_conditions
from kcoral.timing.config import BenchmarkConfig, split_config
from kcoral.timing.findings import EnvironmentWatch, host_gap_reason, verdict
from kcoral.timing.inputs import (
    MODE_ROTATED,
    MODE_SAME,
    OUTPUTS_KEPT,
    InputFactory,
    InputPlan,
    KeptOutput,
    OutputCheck,
    OutputReservoir,
    keep_outputs_always,
    plan_inputs,
)
from kcoral.timing.nvml import SLOWDOWN_MASK, Nvml, clock_state, throttle_reason_names
from kcoral.timing.stats import count_from_budget, summarize
from kcoral.timing.timers import UNHELD_MEASURE, CuptiTimer, EventTimer, Measurement
from kcoral.timing.trust import ArmedState, QuietInterpreter, armed, ask_again, describe_changes

__all__ = ["DefenceTime", "benchmark", "measure"]

DEFENCES_OFF_REASON: Final = "the integrity defences were turned off (config defences=False)"


@dataclass
class BenchmarkRun:
    """A benchmark's report and, for a harness that checks them itself, the kept outputs."""

    report: dict[str, Any]
    kept: list[KeptOutput] = field(default_factory=list)


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    config: Mapping[str, Any] | None = None,
    inputs: InputFactory | None = None,
    check: OutputCheck | None = None,
) -> dict[str, Any]:
    """Time ``fn`` on the GPU and return latency statistics in milliseconds.

    Each counted call runs between two device-wide synchronisations; its latency is the span from
    the first start to the last end of every kernel, memcpy and memset the process ran in that
    window (CUPTI activity records), whatever thread or stream launched it, so work still running
    when the call returned is counted. Before each call the L2 cache is flushed; then, unless the call
    runs work on another stream, a short GPU spin holds the current stream while the host launches
    the call behind it, so host launch gaps stay out of the time (as in Nsight Compute). Before
    counting, the call runs until the SM clock is steady (at most ``clock_warmup_ms``), then for the
    warm-up budget.

    Inputs: ``fn(*args)`` gets *rotated clones* of its CUDA tensor arguments (copies at other
    addresses, floating-point ones scaled a little differently each, taken in turn, so an output
    cached on the inputs' addresses is not reused), and the output of each of a random sample of
    timed calls must equal what ``fn`` returns for the same inputs when called again, untimed
    (unless ``fn`` writes its inputs). ``inputs=``, a
    callable ``index -> tuple of arguments``, gives every call fresh inputs instead (defeating any
    cache), and ``check=``, a callable ``(output, inputs) -> None`` that raises (or returns False)
    for a wrong output, checks the sample. A failed check raises ``ExecutionError("correctness")``.
    With neither arguments nor ``inputs`` (a closure, as in the seed example) every call is the same.

    Config keys (``config={...}`` or a trailing dict argument): ``warmup_ms`` (25), ``repeat_ms``
    (100), ``warmup`` and ``repeat`` (counts; they override the budgets), ``flush_l2`` (True),
    ``launch_hold`` (True), ``clock_warmup_ms`` (1000; 0 skips the clock warm-up), ``method``
    (``"auto"``, ``"cupti"`` or ``"cuda_event"``), ``defences`` (True; False only to measure their
    cost), ``wait_cool_ms`` (0; up to this long, wait for a GPU at most ``cool_temp_c``, 50, and
    at most ``idle_util_pct``, 5, busy before measuring). Counts are capped at 10000 and budgets at 10 s.

    The result holds ``latency_ms_median``/``_mean``/``_min``/``_max``/``_std`` (GPU time),
    ``host_ms_median``/``_min``/``_max`` (synchronised host wall time per call), ``warmup`` and
    ``repeat``, ``flush_l2``, ``activities_stable``, ``method`` (``"cupti"`` or ``"cuda_event"``)
    and ``cupti_error`` (why CUPTI is not used), ``inputs`` (how calls got their inputs),
    ``outputs_checked``, ``latency_measure`` (``span``: first start to last end; ``busy``, the time
    any activity ran, for calls with work on another stream, which no hold holds),
    ``latency_ms_median_by`` (``span``, ``ready_span``, ``busy``, ``cuda_event``), ``launch_hold``,
    ``launch_hold_us``, ``launch_late_calls``, the SM clock and throttle reasons before and after,
    ``conditions_before``/``conditions_after`` (temperature, clocks, power, utilisation) and
    ``cool_wait``, ``gpu``, and ``integrity``: ``verdict`` (``"ok"`` or ``"suspect"``) and ``reasons`` (see
    ``kcoral.timing.findings``).

    Raises ``ExecutionError``: ``parse`` for a bad config, ``unavailable`` when there is no GPU or
    the call launches no GPU work, ``correctness`` when a checked output is wrong, ``integrity``
    when the timer's own state was changed around the measurement or CUPTI, which worked when the
    worker started, failed.

    Example::

        import torch
        from kcoral.builtins import benchmark

        a = torch.randn(1 << 24, device="cuda")
        b = torch.randn_like(a)
        result = benchmark(torch.add, a, b, config={"repeat": 200})
        print(result["latency_ms_median"], result["method"], result["integrity"]["verdict"])
    """
    return measure(fn, *args, config=config, inputs=inputs, check=check).report


def measure(
    fn: Callable[..., Any],
    *args: Any,
    config: Mapping[str, Any] | None = None,
    inputs: InputFactory | None = None,
    check: OutputCheck | None = None,
    keep_outputs: int = OUTPUTS_KEPT,
) -> BenchmarkRun:
    """``benchmark``, returning the kept outputs beside the report (for a harness in another process)."""
    call_args, settings = split_config(args, config)
    defences = settings.defences
    begun = start(settings.method, defences=defences)
    torch, spent = begun.torch, begun.spent
    if defences:
        with spent.step("inputs"):
            plan = plan_inputs(torch, call_args, inputs)
    else:
        plan = InputPlan(MODE_SAME, [call_args], inputs)
    kept_check = check if defences else None
    setup = _Setup(torch, begun.state, settings, begun.timers[0], plan, kept_check, keep_outputs, spent)
    with begun.measuring():
        run = _run(fn, setup)
    begun.finish(run.report)
    if not defences:
        run.report["integrity"] = verdict([DEFENCES_OFF_REASON, *run.report["integrity"]["reasons"]])
    return run


@dataclass(frozen=True)
class _Setup:
    """What a measurement was set up with, before its calibration."""

    torch: Any
    state: ArmedState
    settings: BenchmarkConfig
    timer: CuptiTimer | EventTimer
    plan: InputPlan
    check: OutputCheck | None  # None also where the defences are off
    keep_outputs: int
    spent: DefenceTime


def _run(fn: Callable[..., Any], setup: _Setup) -> BenchmarkRun:
    """Calibrate (:mod:`kcoral.timing.calibrate`), measure the counted calls, report."""
    torch, state, settings, timer, plan = setup.torch, setup.state, setup.settings, setup.timer, setup.plan
    device = torch.cuda.current_device()
    nvml = Nvml.open(torch, device)
    cool = wait_for_cool_gpu(nvml, settings, state.trusted)
    conditions_before = gpu_conditions(nvml)
    ready = calibrate(state.trusted, torch, fn, plan, timer, nvml, settings, setup.spent)
    warmup = warm_up(ready, settings)
    repeat = (
        settings.repeat
        if settings.repeat is not None
        else count_from_budget(settings.repeat_ms, ready.per_call_ms, minimum=1)
    )
    counted = _measure(setup, ready, nvml, repeat)
    report = _report(
        setup,
        device,
        nvml,
        ready,
        counted,
        warmup=warmup,
        repeat=repeat,
        cool=cool,
        conditions_before=conditions_before,
    )
    return BenchmarkRun(report, counted.measurement.kept)


@dataclass
class _Counted:
    """The counted calls: their measurement, the clock around them, what the defences found."""

    measurement: Measurement
    before: dict[str, Any]  # clock_state before the counted calls
    after: dict[str, Any]  # and after
    reasons: list[str]
    outputs_checked: int
    watch_details: dict[str, Any]


def _measure(setup: _Setup, ready: Calibration, nvml: Nvml | None, repeat: int) -> _Counted:
    """The counted calls, watched by the defences (unless ``defences=False``): the trusted state,
    the environment, the kept outputs checked again afterwards."""
    torch, state, settings, timer, plan = setup.torch, setup.state, setup.settings, setup.timer, setup.plan
    check, keep_outputs, spent = setup.check, setup.keep_outputs, setup.spent
    trusted = state.trusted
    defences = settings.defences
    runner = ready.runner
    check_again = defences and plan.mode == MODE_ROTATED and check is None and not ready.writes_inputs
    checking = defences and (check is not None or check_again or keep_outputs_always(plan))
    reservoir = OutputReservoir(keep_outputs if checking else 0, trusted.randbelow)
    before = clock_state(nvml)
    watch = None
    if defences:
        with spent.step("environment"):
            now_us = int(time.time() * 1e6)
            watch = EnvironmentWatch.start(
                nvml, trusted.enumerate_threads, state.threads_at_arm, now_us, state.known_pids, ask_again(state)
            )
    kept = reservoir if defences else None
    counted = CountedCalls(runner, repeat, ready.hold_cycles, ready.hold_ns, ready.unheld, kept)
    if defences:
        with QuietInterpreter(trusted):
            measurement, after = timer.measure(counted, nvml)
    else:
        measurement, after = timer.measure(counted, nvml)
    reasons = list(measurement.reasons)
    spent.add("outputs", reservoir.snapshot_ms)
    if watch is not None:
        with spent.step("environment"):
            reasons.extend(watch.finish())
    if defences:
        with spent.step("trusted_state"):
            fail_on_changes(state, "during the measurement")
            flush_changed = runner.flush_state() != runner.flush_shape
        if flush_changed:
            raise ExecutionError("integrity", "the timer's L2 flush buffer was changed during the measurement")
        if measurement.tampering:
            raise ExecutionError("integrity", describe_changes(measurement.tampering))
    outputs_checked = 0
    if defences and (check is not None or check_again):
        with spent.step("outputs"):
            outputs_checked = check_kept(torch, trusted, runner, measurement.kept, check)
        # The checks above called the user's function again: whatever it changed then is seen now,
        # before anything of the report is made (from here on no user code runs).
        with spent.step("trusted_state"):
            fail_on_changes(state, "while the outputs were checked")
    details = watch.details if watch is not None else {}
    return _Counted(measurement, before, after, reasons, outputs_checked, details)


def _report(
    setup: _Setup,
    device: Any,
    nvml: Nvml | None,
    ready: Calibration,
    counted: _Counted,
    *,
    warmup: int,
    repeat: int,
    cool: CoolWait,
    conditions_before: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report of the counted calls (the keys of ``benchmark``'s docstring)."""
    settings, timer, plan = setup.settings, setup.timer, setup.plan
    measurement, before, after = counted.measurement, counted.before, counted.after
    reasons = list(counted.reasons)
    hold_cycles, unheld = ready.hold_cycles, ready.unheld
    result: dict[str, Any] = summarize(measurement.samples_ms)
    host = _host_summary(measurement)
    gap = host_gap_reason(result["latency_ms_median"], host["host_ms_median"])
    if gap is not None:
        reasons.append(gap)
    reasons_after = after["reasons"]
    result.update(host)
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
            "latency_ms_median_by": measurement.by_estimate,
            "latency_measure": UNHELD_MEASURE if unheld and isinstance(timer, CuptiTimer) else "span",
            "launch_hold": ready.hold_state,
            "launch_hold_us": round(ready.hold_us, 1) if hold_cycles else 0.0,
            "launch_late_calls": measurement.late_calls,
            "clock_steady": ready.clock_steady,
            "clock_warmup_ms": round(ready.clock_warmup_ms, 3),
            "sm_clock_mhz_before": before["sm_clock_mhz"],
            "sm_clock_mhz_after": after["sm_clock_mhz"],
            "throttle_reasons_before": throttle_reason_names(before["reasons"]),
            "throttle_reasons_after": throttle_reason_names(reasons_after),
            "throttled": None if reasons_after is None else bool(reasons_after & SLOWDOWN_MASK),
            "conditions_before": conditions_before,
            "conditions_after": gpu_conditions(nvml),
            "cool_wait": cool.describe(),
            "gpu": _device_name(device),
            "device_index": int(device) if isinstance(device, int) else None,
            "inputs": {**plan.describe(), "first_timed_index": measurement.first_input_index},
            "outputs_checked": counted.outputs_checked,
            "integrity": verdict(reasons),
            "integrity_details": {**measurement.details, **counted.watch_details},
        }
    )
    return result


def _device_name(device: Any) -> str | None:
    """The GPU's name through the reference taken at arm: the report is made after the last check,
    so nothing it calls is looked up then."""
    name = armed().trusted.device_name
    return str(name(device)) if name is not None else None


def _host_summary(measurement: Measurement) -> dict[str, float | None]:
    host = measurement.host_ms
    if not host:
        return {"host_ms_median": None, "host_ms_min": None, "host_ms_max": None}
    return {
        "host_ms_median": float(statistics.median(host)),
        "host_ms_min": float(min(host)),
        "host_ms_max": float(max(host)),
    }
