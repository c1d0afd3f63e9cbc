"""GPU evidence against a running broker, for ``benchmarks/gpu_batch_evidence.sh`` (GPU host).

    python3 benchmarks/gpu_evidence.py remote-honest --url URL [--runs 10] [--in-process 3] [--json out.json]
    python3 benchmarks/gpu_evidence.py busy-service --url URL [--runs 3] [--busy-seconds 40] [--json out.json]
    python3 benchmarks/gpu_evidence.py digest FOLDER

``digest`` prints the counts that the issues ask for from the JSON files the batch wrote in FOLDER
(``suspect-rate.json``, ``busy-service.json``, ``compare.json``, ``remote-honest.json``), one line each.

``remote-honest`` (issue 20): the honest candidate of each workload (``add``, ``matmul`` of the
examples, ``small_mlp`` of the remote attacks) through ``kcoral remote``, ``--runs`` times, the
workloads interleaved (a run cut short leaves even counts); before them the same candidate's
``custom_kernel`` timed by ``benchmark()`` inside a program on the same broker (``--in-process``
programs each), the figure the remote CUPTI median should agree with (2%, the matmul 1%). One row
per run, then a table; the JSON is rewritten after every run.

``busy-service`` (issue 22): a process outside KCoral keeps the GPU busy (a bf16 GEMM loop, not a
child of the broker: the service knows nothing of it) while ``--runs`` programs each compare the
16M-float add with itself; none may read ``faster``, each should read ``suspect`` or ``unclear``,
and the reasons should name the other process (NVML). Progress to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kcoral import Client, Program  # noqa: E402

WORKLOADS = {
    "add": REPO_ROOT / "examples" / "workloads" / "add",
    "matmul": REPO_ROOT / "examples" / "workloads" / "matmul",
    "small_mlp": REPO_ROOT / "tests" / "gpu" / "remote_attacks" / "workloads" / "small_mlp",
}
AGREE = {"add": 0.02, "matmul": 0.01, "small_mlp": 0.02}  # issue 20: CUPTI within this of benchmark()
REMOTE_TIMEOUT_S = 120
PROGRAM_TIMEOUT_S = 120
CASES = REPO_ROOT / "tests" / "gpu" / "compare_cases.py"

IN_PROCESS_SOURCE = """
import secrets

from kcoral.builtins import benchmark


def bench(workload, candidate):
    inputs = workload.make_inputs(secrets.randbelow(2**31))
    config = dict(getattr(workload, "TIMING", None) or {})
    report = benchmark(candidate.custom_kernel, *inputs, config=config)
    return {
        "latency_ms_median": report["latency_ms_median"],
        "latency_ms_min": report["latency_ms_min"],
        "method": report["method"],
        "integrity": report["integrity"],
        "gpu_processes": report["integrity_details"].get("gpu_processes"),
    }
"""


def log(message: str) -> None:
    print(f"[gpu_evidence] {message}", file=sys.stderr, flush=True)


def save(path: Path | None, data: Any) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=1, default=str))


def median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def in_process(client: Client, workload: str) -> dict[str, Any]:
    """The honest candidate's ``custom_kernel`` timed by benchmark() in a program on the broker."""
    root = WORKLOADS[workload]
    program = Program()
    module = program.upload(kind="module", source=(root / "workload.py").read_text())
    candidate = program.upload(kind="module", source=(root / "candidate.py").read_text())
    driver = program.upload(kind="module", source=IN_PROCESS_SOURCE)
    bench = program.get_function(module=driver, name="bench")
    program.return_(key="report", value=program.run(fn=bench, args=[module, candidate]))
    result = client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
    if not result.completed:
        return {"error": result.error}
    return dict(result.results["report"])


