"""The broker's worker side without a broker: a forked worker joins, a lease is granted and held
until the worker's exit, a RESULT becomes the FINAL, and a worker that dies fails its program.

:class:`WorkerMessages` talks back to its broker through a small port; here a recording port stands
in for the broker, with the real pool, lease table and table of requests in flight, a supervisor
with no zygotes running, a real ROUTER socket and a DEALER as the worker, on loopback.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kcoral import protocol
from kcoral.broker.gpu_pids import GRANT_MOST, GpuPids
from kcoral.broker.leases import LeaseTable
from kcoral.broker.requests import Request, RequestState, Worker
from kcoral.broker.settings import BrokerSettings
from kcoral.broker.supervisor import SlotPhase, SlotSpec, SlotState, Supervisor
from kcoral.broker.worker_messages import WorkerMessages
from kcoral.broker.workers import WORKER_EXIT_GRACE_SECONDS, WorkerPool
from kcoral.protocol.worker_link import WorkerId
from kcoral.protocol.zygote_link import WorkerExit
from kcoral.service.shell import InFlightTable
from tests.links import Link, loopback_link

pytestmark = pytest.mark.timeout(60)

WORKER = WorkerId(b"w0-1")


@dataclass
class RecordingBroker:
    """The broker's side of the port: it records what the worker side asks for."""

    requests: InFlightTable[Request]
    node_id: str | None = None
    dispatches: int = 0
    finished: list[dict[str, Any]] = field(default_factory=list)  # FINAL bodies
    told: list[dict[str, Any]] = field(default_factory=list)

    def finish(self, request: Request, body: dict[str, Any], frames: list[Any]) -> None:
        if self.requests.pop(request.id) is not None:
            self.finished.append(body)

    def fail(self, request: Request, kind: str, message: str) -> None:
        self.finish(request, protocol.final_error_body(request.id, kind, message), [])

    def dispatch(self) -> None:
        self.dispatches += 1

    def worker_joined(self, worker: Worker) -> None:
        self.dispatch()

    def tell(self, request: Request, body: dict[str, Any]) -> None:
        self.told.append(body)


@dataclass
class Harness:
    side: WorkerMessages
    broker: RecordingBroker
    leases: LeaseTable
    link: Link

    async def deliver(self, command: bytes, body: dict[str, Any]) -> None:
        await self.link.deliver(self.side.on_message, command, body)

    async def join(self) -> Worker:
        await self.deliver(protocol.READY, {"slot": 0, "pid": 10})
        return self.side.pool.workers[WORKER]

    def running(self, worker: Worker) -> Request:
        """Start a program on ``worker`` as the broker's dispatch does."""
        request = Request("r1", b"alice", {"instructions": []}, protocol.parse_options({}), [], 1)
        request.state, request.gpu_ids, request.worker = RequestState.RUNNING, (0,), worker
        request.queued_at = request.started_at = time.monotonic()
        self.side.requests.add(request)
        self.side.pool.idle.pop(worker.identity)
        worker.request_id, worker.programs = request.id, 1
        return request


@asynccontextmanager
async def worker_side() -> AsyncIterator[Harness]:
    async with loopback_link(WORKER) as link:
        states = {0: SlotState(SlotSpec(0, 0, Path("/tmp/slot-0"), ("zygote",)), worker=WORKER)}
        supervisor = Supervisor([states[0].spec], on_exit=lambda exit: None, states=states)
        requests: InFlightTable[Request] = InFlightTable()
        leases = LeaseTable([0])
        broker = RecordingBroker(requests)
        side = WorkerMessages(
            BrokerSettings(),
            backend=link.backend,
            pool=WorkerPool(supervisor.states),
            requests=requests,
            leases=leases,
            supervisor=supervisor,
            port=broker,
        )
        yield Harness(side, broker, leases, link)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def holder(leases: LeaseTable) -> object:
    gpu = leases.snapshot()["0"]
    assert isinstance(gpu, dict)
    return gpu["holder"]


def test_the_forked_worker_joins_and_then_the_broker_is_ready() -> None:
    async def main() -> None:
        async with worker_side() as t:
            await t.deliver(protocol.READY, {"slot": 7, "pid": 10})  # no such slot
            assert not t.side.pool.workers and not t.side.ready_announced
            await t.join()
            assert set(t.side.pool.idle) == {WORKER}
            assert t.side.ready_announced and t.broker.dispatches == 1

    run(main)


