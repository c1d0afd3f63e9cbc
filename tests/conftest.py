"""Fixtures that start real ``kcoral broker`` processes on loopback and stop them afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kcoral import Client, KCoralError
from kcoral.keys import ClientKeys

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@dataclass
class RunningBroker:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    run_dir: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, keys: ClientKeys | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"broker exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            with Client(url, connect_timeout_seconds=2.0, keys=keys) as client:
                health = client.health()
            # Every slot ready: otherwise which GPUs programs land on depends on start-up order.
            if health["workers"]["idle"] >= health["workers"]["slots"]:
                return
        except KCoralError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"broker did not become healthy:\n{log_path.read_text()}")


def start_broker(
    tmp_path: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    keys: ClientKeys | None = None,
) -> RunningBroker:
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    run_dir = tmp_path / f"run-{port}"
    log_path = tmp_path / f"broker-{port}.log"
    argv = [
        sys.executable,
        "-m",
        "kcoral.cli",
        "--log-level",
        "debug",
        "broker",
        "--listen",
        url,
        "--run-dir",
        str(run_dir),
        *args,
    ]
    if "--sandbox" not in args:
        argv += ["--sandbox", "none"]
    full_env = dict(os.environ, **(env or {}))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    broker = RunningBroker(url, process, log_path, run_dir)
    try:
        wait_healthy(url, process, log_path, keys)
    except BaseException:
        broker.stop(signal.SIGKILL)
        raise
    return broker


BrokerFactory = Callable[..., RunningBroker]


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Start brokers with given flags; each is stopped (and checked to exit) at teardown."""
    started: list[RunningBroker] = []

    def factory(*args: str, **kwargs: object) -> RunningBroker:
        broker = start_broker(tmp_path, *args, **kwargs)  # type: ignore[arg-type]
        started.append(broker)
        return broker

    yield factory
    for broker in started:
        with contextlib.suppress(Exception):
            broker.stop()


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One broker (CPU, 2 fake GPUs, 2 workers each) shared by a module's tests."""
    broker = start_broker(tmp_path_factory.mktemp("broker"), "--fake-gpus", "2", "--workers-per-gpu", "2")
    yield broker
    broker.stop()


@pytest.fixture
def client(shared_broker: RunningBroker) -> Iterator[Client]:
    with Client(shared_broker.url) as c:
        yield c


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
