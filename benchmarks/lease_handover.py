"""What holding the GPU lease until the worker exits costs: the hand-over from one program to the next.

    python benchmarks/lease_handover.py [--programs 40] [--checkout DIR ...] [--json out.json]

Two worker slots share one GPU (a real one where there is one, else ``--fake-gpus 1``); programs
that each hold the GPU for ``--hold-ms`` in one non-``cpu_only`` run are submitted two at a time,
so every program but the first waits for the previous holder. Each run returns the wall-clock time
its GPU work started and ended; the **hand-over** is the gap between one holder's end and the next
holder's start: the result's way to the broker, the worker's exit and the zygote's report of it
(the lease is given back only then), the grant and its way to the next worker. With a real GPU the
exit includes the CUDA context's teardown, so each program creates one (when its module is imported,
before it asks for the lease).

``--checkout DIR`` (repeatable) runs the broker from that source tree instead of this one, in
turns with the others, so that two versions are compared in one run on the same machine.
Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, host_gpu_count, machine, print_table, save_json
from kcoral import AsyncClient, Program, ProgramResult

HOLD_SOURCE = """
import time
import torch
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # the context at import, before the lease: no GPU work, no wait
def hold(ms, cuda):
    start = time.time()
    deadline = time.monotonic() + ms / 1000
    while time.monotonic() < deadline:
        pass
    if cuda:
        torch.cuda.synchronize()
    return start, time.time()
"""


def log(message: str) -> None:
    print(f"[lease_handover] {message}", file=sys.stderr, flush=True)


def hold_program(hold_ms: float, cuda: bool) -> Program:
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=HOLD_SOURCE), name="hold")
    program.return_(key="span", value=program.run(fn=fn, args=[hold_ms, cuda]))
    return program


async def measure(url: str, count: int, hold_ms: float, cuda: bool) -> dict[str, float]:
    program = hold_program(hold_ms, cuda)
    async with AsyncClient(url) as client:
        await asyncio.gather(*(client.execute(program) for _ in range(2)))  # warm-up
        gate = asyncio.Semaphore(2)

        async def one() -> ProgramResult:
            async with gate:
                return await client.execute(program)

        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(count)))
        elapsed = time.perf_counter() - start
    for result in results:
        if not result.completed:
            raise RuntimeError(f"the benchmark program failed: {result.error}")
    spans = sorted(tuple(r.results["span"]) for r in results)
    gaps = [(after[0] - before[1]) * 1000 for before, after in itertools.pairwise(spans)]
    return {
        "programs_per_s": count / elapsed,
        "handover_ms_median": statistics.median(gaps),
        "handover_ms_p90": statistics.quantiles(gaps, n=10)[-1],
        "lease_wait_ms_median": statistics.median(r.lease_wait_ms for r in results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--hold-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="turns per checkout")
    parser.add_argument("--sandbox", choices=("none", "bubblewrap"), default="none")
    parser.add_argument("--checkout", type=Path, action="append", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    gpu = host_gpu_count() > 0
    checkouts = [c.resolve() for c in args.checkout] if args.checkout else [Path(__file__).resolve().parent.parent]
    slots = ["--device", "gpu", "--gpus", "0"] if gpu else ["--fake-gpus", "1"]
    flags = [*slots, "--workers-per-gpu", "2", "--sandbox", args.sandbox]
    log(f"{machine()}; GPU: {gpu}; checkouts: {', '.join(map(str, checkouts))}")
    samples: dict[str, list[dict[str, float]]] = {str(c): [] for c in checkouts}
    for round_ in range(1, args.rounds + 1):
        for checkout in checkouts:
            log(f"round {round_}: {checkout}")
            with broker(*flags, checkout=checkout) as (url, _process):
                samples[str(checkout)].append(asyncio.run(measure(url, args.programs, args.hold_ms, gpu)))
    report: dict[str, Any] = {"machine": machine(), "gpu": gpu, "hold_ms": args.hold_ms, "checkouts": {}}
    rows = []
    for checkout, runs in samples.items():
        merged = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        report["checkouts"][checkout] = {"median_of_rounds": merged, "rounds": runs}
        rows.append(
            [
                checkout,
                merged["programs_per_s"],
                merged["handover_ms_median"],
                merged["handover_ms_p90"],
                merged["lease_wait_ms_median"],
            ]
        )
    print_table(
        f"GPU lease hand-over, 2 slots on one {'GPU' if gpu else 'fake GPU'}, {args.hold_ms:g} ms held each "
        f"({machine()}, sandbox {args.sandbox})",
        ["checkout", "programs/s", "hand-over ms (median)", "hand-over ms (p90)", "lease wait ms (median)"],
        rows,
    )
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
