"""Where a busy broker's CPU goes: constant programs with N in flight, the broker sampled by py-spy.

    python benchmarks/broker_profile.py [--broker-flags "--device cpu --workers 16"] [--in-flight 16]
        [--seconds 10] [--session] [--raw out.txt] [--top 25]

One ``AsyncClient`` keeps ``--in-flight`` constant programs in flight for ``--seconds``; meanwhile
``py-spy record --format raw`` samples the broker's Python thread (``py-spy`` on PATH; without it
only the CPU figures are printed). Printed: programs per second, the broker's CPU per program
(all its threads, from ``/proc``, so zmq's I/O threads too), this client's and the whole machine's
(every process: the zygotes forking and reaping the workers, the workers), and the functions
the broker's thread was in when busy (its own time, then with what it called), idle samples (the
event loop waiting) left out. The throughput goal of the CPU path (1,000 programs a second with
16 workers) needs a broker that spends under a millisecond of CPU on each program.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    broker,
    constant_program,
    machine,
    machine_busy_seconds,
    print_table,
    process_cpu_seconds,
)
from kcoral import AsyncClient

# The frames a sample of the waiting event loop ends in: not the broker's work.
IDLE_FRAMES = ("Runner.run (asyncio/runners.py", "select (selectors.py", "_run_once (asyncio/base_events.py")


async def keep_busy(url: str, in_flight: int, seconds: float, session: bool, started: asyncio.Event) -> int:
    """Constant programs, ``in_flight`` at a time, for ``seconds`` after ``started`` is set; how many."""
    program = constant_program()
    done = 0
    async with AsyncClient(url, session=session) as client:
        for _ in range(10):
            await client.execute(program)
        started.set()
        end = time.monotonic() + seconds

        async def one_lane() -> None:
            nonlocal done
            while time.monotonic() < end:
                result = await client.execute(program)
                assert result.completed, result.error
                done += 1

        await asyncio.gather(*(one_lane() for _ in range(in_flight)))
    return done


def read_samples(raw: Path) -> tuple[Counter[str], Counter[str], int]:
    """py-spy's raw (collapsed) stacks: busy samples by innermost frame, by any frame, and in all."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_FRAMES):
            continue
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            within[frame] += int(count)
    return own, within, total


async def measure(args: argparse.Namespace, url: str, pid: int, raw: Path) -> tuple[int, float, float, float]:
    started = asyncio.Event()
    load = asyncio.create_task(keep_busy(url, args.in_flight, args.seconds, args.session, started))
    await started.wait()
    spy = shutil.which("py-spy")
    recorder = None
    if spy is not None:
        command = [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate", "1000"]
        command += ["--format", "raw", "--nonblocking", "--output", str(raw)]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    broker_before, client_before, busy_before = process_cpu_seconds(pid), time.process_time(), machine_busy_seconds()
    done = await load
    broker_cpu, client_cpu = process_cpu_seconds(pid) - broker_before, time.process_time() - client_before
    machine_cpu = machine_busy_seconds() - busy_before
    if recorder is not None:
        recorder.wait(timeout=args.seconds + 30)
    return done, broker_cpu, client_cpu, machine_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-flags", default="--device cpu --workers 16", help="flags for kcoral broker (quoted)")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--session", action="store_true", help="every program in the client's session")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw stacks here")
    parser.add_argument("--top", type=int, default=25, help="functions listed in each table")
    args = parser.parse_args()
    raw = args.raw or Path(tempfile.mkdtemp(prefix="kcoral-profile-")) / "broker.txt"
    with broker(*args.broker_flags.split()) as (url, process):
        done, broker_cpu, client_cpu, machine_cpu = asyncio.run(measure(args, url, process.pid, raw))
    title = f"{machine()}, broker: {args.broker_flags}{' (one session)' if args.session else ''}"
    print(f"{done / args.seconds:.1f} programs/s with {args.in_flight} in flight ({title})")
    print(
        f"CPU per program: broker {1000 * broker_cpu / done:.3f} ms, client {1000 * client_cpu / done:.3f} ms, "
        f"the whole machine {1000 * machine_cpu / done:.3f} ms (py-spy's samples included; "
        f"{machine_cpu / args.seconds:.1f} of {os.cpu_count()} cores busy)"
    )
    if not raw.exists():
        print("no samples (py-spy not on PATH, or it could not attach)")
        return 0
    own, within, total = read_samples(raw)
    print(f"busy samples of the broker's thread: {total} ({total / args.seconds / 10:.1f}% of the run at 1 kHz)")
    for name, counts in (("own time", own), ("with what it called", within)):
        rows = [[f"{100 * n / total:.1f}%", frame[:110]] for frame, n in counts.most_common(args.top)]
        print_table(f"The broker's busy samples, {name}", ["share", "function (file:line)"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
