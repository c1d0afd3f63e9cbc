"""Stopping a service: SIGTERM and Ctrl-C drain (programs in flight finish, new ones are refused
``busy``), a second Ctrl-C stops at once. The broker runs in a process group of its own, as a
terminal's foreground job does, and Ctrl-C is sent to the whole group as a terminal sends it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kcoral import Client, KCoralError, Program, ProgramResult
from tests.helpers import RunningBroker, start_broker

pytestmark = pytest.mark.timeout(120)

NAP_SOURCE = "import time\ndef nap(seconds):\n    time.sleep(seconds)\n    return seconds\n"
EXIT_SECONDS = 20.0


def nap_program(seconds: float) -> Program:
    program = Program()
    module = program.upload(kind="module", source=NAP_SOURCE)
    nap = program.get_function(module=module, name="nap")
    program.return_(key="slept", value=program.run(fn=nap, args=[seconds]))
    return program


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Background:
    """One program executed in a thread, so the test can signal the broker meanwhile."""

    def __init__(self, url: str, program: Program) -> None:
        self.result: ProgramResult | None = None
        self.error: KCoralError | None = None
        self._thread = threading.Thread(target=self._run, args=(url, program), daemon=True)
        self._thread.start()

    def _run(self, url: str, program: Program) -> None:
        try:
            with Client(url) as client:
                self.result = client.execute(program, timeout_seconds=60)
        except KCoralError as exc:
            self.error = exc

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the program got no answer"


def running(broker: RunningBroker) -> int:
    with Client(broker.url, connect_timeout_seconds=5.0) as client:
        return int(client.health()["load"]["requests_in_progress"])


def interrupt(broker: RunningBroker) -> None:
    """Ctrl-C in a terminal: SIGINT to the foreground process group."""
    os.killpg(broker.process.pid, signal.SIGINT)


def exit_code(broker: RunningBroker) -> int:
    try:
        return broker.process.wait(EXIT_SECONDS)
    except subprocess.TimeoutExpired:
        broker.stop(signal.SIGKILL)
        raise AssertionError(f"the broker did not exit:\n{broker.log()}") from None


@pytest.fixture
def own_group_broker(tmp_path: Path) -> Iterator[RunningBroker]:
    broker = start_broker(tmp_path, "--workers", "2", new_session=True)
    yield broker
    broker.stop(signal.SIGKILL)


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_ctrl_c_drains_like_sigterm_and_the_program_completes(tmp_path: Path, sandbox: str) -> None:
    try:
        broker = start_broker(tmp_path, "--workers", "2", "--sandbox", sandbox, new_session=True)
    except RuntimeError as exc:
        if sandbox == "bubblewrap" and "exited with 78" in str(exc):
            pytest.skip("bwrap cannot run here")
        raise
    try:
        drains_on_ctrl_c(broker)
    finally:
        broker.stop(signal.SIGKILL)


def drains_on_ctrl_c(broker: RunningBroker) -> None:
    program = Background(broker.url, nap_program(1.5))
    wait_for(lambda: running(broker) == 1, 20, "the program to run")
    interrupt(broker)
    wait_for(lambda: "broker_draining" in broker.log(), 10, "the drain to start")
    # Draining: new programs are refused, the one in flight goes on.
    with Client(broker.url) as client, pytest.raises(KCoralError) as refused:
        client.execute(nap_program(0))
    assert refused.value.kind == "busy"
    program.join(30)
    assert program.error is None and program.result is not None
    assert program.result.completed, program.result.error
    assert program.result.results == {"slept": 1.5}
    assert exit_code(broker) == 0
    assert "zygote_died" not in broker.log()


def test_a_second_ctrl_c_stops_at_once(own_group_broker: RunningBroker) -> None:
    broker = own_group_broker
    program = Background(broker.url, nap_program(60))
    wait_for(lambda: running(broker) == 1, 20, "the program to run")
    interrupt(broker)
    wait_for(lambda: "broker_draining" in broker.log(), 10, "the drain to start")
    started = time.monotonic()
    interrupt(broker)
    assert exit_code(broker) == 0
    assert time.monotonic() - started < 10
    program.join(10)
    assert program.error is not None and program.error.kind == "engine"
    assert "stopped before the program finished" in str(program.error)


def test_sigterm_with_nothing_in_flight_stops_promptly(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, "--workers", "1")
    started = time.monotonic()
    assert broker.stop(signal.SIGTERM) == 0
    # The drain ends on an event when the last program is answered, not on a poll or a timeout.
    assert time.monotonic() - started < 10
    assert "broker_stopped" in broker.log()
