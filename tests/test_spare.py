"""A slot's next worker: forked ahead, before the program before it ends, and announced only once
that program's worker has exited (see kcoral.worker.zygote.Zygote). Through a real one-slot broker."""

from __future__ import annotations

import concurrent.futures
import textwrap
import time

import pytest

from kcoral import Client, Program
from tests.helpers import BrokerFactory

SLEEPER = """
import time
def sleep(seconds):
    time.sleep(seconds)
    return time.time()
"""


def program(seconds: float) -> Program:
    built = Program()
    module = built.upload(kind="module", source=textwrap.dedent(SLEEPER))
    fn = built.get_function(module=module, name="sleep", cpu_only=True)
    built.return_(key="out", value=built.run(fn=fn, args=[seconds]))
    return built


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_the_next_worker_is_forked_ahead_and_says_ready_only_after_the_program_before_it(
    broker_factory: BrokerFactory, sandbox: str
) -> None:
    broker = broker_factory("--device", "cpu", "--workers", "1", "--sandbox", sandbox)
    with Client(broker.url) as client:
        client.execute(program(0.0), timeout_seconds=30)  # the slot's first worker, forked at start
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.execute, program(0.8), timeout_seconds=30)
            time.sleep(0.3)
            second = pool.submit(client.execute, program(0.0), timeout_seconds=30)
            before, after = first.result(), second.result()
    assert before.completed and after.completed, (before.error, after.error)
    assert before.worker["identity"] != after.worker["identity"]
    # Forked before the first program ended, off the path from its end to the next program...
    assert after.worker["started_at"] < before.worker["finished_at"] - 0.2
    # ...but it said READY (and so could be given a program) only after the first one had ended.
    assert after.worker["ready_at"] >= before.worker["finished_at"]
    assert after.results["out"] >= before.results["out"]
