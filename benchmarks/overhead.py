"""End-to-end overhead of the service: a program returning a constant, against a bare zmq round trip.

    python benchmarks/overhead.py [--requests 300] [--in-flight 8] [--json out.json] [--plot out.png]
    python benchmarks/overhead.py --curve-cost [--requests 300] [--rounds 3]
    python benchmarks/overhead.py --phases [--session] [--requests 300] [--broker-flags "..."] [--json out.json]
    python benchmarks/overhead.py --against DIR [--session] [--warmup 200] [--requests 300] [--rounds 5]
    python benchmarks/overhead.py --router [--against DIR] [--wire-only] [--requests 300] [--rounds 5]

Measured in one run: (1) a plain zmq DEALER -> ROUTER echo on loopback, (2) one Client executing a
constant program in a loop, (3) the same with a module upload and a function call, (4) programs per
second with 8 in flight through one AsyncClient. Every program runs in a fresh worker process.

``--curve-cost`` instead measures what CurveZMQ costs: two brokers, one without keys and one with
``--curve-secret-key`` (keys made for the run), the constant program's p50 and the rate with 8 in
flight on each, alternating between them round by round so that both see the same machine.

``--phases`` instead finds where a constant program's milliseconds go, one program at a time, from
the wall-clock times that the client, the broker (``result.timeline``) and the worker
(``result.worker``) record on the same host: client to broker, admission, queue, broker to worker,
the worker before, during and after the program's own execution (``elapsed_ms``), the result to
the broker, and the FINAL to the client. What comes after the answer (the worker's exit, the
zygote's wipe of the slot, the next worker's fork and READY) is off the path, unless the next
program finds no worker READY: then it shows in the queue row. ``--session``: the same programs
in one client session (``Client(session=True)``), one worker for all of them.

``--against DIR`` compares two versions as ``--curve-cost`` does two brokers: one of this checkout and one of the
checkout at DIR (a second worktree at an older commit, say), alternated round by round, each
measured through the same client; with ``--session`` every client (one at a time, and the one
with N in flight) runs its programs in its session. Each measurement starts its broker from its
source tree (``PYTHONPATH``; this one too) and stops it after, so that one broker runs at a time:
with the two side by side for the whole run, the one started second read worse one at a time
(the same tree against itself on the H200: p99 11.2 against 5.3 ms, 252 against 278 programs a
second), whatever the order of the measurements and the workers' readiness before each.
``--warmup N`` (also with ``--phases``): each broker so started first serves N programs in flight
and rests a second, so that what its slots do once (the zygotes' collapse of their memory into huge
pages) is not inside its measurement: a broker measured in its first 300 programs is a young one.

``--router`` measures the router's hop: one broker that joins a ``kcoral router``, reached directly
and through the router, alternated round by round in one run (the router's p50 less the direct one's
is what the hop adds). With ``--against DIR``, the hop of this checkout and of the one at DIR in one
run: a router and a broker of each, the four paths alternated round by round. ``--wire-only``: only
the hop's phases (each program's way to the broker and back), not the totals and rates: on a
shared machine, more of them in the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
    process_cpu_seconds,
    progress,
    routed_broker,
    save_json,
)
from kcoral import AsyncClient, Client
from kcoral.keys import ClientKeys, generate_keypair

THIS_CHECKOUT = Path(__file__).resolve().parent.parent
# What alternate() measures, each time it measures it: a context that yields a broker's URL, the
# keys to reach it and its process's PID (None: its CPU is not read), a running broker's or a
# broker started for the measurement and stopped after it.
Opener = Callable[[], contextlib.AbstractContextManager[tuple[str, ClientKeys | None, int | None]]]


# After ``--warmup``'s programs: what a young broker's slots do once (their zygotes collapse their
# memory into huge pages after a few forks, kcoral.worker.huge_pages) is done before the measurement.
WARMUP_PAUSE_SECONDS = 1.0


def running(url: str, keys: ClientKeys | None = None, pid: int | None = None) -> Opener:
    """A broker that runs for the whole comparison."""
    return lambda: contextlib.nullcontext((url, keys, pid))


def started(flags: Sequence[str], checkout: Path) -> Opener:
    """A broker of ``checkout`` started for each measurement and stopped after it."""

    @contextlib.contextmanager
    def opened() -> Iterator[tuple[str, ClientKeys | None, int | None]]:
        with broker(*flags, checkout=checkout) as (url, process):
            yield url, None, process.pid

    return opened


def warm_up(url: str, args: argparse.Namespace, keys: ClientKeys | None = None) -> None:
    """``--warmup``: its programs in flight on the broker at ``url``, then a pause."""
    if args.warmup > 0:
        asyncio.run(in_flight(url, args.warmup, args.in_flight, keys, args.session))
        time.sleep(WARMUP_PAUSE_SECONDS)


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


def sequential(
    url: str,
    count: int,
    program_factory: object,
    label: str,
    keys: ClientKeys | None = None,
    session: bool = False,
) -> list[float]:
    samples = []
    program = program_factory()  # type: ignore[operator]
    with Client(url, keys=keys, session=session) as client:
        for _ in range(5):
            client.execute(program)
        for i in range(count):
            start = time.perf_counter()
            result = client.execute(program)
            samples.append((time.perf_counter() - start) * 1000)
            assert result.completed, result.error
            progress(label, i + 1, count)
    return samples


async def in_flight(
    url: str, count: int, width: int, keys: ClientKeys | None = None, session: bool = False
) -> tuple[float, list[float]]:
    program = constant_program()
    latencies: list[float] = []
    done = 0
    async with AsyncClient(url, keys=keys, session=session) as client:
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


PHASES = (
    ("client -> broker (EXECUTE read)", "t_send", "received_at"),
    ("admission, blobs (queued)", "received_at", "queued_at"),
    ("queue (sent to a worker)", "queued_at", "started_at"),
    ("broker -> worker (PROGRAM read)", "started_at", "program_at"),
    ("worker: program read and executed", "program_at", "executed_at"),
    ("  of which execute_program (elapsed_ms)", "execute_start", "execute_end"),
    ("worker: result map", "executed_at", "finished_at"),
    ("worker -> broker (packed, sent, RESULT read)", "finished_at", "result_at"),
    ("broker -> client (FINAL read)", "result_at", "t_recv"),
)


class NoTimeline(RuntimeError):
    """The broker's results carry no ``timeline`` (a tree older than the phases)."""


