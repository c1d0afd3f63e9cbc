"""Across hosts: through a router, a program goes only to a node with as many GPUs as it asks for,
and one that asks for more than any node has gets ``capacity``. Real ``kcoral router`` and two
``kcoral broker --fake-gpus`` nodes of different sizes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kcoral import AsyncClient, Client, KCoralError, Program, ProgramResult
from tests.helpers import BrokerFactory
from tests.test_router import RunningRouter, router_factory, wait_live

__all__ = ["router_factory"]  # the fixture, used by name below

pytestmark = pytest.mark.timeout(90)

GPU_IDS_SOURCE = "import os\ndef gpus():\n    return os.environ.get('CUDA_VISIBLE_DEVICES')\n"


def gpus_program() -> Program:
    program = Program()
    module = program.upload(kind="module", source=GPU_IDS_SOURCE)
    program.return_(key="cvd", value=program.run(fn=program.get_function(module=module, name="gpus")))
    return program


def test_programs_go_to_nodes_with_enough_gpus_and_too_many_get_capacity(
    router_factory: Callable[..., RunningRouter], broker_factory: BrokerFactory
) -> None:
    router = router_factory()
    for node_id, gpus in (("one-gpu", "1"), ("two-gpu", "2")):
        broker_factory("--fake-gpus", gpus, "--upstream", router.nodes_url, "--node-id", node_id)
    nodes = wait_live(router, "one-gpu", "two-gpu")
    assert {n: nodes[n]["gpus"] for n in nodes} == {"one-gpu": 1, "two-gpu": 2}
    assert router.health()["gpu_count"] == 3

    async def run(counts: list[int]) -> list[ProgramResult]:
        async with AsyncClient(router.url) as client:
            return list(await asyncio.gather(*(client.execute(gpus_program(), gpu_count=n) for n in counts)))

    def dispatched() -> dict[str, int]:
        return {n: node["dispatched"] for n, node in router.nodes().items()}

    assert dispatched() == {"one-gpu": 0, "two-gpu": 0}
    pairs = asyncio.run(run([2, 2, 2, 2]))
    for result in pairs:
        assert result.completed, result.error
        assert result.node_id == "two-gpu"
        assert result.gpu_ids == [0, 1]
        assert result.results["cvd"] == "0,1"
    assert dispatched() == {"one-gpu": 0, "two-gpu": 4}  # only the node that has two GPUs
    singles = asyncio.run(run([1] * 6))
    assert all(r.completed and len(r.gpu_ids) == 1 for r in singles)
    assert {r.node_id for r in singles} <= {"one-gpu", "two-gpu"}

    with Client(router.url) as client:
        with pytest.raises(KCoralError) as caught:
            client.execute(gpus_program(), gpu_count=3)
    assert caught.value.kind == "capacity"
    assert "largest node has 2" in str(caught.value)
    assert sum(dispatched().values()) == 10  # the refused one went nowhere
