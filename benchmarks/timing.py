"""Compare kcoral.builtins.benchmark with Nsight Compute and CUDA events, and check its repeatability.

Workloads: a 16M-float add, a 4096^3 bf16 matmul, a ~5 us add of 1M floats, and the same matmul
launched on a side stream (what CUDA events cannot see). Modes:

- in-process (default): for each workload, the median of ``benchmark()``, of a plain CUDA-event loop
  (L2 flushed the same way, launches queued back to back), and of Nsight Compute's per-call
  ``gpu__time_duration.sum`` (the workload runs in a subprocess under ``ncu --clock-control none``,
  when ``ncu`` is on PATH), with the SM clock ncu saw; optionally ``--runs N`` fresh subprocesses
  for repeatability.
- ``--via-service URL``: each workload submitted as ``--runs`` separate programs to a running
  KCoral service (interleaved: w1 w2 w3 w1 ...); prints each median and the spread
  (max/min - 1). With ``--churn``, a background client keeps submitting programs whose module
  creates a CUDA context on the same GPU without a lease (what a spare worker warming its context
  does), to see whether that moves a running measurement.

Usage (on a GPU host, from the repository root)::

    python3 benchmarks/timing.py --json timing.json
    python3 benchmarks/timing.py --via-service tcp://127.0.0.1:5555 --runs 10
    python3 benchmarks/timing.py --via-service tcp://127.0.0.1:5556 --runs 5 --churn

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WORKLOADS = ("add_16m_f32", "add_256k_f32", "matmul_4096_bf16", "matmul_side_stream", "small_add", "null_kernel")
# The four honest workloads of the integrity checks (small_add, 1M floats, is kept for older tables).
DEFAULT_WORKLOADS = WORKLOADS[:4]
ADD_ELEMENTS = {"add_16m_f32": 1 << 24, "add_256k_f32": 1 << 18, "small_add": 1 << 20}
# Workloads compared with the kernel's own duration rather than ncu's gpu__time_duration, which adds
# ~1.2 us of its own bracketing to every kernel (40% of the 256K add's 3 us; a kernel that does
# nothing reads 1.86 us there, against 0.17 us of SM activity).
COMPARE_WITH_KERNEL_DURATION = frozenset({"add_256k_f32", "small_add"})
# The kernel's own duration by ncu, three ways (all recorded; NCU_OWN_MEASURE is compared with):
# - gr_active: cycles the compute engine (GR) was active over the GR clock: from the grid's start
#   to its last block's end, without ncu's bracketing;
# - time_active: gpu__time_active, the time the GPU was active in the range;
# - sm_active: the busiest SM's cycles with a warp in flight over the SM clock: leaves out the
#   block distribution across SMs, so it reads below the kernel's span on a short kernel.
NCU_OWN_METRICS: dict[str, tuple[str, str | None]] = {
    "gr_active": ("gr__cycles_active.max", "gr__cycles_elapsed.avg.per_second"),
    "time_active": ("gpu__time_active.sum", None),
    "sm_active": ("sm__cycles_active.max", "sm__cycles_elapsed.avg.per_second"),
}
NCU_OWN_MEASURE = "gr_active"
NULL_KERNEL = "null_kernel"
NCU_TOLERANCE = 0.05
SPREAD_TOLERANCE = 0.03
DEFENCES_COST_LIMIT = 0.10
NVTX_RANGE = "kcoral_call"
EVENT_CALLS = 200
CHILD_TIMEOUT_S = 600
PROGRAM_TIMEOUT_S = 120
# Workloads that ncu need not profile again: the side-stream matmul runs the same kernel as the matmul.
NCU_SAME_AS = {"matmul_side_stream": "matmul_4096_bf16"}
NCU_TIME_METRIC = "gpu__time_duration.sum"
NCU_CLOCK_METRIC = "sm__cycles_elapsed.avg.per_second"
# ncu reports values in these units (with --print-units base: ns and cycle/second).
NCU_UNIT_TO_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3}
NCU_UNIT_TO_MHZ = {"cycle/second": 1e-6, "cycle/nsecond": 1e3, "cycle/usecond": 1.0, "hz": 1e-6, "mhz": 1.0}

# The workloads, as source: the same text runs in this process, under ncu, and as an uploaded module.
WORKLOAD_SOURCE = '''
import torch
from kcoral.builtins import benchmark


def make_workload(name):
    """Allocate the workload's tensors and return a call that launches its GPU work."""
    if name in ("add_16m_f32", "add_256k_f32", "small_add"):
        a = torch.randn({"add_16m_f32": 1 << 24, "add_256k_f32": 1 << 18}.get(name, 1 << 20), device="cuda")
        b = torch.randn_like(a)
        out = torch.empty_like(a)

        def add():
            torch.add(a, b, out=out)

        return add
    if name in ("matmul_4096_bf16", "matmul_side_stream"):
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        y = torch.randn_like(x)
        product = torch.empty_like(x)
        side = torch.cuda.Stream()

        def matmul():
            torch.mm(x, y, out=product)

        def matmul_on_side_stream():
            with torch.cuda.stream(side):
                torch.mm(x, y, out=product)

        return matmul if name == "matmul_4096_bf16" else matmul_on_side_stream
    if name == "null_kernel":  # one thread that spins zero cycles: what ncu counts for launching
        return lambda: torch.cuda._sleep(0)
    raise ValueError(f"unknown workload {name!r}")


