"""Where a busy broker's CPU goes: constant programs with N in flight, the broker sampled by py-spy.

    python benchmarks/broker_profile.py [--broker-flags "--device cpu --workers 16"] [--in-flight 16]
        [--seconds 10] [--warmup 0] [--session] [--raw out.txt] [--top 25] [--checkout DIR]

One ``AsyncClient`` keeps ``--in-flight`` constant programs in flight for ``--seconds``; meanwhile
``py-spy record --format raw`` samples the broker's Python thread (``py-spy`` on PATH; without it
only the CPU figures are printed). Printed: programs per second, the broker's CPU per program
(all its threads, from ``/proc``, so zmq's I/O threads too), this client's and the whole machine's
(every process: the zygotes forking and reaping the workers, the workers), the zygotes' own CPU
and minor page faults per program and those of the workers they reaped (from ``/proc``: a fresh
worker's faults are mostly pages it shares with its zygote and copies as it writes to them, see
``kcoral.worker.immortal``), and the functions the broker's thread was in when busy (its own
time, then with what it called), idle samples (the event loop waiting) left out. The throughput
goal of the CPU path (1,000 programs a second with 16 workers) needs a broker that spends under a
millisecond of CPU on each program. ``--warmup SECONDS``: the same load first, unmeasured (a zygote
starts its forker only once it has forked a few workers and collapsed its memory, see
``kcoral.worker.forker``). ``--checkout DIR``: the broker of the source tree at DIR (a
worktree of an older commit, say) instead of this one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import psutil

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


async def keep_busy(
    url: str, in_flight: int, seconds: float, session: bool, started: asyncio.Event, warmup: float = 0.0
) -> int:
    """Constant programs, ``in_flight`` at a time, for ``warmup`` seconds and then for ``seconds``
    after ``started`` is set; how many in the latter."""
    program = constant_program()
    done = 0
    async with AsyncClient(url, session=session) as client:
        for _ in range(10):
            await client.execute(program)
        end = time.monotonic() + warmup

        async def one_lane() -> None:
            nonlocal done
            while time.monotonic() < end:
                result = await client.execute(program)
                assert result.completed, result.error
                done += 1

        await asyncio.gather(*(one_lane() for _ in range(in_flight)))
        done = 0
        started.set()
        end = time.monotonic() + seconds
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


class SlotCounters(NamedTuple):
    """The zygotes' (and their forkers') own CPU seconds and minor faults, and those of the workers
    they reaped."""

    zygote_cpu: float
    zygote_faults: int
    worker_cpu: float
    worker_faults: int

    def __sub__(self, other: tuple[Any, ...]) -> SlotCounters:
        return SlotCounters(*(mine - theirs for mine, theirs in zip(self, other, strict=True)))


def zygotes(broker_pid: int) -> list[psutil.Process]:
    """The broker's zygotes and their forkers (``kcoral.worker.forker``): its descendants named so
    whose parent is not a zygote (a worker keeps its parent's name until it renames itself)."""
    named = []
    for process in psutil.Process(broker_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker that exited meanwhile
            if process.name() in ("kcoral-zygote", "kcoral-forker"):
                named.append((process, process.ppid(), process.name()))
    pids = {process.pid for process, _, name in named if name == "kcoral-zygote"}
    slots = [process for process, parent, name in named if name == "kcoral-zygote" and parent not in pids]
    # A zygote's forker is its oldest child of that name (a worker is named so a moment after its clone).
    forkers: dict[int, psutil.Process] = {}
    for process, parent, name in named:
        if name == "kcoral-forker" and parent in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if parent not in forkers or process.create_time() < forkers[parent].create_time():
                    forkers[parent] = process
    return slots + list(forkers.values())


def slot_counters(processes: list[psutil.Process]) -> dict[int, SlotCounters]:
    """Each of ``processes``' (fields 10 to 17 of ``/proc/PID/stat``), by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    counters = {}
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        minflt, cminflt, utime, stime, cutime, cstime = (int(fields[i]) for i in (7, 8, 11, 12, 13, 14))
        counters[process.pid] = SlotCounters((utime + stime) / ticks, minflt, (cutime + cstime) / ticks, cminflt)
    return counters


def counters_since(before: dict[int, SlotCounters], after: dict[int, SlotCounters]) -> SlotCounters:
    """What the processes of ``after`` counted since ``before`` (from nothing where one was not there
    yet: a forker started meanwhile)."""
    none = SlotCounters(0.0, 0, 0.0, 0)
    used = [counters - before.get(pid, none) for pid, counters in after.items()]
    return SlotCounters(*(sum(column) for column in zip(none, *used, strict=True)))


async def measure(
    args: argparse.Namespace, url: str, pid: int, raw: Path
) -> tuple[int, float, float, float, SlotCounters]:
    started = asyncio.Event()
    load = asyncio.create_task(keep_busy(url, args.in_flight, args.seconds, args.session, started, args.warmup))
    await started.wait()
    spy = shutil.which("py-spy")
    recorder = None
    if spy is not None:
        command = [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate", "1000"]
        command += ["--format", "raw", "--nonblocking", "--output", str(raw)]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slots_before = slot_counters(zygotes(pid))
    broker_before, client_before, busy_before = process_cpu_seconds(pid), time.process_time(), machine_busy_seconds()
    done = await load
    slots_used = counters_since(slots_before, slot_counters(zygotes(pid)))
    broker_cpu, client_cpu = process_cpu_seconds(pid) - broker_before, time.process_time() - client_before
    machine_cpu = machine_busy_seconds() - busy_before
    if recorder is not None:
        recorder.wait(timeout=args.seconds + 30)
    return done, broker_cpu, client_cpu, machine_cpu, slots_used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-flags", default="--device cpu --workers 16", help="flags for kcoral broker (quoted)")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds of the same load before measuring")
    parser.add_argument("--session", action="store_true", help="every program in the client's session")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw stacks here")
    parser.add_argument("--top", type=int, default=25, help="functions listed in each table")
    parser.add_argument("--checkout", type=Path, default=None, help="run the broker of the source tree at DIR")
    args = parser.parse_args()
    raw = args.raw or Path(tempfile.mkdtemp(prefix="kcoral-profile-")) / "broker.txt"
    with broker(*args.broker_flags.split(), checkout=args.checkout) as (url, process):
        done, broker_cpu, client_cpu, machine_cpu, slots = asyncio.run(measure(args, url, process.pid, raw))
    title = f"{machine()}, broker: {args.broker_flags}{' (one session)' if args.session else ''}"
    if args.checkout is not None:
        title += f", of {args.checkout}"
    print(f"{done / args.seconds:.1f} programs/s with {args.in_flight} in flight ({title})")
    print(
        f"CPU per program: broker {1000 * broker_cpu / done:.3f} ms, client {1000 * client_cpu / done:.3f} ms, "
        f"the whole machine {1000 * machine_cpu / done:.3f} ms (py-spy's samples included; "
        f"{machine_cpu / args.seconds:.1f} of {os.cpu_count()} cores busy)"
    )
    print(
        f"Per program: the zygotes (with their forkers) {1000 * slots.zygote_cpu / done:.3f} ms of CPU and "
        f"{slots.zygote_faults / done:.0f} "
        f"minor faults, the workers they reaped {1000 * slots.worker_cpu / done:.3f} ms and "
        f"{slots.worker_faults / done:.0f} (clock ticks of {1000 / os.sysconf('SC_CLK_TCK'):.0f} ms)"
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
