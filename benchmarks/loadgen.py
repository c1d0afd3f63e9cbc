"""Load generator: many clients drive a broker or a router with a mix of programs.

    python3 benchmarks/loadgen.py --url tcp://127.0.0.1:5555 --clients 16 --duration 60
    python3 benchmarks/loadgen.py --broker "--fake-gpus 2" --duration 60 --plot load.png --json load.json
    python3 benchmarks/loadgen.py --router-nodes 3 --broker "--fake-gpus 2" --rate 40 --count 2000

Each of ``--clients`` clients has its own connection. Closed loop (the default): each client runs
one program at a time, back to back. Open loop (``--rate R``): programs arrive at R per second in
all (Poisson arrivals), each on the next client, however many are still in flight; their latency
counts from the moment they were due, so a service that falls behind shows it.

The mix (``--mix``) is ``KIND[:PARAM][=WEIGHT],...``:

==================  =================================================  =====================
kind                the program                                        expected outcome
==================  =================================================  =====================
constant            returns a literal; runs no function                COMPLETED
sleep[:S]           a cpu_only function sleeps S s (0.05), no lease    COMPLETED
lease[:S]           a GPU function holds the GPU lease for S s (0.02)  COMPLETED
tensor[:SIZE]       uploads fresh random bytes as a tensor (256K) and  COMPLETED
                    gets them back
crash               the worker process exits mid-function              FAILED runtime
raise               the function raises                                FAILED runtime
timeout[:S]         sleeps past its own timeout_seconds of S (1)       error timeout
benchmark           kcoral.builtins.benchmark of a 1024^2 matmul       COMPLETED (dropped
                    (only where the service has a CUDA GPU)            from the mix without)
==================  =================================================  =====================

Every program is accounted for: it COMPLETED, FAILED (with the instruction's error kind) or ended
in an error (the request error's kind, or the client's ``transport``/``protocol``), and the totals
must add up to the programs submitted. At the end: a table per kind (count, outcomes, latency
percentiles, throughput), a JSON summary (``--json``) and a plot (``--plot``) of latency over time
and its distribution. The exit status is 1 when the accounting does not add up, when any error is
of kind ``engine``, or (with ``--strict``) when any program ended other than its kind expects.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, machine, print_table, router, save_json
from kcoral import AsyncClient, KCoralError, Program
from kcoral.keys import ClientKeys, KeyFileError
from kcoral.units import parse_size

DEFAULT_MIX = "constant=4,sleep:0.05=3,lease:0.02=3,tensor:256K=2,crash=1,raise=1,timeout:1=1"
DEFAULT_TIMEOUT_SECONDS = 60.0
PROGRESS_INTERVAL_SECONDS = 0.25
PLAIN_PROGRESS_INTERVAL_SECONDS = 10.0  # when stderr is not a terminal: one line this often
# After the last submission, how long in-flight programs may still take before they are abandoned
# (cancelled, and counted as errors of kind "abandoned"): past the longest program timeout and the
# client's own margin, only a lost answer would keep one waiting.
DRAIN_MARGIN_SECONDS = 30.0

SOURCE = """
import os, time

def nap(seconds):
    time.sleep(seconds)
    return seconds

def crash():
    os._exit(3)

def fail():
    raise RuntimeError("loadgen: a deliberate failure")

def echo(x):
    return x

def matmul_benchmark():
    import torch
    from kcoral.builtins import benchmark
    from kcoral.errors import ExecutionError
    if not torch.cuda.is_available():
        raise ExecutionError("unavailable", "no CUDA GPU on this host")
    a = torch.randn(1024, 1024, device="cuda")
    result = benchmark(lambda: a @ a, config={"warmup": 5, "repeat": 20, "clock_warmup_ms": 0})
    return result["latency_ms_median"]
