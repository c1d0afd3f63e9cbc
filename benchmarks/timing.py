"""Compare kcoral.builtins.benchmark with CUDA events and Nsight Compute, and check its repeatability.

For each workload (a 16M-float add, a 4096^3 bf16 matmul, a ~5 us small add) it prints:
- the median of ``benchmark()`` in this process, and the method it used;
- the median of a plain ``torch.cuda.Event`` loop (L2 flushed between calls the same way);
- the median per-call ``gpu__time_duration.sum`` of Nsight Compute, when ``ncu`` is on PATH
  (the workload runs in a subprocess under ``ncu --clock-control none``);
- repeatability: the ``benchmark()`` median from N fresh subprocesses, spread = max/min - 1.

Usage (on a GPU host, from the repository root)::

    python3 benchmarks/timing.py                     # everything, 10 fresh runs
    python3 benchmarks/timing.py --runs 3 --no-ncu --json timing.json

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WORKLOADS = ("add_16m_f32", "matmul_4096_bf16", "small_add")
NVTX_RANGE = "kcoral_call"
EVENT_CALLS = 200
CHILD_TIMEOUT_S = 600
# ncu reports durations in these units (with --print-units base it is ns); factors to milliseconds.
NCU_UNIT_TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3}


def log(message: str) -> None:
    print(f"[timing] {message}", file=sys.stderr, flush=True)


def make_workload(name: str) -> Callable[[], None]:
    """Allocate the workload's tensors and return a call that launches its GPU work."""
    import torch

    if name == "add_16m_f32":
        a = torch.randn(1 << 24, device="cuda")
        b = torch.randn_like(a)
        out = torch.empty_like(a)
    elif name == "small_add":
        a = torch.randn(1 << 20, device="cuda")  # 12 MiB moved: a few microseconds
        b = torch.randn_like(a)
        out = torch.empty_like(a)
    elif name == "matmul_4096_bf16":
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        y = torch.randn_like(x)
        product = torch.empty_like(x)

        def matmul() -> None:
            torch.mm(x, y, out=product)

        return matmul
    else:
        raise ValueError(f"unknown workload {name!r}")

    def add() -> None:
        torch.add(a, b, out=out)

    return add


def cuda_event_median(call: Callable[[], None], calls: int = EVENT_CALLS) -> float:
    """Median of CUDA-event intervals around each call, flushing the L2 by a read in between."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 64 * 1024 * 1024)
    flush = torch.zeros(2 * l2_bytes // 4, dtype=torch.float32, device="cuda")
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for start, end in zip(starts, ends, strict=True):
        flush.sum()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def benchmark_median(name: str) -> dict[str, Any]:
    from kcoral.builtins import benchmark

    result = benchmark(make_workload(name))
    return {
        "median_ms": result["latency_ms_median"],
        "method": result["method"],
        "repeat": result["repeat"],
        "stable": result["activities_stable"],
        "sm_clock_mhz": result["sm_clock_mhz_after"],
        "throttled": result["throttled"],
    }


# ----------------------------------------------------------------------------- child modes


def child_repeat(workloads: list[str]) -> None:
    """One fresh process: benchmark() each workload once, print one JSON line."""
    out = {name: benchmark_median(name) for name in workloads}
    print("KCORAL_JSON " + json.dumps(out), flush=True)


def child_ncu(name: str, iters: int) -> None:
    """Run the workload inside NVTX ranges so ncu profiles only the timed calls."""
    import torch

    call = make_workload(name)
    for _ in range(5):  # compile, cuBLAS handles, autotuning: outside the profiled ranges
        call()
    torch.cuda.synchronize()
    for _ in range(iters):
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- parent


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def parse_ncu_csv(text: str, iters: int) -> float | None:
    """Median per-call gpu__time_duration.sum (ms) from ncu's CSV; kernels are summed per call."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return None
    durations: list[float] = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        factor = NCU_UNIT_TO_MS.get((row.get("Metric Unit") or "").strip())
        raw = (row.get("Metric Value") or "").replace(",", "").strip()
        if factor is None or not raw:
            continue
        try:
            durations.append(float(raw) * factor)
        except ValueError:
            continue
    if not durations:
        return None
    # Every call launches the same kernels in order, so rows group into `iters` equal runs.
    if iters > 0 and len(durations) % iters == 0:
        per_call = len(durations) // iters
        calls = [sum(durations[i : i + per_call]) for i in range(0, len(durations), per_call)]
    else:
        log(f"ncu: {len(durations)} kernel rows do not split into {iters} calls; using per-kernel median")
        calls = durations
    return float(statistics.median(calls))


