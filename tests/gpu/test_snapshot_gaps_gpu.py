"""Class 8 of the attacks on the timer: gaps in the in-process ``benchmark()``'s trusted snapshot
(GPU host). Each attack changes something the timer relies on where the snapshot used to miss it:
a module of ``kcoral.timing`` that was not listed, a function that the report is made with after
the last check, a change made by the user's function while the timer calls it again (untimed) to
check its outputs. Each must fail with ``integrity``, or leave the report untouched.

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_snapshot_gaps_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from kcoral.errors import ExecutionError
from tests.helpers import called_from

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python"),
    pytest.mark.timeout(300),
]

CONFIG = {"warmup": 5, "repeat": 30, "clock_warmup_ms": 0}


@pytest.fixture
def operands() -> tuple[Any, Any]:
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    return a, torch.randn_like(a)


@pytest.fixture
def restore() -> Iterator[list[tuple[Any, str, Any]]]:
    from kcoral.timing import trust

    trust.arm()  # as a worker does before any uploaded code runs
    saved: list[tuple[Any, str, Any]] = []
    yield saved
    for owner, name, value in reversed(saved):
        setattr(owner, name, value)


def _replace(saved: list[tuple[Any, str, Any]], owner: Any, name: str, value: Any) -> None:
    saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _honest_ms(a: Any, b: Any) -> float:
    from kcoral.builtins import benchmark

    return float(benchmark(torch.mm, a, b, config=CONFIG)["latency_ms_median"])


def test_a_device_name_that_rewrites_the_report_is_caught(operands: tuple[Any, Any], restore: list[Any]) -> None:
    """torch.cuda.get_device_name is called while the report is built: replaced from a timed call,
    it could scale the latencies already in the report."""
    from kcoral.builtins import benchmark

    real = torch.cuda.get_device_name

    def rewriting(*args: Any, **kwargs: Any) -> str:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            result = frame.f_locals.get("result")
            if isinstance(result, dict) and "latency_ms_median" in result:
                for key in [k for k in result if k.startswith("latency_ms_")]:
                    if isinstance(result[key], float):
                        result[key] *= 0.05
            frame = frame.f_back
        return real(*args, **kwargs)

    def fn(a: Any, b: Any) -> Any:
        if torch.cuda.get_device_name is real:
            _replace(restore, torch.cuda, "get_device_name", rewriting)
        return torch.mm(a, b)

    honest = _honest_ms(*operands)
    try:
        report = benchmark(fn, *operands, config=CONFIG)
    except ExecutionError as exc:
        assert exc.kind == "integrity", exc
        assert "get_device_name" in exc.message
        return
    assert report["latency_ms_median"] > 0.5 * honest, (report["latency_ms_median"], honest)


def test_a_change_made_during_the_untimed_check_calls_is_caught(operands: tuple[Any, Any], restore: list[Any]) -> None:
    """The rotated-clone check calls the function again after the measurement's last check used to
    run: a change made then (here: the report's summary) went unseen."""
    import kcoral.timing.benchmark as module
    from kcoral.builtins import benchmark

    real = module.summarize

    def scaled(samples: Any) -> dict[str, Any]:
        return {k: (v * 0.05 if isinstance(v, float) else v) for k, v in real(samples).items()}

    def fn(a: Any, b: Any) -> Any:
        if called_from("again") and module.summarize is real:
            _replace(restore, module, "summarize", scaled)
        return torch.mm(a, b)

    with pytest.raises(ExecutionError) as caught:
        benchmark(fn, *operands, config=CONFIG)
    assert caught.value.kind == "integrity"
    assert "summarize" in caught.value.message and "while the outputs were checked" in caught.value.message


def test_a_module_that_was_not_listed_is_watched(operands: tuple[Any, Any], restore: list[Any]) -> None:
    """kcoral.timing.config was not in the snapshot: its config parser could turn the defences off
    without the report saying so, or shrink the counts."""
    import kcoral.timing.config as config
    from kcoral.builtins import benchmark

    real = config.BenchmarkConfig.from_mapping

    def quiet(mapping: Any) -> Any:
        return real({**dict(mapping or {}), "repeat": 1, "flush_l2": False})

    _replace(restore, config.BenchmarkConfig, "from_mapping", staticmethod(quiet))
    with pytest.raises(ExecutionError) as caught:
        benchmark(torch.mm, *operands, config=CONFIG)
    assert caught.value.kind == "integrity" and "kcoral.timing.config" in caught.value.message
