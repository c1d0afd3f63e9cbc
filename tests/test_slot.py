"""The trusted side of a slot: each attack of issue 14 through a real broker, under both sandboxes.

Every test runs a hostile program (numbered as in the issue) and checks two things: the hostile
program ends in a clear FAILED or error, and the next programs are untouched (their workspace holds
only their own files, they get the fake GPU's lease without waiting for the attacker, and they run
as fast as usual). The broker has one fake GPU and two slots, so two programs can share the GPU's
lease and run side by side, as in the campaign that found these holes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from kcoral import Client, KCoralError, Program, ProgramResult
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from tests.helpers import RunningBroker, skip_where_the_preload_leaves_less_than_on_a_cpu_build, start_broker

try:
    check_bwrap()
    BWRAP_ERROR = ""
except SandboxUnavailable as exc:
    BWRAP_ERROR = str(exc)

SANDBOXES = [
    "none",
    pytest.param(
        "bubblewrap", marks=[pytest.mark.bubblewrap, pytest.mark.skipif(bool(BWRAP_ERROR), reason=BWRAP_ERROR)]
    ),
]
MEMORY_LIMIT = "1g"
MAX_PROCESSES = 64
WORKSPACE_QUOTA = 96 << 20
FLAGS = (
    "--fake-gpus", "1", "--workers-per-gpu", "2",
    "--memory-limit", MEMORY_LIMIT, "--max-processes", str(MAX_PROCESSES), "--max-file-bytes", "256m",
    "--max-workspace-bytes", str(WORKSPACE_QUOTA), "--cache-bytes", "1m",
)  # fmt: skip
PROGRAM_TIMEOUT_S = 30.0
VICTIM_HOLD_S = 0.05
# A victim waits for the other victim's lease (it holds the GPU VICTIM_HOLD_S, then its worker
# exits), never for an attacker's; on a loaded 2-core VM an exit can take a few hundred ms.
VICTIM_MAX_LEASE_WAIT_MS = 1500.0
GONE_WITHIN_S = 10.0


@dataclass
class Service:
    broker: RunningBroker
    sandbox: str

    @property
    def url(self) -> str:
        return self.broker.url


@pytest.fixture(scope="module", params=SANDBOXES)
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The broker the attacks run on, one per sandbox; each test leaves it serving."""
    root = tmp_path_factory.mktemp(f"slot-{request.param}")
    running = start_broker(root, "--sandbox", request.param, "--cache-dir", str(root / "cache"), *FLAGS)
    yield Service(running, request.param)
    assert running.stop() == 0, running.log()


@pytest.fixture(scope="module")
def single(service: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker of one slot beside the service, in its sandbox: the next program must wait for the
    one before it. Each test leaves it serving."""
    running = start_broker(
        tmp_path_factory.mktemp(f"single-{service.sandbox}"), "--sandbox", service.sandbox, "--fake-gpus", "1"
    )
    yield running
    assert running.stop() == 0, running.log()


def program_of(
    source: str, name: str, *args: Any, cpu_only: bool = False, files: dict[str, bytes] | None = None
) -> Program:
    program = Program()
    for path, data in (files or {}).items():
        program.upload_file(blob=data, path=path)
    module = program.upload(kind="module", source=textwrap.dedent(source))
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    program.return_(key="out", value=program.run(fn=fn, args=list(args)))
    return program


def execute(url: str, program: Program, **options: Any) -> ProgramResult:
    options.setdefault("timeout_seconds", PROGRAM_TIMEOUT_S)
    with Client(url) as client:
        return client.execute(program, **options)


VICTIM = """
import os, time
def victim(hold_s):
    work = os.getcwd()
    root = os.path.dirname(os.path.dirname(work))  # the slot's workspace
    secret = open("secret.txt").read()
    time.sleep(hold_s)
    shm = os.path.join(root, ".shm")  # inside bubblewrap: the mount point of /dev/shm, kept
    return {"workspace": sorted(os.listdir(root)), "run_dir": os.path.basename(os.path.dirname(work)),
            "shm": sorted(os.listdir(shm)) if os.path.isdir(shm) else [],
            "work": sorted(os.listdir(work)), "secret": secret}
"""


def assert_next_programs_untouched(url: str) -> None:
    """Two programs at once (one per slot), each on the fake GPU: only their own files, their
    own secret, a lease wait bounded by the other victim's, and their GPU time their own."""
    secrets = [uuid.uuid4().hex for _ in range(2)]
    programs = [program_of(VICTIM, "victim", VICTIM_HOLD_S, files={"secret.txt": s.encode()}) for s in secrets]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: execute(url, p), programs))
    for secret, result in zip(secrets, results):
        assert result.completed, result.error
        out = result.results["out"]
        assert out["secret"] == secret
        seen = [entry for entry in out["workspace"] if entry != ".shm"]
        assert seen == [out["run_dir"]] and out["shm"] == [], f"the workspace holds more than this program's run: {out}"
        assert out["work"] == ["secret.txt"]
        assert result.lease_wait_ms < VICTIM_MAX_LEASE_WAIT_MS, result.lease_wait_ms
        assert result.lease_held_ms < VICTIM_HOLD_S * 1000 + 1000, result.lease_held_ms


def zygote_restarts(url: str) -> list[int]:
    with Client(url) as client:
        zygotes = client.health()["workers"]["zygotes"]
    assert all(z["state"] == "running" for z in zygotes), zygotes
    return [z["restarts"] for z in zygotes]


def assert_failed(result: ProgramResult, kind: str, *words: str) -> None:
    assert result.status == "FAILED", result.results
    assert result.error is not None and result.error["kind"] == kind, result.error
    for word in words:
        assert word in result.error["message"], result.error["message"][:2000]


def assert_over_memory_limit(result: ProgramResult) -> None:
    # Whichever sees it first: the zygote's watchdog counting the memory in use, or the kernel's
    # count of the worker's memory cgroup, where the slot has one.
    assert_failed(result, "runtime", "--memory-limit")
    message = result.error["message"] if result.error else ""
    assert "memory in use" in message or "memory cgroup" in message, message[:2000]


# --- 1. Cross-client overlap -----------------------------------------------------------------------

