"""End-to-end overhead of the service: a program returning a constant, against a bare zmq round trip.

    python benchmarks/overhead.py [--requests 300] [--in-flight 8] [--json out.json] [--plot out.png]

Measured in one run: (1) a plain zmq DEALER -> ROUTER echo on loopback, (2) one Client executing a
constant program in a loop, (3) the same with a module upload and a function call, (4) programs per
second with 8 in flight through one AsyncClient. Every program runs in a fresh worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    broker,
    constant_program,
    free_port,
    function_program,
    machine,
    percentiles,
    plot_latencies,
    print_table,
    progress,
    save_json,
)
from kcoral import AsyncClient, Client


def zmq_round_trips(count: int) -> list[float]:
    """Latency of a DEALER/ROUTER echo with a small msgpack-sized body, in ms."""
    context = zmq.Context()
    url = f"tcp://127.0.0.1:{free_port()}"
    router = context.socket(zmq.ROUTER)
    router.bind(url)
    stop = threading.Event()

    def echo() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                router.send_multipart(router.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(url)
    body = b"x" * 200
    samples = []
    for i in range(count + 20):
        start = time.perf_counter()
        dealer.send_multipart([b"KC1", b"\x01", body])
        dealer.recv_multipart()
        if i >= 20:
            samples.append((time.perf_counter() - start) * 1000)
    stop.set()
    thread.join()
    dealer.close(0)
    router.close(0)
    context.term()
    return samples


def sequential(url: str, count: int, program_factory: object, label: str) -> list[float]:
    samples = []
    program = program_factory()  # type: ignore[operator]
    with Client(url) as client:
        for _ in range(5):
            client.execute(program)
        for i in range(count):
            start = time.perf_counter()
            result = client.execute(program)
            samples.append((time.perf_counter() - start) * 1000)
            assert result.completed, result.error
            progress(label, i + 1, count)
    return samples


async def in_flight(url: str, count: int, width: int) -> tuple[float, list[float]]:
    program = constant_program()
    latencies: list[float] = []
    done = 0
    async with AsyncClient(url) as client:
        semaphore = asyncio.Semaphore(width)

        async def one() -> None:
            nonlocal done
            async with semaphore:
                start = time.perf_counter()
                result = await client.execute(program)
                latencies.append((time.perf_counter() - start) * 1000)
                assert result.completed
                done += 1
                progress(f"{width} in flight", done, count)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        elapsed = time.perf_counter() - start
    return count / elapsed, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--broker-flags", default="--workers 4 --sandbox none", help="flags for kcoral broker (quoted)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG with the latency CDFs")
    args = parser.parse_args()

    zmq_samples = zmq_round_trips(args.requests * 10)
    with broker(*args.broker_flags.split()) as (url, _):
        constant = sequential(url, args.requests, constant_program, "constant program")
        function = sequential(url, args.requests, function_program, "upload+run program")
        rate, parallel = asyncio.run(in_flight(url, args.requests * 2, args.in_flight))

    rows = []
    for label, samples in (
        ("zmq DEALER/ROUTER echo", zmq_samples),
        ("program: return constant", constant),
        ("program: upload module, run", function),
        (f"constant, {args.in_flight} in flight", parallel),
    ):
        stats = percentiles(samples)
        rows.append([label, int(stats["n"]), stats["p50_ms"], stats["p99_ms"], stats["mean_ms"]])
    zmq_p50 = percentiles(zmq_samples)["p50_ms"]
    print_table(
        f"End-to-end overhead ({machine()}, broker: {args.broker_flags})",
        ["path", "n", "p50 ms", "p99 ms", "mean ms"],
        rows,
    )
    print(f"\nconstant program p50 / zmq echo p50: {percentiles(constant)['p50_ms'] / zmq_p50:.0f}x")
    print(f"programs per second with {args.in_flight} in flight: {rate:.1f}")
    save_json(args.json, {"rows": rows, "programs_per_second": rate, "machine": machine()})
    plot_latencies(
        args.plot,
        {
            "zmq echo": zmq_samples,
            "constant program": constant,
            "upload+run": function,
            f"{args.in_flight} in flight": parallel,
        },
        "KCoral end-to-end latency",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