"""


@dataclass(frozen=True)
class Kind:
    """One entry of the mix: how to build its program and what it should end in."""

    label: str
    weight: float
    build: Callable[[], Program]
    timeout_seconds: float
    expected: str  # "COMPLETED", "FAILED:<kind>" or "error:<kind>"


def _function_program(name: str, args: Sequence[Any] = (), *, cpu_only: bool = False) -> Program:
    program = Program()
    module = program.upload(kind="module", source=SOURCE)
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    program.return_(key="value", value=program.run(fn=fn, args=list(args)))
    return program


def _constant_program() -> Program:
    program = Program()
    program.return_(key="value", value=1)
    return program


def _tensor_program(size: int) -> Program:
    # Fresh bytes every time: a round trip of the upload, not of the broker's blob cache.
    data = np.frombuffer(random.randbytes(size), dtype=np.uint8)
    program = Program()
    module = program.upload(kind="module", source=SOURCE)
    tensor = program.upload(kind="tensor", value=data)
    fn = program.get_function(module=module, name="echo", cpu_only=True)
    program.return_(key="value", value=program.run(fn=fn, args=[tensor]))
    return program


def parse_kind(entry: str, default_timeout: float) -> Kind:
    """``NAME[:PARAM][=WEIGHT]`` -> Kind; ValueError with the accepted forms."""
    spec, _, weight_text = entry.strip().partition("=")
    name, _, param = spec.partition(":")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise ValueError(f"{entry!r}: the weight after '=' must be a number") from None
    if not weight > 0:
        raise ValueError(f"{entry!r}: the weight must be > 0")

    def seconds(default: float) -> float:
        value = float(param) if param else default
        if not value >= 0:
            raise ValueError(f"{entry!r}: seconds must be >= 0")
        return value

    if name == "constant":
        program = _constant_program()
        return Kind(spec, weight, lambda: program, default_timeout, "COMPLETED")
    if name == "sleep":
        program = _function_program("nap", [seconds(0.05)], cpu_only=True)
        return Kind(spec, weight, lambda: program, default_timeout, "COMPLETED")
    if name == "lease":
        program = _function_program("nap", [seconds(0.02)])
        return Kind(spec, weight, lambda: program, default_timeout, "COMPLETED")
    if name == "tensor":
        size = parse_size(param) if param else 256 << 10
        return Kind(spec or name, weight, lambda: _tensor_program(size), default_timeout, "COMPLETED")
    if name == "crash":
        program = _function_program("crash", cpu_only=True)
        return Kind(spec, weight, lambda: program, default_timeout, "FAILED:runtime")
    if name == "raise":
        program = _function_program("fail", cpu_only=True)
        return Kind(spec, weight, lambda: program, default_timeout, "FAILED:runtime")
    if name == "timeout":
        limit = seconds(1.0)
        # It would sleep well past its timeout; bounded, in case the service failed to stop it.
        program = _function_program("nap", [limit * 10 + 5], cpu_only=True)
        return Kind(spec, weight, lambda: program, max(limit, 0.001), "error:timeout")
    if name == "benchmark":
        program = _function_program("matmul_benchmark")
        return Kind(spec, weight, lambda: program, default_timeout, "COMPLETED")
    raise ValueError(
        f"unknown kind {name!r} in {entry!r}: expected constant, sleep[:S], lease[:S], tensor[:SIZE], "
        "crash, raise, timeout[:S] or benchmark"
    )


def parse_mix(text: str, default_timeout: float) -> list[Kind]:
    kinds = [parse_kind(entry, default_timeout) for entry in text.split(",") if entry.strip()]
    if not kinds:
        raise ValueError("the mix is empty")
    labels = [k.label for k in kinds]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a kind appears twice in the mix: {labels}")
    return kinds


@dataclass
class Sample:
    """One program's fate."""

    kind: str
    client: int
    due_s: float  # when it was due (open loop) or submitted (closed loop), from the start
    latency_ms: float
    outcome: str  # COMPLETED, FAILED or error
    error_kind: str | None = None
    queue_ms: float | None = None
    lease_wait_ms: float | None = None
    elapsed_ms: float | None = None
    node_id: str | None = None

    @property
    def fate(self) -> str:
        return self.outcome if self.outcome == "COMPLETED" else f"{self.outcome}:{self.error_kind}"