ANY_FD_WRITER = """
import json, os, time
def poke_then_spy(spy_s):
    poked = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            os.set_blocking(fd, False)
            poked[name] = os.write(fd, b"\\x01" + json.dumps({"event": "forked", "worker": "x"}).encode() + b"\\n")
        except OSError as exc:
            poked[name] = type(exc).__name__
    seen = set()
    root = os.path.dirname(os.path.dirname(os.getcwd()))
    deadline = time.monotonic() + spy_s
    while time.monotonic() < deadline:
        for base, _dirs, files in os.walk(root):
            seen.update(os.path.join(base, f) for f in files if f == "secret.txt")
        time.sleep(0.02)
    return {"seen": sorted(seen), "started": time.time(), "ended": time.time()}
"""


def test_1_a_program_keeps_its_slot_until_it_and_all_it_started_have_exited(single: RunningBroker) -> None:
    # One slot: the next program must wait for this one, however it pokes the descriptors it has
    # (a byte in the zygote's "done" pipe once let the next program in beside it).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        spy = pool.submit(execute, single.url, program_of(ANY_FD_WRITER, "poke_then_spy", 3.0), timeout_seconds=1.5)
        time.sleep(0.5)
        victim = pool.submit(execute, single.url, program_of(VICTIM, "victim", 0.0, files={"secret.txt": b"s3cret"}))
        with pytest.raises(KCoralError) as refused:
            spy.result()
        assert refused.value.kind == "timeout"  # killed at its timeout, still spying
        after = victim.result()
    assert after.completed, after.error
    assert after.results["out"]["secret"] == "s3cret"
    assert [e for e in after.results["out"]["workspace"] if e != ".shm"] == [after.results["out"]["run_dir"]]
    # It started only once the spy had gone: it waited in the queue for the one slot.
    assert after.queue_ms > 700, after.queue_ms


TAMPERER = """
import ctypes, os, signal, time
SYS_CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
CLONE_PARENT = 0x8000
def tamper_with_the_next_worker(seconds):
    me = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(SYS_CLONE, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0) != 0:
        return "left a process beside the next worker"
    # The zygote's child now, it outlives this worker until the zygote kills it.
    zygote = os.getppid()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (me, os.getpid()):
                continue
            try:
                with open(f"/proc/{name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != zygote:  # only this slot's workers: the zygote's children
                    continue
                pid = int(name)
                os.setpriority(os.PRIO_PROCESS, pid, 19)
                os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        time.sleep(0.001)
    os._exit(0)
"""

SCHEDULING = """
import os
def scheduling():
    return os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0))
"""


def test_1_the_next_worker_is_untouched_by_what_the_previous_program_left(single: RunningBroker) -> None:
    # The next worker is forked while the previous one exits; a process the previous program left
    # beside it (a child of the zygote, made with CLONE_PARENT) renices, pins and stops it.
    discarded_before = single.log().count("spare_worker_discarded")
    left = execute(single.url, program_of(TAMPERER, "tamper_with_the_next_worker", 2.0, cpu_only=True))
    assert left.completed, left.error
    after = execute(single.url, program_of(SCHEDULING, "scheduling"), timeout_seconds=10)
    assert after.completed, after.error
    priority, cpus = after.results["out"]
    assert priority == os.getpriority(os.PRIO_PROCESS, 0)
    assert cpus == sorted(os.sched_getaffinity(0))
    # When the tamperer was in time:
    print("spare discarded:", single.log().count("spare_worker_discarded") > discarded_before)


CLOSER = """
import os
def close_every_descriptor():
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the worker's own socket among them
    return "closed"
"""


def test_1_a_program_that_closes_every_descriptor_it_has_fails_alone(service: Service) -> None:
    # Its worker loses its socket to the broker: the worker, not the slot, dies of it. Or its RESULT
    # still gets out, on a connection made after the program returned (the RESULT's own context
    # opens its descriptors only then), if the worker is not aborted first: either is a true answer.
    result = execute(service.url, program_of(CLOSER, "close_every_descriptor", cpu_only=True), timeout_seconds=10)
    if result.status == "COMPLETED":
        assert result.results == {"out": "closed"}, result.results
    else:
        assert_failed(result, "runtime", "worker exited")
    assert_next_programs_untouched(service.url)


LOG_WRITER = """
import os
def write_everywhere(marker):
    wrote = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if int(name) > 2 and not target.startswith(("socket:", "anon_inode:")):
                os.set_blocking(int(name), False)
                os.write(int(name), ('{"event": "request_finished", "forged": "%s"}\\n' % marker).encode())
                wrote.append(target)
        except OSError:
            pass
    return wrote
"""


def test_1_a_program_cannot_write_the_brokers_log(service: Service) -> None:
    # The worker's own stdout and stderr lead to the broker's log; none of it is within the
    # program's reach, to forge the broker's lines or fill its disk.
    marker = uuid.uuid4().hex
    result = execute(service.url, program_of(LOG_WRITER, "write_everywhere", marker, cpu_only=True))
    assert result.completed, result.error
    assert marker not in service.broker.log(), result.results["out"]
    assert_next_programs_untouched(service.url)


SYSTEM_V = """
import ctypes, os, time
IPC_CREAT, IPC_PRIVATE = 0o1000, 0
def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.shmat.restype = ctypes.c_void_p
    lib.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.shmdt.argtypes = [ctypes.c_void_p]
    return lib
def leave(key, segments, each, hold_s):
    lib = libc()
    for index in range(segments):
        ident = lib.shmget(key + index, each, IPC_CREAT | 0o666)
        address = lib.shmat(ident, None, 0)
        ctypes.memset(address, 1, each)  # resident, and attached by no process once detached
        ctypes.memmove(address, b"the first program's secret", 26)
        lib.shmdt(address)
    lib.semget(key, 1, IPC_CREAT | 0o666)
    lib.msgget(key, IPC_CREAT | 0o666)
    time.sleep(hold_s)
    return segments
def find(key):
    lib = libc()
    ident = lib.shmget(key, 0, 0)
    found = ctypes.string_at(lib.shmat(ident, None, 0), 26) if ident >= 0 else None
    tables = {t: len(open(f"/proc/sysvipc/{t}").read().splitlines()) - 1 for t in ("shm", "sem", "msg")}
    return {"found": found, "tables": tables}
"""


def private_ipc_or_skip(service: Service) -> None:
    if service.sandbox == "none" and os.geteuid() != 0:
        pytest.skip("without a sandbox, and not root, the slots share the host's IPC namespace")


