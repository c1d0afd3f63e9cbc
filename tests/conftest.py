"""Fixtures that start real ``kcoral broker`` processes on loopback (``kcoral.testing``) and stop them
afterwards; fixtures only: what tests import is in ``tests/helpers.py``."""

from __future__ import annotations

import contextlib
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