def evaluate(name, config=None):
    """One program's measurement: the benchmark() report, trimmed to what the table needs."""
    report = benchmark(make_workload(name), config=config or {})
    keep = ("latency_ms_median", "latency_ms_min", "latency_ms_max", "latency_ms_std", "method", "repeat",
            "activities_stable", "activities_per_call", "latency_ms_median_by", "launch_hold", "launch_hold_us",
            "launch_late_calls", "sm_clock_mhz_before", "sm_clock_mhz_after", "throttle_reasons_after",
            "throttled", "clock_steady", "host_ms_median", "integrity", "cupti_error", "latency_measure",
            "integrity_details", "wall_ms", "clock_resolution_ns")
    return {key: report.get(key) for key in keep}
'''

# A program for --churn: its module creates a CUDA context (and a small allocation) at import, with
# no lease, as a spare worker that warms its context would; its cpu_only function then returns.
CHURN_SOURCE = """
import torch

torch.cuda.init()
_warm = torch.empty(1, device="cuda")


def ping():
    return 1
"""


def log(message: str) -> None:
    print(f"[timing] {message}", file=sys.stderr, flush=True)


def workload_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "kcoral_timing_workloads"}
    exec(compile(WORKLOAD_SOURCE, "<kcoral timing workloads>", "exec"), namespace)
    return namespace


def make_workload(name: str) -> Callable[[], None]:
    maker: Callable[[str], Callable[[], None]] = workload_namespace()["make_workload"]
    return maker(name)


def cuda_event_median(call: Callable[[], None], calls: int = EVENT_CALLS) -> float:
    """Median of CUDA-event intervals around each call, flushing the L2 by a read in between.

    No host synchronisation inside the loop: the GPU runs flush, event, call, event back to back
    while the host queues ahead, the way events are usually used (and why they miss side streams).
    """
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


def benchmark_report(name: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    evaluate: Callable[..., dict[str, Any]] = workload_namespace()["evaluate"]
    return evaluate(name, config)


# ----------------------------------------------------------------------------- child modes


def child_repeat(workloads: list[str]) -> None:
    """One fresh process: benchmark() each workload once, print one JSON line."""
    out = {name: benchmark_report(name) for name in workloads}
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


# ----------------------------------------------------------------------------- Nsight Compute


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ncu_metric_names() -> list[str]:
    names = [NCU_TIME_METRIC, NCU_CLOCK_METRIC]
    for value, clock in NCU_OWN_METRICS.values():
        names += [value] if clock is None else [value, clock]
    return list(dict.fromkeys(names))


def _ncu_rows(text: str) -> dict[str, list[float]]:
    """Each metric's values in kernel order, in ms for times, MHz for clocks, cycles for counts."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    values: dict[str, list[float]] = {}
    for row in csv.DictReader(lines):
        metric = row.get("Metric Name") or ""
        unit = (row.get("Metric Unit") or "").strip()
        raw = (row.get("Metric Value") or "").replace(",", "").strip()
        try:
            value = float(raw)
        except ValueError:
            continue
        if unit in NCU_UNIT_TO_MS:
            value *= NCU_UNIT_TO_MS[unit]
        elif unit.lower() in NCU_UNIT_TO_MHZ:
            value *= NCU_UNIT_TO_MHZ[unit.lower()]
        values.setdefault(metric, []).append(value)
    return values


def _per_call(values: list[float], iters: int) -> list[float]:
    """Every call launches the same kernels in order, so rows group into ``iters`` equal runs."""
    if iters > 0 and values and len(values) % iters == 0:
        per_call = len(values) // iters
        return [sum(values[i : i + per_call]) for i in range(0, len(values), per_call)]
    return values


def parse_ncu_csv(text: str, iters: int) -> dict[str, Any] | None:
    """Median per-call gpu__time_duration.sum (ms, kernels summed per call), the median SM clock,
    and the kernel's own duration by each of :data:`NCU_OWN_METRICS` (ms, ``own_by``)."""
    values = _ncu_rows(text)
    durations = values.get(NCU_TIME_METRIC, [])
    if not durations:
        return None
    if iters > 0 and len(durations) % iters:
        log(f"ncu: {len(durations)} kernel rows do not split into {iters} calls; using per-kernel medians")
    own_by: dict[str, float] = {}
    for label, (metric, clock_metric) in NCU_OWN_METRICS.items():
        counts = values.get(metric, [])
        clocks = values.get(clock_metric, []) if clock_metric else []
        if clock_metric is None:
            kernel_ms = counts
        elif len(counts) == len(clocks):
            kernel_ms = [c / (mhz * 1e3) for c, mhz in zip(counts, clocks) if mhz > 0]
        else:
            kernel_ms = []
        if kernel_ms:
            own_by[label] = float(statistics.median(_per_call(kernel_ms, iters)))
    clocks = values.get(NCU_CLOCK_METRIC, [])
    return {
        "median_ms": float(statistics.median(_per_call(durations, iters))),
        "kernels_per_call": len(durations) // iters if iters > 0 and len(durations) % iters == 0 else 0,
        "sm_clock_mhz": float(statistics.median(clocks)) if clocks else None,
        "own_by": own_by,
    }


def ncu_median(name: str, iters: int, ncu: str, workdir: Path) -> dict[str, Any] | None:
    """ncu's figures for one workload; with the duration and clock alone where this ncu does not
    know one of the own-duration metrics (it then profiles nothing)."""
    value = _ncu_profile(name, iters, ncu, workdir, ncu_metric_names())
    if value is None:
        log(f"ncu: retrying {name} with {NCU_TIME_METRIC} and {NCU_CLOCK_METRIC} alone")
        value = _ncu_profile(name, iters, ncu, workdir, [NCU_TIME_METRIC, NCU_CLOCK_METRIC])
    return value


def _ncu_profile(name: str, iters: int, ncu: str, workdir: Path, metrics: list[str]) -> dict[str, Any] | None:
    log_path = workdir / f"ncu_{name}.log"
    command = [
        ncu,
        "--clock-control",
        "none",
        "--metrics",
        ",".join(metrics),
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
        log(f"ncu produced no {NCU_TIME_METRIC} rows for {name}: {text[-500:]}")
    return value


# ----------------------------------------------------------------------------- repeatability


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
            medians[name].append(float(entry["latency_ms_median"]))
    return medians


def spread(values: list[float]) -> float | None:
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values) - 1.0


def fmt(value: float | None, unit_us: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f}" if unit_us else f"{value * 100:.1f}%"


def ncu_reference_ms(name: str, ncu_row: dict[str, Any] | None) -> tuple[float | None, str]:
    """What benchmark() is compared with: ncu's gpu__time_duration, or for the small adds the
    kernel's own duration (:data:`NCU_OWN_MEASURE`)."""
    row = ncu_row or {}
    own = (row.get("own_by") or {}).get(NCU_OWN_MEASURE)
    if name in COMPARE_WITH_KERNEL_DURATION and own:
        return float(own), "kernel"
    value = row.get("median_ms")
    return (float(value), "duration") if value else (None, "-")


# What --defences-cost times: benchmark() as a program calls it (its defaults), and with fixed call
# counts and no clock warm-up, where the work done is the same on and off and only the defences'
# own work differs (the defaults size the counts from an estimate of one call, which moves).
DEFENCES_COST_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "fixed": {"warmup": 20, "repeat": 200, "clock_warmup_ms": 0},
}
# Rounds run first and thrown away: the first benchmark() of a process arms the timer (CUPTI's
# set-up) and the first rounds of a workload pay allocations, autotuning and clock ramp-up; kept,
# they read as a defence's cost of +200% or -40% (the H200, 2026-11-30 08:32).
DEFENCES_COST_DISCARDED_ROUNDS = 2


def defences_cost(workloads: list[str], rounds: int) -> dict[str, Any]:
    """What the integrity defences cost benchmark(), per workload and config, measured two ways.

    Timed inside: each report with the defences on gives the wall time its defence steps took
    (``integrity_details["defences_ms"]``) and its whole wall time (``wall_ms``); the cost is the
    median over the rounds of defences / (wall - defences), the share they add to a measurement.

    On against off: the same calls with ``defences=False`` in turns within each round (the order
    alternating), the cost being the median of each round's own wall-time ratio on/off. This one
    carries benchmark()'s own variation (its adaptive clock warm-up and hold fit), and is reported
    with its quartiles as a check on the first.

    Both after :data:`DEFENCES_COST_DISCARDED_ROUNDS` rounds thrown away.
    """
    results: dict[str, Any] = {}
    for name in workloads:
        for label, base_config in DEFENCES_COST_CONFIGS.items():
            walls: dict[bool, list[float]] = {True: [], False: []}
            medians: dict[bool, list[float]] = {True: [], False: []}
            shares: list[float] = []
            defences_ms: list[float] = []
            for round_index in range(DEFENCES_COST_DISCARDED_ROUNDS + rounds):
                order = (True, False) if round_index % 2 == 0 else (False, True)
                for defences in order:
                    started = time.perf_counter()
                    report = benchmark_report(name, {**base_config, "defences": defences})
                    if round_index >= DEFENCES_COST_DISCARDED_ROUNDS:
                        walls[defences].append(time.perf_counter() - started)
                        medians[defences].append(float(report["latency_ms_median"]))
                        if defences:
                            spent = float(report["integrity_details"]["defences_ms"]["total"])
                            defences_ms.append(spent)
                            shares.append(spent / max(1e-9, float(report["wall_ms"]) - spent))
            ratios = sorted(on / off for on, off in zip(walls[True], walls[False]))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
            row = {
                "workload": name,
                "config": label,
                "rounds": rounds,
                "wall_s_on": statistics.median(walls[True]),
                "wall_s_off": statistics.median(walls[False]),
                "cost": statistics.median(shares),
                "defences_ms": statistics.median(defences_ms),
                "cost_on_off": statistics.median(ratios) - 1.0,
                "cost_q1": quartiles[0] - 1.0,
                "cost_q3": quartiles[2] - 1.0,
                "median_ms_on": statistics.median(medians[True]),
                "median_ms_off": statistics.median(medians[False]),
                "walls_s": {"on": walls[True], "off": walls[False]},
            }
            results[f"{name}/{label}"] = row
            log(
                f"{name} ({label}): defences on {row['wall_s_on']:.3f} s, off {row['wall_s_off']:.3f} s, "
                f"defences {row['defences_ms']:.2f} ms, cost {row['cost']:+.2%} timed inside, "
                f"{row['cost_on_off']:+.1%} on/off (quartiles {row['cost_q1']:+.1%} to {row['cost_q3']:+.1%})"
            )
    return results


def print_defences_cost(results: dict[str, Any]) -> None:
    header = (
        f"{'workload':<20} {'config':<8} {'defences ms':>11} {'cost':>7} {'total s on':>11} {'total s off':>12} "
        f"{'on/off':>7} {'quartiles':>17} {'median us on':>13} {'off':>9} {'ok':>4}"
    )
    print(header)
    print("-" * len(header))
    for row in results.values():
        ok = "yes" if row["cost"] < DEFENCES_COST_LIMIT else "NO"
        spread_text = f"{row['cost_q1']:+.1%}..{row['cost_q3']:+.1%}"
        print(
            f"{row['workload']:<20} {row['config']:<8} {row['defences_ms']:>11.2f} {row['cost']:>+7.2%} "
            f"{row['wall_s_on']:>11.3f} {row['wall_s_off']:>12.3f} "
            f"{row['cost_on_off']:>+7.1%} {spread_text:>17} {fmt(row['median_ms_on']):>13} "
            f"{fmt(row['median_ms_off']):>9} {ok:>4}"
        )
    print(
        "(cost: the defence steps' wall time over the rest of benchmark()'s, timed inside each call, median; "
        "on/off: median of each round's wall time on/off, with its quartiles;\n"
        f" {DEFENCES_COST_DISCARDED_ROUNDS} rounds thrown away first; default = benchmark()'s defaults, "
        f"fixed = {DEFENCES_COST_CONFIGS['fixed']})"
    )


# ----------------------------------------------------------------------------- via the service


class Churn:
    """Keeps submitting context-creating programs from a background thread until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.completed = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kcoral-churn", daemon=True)

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PROGRAM_TIMEOUT_S)

    def _loop(self) -> None:
        from kcoral import Client, KCoralError, Program

        program = Program()
        module = program.upload(kind="module", source=CHURN_SOURCE)
        ping = program.get_function(module=module, name="ping", cpu_only=True)
        program.return_(key="pong", value=program.run(fn=ping))
        with Client(self.url) as client:
            while not self._stop.is_set():
                try:
                    result = client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
                except KCoralError as exc:
                    log(f"churn program refused: {exc}")
                    self.failed += 1
                    time.sleep(0.5)
                    continue
                if result.completed:
                    self.completed += 1
                else:
                    self.failed += 1
                    log(f"churn program failed: {result.error}")


def via_service(url: str, workloads: list[str], runs: int, churn: bool) -> dict[str, Any]:
    """Submit each workload as ``runs`` separate programs; return the reports and the spread."""
    from kcoral import Client, Program

    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in workloads}
    failures: list[str] = []
    spare_programs = 0
    started = time.perf_counter()
    with Client(url) as client, Churn(url) if churn else _NullContext() as churner:
        for run in range(runs):
            for name in workloads:
                program = Program()
                module = program.upload(kind="module", source=WORKLOAD_SOURCE)
                evaluate = program.get_function(module=module, name="evaluate")
                program.return_(key="report", value=program.run(fn=evaluate, args=[name]))
                result = client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
                if not result.completed:
                    failures.append(f"{name} run {run}: {result.error}")
                    log(f"{name} run {run + 1} failed: {result.error}")
                    continue
                report = dict(result.results["report"])
                report["lease_wait_ms"] = result.lease_wait_ms
                reports[name].append(report)
                log(f"{name} run {run + 1}/{runs}: {fmt(report['latency_ms_median'])} us")
        if isinstance(churner, Churn):
            spare_programs = churner.completed
    summary: dict[str, Any] = {"url": url, "runs": runs, "churn": churn, "wall_s": time.perf_counter() - started}
    summary["churn_programs_completed"] = spare_programs
    summary["failures"] = failures
    summary["workloads"] = {}
    for name, entries in reports.items():
        medians = [float(entry["latency_ms_median"]) for entry in entries]
        summary["workloads"][name] = {
            "medians_ms": medians,
            "median_of_medians_ms": float(statistics.median(medians)) if medians else None,
            "spread": spread(medians),
            "max_of_max_ms": max((float(entry["latency_ms_max"]) for entry in entries), default=None),
            "reports": entries,
        }
    return summary


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def judge_service(summary: dict[str, Any], ncu_rows: dict[str, Any] | None) -> None:
    """Add to each workload: how many programs read ok, the worst deviation from ncu, pass/fail."""
    for name, row in summary["workloads"].items():
        verdicts = [((entry.get("integrity") or {}).get("verdict")) for entry in row["reports"]]
        row["ok_programs"] = sum(1 for verdict in verdicts if verdict == "ok")
        row["suspect_reasons"] = [
            (entry.get("integrity") or {}).get("reasons")
            for entry in row["reports"]
            if entry.get("integrity") and entry["integrity"].get("verdict") != "ok"
        ]
        reference, against = ncu_reference_ms(name, (ncu_rows or {}).get(name, {}).get("ncu"))
        row["ncu_ms"], row["ncu_against"] = reference, against
        medians = row["medians_ms"]
        row["ncu_worst"] = max((abs(m / reference - 1) for m in medians), default=None) if reference else None
        row["pass"] = (
            bool(medians)
            and row["ok_programs"] == len(medians)
            and (row["spread"] is None or row["spread"] <= SPREAD_TOLERANCE)
            and (row["ncu_worst"] is None or row["ncu_worst"] <= NCU_TOLERANCE)
        )


def print_service_table(summary: dict[str, Any]) -> None:
    print(f"service {summary['url']}  runs={summary['runs']}  churn={summary['churn']}", end="")
    print(f"  churn programs completed={summary['churn_programs_completed']}")
    header = (
        f"{'workload':<20} {'median us':>10} {'min us':>9} {'max us':>9} {'spread':>8} {'max-of-max us':>14} "
        f"{'ok':>5} {'ncu us':>9} {'worst vs ncu':>13} {'pass':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, row in summary["workloads"].items():
        medians = row["medians_ms"]
        worst = row.get("ncu_worst")
        against = (row.get("ncu_against") or "-")[0]
        print(
            f"{name:<20} {fmt(row['median_of_medians_ms']):>10} {fmt(min(medians) if medians else None):>9} "
            f"{fmt(max(medians) if medians else None):>9} {fmt(row['spread'], unit_us=False):>8} "
            f"{fmt(row['max_of_max_ms']):>14} {row.get('ok_programs', '-')!s:>2}/{len(medians):<2} "
            f"{fmt(row.get('ncu_ms')):>9} {(f'{worst:.1%}' + against) if worst is not None else '-':>13} "
            f"{('yes' if row.get('pass') else 'NO'):>5}"
        )
        print("    medians us: " + " ".join(fmt(value) for value in medians))
        for reasons in row.get("suspect_reasons") or []:
            print(f"    suspect: {reasons}")
    print(
        f"(pass: every program ok, spread <= {SPREAD_TOLERANCE:.0%}, every median within {NCU_TOLERANCE:.0%} of ncu; "
        "worst vs ncu: d = gpu__time_duration, k = the kernel's own duration)"
    )


# ----------------------------------------------------------------------------- main


def in_process(args: argparse.Namespace) -> int:
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
    null: dict[str, Any] | None = None
    if ncu is not None and COMPARE_WITH_KERNEL_DURATION & set(args.workloads):
        null = ncu_median(NULL_KERNEL, args.ncu_iters, ncu, workdir)
        log(f"ncu: a kernel that does nothing reads {json.dumps(null)}")
    for name in args.workloads:
        log(f"{name}: benchmark() and CUDA events in this process")
        started = time.perf_counter()
        row: dict[str, Any] = {"benchmark": benchmark_report(name)}
        row["benchmark_wall_s"] = round(time.perf_counter() - started, 3)
        if args.variants:
            row["benchmark_no_hold"] = benchmark_report(name, {"launch_hold": False})
            row["benchmark_no_flush"] = benchmark_report(name, {"flush_l2": False})
        row["cuda_event_median_ms"] = cuda_event_median(make_workload(name))
        torch.cuda.empty_cache()
        if ncu is None:
            row["ncu"] = None
        elif NCU_SAME_AS.get(name) in rows:
            row["ncu"] = rows[NCU_SAME_AS[name]]["ncu"]
        else:
            row["ncu"] = ncu_median(name, args.ncu_iters, ncu, workdir)
        if row["ncu"] and null and name in COMPARE_WITH_KERNEL_DURATION:
            row["ncu"] = {**row["ncu"], "null_kernel": null}
        log(f"{name}: {json.dumps(row, default=str)}")
        rows[name] = row
        if args.json:  # after each workload, so a run cut short keeps what it measured
            args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "workloads": rows}, default=str))

    if args.runs > 0:
        for name, values in repeat_runs(args.workloads, args.runs).items():
            rows[name]["fresh_medians_ms"] = values
            rows[name]["spread"] = spread(values)

    columns: list[tuple[str, str]] = [("workload", "<20"), ("benchmark us", ">13"), ("method", ">10")]
    columns += [("events us", ">10"), ("ncu us", ">9"), ("bench/ncu", ">10"), ("ncu MHz", ">8")]
    columns += [("bench MHz", ">10"), ("runs", ">5"), ("spread", ">8")]
    header = " ".join(f"{title:{align}}" for title, align in columns)
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        bench = row["benchmark"]
        ncu_row = row["ncu"] or {}
        ncu_ms, against = ncu_reference_ms(name, row["ncu"])
        ratio = f"{bench['latency_ms_median'] / ncu_ms - 1:+.1%}{against[0]}" if ncu_ms else "-"
        ncu_mhz = ncu_row.get("sm_clock_mhz")
        print(
            f"{name:<20} {fmt(bench['latency_ms_median']):>13} {bench['method']:>10} "
            f"{fmt(row['cuda_event_median_ms']):>10} {fmt(ncu_ms):>9} {ratio:>10} "
            f"{(f'{ncu_mhz:.0f}' if ncu_mhz else '-'):>8} {bench['sm_clock_mhz_after'] or '-':>10} "
            f"{len(row.get('fresh_medians_ms', [])):>5} {fmt(row.get('spread'), unit_us=False):>8}"
        )
    print("(bench/ncu: d = against ncu's gpu__time_duration, k = against the kernel's own duration)")
    print()
    print("benchmark() medians by way of measuring (us):")
    for name, row in rows.items():
        for label in ("benchmark", "benchmark_no_hold", "benchmark_no_flush"):
            if label in row:
                by = row[label]["latency_ms_median_by"] or {}
                parts = " ".join(f"{key}={fmt(value)}" for key, value in by.items())
                print(
                    f"  {name:<20} {label:<19} {parts}  hold={row[label]['launch_hold_us']}us "
                    f"late={row[label]['launch_late_calls']} per_call={row[label]['activities_per_call']}"
                )
    if args.json:
        payload = {"gpu": torch.cuda.get_device_name(), "ncu": ncu, "workloads": rows}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--runs", type=int, default=0, help="fresh processes (or programs) for repeatability")
    parser.add_argument("--ncu-iters", type=int, default=20, help="calls profiled by ncu per workload")
    parser.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute even if ncu is on PATH")
    parser.add_argument("--variants", action="store_true", help="also benchmark() without hold and without flush")
    parser.add_argument("--via-service", metavar="URL", help="submit the workloads as programs to this service")
    parser.add_argument("--churn", action="store_true", help="with --via-service: keep spare contexts starting")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--ncu-json",
        type=Path,
        help="with --via-service: an in-process run's --json, whose ncu medians to compare with",
    )
    parser.add_argument(
        "--defences-cost",
        type=int,
        metavar="ROUNDS",
        default=0,
        help="time benchmark() with and without its integrity defences, alternating, ROUNDS each",
    )
    parser.add_argument("--child-repeat", nargs="+", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--child-ncu", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child_repeat:
        child_repeat(args.child_repeat)
        return 0
    if args.child_ncu:
        child_ncu(args.child_ncu, args.ncu_iters)
        return 0
    if args.defences_cost:
        results = defences_cost(args.workloads, args.defences_cost)
        print_defences_cost(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
        return 0 if all(row["cost"] < DEFENCES_COST_LIMIT for row in results.values()) else 1
    if args.via_service:
        summary = via_service(args.via_service, args.workloads, max(1, args.runs), args.churn)
        ncu_rows = None
        if args.ncu_json is not None and args.ncu_json.is_file():
            ncu_rows = json.loads(args.ncu_json.read_text()).get("workloads")
        elif args.ncu_json is not None:
            log(f"{args.ncu_json} is missing: no comparison with ncu")
        judge_service(summary, ncu_rows)
        print_service_table(summary)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2, default=str))
            log(f"wrote {args.json}")
        return 0 if not summary["failures"] else 1
    return in_process(args)


if __name__ == "__main__":
    sys.exit(main())