def test_a_lease_is_held_until_the_worker_exits_and_its_result_becomes_the_final() -> None:
    async def main() -> None:
        async with worker_side() as t:
            request = t.running(await t.join())
            await t.deliver(protocol.LEASE, {"request_id": "r1"})
            no_pids: dict[str, Any] = {"own": None, "idle": [], "exited": []}  # no zygote runs: none is known
            assert await t.link.answer() == (protocol.GRANT, {"request_id": "r1", "gpu_pids": no_pids})
            assert t.side.holds_lease(request.worker, "r1") and holder(t.leases) == "r1"
            await t.deliver(protocol.RELEASE, {"request_id": "r1"})  # ignored: the exit gives it back
            await t.deliver(protocol.RESULT, protocol.program_result("r1", results={"sum": 5}))
            (final,) = t.broker.finished
            assert final["ok"] and final["result"]["status"] == "COMPLETED"
            assert final["result"]["gpu_ids"] == [0] and final["result"]["lease_wait_ms"] >= 0
            timeline = final["result"]["timeline"]  # the broker's own times, wall clock, in order
            at = [timeline[name] for name in ("received_at", "queued_at", "started_at", "result_at")]
            assert at == sorted(at) and abs(at[-1] - time.time()) < 5
            assert holder(t.leases) == "r1"  # the worker may still be on the GPU until it exits
            t.side.on_exit(WorkerExit(0, WORKER, 0, None))
            assert holder(t.leases) is None and not t.side.held_leases

    run(main)


def test_a_worker_that_dies_while_running_fails_its_program() -> None:
    async def main() -> None:
        async with worker_side() as t:
            t.running(await t.join())
            await t.deliver(protocol.PROGRESS, {"request_id": "r1", "index": 0})
            t.side.on_exit(WorkerExit(0, WORKER, None, 9))
            assert t.broker.finished == []  # its RESULT may still be in the socket
            await asyncio.sleep(WORKER_EXIT_GRACE_SECONDS + 0.1)
            (final,) = t.broker.finished
            error = final["result"]["error"]
            assert final["result"]["status"] == "FAILED" and error["kind"] == "runtime"
            assert error["instruction_index"] == 0 and "killed by signal 9" in error["message"]
            assert not t.side.pool.workers

    run(main)


def test_a_grant_names_the_holders_pid_its_spare_and_then_the_holder_gone() -> None:
    """GRANT's gpu_pids: the holder's and its slot's spare's host pids, found among the zygote's
    children by the pids the zygote reported (here the test process stands for the zygote, two
    real processes for the worker and the spare); after the holder's exit, its pid is named to
    the GPU's next holders."""

    async def main() -> None:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        worker, spare = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
        try:
            async with worker_side() as t:
                state = t.side.supervisor.states[0]
                state.zygote_host_pid = os.getpid()
                t.side.supervisor._handle_event(state, {"event": "forked", "worker": "w0-1", "pid": worker.pid})
                t.side.supervisor._handle_event(state, {"event": "spare", "worker": "w0-2", "pid": spare.pid})
                t.running(await t.join())
                await t.deliver(protocol.LEASE, {"request_id": "r1"})
                command, body = await t.link.answer()
                assert command == protocol.GRANT
                assert body["gpu_pids"] == {"own": worker.pid, "idle": [spare.pid], "exited": []}
                await t.deliver(protocol.RESULT, protocol.program_result("r1", results={}))
                assert t.side.gpu_pids.exited([0], time.monotonic()) == []  # it may still run work
                t.side.on_exit(WorkerExit(0, WORKER, 0, None))
                assert t.side.gpu_pids.exited([0], time.monotonic()) == [worker.pid]
                assert t.side.gpu_pids.exited([1], time.monotonic()) == []  # another GPU's holders: none
                # The spare is announced (it becomes the slot's worker): no longer idle.
                t.side.supervisor._handle_event(state, {"event": "forked", "worker": "w0-2", "pid": spare.pid})
                assert t.side.supervisor.worker_host_pid(0) == spare.pid
                assert t.side.supervisor.gpu_spares([0], holder_slot=0) == []
        finally:
            for process in (worker, spare):
                process.kill()
                process.wait()

    run(main)


def test_an_exited_holder_is_named_for_a_while_and_never_as_the_holder_itself() -> None:
    pids = GpuPids(keep_seconds=10.0, most=2)
    pids.lease_gone([0], 100, now=0.0)
    pids.lease_gone([0, 1], 101, now=5.0)
    pids.lease_gone([0], None, now=5.0)  # a holder whose pid was not found: nothing
    assert pids.grant([0], own=101, spares=[], now=6.0) == {"own": 101, "idle": [], "exited": [100]}
    assert pids.grant([0], own=101, spares=[100, 7], now=6.0) == {"own": 101, "idle": [7, 100], "exited": []}
    assert pids.exited([0], now=12.0) == [101]  # 100 went back 12 s ago
    pids.lease_gone([0], 102, now=12.0)
    pids.lease_gone([0], 103, now=12.0)
    assert pids.exited([0], now=12.0) == [102, 103] and pids.exited([1], now=12.0) == [101]
    many = GpuPids()
    for pid in range(1, GRANT_MOST + 101):
        many.lease_gone([pid % 8], pid, now=float(pid) / 1000)
    assert many.exited(range(8), now=10.0) == list(range(101, GRANT_MOST + 101))  # the latest, at most


