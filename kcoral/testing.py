"""Start a real ``kcoral broker`` or ``kcoral router`` on loopback and wait until it serves.

For tests and benchmarks (this project's, and those of people who test code against KCoral): the
service runs as ``python -m kcoral.cli`` in a subprocess, as in production, and is reached through
the public client. A broker counts as ready when every worker slot is idle (otherwise which GPUs
programs land on depends on start-up order); a router, when it answers ``health()``.

Example::

    with running_broker(tmp_path, "--fake-gpus", "2") as broker:
        with Client(broker.url) as client:
            print(client.health()["gpu_count"])   # 2
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

from kcoral.client.blocking import Client
from kcoral.errors import KCoralError

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 20.0
POLL_SECONDS = 0.1
HEALTH_TIMEOUT_SECONDS = 2.0  # one health() while starting; a slow answer is asked again
# A free port can be taken by another process between free_port() and the service's bind: a
# service started on ports it was not given is started again on new ones, this many times at most.
PORT_ATTEMPTS = 3
PORT_TAKEN = "Address already in use"


class LaunchOptions(TypedDict, total=False):
    """How :func:`start_broker` and :func:`start_router` start a service and wait for it."""

    env: Mapping[str, str]  # added to this process's environment
    cwd: Path  # where it runs: another checkout, say, to run that checkout's kcoral
    log_level: str  # "debug" unless given
    new_session: bool  # a process group of its own, as a terminal starts a foreground job
    client_options: Mapping[str, Any]  # what Client() needs to reach it (keys=..., say)
    timeout_seconds: float  # how long to wait for it to be ready


# What a broker's zygote preloads on its defaults, then the private data it holds (VmData, what
# RLIMIT_DATA and so --memory-limit count), printed: kcoral.worker.children, kcoral.worker.limits.
PRELOAD_DATA = """
from kcoral.protocol import ZYGOTE_DEFAULT_PRELOAD
from kcoral.worker.children import preload_for_workers
from kcoral.worker.limits import own_data_bytes
preload_for_workers(ZYGOTE_DEFAULT_PRELOAD)
print(own_data_bytes())
"""


@functools.cache
def preloaded_data_bytes() -> int | None:
    """The private data a worker starts with under ``--memory-limit`` here: that of a process that
    preloaded what a broker's zygote preloads on its defaults (about 220 MiB with a CPU build of
    torch, 770 MiB with a CUDA build, more with CUPTI); None where it could not be read. Measured
    once per process, in a subprocess (a second or two: it imports torch)."""
    run = subprocess.run([sys.executable, "-c", PRELOAD_DATA], capture_output=True, text=True, timeout=300)
    try:
        return int(run.stdout.split()[-1])
    except (ValueError, IndexError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningService:
    """A broker or router process started by :func:`start_broker` or :func:`start_router`."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    run_dir: Path | None = None  # a broker's --run-dir
    nodes_url: str | None = None  # a router's --nodes-listen
    client_options: Mapping[str, Any] = field(default_factory=dict)  # for Client(): keys, say

    def client(self, timeout_seconds: float = 5.0) -> Client:
        """A client of this service (close it, or use it as a context manager)."""
        return Client(self.url, connect_timeout_seconds=timeout_seconds, **self.client_options)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, timeout_seconds: float = 5.0) -> dict[str, Any]:
        with self.client(timeout_seconds) as client:
            return client.health()

    def nodes(self) -> dict[str, dict[str, Any]]:
        """A router's nodes (from its health), by node id."""
        return {node["node_id"]: node for node in self.health()["nodes"]}

    def stop(self, sig: int = signal.SIGTERM, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> int:
        """Send ``sig`` and wait for the exit (SIGKILL after ``timeout_seconds``); the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def broker_ready(health: Mapping[str, Any]) -> bool:
    workers = health["workers"]
    return bool(workers["idle"] >= workers["slots"])


def wait_ready(
    service: RunningService,
    ready: Callable[[Mapping[str, Any]], bool] = lambda health: True,
    timeout_seconds: float = START_TIMEOUT_SECONDS,
) -> None:
    """Poll ``health()`` until ``ready(health)``; RuntimeError with the log if it exits or times out."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.url}: exited with {service.process.returncode}:\n{service.log()}")
        with contextlib.suppress(KCoralError):
            if ready(service.health(HEALTH_TIMEOUT_SECONDS)):
                return
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"{service.url}: not ready within {timeout_seconds:g} s:\n{service.log()}")