@dataclass
class Load:
    """What drives the run and what it has seen so far (read by the progress display)."""

    kinds: list[Kind]
    clients: int
    duration_s: float | None
    count: int | None
    rate: float | None
    seed: int
    samples: list[Sample] = field(default_factory=list)
    submitted: int = 0
    started: float = 0.0
    submitting_ended: float | None = None

    @property
    def in_flight(self) -> int:
        return self.submitted - len(self.samples)

    def may_submit(self) -> bool:
        if self.count is not None and self.submitted >= self.count:
            return False
        return self.duration_s is None or time.monotonic() - self.started < self.duration_s


async def run_one(client: AsyncClient, index: int, load: Load, kind: Kind, due: float) -> None:
    try:
        program = kind.build()
        result = await client.execute(program, timeout_seconds=kind.timeout_seconds)
    except KCoralError as exc:
        sample = Sample(kind.label, index, due - load.started, 0.0, "error", exc.kind)
    except asyncio.CancelledError:
        sample = Sample(kind.label, index, due - load.started, 0.0, "error", "abandoned")
        load.samples.append(_timed(sample, due))
        raise
    except Exception as exc:  # a bug here must still be counted, not lost
        sample = Sample(kind.label, index, due - load.started, 0.0, "error", f"loadgen:{type(exc).__name__}")
    else:
        sample = Sample(
            kind.label,
            index,
            due - load.started,
            0.0,
            result.status,
            (result.error or {}).get("kind"),
            result.queue_ms,
            result.lease_wait_ms,
            result.elapsed_ms,
            getattr(result, "node_id", None) or result.worker.get("node_id"),
        )
    load.samples.append(_timed(sample, due))


def _timed(sample: Sample, due: float) -> Sample:
    sample.latency_ms = (time.monotonic() - due) * 1000
    return sample


async def closed_loop(clients: list[AsyncClient], load: Load, rng: random.Random) -> None:
    weights = [k.weight for k in load.kinds]

    async def client_loop(index: int, client: AsyncClient) -> None:
        while load.may_submit():
            load.submitted += 1
            kind = rng.choices(load.kinds, weights)[0]
            await run_one(client, index, load, kind, time.monotonic())

    await asyncio.gather(*(client_loop(i, c) for i, c in enumerate(clients)))


async def open_loop(clients: list[AsyncClient], load: Load, rng: random.Random) -> set[asyncio.Task[None]]:
    assert load.rate
    weights = [k.weight for k in load.kinds]
    tasks: set[asyncio.Task[None]] = set()
    due = time.monotonic()
    index = 0
    while load.may_submit():
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
            if not load.may_submit():
                break
        load.submitted += 1
        kind = rng.choices(load.kinds, weights)[0]
        task = asyncio.create_task(run_one(clients[index % len(clients)], index % len(clients), load, kind, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        index += 1
        due += rng.expovariate(load.rate)
    return tasks


async def drive(
    url: str, load: Load, progress: Callable[[Load, bool], None] | None, keys: ClientKeys | None = None
) -> None:
    rng = random.Random(load.seed)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient(url, connect_timeout_seconds=30, keys=keys))
            for _ in range(load.clients)
        ]
        reporter = asyncio.create_task(_report(load, progress)) if progress else None
        load.started = time.monotonic()
        drain_limit = max(k.timeout_seconds for k in load.kinds) + DRAIN_MARGIN_SECONDS
        if load.rate:
            tasks = await open_loop(clients, load, rng)
            load.submitting_ended = time.monotonic()
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=drain_limit)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        else:
            loop_task = asyncio.create_task(closed_loop(clients, load, rng))
            limit = None if load.duration_s is None else load.duration_s + drain_limit
            done, _ = await asyncio.wait({loop_task}, timeout=limit)
            if not done:
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
            load.submitting_ended = load.submitting_ended or time.monotonic()
        if reporter:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
            progress(load, True)  # type: ignore[misc]


async def _report(load: Load, progress: Callable[[Load, bool], None] | None) -> None:
    assert progress is not None
    while True:
        progress(load, False)
        await asyncio.sleep(PROGRESS_INTERVAL_SECONDS)


