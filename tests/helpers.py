"""What many tests share and import: starting a real broker for a test, a free port, whether a GPU
is here, one function of uploaded source run as a program. The fixtures built on these live in
``tests/conftest.py``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Unpack

import pytest

from kcoral import Client, Program, ProgramResult, testing
from kcoral.testing import RunningService as RunningBroker
from kcoral.testing import free_port as free_port
from kcoral.testing import preloaded_data_bytes
from kcoral.units import format_bytes

__all__ = [
    "BrokerFactory",
    "RunningBroker",
    "free_port",
    "has_gpu",
    "run_function",
    "skip_where_the_preload_leaves_less_than_on_a_cpu_build",
    "start_broker",
]


def called_from(name: str) -> bool:
    """Whether a function of that name is on the stack above the caller of this function's caller:
    for a candidate that acts only when the timer calls it from a given place (the timer calls
    through its runner, so that place is a frame or more up)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


# What a broker logs where its --memory-limit is below what a worker holds before its program.
MEMORY_LIMIT_REFUSED = "is below what a worker holds before its program runs"


# The tests' memory limits (1 GiB, with their programs' sizes around it) are sized for workers whose
# zygote preloads a CPU build of torch: about 220 MiB of private data (VmData) on the 2-core VM. A
# CUDA build holds about 760 MiB there before any context (Python 3.12, torch 2.13), which leaves
# a program too little under 1 GiB.
SIZED_FOR_PRELOAD_BYTES = 512 << 20


def skip_where_the_preload_leaves_less_than_on_a_cpu_build(what: str) -> None:
    """Skip a test whose programs are sized for the room a 1 GiB ``--memory-limit`` leaves a program
    beside a CPU build of torch, where this interpreter's preloaded libraries hold more private data
    (a CUDA build of torch): ``what`` says what the test's programs need that room for."""
    held = preloaded_data_bytes()
    if held is not None and held > SIZED_FOR_PRELOAD_BYTES:
        pytest.skip(
            f"{what}: sized for the room beside a CPU build of torch, but the preloaded libraries hold "
            f"{format_bytes(held)} of private data here (a CUDA build?), over {format_bytes(SIZED_FOR_PRELOAD_BYTES)}"
        )


def start_broker(
    tmp_path: Path,
    *args: str,
    port: int | None = None,
    skip_if_limit_refused: bool = True,
    **launch: Unpack[testing.LaunchOptions],
) -> RunningBroker:
    """A broker for a test: debug logs, and no sandbox unless the test asks for one.

    On a GPU host, a broker that refuses the test's ``--memory-limit`` (its zygote's preloaded
    libraries, a CUDA build of torch and CUPTI, hold nearly 1 GiB of private data there) skips the
    test, which was sized for a CPU host; anywhere else the refusal fails it, as any other start.
    """
    sandbox = () if "--sandbox" in args else ("--sandbox", "none")
    try:
        return testing.start_broker(tmp_path, *args, *sandbox, port=port, **launch)
    except RuntimeError as exc:
        if skip_if_limit_refused and MEMORY_LIMIT_REFUSED in str(exc) and has_gpu():
            said = next((line for line in str(exc).splitlines() if MEMORY_LIMIT_REFUSED in line), "")
            pytest.skip(f"a limit sized for a CPU host, refused on this GPU host: {said.strip()[:400]}")
        raise


def run_function(url: str, source: str, name: str, *args: object, timeout_seconds: float = 120.0) -> ProgramResult:
    """Upload ``source`` as a module and run its function ``name`` on ``args`` through a client of
    its own; the value comes back under ``out``."""
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=source), name=name)
    program.return_(key="out", value=program.run(fn=fn, args=list(args)))
    with Client(url) as client:
        return client.execute(program, timeout_seconds=timeout_seconds)


BrokerFactory = Callable[..., RunningBroker]
