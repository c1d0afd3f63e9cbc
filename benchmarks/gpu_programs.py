"""Fresh GPU programs: what a program that makes a CUDA context costs through KCoral, beside the
driver's floor measured in the same run.

    python benchmarks/gpu_programs.py [--sequential 60] [--concurrent 40] [--in-flight 8]
        [--config NAME CHECKOUT FLAGS ...] [--timing NAME[+churn] ...] [--timing-runs 4]
        [--floor-rounds 3] [--session NAME ...] [--json out.json]

The program: a CUDA context (its first tensor on the GPU), an add of 1M floats, a synchronise, a
float back; ``--sequential`` of them one at a time, then ``--concurrent`` with ``--in-flight`` at
once, all through one public :class:`kcoral.AsyncClient`; latency is the client's (submit to
result), p50 and p99, and programs per second with several in flight.

Each ``--config NAME CHECKOUT FLAGS`` is a broker: the source tree it runs from (``.``: this one)
and its flags (``--sandbox`` is the broker's default, bubblewrap, unless given), measured in the
order given. ``--timing NAME`` also submits ``benchmarks/timing.py``'s honest workloads to that
broker as separate programs (``--timing-runs`` each) and reports their medians' spread and worst
single call; ``NAME+churn`` does it while a second client keeps programs that make and drop CUDA
contexts on the same GPU running beside them (what spares made ahead do at worst). ``--session
NAME`` measures that broker again through a client session (``AsyncClient(session=True)``: the
client's programs share one worker and its CUDA context), and says how many workers served it.

The floor (``--floor-rounds``, 0 for none): in this process, which imports torch and never
initialises CUDA, fork K children at once (K = 1, 4, 8) that each make a context, run one add
and synchronise; then SIGKILL them all and reap them: the time to create (fork to the add done) and
to reap (kill to reaped), each child and all K, and K over the two makespans, the most fresh
contexts the driver gives one GPU per second at that concurrency.

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, host_gpu_count, machine, percentiles, print_table, save_json
from kcoral import AsyncClient, Program, ProgramResult

GPU_PROGRAM_SOURCE = """
import torch


def add(device):
    x = torch.ones(1 << 20, device=device)
    y = x + x
    if device == "cuda":
        torch.cuda.synchronize()
    return float(y[0])
"""
PROGRAM_TIMEOUT_S = 120
WARMUP_PROGRAMS = 4
SETTLE_SECONDS = 1.5  # after the broker is ready: the spares forked ahead make their contexts
FLOOR_CONCURRENCY = (1, 4, 8)
FLOOR_CHILD_TIMEOUT_S = 60
TIMING_WORKLOADS = ("add_16m_f32", "add_256k_f32", "matmul_4096_bf16", "matmul_side_stream")


def log(message: str) -> None:
    print(f"[gpu_programs] {message}", file=sys.stderr, flush=True)


def gpu_program(device: str) -> Program:
    program = Program()
    module = program.upload(kind="module", source=GPU_PROGRAM_SOURCE)
    add = program.get_function(module=module, name="add")
    program.return_(key="v", value=program.run(fn=add, args=[device]))
    return program


def check(result: ProgramResult) -> None:
    if not result.completed or result.results.get("v") != 2.0:
        raise RuntimeError(f"the GPU program failed: {result.error}")


async def measure(
    url: str, sequential: int, concurrent: int, in_flight: int, device: str, session: bool = False
) -> dict[str, Any]:
    """The issue's measurement: ``sequential`` programs one at a time, then ``concurrent`` with
    ``in_flight`` at once, through one AsyncClient (``device`` "cpu": a dry run without a GPU).
    ``session``: the client's programs share one worker and its CUDA context (``session=True``)."""
    program = gpu_program(device)
    async with AsyncClient(url, session=session) as client:
        for _ in range(WARMUP_PROGRAMS):
            check(await client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S))
        await asyncio.sleep(SETTLE_SECONDS)
        one_ms: list[float] = []
        one_results: list[ProgramResult] = []
        for _ in range(sequential):
            start = time.perf_counter()
            result = await client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
            one_ms.append((time.perf_counter() - start) * 1000)
            check(result)
            one_results.append(result)
        await asyncio.sleep(SETTLE_SECONDS)
        gate = asyncio.Semaphore(in_flight)

        async def one() -> tuple[float, ProgramResult]:
            async with gate:
                start = time.perf_counter()
                result = await client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
                return (time.perf_counter() - start) * 1000, result

        started = time.perf_counter()
        many = await asyncio.gather(*(one() for _ in range(concurrent)))
        elapsed = time.perf_counter() - started
    for _, result in many:
        check(result)
    many_ms = [ms for ms, _ in many]
    return {
        "sequential": percentiles(one_ms),
        "sequential_lease_wait_ms_p50": statistics.median(r.lease_wait_ms for r in one_results),
        "sequential_elapsed_ms_p50": statistics.median(r.elapsed_ms for r in one_results),
        "concurrent": percentiles(many_ms),
        "concurrent_per_s": concurrent / elapsed,
        "concurrent_lease_wait_ms_p50": statistics.median(r.lease_wait_ms for _, r in many),
        "in_flight": in_flight,
        "session": session,
        "sessions_seen": len({r.worker.get("identity") for r in one_results if isinstance(r.worker, dict)}),
    }