class ProgressBar:
    """A one-line bar on a terminal; a line every few seconds otherwise."""

    WIDTH = 30

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.last_plain = 0.0

    def __call__(self, load: Load, final: bool) -> None:
        elapsed = time.monotonic() - load.started
        if load.duration_s is not None:
            fraction, total = min(1.0, elapsed / load.duration_s), f"{elapsed:5.1f}/{load.duration_s:g} s"
        else:
            done_count = load.count or 1
            fraction, total = min(1.0, load.submitted / done_count), f"{load.submitted}/{load.count} submitted"
        errors = sum(1 for s in load.samples if s.outcome == "error")
        failed = sum(1 for s in load.samples if s.outcome == "FAILED")
        rate = len(load.samples) / elapsed if elapsed > 0 else 0.0
        text = (
            f"{total}  {len(load.samples)} done ({rate:.1f}/s), {load.in_flight} in flight, "
            f"{failed} failed, {errors} errors"
        )
        if self.tty:
            filled = int(fraction * self.WIDTH)
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {text}\x1b[K")
            if final:
                self.stream.write("\n")
        elif final or time.monotonic() - self.last_plain >= PLAIN_PROGRESS_INTERVAL_SECONDS:
            self.last_plain = time.monotonic()
            self.stream.write(f"loadgen: {text}\n")
        self.stream.flush()


# --- the report ---


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else math.nan


def summarize(load: Load, url: str, service: str) -> dict[str, Any]:
    ended = load.submitting_ended or time.monotonic()
    wall = max(1e-9, (max([load.started, ended]) - load.started))
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in [*load.kinds, None]:
        label = kind.label if kind else "all"
        samples = [s for s in load.samples if kind is None or s.kind == label]
        latencies = [s.latency_ms for s in samples]
        fates = Counter(s.fate for s in samples)
        entry: dict[str, Any] = {
            "count": len(samples),
            "completed": sum(1 for s in samples if s.outcome == "COMPLETED"),
            "failed": sum(1 for s in samples if s.outcome == "FAILED"),
            "errors": sum(1 for s in samples if s.outcome == "error"),
            "fates": dict(sorted(fates.items())),
            "p50_ms": _percentile(latencies, 50),
            "p90_ms": _percentile(latencies, 90),
            "p99_ms": _percentile(latencies, 99),
            "max_ms": max(latencies) if latencies else math.nan,
            "throughput_per_s": len(samples) / wall,
        }
        if kind is not None:
            entry["expected"] = kind.expected
            entry["unexpected"] = sum(n for fate, n in fates.items() if fate != kind.expected)
        queue = [s.queue_ms for s in samples if s.queue_ms is not None]
        entry["queue_p50_ms"] = _percentile(queue, 50)
        by_kind[label] = entry
    overall = by_kind["all"]
    engine = sum(1 for s in load.samples if s.error_kind == "engine")
    return {
        "url": url,
        "service": service,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "clients": load.clients,
        "mode": f"open loop at {load.rate:g}/s" if load.rate else "closed loop",
        "duration_s": load.duration_s,
        "count": load.count,
        "wall_s": wall,
        "submitted": load.submitted,
        "completed": overall["completed"],
        "failed": overall["failed"],
        "errors": overall["errors"],
        "accounted": overall["completed"] + overall["failed"] + overall["errors"] == load.submitted,
        "engine_errors": engine,
        "unexpected": sum(e.get("unexpected", 0) for e in by_kind.values()),
        "nodes": dict(Counter(s.node_id for s in load.samples if s.node_id)),
        "kinds": by_kind,
    }


# Error kinds only a client can see: the service never counts them.
CLIENT_SIDE_KINDS = ("transport", "protocol", "abandoned")


def scrape_programs(url: str) -> dict[tuple[str, str], float]:
    """kcoral_programs_total from a metrics endpoint: (outcome, error kind) -> count."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kcoral_programs_total":
                counts[(sample.labels["outcome"], sample.labels["error_kind"])] = sample.value
    return counts


def compare_with_service(
    load: Load, before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, Any]:
    """The service's own counts of this run (the endpoint's difference) beside the loadgen's."""
    service = {f"{o}:{k}" if k else o: after.get((o, k), 0) - before.get((o, k), 0) for o, k in after}
    service = {key: int(n) for key, n in sorted(service.items()) if n}
    seen: Counter[str] = Counter()
    for sample in load.samples:
        if sample.outcome == "error" and (sample.error_kind in CLIENT_SIDE_KINDS or ":" in str(sample.error_kind)):
            continue
        outcome = {"COMPLETED": "completed", "FAILED": "failed"}.get(sample.outcome, "error")
        seen[f"{outcome}:{sample.error_kind}" if outcome != "completed" else outcome] += 1
    loadgen = dict(sorted(seen.items()))
    return {"service": service, "loadgen": loadgen, "agree": service == loadgen}


