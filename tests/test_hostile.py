"""What a hostile program could still do to its own result or to the next one (issue 26), through a
real broker under both sandboxes: flood the worker's socket with PROGRESS from threads that outlive
its function, spread its memory over CLONE_PARENT children, hand a descriptor to another slot's
program over an abstract Unix socket, and leave a POSIX message queue for the next program.
"""

from __future__ import annotations

import concurrent.futures
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral import Client, Program, ProgramResult
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from tests.conftest import RunningBroker, start_broker
from tests.hostile_programs import FLOOD, SPREAD

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


def test_a_progress_flood_from_the_programs_own_thread_loses_no_result(broker: RunningBroker) -> None:
    programs = []
    for _ in range(8):
        program = Program()  # the run is the last instruction: after it the worker sends only its RESULT
        module = program.upload(kind="module", source=FLOOD)
        program.run(fn=program.get_function(module=module, name="flood", cpu_only=True), args=[0.3])
        programs.append(program)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: execute(broker.url, p), programs))
    for result in results:
        assert result.completed, result.error
    assert execute(broker.url, program_of("def f():\n    return 1\n", "f")).results["out"] == 1


def test_memory_spread_over_clone_parent_children_does_not_complete(broker: RunningBroker) -> None:
    """Three CLONE_PARENT children of 600 MiB each for 3 s: 1.8 GiB against the 1 GiB limit (at
    3 x 450 MiB the watchdog's proportional count came to 0.92 to 1.05 GiB: a coin toss)."""
    result = execute(broker.url, program_of(SPREAD, "spread", 3, 600, 3.0))
    assert not result.completed, f"{result.results['out']} children held 600 MiB for 3 s"
    assert result.error is not None and "--memory-limit" in result.error["message"], result.error


BRIEF = """
import ctypes, os, time
CLONE_PARENT, SIGCHLD, SYS_CLONE = 0x00008000, 17, 56  # x86_64

def brief(children, mib, bursts):
    # Short bursts over the limit, each shorter than the watchdog's sampling interval.
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    for _ in range(children):
        if libc.syscall(SYS_CLONE, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0) == 0:
            os.close(w)
            for _ in range(bursts):
                os.read(r, 1)
                block = b"\\x01" * (mib << 20)
                del block
            os._exit(0)
    os.close(r)
    for _ in range(bursts):
        os.write(w, b"x" * children)
        time.sleep(0.2)
    return "brief"
"""


# Not strict: whether a sample lands inside a burst is chance (on a quiet 2-core VM it sometimes
# does, and the program is killed), so the open hole shows as an xfail or, now and then, an xpass.
@pytest.mark.xfail(
    strict=False,
    reason="open: the watchdog samples every 50 ms, and no kernel peak of the whole tree (a memory "
    "cgroup per program) is read; bursts shorter than a sample may end COMPLETED",
)
def test_memory_in_bursts_between_samples_is_caught_or_marked(broker: RunningBroker) -> None:
    result = execute(broker.url, program_of(BRIEF, "brief", 3, 450, 5))
    assert not result.completed, result.results
    assert result.error is not None and "--memory-limit" in result.error["message"], result.error


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