def timing(url: str, runs: int, churn: bool) -> dict[str, Any]:
    """benchmark.py's honest workloads as ``runs`` programs each: medians, spread, worst call, verdicts."""
    from benchmarks.timing import judge_service, via_service

    summary = via_service(url, list(TIMING_WORKLOADS), runs, churn)
    judge_service(summary, None)
    rows = {}
    for name, row in summary["workloads"].items():
        rows[name] = {
            "median_of_medians_ms": row["median_of_medians_ms"],
            "spread": row["spread"],
            "max_of_max_ms": row["max_of_max_ms"],
            "ok_programs": row["ok_programs"],
            "programs": len(row["medians_ms"]),
            "suspect_reasons": row["suspect_reasons"],
            "medians_ms": row["medians_ms"],
            # How far each program's device records were moved onto the host's clock (see
            # kcoral.timing.windows.clock_offsets): 0 where the two clocks agree.
            "clock_offsets_us": [
                (entry.get("integrity_details") or {}).get("clock_offset_us") for entry in row["reports"]
            ],
            # How much of the clock check's allowance each program's CUPTI clock used (0: inside every
            # bracket of the host's readings; past 1 the measurement fails with integrity).
            "clock_stray_shares": [
                (entry.get("integrity_details") or {}).get("clock_stray_share") for entry in row["reports"]
            ],
        }
    return {"churn": churn, "churn_programs": summary["churn_programs_completed"], "workloads": rows}


def _largest_share(shares: list[float | None]) -> str:
    """The largest share of the clock check's allowance a program used, in %; "-" where none said."""
    known = [share for share in shares if share is not None]
    return f"{max(known) * 100:.1f}" if known else "-"


# --- the driver's floor ---------------------------------------------------------------------------


def _child(report_fd: int) -> None:
    """In a forked child: a context, an add of 1M floats, a synchronise; say so, then wait to be killed."""
    code = 1
    try:
        import torch

        x = torch.ones(1 << 20, device="cuda")
        y = x + x
        torch.cuda.synchronize()
        assert float(y[0]) == 2.0
        os.write(report_fd, f"{time.monotonic()}\n".encode())
        while True:
            time.sleep(60)
    except BaseException as exc:
        os.write(report_fd, f"error {exc!r}\n".encode())
        code = 2
    finally:
        os._exit(code)


def floor_round(count: int) -> dict[str, Any]:
    """Fork ``count`` children at once, each makes a context; then kill and reap them all."""
    read_fd, write_fd = os.pipe()
    forked_at: dict[int, float] = {}
    for _ in range(count):
        at = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(write_fd)
        forked_at[pid] = at
    os.close(write_fd)
    first_fork = min(forked_at.values())
    done: list[float] = []
    buffer = b""
    deadline = time.monotonic() + FLOOR_CHILD_TIMEOUT_S
    while len(done) < count and time.monotonic() < deadline:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            break
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.startswith(b"error"):
                raise RuntimeError(f"a floor child failed: {line.decode()}")
            done.append(float(line))
    os.close(read_fd)
    created = max(done) if done else time.monotonic()
    killed_at = time.monotonic()
    for pid in forked_at:
        os.kill(pid, signal.SIGKILL)
    reaped: list[float] = []
    for pid in forked_at:
        os.waitpid(pid, 0)
        reaped.append(time.monotonic())
    if len(done) < count:
        raise RuntimeError(f"only {len(done)} of {count} floor children made their context")
    create_ms = [(t - first_fork) * 1000 for t in done]
    reap_ms = [(t - killed_at) * 1000 for t in reaped]
    return {
        "create_ms_each_median": statistics.median(create_ms),
        "create_ms_all": (created - first_fork) * 1000,
        "reap_ms_each_median": statistics.median(reap_ms),
        "reap_ms_all": max(reap_ms),
    }


def floor(rounds: int) -> dict[str, Any]:
    import torch  # imported, never initialised here: each child makes its own context

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the parent: the children would inherit it")
    report: dict[str, Any] = {}
    for count in FLOOR_CONCURRENCY:
        samples = [floor_round(count) for _ in range(rounds)]
        merged = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        merged["contexts_per_s"] = count / ((merged["create_ms_all"] + merged["reap_ms_all"]) / 1000)
        report[str(count)] = merged
        log(f"floor, {count} at once: {merged}")
    return report


# --- the run ----------------------------------------------------------------------------------------


