"""The ``provenance`` map of every result: its parts (digests, the program's claims, the GPUs) and
the map itself through a real broker, and through a router, on loopback."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kcoral import Client, Program
from kcoral.broker.provenance import Provenance, program_claims, program_digests
from kcoral.broker.target import GpuInfo, TargetInfo
from kcoral.testing import RunningService as RunningRouter
from tests.helpers import BrokerFactory
from tests.test_router import router_factory, wait_live  # noqa: F401  (router_factory: the fixture)

pytestmark = pytest.mark.timeout(60)

DOCUMENTED_FIELDS = frozenset(
    {
        "request_id", "node_id", "hostname", "broker_instance_id", "versions", "sandbox", "device",
        "fake_gpus", "gpus", "gpu_conditions", "program", "options", "program_claims",
    }
)  # fmt: skip

SOURCE = """
from kcoral.builtins import note_seed

def run(x):
    note_seed("inputs", 1234)
    return float(x.sum())
"""


class StillGpus:
    """GPU conditions that do not change (a stand-in for NVML)."""

    driver_version = "580.95.05"
    cuda_driver_version = "13.0"

    def read(self, gpu_ids: list[int]) -> dict[str, dict[str, Any]]:
        return {str(g): {"temperature_c": 33, "sm_clock_mhz": 1980} for g in gpu_ids}


def seeded_program() -> tuple[Program, np.ndarray]:
    data = np.arange(1024, dtype=np.float32)
    program = Program()
    module = program.upload(kind="module", source=SOURCE)
    tensor = program.upload(kind="tensor", value=data)
    run = program.get_function(module=module, name="run")
    program.return_(key="sum", value=program.run(fn=run, args=[tensor]))
    return program, data


def test_the_program_digests() -> None:
    program: dict[str, Any] = {
        "instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": "x = 1\n"},
            {"op": "upload", "id": "b", "kind": "bytes", "blob": "ab" * 32, "size": 3},
            {"op": "upload", "id": "big", "kind": "module", "blob": "cd" * 32, "size": 5000},
        ]
    }
    digests = program_digests(program, ["ab" * 32, "ab" * 32, "cd" * 32])
    # A source over INLINE_SOURCE_BYTES travels as a blob: its module is named by the blob's digest.
    assert digests["modules"] == {"m": hashlib.sha256(b"x = 1\n").hexdigest(), "big": "cd" * 32}
    assert digests["blobs"] == ["ab" * 32, "cd" * 32]
    assert digests["digest"] == program_digests(dict(program), [])["digest"]  # the same program, the same digest
    program["instructions"][0]["source"] = "x = 2\n"
    assert program_digests(program, [])["digest"] != digests["digest"]


def test_the_programs_claims_are_kept_only_in_shape() -> None:
    assert program_claims({"seeds": {"compare": 7, "inputs": -3}, "torch_cuda": "13.0"}) == {
        "seeds": {"compare": 7, "inputs": -3},
        "torch_cuda": "13.0",
    }
    many = {f"s{i}": i for i in range(40)}
    bad = {"seeds": {"bad name!": 1, "ok": "7", "flag": True, **many}, "torch_cuda": "x" * 99}
    claims = program_claims(bad)
    assert len(claims["seeds"]) == 29 and "ok" not in claims["seeds"] and "flag" not in claims["seeds"]
    assert claims["torch_cuda"] is None
    assert program_claims("not a map") == {"seeds": {}, "torch_cuda": None}


def test_the_gpus_are_named_by_uuid_name_and_bus_id() -> None:
    gpu = GpuInfo(0, "NVIDIA H200", "9.0", 143771, "00000000:19:00.0", "GPU-3f1d")
    target = TargetInfo("gpu", (gpu,), extra={"torch": "2.11.0", "cupti-python": "13.0.1"})
    provenance = Provenance(target, {"kcoral": "0.1.0"}, "bubblewrap", "host", "abc", conditions=StillGpus())  # type: ignore[arg-type]
    started = provenance.at_start(
        request_id="r1",
        program={"instructions": []},
        digests=[],
        options={"timeout_seconds": 60},
        gpu_ids=[0],
        node_id="n1",
    )
    made = provenance.for_result(started, [0], {"seeds": {"compare": 5}})
    assert made["gpus"] == [{"index": 0, "uuid": "GPU-3f1d", "name": "NVIDIA H200", "pci_bus_id": "00000000:19:00.0"}]
    assert made["versions"]["driver"] == "580.95.05" and made["versions"]["cuda_driver"] == "13.0"
    assert made["versions"]["torch"] == "2.11.0" and made["versions"]["cupti-python"] == "13.0.1"
    assert made["gpu_conditions"]["start"] == made["gpu_conditions"]["end"] == {"0": StillGpus().read([0])["0"]}
    assert made["node_id"] == "n1" and made["sandbox"] == "bubblewrap"
    assert made["program_claims"]["seeds"] == {"compare": 5}


def check_provenance(result: Any, data: np.ndarray, *, node_id: str | None) -> dict[str, Any]:
    assert result.status == "COMPLETED", result.error
    provenance = result.provenance
    assert provenance["request_id"] == result.request_id
    assert provenance["node_id"] == node_id == result.node_id
    assert provenance["sandbox"] == "none"
    assert provenance["versions"]["kcoral"] and provenance["versions"]["python"]
    assert provenance["versions"]["protocol"] == "KC1"
    assert provenance["program"]["modules"] == {"upload_0": hashlib.sha256(SOURCE.encode()).hexdigest()}
    assert provenance["program"]["blobs"] == [hashlib.sha256(data.tobytes()).hexdigest()]
    assert provenance["program_claims"]["seeds"] == {"inputs": 1234}
    assert provenance["options"]["timeout_seconds"] == 30
    assert provenance["gpus"] == [{"index": 0, "uuid": None, "name": None, "pci_bus_id": None}]  # a fake GPU
    assert provenance["gpu_conditions"] == {"start": None, "end": None}  # no NVML on a CPU host
    # Every field of docs/protocol.md section 8, filled as this host allows (no NVIDIA driver here).
    assert set(provenance) >= DOCUMENTED_FIELDS, DOCUMENTED_FIELDS - set(provenance)
    assert isinstance(provenance["hostname"], str) and provenance["hostname"]
    assert isinstance(provenance["broker_instance_id"], str) and provenance["broker_instance_id"]
    assert provenance["fake_gpus"] == 1 and provenance["device"] in ("cpu", "gpu")
    assert provenance["versions"]["torch"] and provenance["versions"]["numpy"]
    assert len(provenance["program"]["digest"]) == 64
    assert "torch_cuda" in provenance["program_claims"]
    return dict(provenance)


def test_a_result_from_a_broker_carries_its_provenance(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--workers", "1", "--fake-gpus", "1")
    program, data = seeded_program()
    with Client(broker.url) as client:
        first = client.execute(program, timeout_seconds=30)
        second = client.execute(program, timeout_seconds=30)
    one = check_provenance(first, data, node_id=None)
    two = check_provenance(second, data, node_id=None)
    # The same program and blobs: the same digests, so a re-run can be told to be the same one.
    assert one["program"] == two["program"] and one["request_id"] != two["request_id"]
    assert one["broker_instance_id"] == two["broker_instance_id"]


def test_a_failed_program_has_its_provenance_too(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--workers", "1")
    program = Program()
    module = program.upload(kind="module", source="import os\ndef die():\n    os._exit(3)\n")
    program.run(fn=program.get_function(module=module, name="die", cpu_only=True))
    with Client(broker.url) as client:
        result = client.execute(program, timeout_seconds=30)
    assert result.status == "FAILED"
    assert result.provenance["request_id"] == result.request_id and result.provenance["program"]["modules"]


def test_a_result_through_a_router_names_its_node(
    request: pytest.FixtureRequest, broker_factory: BrokerFactory
) -> None:
    start_router: Callable[..., RunningRouter] = request.getfixturevalue("router_factory")
    router = start_router()
    broker_factory("--workers", "1", "--fake-gpus", "1", "--upstream", router.nodes_url, "--node-id", "east")
    wait_live(router, "east")
    program, data = seeded_program()
    with Client(router.url) as client:
        result = client.execute(program, timeout_seconds=30)
    check_provenance(result, data, node_id="east")
