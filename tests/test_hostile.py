"""What a hostile program could still do to its own result or to the next one (issue 26), through a
real broker under both sandboxes: flood the worker's socket with PROGRESS from threads that outlive
its function, spread its memory over CLONE_PARENT children, hand a descriptor to another slot's
program over an abstract Unix socket, and leave a POSIX message queue for the next program.
"""

from __future__ import annotations

import concurrent.futures
import signal
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral import Client, Program, ProgramResult
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from tests.conftest import RunningBroker, start_broker
from tests.helpers import skip_where_the_preload_leaves_less_than_on_a_cpu_build
from tests.hostile_programs import FLOOD, POPULATED, SPREAD

try:
    check_bwrap()
    BWRAP_ERROR = ""
except SandboxUnavailable as exc:
    BWRAP_ERROR = str(exc)

BUBBLEWRAP = pytest.param(
    "bubblewrap", marks=[pytest.mark.bubblewrap, pytest.mark.skipif(bool(BWRAP_ERROR), reason=BWRAP_ERROR)]
)
FLAGS = ("--fake-gpus", "1", "--workers-per-gpu", "2", "--memory-limit", "1g", "--max-processes", "64")
TIMEOUT_S = 60.0
PEAK_TRIES = 3


@pytest.fixture(scope="module", params=["none", BUBBLEWRAP])
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    running = start_broker(root, "--sandbox", request.param, *FLAGS)
    yield running
    assert running.stop() == 0, running.log()


def sandbox_of(broker: RunningBroker) -> str:
    return str(broker.health()["sandbox"])


def program_of(source: str, name: str, *args: Any, cpu_only: bool = True) -> Program:
    program = Program()
    module = program.upload(kind="module", source=textwrap.dedent(source))
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    program.return_(key="out", value=program.run(fn=fn, args=list(args)))
    return program


def execute(url: str, program: Program) -> ProgramResult:
    with Client(url) as client:
        return client.execute(program, timeout_seconds=TIMEOUT_S)


@pytest.mark.parametrize("how", ["thread", "unseen", "joined"])
def test_a_progress_flood_from_the_programs_own_thread_loses_no_result(broker: RunningBroker, how: str) -> None:
    """The RESULT goes on the worker's own socket only where no thread but the worker's is left
    (``unseen``: one that threading never lists, found in the kernel's list of the process's
    threads); ``joined``: the flood stopped before the return, its messages still queued there."""
    programs = []
    for _ in range(8):
        program = Program()  # the run is the last instruction: after it the worker sends only its RESULT
        module = program.upload(kind="module", source=FLOOD)
        program.run(fn=program.get_function(module=module, name="flood", cpu_only=True), args=[0.3, how])
        programs.append(program)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: execute(broker.url, p), programs))
    for result in results:
        assert result.completed, result.error
    assert execute(broker.url, program_of("def f():\n    return 1\n", "f")).results["out"] == 1


def test_memory_spread_over_clone_parent_children_does_not_complete(broker: RunningBroker) -> None:
    """Three CLONE_PARENT children of 600 MiB each for 3 s: 1.8 GiB against the 1 GiB limit (at
    3 x 450 MiB the watchdog's proportional count came to 0.92 to 1.05 GiB: a coin toss)."""
    skip_where_the_preload_leaves_less_than_on_a_cpu_build("children of 600 MiB each, each under RLIMIT_DATA 1 GiB")
    result = execute(broker.url, program_of(SPREAD, "spread", 3, 600, 3.0))
    assert not result.completed, f"{result.results['out']} children held 600 MiB for 3 s"
    assert result.error is not None and "--memory-limit" in result.error["message"], result.error