def figures(measured: dict[str, Any], middle: str) -> list[Any]:
    """A table row's figures of one measurement: one at a time (p50, p99), ``middle``, then with
    several in flight (p50, p99, programs per second)."""
    one, many, rate = measured["sequential"], measured["concurrent"], measured["concurrent_per_s"]
    return [one["p50_ms"], one["p99_ms"], measured[middle], many["p50_ms"], many["p99_ms"], rate]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", type=int, default=60)
    parser.add_argument("--concurrent", type=int, default=40)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument(
        "--config",
        nargs=3,
        action="append",
        metavar=("NAME", "CHECKOUT", "FLAGS"),
        default=None,
        help="a broker to measure: its name, source tree ('.': this one) and flags",
    )
    parser.add_argument("--timing", action="append", default=[], help="NAME or NAME+churn: also time workloads")
    parser.add_argument("--timing-runs", type=int, default=4)
    parser.add_argument("--floor-rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--session", action="append", default=[], help="NAME: also measure that broker through a client session"
    )
    args = parser.parse_args()

    here = Path(__file__).resolve().parent.parent
    device = "cuda" if host_gpu_count() else "cpu"  # without a GPU: the same steps on the CPU, as a dry run
    configs = args.config or [["defaults", ".", ""]]
    report: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.floor_rounds and device == "cuda":
        report["floor"] = floor(args.floor_rounds)
    report["configs"] = {}
    timed: dict[str, list[bool]] = {}
    for wanted in args.timing:
        timed.setdefault(wanted.split("+")[0], []).append(wanted.endswith("+churn"))
    for name, checkout, flags in configs:
        tree = here if checkout == "." else Path(checkout).resolve()
        log(f"{name}: {tree} {flags}")
        entry: dict[str, Any] = {"checkout": str(tree), "flags": flags}
        try:
            with broker(*shlex.split(flags), checkout=None if tree == here else tree) as (url, _process):
                entry.update(asyncio.run(measure(url, args.sequential, args.concurrent, args.in_flight, device)))
                if name in args.session:
                    entry["in_session"] = asyncio.run(
                        measure(url, args.sequential, args.concurrent, args.in_flight, device, session=True)
                    )
                if device == "cuda":
                    entry["timing"] = [timing(url, args.timing_runs, churn) for churn in timed.get(name, [])]
        except Exception as exc:
            log(f"{name} failed: {exc!r}")
            entry["error"] = repr(exc)
        report["configs"][name] = entry
        save_json(args.json, report)

    title = f"GPU program (context, 1M-float add, sync) through AsyncClient ({report['machine']}, {report['date']})"
    rows = []
    for name, entry in report["configs"].items():
        if "error" in entry:
            rows.append([name, entry["flags"], "failed", "", "", "", "", ""])
            continue
        rows.append([name, entry["flags"] or "(defaults)", *figures(entry, "sequential_lease_wait_ms_p50")])
    header = [
        "broker",
        "flags",
        "seq p50 ms",
        "seq p99 ms",
        "seq lease wait ms",
        "8 in flight p50 ms",
        "p99 ms",
        "per s",
    ]
    print_table(title, header, rows)
    session_rows = [
        [name, *figures(one, "sessions_seen")]
        for name, entry in report["configs"].items()
        if (one := entry.get("in_session"))
    ]
    if session_rows:
        print_table(
            "The same program in one client session (AsyncClient(session=True): one worker, one CUDA context)",
            ["broker", "seq p50 ms", "seq p99 ms", "workers seen", "8 in flight p50 ms", "p99 ms", "per s"],
            session_rows,
        )
    if "floor" in report:
        print_table(
            "The driver's floor: K children forked from a torch parent make a context and one add, then SIGKILL",
            ["K at once", "create ms (each)", "create ms (all)", "reap ms (each)", "reap ms (all)", "contexts/s"],
            [
                [
                    k,
                    v["create_ms_each_median"],
                    v["create_ms_all"],
                    v["reap_ms_each_median"],
                    v["reap_ms_all"],
                    v["contexts_per_s"],
                ]
                for k, v in report["floor"].items()
            ],
        )
    timing_rows = []
    for name, entry in report["configs"].items():
        for timed_run in entry.get("timing") or []:
            for workload, row in timed_run["workloads"].items():
                timing_rows.append(
                    [
                        name + (" + churn" if timed_run["churn"] else ""),
                        workload,
                        (row["median_of_medians_ms"] or 0) * 1000,
                        (row["spread"] or 0) * 100,
                        (row["max_of_max_ms"] or 0) * 1000,
                        f"{row['ok_programs']}/{row['programs']}",
                        " ".join("-" if o is None else f"{o:g}" for o in row["clock_offsets_us"]),
                        _largest_share(row["clock_stray_shares"]),
                    ]
                )
    if timing_rows:
        print_table(
            "benchmark() through each broker (us; spread = max/min - 1 of the programs' medians, %)",
            ["broker", "workload", "median us", "spread %", "worst call us", "ok", "clock offsets us", "clock stray %"],
            timing_rows,
        )
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