def test_1_system_v_objects_a_program_leaves_are_gone_before_the_next(service: Service) -> None:
    # Segments, semaphores and queues outlive every process: the next program in the slot could
    # attach to the first one's (its IPC namespace is the slot's, or the host's without a sandbox).
    private_ipc_or_skip(service)
    key = 0x4B43000 + uuid.uuid4().int % 0x1000
    left = execute(service.url, program_of(SYSTEM_V, "leave", key, 1, 1 << 20, 0.0, cpu_only=True))
    assert left.completed, left.error
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one per slot: the first one's among them
        spies = list(pool.map(lambda _: execute(service.url, program_of(SYSTEM_V, "find", key)), range(2)))
    for spy in spies:
        assert spy.completed, spy.error
        assert spy.results["out"] == {"found": None, "tables": {"shm": 0, "sem": 0, "msg": 0}}
    assert_next_programs_untouched(service.url)


def test_4_shared_memory_segments_no_process_attached_count_against_the_limit(service: Service) -> None:
    private_ipc_or_skip(service)
    key = 0x4B44000 + uuid.uuid4().int % 0x1000
    result = execute(service.url, program_of(SYSTEM_V, "leave", key, 3, 400 << 20, 10.0, cpu_only=True))
    assert_over_memory_limit(result)
    spy = execute(service.url, program_of(SYSTEM_V, "find", key, cpu_only=True))
    assert spy.completed and spy.results["out"]["found"] is None, spy.results
    assert_next_programs_untouched(service.url)


KEYRINGS = """
import ctypes, os
SYS_ADD_KEY, SYS_KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
KEYRINGS = {"session": -3, "user": -4, "user-session": -5}
KEYCTL_SEARCH, KEYCTL_READ = 10, 11
def syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall
def leave(description, secret):
    call = syscall()
    return {name: call(SYS_ADD_KEY, b"user", f"{description}-{name}".encode(), secret.encode(), len(secret),
                       ctypes.c_long(ring)) > 0 for name, ring in KEYRINGS.items()}
def find(description):
    call = syscall()
    found = {}
    for name, ring in KEYRINGS.items():
        key = call(SYS_KEYCTL, KEYCTL_SEARCH, ctypes.c_long(ring), b"user", f"{description}-{name}".encode(), 0)
        if key > 0:
            data = ctypes.create_string_buffer(64)
            found[name] = data.raw[: call(SYS_KEYCTL, KEYCTL_READ, ctypes.c_long(key), data, 64)]
    return found
"""


def test_1_keys_a_program_leaves_in_its_keyrings_are_gone_before_the_next(service: Service) -> None:
    if service.sandbox == "none":
        pytest.skip("without a sandbox programs share the host user's keyrings, other programs' keys among them")
    description = f"kcoral-{uuid.uuid4().hex[:8]}"
    left = execute(service.url, program_of(KEYRINGS, "leave", description, "the first program's secret", cpu_only=True))
    assert left.completed and all(left.results["out"].values()), (left.error, left.results)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one per slot: the first one's among them
        spies = list(pool.map(lambda _: execute(service.url, program_of(KEYRINGS, "find", description)), range(2)))
    for spy in spies:
        assert spy.completed, spy.error
        assert spy.results["out"] == {}, spy.results["out"]
    assert_next_programs_untouched(service.url)


# --- 2. Zygote blinding ------------------------------------------------------------------------------

BLINDER = """
import ctypes, os, time
EPOLL_CTL_ADD, EPOLLIN = 1, 1
class Event(ctypes.Structure):
    _pack_ = 1 if os.uname().machine == "x86_64" else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]
def blind_then_fork(count):
    libc = ctypes.CDLL(None, use_errno=True)
    always = os.eventfd(1)  # always readable
    tagged = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if "eventpoll" in target and int(name) != always:
            event = Event(EPOLLIN, 0)  # tagged as fd 0: the zygote's command pipe
            if libc.epoll_ctl(int(name), EPOLL_CTL_ADD, always, ctypes.byref(event)) == 0:
                tagged.append(int(name))
    children = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
    time.sleep(20)
    return tagged
"""


def test_2_a_program_cannot_blind_the_zygote_and_the_watchdog_still_kills_it(service: Service) -> None:
    url = service.url
    result = execute(url, program_of(BLINDER, "blind_then_fork", MAX_PROCESSES + 8, cpu_only=True))
    assert_failed(result, "runtime", "--max-processes")
    with Client(url) as client:
        assert all(z["state"] == "running" for z in client.health()["workers"]["zygotes"])
    assert_next_programs_untouched(url)


ZYGOTE_REACHER = """
import ctypes, errno, os
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = {"x86_64": (434, 438), "aarch64": (434, 438)}[os.uname().machine]
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
def reach_the_zygote():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    zygote = os.getppid()
    reached = {}
    pidfd = libc.syscall(SYS_PIDFD_OPEN, zygote, 0)
    if pidfd >= 0:
        for fd in range(16):  # its epoll set, command and event pipes are among these
            if libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0) >= 0:
                reached[f"pidfd_getfd {fd}"] = "ok"
    for name in ("fd", "fdinfo", "map_files"):
        try:
            if os.listdir(f"/proc/{zygote}/{name}"):
                reached[f"/proc {name}"] = "ok"
        except OSError:
            pass
    for name in ("mem", "environ", "maps"):
        try:
            with open(f"/proc/{zygote}/{name}", "rb") as handle:
                if handle.read(1):
                    reached[f"/proc {name}"] = "ok"
        except OSError:
            pass
    if libc.ptrace(PTRACE_ATTACH, zygote, 0, 0) == 0:
        reached["ptrace"] = "ok"
        libc.ptrace(PTRACE_DETACH, zygote, 0, 0)
    return reached
"""


def test_2_a_program_cannot_reach_the_zygotes_descriptors_or_memory(service: Service) -> None:
    # Other ways than an inherited epoll descriptor: take the zygote's descriptors with
    # pidfd_getfd, read them or its memory through /proc, or trace it.
    if service.sandbox == "none" and os.geteuid() == 0:
        pytest.skip("root without a sandbox may trace any process: only bubblewrap walls the zygote off")
    restarts = zygote_restarts(service.url)
    result = execute(service.url, program_of(ZYGOTE_REACHER, "reach_the_zygote", cpu_only=True))
    assert result.completed, result.error
    assert result.results["out"] == {}, result.results["out"]
    assert zygote_restarts(service.url) == restarts
    assert_next_programs_untouched(service.url)