def remote(url: str, suite: Path, workload: str) -> dict[str, Any]:
    """One ``kcoral remote`` evaluation of the workload's honest candidate: its report's figures."""
    command = [sys.executable, "-m", "kcoral", "remote", "--remote", url, "--timeout", str(REMOTE_TIMEOUT_S)]
    command += ["--", f"workloads/{workload}", f"workloads/{workload}/candidate.py"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=suite, capture_output=True, text=True, timeout=REMOTE_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        return {"rc": None, "seconds": round(time.monotonic() - started, 1), "error": "timed out"}
    row: dict[str, Any] = {"rc": done.returncode, "seconds": round(time.monotonic() - started, 1)}
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return {**row, "error": (done.stderr or done.stdout)[-600:]}
    timing = report.get("timing") or {}
    bracket = timing.get("bracket") or {}
    row.update(
        {
            "correct": report.get("correct"),
            "verdict": (report.get("integrity") or {}).get("verdict"),
            "reasons": (report.get("integrity") or {}).get("reasons"),
            "cupti_ms": timing.get("latency_ms_median"),
            "time_source": timing.get("time_source"),
            "bracket_net_ms": bracket.get("net_ms"),
            "bracket_agrees": bracket.get("agrees"),
            "baseline_ms": (report.get("baseline") or {}).get("latency_ms_median"),
            "speedup": report.get("speedup"),
        }
    )
    return row


def remote_honest(args: argparse.Namespace) -> int:
    summary: dict[str, Any] = {"url": args.url, "runs": args.runs, "in_process": {}, "remote": {}}
    with Client(args.url, connect_timeout_seconds=30.0) as client:
        for workload in WORKLOADS:
            summary["in_process"][workload] = [in_process(client, workload) for _ in range(args.in_process)]
            log(f"in-process {workload}: {summary['in_process'][workload]}")
            save(args.json, summary)
    with tempfile.TemporaryDirectory(prefix="kcoral-evidence-") as scratch:
        suite = Path(scratch)
        for workload, root in WORKLOADS.items():
            shutil.copytree(root, suite / "workloads" / workload)
        for run in range(args.runs):
            for workload in WORKLOADS:
                row = remote(args.url, suite, workload)
                summary["remote"].setdefault(workload, []).append(row)
                log(f"remote {workload} run {run + 1}/{args.runs}: {row}")
                tabulate(summary)
                save(args.json, summary)
            if run == 0 and not any("cupti_ms" in rows[0] for rows in summary["remote"].values()):
                log("no workload gave a report in the first round: the rest would fail the same way")
                break
    tabulate(summary)
    print(
        "workload | runs | correct | ok | cupti ms (median, min-max) | bracket net ms | speedup min-max | "
        "benchmark() ms | in-process verdicts | cupti vs benchmark() | within"
    )
    for workload, line in summary["table"].items():
        print(" | ".join(str(v) for v in (workload, *line.values())), flush=True)
    save(args.json, summary)
    return 0


def tabulate(summary: dict[str, Any]) -> None:
    """The table of ``remote-honest`` from its rows so far (kept in the JSON after every run, so a
    run cut short still has it)."""
    summary["table"] = {}
    for workload in WORKLOADS:
        rows = summary["remote"].get(workload, [])
        cupti = [r["cupti_ms"] for r in rows if isinstance(r.get("cupti_ms"), float)]
        speedups = [r["speedup"] for r in rows if isinstance(r.get("speedup"), float)]
        nets = [r["bracket_net_ms"] for r in rows if isinstance(r.get("bracket_net_ms"), float)]
        local_reports = summary["in_process"].get(workload, [])
        local = [r["latency_ms_median"] for r in local_reports if "latency_ms_median" in r]
        against = statistics.median(cupti) / statistics.median(local) - 1 if cupti and local else None
        summary["table"][workload] = {
            "runs": len(rows),
            "correct": sum(r.get("correct") is True for r in rows),
            "ok": sum(r.get("verdict") == "ok" for r in rows),
            "cupti_ms_median": median(cupti),
            "cupti_ms_range": [min(cupti), max(cupti)] if cupti else None,
            "bracket_net_ms_median": median(nets),
            "speedup_range": [min(speedups), max(speedups)] if speedups else None,
            "benchmark_ms_median": median(local),
            "in_process_verdicts": [(r.get("integrity") or {}).get("verdict") for r in local_reports],
            "cupti_vs_benchmark": against,
            "within": against is not None and abs(against) <= AGREE[workload],
        }


def busy_service(args: argparse.Namespace) -> int:
    """``--runs`` compare() programs on the broker beside a GEMM loop the service knows nothing of."""
    program = Program()
    module = program.upload(kind="module", source=CASES.read_text())
    run = program.get_function(module=module, name="self_vs_self")
    program.return_(key="rows", value=program.run(fn=run, args=[1]))
    from tests.gpu.compare_cases import BUSY_SOURCE  # the GEMM loop that compare_gpu.py runs beside

    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY_SOURCE, str(args.busy_seconds)], stdout=subprocess.PIPE, text=True
    )
    rows: list[dict[str, Any]] = []
    try:
        assert busy.stdout is not None
        word = busy.stdout.readline().strip()
        log(f"outside process {busy.pid}: {word or 'no word'}")
        if word != "busy":
            log("the outside process did not start its GEMMs (no CUDA GPU here?): nothing to compare beside")
            return 1
        with Client(args.url, connect_timeout_seconds=30.0) as client:
            for index in range(args.runs):
                result = client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
                row = dict(result.results["rows"][0]) if result.completed else {"error": result.error}
                row["busy_pid"] = busy.pid
                rows.append(row)
                log(f"busy run {index + 1}/{args.runs}: {row}")
                save(args.json, rows)
    finally:
        busy.kill()
        busy.wait()
    print("run | verdict | integrity | ratio | reasons")
    for index, row in enumerate(rows):
        reasons = "; ".join(row.get("reasons") or [])[:240]
        print(f"{index + 1} | {row.get('verdict')} | {row.get('integrity')} | {row.get('ratio')} | {reasons}")
    faster = sum(row.get("verdict") == "faster" for row in rows)
    flagged = sum(row.get("verdict") == "unclear" or row.get("integrity") == "suspect" for row in rows)
    print(json.dumps({"runs": len(rows), "faster": faster, "suspect_or_unclear": flagged}))
    save(args.json, rows)
    return 0 if rows and faster == 0 else 1


