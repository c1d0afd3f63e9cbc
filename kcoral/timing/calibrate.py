"""What runs before the counted calls of ``benchmark`` and ``compare``: the start both share
(:func:`start`: the trusted state checked, the timers chosen; :class:`Start` also turns a CUPTI
failure while measuring into an integrity failure and stamps the report's times), the wait for a
cool GPU where asked, then, per callable, the first call, the probe, the clock warm-up, the
launch-hold fit, the per-call estimate and the warm-up (the package docstring says why each).

Both measurements start here, so a defence added to these steps holds for both.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kcoral.errors import ExecutionError
from kcoral.timing.calls import Runner
from kcoral.timing.conditions import CoolWait, wait_cool_idle
from kcoral.timing.config import ESTIMATE_CALLS, BenchmarkConfig
from kcoral.timing.cupti import CuptiUnavailable
from kcoral.timing.inputs import MODE_ROTATED, InputPlan, versions
from kcoral.timing.nvml import CLOCK_SAMPLE_INTERVAL_S, Nvml, clock_is_steady
from kcoral.timing.stats import count_from_budget
from kcoral.timing.timers import UNHELD_STATE, CuptiTimer, EventTimer, initial_hold_us
from kcoral.timing.trust import ArmedState, Trusted, armed, describe_changes, ensure_tracer, verify


@dataclass
class DefenceTime:
    """The wall time benchmark() spends in its defences, by step, on the trusted clock.

    Reported in ``integrity_details["defences_ms"]`` beside the report's ``wall_ms``: what the
    defences cost each measurement, timed where it is spent. Timing benchmark() with the defences
    on and off instead measured noise: its wall time moves by 30% from one call to the next on the
    H200 (the clock warm-up and the hold fit adapt), ten times what the defences take.
    """

    clock: Callable[[], float]
    steps_ms: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = self.clock()
        try:
            yield
        finally:
            self.add(name, (self.clock() - began) * 1e3)

    def add(self, name: str, ms: float) -> None:
        self.steps_ms[name] = self.steps_ms.get(name, 0.0) + ms

    def report(self) -> dict[str, float]:
        return {"total": round(sum(self.steps_ms.values()), 3), **{k: round(v, 3) for k, v in self.steps_ms.items()}}


def import_torch_with_gpu(state: ArmedState) -> Any:
    torch = state.trusted.torch
    if torch is None:
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
    if state.trusted.synchronize is None:
        raise ExecutionError("unavailable", "torch was not imported when the timer was armed")
    return torch


def choose_timer(method: str, state: ArmedState) -> tuple[CuptiTimer | EventTimer, str | None]:
    """CUPTI wherever it worked at arm; CUDA events only where it never did, or when asked."""
    if method == "cuda_event":
        return EventTimer(), None
    try:
        tracer = ensure_tracer(state)
    except CuptiUnavailable as exc:
        raise ExecutionError("integrity", f"CUPTI imported when the worker started but fails now: {exc}") from exc
    if tracer is None:
        if method == "cupti":
            raise ExecutionError("unavailable", f"CUPTI timing was requested but is unavailable: {state.cupti_error}")
        return EventTimer(), state.cupti_error
    return CuptiTimer(tracer), None


def check_subscriber(state: ArmedState, timer: CuptiTimer | EventTimer) -> None:
    """A CUPTI callback subscription held by anyone but the timer fails the measurement."""
    if isinstance(timer, CuptiTimer) and state.tracer is not None:
        subscriber = state.tracer.foreign_subscriber()
        if subscriber is not None:
            raise ExecutionError(
                "integrity", f"a CUPTI callback subscription is held by someone other than the timer: {subscriber}"
            )


def is_cupti_failure(exc: BaseException) -> bool:
    """True when the exception came from CUPTI rather than from the user's function."""
    module = type(exc).__module__ or ""
    return module.startswith("cupti")


def fail_on_changes(state: ArmedState, when: str) -> None:
    changes = verify(state)
    if changes:
        raise ExecutionError("integrity", f"the timer's state changed {when}: {describe_changes(changes)}")


@dataclass(frozen=True)
class Start:
    """How a measurement began: the armed state, when (on the trusted clock), the time its defences
    take, torch, one timer per callable, and why CUPTI is not used where it is not."""

    state: ArmedState
    began: float
    spent: DefenceTime
    torch: Any
    timers: list[CuptiTimer | EventTimer]
    cupti_error: str | None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """CUPTI worked when the worker started: its failure while measuring is an integrity failure."""
        try:
            yield
        except ExecutionError:
            raise
        except Exception as exc:
            if isinstance(self.timers[0], CuptiTimer) and is_cupti_failure(exc):
                raise ExecutionError(
                    "integrity", f"CUPTI worked when the worker started but failed during the measurement: {exc!r}"
                ) from exc
            raise

    def finish(self, report: dict[str, Any]) -> None:
        """The report's ``cupti_error``, ``wall_ms`` and ``integrity_details["defences_ms"]``."""
        report["cupti_error"] = self.cupti_error
        report["wall_ms"] = round((self.state.trusted.perf_counter() - self.began) * 1e3, 3)
        report["integrity_details"]["defences_ms"] = self.spent.report()