def phases(url: str, count: int, session: bool = False) -> dict[str, list[float]]:
    """Per-phase milliseconds of ``count`` constant programs, one at a time (see the docstring)."""
    program = constant_program()
    samples: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    samples["total"] = []
    with Client(url, session=session) as client:
        for _ in range(5):
            client.execute(program)
        for i in range(count):
            t_send = time.time()
            result = client.execute(program)
            t_recv = time.time()
            assert result.completed, result.error
            worker = result.worker
            points = {"t_send": t_send, "t_recv": t_recv, **result.timeline}
            for name in ("program_at", "executed_at", "finished_at"):
                if isinstance(worker.get(name), (int, float)):
                    points[name] = float(worker[name])
            if not {"program_at", "executed_at", "finished_at", "received_at", "result_at"} <= points.keys():
                raise NoTimeline("this broker reports no timeline (an older tree?)")
            points["execute_start"], points["execute_end"] = 0.0, result.elapsed_ms / 1000
            for name, start, end in PHASES:
                samples[name].append((points[end] - points[start]) * 1000)
            samples["total"].append((t_recv - t_send) * 1000)
            progress("phases", i + 1, count)
    return samples


def print_phases(samples: dict[str, list[float]], flags: str) -> None:
    rows = []
    for name, values in samples.items():
        stats = percentiles(values)
        rows.append([name, stats["p50_ms"], float(np.percentile(values, 90)), stats["p99_ms"], stats["mean_ms"]])
    print_table(
        f"Where a constant program's time goes, one at a time ({machine()}, broker: {flags})",
        ["phase", "p50 ms", "p90 ms", "p99 ms", "mean ms"],
        rows,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--broker-flags", default="--workers 4 --sandbox none", help="flags for kcoral broker (quoted)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG with the latency CDFs")
    parser.add_argument("--curve-cost", action="store_true", help="compare brokers with and without CurveZMQ")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per broker with --curve-cost or --against")
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="DIR",
        help="compare with a broker (with --router: a router and its broker) run from the checkout at DIR",
    )
    parser.add_argument("--phases", action="store_true", help="where a constant program's milliseconds go")
    parser.add_argument("--router", action="store_true", help="one broker directly and through kcoral router")
    parser.add_argument("--wire-only", action="store_true", help="with --router: only the hop's phases")
    parser.add_argument(
        "--session", action="store_true", help="with --phases or --against: the programs in one client session"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="with --against or --phases: N programs in flight on each broker started, and a pause, first",
    )
    args = parser.parse_args()
    if args.curve_cost:
        return curve_cost(args)
    if args.router:
        return router_hop(args)
    if args.against is not None:
        return against(args)
    if args.phases:
        with broker(*args.broker_flags.split()) as (url, _):
            warm_up(url, args)
            samples = phases(url, args.requests, args.session)
        print_phases(samples, args.broker_flags + (" (one session)" if args.session else ""))
        save_json(args.json, {"phases": samples, "machine": machine(), "broker_flags": args.broker_flags})
        return 0

    zmq_samples = zmq_round_trips(args.requests * 10)
    with broker(*args.broker_flags.split()) as (url, _):
        constant = sequential(url, args.requests, constant_program, "constant program")
        function = sequential(url, args.requests, function_program, "upload+run program")
        rate, parallel = asyncio.run(in_flight(url, args.requests * 2, args.in_flight))

    rows = []
    for label, column in (
        ("zmq DEALER/ROUTER echo", zmq_samples),
        ("program: return constant", constant),
        ("program: upload module, run", function),
        (f"constant, {args.in_flight} in flight", parallel),
    ):
        stats = percentiles(column)
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


