"""The slot's forker (kcoral.worker.forker): workers cloned as the zygote's own children, and a
zygote that forks them itself once its forker is gone or stopped."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from pathlib import Path

import psutil
import pytest

from kcoral.worker.forker import FORKER_ANSWER_SECONDS, ParentClone
from tests.helpers import (
    RunningBroker,
    run_function,
    skip_where_the_preload_leaves_less_than_on_a_cpu_build,
    start_broker,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ParentClone.of_this_process() is None,
    reason=f"no forker here ({sys.platform}, {platform.machine()})",
)

# What a worker can see of its parent and the parent's other children, and of its own thread.
LOOK_AROUND = """
import ctypes, os, random, threading

def children_of(pid):
    names = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            for child in listed.read().split():
                try:
                    with open(f"/proc/{child}/comm") as comm:
                        names[int(child)] = comm.read().strip()
                except OSError:
                    pass
    return names

def forker_of(pid):
    forkers = [child for child, name in children_of(pid).items() if name == "kcoral-forker" and child != os.getpid()]
    return forkers[0] if forkers else None

def look():
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.c_void_p()
    libc.prctl(40, ctypes.byref(address), 0, 0, 0)  # PR_GET_TID_ADDRESS
    head, length = ctypes.c_void_p(), ctypes.c_size_t()
    robust = libc.syscall(274 if os.uname().machine == "x86_64" else 100, 0, ctypes.byref(head), ctypes.byref(length))
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    parent = os.getppid()
    with open(f"/proc/{parent}/comm") as comm:
        parent_name = comm.read().strip()
    forker = forker_of(parent)
    readable = None
    if forker is not None:
        try:
            open(f"/proc/{forker}/mem", "rb").close()
            readable = True
        except OSError:
            readable = False
    return {
        "parent": parent_name,
        "forker": forker,
        "forker_memory_readable": readable,
        "thread_id_recorded": ctypes.c_int.from_address(address.value).value == threading.get_native_id(),
        "robust_list": robust == 0 and bool(head.value) and length.value > 0,
        "random": random.random(),
    }

def signal_forker(name):
    import signal
    forker = forker_of(os.getppid())
    if forker is not None:
        os.kill(forker, getattr(signal, name))
    return forker