FREEZER = """
import os, signal, time
def freeze_the_zygote(how, hold_s):
    zygote = os.getppid()
    if how == "its group":
        os.killpg(os.getpgid(zygote), signal.SIGSTOP)
    elif how == "all it can signal":
        os.kill(-1, signal.SIGSTOP)  # in the sandbox: every process of its pid namespace but init
    else:
        os.kill(zygote, signal.SIGSTOP)
    time.sleep(hold_s)  # unwatched, were the zygote left stopped
    return "still running"
"""


def wait_until_every_slot_serves(url: str, slots: int = 2) -> None:
    deadline = time.monotonic() + 60
    with Client(url) as client:
        while client.health()["workers"]["idle"] < slots:
            assert time.monotonic() < deadline, "a slot never served again"
            time.sleep(0.1)


@pytest.mark.parametrize("how", ["the zygote", "its group", "all it can signal"])
def test_2_a_program_that_freezes_its_zygote_fails_and_its_slot_is_restarted(service: Service, how: str) -> None:
    # A stopped zygote watches nothing: the supervisor finds it stopped, kills its slot's sandbox and
    # starts a new zygote; the program fails saying so, and holds the GPU no longer than that.
    if how == "all it can signal" and service.sandbox == "none":
        pytest.skip("without a sandbox kill(-1) stops every process of the user, the tests' own among them")
    if how == "its group" and service.sandbox == "bubblewrap":
        pytest.skip("the zygote leads its group under both sandboxes: the same signal as to the zygote")
    start = time.monotonic()
    result = execute(service.url, program_of(FREEZER, "freeze_the_zygote", how, 20.0))
    assert_failed(result, "runtime", "its zygote died", "found stopped")
    assert time.monotonic() - start < 10.0, "the frozen zygote went unnoticed for as long as a silent one"
    wait_until_every_slot_serves(service.url)
    assert_next_programs_untouched(service.url)


SPOOFER = """
import os, signal, time
def say_the_broker_died():
    os.kill(os.getppid(), signal.SIGUSR2)  # the signal the zygote gets when the broker dies
    time.sleep(0.5)
    return "still running"
"""


def test_2_a_program_cannot_make_its_zygote_believe_the_broker_died(service: Service) -> None:
    restarts = zygote_restarts(service.url)
    result = execute(service.url, program_of(SPOOFER, "say_the_broker_died", cpu_only=True))
    assert result.completed and result.results["out"] == "still running", result.error
    assert zygote_restarts(service.url) == restarts
    assert_next_programs_untouched(service.url)


# --- 3. The lease is cooperative -----------------------------------------------------------------

LEASE_THIEF = """
import gc, os, time
import zmq
from kcoral import protocol
def give_back_and_keep_going(hold_s):
    request_id = os.environ["KCORAL_REQUEST_ID"]
    sent = 0
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed:
            obj.send_multipart(protocol.message(protocol.RELEASE, {"request_id": request_id}))
            sent += 1
        if type(obj).__name__ == "LeaseChannel":
            obj.granted_at = None  # its own record, for what that is worth
    time.sleep(hold_s)  # "GPU work" after the release
    return {"released": sent, "ended": time.time()}
"""

GPU_CLOCK = """
import time
def started():
    return time.time()
"""


def test_3_the_lease_goes_back_only_when_its_holder_has_exited(service: Service) -> None:
    hold_s = 1.0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        thief = pool.submit(execute, service.url, program_of(LEASE_THIEF, "give_back_and_keep_going", hold_s))
        time.sleep(0.4)  # the thief holds the lease by now (its run started at once)
        after = pool.submit(execute, service.url, program_of(GPU_CLOCK, "started"))
        stolen, waited = thief.result(), after.result()
    assert stolen.completed and stolen.results["out"]["released"] >= 1, stolen.error
    assert waited.completed, waited.error
    # The second program got the GPU only after the thief's process had ended, not at its RELEASE.
    assert waited.results["out"] >= stolen.results["out"]["ended"]
    assert waited.lease_wait_ms > (hold_s - 0.4) * 1000 * 0.8, waited.lease_wait_ms
    assert_next_programs_untouched(service.url)


EARLY_LEAVER = """
import ctypes, gc, os, time
import zmq
from kcoral import protocol
def leave_early_and_keep_going(how, hold_s, name):
    ctypes.CDLL(None).prctl(15, name.encode())  # PR_SET_NAME: the test finds this process by it
    request_id = os.environ["KCORAL_REQUEST_ID"]
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.type == zmq.DEALER:
            if how == "result first":  # the broker answers the client: the worker is done with
                body = protocol.program_result(request_id, results={"out": "done early"})
                obj.send_multipart([protocol.VERSION, protocol.RESULT, protocol.pack(body)])
            else:  # the broker never hears from this worker again
                obj.close(linger=0)
    time.sleep(hold_s)  # "GPU work" after it
    return "done"
"""