def print_report(summary: dict[str, Any]) -> None:
    rows = []
    for label, entry in summary["kinds"].items():
        fates = ", ".join(f"{fate} {n}" for fate, n in entry["fates"].items())
        rows.append(
            [
                label,
                entry["count"],
                fates or "-",
                entry.get("unexpected", ""),
                entry["p50_ms"],
                entry["p90_ms"],
                entry["p99_ms"],
                entry["max_ms"],
                entry["throughput_per_s"],
            ]
        )
    title = (
        f"{summary['service']} {summary['url']}: {summary['clients']} clients, {summary['mode']}, "
        f"{summary['wall_s']:.1f} s of submissions ({summary['machine']})"
    )
    header = ["kind", "count", "outcomes", "unexpected", "p50 ms", "p90 ms", "p99 ms", "max ms", "per s"]
    print_table(title, header, rows)
    verdict = "yes" if summary["accounted"] else "NO"
    print(
        f"\nsubmitted {summary['submitted']} = completed {summary['completed']} + failed {summary['failed']} "
        f"+ errors {summary['errors']}: accounted for: {verdict}; engine errors: {summary['engine_errors']}; "
        f"outcomes other than expected: {summary['unexpected']}"
    )
    if summary["nodes"]:
        print("programs per node: " + ", ".join(f"{n} {c}" for n, c in sorted(summary["nodes"].items())))
    metrics = summary.get("metrics")
    if metrics:
        verdict = "yes" if metrics["agree"] else "NO"
        print(f"the service's metrics agree with these counts: {verdict}")
        print(f"  service (kcoral_programs_total, this run): {metrics['service']}")
        print(f"  loadgen:                                   {metrics['loadgen']}")


