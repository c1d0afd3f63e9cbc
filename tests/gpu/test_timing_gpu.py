"""GPU tests of kcoral.builtins.benchmark and GpuAccessGuard (skipped without a CUDA GPU).

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_timing_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral.builtins import GpuAccessGuard, benchmark
from kcoral.errors import ExecutionError
from kcoral.timing import timers, trust
from kcoral.timing.cupti import CuptiTracer

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_cupti = pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python")

ADD_ELEMENTS = 1 << 24  # 16M float32: 192 MiB moved per add, well past the L2


@pytest.fixture(scope="module")
def add_operands() -> Iterator[tuple[Any, Any, Any]]:
    a = torch.randn(ADD_ELEMENTS, device="cuda")
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    yield a, b, out
    del a, b, out
    torch.cuda.empty_cache()


def _add(a: Any, b: Any, out: Any) -> None:
    torch.add(a, b, out=out)


@needs_cupti
def test_add_of_16m_floats_is_timed_by_cupti(add_operands: tuple[Any, Any, Any]) -> None:
    result = benchmark(_add, *add_operands)
    assert result["method"] == "cupti", result.get("cupti_error")
    # 192 MiB at the H200's ~4.8 TB/s peak is ~42 us; ~33 us was seen (part of it hits the L2).
    assert 0.010 < result["latency_ms_median"] < 0.5, result
    assert result["latency_ms_min"] <= result["latency_ms_median"] <= result["latency_ms_max"]
    assert result["activities_stable"] is True
    assert result["activities_per_call"] == 1
    assert result["flush_l2"] is True
    assert result["warmup"] >= 1 and result["repeat"] >= 1
    assert result["samples"] == result["repeat"]
    assert isinstance(result["gpu"], str) and result["gpu"]
    # The launch hold ran and was long enough; the medians by each way of measuring are reported.
    assert result["launch_hold"] == "on", result
    assert result["launch_hold_us"] > 0
    assert result["launch_late_calls"] == 0
    by = result["latency_ms_median_by"]
    assert by["span"] == result["latency_ms_median"]
    assert by["busy"] <= by["span"] <= by["ready_span"]
    if result["sm_clock_mhz_after"] is not None:
        assert result["sm_clock_mhz_after"] > 0
        assert isinstance(result["throttle_reasons_after"], list)
        assert isinstance(result["throttled"], bool)


@needs_cupti
def test_explicit_counts_override_the_budgets(add_operands: tuple[Any, Any, Any]) -> None:
    result = benchmark(_add, *add_operands, {"warmup": 3, "repeat": 17, "flush_l2": False})
    assert (result["warmup"], result["repeat"], result["samples"]) == (3, 17, 17)
    assert result["flush_l2"] is False


@needs_cupti
def test_side_stream_work_is_counted() -> None:
    size = 8192
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    product = torch.empty_like(x)
    small = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()

    def side_only() -> None:
        with torch.cuda.stream(side):
            torch.mm(x, y, out=product)

    def main_and_side() -> None:
        small.add_(1.0)  # short kernel on the current stream
        with torch.cuda.stream(side):
            torch.mm(x, y, out=product)  # long kernel on a stream the current one never waits for

    alone = benchmark(side_only, config={"repeat": 20})
    both = benchmark(main_and_side, config={"repeat": 20})
    assert alone["method"] == both["method"] == "cupti"
    # Work on another stream is not held by the spin, so neither call gets a hold.
    assert alone["launch_hold"].startswith("off") and both["launch_hold"].startswith("off"), (alone, both)
    assert alone["latency_ms_median"] > 0.3  # ~1.4 ms at ~780 TFLOP/s
    assert both["latency_ms_median"] >= 0.9 * alone["latency_ms_median"], (alone, both)
    # The current-stream add and the side-stream matmul at least (cuBLAS may add a workspace memset).
    assert both["activities_per_call"] >= 2


@needs_cupti
def test_launch_hold_keeps_host_gaps_out_of_the_time() -> None:
    data = torch.zeros(1024, device="cuda")

    def two_kernels_with_host_work_between() -> None:
        data.add_(1.0)
        time.sleep(200e-6)  # host work between two launches: the GPU waits for it without a hold
        data.add_(1.0)

    held = benchmark(two_kernels_with_host_work_between, config={"repeat": 30})
    unheld = benchmark(two_kernels_with_host_work_between, config={"repeat": 30, "launch_hold": False})
    assert held["launch_hold"] == "on" and held["launch_hold_us"] > 200, held
    assert held["launch_late_calls"] == 0, held
    assert held["latency_ms_median"] < 0.1, held  # two tiny kernels, back to back
    assert unheld["launch_hold_us"] == 0.0
    assert unheld["latency_ms_median"] > 0.19, unheld  # the host's 200 us between them
    assert held["activities_per_call"] == unheld["activities_per_call"] == 2


def test_cuda_event_method(add_operands: tuple[Any, Any, Any]) -> None:
    result = benchmark(_add, *add_operands, config={"method": "cuda_event", "repeat": 50})
    assert result["method"] == "cuda_event"
    assert 0.010 < result["latency_ms_median"] < 0.5, result
    assert result["activities_stable"] is True


def test_cuda_events_only_where_cupti_never_worked(
    add_operands: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = trust.armed()
    # As armed where CUPTI never imported: no tracer, and so none of its attributes in the snapshot.
    never = dataclasses.replace(
        armed,
        tracer=None,
        cupti_module=None,
        cupti_error="cupti-python is not importable: simulated",
        snapshot=trust.take_snapshot(armed.modules, None),
    )
    monkeypatch.setattr(trust, "_ARMED", never)
    result = benchmark(_add, *add_operands, config={"repeat": 20})
    assert result["method"] == "cuda_event"
    assert "simulated" in result["cupti_error"]
    assert result["host_ms_median"] is not None
    with pytest.raises(ExecutionError) as caught:
        benchmark(_add, *add_operands, config={"repeat": 20, "method": "cupti"})
    assert caught.value.kind == "unavailable"


@needs_cupti
def test_a_reset_fallback_switch_is_integrity_not_a_silent_fallback(
    add_operands: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    trust.armed()
    monkeypatch.setattr(CuptiTracer, "_instance_error", "cupti-python is not importable: simulated")
    with pytest.raises(ExecutionError) as caught:
        benchmark(_add, *add_operands, config={"repeat": 20})
    assert caught.value.kind == "integrity"
    assert "_instance_error" in caught.value.message


@needs_cupti
def test_honest_add_reads_ok_with_host_time_beside_gpu_time(add_operands: tuple[Any, Any, Any]) -> None:
    result = benchmark(_add, *add_operands, config={"repeat": 50})
    assert result["integrity"] == {"verdict": "ok", "reasons": []}, result["integrity"]
    assert result["inputs"]["mode"] == "rotated_clones"
    assert result["latency_ms_median"] <= result["host_ms_median"] < 3 * result["latency_ms_median"] + 0.05


@needs_cupti
def test_work_launched_by_a_helper_thread_is_counted() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    product = torch.empty_like(x)
    flag = torch.zeros(1, device="cuda")
    jobs: queue.Queue[threading.Event] = queue.Queue()

    def serve() -> None:
        side = torch.cuda.Stream()
        while (launched := jobs.get()) is not None:
            with torch.cuda.stream(side):
                torch.mm(x, x, out=product)
            launched.set()

    def honest() -> None:
        torch.mm(x, x, out=product)

    def through_helper() -> None:
        launched = threading.Event()
        jobs.put(launched)
        launched.wait()
        flag.add_(1.0)

    helper = threading.Thread(target=serve, daemon=True)
    helper.start()
    try:
        plain = benchmark(honest, config={"repeat": 30})
        cheat = benchmark(through_helper, config={"repeat": 30})
    finally:
        jobs.put(None)  # type: ignore[arg-type]
        helper.join()
    assert cheat["latency_ms_median"] >= 0.9 * plain["latency_ms_median"], (plain, cheat)
    assert cheat["integrity_details"]["other_thread_activities"] >= 30


@needs_cupti
def test_fresh_inputs_from_a_factory_and_a_failing_check() -> None:
    made: list[int] = []

    def make(index: int) -> tuple[Any, ...]:
        made.append(index)
        return (torch.full((1 << 20,), float(index), device="cuda"),)

    def double(x: Any) -> Any:
        return x * 2

    result = benchmark(double, inputs=make, check=lambda out, args: torch.equal(out, args[0] * 2))
    assert result["inputs"]["mode"] == "factory" and result["outputs_checked"] >= 1
    assert len(set(made)) == len(made)
    stale: dict[str, Any] = {}

    def memoised(x: Any) -> Any:
        stale.setdefault("out", x * 2)
        return stale["out"]

    with pytest.raises(ExecutionError) as caught:
        benchmark(memoised, inputs=make, check=lambda out, args: torch.equal(out, args[0] * 2))
    assert caught.value.kind == "correctness"


@needs_cupti
def test_a_patched_timer_method_fails_with_integrity(
    add_operands: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    trust.armed()
    original = timers.CuptiTimer.measure

    def scaled(self: Any, *args: Any, **kwargs: Any) -> Any:
        measurement, after = original(self, *args, **kwargs)
        measurement.samples_ms = [s * 0.1 for s in measurement.samples_ms]
        return measurement, after

    monkeypatch.setattr(timers.CuptiTimer, "measure", scaled)
    with pytest.raises(ExecutionError) as caught:
        benchmark(_add, *add_operands, config={"repeat": 10})
    assert caught.value.kind == "integrity"
    assert "CuptiTimer.measure was replaced" in caught.value.message


@needs_cupti
@pytest.mark.parametrize("work", [lambda: None, lambda: torch.ones(8).sum()], ids=["nothing", "cpu_tensor"])
def test_call_without_gpu_work_is_unavailable(work: Any) -> None:
    with pytest.raises(ExecutionError) as caught:
        benchmark(work, config={"repeat": 5})
    assert caught.value.kind == "unavailable"
    assert "no GPU work" in caught.value.message


@needs_cupti
def test_calls_that_launch_different_work_are_unstable() -> None:
    data = torch.zeros(1 << 20, device="cuda")
    turn = itertools.count()

    def alternating() -> None:
        data.add_(1.0)
        if next(turn) % 2:
            data.mul_(0.5)

    result = benchmark(alternating, config={"repeat": 20, "warmup": 2})
    assert result["method"] == "cupti"
    assert result["activities_stable"] is False


def test_guard_catches_a_cuda_tensor_in_a_fresh_process() -> None:
    script = textwrap.dedent(
        """
        import torch
        from kcoral.builtins import GpuAccessGuard
        from kcoral.errors import ExecutionError
        with GpuAccessGuard() as guard:
            try:
                torch.zeros(1, device="cuda")
                print("NO ERROR")
            except ExecutionError as exc:
                print("KIND", exc.kind)
        print("VIOLATION", guard.violation)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "KIND gpu_access" in done.stdout, done.stdout
    assert "VIOLATION None" not in done.stdout


@needs_cupti
def test_guard_records_cuda_use_after_cuda_was_initialised() -> None:
    torch.zeros(1, device="cuda")  # CUDA initialised: torch's Python hook no longer runs
    torch.cuda.synchronize()
    with GpuAccessGuard() as guard:
        torch.zeros(1, device="cuda")  # torch's C++ path skips _lazy_init once CUDA is initialised
    torch.cuda.synchronize()
    assert guard.violation is not None
    assert guard.violation.startswith("CUDA API call")
    with pytest.raises(ExecutionError) as caught:
        guard.check()
    assert caught.value.kind == "gpu_access"


def test_guard_refuses_torch_cuda_calls_after_cuda_was_initialised() -> None:
    torch.zeros(1, device="cuda")
    with GpuAccessGuard(use_cupti=False) as guard, pytest.raises(ExecutionError) as caught:
        torch.cuda.synchronize()  # torch.cuda's Python functions still pass through _lazy_init
    assert caught.value.kind == "gpu_access"
    assert guard.violation is not None


@needs_cupti
def test_guard_allows_a_device_count_query() -> None:
    with GpuAccessGuard() as guard:
        assert torch.cuda.device_count() >= 1
    assert guard.violation is None, guard.violation
