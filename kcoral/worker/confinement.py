"""A sandboxed worker's confinement to the GPUs of its program, done before any of the program's code.

A slot's zygote runs in bubblewrap with the device nodes of every GPU the broker serves, and with
``CAP_SYS_ADMIN`` (and ``CAP_SETPCAP``) inside the sandbox's user namespace only (see
:mod:`kcoral.sandbox.bubblewrap`). The broker picks a program's GPUs when it dispatches it, so the
worker learns them from the PROGRAM message (the broker's word, never the program's). Then, before
the program's first instruction, :func:`confine`:

1. enters a mount namespace of its own (``unshare(CLONE_NEWNS)``, all mounts private, so nothing
   reaches the zygote or the next worker);
2. mounts a fresh tmpfs over ``/dev`` and binds back every entry of the old one except the device
   nodes of the GPUs it did not lease (``/dev/nvidiaN``): those are *absent*, exactly as when
   bubblewrap was never given them, which is the layout CUDA is known to work in (an inaccessible
   node, such as ``/dev/null`` bound over it, is not);
3. covers ``/proc/PID`` of every other process of the slot (the zygote, bubblewrap's init, a worker
   still exiting) with an empty read-only tmpfs, so ``/proc/PID/root/dev/nvidia1`` leads nowhere;
4. drops every capability for good: the bounding and ambient sets emptied, permitted, effective and
   inheritable set to zero, ``PR_SET_NO_NEW_PRIVS``; it then checks ``/proc/self/status`` and
   refuses the program if any capability is left.

CUDA numbers the GPUs it can open, so inside the confinement the program's GPUs are CUDA devices
``0..k-1`` (in PCI bus order, the order of their broker indices, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``):
:func:`visible_devices` gives ``CUDA_VISIBLE_DEVICES`` accordingly. A program that rewrites it, or
opens another GPU's node by path, finds no other GPU. Measured on the 2-core CPU VM while it was
busy (``benchmarks/confinement.py``, 8 stand-in GPU nodes, load 9 to 17): 10 ms median, most of it
the dozen mount calls of the ``/dev`` rebuild, each waiting for a CPU; a new bubblewrap per
program instead would cost 45 ms there, and a zygote per GPU set an ``import torch`` per new set.

What is left: a process that a program's own thread starts in the microseconds between the
zygote's last kill of the retiring worker's descendants and that worker's exit lives until the
zygote reaps the exit, and meanwhile could reach the next worker's root through ``/proc/PID/root``
(same user, no capabilities either side). Closing that for good needs a user namespace per worker,
which bubblewrap's ``--disable-userns`` rules out unless a seccomp filter takes its place.

A worker is confined once: a reused worker (``--max-programs-per-worker`` other than 1) serves only
programs on the same GPUs, and refuses others (kind ``unavailable``), as a worker with an eager CUDA
context does.

Without a sandbox (``--sandbox none``) nothing is confined and ``CUDA_VISIBLE_DEVICES`` lists the
broker's indices of the program's GPUs.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "ConfinementError",
    "DevEntry",
    "configure",
    "confine",
    "confined_to",
    "confinement_ms",
    "dev_entries_kept",
    "holds_gpu_device",
    "prepare",
    "visible_devices",
]

CLONE_NEWNS: Final = 0x00020000
MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MS_PRIVATE: Final = 0x40000
PR_CAPBSET_DROP: Final = 24
PR_SET_NO_NEW_PRIVS: Final = 38
PR_CAP_AMBIENT: Final = 47
PR_CAP_AMBIENT_CLEAR_ALL: Final = 4
LINUX_CAPABILITY_VERSION_3: Final = 0x20080522
DEV: Final = Path("/dev")
PROC: Final = Path("/proc")
GPU_NODE: Final = re.compile(r"nvidia(\d+)")
CAPABILITY_FIELDS: Final = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
DEV_TMPFS_OPTIONS: Final = "mode=0755,size=64k,nr_inodes=256"
MASK_TMPFS_OPTIONS: Final = "mode=0500,size=4k,nr_inodes=4"

_LIBC: Final = ctypes.CDLL(None, use_errno=True)

# Per process: the GPU index -> device node map this worker's zygote was given (None: no sandbox)
# and the GPUs it is confined to once it is.
_nodes: dict[int, str] | None = None
_confined: tuple[int, ...] | None = None
_took_ms: float | None = None  # how long the confinement took (the result's worker map reports it)
_prepared: tuple[int, ...] | None = None  # the GPUs whose /dev prepare() built while idle
_original_dev: int | None = None  # O_PATH descriptor of the sandbox's /dev, until confined


class ConfinementError(RuntimeError):
    """Raised when the worker cannot confine itself; no program may then run in it."""


@dataclass(frozen=True)
class DevEntry:
    """One entry of ``/dev`` as the zygote's sandbox has it."""

    name: str
    kind: str  # "dir", "symlink" or "node" (device node or file: bound back as it is)