def curve_cost(args: argparse.Namespace) -> int:
    """The constant program's p50 and the rate with N in flight, without and with CurveZMQ."""
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-keys-") as folder:
        keys_dir = Path(folder)
        generate_keypair(keys_dir / "server", "server")
        generate_keypair(keys_dir / "clients", "bench")
        keys = ClientKeys.from_files(keys_dir / "server" / "server.key", keys_dir / "clients" / "bench.key_secret")
        curve_flags = [
            "--curve-secret-key",
            str(keys_dir / "server" / "server.key_secret"),
            "--authorized-keys",
            str(keys_dir / "clients"),
        ]
        flags = args.broker_flags.split()
        with broker(*flags) as (plain_url, _), broker(*flags, *curve_flags, keys=keys) as (curve_url, _):
            rows, rates = alternate(args, {"plain": running(plain_url), "curve": running(curve_url, keys)})
    print_table(
        f"CurveZMQ cost ({machine()}, broker: {args.broker_flags}, {args.rounds} alternating rounds)",
        alternated_columns("broker", args.in_flight),
        rows,
    )
    p50_ratio, rate_ratio = rows[1][2] / rows[0][2], rows[1][4] / rows[0][4]
    print(f"\ncurve / plain: p50 {p50_ratio:.3f}x, {args.in_flight} in flight {rate_ratio:.3f}x")
    save_json(args.json, {"rows": rows, "rates": rates, "machine": machine()})
    return 0


def alternated_columns(first: str, in_flight: int) -> list[str]:
    """The columns of a table of ``alternate``'s rows, ``first`` naming what each row measured."""
    return [
        first,
        "n",
        "constant p50 ms",
        "p99 ms",
        f"programs/s, {in_flight} in flight (median)",
        "one at a time/s",
        "broker CPU ms/program",
        "client CPU ms/program",
    ]


def against(args: argparse.Namespace) -> int:
    """The constant program's p50 and the rate with N in flight, on this checkout and on ``--against``."""
    flags = args.broker_flags.split()
    other, this = started(flags, args.against.resolve()), started(flags, THIS_CHECKOUT)
    rows, rates = alternate(args, {"other": other, "this": this})
    print_table(
        f"This checkout against {args.against} ({machine()}, broker: {args.broker_flags}, "
        f"{args.rounds} alternating rounds)",
        alternated_columns("broker", args.in_flight),
        rows,
    )
    p50_ratio, rate_ratio = rows[1][2] / rows[0][2], rows[1][4] / rows[0][4]
    print(f"\nthis / other: p50 {p50_ratio:.3f}x, {args.in_flight} in flight {rate_ratio:.3f}x")
    save_json(args.json, {"rows": rows, "rates": rates, "machine": machine(), "against": str(args.against)})
    return 0