def running_named(name: str) -> list[psutil.Process]:
    processes = psutil.process_iter(["name", "status"])
    return [p for p in processes if p.info["name"] == name and p.info["status"] != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("how", ["result first", "socket closed"])
def test_3_a_program_that_answers_early_or_hangs_up_keeps_the_gpu_no_longer_than_it_runs(
    service: Service, how: str
) -> None:
    # Answered early, the worker is killed at once (its answer was its last word); hung up, it
    # keeps the lease until it exits. Either way the next program gets the GPU only after that.
    hold_s = 3.0
    name = f"kc{uuid.uuid4().hex[:10]}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        began = time.time()
        leaver = pool.submit(
            execute, service.url, program_of(EARLY_LEAVER, "leave_early_and_keep_going", how, hold_s, name)
        )
        time.sleep(0.4)  # it holds the lease by now
        after = pool.submit(execute, service.url, program_of(GPU_CLOCK, "started"))
        if how == "result first":
            left = leaver.result()
            assert left.completed and left.results["out"] == "done early", left.error
            deadline = time.monotonic() + 2.0  # well before it would have slept its hold_s out
            while running_named(name):
                assert time.monotonic() < deadline, "a worker that had answered kept running"
                time.sleep(0.02)
        left, waited = leaver.result(), after.result()
    assert waited.completed, waited.error
    if how == "socket closed":
        # Its RESULT goes on a connection of its own, which says what the program did to the worker.
        assert_failed(left, "runtime", "Socket operation on non-socket")
        assert waited.results["out"] >= began + hold_s, "the GPU went to the next program while the first still ran"
    assert_next_programs_untouched(service.url)


# --- 4. Limits escaped by clone(CLONE_PARENT) ---------------------------------------------------

CLONE_PARENT_SPAWNER = """
import ctypes, os, signal, time
SYS_CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
CLONE_PARENT = 0x8000
def escape(count, token):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    made = 0
    for _ in range(count):
        pid = libc.syscall(SYS_CLONE, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)
        if pid == 0:  # the zygote's child, not ours
            os.execv("/bin/sleep", ["/bin/sleep", token])
        if pid > 0:
            made += 1
    time.sleep(20)
    return made
"""


def test_4_processes_made_with_clone_parent_are_counted_and_killed(service: Service) -> None:
    token = f"{30 + uuid.uuid4().int % 10**6 / 10**7:.7f}"  # a unique sleep time marks them
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        escapee = pool.submit(
            execute, service.url, program_of(CLONE_PARENT_SPAWNER, "escape", MAX_PROCESSES + 16, token, cpu_only=True)
        )
        time.sleep(0.2)
        # The other slot's program runs meanwhile, and is no victim of the kill.
        beside = pool.submit(execute, service.url, program_of(VICTIM, "victim", 1.0, files={"secret.txt": b"x"}))
        result, other = escapee.result(), beside.result()
    assert_failed(result, "runtime", "--max-processes")
    assert other.completed, other.error
    deadline = time.monotonic() + GONE_WITHIN_S
    while left := [p for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, f"processes made with CLONE_PARENT survived: {left}"
        time.sleep(0.05)
    assert_next_programs_untouched(service.url)


CLONE_PARENT_HOGS = """
import ctypes, os, signal, sys, time
SYS_CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
CLONE_PARENT = 0x8000
HOG = "import ctypes, time; ctypes.CDLL(None).prctl(4, {dumpable}); held = b'x' * ({each}); time.sleep(30)  # {token}"
def hog(count, each, token, dumpable):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    for _ in range(count):
        if libc.syscall(SYS_CLONE, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0) == 0:  # the zygote's child
            code = HOG.format(each=each, token=token, dumpable=dumpable)
            os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", code])
    time.sleep(20)
"""


@pytest.mark.parametrize("dumpable", [1, 0], ids=["readable", "not-dumpable"])
def test_4_memory_of_processes_made_with_clone_parent_counts_against_the_limit(service: Service, dumpable: int) -> None:
    # Three processes of 0.6 GiB each, every one under the per-process limit of 1 GiB, and all of
    # them the zygote's children rather than the worker's: together they pass --memory-limit. Not
    # dumpable, their memory maps are closed to the zygote: what they hold counts all the same.
    token = uuid.uuid4().hex
    program = program_of(CLONE_PARENT_HOGS, "hog", 3, 600 << 20, token, dumpable, cpu_only=True)
    result = execute(service.url, program)
    assert_over_memory_limit(result)
    deadline = time.monotonic() + GONE_WITHIN_S
    while left := [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, f"processes made with CLONE_PARENT survived: {left}"
        time.sleep(0.05)
    assert_next_programs_untouched(service.url)


# --- 5. Results lost as "crashes" -----------------------------------------------------------------

BIG_RESULTS = """
import sys
import numpy as np
def big_string():
    return "x" * (80 << 20)
def big_list():
    return [0.5] * 8_000_000
def big_message():
    raise ValueError("y" * (80 << 20))
def many_tensors():
    return [np.zeros(1, dtype=np.float32) for _ in range(100_000)]
def full_stdout():
    sys.stdout.write("z" * (70 << 20))
    sys.stdout.flush()
    return "kept"
def deep_nesting():
    value = []
    for _ in range(100_000):
        value = [value]
    return value
def a_cycle():
    value = {}
    value["self"] = value
    return value
def at_the_inline_bound(extra):
    from kcoral.worker.interpreter import MAX_INLINE_RESULT_BYTES
    return "x" * (MAX_INLINE_RESULT_BYTES - 5 + extra)  # a str of over 64 KiB: 5 bytes of header
def invalid_utf8():
    sys.stdout.flush()
    sys.stdout.buffer.write(b"\\xff" * (30 << 20))
    sys.stdout.flush()
    return "kept"
"""


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("big_string", "serialization", ["takes", "bytes of the result's body"]),
        ("big_list", "serialization", ["takes", "bytes of the result's body"]),
        ("big_message", "runtime", ["ValueError", "[cut]"]),
        ("many_tensors", "serialization", ["data frames"]),
        ("full_stdout", None, []),
        ("invalid_utf8", None, []),
        ("deep_nesting", "serialization", ["nested deeper"]),
        ("a_cycle", "serialization", ["nested deeper"]),
    ],
)
def test_5_results_of_any_size_end_completed_or_clearly_failed(
    service: Service, name: str, kind: str | None, words: list[str]
) -> None:
    skip_where_the_preload_leaves_less_than_on_a_cpu_build("results of up to 64 MiB built under --memory-limit 1g")
    program = Program()
    program.return_(key="before", value="kept")
    module = program.upload(kind="module", source=textwrap.dedent(BIG_RESULTS))
    fn = program.get_function(module=module, name=name, cpu_only=True)
    program.return_(key="out", value=program.run(fn=fn))
    result = execute(service.url, program, output_limit_bytes=64 << 20)
    assert result.results.get("before") == "kept", result.error  # what came before the failure is kept
    if kind is None:
        assert result.completed, result.error
        assert result.results["out"] == "kept"
        assert result.stdout_truncated
        assert 0 < len(result.stdout.encode()) <= 64 << 20
    else:
        assert_failed(result, kind, *words)
        assert result.error is not None
        assert "worker exited" not in result.error["message"]


@pytest.mark.parametrize(("extra", "kind"), [(0, None), (1, "serialization")])
def test_5_a_value_at_the_bound_of_a_results_body_completes_and_one_byte_more_fails(
    service: Service, extra: int, kind: str | None
) -> None:
    result = execute(service.url, program_of(BIG_RESULTS, "at_the_inline_bound", extra, cpu_only=True))
    if kind is None:
        assert result.completed, result.error
        assert len(result.results["out"]) > 50 << 20
    else:
        assert_failed(result, kind, "bytes of the result's body")
        assert result.error is not None
        assert "worker exited" not in result.error["message"]


FORGED_RESULTS = """
import gc, os
import zmq
from kcoral import protocol
def forge(how):
    request_id = os.environ["KCORAL_REQUEST_ID"]
    body = {"request_id": request_id, "status": "COMPLETED", "results": {}, "error": None}
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.type == zmq.DEALER:
            if how == "oversized":
                body["stdout"] = "o" * (65 << 20)
                obj.send_multipart([protocol.VERSION, protocol.RESULT, protocol.pack(body)])
            else:
                obj.send_multipart([protocol.VERSION, protocol.RESULT, b"\\xc1 not msgpack"])
    import time
    time.sleep(10)
"""


@pytest.mark.parametrize(("how", "kind"), [("oversized", "response_too_large"), ("unreadable", "serialization")])
def test_5_the_broker_turns_an_oversized_or_unreadable_result_into_a_clear_failure(
    service: Service, how: str, kind: str
) -> None:
    if how == "oversized":
        skip_where_the_preload_leaves_less_than_on_a_cpu_build("a result over the response limit built under 1 GiB")
    program = program_of(FORGED_RESULTS, "forge", how, cpu_only=True)
    if kind == "response_too_large":
        with pytest.raises(KCoralError) as refused:
            execute(service.url, program)
        assert refused.value.kind == kind
        assert "bytes" in str(refused.value)
    else:
        assert_failed(execute(service.url, program), kind, "could not be read")
    assert_next_programs_untouched(service.url)


# --- 6. Return values that crash the worker -------------------------------------------------------

RAISING_VALUES = """
import torch
class Dict(dict):
    def items(self):
        raise RuntimeError("items")
    def keys(self):
        raise RuntimeError("keys")
    def __iter__(self):
        raise RuntimeError("iter")
class List(list):
    def __iter__(self):
        raise RuntimeError("iter")
class Float(float):
    def __float__(self):
        raise RuntimeError("float")
    def __repr__(self):
        raise RuntimeError("repr")
class Loud(Exception):
    def __str__(self):
        raise RuntimeError("str")
class Exiting(list):
    def __iter__(self):
        raise SystemExit(0)
class Interrupting(int):
    def __int__(self):
        raise KeyboardInterrupt()
    def __index__(self):
        raise KeyboardInterrupt()
class ExitingTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise SystemExit(3)
class ExitingMessage(Exception):
    def __str__(self):
        raise SystemExit(4)
def exits_on_iteration():
    return Exiting([1])
def interrupts_on_conversion():
    return Interrupting(5)
def an_exiting_tensor():
    return torch.zeros(3).as_subclass(ExitingTensor)
def exits_reading_its_message():
    raise ExitingMessage()
def exits():
    raise SystemExit(0)
def a_dict():
    return Dict(a=1)
def a_list():
    return List([1, 2])
def a_float():
    return Float(1.5)
def a_meta_tensor():
    return torch.empty(4, device="meta")
def an_exception():
    raise Loud()
"""


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("a_dict", "serialization"),
        ("a_list", "serialization"),
        ("a_float", "serialization"),
        ("a_meta_tensor", "serialization"),
        ("an_exception", "runtime"),
        ("exits_on_iteration", "serialization"),
        ("interrupts_on_conversion", "serialization"),
        ("an_exiting_tensor", "serialization"),
        ("exits_reading_its_message", "runtime"),
        ("exits", "runtime"),
    ],
)
def test_6_values_whose_own_methods_raise_fail_the_return_not_the_worker(
    service: Service, name: str, kind: str
) -> None:
    result = execute(service.url, program_of(RAISING_VALUES, name, cpu_only=True))
    assert_failed(result, kind)
    assert result.error is not None
    assert "worker exited" not in result.error["message"]
    assert result.error["instruction_op"] == ("return" if kind == "serialization" else "run")


