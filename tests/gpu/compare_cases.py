"""The H200 checks of ``compare`` (issue 22), as functions that return plain reports.

One module serves three callers: the GPU test (``tests/gpu/test_compare_gpu.py``), the table
printer (``benchmarks/compare_gpu.py``) and a program through the service (its source is uploaded
as a module, so it imports nothing of the tests). Each function runs on the current CUDA device.

- ``self_vs_self``: the 16M-float add against itself (``same`` expected, the interval holding 1.0).
- ``more_work``: the 16M-float add against the same add of 1.03x the elements (``slower``).
- ``matmul_vs_slower``: the examples' 4096^3 bf16 matmul against a variant doing 1.5x the work,
  with the ratio of the two medians measured apart by ``benchmark``.
- ``adaptive_stop``: each honest workload against itself: what ended the sampling, the samples
  used and the half-width reached.
- ``busy_process``: a process outside KCoral that keeps the GPU busy while a comparison runs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from kcoral.builtins import benchmark, compare

ADD_ELEMENTS = 1 << 24
MORE_WORK = 1.03
MATMUL_N = 4096
SLOWER_SHARE = 0.5  # the variant multiplies half of A's rows a second time: 1.5x the work
SMALL_ADD_ELEMENTS = 1 << 20
MLP_BATCH, MLP_WIDTH, MLP_LAYERS = 64, 1024, 4

# The fields of a compare() report that the tables show.
SUMMARY_KEYS = ("verdict", "ratio", "ratio_low", "ratio_high", "halfwidth", "contains_one", "rounds")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The part of a compare() report a table shows."""
    row = {key: report[key] for key in SUMMARY_KEYS}
    row.update(
        {
            "stop": report["stop"]["reason"],
            "samples": report["a"]["samples"] + report["b"]["samples"],
            "left_out": report["clock"]["samples_left_out"],
            "a_ms": report["a"]["latency_ms_median"],
            "b_ms": report["b"]["latency_ms_median"],
            "a_noise": report["a"]["noise"],
            "integrity": report["integrity"]["verdict"],
            "reasons": report["integrity"]["reasons"][:3],
            "temperature_c": (report["conditions_before"] or {}).get("temperature_c"),
            "sm_clock_mhz": report["clock"]["sm_clock_mhz_median"],
            "sm_clock_mhz_by_side": report["clock"].get("sm_clock_mhz_median_by_side"),
            "power_capped": report["clock"].get("samples_power_capped"),
            "rounds_clock_apart": report.get("rounds_clock_apart"),
            "measure_ms": report["stop"]["measure_ms"],
        }
    )
    return row


def _add(a: Any, b: Any) -> Any:
    return torch.add(a, b)


def self_vs_self(runs: int = 10, config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    x = torch.randn(ADD_ELEMENTS, device="cuda")
    y = torch.randn_like(x)
    return [summary(compare(_add, _add, x, y, config=config)) for _ in range(runs)]


def more_work(runs: int = 10, config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    larger = int(ADD_ELEMENTS * MORE_WORK)
    x = torch.randn(larger, device="cuda")
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    x16, y16, out16 = x[:ADD_ELEMENTS], y[:ADD_ELEMENTS], out[:ADD_ELEMENTS]

    def base() -> None:
        torch.add(x16, y16, out=out16)

    def more() -> None:
        torch.add(x, y, out=out)

    return [summary(compare(base, more, config=config)) for _ in range(runs)]


def _mm(a: Any, b: Any) -> Any:
    return torch.mm(a, b)


def _mm_slower(a: Any, b: Any) -> Any:
    out = torch.mm(a, b)
    torch.mm(a[: int(a.shape[0] * SLOWER_SHARE)], b)  # the same output for 1.5x the multiplications
    return out


def matmul_operands() -> tuple[Any, Any]:
    scale = MATMUL_N**-0.25
    a = (torch.randn(MATMUL_N, MATMUL_N, device="cuda") * scale).to(torch.bfloat16)
    b = (torch.randn(MATMUL_N, MATMUL_N, device="cuda") * scale).to(torch.bfloat16)
    return a, b


def matmul_vs_slower(runs: int = 3, config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    a, b = matmul_operands()
    rows = []
    for _ in range(runs):
        apart_a = benchmark(_mm, a, b)["latency_ms_median"]
        apart_b = benchmark(_mm_slower, a, b)["latency_ms_median"]
        row = summary(compare(_mm, _mm_slower, a, b, config=config))
        row["ratio_apart"] = apart_b / apart_a
        row["ratio_vs_apart"] = row["ratio"] / row["ratio_apart"] - 1
        rows.append(row)
    return rows


def _workloads() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    x = torch.randn(ADD_ELEMENTS, device="cuda")
    small = torch.randn(SMALL_ADD_ELEMENTS, device="cuda")
    layers = torch.nn.Sequential(
        *[m for _ in range(MLP_LAYERS) for m in (torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU())]
    ).cuda()
    batch = torch.randn(MLP_BATCH, MLP_WIDTH, device="cuda")

    def mlp(inputs: Any) -> Any:
        with torch.no_grad():
            return layers(inputs)

    return {
        "add_16m": (_add, (x, torch.randn_like(x))),
        "add_1m": (_add, (small, torch.randn_like(small))),
        "matmul_bf16_4096": (_mm, matmul_operands()),
        "small_mlp": (mlp, (batch,)),
    }


def adaptive_stop(config: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    return {name: summary(compare(fn, fn, *args, config=config)) for name, (fn, args) in _workloads().items()}


BUSY_SOURCE = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("busy", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize()
"""


def busy_process(seconds: float) -> subprocess.Popen[str]:
    """A process outside KCoral that keeps the GPU busy for ``seconds`` (started when it says so)."""
    process = subprocess.Popen([sys.executable, "-c", BUSY_SOURCE, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    process.stdout.readline()
    return process
