"""benchmark() while the host's wall clock is stepped: a step inside the timed calls reads suspect.

CUPTI's timestamps follow the host's wall clock (``CLOCK_REALTIME``), while the clock check of
``kcoral.timing.windows`` reads the monotonic one; a step of the wall clock inside a measurement must
read ``suspect`` ("the host's wall clock was stepped ..."), never ``integrity`` and never ``ok``
(``kcoral.timing.timers``). This runs ``benchmark()`` on a 16M-float add ``--runs`` times in this
process while a helper process steps the wall clock by ``--step-us``, forward and back in turn, every
``--every-s`` seconds, and puts it back where it was at the end. A step lands inside a measurement's
timed calls in some runs, in its calibration or between measurements in the others; with steps more
often than measurements (the default), some measurements see a step and its reverse, which must read
``suspect`` too (the wall clock is read after each timed call).

    python3 benchmarks/wall_clock_step.py --step-the-clock [--runs 16] [--step-us 500] [--every-s 0.3]

It steps the clock of the machine it runs on: root, a GPU, and ``--step-the-clock`` to say so. Exits
1 where a measurement that saw a step read ``ok`` or failed with ``integrity``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table

# The helper: steps of +S and -S in turn, each after EVERY seconds; an even count, so the clock ends
# where it began (less the time the steps themselves took).
STEPPER = """
import sys, time
step_ns, every_s, count = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
for index in range(count):
    time.sleep(every_s)
    sign = 1 if index % 2 == 0 else -1
    now = time.clock_gettime_ns(time.CLOCK_REALTIME)
    time.clock_settime_ns(time.CLOCK_REALTIME, now + sign * step_ns)
    print(f"{time.monotonic():.3f} {sign * step_ns}", flush=True)
"""
# A step this far from the one benchmark() reads counts as that step (two clocks read apart).
READ_TOLERANCE_US = 5.0


def measure(runs: int) -> list[dict[str, Any]]:
    import torch

    from kcoral.errors import ExecutionError
    from kcoral.timing.benchmark import benchmark

    x = torch.ones(1 << 24, device="cuda")
    rows = []
    for run in range(runs):
        began = time.monotonic()
        row: dict[str, Any] = {"run": run, "began": began}
        try:
            result = benchmark(lambda: x.add_(1.0))
            details = result["integrity_details"]
            row.update(
                verdict=result["integrity"]["verdict"],
                reasons=result["integrity"]["reasons"],
                step_us=details.get("wall_clock_step_us"),
                stray=details.get("clock_stray_share"),
                median_us=result["latency_ms_median"] * 1e3,
            )
        except ExecutionError as exc:  # integrity, among others: the verdict names the kind
            row.update(verdict=f"{exc.kind}: {exc.message}", reasons=[], step_us=None, stray=None, median_us=None)
        row["ended"] = time.monotonic()
        rows.append(row)
        print(f"[wall_clock_step] run {run + 1}/{runs}: {row['verdict'][:60]}", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-the-clock", action="store_true", help="yes: step this machine's wall clock")
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--step-us", type=float, default=500.0)
    parser.add_argument("--every-s", type=float, default=0.3)
    args = parser.parse_args()
    if not args.step_the_clock or os.geteuid() != 0:
        print("steps this machine's wall clock: run as root with --step-the-clock", file=sys.stderr)
        return 2
    step_ns = int(args.step_us * 1000)
    # Enough steps to cover the runs (0.7 to 1.2 s a measurement on an H100), an even number of them.
    count = 2 * (int(args.runs * 1.2 / args.every_s) // 2 + 1)
    stepper = subprocess.Popen(
        [sys.executable, "-c", STEPPER, str(step_ns), str(args.every_s), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rows = measure(args.runs)
    finally:
        stepper.wait()  # every step made, the clock back where it was
    steps = [(float(at), int(ns)) for at, ns in (line.split() for line in stepper.stdout or [])]
    table, wrong = [], 0
    for row in rows:
        inside = [ns for at, ns in steps if row["began"] <= at <= row["ended"]]
        seen = row["step_us"] is not None and abs(row["step_us"]) > 10
        if seen and row["verdict"] == "ok":
            wrong += 1
        if row["verdict"].startswith("integrity"):
            wrong += 1  # honest work, whatever the clock did: never tampering
        if seen and inside and abs(abs(row["step_us"]) - abs(inside[0]) / 1e3) > READ_TOLERANCE_US:
            wrong += 1  # read, but not as the step made
        table.append(
            [
                row["run"],
                " ".join(f"{ns / 1e3:+.0f}" for ns in inside) or "-",
                "-" if row["step_us"] is None else f"{row['step_us']:+.3f}",
                "-" if row["stray"] is None else f"{row['stray']:.3f}",
                "-" if row["median_us"] is None else f"{row['median_us']:.2f}",
                row["verdict"][:50],
                (row["reasons"][0] if row["reasons"] else "")[:70],
            ]
        )
    print_table(
        f"benchmark() of a 16M add while the wall clock is stepped by {args.step_us:g} us every {args.every_s:g} s",
        ["run", "steps in the run us", "step read us", "clock stray", "median us", "verdict", "first reason"],
        table,
    )
    caught = sum(1 for row in rows if row["step_us"] is not None and abs(row["step_us"]) > 10)
    print(f"{caught} of {len(rows)} measurements saw a step inside their timed calls; read wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