# --- 7. Workspace quota ---------------------------------------------------------------------------

FILLER = """
import os, time
def fill(files, each):
    block = os.urandom(1 << 20)
    for index in range(files):
        with open(f"part-{index}", "wb") as handle:
            for _ in range(each >> 20):
                handle.write(block)
    time.sleep(10)
"""


def test_7_files_over_the_workspace_quota_fail_naming_it(service: Service) -> None:
    # Each file is under --max-file-bytes; together they pass --max-workspace-bytes.
    result = execute(service.url, program_of(FILLER, "fill", 8, 16 << 20, cpu_only=True))
    assert_failed(result, "runtime", "--max-workspace-bytes")
    assert_next_programs_untouched(service.url)


HOLDER = """
import ctypes, os, time
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1
def hold_deleted(files, each, how):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    block = os.urandom(1 << 20)
    held = []
    for index in range(files):
        if how == "memfd":
            fd = os.memfd_create(f"part-{index}")
        else:
            fd = os.open(f"part-{index}", os.O_RDWR | os.O_CREAT, 0o600)
            os.unlink(f"part-{index}")  # out of the workspace's sight, not off the disk
        for _ in range(each >> 20):
            os.write(fd, block)
        if how == "mapped":  # held by a mapping alone
            held.append(libc.mmap(None, each, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0))
            os.close(fd)
    time.sleep(10)
"""


@pytest.mark.parametrize("how", ["deleted", "memfd", "mapped"])
def test_7_deleted_files_a_program_holds_count_against_its_quota(service: Service, how: str) -> None:
    # Each under --max-file-bytes and none in the workspace: together over --max-workspace-bytes.
    result = execute(service.url, program_of(HOLDER, "hold_deleted", 4, 32 << 20, how, cpu_only=True))
    assert_failed(result, "runtime", "--max-workspace-bytes", "deleted files it holds")
    assert_next_programs_untouched(service.url)


FAIR_FILES = """
import os, time
def hard_links(names, each):
    with open("data", "wb") as handle:
        handle.write(os.urandom(each))
    for index in range(names):
        os.link("data", f"name-{index}")
    time.sleep(1.0)  # several samples of the workspace
    return len(os.listdir("."))
def sparse(files, each):
    for index in range(files):
        with open(f"sparse-{index}", "wb") as handle:
            handle.truncate(each)
    time.sleep(1.0)
    return len(os.listdir("."))
"""


@pytest.mark.parametrize(("name", "args"), [("hard_links", (10, 16 << 20)), ("sparse", (4, 200 << 20))])
def test_7_the_quota_counts_the_disk_files_take_not_their_names_or_holes(
    service: Service, name: str, args: tuple[int, int]
) -> None:
    # 16 MiB under eleven names, 800 MiB of holes: each well under the quota on disk.
    result = execute(service.url, program_of(FAIR_FILES, name, *args, cpu_only=True))
    assert result.completed, result.error
    assert_next_programs_untouched(service.url)