def router_hop(args: argparse.Namespace) -> int:
    """The constant program's p50 and the rate with N in flight, directly and through the router
    (of this checkout, and with ``--against`` of the one at DIR too)."""
    trees = {"": None} if args.against is None else {"other ": args.against.resolve(), "this ": THIS_CHECKOUT}
    urls: dict[str, str] = {}
    tree_of: dict[str, str] = {}  # each path's tree, by the path's name
    wire: dict[str, list[float]] = {}  # client -> broker and back, per program
    with contextlib.ExitStack() as stack:
        for tree, checkout in trees.items():
            routed_url, direct_url = stack.enter_context(routed_broker(*args.broker_flags.split(), checkout=checkout))
            urls.update({f"{tree}direct": direct_url, f"{tree}router": routed_url})
            tree_of.update({f"{tree}direct": tree, f"{tree}router": tree})
        rows: list[list[Any]] = []
        rates: dict[str, list[float]] = {}
        if not args.wire_only:
            rows, rates = alternate(args, {name: running(url) for name, url in urls.items()})
        # The hop alone, without the fresh worker's noise: the client -> broker and broker ->
        # client phases of each program (its broker's timeline), alternated round by round too.
        # A tree older than the timelines (the reference, say) has its totals only.
        untimed: set[str] = set()
        for name in in_turn(list(urls), args.rounds):
            if tree_of[name] in untimed:
                continue
            try:
                samples = phases(urls[name], max(1, args.requests // args.rounds))
            except NoTimeline:
                untimed.add(tree_of[name])
                continue
            ways = zip(samples["client -> broker (EXECUTE read)"], samples["broker -> client (FINAL read)"])
            wire.setdefault(name, []).extend(there + back for there, back in ways)
    against = f", this checkout against {args.against}" if args.against is not None else ""
    title = f"The router's hop ({machine()}, broker: {args.broker_flags}, {args.rounds} alternating rounds{against})"
    if rows:
        print_table(title, alternated_columns("path", args.in_flight), rows)
    else:
        print(f"\n{title}")
    hops = {}
    for index, tree in enumerate(trees):
        if tree in untimed:
            print(f"\n{tree}reports no timeline: its hop on the wire is not measured, only its totals")
        else:
            direct, routed = (float(np.median(wire[f"{tree}{path}"])) for path in ("direct", "router"))
            added = hops[tree.strip() or "this"] = routed - direct
            print(f"\n{tree or ''}client -> broker -> client (the EXECUTE's way there and the FINAL's back), p50:")
            print(f"  direct {direct:.3f} ms, through the router {routed:.3f} ms: the hop adds {added:+.3f} ms")
        if rows:
            direct_row, router_row = rows[2 * index], rows[2 * index + 1]
            hop, ratio = router_row[2] - direct_row[2], router_row[4] / direct_row[4]
            print(f"  router - direct: p50 {hop:+.3f} ms; {args.in_flight} in flight {ratio:.3f}x")
    if {"this", "other"} <= hops.keys():
        print(f"\nthe hop, this - other: {hops['this'] - hops['other']:+.3f} ms")
    save_json(args.json, {"rows": rows, "rates": rates, "wire_ms": wire, "hops_ms": hops, "machine": machine()})
    return 0


def in_turn(names: list[str], rounds: int) -> Iterator[str]:
    """Each of ``names`` once a round for ``rounds`` rounds, in the opposite order every other round
    (so that neither is always measured first)."""
    for index in range(rounds):
        yield from (names[::-1] if index % 2 else names)


def alternate(args: argparse.Namespace, brokers: dict[str, Opener]) -> tuple[list[list[Any]], dict[str, list[float]]]:
    """``args.rounds`` rounds, each measuring every broker in turn (in the opposite order every other
    round): rows of (name, n, p50, p99, median rate in flight, rate one at a time, the broker's
    and this client's CPU per program in flight) and the rates of each round. Each measurement
    opens its broker (see :data:`Opener`); without its process, the broker's CPU column is empty."""
    samples: dict[str, list[float]] = {name: [] for name in brokers}
    rates: dict[str, list[float]] = {name: [] for name in brokers}
    cpu: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in brokers}  # broker s, client s, programs
    per_round = max(1, args.requests // args.rounds)
    pids_known = True
    for name in in_turn(list(brokers), args.rounds):
        with brokers[name]() as (url, key, pid):
            pids_known = pids_known and pid is not None
            warm_up(url, args, key)
            samples[name] += sequential(url, per_round, constant_program, f"constant, {name}", key, args.session)
            broker_before, client_before = process_cpu_seconds(pid) if pid else 0.0, time.process_time()
            rate, _lat = asyncio.run(in_flight(url, per_round * 2, args.in_flight, key, args.session))
            cpu[name][0] += (process_cpu_seconds(pid) - broker_before) if pid else 0.0
            cpu[name][1] += time.process_time() - client_before
            cpu[name][2] += per_round * 2
            rates[name].append(rate)
    rows: list[list[Any]] = []
    for name in brokers:
        stats = percentiles(samples[name])
        one_at_a_time = 1000 * len(samples[name]) / sum(samples[name])
        broker_s, client_s, programs = cpu[name]
        rows.append(
            [
                name,
                int(stats["n"]),
                stats["p50_ms"],
                stats["p99_ms"],
                float(np.median(rates[name])),
                one_at_a_time,
                1000 * broker_s / programs if pids_known else float("nan"),
                1000 * client_s / programs,
            ]
        )
    return rows, rates


if __name__ == "__main__":
    sys.exit(main())
