"""compare() on the GPU: issue 22's checks as a table (the GPU test asserts the same cases).

Usage (on the GPU host, the `gpu` extra installed; runs in this process, no broker needed)::

    python3 benchmarks/compare_gpu.py [--runs 10] [--json out.json]

Prints, for each case (``tests/gpu/compare_cases.py``), one row per run: ``verdict``, the ratio B/A
with its 95% interval, the half-width reached, what ended the sampling, the rounds and samples used,
the samples left out by the clock filter, each side's median, the integrity verdict and the GPU's
temperature before; then the adaptive stop on the honest workloads, and a run with the GPU held busy
by another process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.gpu import compare_cases  # noqa: E402

COLUMNS = (
    "case",
    "verdict",
    "ratio",
    "low",
    "high",
    "halfwidth",
    "stop",
    "rounds",
    "samples",
    "left_out",
    "capped",
    "clock_apart",
    "a_ms",
    "b_ms",
    "apart",
    "integrity",
    "temp_c",
)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.5f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "-"
    return "-" if value is None else str(value)


def _line(case: str, row: dict[str, Any]) -> str:
    values = [
        case,
        row["verdict"],
        row["ratio"],
        row["ratio_low"],
        row["ratio_high"],
        row["halfwidth"],
        row["stop"],
        row["rounds"],
        row["samples"],
        row["left_out"],
        row.get("power_capped"),
        row.get("rounds_clock_apart"),
        row["a_ms"],
        row["b_ms"],
        row.get("ratio_apart"),
        row["integrity"],
        row["temperature_c"],
    ]
    return " | ".join(_cell(v) for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of the self and 1.03x cases (default 10)")
    parser.add_argument("--matmul-runs", type=int, default=3)
    parser.add_argument("--busy-seconds", type=float, default=60.0, help="0 skips the busy-GPU case")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    rows: dict[str, Any] = {}
    print(" | ".join(COLUMNS))
    print(" | ".join("---" for _ in COLUMNS))
    cases = [
        ("self_16m_add", lambda: compare_cases.self_vs_self(args.runs)),
        ("add_1.03x", lambda: compare_cases.more_work(args.runs)),
        ("matmul_1.5x", lambda: compare_cases.matmul_vs_slower(args.matmul_runs)),
    ]
    for name, run in cases:
        rows[name] = run()
        for row in rows[name]:
            print(_line(name, row), flush=True)
    rows["adaptive_stop"] = compare_cases.adaptive_stop()
    for name, row in rows["adaptive_stop"].items():
        print(_line(f"stop:{name}", row), flush=True)
    if args.busy_seconds > 0:
        busy = compare_cases.busy_process(args.busy_seconds)
        try:
            rows["busy_gpu"] = compare_cases.self_vs_self(3)
        finally:
            busy.kill()
            busy.wait()
        for row in rows["busy_gpu"]:
            print(_line("busy_gpu", row) + " | " + "; ".join(row["reasons"])[:200], flush=True)
    summary = {
        "self_same": sum(r["verdict"] == "same" for r in rows["self_16m_add"]),
        "self_contains_one": sum(bool(r["contains_one"]) for r in rows["self_16m_add"]),
        "more_slower": sum(r["verdict"] == "slower" for r in rows["add_1.03x"]),
        "matmul_within_2pct": sum(abs(r["ratio_vs_apart"]) <= 0.02 for r in rows["matmul_1.5x"]),
        "busy_faster": sum(r["verdict"] == "faster" for r in rows.get("busy_gpu", [])),
    }
    print(json.dumps(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