def start_broker(
    work_dir: Path, *args: str, port: int | None = None, **launch: Unpack[LaunchOptions]
) -> RunningService:
    """``kcoral broker --listen tcp://127.0.0.1:PORT --run-dir WORK_DIR/run-PORT ARGS``, ready.

    Its log is ``WORK_DIR/broker-PORT.log`` (``broker-PORT-1.log`` for a second start on that
    port, ...); a broker that does not get ready is killed.
    """
    if port is None:
        return _on_free_ports(lambda: start_broker(work_dir, *args, port=free_port(), **launch))
    run_dir = work_dir / f"run-{port}"
    argv = ["broker", "--listen", f"tcp://127.0.0.1:{port}", "--run-dir", str(run_dir), *args]
    service = _spawn(argv, _fresh_log(work_dir, f"broker-{port}"), launch)
    service.run_dir = run_dir
    _wait_or_kill(service, broker_ready, launch)
    return service


def start_router(
    work_dir: Path,
    *args: str,
    url: str | None = None,
    nodes_url: str | None = None,
    **launch: Unpack[LaunchOptions],
) -> RunningService:
    """``kcoral router --listen URL --nodes-listen NODES_URL ARGS`` (free loopback ports by default), ready."""
    if url is None and nodes_url is None:
        return _on_free_ports(
            lambda: start_router(
                work_dir,
                *args,
                url=f"tcp://127.0.0.1:{free_port()}",
                nodes_url=f"tcp://127.0.0.1:{free_port()}",
                **launch,
            )
        )
    url = url or f"tcp://127.0.0.1:{free_port()}"
    nodes_url = nodes_url or f"tcp://127.0.0.1:{free_port()}"
    log_path = _fresh_log(work_dir, f"router-{url.rsplit(':', 1)[-1]}")
    service = _spawn(["router", "--listen", url, "--nodes-listen", nodes_url, *args], log_path, launch)
    service.nodes_url = nodes_url
    _wait_or_kill(service, lambda health: True, launch)
    return service


@contextlib.contextmanager
def running_broker(work_dir: Path, *args: str, **launch: Unpack[LaunchOptions]) -> Iterator[RunningService]:
    """:func:`start_broker` as a context manager that stops the broker (SIGTERM) at the end."""
    service = start_broker(work_dir, *args, **launch)
    try:
        yield service
    finally:
        service.stop()


def _on_free_ports(start: Callable[[], RunningService]) -> RunningService:
    """``start()``, again (on new free ports) where the one it chose was taken meanwhile."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return start()
        except RuntimeError as exc:
            if PORT_TAKEN not in str(exc):
                raise
    return start()


def _spawn(argv: list[str], log_path: Path, launch: LaunchOptions) -> RunningService:
    command = [sys.executable, "-m", "kcoral.cli", "--log-level", launch.get("log_level", "debug"), *argv]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **launch.get("env", {})},
            cwd=launch.get("cwd"),
            start_new_session=launch.get("new_session", False),
        )
    url = argv[argv.index("--listen") + 1]
    return RunningService(url, process, log_path, client_options=launch.get("client_options", {}))


def _fresh_log(work_dir: Path, stem: str) -> Path:
    """A log path not used yet: a service restarted on the same port keeps the first one's log."""
    path = work_dir / f"{stem}.log"
    serial = 0
    while path.exists():
        serial += 1
        path = work_dir / f"{stem}-{serial}.log"
    return path


def _wait_or_kill(service: RunningService, ready: Callable[[Mapping[str, Any]], bool], launch: LaunchOptions) -> None:
    try:
        wait_ready(service, ready, launch.get("timeout_seconds", START_TIMEOUT_SECONDS))
    except BaseException:
        service.stop(signal.SIGKILL)
        raise
