"""A CuTe DSL kernel with three named IKET stages, for ``kcoral iket`` (see README.md beside this file).

The kernel sums each row of an (M, N) float32 matrix: one warp per row. Its stages, each an IKET
range (``range_start``/``range_end`` of ``cutlass.cute.experimental.iket``):

- ``accumulate``: each lane adds up its strided share of the row (the global-memory reads);
- ``warp_reduce``: the 32 partial sums are combined with butterfly shuffles;
- ``store``: lane 0 writes the row's sum.

The markers cost nothing outside run-iket: the CuTe DSL strips IKET ops at compile time unless
``CUTE_DSL_COMPILER_OPT`` holds ``iket``, which run-iket sets for the script it runs. ``--no-markers``
builds the same kernel without the marker calls at all.

Modes::

    python3 row_sum_iket.py                      # run once and check against torch.sum
    python3 row_sum_iket.py --bench              # also time it with kcoral.builtins.benchmark
    python3 row_sum_iket.py --compile-only       # compile for sm_90a with fake tensors (no GPU)

With ``--bench`` the script prints one line ``IKET_BENCH {json}``: the pass it ran in (``tracker``
or ``iket`` under run-iket, which runs the script twice; ``none`` outside it), whether the kernel
had markers and whether they were compiled in, and the benchmark's median. Every pass times the
same way (BENCH_CONFIG: CUDA events, fixed counts), so that numbers taken under run-iket's
injection library compare with those taken without it. Under run-iket, ``--bench`` records every
one of its ~230 launches: give ``kcoral iket`` ``--postprocess none`` (no trace files of them) or
``--iket-args "--enabled-cluster 0,0,0"`` (one block's events per launch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.experimental import iket

WARP = 32
# Fixed counts and no clock warm-up in benchmark() (warm_gpu warms the clock with work of its own),
# so that run-iket's tracker pass launches the kernel as often as its traced pass: the tracker sizes
# the trace buffer from what it saw (plus 15%). CUDA events, since run-iket's injection library
# may hold CUPTI.
BENCH_CONFIG = {"method": "cuda_event", "warmup": 20, "repeat": 200, "clock_warmup_ms": 0}
WARM_GPU_SECONDS = 1.0


@cute.kernel
def row_sum_kernel(g_in: cute.Tensor, g_out: cute.Tensor, markers: cutlass.Constexpr[bool]) -> None:
    lane, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    n = g_in.shape[1]

    if cutlass.const_expr(markers):
        accumulate = iket.range_start("accumulate")
    acc = cutlass.Float32(0.0)
    for i in cutlass.range(lane, n, WARP):
        acc = acc + g_in[row, i]
    if cutlass.const_expr(markers):
        iket.range_end(accumulate)
        warp_reduce = iket.range_start("warp_reduce")
    acc = cute.arch.warp_reduction_sum(acc)
    if cutlass.const_expr(markers):
        iket.range_end(warp_reduce)
        store = iket.range_start("store")
    if lane == 0:
        g_out[row] = acc
    if cutlass.const_expr(markers):
        iket.range_end(store)


@cute.jit
def row_sum(m_in: cute.Tensor, m_out: cute.Tensor, stream: cuda.CUstream, markers: cutlass.Constexpr[bool]) -> None:
    rows = m_in.shape[0]
    row_sum_kernel(m_in, m_out, markers).launch(grid=(rows, 1, 1), block=(WARP, 1, 1), stream=stream)


def iket_pass() -> str:
    """Which of run-iket's passes this process is: ``tracker``, ``iket``, or ``none`` outside run-iket."""
    config = os.environ.get("IKET_INJECTION_CONFIG")
    if not config:
        return "none"
    try:
        return str(json.loads(Path(config).read_text()).get("toolName", "unknown"))
    except (OSError, ValueError):
        return "unknown"


def markers_compiled_in() -> bool:
    return "iket" in os.environ.get("CUTE_DSL_COMPILER_OPT", "").replace(",", " ").split()


def compile_only(rows: int, cols: int, markers: bool) -> None:
    """Compile for sm_90a with fake tensors: a check of the kernel that needs no GPU."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    fake_in = make_fake_compact_tensor(cutlass.Float32, (rows, cols), stride_order=(1, 0))
    fake_out = make_fake_compact_tensor(cutlass.Float32, (rows,))
    cute.compile(row_sum, fake_in, fake_out, make_fake_stream(), markers)
    print(
        f"compiled row_sum for {os.environ['CUTE_DSL_ARCH']} (markers={markers}, compiled in={markers_compiled_in()})"
    )


def warm_gpu(torch: Any) -> None:
    """About WARM_GPU_SECONDS of matrix products (no IKET markers in them) to bring the clock up."""
    x = torch.randn(4096, 4096, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_GPU_SECONDS:
        for _ in range(10):
            x = torch.nn.functional.normalize(x @ x)
        torch.cuda.synchronize()


def run(rows: int, cols: int, markers: bool, bench: bool) -> int:
    import torch
    from cutlass.cute.runtime import from_dlpack

    torch.manual_seed(0)
    data = torch.randn(rows, cols, device="cuda", dtype=torch.float32)
    out = torch.empty(rows, device="cuda", dtype=torch.float32)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled = cute.compile(
        row_sum, from_dlpack(data, assumed_align=16), from_dlpack(out, assumed_align=16), stream, markers
    )

    def row_sums(matrix: torch.Tensor) -> torch.Tensor:
        result = torch.empty(matrix.shape[0], device=matrix.device, dtype=torch.float32)
        current = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        compiled(from_dlpack(matrix, assumed_align=16), from_dlpack(result, assumed_align=16), current)
        return result

    got = row_sums(data)
    torch.cuda.synchronize()
    expected = data.sum(dim=1)
    error = float((got - expected).abs().max())
    ok = bool(torch.allclose(got, expected, rtol=1e-4, atol=1e-2))
    print(f"row_sum {rows}x{cols}: max abs error {error:.3g} ({'ok' if ok else 'WRONG'}), pass {iket_pass()}")
    if not ok:
        return 1
    if bench:
        from kcoral.builtins import benchmark

        warm_gpu(torch)
        report = benchmark(row_sums, data, config=BENCH_CONFIG)
        line = {
            "pass": iket_pass(),
            "markers": markers,
            "markers_compiled_in": markers and markers_compiled_in(),
            "rows": rows,
            "cols": cols,
            "latency_ms_median": report["latency_ms_median"],
            "latency_ms_min": report["latency_ms_min"],
            "method": report["method"],
            "repeat": report["repeat"],
            "integrity": report["integrity"]["verdict"],
        }
        print("IKET_BENCH " + json.dumps(line), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--no-markers", action="store_true", help="build the kernel without IKET marker calls")
    parser.add_argument("--bench", action="store_true", help="time the kernel with kcoral.builtins.benchmark")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a with fake tensors, no GPU")
    args = parser.parse_args()
    if args.rows < 1 or args.cols < 1:
        parser.error("--rows and --cols must be positive")
    if args.compile_only:
        compile_only(args.rows, args.cols, not args.no_markers)
        return 0
    return run(args.rows, args.cols, not args.no_markers, args.bench)


if __name__ == "__main__":
    sys.exit(main())
