"""Fresh workers: programs per second through zygote-forked workers, against a subprocess each.

    python benchmarks/spawn.py [--programs 300] [--in-flight 8] [--sandbox none|bubblewrap|both]
                               [--workers N] [--all-gpus | --fake-gpus N] [--json out.json]
    python benchmarks/spawn.py --checkout MAIN_TREE --checkout BRANCH_TREE --rounds 6 [--programs 40] ...

Measured in one run, for a program that returns a constant from an uploaded function (its module
imports torch, which the zygote has already imported):
- programs per second one at a time (one Client) and with ``--in-flight`` at once (one AsyncClient),
  each program in a fresh worker process, per sandbox setting;
- the same rates for what ``subprocess.run([python, "-c", "import torch; print(1)"])`` harnesses do:
  a new interpreter per program, one at a time and ``--in-flight`` at once;
- the time from a worker's exit to its replacement being READY, from the wall-clock times each
  worker reports (``result.worker``: ``finished_at`` of one program, ``started_at`` and
  ``ready_at`` of the next worker of the same slot). On a host with a GPU that broker runs with
  ``KCORAL_EAGER_CUDA=1``, so READY there includes the new worker's CUDA context; the cold start it
  replaces (``import torch`` and a CUDA context in a new interpreter) is measured beside it. The
  rate measurements leave CUDA lazy (the default): the constant program never initialises it.
- with GPUs (``--all-gpus`` on a GPU host, ``--fake-gpus N`` anywhere) and bubblewrap, each worker
  confines itself to its program's GPU before the program runs: the median time it took
  (``result.worker["confinement_ms"]``) is reported beside the rates.

With ``--checkout`` (twice or more) it compares versions instead, in one run: a broker per source
tree and sandbox, all started at once, and the two rates measured in turns (the order rotating each
round) for ``--rounds`` rounds, so that a load that comes and goes on a shared machine falls on
each version alike; the table gives the median of the rounds and each tree's ratio to the first,
and the CPU time the service (broker, zygotes, workers) spent per program, which a shared machine's
load disturbs much less than the rates.

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, host_gpu_count, machine, print_table, progress, save_json
from kcoral import AsyncClient, Client, Program, ProgramResult

CONSTANT_SOURCE = "import torch\n\n\ndef constant():\n    return 1\n"
SUBPROCESS_ARGV = (sys.executable, "-c", "import torch; print(1)")
COLD_CUDA_ARGV = (sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); print(1)")
REPLACEMENT_PAUSE_SECONDS = 2.0  # between the programs of the replacement measurement: all idle, all ready


def log(message: str) -> None:
    print(f"[spawn] {message}", file=sys.stderr, flush=True)


def constant_program() -> Program:
    program = Program()
    module = program.upload(kind="module", source=CONSTANT_SOURCE)
    constant = program.get_function(module=module, name="constant")
    program.return_(key="v", value=program.run(fn=constant))
    return program


def check(result: ProgramResult) -> None:
    if not result.completed or result.results.get("v") != 1:
        raise RuntimeError(f"the benchmark program failed: {result!r} {result.error}")


CONFINEMENT_MS: list[float] = []  # result.worker["confinement_ms"] of the sequential runs


def sequential_rate(url: str, count: int, label: str) -> float:
    program = constant_program()
    CONFINEMENT_MS.clear()
    with Client(url) as client:
        for _ in range(min(8, count)):  # warm-up: connections, blob cache
            check(client.execute(program))
        start = time.perf_counter()
        for done in range(1, count + 1):
            result = client.execute(program)
            check(result)
            if result.worker.get("confinement_ms") is not None:
                CONFINEMENT_MS.append(float(result.worker["confinement_ms"]))
            progress(label, done, count)
        return count / (time.perf_counter() - start)


async def concurrent_rate(url: str, count: int, in_flight: int, label: str) -> float:
    program = constant_program()
    async with AsyncClient(url) as client:
        await asyncio.gather(*(client.execute(program) for _ in range(in_flight)))  # warm-up
        gate = asyncio.Semaphore(in_flight)
        done = 0

        async def one() -> None:
            nonlocal done
            async with gate:
                check(await client.execute(program))
            done += 1
            progress(label, done, count)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        return count / (time.perf_counter() - start)


def replacement_times(url: str, count: int) -> dict[str, float]:
    """Median ms from a worker's exit to the next worker of its slot: forked, READY."""
    program = constant_program()
    results: list[ProgramResult] = []
    with Client(url) as client:
        for done in range(1, count + 1):
            time.sleep(REPLACEMENT_PAUSE_SECONDS)
            result = client.execute(program)
            check(result)
            results.append(result)
            progress("exit -> READY", done, count)
    by_slot: dict[int, list[dict[str, Any]]] = {}
    for result in results:
        by_slot.setdefault(int(result.worker["slot"]), []).append(result.worker)
    forked, ready, context = [], [], []
    for workers in by_slot.values():
        for before, after in itertools.pairwise(workers):
            forked.append((after["started_at"] - before["finished_at"]) * 1000)
            ready.append((after["ready_at"] - before["finished_at"]) * 1000)
            context.append((after["ready_at"] - after["started_at"]) * 1000)
    if not ready:
        raise RuntimeError("no slot ran two programs: cannot measure replacements")
    return {
        "exit_to_worker_started_ms": statistics.median(forked),
        "worker_started_to_ready_ms": statistics.median(context),
        "exit_to_ready_ms": statistics.median(ready),
        "exit_to_ready_max_ms": max(ready),
        "samples": float(len(ready)),
    }


