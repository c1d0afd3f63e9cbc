"""Ctrl-C of a waiting client cancels its program on the service, for every kind of client.

Each test runs the client in a subprocess against a real broker, waits until the program runs,
sends SIGINT as a terminal would, and checks that the broker cancelled the program and freed its
slot long before the program would have ended by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral import Client
from tests.helpers import RunningBroker, start_broker

SLEEP_SECONDS = 120  # how long the program would run if nobody cancelled it
PROMPT_SECONDS = 10.0  # how soon the slot must be free again after Ctrl-C (typically 0.3 s)

SLEEPER = "def sleep(s):\n    import time\n    time.sleep(s)\n"

CLIENT_SCRIPT = f"""
import sys
from kcoral import Client, Program
program = Program()
fn = program.get_function(module=program.upload(kind="module", source={SLEEPER!r}), name="sleep")
program.run(fn=fn, args=[{SLEEP_SECONDS}])
with Client(sys.argv[1]) as client:
    client.execute(program, timeout_seconds=300)
"""

ASYNC_CLIENT_SCRIPT = f"""
import asyncio, sys
from kcoral import AsyncClient, Program
program = Program()
fn = program.get_function(module=program.upload(kind="module", source={SLEEPER!r}), name="sleep")
program.run(fn=fn, args=[{SLEEP_SECONDS}])
async def main():
    async with AsyncClient(sys.argv[1]) as client:
        await client.execute(program, timeout_seconds=300)
asyncio.run(main())
"""

# A notebook's case: the call is made from inside a running event loop, so a thread of the client's
# drives its loop and the caller waits for the answer (its Ctrl-C cancels the call's future).
IN_A_LOOP_SCRIPT = f"""
import asyncio, sys, time
from kcoral import Client, Program
program = Program()
fn = program.get_function(module=program.upload(kind="module", source={SLEEPER!r}), name="sleep")
program.run(fn=fn, args=[{SLEEP_SECONDS}])
async def main():
    with Client(sys.argv[1]) as client:
        try:
            client.execute(program, timeout_seconds=300)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            time.sleep(30)  # the client stays open: its CANCEL must not wait for its close
asyncio.new_event_loop().run_until_complete(main())
"""


@pytest.fixture(scope="module")
def one_slot_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    broker = start_broker(tmp_path_factory.mktemp("interrupt"), "--fake-gpus", "1")
    yield broker
    broker.stop()


def _load(url: str) -> dict[str, int]:
    with Client(url, connect_timeout_seconds=5) as client:
        health = client.health()
    return {"running": health["load"]["requests_in_progress"], "idle": health["workers"]["idle"]}


def _wait_for(predicate: object, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def _start_client(argv: list[str]) -> subprocess.Popen[str]:
    """The client's process, its output piped. As from a terminal: SIGINT not ignored, whatever
    this process inherited (a shell's background job ignores it, and a Python started so never
    raises KeyboardInterrupt)."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupt_and_check(broker: RunningBroker, argv: list[str]) -> subprocess.CompletedProcess[str]:
    process = _start_client(argv)
    try:
        _wait_for(lambda: _load(broker.url)["running"] == 1, 60, "the program runs")
        process.send_signal(signal.SIGINT)
        freed = _wait_for(
            lambda: _load(broker.url) == {"running": 0, "idle": 1}, PROMPT_SECONDS, "the slot is free again"
        )
        out, err = process.communicate(timeout=PROMPT_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert freed < PROMPT_SECONDS
    cancelled = [line for line in broker.log().splitlines() if "request_cancelled" in line]
    assert cancelled and "state=running" in cancelled[-1], broker.log()[-3000:]
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def test_ctrl_c_of_a_blocking_client_cancels_the_program(one_slot_broker: RunningBroker, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    done = _interrupt_and_check(one_slot_broker, [sys.executable, str(script), one_slot_broker.url])
    assert "KeyboardInterrupt" in done.stderr


def test_ctrl_c_of_an_async_client_cancels_the_program(one_slot_broker: RunningBroker, tmp_path: Path) -> None:
    script = tmp_path / "async_client.py"
    script.write_text(ASYNC_CLIENT_SCRIPT)
    done = _interrupt_and_check(one_slot_broker, [sys.executable, str(script), one_slot_broker.url])
    assert "KeyboardInterrupt" in done.stderr


def test_ctrl_c_of_an_adapter_cancels_the_program(one_slot_broker: RunningBroker) -> None:
    code = textwrap.dedent(f"import time; time.sleep({SLEEP_SECONDS})")
    argv = [sys.executable, "-m", "kcoral.cli", "python", "--remote", one_slot_broker.url, "--", "-c", code]
    done = _interrupt_and_check(one_slot_broker, argv)
    assert done.returncode == 130
    assert "interrupted" in done.stderr and "cancelled" in done.stderr


def test_ctrl_c_of_a_blocking_client_called_in_a_running_loop_cancels_the_program(
    one_slot_broker: RunningBroker, tmp_path: Path
) -> None:
    script = tmp_path / "in_a_loop.py"
    script.write_text(IN_A_LOOP_SCRIPT)
    process = _start_client([sys.executable, str(script), one_slot_broker.url])
    try:
        _wait_for(lambda: _load(one_slot_broker.url)["running"] == 1, 60, "the program runs")
        process.send_signal(signal.SIGINT)
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "interrupted"
        # While the client is still open, no call of its running: the cancellation went anyway.
        _wait_for(lambda: _load(one_slot_broker.url) == {"running": 0, "idle": 1}, 5, "the slot is free again")
    finally:
        process.kill()
        process.wait()