def start(method: str, callables: int = 1, *, defences: bool = True) -> Start:
    """Begin a measurement of ``callables`` callables: torch with a GPU, the trusted state unchanged
    since the worker started, a timer each, no foreign CUPTI subscriber (``defences=False``: no
    checks, for ``benchmarks/timing.py --defences-cost``)."""
    state = armed()
    began = state.trusted.perf_counter()
    spent = DefenceTime(state.trusted.perf_counter)
    torch = import_torch_with_gpu(state)
    if defences:
        with spent.step("trusted_state"):
            fail_on_changes(state, "since the worker started (before the measurement)")
    # One timer per callable: a CUPTI timer keeps what its callable's probe launched.
    chosen = [choose_timer(method, state) for _ in range(callables)]
    if defences:
        with spent.step("trusted_state"):
            check_subscriber(state, chosen[0][0])
    return Start(state, began, spent, torch, [timer for timer, _ in chosen], chosen[0][1])


def warm_clock(
    runner: Runner, nvml: Nvml | None, budget_ms: float, launch_ms: list[float]
) -> tuple[bool | None, float, list[float]]:
    """Run the call until the SM clock is steady or the budget is spent.

    Returns (steady, milliseconds spent, wall time of each iteration in ms); steady is None when
    NVML cannot read the clock or the budget is zero. Each call's host launch time is appended to
    ``launch_ms``.
    """
    if nvml is None or budget_ms <= 0 or nvml.sm_clock_mhz() is None:
        return None, 0.0, []
    perf_counter = runner.trusted.perf_counter
    began = perf_counter()
    deadline = began + budget_ms / 1e3
    next_sample = began
    samples: list[float] = []
    iterations: list[float] = []
    steady = False
    while True:
        tick = perf_counter()
        launch_ms.append(runner.iteration())
        now = perf_counter()
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
    return steady, (perf_counter() - began) * 1e3, iterations


@dataclass
class Calibration:
    """One callable made ready for its counted calls: its runner, the hold, the per-call estimate."""

    runner: Runner
    writes_inputs: bool
    clock_steady: bool | None
    clock_warmup_ms: float
    hold_us: float
    hold_state: str
    hold_cycles: int
    per_call_ms: float  # wall time of one iteration, hold included

    @property
    def unheld(self) -> bool:
        """The call runs work on another stream, which no hold holds (``UNHELD_MEASURE``)."""
        return self.hold_state.startswith(UNHELD_STATE)

    @property
    def hold_ns(self) -> int:
        return int(self.hold_us * 1e3) if self.hold_cycles else 0


def calibrate(
    trusted: Trusted,
    torch: Any,
    fn: Callable[..., Any],
    plan: InputPlan,
    timer: CuptiTimer | EventTimer,
    nvml: Nvml | None,
    settings: BenchmarkConfig,
    spent: DefenceTime,
) -> Calibration:
    """The first call, the probe, the clock warm-up and the hold fit of ``fn``; no warm-up yet."""
    runner = Runner(trusted, fn, plan, settings.flush_l2)
    # The first call pays one-off costs (compilation, autotuning, handles); keep it out of the probe.
    # It also tells whether the call writes its inputs (then its outputs are not checked).
    _, first_inputs = runner.next_inputs()
    with spent.step("inputs"):
        before_call = versions(torch, first_inputs)
    tick = trusted.perf_counter()
    runner.call(first_inputs)
    launch_ms = [(trusted.perf_counter() - tick) * 1e3]
    runner.synchronize()
    with spent.step("inputs"):
        writes_inputs = versions(torch, first_inputs) != before_call
    if writes_inputs and plan.mode == MODE_ROTATED:
        plan.note = "the call writes its inputs: outputs not checked"
    del first_inputs
    timer.probe(runner)

    clock_steady, clock_warmup_ms, iteration_ms = warm_clock(runner, nvml, settings.clock_warmup_ms, launch_ms)
    if len(iteration_ms) < ESTIMATE_CALLS:
        for _ in range(ESTIMATE_CALLS - len(iteration_ms)):
            tick = trusted.perf_counter()
            launch_ms.append(runner.iteration())
            iteration_ms.append((trusted.perf_counter() - tick) * 1e3)

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
    return Calibration(
        runner, writes_inputs, clock_steady, clock_warmup_ms, hold_us, hold_state, hold_cycles, per_call_ms
    )


def warm_up(calibration: Calibration, settings: BenchmarkConfig) -> int:
    """Run the warm-up (a count, or calls for the warm-up budget); the number of calls run."""
    warmup = (
        settings.warmup
        if settings.warmup is not None
        else count_from_budget(settings.warmup_ms, calibration.per_call_ms, minimum=1)
    )
    for _ in range(warmup):
        calibration.runner.iteration()
    return warmup


def wait_for_cool_gpu(nvml: Nvml | None, settings: BenchmarkConfig, trusted: Trusted) -> CoolWait:
    """The wait a measurement's config asks for (``wait_cool_ms``, ``cool_temp_c``, ``idle_util_pct``)."""
    return wait_cool_idle(
        nvml,
        max_wait_ms=settings.wait_cool_ms,
        cool_temp_c=settings.cool_temp_c,
        idle_util_pct=settings.idle_util_pct,
        clock=trusted.perf_counter,
        sleep=time.sleep,
    )
