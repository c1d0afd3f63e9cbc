"""Client sessions through a real broker with fake GPUs: a client's consecutive programs share one
worker, never another client's; the workspace and module state are wiped between them; a failure,
the idle bound and the client's end end the session; health() lists it."""

from __future__ import annotations

import textwrap
import time

import pytest

from kcoral import Client, Program, ProgramResult
from tests.helpers import BrokerFactory

pytestmark = pytest.mark.timeout(180)

SOURCE = textwrap.dedent(
    """
    import os
    import sys

    SEEN = []

    def step(name):
        SEEN.append(name)  # a module global: a fresh import in every program
        before = sorted(os.listdir("../.."))  # the slot's workspace: this program's directory alone
        with open("mine.txt", "w") as handle:
            handle.write(name)
        sys.path.append("/kcoral-session-probe-" + name)  # process state the worker puts back
        return {"seen": list(SEEN), "before": before, "probes": [p for p in sys.path if "kcoral-session-probe" in p]}

    def fail():
        raise RuntimeError("this program fails")

    def close_every_descriptor():
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the worker's sockets and RESULT context among them
        return "closed"
    """
)


def run(client: Client, name: str, *args: object, cpu_only: bool = False, timeout: float = 60) -> ProgramResult:
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=SOURCE), name=name, cpu_only=cpu_only)
    program.return_(key="out", value=program.run(fn=fn, args=list(args)))
    return client.execute(program, timeout_seconds=timeout)


def identity(result: ProgramResult) -> str:
    return str(result.worker["identity"])


FLAGS = ("--fake-gpus", "1", "--workers-per-gpu", "2", "--sandbox", "none")


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_a_clients_programs_share_one_worker_with_nothing_left_between_them(
    broker_factory: BrokerFactory, sandbox: str
) -> None:
    broker = broker_factory("--fake-gpus", "1", "--workers-per-gpu", "2", "--sandbox", sandbox)
    with Client(broker.url, session=True) as client:
        first, second, third = (run(client, "step", name) for name in ("a", "b", "c"))
        health = client.health()
    for result in (first, second, third):
        assert result.completed, result.error
    assert identity(first) == identity(second) == identity(third)  # one worker for all three
    assert second.lease_wait_ms < 50 and second.gpu_ids == first.gpu_ids == [0]  # its lease held
    # Each program found what a fresh worker finds: its own module, no files, no leftover state.
    assert second.results["out"]["seen"] == ["b"] and third.results["out"]["seen"] == ["c"]
    for result in (first, second, third):
        # (bubblewrap mounts the slot's /dev/shm at .shm, emptied with the rest)
        (own,) = [name for name in result.results["out"]["before"] if name != ".shm"]
        assert own == f"run-{result.request_id}"
    assert third.results["out"]["probes"] == ["/kcoral-session-probe-c"]
    (session,) = health["sessions"]
    assert session["programs"] == 3 and session["gpu_ids"] == [0] and session["worker"] == identity(third)


def test_a_session_never_serves_another_client(broker_factory: BrokerFactory) -> None:
    # Two GPUs: a session holds its GPU's lease while it lasts, so two sessions need two.
    broker = broker_factory("--fake-gpus", "2", "--workers-per-gpu", "2", "--sandbox", "none")
    with Client(broker.url, session=True) as alice, Client(broker.url, session=True) as bob:
        a1 = run(alice, "step", "a1")
        b1 = run(bob, "step", "b1")
        a2 = run(alice, "step", "a2")
        with Client(broker.url) as carol:  # no session (and no GPU): a fresh worker, never the sessions'
            c1 = run(carol, "step", "c1", cpu_only=True)
        b2 = run(bob, "step", "b2")
    for result in (a1, a2, b1, b2, c1):
        assert result.completed, result.error
    assert identity(a1) == identity(a2) and identity(b1) == identity(b2)
    assert identity(a1) != identity(b1) and a1.gpu_ids != b1.gpu_ids
    assert identity(c1) not in {identity(a1), identity(b1)}


def test_a_failed_program_ends_its_session(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(*FLAGS)
    with Client(broker.url, session=True) as client:
        before = run(client, "step", "a")
        failed = run(client, "fail")
        after = run(client, "step", "b")
    assert before.completed and after.completed, (before.error, after.error)
    assert failed.status == "FAILED" and failed.error is not None and failed.error["kind"] == "runtime"
    assert identity(failed) == identity(before)  # it ran in the session ...
    assert identity(after) != identity(before)  # ... which it ended: the next one starts anew


def test_an_idle_session_ends_and_its_client_closing_ends_it(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(*FLAGS, "--session-idle", "1")
    with Client(broker.url, session=True) as client:
        first = run(client, "step", "a")
        time.sleep(3.5)  # past --session-idle (checked at each one-second heartbeat)
        second = run(client, "step", "b")
        assert client.health()["sessions"][0]["worker"] == identity(second)
    assert first.completed and second.completed
    assert identity(first) != identity(second)
    with Client(broker.url) as watcher:
        deadline = time.monotonic() + 15
        while watcher.health()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert watcher.health()["sessions"] == []  # the closed client's session is gone


def test_a_program_that_closes_its_workers_descriptors_ends_its_session_alone(broker_factory: BrokerFactory) -> None:
    # Its second program: the worker's RESULT context, kept from the first, is open while it runs.
    broker = broker_factory(*FLAGS)
    with Client(broker.url, session=True) as client:
        before = run(client, "step", "a")
        closer = run(client, "close_every_descriptor", timeout=15)
        after = run(client, "step", "b", timeout=30)
    assert before.completed and after.completed, (before.error, after.error)
    if closer.status == "COMPLETED":
        assert closer.results == {"out": "closed"}
    else:  # its worker lost its sockets: it exits (or is killed at the timeout), alone
        assert closer.error is not None and closer.error["kind"] in ("runtime", "timeout"), closer.error
    assert identity(after) != identity(before)