PEAK = (
    """
import ctypes, mmap, os, select, time
CLONE_PARENT, SIGCHLD, SYS_CLONE = 0x00008000, 17, 56  # x86_64

def wait_for(fd, count, wait_s):
    got, deadline = b"", time.monotonic() + wait_s
    while len(got) < count and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        got += os.read(fd, count)
    return len(got)

"""
    + POPULATED
    + """
def peak(children, hold_mib, burst_mib, wait_s):
    # Children of the worker's parent, each under the per-process limit, that hold memory under
    # the slot's limit together, then each take a burst at once that passes it, and give it back:
    # over the limit for the few milliseconds of the bursts' last pages, between two samples. Each
    # keeps its burst until all are through (``release``): on a loaded host the bursts would
    # otherwise come one after another, never over the limit together.
    libc = ctypes.CDLL(None, use_errno=True)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    release_r, release_w = os.pipe()
    for _ in range(children):
        if libc.syscall(SYS_CLONE, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0) == 0:
            held = populated(hold_mib)  # no malloc in a raw clone's child (POPULATED)
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            burst = populated(burst_mib)  # unmapped at once: a few milliseconds
            os.write(done_w, b"1")
            os.read(release_r, 1)
            burst.close()
            time.sleep(wait_s)
            os._exit(0)
    if wait_for(ready_r, children, wait_s) < children:
        return "not ready"
    os.write(go_w, b"x" * children)
    through = wait_for(done_r, children, wait_s)  # how many bursts were through
    os.write(release_w, b"x" * children)
    return through
"""
)


def run_peak(url: str) -> ProgramResult:
    """PEAK's result, tried again while the attack never came: its CLONE_PARENT children were not
    ready within 5 s, or the worker crashed on a signal that is not the limit's kill (SIGSEGV, once
    in CI). Both seen only on the loaded 2-core CI machine, never in 60 runs here beside two busy
    cores. A raw clone of the worker, which has zmq's threads, copies no lock or thread state into
    the child: the program's own fragility, not the limit's. A COMPLETED count of bursts is a miss,
    and is returned at once; three inconclusive tries in a row fail the caller's assertion too."""
    for _ in range(PEAK_TRIES):
        result = execute(url, program_of(PEAK, "peak", 3, 300, 60, 5.0))
        if not _peak_inconclusive(result):
            return result
    return result


def _peak_inconclusive(result: ProgramResult) -> bool:
    if result.error is None:
        return result.results.get("out") == "not ready"
    message = str(result.error.get("message", ""))
    return "killed by signal" in message and "--memory-limit" not in message


def memory_cgroups_of(broker: RunningBroker) -> Path | None:
    """The broker's memory cgroup directory, where it has one (HEALTH's ``memory_accounting``)."""
    accounting = broker.health()["memory_accounting"]
    return Path(accounting["cgroup"]) if accounting["kind"] == "cgroup-v1" else None


def test_memory_in_bursts_between_samples_is_caught(broker: RunningBroker) -> None:
    """Three CLONE_PARENT children hold 300 MiB each, then take 60 MiB each at once (1.05 GiB
    against 1 GiB) and give it back within milliseconds, between two of the watchdog's 50 ms
    samples: COMPLETED most times before each worker had a memory cgroup."""
    if memory_cgroups_of(broker) is None:
        pytest.xfail(f"no memory cgroup here ({broker.health()['memory_accounting']}): the watchdog's samples alone")
    result = run_peak(broker.url)
    assert not result.completed, result.results
    assert result.error is not None and "--memory-limit" in result.error["message"], result.error


HONEST_MEMORY = """
import os
def honest(mib, file_mib):
    # Memory under the limit and a file larger than the limit is left (page cache, reclaimed).
    block = b"\\1" * (mib << 20)
    with open("big.bin", "wb") as f:
        for _ in range(file_mib):
            f.write(b"\\1" * (1 << 20))
    os.remove("big.bin")
    return len(block)
"""


