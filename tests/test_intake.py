"""Program intake without a broker: admission, blob negotiation, timeouts, size refusals, digest
mismatches and late BLOBS, in milliseconds.

:class:`ProgramIntake` talks back to its broker through a small port; here a recording port stands
in for the broker, with a real blob store (memory only) and the real table of requests in flight.
Each test runs its own event loop with ``asyncio.run``, as tests/test_leases.py does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from kcoral import Program, protocol
from kcoral.broker.blobs import BlobStore, BlobStoreSettings
from kcoral.broker.intake import OFF_LOOP_UPLOAD_BYTES, IntakeSettings, ProgramIntake
from kcoral.broker.requests import Request
from kcoral.service.admission import declared_sizes, refuse_gpu_count, refuse_new_request, refuse_size
from kcoral.service.shell import ClientMessage, InFlightTable
from kcoral.service.tasks import TaskSet

ALICE = b"alice"
BOB = b"bob"


@dataclass
class RecordingBroker:
    """The broker's side of the port: it records what intake asks for."""

    requests: InFlightTable[Request]
    draining: bool = False
    refused: list[tuple[bytes, str, str]] = field(default_factory=list)  # (client, request_id, kind)
    told: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (request_id, kind, message)
    queued: list[str] = field(default_factory=list)
    internal: list[Exception] = field(default_factory=list)

    def refuse(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        self.refused.append((client, request_id, kind))

    def tell(self, request: Request, body: dict[str, Any]) -> None:
        self.told.append((request.id, body))

    def fail(self, request: Request, kind: str, message: str) -> None:
        if self.requests.pop(request.id) is not None:
            if request.timer is not None:
                request.timer.cancel()
            self.failed.append((request.id, kind, message))

    def enqueue(self, request: Request) -> None:
        self.queued.append(request.id)

    def fail_internal(self, message: ClientMessage, exc: Exception) -> None:
        self.internal.append(exc)

    def states(self, request_id: str) -> list[str]:
        return [body["state"] for rid, body in self.told if rid == request_id]


@dataclass
class Intake:
    intake: ProgramIntake
    broker: RecordingBroker
    blobs: BlobStore
    tasks: TaskSet


def make_intake(**settings: Any) -> Intake:
    requests: InFlightTable[Request] = InFlightTable()
    broker = RecordingBroker(requests)
    blobs = BlobStore(BlobStoreSettings(memory_bytes=64 << 20))
    tasks = TaskSet()
    intake = ProgramIntake(
        IntakeSettings(**{"gpu_count": 2, **settings}), blobs=blobs, requests=requests, tasks=tasks, port=broker
    )
    return Intake(intake, broker, blobs, tasks)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def two_blob_program(first: bytes = b"a" * 100, second: bytes = b"b" * 200) -> tuple[dict[str, Any], list[str]]:
    """A program with two byte uploads, as the broker decodes it; its digests in order."""
    program = Program()
    program.return_(key="first", value=program.upload(kind="bytes", value=first))
    program.return_(key="second", value=program.upload(kind="bytes", value=second))
    wire, blobs = program.to_wire()
    return protocol.unpack_map(protocol.pack(wire)), list(blobs)


def execute(
    request_id: str, program: dict[str, Any], attached: dict[str, bytes], client: bytes = ALICE, **options: Any
) -> ClientMessage:
    body = {"request_id": request_id, "program": program, "options": options, "blobs": list(attached)}
    return ClientMessage(client, protocol.EXECUTE, request_id, body, [], [memoryview(b) for b in attached.values()])


def blobs_message(request_id: str, attached: dict[str, bytes], client: bytes = ALICE) -> ClientMessage:
    body = {"request_id": request_id, "blobs": list(attached)}
    return ClientMessage(client, protocol.BLOBS, request_id, body, [], [memoryview(b) for b in attached.values()])


FIRST, SECOND = b"a" * 100, b"b" * 200
PROGRAM, (FIRST_DIGEST, SECOND_DIGEST) = two_blob_program(FIRST, SECOND)


def test_missing_blobs_are_asked_for_then_the_program_is_queued() -> None:
    async def main() -> None:
        t = make_intake()
        t.intake.on_execute(execute("r1", PROGRAM, {FIRST_DIGEST: FIRST}))
        assert t.broker.told == [("r1", {"request_id": "r1", "state": "need_blobs", "blobs": [SECOND_DIGEST]})]
        assert t.broker.queued == []
        t.intake.on_blobs(blobs_message("r1", {SECOND_DIGEST: SECOND}))
        assert t.broker.states("r1") == ["need_blobs", "queued"]
        assert t.broker.queued == ["r1"]
        request = t.broker.requests.get("r1")
        assert request is not None and request.state == "queued" and request.timer is None
        # The same inputs again: the cache holds them, nothing is asked for.
        t.intake.on_execute(execute("r2", PROGRAM, {}))
        assert t.broker.states("r2") == ["queued"]
        assert t.broker.refused == [] and t.broker.failed == []

    run(main)


def test_a_client_that_never_sends_its_blobs_times_out() -> None:
    async def main() -> None:
        t = make_intake(negotiation_timeout_seconds=0.05)
        t.intake.on_execute(execute("r1", PROGRAM, {}))
        await asyncio.sleep(0.03)
        # An empty BLOBS brings nothing, so it does not extend the deadline.
        t.intake.on_blobs(blobs_message("r1", {}))
        await asyncio.sleep(0.04)
        assert [(rid, kind) for rid, kind, _ in t.broker.failed] == [("r1", "timeout")]
        assert "within 0.05 s" in t.broker.failed[0][2]
        assert "r1" not in t.broker.requests

    run(main)


def test_a_round_that_brings_blobs_restarts_the_deadline() -> None:
    async def main() -> None:
        t = make_intake(negotiation_timeout_seconds=0.2)
        t.intake.on_execute(execute("r1", PROGRAM, {}))
        await asyncio.sleep(0.12)
        t.intake.on_blobs(blobs_message("r1", {FIRST_DIGEST: FIRST}))
        # Past the first deadline, well before the second (with room for a slow, shared machine).
        await asyncio.sleep(0.1)
        assert t.broker.failed == []
        await asyncio.sleep(0.15)
        assert [kind for _, kind, _ in t.broker.failed] == ["timeout"]

    run(main)


def test_declared_sizes_over_the_limit_are_refused_before_any_blob() -> None:
    async def main() -> None:
        t = make_intake(max_request_bytes=250)
        assert sum(declared_sizes(PROGRAM).values()) == 300
        t.intake.on_execute(execute("r1", PROGRAM, {}))
        assert t.broker.refused == [(ALICE, "r1", "request_too_large")]
        assert len(t.broker.requests) == 0 and t.broker.told == []

    run(main)


def test_blob_bytes_over_the_limit_fail_the_request() -> None:
    async def main() -> None:
        # The program declares 300 bytes, under the limit, then sends a larger frame under a digest.
        t = make_intake(max_request_bytes=1000)
        t.intake.on_execute(execute("r1", PROGRAM, {FIRST_DIGEST: b"x" * 1001}))
        assert [(rid, kind) for rid, kind, _ in t.broker.failed] == [("r1", "request_too_large")]
        assert not t.blobs.has(FIRST_DIGEST)

    run(main)


def test_a_blob_that_does_not_match_its_digest_fails_the_request() -> None:
    async def main() -> None:
        t = make_intake()
        t.intake.on_execute(execute("r1", PROGRAM, {FIRST_DIGEST: b"not the bytes"}))
        assert [(rid, kind) for rid, kind, _ in t.broker.failed] == [("r1", "parse")]
        assert "digest mismatch" in t.broker.failed[0][2]
        assert not t.blobs.has(FIRST_DIGEST)

    run(main)


def test_a_blob_the_program_does_not_use_fails_the_request() -> None:
    async def main() -> None:
        t = make_intake()
        stray = b"stray"
        t.intake.on_execute(execute("r1", PROGRAM, {protocol.sha256_hex(stray): stray}))
        assert [(rid, kind) for rid, kind, _ in t.broker.failed] == [("r1", "parse")]
        assert "not used by the program" in t.broker.failed[0][2]

    run(main)


def test_late_blobs_are_ignored_and_strangers_blobs_refused() -> None:
    async def main() -> None:
        t = make_intake()
        t.intake.on_execute(execute("r1", PROGRAM, {FIRST_DIGEST: FIRST, SECOND_DIGEST: SECOND}))
        assert t.broker.states("r1") == ["queued"]
        # The client repeats a round after its program was queued: no answer, the program goes on.
        t.intake.on_blobs(blobs_message("r1", {SECOND_DIGEST: SECOND}))
        assert t.broker.refused == [] and t.broker.failed == [] and t.broker.states("r1") == ["queued"]
        # Another client naming the same id, or an id nobody sent: refused parse.
        t.intake.on_blobs(blobs_message("r1", {}, client=BOB))
        t.intake.on_blobs(blobs_message("nobody", {}))
        assert t.broker.refused == [(BOB, "r1", "parse"), (ALICE, "nobody", "parse")]

    run(main)


def test_admission_refusals() -> None:
    async def main() -> None:
        t = make_intake(max_queued=1)
        t.intake.on_execute(execute("r1", PROGRAM, {}))  # waits for its blobs
        t.intake.on_execute(execute("r1", PROGRAM, {}))  # the same id again
        t.intake.on_execute(execute("r2", PROGRAM, {}))  # the queue is full
        t.intake.on_execute(execute("r3", {"instructions": "no"}, {}))
        t.broker.draining = True
        t.intake.on_execute(execute("r4", PROGRAM, {}))
        assert [(rid, kind) for _, rid, kind in t.broker.refused] == [
            ("r1", "parse"),
            ("r2", "busy"),
            ("r3", "busy"),  # the queue is checked before the body
            ("r4", "busy"),
        ]
        t = make_intake(gpu_count=2)
        t.intake.on_execute(execute("r5", PROGRAM, {}, gpu_count=3))
        t.intake.on_execute(execute("r6", {"instructions": "no"}, {}))
        assert [(rid, kind) for _, rid, kind in t.broker.refused] == [("r5", "capacity"), ("r6", "parse")]

    run(main)


def test_a_large_upload_is_hashed_off_the_loop_and_then_queued() -> None:
    big = bytes(OFF_LOOP_UPLOAD_BYTES)
    program, (big_digest, small_digest) = two_blob_program(big, b"small")

    async def main() -> None:
        t = make_intake()
        t.intake.on_execute(execute("r1", program, {big_digest: big, small_digest: b"small"}))
        assert t.broker.told == []  # not yet: the thread is hashing
        assert len(t.tasks) == 1
        while len(t.tasks):
            await asyncio.sleep(0.005)
        assert t.broker.states("r1") == ["queued"] and t.blobs.has(big_digest)

    run(main)


def test_the_admission_checks_are_pure_functions() -> None:
    no: dict[str, Any] = dict(already_in_flight=False, draining=False, waiting=0, max_queued=1)
    assert refuse_new_request(service="router", **no) is None
    assert refuse_new_request(service="router", **{**no, "draining": True}) == (
        "busy",
        "the router is shutting down",
    )
    assert refuse_new_request(service="broker", **{**no, "waiting": 1}) == ("busy", "the queue is full (1 programs)")
    share = dict(no, max_queued=10, max_queued_per_client=2)
    assert refuse_new_request(service="router", **share, client_waiting=1) is None
    assert refuse_new_request(service="router", **share, client_waiting=2) == (
        "busy",
        "this client has 2 programs waiting; one client may have at most 2",
    )
    # A repeated id is answered as such, whatever its client's share.
    repeated = refuse_new_request(service="broker", **{**share, "already_in_flight": True}, client_waiting=2)
    assert repeated is not None and repeated.kind == "parse"
    assert refuse_size(10, 10, service="broker") is None
    kind, message = refuse_size(11, 10, service="router") or ("", "")
    assert kind == "request_too_large" and "this router takes at most 10" in message
    assert refuse_gpu_count(2, 2, where="this host") is None
    assert refuse_gpu_count(3, 2, where="the largest node") == (
        "capacity",
        "the program asks for 3 GPUs; the largest node has 2",
    )


@pytest.mark.parametrize("count", [1, 3])
def test_a_tensor_counts_once_however_often_it_is_named(count: int) -> None:
    import numpy as np

    program = Program()
    tensor = program.upload(kind="tensor", value=np.zeros(8, dtype=np.float32))
    for i in range(count):
        program.return_(key=f"k{i}", value=tensor)
    wire, _ = program.to_wire()
    assert sum(declared_sizes(protocol.unpack_map(protocol.pack(wire))).values()) == 32
