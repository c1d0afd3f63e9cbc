"""What many tests share and import: starting a real broker for a test, a free port, whether a GPU
is here. The fixtures built on these live in ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Unpack

from kcoral import testing
from kcoral.testing import RunningService as RunningBroker
from kcoral.testing import free_port as free_port

__all__ = ["BrokerFactory", "RunningBroker", "free_port", "has_gpu", "start_broker"]


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def start_broker(
    tmp_path: Path, *args: str, port: int | None = None, **launch: Unpack[testing.LaunchOptions]
) -> RunningBroker:
    """A broker for a test: debug logs, and no sandbox unless the test asks for one."""
    sandbox = () if "--sandbox" in args else ("--sandbox", "none")
    return testing.start_broker(tmp_path, *args, *sandbox, port=port, **launch)


BrokerFactory = Callable[..., RunningBroker]