def plot(path: str, load: Load, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (over_time, distribution) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind in load.kinds:
        samples = [s for s in load.samples if s.kind == kind.label]
        if not samples:
            continue
        ok = [s for s in samples if s.outcome != "error"]
        failed = [s for s in samples if s.outcome == "error"]
        (line,) = over_time.plot(
            [s.due_s for s in ok], [max(s.latency_ms, 0.01) for s in ok], ".", markersize=3, label=kind.label
        )
        if failed:
            over_time.plot(
                [s.due_s for s in failed],
                [max(s.latency_ms, 0.01) for s in failed],
                "x",
                markersize=4,
                color=line.get_color(),
            )
        data = np.sort([max(s.latency_ms, 0.01) for s in samples])
        distribution.plot(data, np.arange(1, len(data) + 1) / len(data), label=kind.label, color=line.get_color())
    over_time.set_yscale("log")
    over_time.set_xlabel("submitted at (s from start)")
    over_time.set_ylabel("end-to-end latency (ms, log); x: request error")
    over_time.set_title("latency over time")
    over_time.grid(True, which="both", alpha=0.3)
    distribution.set_xscale("log")
    distribution.set_xlabel("end-to-end latency (ms, log)")
    distribution.set_ylabel("fraction of programs")
    distribution.set_title("distribution (CDF)")
    distribution.grid(True, which="both", alpha=0.3)
    distribution.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    sys.stderr.write(f"plot written to {path}\n")


# --- the command line ---


@contextlib.contextmanager
def service(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """The URL to drive and a description: --url, or a broker or a router with nodes started here."""
    if args.url:
        yield args.url, "service"
        return
    flags = shlex.split(args.broker or "")
    if args.router_nodes:
        with router(args.router_nodes, *flags, router_flags=shlex.split(args.router or "")) as url:
            yield url, f"router with {args.router_nodes} brokers ({args.broker or 'default flags'})"
    else:
        with broker(*flags) as (url, _):
            yield url, f"broker ({args.broker or 'default flags'})"


async def probe_benchmark(url: str, kinds: list[Kind], keys: ClientKeys | None = None) -> list[Kind]:
    """Drop ``benchmark`` from the mix where the service has no CUDA GPU (it would only fail)."""
    bench = [k for k in kinds if k.label == "benchmark"]
    if not bench:
        return kinds
    async with AsyncClient(url, connect_timeout_seconds=30, keys=keys) as client:
        result = await client.execute(bench[0].build(), timeout_seconds=120)
    if result.completed:
        return kinds
    sys.stderr.write(f"loadgen: benchmark dropped from the mix: {(result.error or {}).get('message')}\n")
    rest = [k for k in kinds if k.label != "benchmark"]
    if not rest:
        raise SystemExit("loadgen: nothing left in the mix")
    return rest


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The docstring as written (its table of kinds), and each flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 benchmarks/loadgen.py", description=__doc__, formatter_class=_HelpFormatter
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="drive this broker or router (default: start a broker here)")
    parser.add_argument("--broker", default="--fake-gpus 2", help="flags of the broker(s) started here")
    target.add_argument("--router-nodes", type=int, default=0, help="start a router with this many brokers")
    parser.add_argument("--router", default="", help="flags of the router started here (with --router-nodes)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, one connection each")
    parser.add_argument("--rate", type=float, default=None, help="open loop: programs per second in all")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of submissions (default: 30, unless --count)"
    )
    parser.add_argument("--count", type=int, default=None, help="programs to submit in all")
    parser.add_argument("--mix", default=DEFAULT_MIX, help="KIND[:PARAM][=WEIGHT],...")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="timeout_seconds of each program but 'timeout'"
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the mix and the arrivals")
    parser.add_argument("--json", help="write the summary (and every sample) here")
    parser.add_argument("--plot", help="write a PNG of latency over time and its distribution here")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any program ends unexpectedly")
    parser.add_argument("--server-key", metavar="FILE", help="with --url: the service's public key file (CurveZMQ)")
    parser.add_argument("--client-key", metavar="FILE", help="with --url: this client's secret key file")
    parser.add_argument(
        "--metrics",
        metavar="URL",
        help="the service's Prometheus endpoint (http://HOST:PORT/metrics): its program counts for the run "
        "are compared with the loadgen's",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.duration is None and args.count is None:
        args.duration = 30.0
    for name in ("clients", "count", "duration", "rate"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name} must be > 0")
    try:
        kinds = parse_mix(args.mix, args.timeout)
    except ValueError as exc:
        parser.error(f"--mix: {exc}")
    if (args.server_key is None) != (args.client_key is None):
        parser.error("--server-key and --client-key go together")
    try:
        keys = ClientKeys.from_files(Path(args.server_key), Path(args.client_key)) if args.server_key else None
    except KeyFileError as exc:
        parser.error(str(exc))
    with service(args) as (url, description):
        kinds = asyncio.run(probe_benchmark(url, kinds, keys))
        load = Load(kinds, args.clients, args.duration, args.count, args.rate, args.seed)
        progress = None if args.quiet else ProgressBar(sys.stderr)
        before = scrape_programs(args.metrics) if args.metrics else {}
        asyncio.run(drive(url, load, progress, keys))
        after = scrape_programs(args.metrics) if args.metrics else {}
    summary = summarize(load, url, description)
    if args.metrics:
        summary["metrics"] = compare_with_service(load, before, after)
    print_report(summary)
    if args.json:
        save_json(args.json, {**summary, "samples": [asdict(s) for s in load.samples]})
    if args.plot:
        plot(args.plot, load, f"{description}, {args.clients} clients, {summary['mode']}")
    bad = not summary["accounted"] or summary["engine_errors"] or (args.strict and summary["unexpected"])
    bad = bad or (args.metrics and not summary["metrics"]["agree"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Kind", "Load", "Sample", "main", "parse_mix", "summarize"]
