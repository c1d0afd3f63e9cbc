"""Shared pieces of the benchmark scripts: start a broker, percentiles, progress, tables, plots."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kcoral import Client, KCoralError, Program


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def broker(
    *flags: str, log_path: Path | None = None, checkout: Path | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``kcoral broker`` on a free loopback port; stop it (SIGTERM) afterwards.

    ``checkout``: run the broker from that source tree (its own ``kcoral``), to compare versions.
    """
    url = f"tcp://127.0.0.1:{free_port()}"
    run_dir = Path(tempfile.mkdtemp(prefix="kcoral-bench-"))
    log_path = log_path or run_dir.with_suffix(".log")
    argv = [
        sys.executable,
        "-m",
        "kcoral.cli",
        "--log-level",
        "warning",
        "broker",
        "--listen",
        url,
        "--run-dir",
        str(run_dir / "run"),
        *flags,
    ]
    env = None if checkout is None else dict(os.environ, PYTHONPATH=str(checkout))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=checkout, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"broker exited: {log_path.read_text()}")
            try:
                with Client(url, connect_timeout_seconds=2) as client:
                    health = client.health()
                if health["workers"]["idle"] >= health["workers"]["slots"]:
                    break
            except KCoralError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker not ready: {log_path.read_text()}")
            time.sleep(0.2)
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def router(nodes: int, *broker_flags: str) -> Iterator[str]:
    """Start ``kcoral router`` and ``nodes`` brokers that join it; yield the router's client URL once
    every node is live. Everything is stopped (SIGTERM) afterwards."""
    url, nodes_url = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    log_path = Path(tempfile.mkdtemp(prefix="kcoral-bench-router-")) / "router.log"
    argv = [sys.executable, "-m", "kcoral.cli", "--log-level", "warning", "router"]
    argv += ["--listen", url, "--nodes-listen", nodes_url]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        with contextlib.ExitStack() as stack:
            for index in range(nodes):
                flags = ("--upstream", nodes_url, "--node-id", f"node-{index}", *broker_flags)
                stack.enter_context(broker(*flags))
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(KCoralError), Client(url, connect_timeout_seconds=2) as client:
                    live = [n for n in client.health().get("nodes", []) if n.get("state") == "live"]
                    if len(live) >= nodes:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"router not ready: {log_path.read_text()}")
                time.sleep(0.2)
            yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
