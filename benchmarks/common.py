"""Shared pieces of the benchmark scripts: start a broker, percentiles, progress, tables, plots."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kcoral import Program
from kcoral.broker.target import list_gpus
from kcoral.keys import ClientKeys
from kcoral.testing import LaunchOptions, running_broker, start_router, wait_ready
from kcoral.testing import free_port as free_port


def host_gpu_count() -> int:
    """The GPUs a broker started here on its defaults would serve (its own discovery)."""
    return len(list_gpus())


@contextlib.contextmanager
def work_directory(prefix: str) -> Iterator[Path]:
    """A directory for a service's logs, run directory and blob cache: removed once the benchmark is
    done with it (a campaign's cache held 0.8 GiB), kept where it failed, for its logs."""
    work_dir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work_dir
    except BaseException:
        let_go_of(work_dir, failed=True)
        raise
    let_go_of(work_dir, failed=False)


def let_go_of(work_dir: Path, *, failed: bool) -> None:
    """A benchmark's work directory once it is done with it: kept, and named, where it failed, for
    its logs; removed otherwise."""
    if failed:
        print(f"kept for its logs: {work_dir}", file=sys.stderr)
    else:
        shutil.rmtree(work_dir, ignore_errors=True)


@contextlib.contextmanager
def broker(
    *flags: str, checkout: Path | None = None, keys: ClientKeys | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``kcoral broker`` on a free loopback port, every slot ready; stop it (SIGTERM) afterwards.

    ``checkout``: run the broker from that source tree (its own ``kcoral``), to compare versions.
    ``keys``: how to reach a broker whose ``flags`` give it CurveZMQ.
    """
    launch: LaunchOptions = {"log_level": "warning", "timeout_seconds": 120}
    if keys is not None:
        launch["client_options"] = {"keys": keys}
    if checkout is not None:
        # Absolute: the sandbox passes PYTHONPATH on to the zygotes, which start in /workspace, where
        # a relative one names nothing; they then imported the installed kcoral, not the checkout's.
        launch.update({"cwd": checkout, "env": {"PYTHONPATH": str(checkout.resolve())}})
    # A sandboxed broker on a loaded machine can take a minute and more to fork all its zygotes.
    with work_directory("kcoral-bench-") as work_dir, running_broker(work_dir, *flags, **launch) as service:
        yield service.url, service.process


@contextlib.contextmanager
def router(nodes: int, *broker_flags: str, router_flags: Sequence[str] = ()) -> Iterator[str]:
    """Start ``kcoral router`` and ``nodes`` brokers that join it; yield the router's client URL once
    every node is live. Everything is stopped (SIGTERM) afterwards."""
    with work_directory("kcoral-bench-router-") as work_dir:
        service = start_router(work_dir, *router_flags, log_level="warning")
        try:
            with contextlib.ExitStack() as stack:
                for index in range(nodes):
                    assert service.nodes_url is not None
                    flags = ("--upstream", service.nodes_url, "--node-id", f"node-{index}", *broker_flags)
                    stack.enter_context(broker(*flags))
                wait_ready(service, lambda health: sum(n.get("state") == "live" for n in health["nodes"]) >= nodes)
                yield service.url
        finally:
            service.stop()


@contextlib.contextmanager
def routed_broker(*broker_flags: str, checkout: Path | None = None) -> Iterator[tuple[str, str]]:
    """One broker that joins a ``kcoral router``: yield (the router's client URL, the broker's
    own), once the node is live, so that one run can reach the same broker both ways.
    ``checkout``: run both from that source tree (its own ``kcoral``), to compare versions."""
    launch: LaunchOptions = {"log_level": "warning"}
    if checkout is not None:
        launch.update({"cwd": checkout, "env": {"PYTHONPATH": str(checkout.resolve())}})  # absolute: see broker()
    with work_directory("kcoral-bench-router-") as work_dir:
        service = start_router(work_dir, **launch)
        try:
            assert service.nodes_url is not None
            flags = ("--upstream", service.nodes_url, "--node-id", "node-0", *broker_flags)
            with broker(*flags, checkout=checkout) as (url, _):
                wait_ready(service, lambda health: any(n.get("state") == "live" for n in health["nodes"]))
                yield service.url, url
        finally:
            service.stop()


def constant_program(value: object = 1) -> Program:
    program = Program()
    program.return_(key="v", value=value)
    return program


def function_program() -> Program:
    program = Program()
    module = program.upload(kind="module", source="def f():\n    return 1\n")
    program.return_(key="v", value=program.run(fn=program.get_function(module=module, name="f")))
    return program


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    data = np.asarray(samples_ms)
    return {
        "n": float(len(data)),
        "p50_ms": float(np.percentile(data, 50)),
        "p99_ms": float(np.percentile(data, 99)),
        "mean_ms": float(data.mean()),
        "min_ms": float(data.min()),
    }


def progress(label: str, done: int, total: int) -> None:
    if done == total or done % max(1, total // 20) == 0:
        sys.stderr.write(f"\r{label}: {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU of one process (all its threads) so far; 0 where it cannot be read.
    For a process with everything below it: ``benchmarks/spawn.py``'s ``service_cpu_seconds``."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def machine_busy_seconds() -> float:
    """CPU time every core of this machine has spent busy so far: user, nice, system, interrupts
    and steal (``/proc/stat``'s guest time is in user's already)."""
    times = psutil.cpu_times()
    busy = ("user", "nice", "system", "irq", "softirq", "steal")
    return float(sum(getattr(times, name, 0.0) for name in busy))


def machine() -> str:
    return f"{os.cpu_count()} cores, {os.uname().machine}, Python {sys.version.split()[0]}"


def save_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))


def plot_latencies(path: str | None, series: dict[str, Sequence[float]], title: str) -> None:
    """A CDF of latency samples per series (skipped if matplotlib is missing)."""
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("matplotlib missing: no plot\n")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, samples in series.items():
        data = np.sort(np.asarray(samples))
        ax.plot(data, np.arange(1, len(data) + 1) / len(data), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    sys.stderr.write(f"plot written to {path}\n")
