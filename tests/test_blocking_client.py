"""The blocking Client drives its loop in the calling thread (kcoral.client.blocking): calls of
several threads on one client at once, a call from a thread that already runs an event loop (a
notebook's), and a client that goes on serving after them. A real broker on loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest

from kcoral import AsyncClient, Client, Program, TransportError
from tests.helpers import RunningBroker, start_broker

NAP = "def nap(s, v):\n    import time\n    time.sleep(s)\n    return v\n"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    running = start_broker(tmp_path_factory.mktemp("blocking"), "--device", "cpu", "--workers", "4")
    yield running
    running.stop()


def napping(seconds: float, value: int) -> Program:
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=NAP), name="nap", cpu_only=True)
    program.return_(key="out", value=program.run(fn=fn, args=[seconds, value]))
    return program


def test_threads_sharing_one_client_each_get_their_own_answer(broker: RunningBroker) -> None:
    with Client(broker.url) as client:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            # Staggered lengths: the thread that drives the loop is answered before the others,
            # which go on on the client's own thread.
            results = list(pool.map(lambda i: client.execute(napping(0.05 * (i % 3), i)), range(12)))
        assert [r.results["out"] for r in results] == list(range(12))
        assert all(r.completed for r in results)
        assert client.execute(napping(0, 99)).results["out"] == 99  # and it serves on after them
    assert not [t for t in threading.enumerate() if t.name == "kcoral-client"]  # no driver left behind


def test_a_call_from_inside_a_running_event_loop_is_served(broker: RunningBroker) -> None:
    # A notebook runs an event loop in the caller's thread: the client's loop cannot run there too.
    async def inside() -> list[int]:
        with Client(broker.url) as client:
            return [client.execute(napping(0, i)).results["out"] for i in range(3)]

    assert asyncio.run(inside()) == [0, 1, 2]


def test_a_client_closed_while_another_thread_waits_ends_that_call(broker: RunningBroker) -> None:
    client = Client(broker.url)
    client.open()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.execute, napping(30, 1))
        threading.Event().wait(1.0)  # it runs by now
        client.close()
        with pytest.raises(TransportError, match="the client was closed"):
            waiting.result(timeout=15)


def test_calls_in_flight_when_an_async_client_closes_are_told_it_was_closed(broker: RunningBroker) -> None:
    # Closing sends CANCEL for each; the broker's "cancelled" answers may come back before the
    # socket is gone, and are not the callers' answer (once 3 of 40 read "cancelled" under load).
    async def closed_under_them() -> list[BaseException | object]:
        client = AsyncClient(broker.url)
        await client.open()
        calls = [asyncio.ensure_future(client.execute(napping(30, i))) for i in range(3)]
        await asyncio.sleep(1.0)  # running by now
        await client.aclose()
        return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 15))

    for _ in range(3):
        outcomes = asyncio.run(closed_under_them())
        assert all(isinstance(o, TransportError) and "the client was closed" in str(o) for o in outcomes), outcomes


def test_a_program_started_at_once_is_told_queued_then_running(broker: RunningBroker) -> None:
    # The broker sends `queued` after the PROGRAM where a worker takes the program at once (the
    # worker does not wait for it), and still before `running`.
    async def states() -> list[str]:
        events: list[str] = []
        async with AsyncClient(broker.url) as client:
            for i in range(5):
                await client.execute(napping(0, i), on_progress=lambda event: events.append(event.state))
        return events

    events = asyncio.run(states())
    assert [e for e in events if e in ("queued", "running")] == ["queued", "running"] * 5