def ncu_median(name: str, iters: int, ncu: str, workdir: Path) -> float | None:
    log_path = workdir / f"ncu_{name}.log"
    command = [
        ncu,
        "--clock-control",
        "none",
        "--metrics",
        "gpu__time_duration.sum",
        "--csv",
        "--print-units",
        "base",
        "--nvtx",
        "--nvtx-include",
        f"{NVTX_RANGE}/",
        "--target-processes",
        "all",
        "--log-file",
        str(log_path),
        sys.executable,
        str(Path(__file__).resolve()),
        "--child-ncu",
        name,
        "--ncu-iters",
        str(iters),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=child_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"ncu failed for {name}: {exc}")
        return None
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if done.returncode != 0:
        log(f"ncu exited {done.returncode} for {name}: {(done.stderr or text)[-500:]}")
    value = parse_ncu_csv(text or done.stdout, iters)
    if value is None:
        log(f"ncu produced no gpu__time_duration.sum rows for {name}: {text[-500:]}")
    return value


def repeat_runs(workloads: list[str], runs: int) -> dict[str, list[float]]:
    medians: dict[str, list[float]] = {name: [] for name in workloads}
    for run in range(runs):
        log(f"fresh process {run + 1}/{runs}")
        try:
            done = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child-repeat", *workloads],
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
                env=child_env(),
            )
        except subprocess.TimeoutExpired:
            log("fresh process timed out")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("KCORAL_JSON ")]
        if done.returncode != 0 or not lines:
            log(f"fresh process failed ({done.returncode}): {done.stderr[-800:]}")
            continue
        for name, entry in json.loads(lines[-1][len("KCORAL_JSON ") :]).items():
            medians[name].append(float(entry["median_ms"]))
    return medians


def spread(values: list[float]) -> float | None:
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values) - 1.0


def fmt(value: float | None, unit_us: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f}" if unit_us else f"{value * 100:.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--runs", type=int, default=10, help="fresh subprocesses for repeatability (0 skips)")
    parser.add_argument("--ncu-iters", type=int, default=20, help="calls profiled by ncu per workload")
    parser.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute even if ncu is on PATH")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--child-repeat", nargs="+", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--child-ncu", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child_repeat:
        child_repeat(args.child_repeat)
        return 0
    if args.child_ncu:
        child_ncu(args.child_ncu, args.ncu_iters)
        return 0

    import torch

    if not torch.cuda.is_available():
        log("no CUDA GPU: nothing to measure")
        return 2
    ncu = None if args.no_ncu else shutil.which("ncu")
    if ncu is None and not args.no_ncu:
        log("ncu is not on PATH: the Nsight Compute column stays empty")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kcoral_timing_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)

    rows: dict[str, dict[str, Any]] = {}
    for name in args.workloads:
        log(f"{name}: benchmark() and CUDA events in this process")
        started = time.perf_counter()
        row: dict[str, Any] = {"benchmark": benchmark_median(name)}
        row["benchmark_wall_s"] = round(time.perf_counter() - started, 3)
        row["cuda_event_median_ms"] = cuda_event_median(make_workload(name))
        torch.cuda.empty_cache()
        if ncu is not None:
            log(f"{name}: Nsight Compute ({args.ncu_iters} calls)")
            row["ncu_median_ms"] = ncu_median(name, args.ncu_iters, ncu, workdir)
        else:
            row["ncu_median_ms"] = None
        rows[name] = row

    if args.runs > 0:
        for name, values in repeat_runs(args.workloads, args.runs).items():
            rows[name]["fresh_medians_ms"] = values
            rows[name]["spread"] = spread(values)

    columns = (("workload", "<18"), ("benchmark us", ">13"), ("method", ">10"), ("events us", ">10"))
    columns += (("ncu us", ">9"), ("runs", ">5"), ("spread", ">8"))
    header = " ".join(f"{title:{align}}" for title, align in columns)
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        bench = row["benchmark"]
        print(
            f"{name:<18} {fmt(bench['median_ms']):>13} {bench['method']:>10} {fmt(row['cuda_event_median_ms']):>10} "
            f"{fmt(row['ncu_median_ms']):>9} {len(row.get('fresh_medians_ms', [])):>5} "
            f"{fmt(row.get('spread'), unit_us=False):>8}"
        )
    if args.json:
        payload = {"gpu": torch.cuda.get_device_name(), "ncu": ncu, "workloads": rows}
        args.json.write_text(json.dumps(payload, indent=2))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