def test_the_spares_of_every_slot_on_the_gpu_are_named_and_the_holder_s_own_also_by_its_sandbox_pid(
    tmp_path: Path,
) -> None:
    """On the H200 an honest benchmark() read suspect in 11 of 11 programs: NVML named the spares of
    the GPU's other slots (making their CUDA contexts) by their host pids, and its own slot's by the
    pid inside the sandbox. A GRANT now names every spare on the lease's GPUs by its host pid, and the
    holder's own slot's spare also by the pid its zygote gave."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    spares = [subprocess.Popen(sleeper) for _ in range(3)]
    try:
        specs = [SlotSpec(slot, gpu, tmp_path / str(slot), ("true",)) for slot, gpu in ((0, 0), (1, 0), (2, 1))]
        supervisor = Supervisor(specs, on_exit=lambda exit: None)
        for spec, spare in zip(specs, spares, strict=True):
            state = supervisor.states[spec.slot] = SlotState(spec)
            state.zygote_host_pid = os.getpid()  # the test stands for each zygote
            state.spare_pid = spare.pid
        assert sorted(supervisor.gpu_spares([0], holder_slot=0)) == sorted([spares[0].pid] * 2 + [spares[1].pid])
        assert supervisor.gpu_spares([1], holder_slot=0) == [spares[2].pid]
        supervisor.states[1].spare_pid = None  # slot 1's spare was announced: none named until the next
        assert supervisor.gpu_spares([0], holder_slot=1) == [spares[0].pid]
    finally:
        for process in spares:
            process.kill()
            process.wait()


def test_a_grant_waits_for_the_next_spare_of_a_slot_whose_worker_just_exited(tmp_path: Path) -> None:
    """Between a worker's exit and its zygote's next spare, a slot has its old spare and no worker:
    the spare is about to be announced and the next one forked (it would make its CUDA context
    during the next holder's measurement, unnamed). spares_named waits for that one, within bound."""

    async def main() -> None:
        specs = [SlotSpec(0, 0, tmp_path / "0", ("true",)), SlotSpec(1, 0, tmp_path / "1", ("true",))]
        supervisor = Supervisor(specs, on_exit=lambda exit: None)
        for spec in specs:
            state = supervisor.states[spec.slot] = SlotState(spec, state=SlotPhase.RUNNING)
            state.worker, state.spare, state.spare_pid = WorkerId(b"w1"), WorkerId(b"w2"), 20
        settled = supervisor.states[0]
        just_exited = supervisor.states[1]
        just_exited.worker = None
        waiting = asyncio.create_task(supervisor.spares_named([0], timeout=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        supervisor._handle_event(just_exited, {"event": "forked", "worker": "w2", "pid": 20})
        await asyncio.sleep(0.05)
        assert not waiting.done()  # its spare became the worker; the next is not named yet
        supervisor._handle_event(just_exited, {"event": "spare", "worker": "w3", "pid": 21})
        await asyncio.wait_for(waiting, 1.0)
        assert settled.spare_pid == 20 and just_exited.spare_pid == 21
        started = time.monotonic()
        await supervisor.spares_named([0], timeout=5.0)  # both settled: no wait
        assert time.monotonic() - started < 0.1

    run(main)


def test_a_spare_is_asked_for_with_a_program_only_once_the_zygote_said_it_was_gone(tmp_path: Path) -> None:
    """The zygote forks a spare ahead as it announces each worker: the broker sends ``fork_spare``
    with a program only after ``spare_gone`` for the spare it knows, and no more once the next is
    named (a stale ``spare_gone`` of another worker changes nothing)."""
    spec = SlotSpec(0, None, tmp_path / "0", ("true",))
    supervisor = Supervisor([spec], on_exit=lambda exit: None)
    state = supervisor.states[0] = SlotState(spec, state=SlotPhase.RUNNING)
    sent: list[str] = []
    supervisor._command = lambda slot, command, worker=None, **fields: sent.append(str(command))  # type: ignore[method-assign]
    state.worker, state.spare, state.spare_pid = WorkerId(b"w1"), WorkerId(b"w2"), 20
    supervisor.program_started(0)
    assert sent == []
    supervisor._handle_event(state, {"event": "spare_gone", "worker": "w9"})  # not the one it knows
    supervisor.program_started(0)
    assert sent == [] and state.spare == WorkerId(b"w2")
    supervisor._handle_event(state, {"event": "spare_gone", "worker": "w2"})
    assert state.spare is None and state.spare_pid is None
    supervisor.program_started(0)
    assert sent == ["fork_spare"]
    supervisor._handle_event(state, {"event": "spare", "worker": "w3", "pid": 21})
    supervisor.program_started(0)
    assert sent == ["fork_spare"] and state.spare == WorkerId(b"w3")
