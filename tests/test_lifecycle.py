"""Worker lifecycle against real brokers: fresh processes, clean kills, limits, state resets.

Every process a test program starts renames itself (``/proc/PID/comm``) to this module's random
token, and every worker and zygote PID the tests see is recorded; at the end of the module none of
them may be alive or a zombie. On hosts whose init does not reap (this one), a process that escaped
its zygote would stay a zombie for good, so the check would see it.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcoral import Client, KCoralError, Program, ProgramResult
from kcoral.worker import processes
from kcoral.worker.state import cuda_view_mismatch
from tests.helpers import BrokerFactory, RunningBroker, start_broker

TOKEN = f"kclc{secrets.token_hex(3)}"  # the comm name of every process a test program starts
MEMORY_LIMIT = 1 << 30
MAX_PROCESSES = 24
MAX_FILE_BYTES = 32 << 20
LIMIT_FLAGS = (
    "--memory-limit",
    str(MEMORY_LIMIT),
    "--max-processes",
    str(MAX_PROCESSES),
    "--max-file-bytes",
    str(MAX_FILE_BYTES),
)
GONE_WITHIN_SECONDS = 2.0

# Helpers uploaded with every program: name the process, report PIDs, start children three ways.
HELPERS = textwrap.dedent(
    f"""
    import ctypes, os, sys, threading, time

    def name_me():
        ctypes.CDLL(None).prctl(15, b"{TOKEN}", 0, 0, 0)

    def note(path, pid):
        with open(path, "a") as handle:
            handle.write(f"{{pid}}\\n")

    def start_children(path):
        name_me()
        plain = os.fork()
        if plain == 0:
            time.sleep(600)
            os._exit(0)
        note(path, plain)
        session = os.fork()
        if session == 0:
            os.setsid()
            time.sleep(600)
            os._exit(0)
        note(path, session)
        middle = os.fork()
        if middle == 0:  # the classic daemon: setsid, fork again, let the middle one exit
            os.setsid()
            if os.fork() == 0:
                note(path, os.getpid())
                time.sleep(600)
                os._exit(0)
            os._exit(0)
        os.waitpid(middle, 0)
        deadline = time.monotonic() + 5
        while len(open(path).read().split()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    """
)


# --- helpers --------------------------------------------------------------------------------------


def program(body: str, *args: Any, helpers: bool = True) -> Program:
    """A program that runs ``main(*args)`` from ``body`` and returns its value as ``value``."""
    source = (HELPERS if helpers else "") + textwrap.dedent(body)
    prog = Program()
    module = prog.upload(kind="module", source=source)
    main = prog.get_function(module=module, name="main")
    prog.return_(key="value", value=prog.run(fn=main, args=list(args)))
    return prog


def run(url: str, body: str, *args: Any, timeout: float = 30.0) -> ProgramResult:
    with Client(url) as client:
        return client.execute(program(body, *args), timeout_seconds=timeout)


def pid_of(url: str) -> int:
    result = run(url, "def main():\n    return os.getpid()\n")
    assert result.completed, result
    seen_pids.add(int(result.results["value"]))
    return int(result.results["value"])


def alive(pid: int) -> bool:
    """Whether ``pid`` exists at all, zombies included."""
    return os.path.exists(f"/proc/{pid}")


def wait_until_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def read_pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def health(url: str) -> dict[str, Any]:
    with Client(url) as client:
        return client.health()


def marked_processes() -> list[processes.ProcessInfo]:
    return [info for info in processes.process_table() if info.name == TOKEN]


def zombies() -> list[processes.ProcessInfo]:
    return [info for info in processes.process_table() if info.zombie]


seen_pids: set[int] = set()  # workers and zygotes whose end the leak check verifies


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After every broker of the module stopped: none of our processes alive or a zombie."""
    zombies_before = {z.pid for z in zombies()}
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = marked_processes()
        survivors = [p for p in seen_pids if alive(p)]
        if (not leaked and not survivors) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    new_zombies = [z for z in zombies() if z.pid not in zombies_before]
    assert not leaked, f"processes started by test programs still exist: {leaked}"
    assert not survivors, f"workers or zygotes still exist: {[processes.read_process(p) for p in survivors]}"
    ours = [z for z in new_zombies if z.ppid == os.getpid() or z.pid in seen_pids or z.name == TOKEN]
    assert not ours, f"zombies left: {ours} (all new zombies on the host: {new_zombies})"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One CPU worker with small limits, shared by the tests that end their worker anyway."""
    broker = start_broker(tmp_path_factory.mktemp("limited"), "--workers", "1", *LIMIT_FLAGS)
    seen_pids.update(z["zygote_pid"] for z in health(broker.url)["workers"]["zygotes"])
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def reusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One worker that runs program after program (--max-programs-per-worker 0)."""
    broker = start_broker(tmp_path_factory.mktemp("reusing"), "--fake-gpus", "1", "--max-programs-per-worker", "0")
    seen_pids.update(z["zygote_pid"] for z in health(broker.url)["workers"]["zygotes"])
    yield broker
    broker.stop()


# --- a fresh process for every program --------------------------------------------------------------


def test_every_program_gets_a_fresh_process(limited: RunningBroker) -> None:
    counter = """
        calls = 0

        def main():
            global calls
            calls += 1
            import random, numpy, torch
            os.environ["KCORAL_LEAK_TEST"] = "set by an earlier program"
            return [os.getpid(), calls, random.random(), float(torch.rand(1)), float(numpy.random.random())]
    """
    seen = """
        def main():
            return os.environ.get("KCORAL_LEAK_TEST")
    """
    first = run(limited.url, counter)
    leak = run(limited.url, seen)
    second = run(limited.url, counter)
    assert first.completed and second.completed and leak.completed
    (pid1, calls1, py1, torch1, np1), (pid2, calls2, py2, torch2, np2) = first.results["value"], second.results["value"]
    seen_pids.update((pid1, pid2))
    assert pid1 != pid2
    assert calls1 == calls2 == 1  # the uploaded module's globals start over
    assert leak.results["value"] is None  # the environment variable did not reach the next program
    # Forked workers do not share their zygote's random generator states.
    assert py1 != py2 and torch1 != torch2 and np1 != np2


# --- a reused worker starts each program from the same state ----------------------------------------


def test_reused_worker_resets_process_state(reusing: RunningBroker, tmp_path: Path) -> None:
    before = """
        def main():
            import torch
            return [os.getpid(), torch.get_num_threads(), os.umask(0o022)]
    """
    change = """
        def main(folder):
            import random, signal, sys, torch, numpy
            sys.path.insert(0, folder)
            with open(os.path.join(folder, "kclc_helper.py"), "w") as handle:
                handle.write("hits = 0\\n")
            import kclc_helper
            kclc_helper.hits += 1
            os.environ["KCORAL_LEAK_TEST"] = "1"
            os.chdir("/")
            os.umask(0o077)
            torch.set_num_threads(1)
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)
            torch.manual_seed(0)
            numpy.random.seed(0)
            random.seed(0)
            signal.signal(signal.SIGUSR1, lambda *a: None)
            return os.getpid()
    """
    check = """
        def main(folder):
            import random, signal, sys, torch, numpy
            drawn = torch.rand(3).tolist()
            torch.manual_seed(0)
            seeded = torch.rand(3).tolist()
            return {
                "pid": os.getpid(),
                "env": os.environ.get("KCORAL_LEAK_TEST"),
                "cwd_is_fresh": os.getcwd().endswith("work") and os.getcwd() != "/",
                "path": folder in sys.path,
                "helper": "kclc_helper" in sys.modules,
                "threads": torch.get_num_threads(),
                "umask": os.umask(0o022),
                "dtype": str(torch.get_default_dtype()),
                "grad": torch.is_grad_enabled(),
                "torch_seeded": drawn == seeded,
                "sigusr1_default": signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
            }
    """
    folder = str(tmp_path)
    initial = run(reusing.url, before)
    assert initial.completed, initial
    pid, threads, umask = initial.results["value"]
    seen_pids.add(pid)
    changed = run(reusing.url, change, folder)
    assert changed.completed, changed
    assert changed.results["value"] == pid, "the broker did not reuse the worker"
    state = run(reusing.url, check, folder)
    assert state.completed, state
    assert state.results["value"] == {
        "pid": pid,
        "env": None,
        "cwd_is_fresh": True,
        "path": False,
        "helper": False,
        "threads": threads,
        "umask": umask,
        "dtype": "torch.float32",
        "grad": True,
        "torch_seeded": False,
        "sigusr1_default": True,
    }


def test_cuda_poison_retires_a_reused_worker(reusing: RunningBroker) -> None:
    fail = """
        def main(message):
            raise RuntimeError(message)
    """
    pid = pid_of(reusing.url)
    # Not sticky (the context stays usable): the worker is kept.
    oom = run(reusing.url, fail, "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom.status == "FAILED" and oom.worker.get("reusable") is True
    assert pid_of(reusing.url) == pid
    poisoned = run(reusing.url, fail, "CUDA error: an illegal memory access was encountered")
    assert poisoned.status == "FAILED" and poisoned.error is not None and poisoned.error["kind"] == "runtime"
    assert poisoned.worker.get("reusable") is False and "CUDA context unusable" in poisoned.worker["retire_reason"]
    assert pid_of(reusing.url) != pid


def test_leftover_process_and_thread_are_killed_and_reported(reusing: RunningBroker, tmp_path: Path) -> None:
    body = """
        def main(path):
            name_me()
            child = os.fork()
            if child == 0:
                time.sleep(600)
                os._exit(0)
            note(path, child)
            threading.Thread(target=time.sleep, args=(600,), name="kclc-sleeper", daemon=True).start()
            return os.getpid()
    """
    pids_file = tmp_path / "pids"
    result = run(reusing.url, body, str(pids_file))
    assert result.completed, result
    seen_pids.add(result.results["value"])
    (child,) = read_pids(pids_file)
    assert not alive(child), "the leftover process was not killed before the result was sent"
    assert result.worker["leftover_processes"] == [f"{child} ({TOKEN})"]
    assert result.worker["leftover_threads"] == ["kclc-sleeper"]
    assert result.worker["reusable"] is False and "left" in result.worker["retire_reason"]
    assert pid_of(reusing.url) != result.results["value"]


# --- kills leave nothing behind ---------------------------------------------------------------------


def test_timeout_kills_every_descendant(limited: RunningBroker, tmp_path: Path) -> None:
    body = """
        def main(path):
            start_children(path)
            note(path + ".worker", os.getpid())
            time.sleep(600)
    """
    pids_file = tmp_path / "pids"
    with pytest.raises(KCoralError) as caught:
        run(limited.url, body, str(pids_file), timeout=2.0)
    timed_out_at = time.monotonic()
    assert caught.value.kind == "timeout"
    children = read_pids(pids_file)
    (worker,) = read_pids(Path(f"{pids_file}.worker"))
    seen_pids.add(worker)
    assert len(children) == 3, "the program did not start its plain, setsid and daemon children"
    left = wait_until_gone([worker, *children], GONE_WITHIN_SECONDS)
    assert not left, f"still there {time.monotonic() - timed_out_at:.2f} s after the timeout: {left}"
    assert pid_of(limited.url) != worker


def test_worker_exit_fails_the_program_and_service_continues(limited: RunningBroker) -> None:
    result = run(limited.url, "def main():\n    os._exit(3)\n")
    assert result.status == "FAILED" and result.error is not None
    assert result.error["kind"] == "runtime"
    assert "worker exited while executing the instruction" in result.error["message"]
    assert "exit code 3" in result.error["message"]
    assert result.error["instruction_op"] == "run"
    assert pid_of(limited.url) > 0


def test_killed_zygote_is_replaced(broker_factory: BrokerFactory) -> None:
    # CPU workers: one slot, so one zygote on any host (a GPU host's defaults give a slot per GPU).
    broker = broker_factory("--workers", "1", "--device", "cpu")
    (zygote,) = health(broker.url)["workers"]["zygotes"]
    workers = processes.children(zygote["zygote_pid"])
    seen_pids.update([zygote["zygote_pid"], *workers])
    os.kill(zygote["zygote_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        state = health(broker.url)
        (now,) = state["workers"]["zygotes"]
        if now["restarts"] >= 1 and now["state"] == "running" and state["workers"]["idle"] >= 1:
            break
        assert time.monotonic() < deadline, f"the zygote was not replaced: {state['workers']}"
        time.sleep(0.05)
    assert now["zygote_pid"] != zygote["zygote_pid"]
    seen_pids.add(now["zygote_pid"])
    assert "zygote exited" in now["last_error"]
    assert pid_of(broker.url) > 0
    assert not wait_until_gone([zygote["zygote_pid"], *workers], GONE_WITHIN_SECONDS)
    assert "zygote_restart" in broker.log()


# --- resource limits --------------------------------------------------------------------------------


def test_memory_bomb_fails_naming_the_limit(limited: RunningBroker) -> None:
    body = """
        def main():
            hoard = []
            while True:
                hoard.append(b"x" * (64 << 20))
    """
    result = run(limited.url, body)
    assert result.status == "FAILED" and result.error is not None
    assert result.error["kind"] == "runtime"
    assert "MemoryError" in result.error["message"] and "--memory-limit" in result.error["message"]
    assert pid_of(limited.url) > 0


def test_memory_spread_over_processes_is_caught_by_the_watchdog(limited: RunningBroker, tmp_path: Path) -> None:
    # Each child stays under its own RLIMIT_DATA; together they pass the limit. A child inherits
    # the worker's data segment, which depends on the torch build (CPU torch maps about 215 MiB at
    # import, CUDA torch 767 MiB), so the program measures it and sizes the blocks to fit beside it.
    body = """
        def main(path, limit):
            name_me()
            with open("/proc/self/status") as status:
                inherited = next(int(l.split()[1]) << 10 for l in status if l.startswith("VmData:"))
            block = min(400 << 20, limit - inherited - (64 << 20))
            assert block > (32 << 20), f"the worker alone maps {inherited >> 20} MiB of data"
            for _ in range(limit // block + 2):
                child = os.fork()
                if child == 0:
                    data = b"x" * block
                    time.sleep(600)
                    os._exit(0)
                note(path, child)
            time.sleep(600)
    """
    pids_file = tmp_path / "pids"
    result = run(limited.url, body, str(pids_file), MEMORY_LIMIT)
    assert result.status == "FAILED" and result.error is not None
    assert "worker exited while executing the instruction" in result.error["message"]
    assert "--memory-limit" in result.error["message"], result.error["message"]
    assert not wait_until_gone(read_pids(pids_file), GONE_WITHIN_SECONDS)
    assert pid_of(limited.url) > 0


def test_fork_bomb_fails_naming_the_limit(limited: RunningBroker) -> None:
    # Exponential, but bounded (1023 processes at most, gone after 60 s) in case containment
    # failed: this machine is shared.
    body = """
        def main():
            name_me()
            me, give_up = os.getpid(), time.monotonic() + 60
            generation = forked = 0
            while forked < 2 and generation < 9:
                if os.fork() == 0:
                    generation, forked = generation + 1, 0
                else:
                    forked += 1
            while time.monotonic() < give_up:
                time.sleep(0.05)
            if os.getpid() != me:
                os._exit(0)
    """
    result = run(limited.url, body)
    assert result.status == "FAILED" and result.error is not None
    assert "worker exited while executing the instruction" in result.error["message"]
    assert "--max-processes" in result.error["message"], result.error["message"]
    assert pid_of(limited.url) > 0
    assert not wait_until_gone([p.pid for p in marked_processes()], GONE_WITHIN_SECONDS)


def test_disk_filler_fails_naming_the_limit(limited: RunningBroker) -> None:
    body = """
        def main():
            chunk = b"x" * (1 << 20)
            with open("filler", "wb") as handle:
                while True:
                    handle.write(chunk)
                    handle.flush()
    """
    result = run(limited.url, body)
    assert result.status == "FAILED" and result.error is not None
    assert result.error["kind"] == "runtime"
    assert "File too large" in result.error["message"] and "--max-file-bytes" in result.error["message"]
    assert pid_of(limited.url) > 0


# --- unit level ---------------------------------------------------------------------------------


def test_a_cuda_context_made_for_other_gpus_refuses_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cuda_view_mismatch([1]) is None
    for gpu_ids in ([0], [1, 2], []):
        refusal = cuda_view_mismatch(gpu_ids)
        assert refusal is not None and "--cuda-context lazy" in refusal
    fake_torch.cuda.is_initialized = lambda: False  # no context yet: any GPUs will do
    assert cuda_view_mismatch([0, 3]) is None