def _load(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def digest(folder: Path) -> int:
    """One line per part: what the issues' "It must show" lists count."""
    timing = _load(folder, "suspect-rate.json")
    if isinstance(timing, dict):
        rows = timing.get("workloads", {})
        ok = sum(row.get("ok_programs", 0) for row in rows.values())
        total = sum(len(row.get("medians_ms", [])) for row in rows.values())
        excused: dict[str, int] = {}
        for row in rows.values():
            for report in row.get("reports", []):
                seen = ((report.get("integrity_details") or {}).get("gpu_processes") or {}).get("excused") or {}
                for why in seen.values():
                    excused[why] = excused.get(why, 0) + 1
        reasons = [r for row in rows.values() for r in row.get("suspect_reasons", [])]
        print(
            f"issue 21 honest benchmark() beside contexts made ahead: {ok} of {total} ok "
            f"(failed programs: {len(timing.get('failures', []))}); busy pids left out: {excused}; "
            f"suspect reasons: {reasons}"
        )
    busy = _load(folder, "busy-service.json")
    if isinstance(busy, list):
        verdicts = [(row.get("verdict"), row.get("integrity")) for row in busy]
        print(f"issue 22 busy GPU (outside process) through the service: {verdicts}")
    compared = _load(folder, "compare.json")
    if isinstance(compared, dict):
        self_rows, more, matmul = (compared.get(k, []) for k in ("self_16m_add", "add_1.03x", "matmul_1.5x"))
        counts = {
            "self_same": f"{sum(r['verdict'] == 'same' for r in self_rows)}/{len(self_rows)}",
            "self_holds_1": f"{sum(bool(r['contains_one']) for r in self_rows)}/{len(self_rows)}",
            "more_slower": f"{sum(r['verdict'] == 'slower' and r['ratio_low'] > 1 for r in more)}/{len(more)}",
            "matmul_slower": f"{sum(r['verdict'] == 'slower' for r in matmul)}/{len(matmul)}",
            "matmul_within_2pct": f"{sum(abs(r.get('ratio_vs_apart', 1)) <= 0.02 for r in matmul)}/{len(matmul)}",
            "matmul_power_capped": [r.get("power_capped") for r in matmul],
            "matmul_rounds_clock_apart": [r.get("rounds_clock_apart") for r in matmul],
            "matmul_clock_by_side": [r.get("sm_clock_mhz_by_side") for r in matmul],
            "busy_faster": sum(r["verdict"] == "faster" for r in compared.get("busy_gpu", [])),
        }
        print(f"issue 22 compare(): {json.dumps(counts)}")
    honest = _load(folder, "remote-honest.json")
    if isinstance(honest, dict):
        for workload, line in (honest.get("table") or {}).items():
            print(f"issue 20 remote honest {workload}: {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    honest = sub.add_parser("remote-honest", help="honest candidates through kcoral remote, beside benchmark()")
    honest.add_argument("--runs", type=int, default=10)
    honest.add_argument("--in-process", type=int, default=3)
    busy = sub.add_parser("busy-service", help="compare() programs beside a process outside KCoral")
    busy.add_argument("--runs", type=int, default=3)
    busy.add_argument("--busy-seconds", type=float, default=40.0)
    for part in (honest, busy):  # digest's parser is added below
        part.add_argument("--url", required=True, help="tcp://HOST:PORT of a running broker")
        part.add_argument("--json", type=Path)
    summary = sub.add_parser("digest", help="the counts of the JSON files a batch wrote")
    summary.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    # A time limit's SIGTERM ends the run through its finally blocks: the outside process goes too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.what == "digest":
        return digest(args.folder)
    return remote_honest(args) if args.what == "remote-honest" else busy_service(args)


if __name__ == "__main__":
    raise SystemExit(main())