def configure(nodes: Mapping[int, str] | None) -> None:
    """Tell this process (a freshly forked worker) the device node of each GPU of the sandbox.

    ``None`` means no sandbox: :func:`confine` then does nothing.
    """
    global _nodes, _confined, _prepared
    _nodes = None if nodes is None else {int(k): str(v) for k, v in nodes.items()}
    _confined = _prepared = None


def confined_to() -> tuple[int, ...] | None:
    """The GPUs this process is confined to, or None when it is not (yet, or at all)."""
    return _confined


def confinement_ms() -> float | None:
    """How long :func:`confine` took in this process, or None when it did not confine it."""
    return _took_ms


def visible_devices(gpu_ids: Iterable[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a program on ``gpu_ids`` (sorted, as the broker sends them).

    Confined, CUDA sees only the program's GPUs and numbers them from 0; unconfined, it sees every
    GPU of the host and the broker's indices are CUDA's (``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
    """
    ids = list(gpu_ids)
    if _confined is not None:
        return ",".join(str(position) for position in range(len(ids)))
    return ",".join(str(g) for g in ids)


def dev_entries_kept(entries: Iterable[DevEntry], nodes: Mapping[int, str], gpu_ids: Iterable[int]) -> list[DevEntry]:
    """The ``/dev`` entries a program on ``gpu_ids`` keeps: all but the other GPUs' nodes.

    A GPU node is known by name (``nvidiaN``, N the device minor); one that the map does not name
    (a GPU the broker does not serve) goes too.

    Example::

        >>> entries = [DevEntry("null", "node"), DevEntry("nvidia0", "node"), DevEntry("nvidia1", "node"),
        ...            DevEntry("nvidiactl", "node")]
        >>> [e.name for e in dev_entries_kept(entries, {0: "/dev/nvidia0", 1: "/dev/nvidia1"}, [1])]
        ['null', 'nvidia1', 'nvidiactl']
    """
    leased = {Path(nodes[g]).name for g in gpu_ids if g in nodes}
    return [e for e in entries if not GPU_NODE.fullmatch(e.name) or e.name in leased]


def prepare(gpu_ids: Iterable[int]) -> None:
    """While idle (after READY), do the slow part of :func:`confine` for the likeliest GPUs.

    The worker enters its own mount namespace and builds the ``/dev`` of ``gpu_ids`` (its slot's
    GPU: the broker prefers it), but keeps its capabilities, so that :func:`confine` can still
    build another ``/dev`` when the program brings other GPUs. A failure is left for
    :func:`confine` to meet again and report.
    """
    global _prepared
    wanted = tuple(sorted(gpu_ids))
    if _nodes is None or _confined is not None or _prepared is not None:
        return
    if any(g not in _nodes for g in wanted):
        return
    try:
        _enter_namespace()
        _build_dev(wanted)
    except OSError:
        return
    _prepared = wanted


def confine(gpu_ids: Iterable[int]) -> str | None:
    """Confine this worker to ``gpu_ids`` (see the module's docstring); say why a program cannot run.

    Returns None when the program may run: confined now, confined to these GPUs already, or not
    sandboxed at all. Returns the reason otherwise (the worker is then unusable and retires).
    """
    global _confined, _took_ms, _original_dev
    wanted = tuple(sorted(gpu_ids))
    start = time.perf_counter()
    if _nodes is None:
        return None
    if _confined is not None:
        if _confined == wanted:
            return None
        return (
            f"this worker is confined to GPU(s) {list(_confined)} and cannot serve a program on "
            f"{list(wanted)}; start the broker with --max-programs-per-worker 1 to run programs on other GPU sets"
        )
    unknown = [g for g in wanted if g not in _nodes]
    if unknown:
        drop_capabilities_quietly()
        return f"the sandbox has no device node for GPU(s) {unknown}"
    try:
        _enter_namespace()
        if _prepared != wanted:
            _build_dev(wanted)  # over the prepared one, if any: the original stays reachable by fd
        _mask_other_processes()
    except OSError as exc:
        drop_capabilities_quietly()
        return f"the worker could not confine itself to GPU(s) {list(wanted)}: {exc}"
    finally:
        if _original_dev is not None:
            os.close(_original_dev)
            _original_dev = None
    try:
        drop_capabilities()
    except (OSError, ConfinementError) as exc:
        return f"the worker could not drop its capabilities: {exc}"
    _confined = wanted
    _took_ms = (time.perf_counter() - start) * 1000
    return None


def _enter_namespace() -> None:
    """A mount namespace of our own (once), all private, and a handle on the sandbox's ``/dev``."""
    global _original_dev
    if _original_dev is not None:
        return
    _check(_LIBC.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Opened after the unshare: a bind's source must be a mount of our own namespace.
    _original_dev = os.open(DEV, os.O_PATH | os.O_DIRECTORY)


def _build_dev(gpu_ids: tuple[int, ...]) -> None:
    """A fresh read-only ``/dev``: the sandbox's entries, bound back, but other GPUs' nodes."""
    assert _nodes is not None and _original_dev is not None
    via = f"/proc/self/fd/{_original_dev}"
    entries = [_dev_entry(via, name) for name in sorted(os.listdir(via))]
    kept = dev_entries_kept(entries, _nodes, gpu_ids)
    _mount("tmpfs", str(DEV), "tmpfs", MS_NOSUID | MS_NOEXEC, DEV_TMPFS_OPTIONS)
    for entry in kept:
        source, target = f"{via}/{entry.name}", DEV / entry.name
        if entry.kind == "symlink":
            os.symlink(os.readlink(source), target)
            continue
        if entry.kind == "dir":
            target.mkdir()
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
        _mount(source, str(target), None, MS_BIND | MS_REC)
    _mount(None, str(DEV), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def _dev_entry(directory: str, name: str) -> DevEntry:
    mode = os.lstat(f"{directory}/{name}").st_mode
    if stat.S_ISLNK(mode):
        return DevEntry(name, "symlink")
    return DevEntry(name, "dir" if stat.S_ISDIR(mode) else "node")


def _mask_other_processes() -> None:
    """Cover ``/proc/PID`` (and ``/proc/TID``) of every other process of the slot's pid namespace.

    Each has a root (``/proc/PID/root``) whose ``/dev`` may hold other GPUs' nodes. Processes that
    appear later are this worker's own: the zygote forks the next worker only after this one is done.
    """
    me = os.getpid()
    for pid in [int(n) for n in os.listdir(PROC) if n.isdigit() and int(n) != me]:
        try:
            tids = [int(t) for t in os.listdir(PROC / str(pid) / "task") if t.isdigit()]
        except OSError:
            tids = []
        for target in dict.fromkeys([pid, *tids]):
            try:
                _mount(
                    "tmpfs",
                    str(PROC / str(target)),
                    "tmpfs",
                    MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                    MASK_TMPFS_OPTIONS,
                )
            except FileNotFoundError:
                pass  # it ended meanwhile


def drop_capabilities() -> None:
    """Give up every capability for good, then check that none is left (ConfinementError if one is)."""
    libc = _LIBC
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for capability in range(last + 1):
        # Needs CAP_SETPCAP; where it is missing the bounding set was empty already (bwrap --cap-drop ALL).
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    _capset_zero(libc)
    left = capabilities_left()
    if left:
        raise ConfinementError(f"capabilities left after dropping them: {left}")


def drop_capabilities_quietly() -> None:
    """Drop what can be dropped when confinement failed; the program is refused anyway."""
    try:
        drop_capabilities()
    except (OSError, ConfinementError):
        pass


def capabilities_left(status: str | None = None) -> dict[str, str]:
    """The non-zero capability sets of ``/proc/self/status`` (or of ``status``, its text)."""
    text = Path("/proc/self/status").read_text() if status is None else status
    left = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in CAPABILITY_FIELDS and int(value.strip(), 16) != 0:
            left[name] = value.strip()
    return left


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset_zero(libc: ctypes.CDLL) -> None:
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()  # zeroed: no capability in any set
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = _LIBC
    result = libc.mount(
        None if source is None else source.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None if data is None else data.encode(),
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source or ''} on {target}: {os.strerror(errno)}", target)


# The NVIDIA driver's character devices (/dev/nvidia0.., /dev/nvidiactl); nvidia-uvm's major is
# given out at load time, so that one is known by its path.
NVIDIA_MAJOR: Final = 195
NVIDIA_PATH: Final = "/dev/nvidia"


def holds_gpu_device(pid: int) -> bool | None:
    """Whether a process has an NVIDIA device open or mapped: True, False, or None where its
    descriptors or mappings cannot be read (taken as holding one by the caller).

    A CUDA context lives on such descriptors and mappings: a process with neither has no context
    and, once killed, can never make one (it would need system calls after the kill). A process
    already gone (or a zombie: its descriptors and memory are released first) holds none.
    """
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    for name in names:
        try:
            if NVIDIA_PATH in os.readlink(f"{fd_dir}/{name}"):
                return True
            status = os.stat(f"{fd_dir}/{name}")
        except FileNotFoundError:
            continue  # closed meanwhile
        except OSError:
            return None
        if stat.S_ISCHR(status.st_mode) and os.major(status.st_rdev) == NVIDIA_MAJOR:
            return True
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return NVIDIA_PATH.encode() in maps.read()
    except FileNotFoundError:
        return False
    except OSError:
        return None
