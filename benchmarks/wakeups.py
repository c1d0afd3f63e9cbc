"""What waking a sleeping process costs on this host: round trips through a pipe and through zmq.

    python benchmarks/wakeups.py [--trips 2000] [--pause-ms 0.5] [--hold-latency] [--json out.json]

Two processes pass a message back and forth ``--trips`` times, pausing ``--pause-ms`` after each
round trip so that the other side goes to sleep, as the service's processes do between programs:
once through a pipe (one wakeup each way), then through a zmq ``DEALER`` pair over ``ipc://`` and
over ``tcp://`` loopback (zmq's I/O threads add two wakeups each way). Printed: the CPU idle
driver and its states, and the p50, p90 and p99 of each round trip in microseconds. With
``--hold-latency`` (root) each is measured again while ``/dev/cpu_dma_latency`` is held at 0 (the
idle governor then keeps idle CPUs out of deep states, where there is an idle driver to obey it).
A constant program crosses four zmq hops and wakes about fourteen threads: these figures say how
much of its milliseconds the host's wakeups are (``benchmarks/RESULTS.md``, "What a wakeup costs
on these hosts").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_table, save_json
from kcoral.testing import free_port

WARMUP_TRIPS = 50
IDLE_STATES = Path("/sys/devices/system/cpu/cpu0/cpuidle")


def idle_driver() -> str:
    try:
        driver = Path("/sys/devices/system/cpu/cpuidle/current_driver").read_text().strip()
    except OSError:
        driver = "unknown"
    states = []
    for state in sorted(IDLE_STATES.glob("state*")):
        with contextlib.suppress(OSError):
            states.append(f"{(state / 'name').read_text().strip()} ({(state / 'latency').read_text().strip()} us)")
    return f"{driver}: {', '.join(states) or 'no states'}"


def timed_trips(trip: Callable[[], None], trips: int, pause_s: float) -> list[float]:
    """Microseconds of each of ``trips`` round trips, after WARMUP_TRIPS untimed ones, with a
    pause of ``pause_s`` after each (the other side goes to sleep meanwhile)."""
    samples = []
    for i in range(trips + WARMUP_TRIPS):
        start = time.perf_counter_ns()
        trip()
        if i >= WARMUP_TRIPS:
            samples.append((time.perf_counter_ns() - start) / 1000)
        time.sleep(pause_s)
    return samples


def pipe_trips(trips: int, pause_s: float) -> list[float]:
    there_read, there_write = os.pipe()
    back_read, back_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(trips + WARMUP_TRIPS):
                os.read(there_read, 1)
                os.write(back_write, b"x")
        finally:
            os._exit(0)

    def trip() -> None:
        os.write(there_write, b"x")
        os.read(back_read, 1)

    try:
        return timed_trips(trip, trips, pause_s)
    finally:
        os.waitpid(pid, 0)
        for descriptor in (there_read, there_write, back_read, back_write):
            os.close(descriptor)


def zmq_trips(trips: int, pause_s: float, endpoint: str) -> list[float]:
    pid = os.fork()
    if pid == 0:
        try:
            context = zmq.Context()
            echo = context.socket(zmq.DEALER)
            echo.connect(endpoint)
            for _ in range(trips + WARMUP_TRIPS + 1):
                echo.send(echo.recv())
            echo.close(linger=1000)
            context.term()
        finally:
            os._exit(0)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.bind(endpoint)
    message = b"x" * 200

    def trip() -> None:
        sock.send(message)
        sock.recv()

    try:
        sock.send(b"hello")  # the connection made before any trip is timed
        sock.recv()
        return timed_trips(trip, trips, pause_s)
    finally:
        os.waitpid(pid, 0)
        sock.close(linger=0)
        context.term()


def quantiles_us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {f"p{q}": round(ordered[min(len(ordered) - 1, len(ordered) * q // 100)], 1) for q in (50, 90, 99)}


@contextlib.contextmanager
def latency_held(hold: bool) -> Iterator[None]:
    """``/dev/cpu_dma_latency`` at 0 while the block runs (the kernel keeps it while it is open)."""
    if not hold:
        yield
        return
    descriptor = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    try:
        os.write(descriptor, struct.pack("i", 0))
        yield
    finally:
        os.close(descriptor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--pause-ms", type=float, default=0.5)
    parser.add_argument("--hold-latency", action="store_true", help="again with /dev/cpu_dma_latency held at 0")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pause_s = args.pause_ms / 1000
    with tempfile.TemporaryDirectory(prefix="kcoral-wakeups-") as directory:
        ways: dict[str, Callable[[], list[float]]] = {
            "pipe": lambda: pipe_trips(args.trips, pause_s),
            "zmq ipc://": lambda: zmq_trips(args.trips, pause_s, f"ipc://{directory}/echo.sock"),
            "zmq tcp:// loopback": lambda: zmq_trips(args.trips, pause_s, f"tcp://127.0.0.1:{free_port()}"),
        }
        rows, results = [], {}
        for hold in (False, True) if args.hold_latency else (False,):
            with latency_held(hold):
                for name, trips in ways.items():
                    label = f"{name}{', latency held at 0' if hold else ''}"
                    stats = quantiles_us(trips())
                    results[label] = stats
                    rows.append([label, stats["p50"], stats["p90"], stats["p99"]])
    driver = idle_driver()
    print(f"CPU idle driver: {driver}")
    print_table(
        f"Round trips between two processes ({machine()}, {args.trips} each, {args.pause_ms} ms apart)",
        ["way", "p50 us", "p90 us", "p99 us"],
        rows,
    )
    save_json(args.json, {"machine": machine(), "idle_driver": driver, "round_trips_us": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