# --- 7b. The run directory a fresh worker gets from the one before ---------------------------------

RUN_DIRECTORY_MARKS = """
import os
def mark(how):
    work = os.getcwd()
    run = os.path.dirname(work)
    root = os.path.dirname(run)
    if how == "leftovers":
        for name in ("work", "home", "tmp"):
            with open(os.path.join(run, name, "left.txt"), "w") as out:
                out.write("the last program's")
        os.mkdir(os.path.join(root, "beside"))
    elif how == "modes":
        os.chmod(run, 0o2777)
        os.chmod(os.path.join(run, "home"), 0o3777)
        os.chmod(os.path.join(run, "tmp"), 0)
    elif how == "xattr":
        try:
            os.setxattr(os.path.join(run, "home"), "user.mark", b"the last program's")
        except OSError:
            pass  # a filesystem without user attributes: nothing to hand on
    elif how == "grown":
        for number in range(3000):
            open(os.path.join(run, "home", "a-long-name-for-a-file-%06d" % number), "w").close()
        for number in range(3000):
            os.unlink(os.path.join(run, "home", "a-long-name-for-a-file-%06d" % number))
    elif how == "replaced":
        os.chdir(root)
        os.rename(run, os.path.join(root, "moved"))
        os.makedirs(os.path.join(run, "home", "planted"))
    elif how == "squatted":
        os.makedirs(os.path.join(root, "run-ready", "home", "planted"))
        os.makedirs(os.path.join(root, "run-ready", "work"))
    return how
"""

RUN_DIRECTORY_LOOK = """
import os
def look():
    run = os.path.dirname(os.getcwd())
    root = os.path.dirname(run)
    seen = {"workspace": sorted(e for e in os.listdir(root) if e != ".shm" and e != os.path.basename(run))}
    for name in ("", "work", "home", "tmp"):
        path = os.path.join(run, name)
        info = os.lstat(path)
        try:
            xattrs = sorted(os.listxattr(path))
        except OSError:
            xattrs = []
        seen[name or "run"] = [oct(info.st_mode), sorted(os.listdir(path)), xattrs, info.st_size]
    return seen
"""


@pytest.mark.parametrize("how", ["leftovers", "modes", "xattr", "grown", "replaced", "squatted"])
def test_7_b_the_next_fresh_worker_s_run_directory_is_as_new_whatever_the_last_program_did(
    single: RunningBroker, how: str
) -> None:
    # The slot's zygote hands each fresh worker the last one's run directory, emptied and as made
    # (kcoral.worker.run_directory): nothing the program did to it may reach the next one.
    looked = [execute(single.url, program_of(RUN_DIRECTORY_LOOK, "look", cpu_only=True)) for _ in range(2)]
    assert all(r.completed for r in looked), [r.error for r in looked]
    as_new = looked[1].results["out"]
    assert looked[0].results["out"] == as_new and as_new["workspace"] == [], as_new
    marked = execute(single.url, program_of(RUN_DIRECTORY_MARKS, "mark", how, cpu_only=True))
    assert marked.completed, marked.error
    after = execute(single.url, program_of(RUN_DIRECTORY_LOOK, "look", cpu_only=True))
    assert after.completed, after.error
    assert after.results["out"] == as_new


# --- 8. Progress floods ---------------------------------------------------------------------------

FLOODER = """
import gc, os, time
import zmq
from kcoral import protocol
def flood(seconds):
    request_id = os.environ["KCORAL_REQUEST_ID"]
    sock = next(o for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed and o.type == zmq.DEALER)
    message = protocol.message(protocol.PROGRESS, {"request_id": request_id, "index": 0})
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(1000):
            sock.send_multipart(message)
        sent += 1000
    return sent
"""


def test_8_a_progress_flood_does_not_stall_the_broker(service: Service) -> None:
    flood_s = 2.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        flooding = pool.submit(execute, service.url, program_of(FLOODER, "flood", flood_s, cpu_only=True))
        time.sleep(0.5)
        slowest = 0.0
        with Client(service.url) as client:
            while not flooding.done():
                start = time.monotonic()
                client.health()
                slowest = max(slowest, time.monotonic() - start)
                time.sleep(0.05)
        flooded = flooding.result()
    assert flooded.completed and flooded.results["out"] > 0, flooded.error
    assert slowest < 1.0, f"HEALTH took {slowest:.2f} s during a PROGRESS flood"
    assert_next_programs_untouched(service.url)


LARGE_FLOODER = """
import gc, os, time
import zmq
from kcoral import protocol
def flood_large(command, size, seconds):
    request_id = os.environ["KCORAL_REQUEST_ID"]
    sock = next(o for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed and o.type == zmq.DEALER)
    body = {"request_id": request_id, "slot": 0, "pad": b"p" * size}
    message = [protocol.VERSION, getattr(protocol, command), protocol.pack(body)]
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.send_multipart(message, copy=False)
        sent += 1
    return sent
"""


