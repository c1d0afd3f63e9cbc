"""The federation as hosts: a router host and three broker hosts, each in a network namespace of its
own on one switch (benchmarks/simulated_hosts.py), started with the command lines of the systemd
units in deploy/systemd/, with CURVE keys. Root only; skipped, with the reason, elsewhere.

Every address used is one of the test's own hosts, in a /24 of 198.18.0.0/15; everything the test
makes (namespaces, links, processes) is removed at its end, failed or not.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.simulated_hosts import Federation, Keys, Network, unavailable_reason
from kcoral import AsyncClient, KCoralError, Program, ProgramResult, protocol

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

NODES = ("b1", "b2", "b3")
CLIENTS = ("alice", "bob")
LIVENESS_SECONDS = protocol.HEARTBEAT_INTERVAL_SECONDS * protocol.HEARTBEAT_LIVENESS
NAP_SOURCE = "import time\ndef nap(seconds):\n    time.sleep(seconds)\n    return seconds\n"


def nap_program(seconds: float) -> Program:
    program = Program()
    nap = program.get_function(module=program.upload(kind="module", source=NAP_SOURCE), name="nap")
    program.return_(key="slept", value=program.run(fn=nap, args=[seconds]))
    return program


def tensor_program(data: np.ndarray) -> Program:
    program = Program()
    program.return_(key="sum", value=program.run(
        fn=program.get_function(module=program.upload(kind="module", source="def total(x):\n    return int(x.sum())\n"),
                                name="total"),
        args=[program.upload(kind="tensor", value=data)],
    ))  # fmt: skip
    return program


@pytest.fixture
def federation(tmp_path: Path, short_tmp_path: Path) -> Iterator[Federation]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"simulated hosts need network namespaces: {reason}")
    keys = Keys(tmp_path / "etc-kcoral", nodes=NODES, clients=CLIENTS, strangers=("rogue",))
    with Network.create() as network:
        federation = Federation(network, keys, short_tmp_path)  # each host's run dir, its sockets, below it
        try:
            yield federation
        finally:
            federation.stop()


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():  # type: ignore[operator]
                return
        except KCoralError:
            pass  # a health request that got no answer in time: asked again
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_federation_as_hosts(federation: Federation) -> None:
    network = federation.network
    router_host = network.add_host("router")
    hosts = {name: network.add_host(name) for name in (*NODES, "rogue")}
    router = federation.start_router(router_host)
    for name in NODES:
        federation.start_broker(hosts[name])
    # A host whose key pair the router does not list: its broker runs, but it never joins.
    federation.start_broker(hosts["rogue"], "rogue")
    nodes = federation.wait_live(*NODES, timeout_seconds=240)
    assert sorted(nodes) == sorted(NODES), nodes
    url = router.url
    alice, bob = (federation.keys.client(name) for name in CLIENTS)

    async def spread() -> list[ProgramResult]:
        async with AsyncClient(url, keys=alice) as a, AsyncClient(url, keys=bob) as b:
            return await asyncio.gather(*(c.execute(nap_program(0.4)) for c in (a, b) * 6))

    results = asyncio.run(spread())
    assert all(r.status == "COMPLETED" for r in results), [r.error for r in results]
    ran_on = {r.node_id for r in results}
    assert ran_on == set(NODES), ran_on
    nodes = federation.nodes()
    assert sum(nodes[n]["dispatched"] for n in NODES) == 12

    # Blob affinity: the same tensor again goes to the node that holds it, and is not sent again.
    data = np.arange(1 << 16, dtype=np.int64)

    async def affinity() -> tuple[list[ProgramResult], int, int]:
        async with AsyncClient(url, keys=alice) as client:
            first = await client.execute(tensor_program(data))
            sent = client.blob_bytes_sent
            again = [await client.execute(tensor_program(data)) for _ in range(3)]
            return [first, *again], sent, client.blob_bytes_sent

    runs, sent_first, sent_all = asyncio.run(affinity())
    assert all(r.status == "COMPLETED" and r.results["sum"] == int(data.sum()) for r in runs), runs[0].error
    assert len({r.node_id for r in runs}) == 1, [r.node_id for r in runs]
    assert sent_first >= data.nbytes and sent_all == sent_first

    # A host cut off: only its program fails, with node_lost; the others complete.
    async def cut_one() -> tuple[list[ProgramResult | BaseException], float, str]:
        async with AsyncClient(url, keys=alice) as a, AsyncClient(url, keys=bob) as b:
            runs = [asyncio.create_task(c.execute(nap_program(12))) for c in (a, b, a)]
            await asyncio.to_thread(
                wait_for, lambda: all(n["in_flight"] == 1 for n in federation.nodes().values()), 20, "a program each"
            )
            cut_at = time.monotonic()
            network.cut(hosts["b2"])
            await asyncio.wait(runs, timeout=LIVENESS_SECONDS + 3, return_when=asyncio.FIRST_COMPLETED)
            lost_after = time.monotonic() - cut_at
            states = {n: v["state"] for n, v in federation.nodes().items()}
            outcomes = await asyncio.gather(*runs, return_exceptions=True)
            return outcomes, lost_after, states.get("b2", "?")

    outcomes, lost_after, b2_state = asyncio.run(cut_one())
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    completed = [o for o in outcomes if isinstance(o, ProgramResult)]
    assert len(errors) == 1 and isinstance(errors[0], KCoralError) and errors[0].kind == "node_lost", outcomes
    assert lost_after < LIVENESS_SECONDS + 3 and b2_state == "lost"
    assert len(completed) == 2 and all(r.status == "COMPLETED" for r in completed)
    assert {r.node_id for r in completed} == {"b1", "b3"}

    # The link comes back: the host registers again and takes work.
    network.restore(hosts["b2"])
    restored_at = time.monotonic()
    federation.wait_live("b2", timeout_seconds=30)
    rejoined_after = time.monotonic() - restored_at

    async def after_rejoin() -> list[ProgramResult]:
        async with AsyncClient(url, keys=bob) as client:
            return await asyncio.gather(*(client.execute(nap_program(0.5)) for _ in range(6)))

    again = asyncio.run(after_rejoin())
    assert all(r.status == "COMPLETED" for r in again) and "b2" in {r.node_id for r in again}

    # The host without an authorised node key was refused all along.
    assert "rogue" not in federation.nodes()
    assert federation.brokers["rogue"].process.poll() is None
    assert "peer_refused" in router.log()

    # Prometheus scrapes the router's --metrics-listen (the unit's 0.0.0.0:9464) from another host.
    with urllib.request.urlopen(f"http://{router.url[6:].rsplit(':', 1)[0]}:9464/metrics", timeout=5) as page:
        metrics = page.read().decode()
    assert 'kcoral_nodes{state="live"} 3.0' in metrics

    # A unit's stop (SIGTERM) drains: every service exits 0.
    statuses = federation.stop()
    assert statuses == dict.fromkeys([*NODES, "rogue", "router"], 0), statuses
    # The figures benchmarks/RESULTS.md quotes (shown with pytest -s).
    print(
        f"\nfederation: node_lost {lost_after:.2f} s after the cut, live again {rejoined_after:.2f} s after the restore"
    )
