"""Fixtures that start real ``kcoral broker`` processes on loopback (``kcoral.testing``) and stop them
afterwards; fixtures only: what tests import is in ``tests/helpers.py``."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral import Client
from tests.helpers import BrokerFactory, RunningBroker, has_gpu, start_broker


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


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh directory with a short path, for services that make Unix sockets deep below it
    (108 bytes at most): under pytest-xdist, tmp_path is longer by its ``popen-gwN/``."""
    path = Path(tempfile.mkdtemp(prefix="kc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (pyproject.toml) on a GPU host: no workers, so that GPU tests never time kernels
    beside each other; elsewhere pytest-xdist's own count (the cores, or
    $PYTEST_XDIST_AUTO_NUM_WORKERS). A GPU device node says GPU host without importing torch."""
    if not os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") and glob.glob("/dev/nvidia[0-9]*"):
        return 0
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