def subprocess_rates(count: int, in_flight: int) -> tuple[float, float]:
    def one(_: int) -> None:
        subprocess.run(SUBPROCESS_ARGV, check=True, capture_output=True)

    start = time.perf_counter()
    for done in range(1, count + 1):
        one(done)
        progress("subprocess, one at a time", done, count)
    sequential = count / (time.perf_counter() - start)
    start = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        for done, _ in enumerate(pool.map(one, range(count)), 1):
            progress(f"subprocess, {in_flight} at once", done, count)
    return sequential, count / (time.perf_counter() - start)


def cold_cuda_start_ms(runs: int) -> float:
    samples = []
    for done in range(1, runs + 1):
        start = time.perf_counter()
        subprocess.run(COLD_CUDA_ARGV, check=True, capture_output=True)
        samples.append((time.perf_counter() - start) * 1000)
        progress("cold import torch + CUDA context", done, runs)
    return statistics.median(samples)


def broker_flags(sandbox: str, workers: int, gpu: bool, all_gpus: bool = False, fake_gpus: int = 0) -> list[str]:
    """``workers`` slots in all; on GPU 0 alone, or spread over every GPU with ``all_gpus`` (each
    program then runs on one of them, and in bubblewrap its worker keeps only that GPU's node),
    or over ``fake_gpus`` fake GPUs (stand-in device nodes: the same confinement, on a CPU host)."""
    if fake_gpus:
        slots = ["--fake-gpus", str(fake_gpus), "--workers-per-gpu", str(max(1, workers // fake_gpus))]
    elif gpu and all_gpus:
        slots = ["--device", "gpu", "--workers-per-gpu", str(max(1, workers // max(1, host_gpu_count())))]
    elif gpu:
        slots = ["--device", "gpu", "--gpus", "0", "--workers-per-gpu", str(workers)]
    else:
        slots = ["--workers", str(workers)]
    return [*slots, "--sandbox", sandbox]


def service_cpu_seconds(broker_pid: int) -> float:
    """CPU seconds used so far by a broker and every process below it, reaped ones included (a
    process's ``children_*`` times are its reaped children's). On a loaded machine this moves far
    less than a rate does: on two shared cores the rate is the cores over this, per program."""
    try:
        root = psutil.Process(broker_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for process in tree:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def compare_checkouts(args: argparse.Namespace, workers: int, gpu: bool) -> int:
    """The rates of each source tree and sandbox, measured in turns; medians and ratios."""
    checkouts = [Path(c).resolve() for c in args.checkout]
    sandboxes = ("none", "bubblewrap") if args.sandbox == "both" else (args.sandbox,)
    cases = [(c, s) for s in sandboxes for c in checkouts]
    rates: dict[tuple[Path, str], list[tuple[float, float, float]]] = {case: [] for case in cases}
    with contextlib.ExitStack() as stack:
        urls, pids = {}, {}
        for checkout, sandbox in cases:
            log(f"starting a broker from {checkout}, sandbox {sandbox}")
            urls[checkout, sandbox], process = stack.enter_context(
                broker(*broker_flags(sandbox, workers, gpu, args.all_gpus, args.fake_gpus), checkout=checkout)
            )
            pids[checkout, sandbox] = process.pid
        for round_ in range(args.rounds):
            for checkout, sandbox in cases[round_ % len(cases) :] + cases[: round_ % len(cases)]:
                label = f"round {round_ + 1}, {checkout.name}, {sandbox}"
                url = urls[checkout, sandbox]
                cpu_before = service_cpu_seconds(pids[checkout, sandbox])
                one = sequential_rate(url, args.programs, f"{label}, one at a time")
                many = asyncio.run(
                    concurrent_rate(url, args.programs, args.in_flight, f"{label}, {args.in_flight} at once")
                )
                cpu_ms = (service_cpu_seconds(pids[checkout, sandbox]) - cpu_before) * 1000 / (2 * args.programs)
                rates[checkout, sandbox].append((one, many, cpu_ms))
    report: dict[str, Any] = {"machine": machine(), "gpu": gpu, "workers": workers, "rounds": args.rounds, "cases": []}
    rows: list[list[Any]] = []
    for sandbox in sandboxes:
        first = None
        for checkout in checkouts:
            runs = rates[checkout, sandbox]
            one = statistics.median(r[0] for r in runs)
            many = statistics.median(r[1] for r in runs)
            cpu_ms = statistics.median(r[2] for r in runs)
            first = first or (one, many, cpu_ms)
            rows.append(
                [
                    f"{checkout}, sandbox {sandbox}",
                    one,
                    many,
                    one / first[0],
                    many / first[1],
                    cpu_ms,
                    cpu_ms / first[2],
                ]
            )
            report["cases"].append(
                {
                    "checkout": str(checkout),
                    "sandbox": sandbox,
                    "sequential_per_s": one,
                    "concurrent_per_s": many,
                    "service_cpu_ms_per_program": cpu_ms,
                    "rounds": runs,
                }
            )
    print_table(
        f"Programs per second, median of {args.rounds} rounds ({machine()}, {workers} worker slot(s), GPU: {gpu})",
        [
            "source tree",
            "one at a time",
            f"{args.in_flight} in flight",
            "ratio (one)",
            f"ratio ({args.in_flight})",
            "service CPU ms/program",
            "ratio (CPU)",
        ],
        rows,
    )
    save_json(args.json, report)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=300, help="programs per kcoral measurement")
    parser.add_argument("--subprocess-runs", type=int, default=16, help="interpreters per subprocess measurement")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--sandbox", choices=("none", "bubblewrap", "both"), default="none")
    parser.add_argument("--workers", type=int, default=None, help="worker slots (default: CPU cores, at most 8)")
    parser.add_argument("--replacements", type=int, default=8, help="programs for the exit -> READY measurement")
    parser.add_argument("--all-gpus", action="store_true", help="slots on every GPU, not GPU 0 alone")
    parser.add_argument("--fake-gpus", type=int, default=0, help="slots on N fake GPUs (a host without GPUs)")
    parser.add_argument("--json", default=None, help="save the numbers here")
    parser.add_argument("--checkout", action="append", default=None, help="compare brokers run from these trees")
    parser.add_argument("--rounds", type=int, default=6, help="turns per tree and sandbox (with --checkout)")
    args = parser.parse_args()

    gpu = host_gpu_count() > 0
    workers = args.workers or min(8, os.cpu_count() or 2)
    sandboxes = ("none", "bubblewrap") if args.sandbox == "both" else (args.sandbox,)
    log(f"{machine()}; GPU: {gpu}; {workers} worker slot(s); sandbox: {', '.join(sandboxes)}")
    if args.checkout:
        return compare_checkouts(args, workers, gpu)

    report: dict[str, Any] = {
        "machine": machine(),
        "gpu": gpu,
        "gpus": args.fake_gpus or (host_gpu_count() if gpu and args.all_gpus else int(gpu)),
        "workers": workers,
        "in_flight": args.in_flight,
    }
    rows: list[list[Any]] = []
    for sandbox in sandboxes:
        log(f"starting a broker, sandbox {sandbox}")
        try:
            flags = broker_flags(sandbox, workers, gpu, args.all_gpus, args.fake_gpus)
            with broker(*flags) as (url, _process):
                one = sequential_rate(url, args.programs, f"kcoral {sandbox}, one at a time")
                confinement = statistics.median(CONFINEMENT_MS) if CONFINEMENT_MS else None
                many = asyncio.run(
                    concurrent_rate(url, args.programs, args.in_flight, f"kcoral {sandbox}, {args.in_flight} at once")
                )
        except RuntimeError as exc:  # a broker that cannot start here (no bwrap, say): say so, go on
            log(f"sandbox {sandbox}: {exc}")
            rows.append([f"kcoral, zygote fork, sandbox {sandbox}", "failed", "failed"])
            continue
        log(f"sandbox {sandbox}: {one:.1f}/s one at a time, {many:.1f}/s {args.in_flight} at once")
        log(f"sandbox {sandbox}: worker confinement, median ms: {confinement}")
        report[f"kcoral_{sandbox}"] = {"sequential_per_s": one, "concurrent_per_s": many, "confinement_ms": confinement}
        rows.append([f"kcoral, zygote fork, sandbox {sandbox}", one, many])
        if confinement is not None:
            rows.append([f"  worker confinement to its GPU, median ms ({sandbox})", confinement, ""])
    measured = [s for s in sandboxes if f"kcoral_{s}" in report]
    if not measured:
        return 1

    sub_one, sub_many = subprocess_rates(args.subprocess_runs, args.in_flight)
    report["subprocess"] = {"sequential_per_s": sub_one, "concurrent_per_s": sub_many}
    rows.append(["subprocess.run(python -c 'import torch')", sub_one, sub_many])
    best = report[f"kcoral_{measured[0]}"]
    rows.append(["ratio kcoral / subprocess", best["sequential_per_s"] / sub_one, best["concurrent_per_s"] / sub_many])
    if len(measured) == 2:
        plain, boxed = report["kcoral_none"], report["kcoral_bubblewrap"]
        cost = {k: 1 - boxed[k] / plain[k] for k in ("sequential_per_s", "concurrent_per_s")}
        report["sandbox_cost"] = cost
        rows.append(["bubblewrap cost (1 - boxed/plain)", cost["sequential_per_s"], cost["concurrent_per_s"]])
    print_table(
        f"Programs per second ({machine()}, {workers} worker slot(s), GPUs: {report['gpus']})",
        ["what", "one at a time", f"{args.in_flight} in flight"],
        rows,
    )

    log("measuring exit -> READY (sandbox none, one slot" + (", KCORAL_EAGER_CUDA=1)" if gpu else ")"))
    if gpu:
        os.environ["KCORAL_EAGER_CUDA"] = "1"  # inherited by the broker, then by its zygotes
    try:
        with broker(*broker_flags("none", 1, gpu)) as (url, _process):
            replacement = replacement_times(url, args.replacements)
    finally:
        os.environ.pop("KCORAL_EAGER_CUDA", None)
    report["replacement"] = replacement
    timing_rows: list[list[Any]] = [
        ["worker exit -> next worker forked and running", replacement["exit_to_worker_started_ms"]],
        [
            "next worker running -> READY" + (" (CUDA context made)" if gpu else ""),
            replacement["worker_started_to_ready_ms"],
        ],
        ["worker exit -> replacement READY (median)", replacement["exit_to_ready_ms"]],
        ["worker exit -> replacement READY (max)", replacement["exit_to_ready_max_ms"]],
    ]
    if gpu:
        report["cold_cuda_start_ms"] = cold_cuda_start_ms(3)
        timing_rows.append(["cold start: new interpreter, import torch, CUDA context", report["cold_cuda_start_ms"]])
    print_table("Replacement worker (ms)", ["what", "ms"], timing_rows)
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