def test_8_a_flood_of_large_messages_neither_stalls_nor_swells_the_broker(service: Service) -> None:
    # Only a RESULT may be large: the rest, however many, is dropped before it is decoded (decoding
    # a 1-s flood of LEASEs of 32 MiB held the broker's loop for seconds).
    command = "LEASE"
    broker = psutil.Process(service.broker.process.pid)
    before = broker.memory_info().rss
    largest = before
    slowest = 0.0
    flood = program_of(LARGE_FLOODER, "flood_large", command, 32 << 20, 1.0, cpu_only=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        flooding = pool.submit(execute, service.url, flood, timeout_seconds=3)
        with Client(service.url) as client:
            while not flooding.done():
                start = time.monotonic()
                client.health()
                slowest = max(slowest, time.monotonic() - start)
                largest = max(largest, broker.memory_info().rss)
                time.sleep(0.05)
        try:
            flooding.result()  # its own answer, completed or lost behind its flood: the program's affair
        except KCoralError as exc:
            assert exc.kind == "timeout", exc
    assert slowest < 1.0, f"HEALTH took {slowest:.2f} s during a flood of large {command}s"
    assert largest - before < 256 << 20, f"the broker grew by {(largest - before) >> 20} MiB"
    assert_next_programs_untouched(service.url)


# --- 9. Forged worker identity ----------------------------------------------------------------------

IMPOSTOR = """
import json, os, time
import zmq
from kcoral import protocol
def pose(endpoint, wait_s):
    identity = "w0-99-" + os.urandom(8).hex()
    line = (json.dumps({"event": "forked", "worker": identity, "pid": 1}) + "\\n").encode()
    wrote = {}
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.set_blocking(int(name), False)
                wrote[name] = os.write(int(name), line)
            except OSError as exc:
                wrote[name] = type(exc).__name__
    for fd in (0, 1):  # the zygote's command and event streams, through /proc
        try:
            with open(f"/proc/{os.getppid()}/fd/{fd}", "wb", buffering=0) as stream:
                stream.write(line if fd == 1 else b'{"cmd": "stop"}\\n')
            wrote[f"zygote-{fd}"] = "ok"
        except OSError as exc:
            wrote[f"zygote-{fd}"] = type(exc).__name__
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    sock.send_multipart(protocol.message(protocol.READY, {"slot": 0, "pid": 1, "gpu": 0}))
    got = sock.poll(int(wait_s * 1000))
    sock.close(linger=0)
    context.term()
    return {"handed_work": bool(got), "wrote": wrote}
"""


def test_9_a_program_cannot_pose_as_a_worker_or_speak_for_its_zygote(service: Service) -> None:
    assert service.broker.run_dir is not None
    endpoint = f"ipc://{service.broker.run_dir / 'ipc' / 'workers.sock'}"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        posing = pool.submit(execute, service.url, program_of(IMPOSTOR, "pose", endpoint, 3.0, cpu_only=True))
        time.sleep(1.0)
        victims = [pool.submit(execute, service.url, program_of(GPU_CLOCK, "started")) for _ in range(2)]
        posed = posing.result()
        done = [v.result() for v in victims]
    assert posed.completed, posed.error
    out = posed.results["out"]
    assert out["handed_work"] is False, "another client's program was handed to the impostor"
    assert out["wrote"]["zygote-0"] != "ok" and out["wrote"]["zygote-1"] != "ok", out["wrote"]
    assert all(v.completed for v in done), [v.error for v in done]
    with Client(service.url) as client:
        assert all(z["state"] == "running" for z in client.health()["workers"]["zygotes"])
    assert_next_programs_untouched(service.url)


FORGED_SHAPES = """
import gc, os, time
import zmq
from kcoral import protocol
def forge(changes):
    body = protocol.program_result(os.environ["KCORAL_REQUEST_ID"])
    body.update(changes)
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.type == zmq.DEALER:
            obj.send_multipart([protocol.VERSION, protocol.RESULT, protocol.pack(body)])
    time.sleep(10)
"""


@pytest.mark.parametrize(
    "changes",
    [
        {"results": 5},
        {"results": {1: 2}},
        {"status": "WEIRD"},
        {"status": "FAILED"},
        {"error": "boom", "status": "FAILED"},
        {"error": {"kind": 7, "message": "m"}, "status": "FAILED"},
        {"elapsed_ms": "soon", "stdout": 5},
        {"worker": [1]},
    ],
    ids=["results-int", "results-keys", "status", "failed-no-error", "error-str", "error-kind", "times", "worker"],
)
def test_9_a_result_of_the_wrong_shape_fails_its_program_clearly(service: Service, changes: dict[str, Any]) -> None:
    # The program speaks for its worker with a RESULT the client could not read: the broker fails
    # it, rather than hand its client a reply that breaks there.
    result = execute(service.url, program_of(FORGED_SHAPES, "forge", changes, cpu_only=True), timeout_seconds=10)
    assert_failed(result, "serialization", "could not be read")
    assert_next_programs_untouched(service.url)


# --- 10. The service's own side -------------------------------------------------------------------

GROUP_KILLER = """
import os, signal, time
def kill_my_zygotes_group():
    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    time.sleep(5)
"""


def test_10_a_program_cannot_kill_the_broker_through_its_process_group(service: Service, tmp_path: Path) -> None:
    own = start_broker(tmp_path, "--sandbox", service.sandbox, "--fake-gpus", "1", "--workers-per-gpu", "2")
    try:
        result = execute(own.url, program_of(GROUP_KILLER, "kill_my_zygotes_group", cpu_only=True))
        assert_failed(result, "runtime", "worker exited")
        assert own.process.poll() is None, "the broker died"
        deadline = time.monotonic() + 60
        with Client(own.url) as client:
            while client.health()["workers"]["idle"] < 2:
                assert time.monotonic() < deadline, "the slot never served again"
                time.sleep(0.1)
        assert_next_programs_untouched(own.url)
    finally:
        assert own.stop() == 0, own.log()


POISONER = """
import glob, os
def poison(cache_dir, digest):
    outcome = {}
    for path in [os.path.join(cache_dir, digest), f"/blobs/{digest}"]:
        try:
            with open(path, "r+b") as handle:
                handle.write(b"poison")
            outcome[path] = "ok"
        except OSError as exc:
            outcome[path] = type(exc).__name__
    return outcome
"""

SUMMER = """
def total(x):
    return float(x.sum())
"""


def test_10_a_program_cannot_poison_other_clients_cached_blobs(service: Service) -> None:
    data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: past --cache-bytes 1m / 4, so on disk only
    digest = hashlib.sha256(data.tobytes()).hexdigest()
    summing = Program()
    summing.return_(
        key="out",
        value=summing.run(
            fn=summing.get_function(module=summing.upload(kind="module", source=SUMMER), name="total", cpu_only=True),
            args=[summing.upload(kind="tensor", value=data)],
        ),
    )
    first = execute(service.url, summing)
    assert first.completed, first.error
    assert service.broker.run_dir is not None
    cache_dir = str(service.broker.run_dir.parent / "cache")
    poisoned = execute(service.url, program_of(POISONER, "poison", cache_dir, digest, cpu_only=True))
    assert poisoned.completed, poisoned.error
    if service.sandbox == "bubblewrap":
        assert "ok" not in poisoned.results["out"].values(), poisoned.results["out"]
    second = execute(service.url, summing)
    assert second.completed, second.error
    assert second.results["out"] == first.results["out"] == float(data.sum())
    # Inside bubblewrap the worker maps the blob from the read-only cache; without a sandbox the
    # broker hashes it again on every read from disk and sends it as a frame.
    assert ("blob_paths=1" in service.broker.log()) == (service.sandbox == "bubblewrap")
