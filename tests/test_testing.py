"""kcoral.testing: a service started on free ports it chose is started again where one was taken
between its choice and the bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral import testing


def test_a_router_whose_free_port_was_taken_meanwhile_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        ports: Iterator[int] = iter([busy, *(testing.free_port() for _ in range(8))])
        monkeypatch.setattr(testing, "free_port", lambda: next(ports))
        router = testing.start_router(tmp_path)
        try:
            assert router.url != f"tcp://127.0.0.1:{busy}"
            assert router.health()["status"] == "ok"
        finally:
            router.stop()
    first = (tmp_path / f"router-{busy}.log").read_text()
    assert testing.PORT_TAKEN in first  # the first start found it taken, and was not the last