@pytest.mark.parametrize("sandbox", ["none", BUBBLEWRAP])
def test_memory_cgroups_leave_honest_programs_and_nothing_behind(
    sandbox: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A program that holds 600 MiB and writes 700 MiB of file completes: the file's page cache is
    charged to its cgroup too (1.3 GiB against the 1 GiB limit), and reclaimed. Each slot holds the
    cgroups of its current and spare workers alone; a program cannot reach them; the broker's stop
    removes them all."""
    skip_where_the_preload_leaves_less_than_on_a_cpu_build("an honest program of 600 MiB under 1 GiB")
    running = start_broker(tmp_path_factory.mktemp(f"cgroups-{sandbox}"), "--sandbox", sandbox, *FLAGS)
    try:
        base = memory_cgroups_of(running)
        if base is None:
            pytest.skip(f"no memory cgroup here: {running.health()['memory_accounting']}")
        result = execute(running.url, program_of(HONEST_MEMORY, "honest", 600, 700))
        assert result.completed, result.error
        for _ in range(3):
            over = run_peak(running.url)
            assert over.error is not None and "--memory-limit" in over.error["message"], over.results
        slots = sorted(p for p in base.iterdir() if p.is_dir())
        assert [p.name for p in slots] == ["slot-0", "slot-1"]
        for slot in slots:
            workers = [p.name for p in slot.iterdir() if p.is_dir()]
            assert len(workers) <= 4, workers  # the current worker's, the spare's, at most 2 free
        if sandbox == "bubblewrap":
            reach = execute(running.url, program_of(REACH_CGROUP, "reach"))
            assert reach.completed, reach.error
            found = reach.results["out"]
            assert found["sys"] is False and found["own_fds"] == [] and found["zygote_fds"] != "listed", found
    finally:
        assert running.stop() == 0, running.log()
    assert not base.exists(), list(base.rglob("*"))[:5]


def test_memory_cgroups_of_a_killed_broker_go_with_the_next_one(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A broker killed with SIGKILL runs no stop: the next broker started below the same cgroup
    removes its directory, once no process of its workers is left in it."""
    work = tmp_path_factory.mktemp("cgroups-killed")
    killed = start_broker(work, "--sandbox", "none", *FLAGS)
    base = memory_cgroups_of(killed)
    if base is None:
        killed.stop()
        pytest.skip(f"no memory cgroup here: {killed.health()['memory_accounting']}")
    assert killed.stop(signal.SIGKILL) != 0
    deadline = time.monotonic() + 10.0
    while any((d / "cgroup.procs").read_text() for d in [base, *base.rglob("*")] if d.is_dir()):
        assert time.monotonic() < deadline, "the killed broker's workers are still alive"
        time.sleep(0.1)
    assert base.exists()
    after = start_broker(work, "--sandbox", "none", *FLAGS)
    try:
        assert not base.exists(), list(base.rglob("*"))[:5]
    finally:
        assert after.stop() == 0, after.log()


REACH_CGROUP = """
import os
def reach():
    try:
        os.listdir(f"/proc/{os.getppid()}/fd")
        zygote = "listed"
    except OSError as exc:
        zygote = type(exc).__name__
    own = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            own.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return {"sys": os.path.exists("/sys/fs/cgroup"), "zygote_fds": zygote,
            "own_fds": [link for link in own if "cgroup" in link]}
"""


LISTEN = """
import os, socket, time
def listen(name, hold_s):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\\0" + name)
    server.listen(1)
    time.sleep(hold_s)
    return "listened"
"""

CONNECT = """
import socket, time
def connect(name, tries):
    for _ in range(tries):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect("\\0" + name)
            return "reached"
        except OSError:
            time.sleep(0.1)
        finally:
            client.close()
    return "unreachable"
"""


def test_an_abstract_unix_socket_does_not_reach_another_slots_program(broker: RunningBroker) -> None:
    if sandbox_of(broker) != "bubblewrap":
        pytest.skip("without a sandbox the slots share the host's network namespace")
    name = f"kcoral-{uuid.uuid4().hex}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        listening = pool.submit(execute, broker.url, program_of(LISTEN, "listen", name, 4.0))
        reaching = pool.submit(execute, broker.url, program_of(CONNECT, "connect", name, 30))
        reached, listened = reaching.result(), listening.result()
    assert listened.completed, listened.error
    assert reached.completed, reached.error
    assert reached.results["out"] == "unreachable"


MQUEUE = """
import ctypes, os
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int

def leave(name):
    fd = rt.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    if fd < 0:
        return "mq_open: " + os.strerror(ctypes.get_errno())
    rt.mq_send(fd, b"left behind", 11, 0)
    return "left"

def find(name):
    fd = rt.mq_open(name.encode(), os.O_RDWR)
    return "found" if fd >= 0 else os.strerror(ctypes.get_errno())
"""


def test_a_posix_message_queue_does_not_survive_to_the_next_program(broker: RunningBroker) -> None:
    if sandbox_of(broker) != "bubblewrap":
        pytest.skip("without a sandbox the queues live in the host's (or the slot's) IPC namespace")
    name = f"/kcoral-{uuid.uuid4().hex[:16]}"
    left = execute(broker.url, program_of(MQUEUE, "leave", name))
    assert left.completed and left.results["out"] == "left", (left.error, left.results)
    for _ in range(4):  # the next programs, in both slots
        found = execute(broker.url, program_of(MQUEUE, "find", name))
        assert found.completed, found.error
        assert found.results["out"] != "found"
