"""How far CUPTI's GPU records disagree with its host clock, by how long the context has waited.

``benchmark()`` reads its windows on the host (``cupti.get_timestamp()`` after a device-wide
synchronisation) and compares them with the GPU's activity records, which CUPTI maps onto the
host's clock; ``kcoral.timing.windows.clock_offsets`` moves the records back where the two disagree.
This measures the disagreement directly: each child process makes a CUDA context (as a spare
worker does), waits ``W`` seconds, enables CUPTI and then, at each probe time, synchronises, reads
the host clock, launches one small kernel, synchronises and reads it again. A record on the host's
clock starts after the first reading and ends before the second; the table gives, of five such
kernels a probe, the least of (kernel start - reading before) and of (reading after - kernel end):
both are positive where the clocks agree, and one goes negative by the disagreement where they do
not. It also tells whether CUPTI's ``threadId`` of an API record is the one
``kcoral.timing.cupti.cupti_thread_id()`` gives (the alignment relies on it; it is not the OS thread
id of ``threading.get_native_id()``).

    python3 benchmarks/cupti_clock.py --waits 0 20 40 --probes 0 1 10

The children run at once, one per wait; needs a GPU, torch and cupti-python.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table

KERNELS_PER_PROBE = 5


def child(wait_s: float, probes: list[float]) -> dict[str, Any]:
    """In a fresh process: a context, ``wait_s`` of waiting, then CUPTI and a probe at each time."""
    import threading

    import torch

    from kcoral.timing.cupti import cupti_thread_id

    try:
        from cupti import cupti
    except ImportError as exc:  # the gpu extra: pip install 'kcoral[gpu]'
        raise SystemExit(f"cupti-python is needed (the gpu extra): {exc}") from exc

    torch.cuda.init()
    tensor = torch.zeros(1 << 10, device="cuda")
    torch.cuda.synchronize()
    time.sleep(wait_s)
    kernels: list[tuple[int, int]] = []
    threads: set[int] = set()

    def requested() -> tuple[int, int]:
        return 8 << 20, 0

    def completed(records: Any) -> None:
        for record in records:
            if int(record.kind) == int(cupti.ActivityKind.CONCURRENT_KERNEL):
                kernels.append((int(record.start), int(record.end)))
            elif int(record.kind) == int(cupti.ActivityKind.RUNTIME):
                threads.add(int(record.thread_id))

    cupti.activity_register_callbacks(requested, completed)
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    cupti.activity_enable(cupti.ActivityKind.RUNTIME)
    started = time.monotonic()
    rows = []
    for at in probes:
        time.sleep(max(0.0, at - (time.monotonic() - started)))
        before_us, after_us = [], []
        for _ in range(KERNELS_PER_PROBE):
            torch.cuda.synchronize()
            before = int(cupti.get_timestamp())
            tensor.add_(1)
            torch.cuda.synchronize()
            after = int(cupti.get_timestamp())
            cupti.activity_flush_all(1)
            start, end = kernels[-1]
            before_us.append((start - before) / 1e3)
            after_us.append((after - end) / 1e3)
        rows.append({"at_s": at, "start_after_reading_us": min(before_us), "reading_after_end_us": min(after_us)})
    cupti.activity_disable(cupti.ActivityKind.RUNTIME)
    cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    return {
        "wait_s": wait_s,
        "probes": rows,
        "native_thread": threading.get_native_id(),
        "timer_thread": cupti_thread_id(),  # what the timer takes for the calling thread's
        "cupti_threads": sorted(threads),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waits", type=float, nargs="+", default=[0.0, 20.0, 40.0], help="seconds each context waits")
    parser.add_argument("--probes", type=float, nargs="+", default=[0.0, 1.0, 10.0], help="seconds after the wait")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.probes)), flush=True)
        return 0
    here = Path(__file__).resolve().parent.parent
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cupti_clock", "--child", str(wait), "--probes", *map(str, args.probes)],
            cwd=here,
            stdout=subprocess.PIPE,
            text=True,
        )
        for wait in args.waits
    ]
    results = []
    for process in children:
        out, _ = process.communicate()
        if process.returncode != 0 or not out.strip():
            print(f"a child failed (exit {process.returncode})", file=sys.stderr)
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    rows = [
        [
            result["wait_s"],
            probe["at_s"],
            round(probe["start_after_reading_us"], 1),
            round(probe["reading_after_end_us"], 1),
            "yes" if result["cupti_threads"] == [result["timer_thread"]] else f"no: {result['cupti_threads']}",
        ]
        for result in results
        for probe in result["probes"]
    ]
    print_table(
        "CUPTI's GPU records against its host clock (negative: the records are off by that much)",
        [
            "context waited s",
            "probe at s",
            "kernel start - reading before us",
            "reading after - kernel end us",
            "API threadId = cupti_thread_id()",
        ],
        rows,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