"""


def forker_of(broker: RunningBroker) -> int | None:
    """The pid of the broker's (one) zygote's forker, once it has one: after the zygote's
    HUGE_PAGES_AFTER_FORKS-th fork and its collapse, which the programs here bring about."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = run_function(broker.url, "def f():\n    return 1\n", "f")
        assert result.completed, result.error
        for process in psutil.Process(broker.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.name() == "kcoral-forker" and psutil.Process(process.ppid()).name() == "kcoral-zygote":
                    if process.create_time() < time.time() - 0.5:  # not a worker a moment after its clone
                        return process.pid
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_a_worker_is_cloned_by_the_forker_as_the_zygotes_own_child(tmp_path: Path, sandbox: str) -> None:
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu", "--sandbox", sandbox)
    try:
        assert forker_of(broker) is not None
        seen = []
        for _ in range(3):
            result = run_function(broker.url, LOOK_AROUND, "look")
            assert result.completed, result.error
            seen.append(result.results["out"])
    finally:
        broker.stop()
    for look in seen:
        assert look["parent"] == "kcoral-zygote"
        assert look["forker"] is not None  # the zygote's other child, the one that cloned this one
        if sandbox == "bubblewrap" or os.geteuid() != 0:  # root reads any process's memory
            assert look["forker_memory_readable"] is False  # as the zygote's: not dumpable
        # Made as glibc's fork makes a child: its thread id in its thread descriptor, its robust
        # futex list registered; and as os.fork does: Python's generator reseeded.
        assert look["thread_id_recorded"] is True
        assert look["robust_list"] is True
    assert len({look["forker"] for look in seen}) == 1
    assert len({look["random"] for look in seen}) == 3


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_zygote_forks_itself_once_its_forker_is_killed_or_stopped(tmp_path: Path, how: str) -> None:
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu")
    try:
        forker = forker_of(broker)
        assert forker is not None
        result = run_function(broker.url, LOOK_AROUND, "signal_forker", how, timeout_seconds=60)
        assert result.completed, result.error
        assert result.results["out"] == forker
        # The spare forked beside that program came from the forker already; the next one is the
        # zygote's own (after FORKER_ANSWER_SECONDS where the forker was stopped), and a new
        # forker follows the zygote's next collapse.
        started = time.monotonic()
        looks = []
        for _ in range(4):
            result = run_function(broker.url, LOOK_AROUND, "look", timeout_seconds=60)
            assert result.completed, result.error
            looks.append(result.results["out"])
        assert time.monotonic() - started < FORKER_ANSWER_SECONDS + 30
        assert not psutil.pid_exists(forker) or psutil.Process(forker).status() == psutil.STATUS_ZOMBIE
    finally:
        broker.stop()
    assert all(look["parent"] == "kcoral-zygote" for look in looks)
    assert all(look["forker"] != forker for look in looks[1:])
    assert all(look["thread_id_recorded"] for look in looks)


LEAVE_AND_HOLD = """
import os, subprocess, sys, time

def leave():
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return daemon.pid

def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"

def hold(mib, seconds):
    data = b"x" * (mib << 20)
    time.sleep(seconds)
    return len(data)
"""


def test_with_the_forker_serving_what_a_program_leaves_is_killed_and_its_memory_bounded(tmp_path: Path) -> None:
    """The forker is the one process below the zygote besides the spare that is not the program's:
    a program's leftovers are still killed and its memory still counted, and the forker stays."""
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu", "--memory-limit", "1g")
    try:
        forker = forker_of(broker)
        assert forker is not None
        left = run_function(broker.url, LEAVE_AND_HOLD, "leave")
        assert left.completed, left.error
        after = run_function(broker.url, LEAVE_AND_HOLD, "alive", left.results["out"])
        assert after.completed, after.error
        assert after.results["out"] is False  # killed with the worker that started it
        over = run_function(broker.url, LEAVE_AND_HOLD, "hold", 1536, 4.0)
        assert not over.completed, "1.5 GiB held for 4 s under a 1 GiB limit"
        assert over.error is not None and "--memory-limit" in over.error["message"], over.error
        fine = run_function(broker.url, LEAVE_AND_HOLD, "hold", 64, 0.5)
        assert fine.completed, fine.error
        assert psutil.pid_exists(forker) and psutil.Process(forker).name() == "kcoral-forker"
    finally:
        broker.stop()


FORK_AND_WAIT = """
import os, time

def fork_and_wait(count, seconds):
    for _ in range(count):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    time.sleep(seconds)
    return count
"""


def test_a_program_that_stops_the_forker_is_still_watched_while_the_zygote_waits_for_it(tmp_path: Path) -> None:
    """A stopped forker keeps the zygote waiting for its answer about the next spare, up to
    FORKER_ANSWER_SECONDS, while the program that came before that fork runs: the watchdog samples
    it all the same, and it does not get that long over its limits."""
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu", "--max-processes", "8")
    try:
        forker = forker_of(broker)
        assert forker is not None
        stopped = run_function(broker.url, LOOK_AROUND, "signal_forker", "SIGSTOP", timeout_seconds=60)
        assert stopped.completed, stopped.error
        assert stopped.results["out"] == forker
        # Its successor is announced, and the zygote asks the stopped forker for the spare beside it.
        over = run_function(broker.url, FORK_AND_WAIT, "fork_and_wait", 16, FORKER_ANSWER_SECONDS * 0.7)
        after = run_function(broker.url, FORK_AND_WAIT, "fork_and_wait", 2, 0.0)
    finally:
        broker.stop()
    assert not over.completed, "17 processes for most of the wait, under a limit of 8"
    assert over.error is not None and "--max-processes" in over.error["message"], over.error
    assert after.completed, after.error


SPREAD_MEMORY = """
import os, time

def spread(children, mib, seconds):
    filled, told = os.pipe()
    for _ in range(children):
        if os.fork() == 0:
            held = bytearray(mib << 20)
            held[:: 4096] = b"x" * len(held[:: 4096])
            os.write(told, b".")
            time.sleep(30)
            os._exit(0)
    for _ in range(children):
        os.read(filled, 1)  # the memory is held from here on
    time.sleep(seconds)
    return children * mib
"""


def test_a_program_that_stops_the_forker_is_still_held_to_its_memory_while_the_zygote_waits(tmp_path: Path) -> None:
    """The same wait, another limit: three processes of 450 MiB each, every one under its own
    RLIMIT_DATA, 1.3 GiB together under --memory-limit 1g with no memory cgroup, so that only the
    watchdog's sum over the tree can see them, held for 0.3 s of the wait once filled."""
    skip_where_the_preload_leaves_less_than_on_a_cpu_build("processes of 450 MiB each, each under RLIMIT_DATA 1 GiB")
    broker = start_broker(
        tmp_path, "--workers", "1", "--device", "cpu", "--memory-limit", "1g", "--memory-cgroup", "off"
    )
    try:
        forker = forker_of(broker)
        assert forker is not None
        stopped = run_function(broker.url, LOOK_AROUND, "signal_forker", "SIGSTOP", timeout_seconds=60)
        assert stopped.completed, stopped.error
        over = run_function(broker.url, SPREAD_MEMORY, "spread", 3, 450, FORKER_ANSWER_SECONDS * 0.3)
        after = run_function(broker.url, FORK_AND_WAIT, "fork_and_wait", 2, 0.0)
    finally:
        broker.stop()
    assert not over.completed, "1.3 GiB held for 0.3 s of the wait, under a limit of 1 GiB"
    assert over.error is not None and "--memory-limit" in over.error["message"], over.error
    assert after.completed, after.error
