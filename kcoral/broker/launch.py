"""How the broker starts each slot's zygote: its command line (:class:`ZygoteSettings`, one per slot)
inside bubblewrap, or as it is with ``--sandbox none``.

The broker knows a slot's workspace by its host path; a sandboxed zygote sees the same directory
at ``/workspace`` and is told that path (the broker hands paths to the zygote only on its command
line, so nothing else needs translating). What the sandbox holds is
:mod:`kcoral.sandbox.bubblewrap`'s business; this module supplies the broker's side of it: the bwrap
that was found to work, the ipc and blob cache directories, a shared-memory directory per slot,
the interpreter flags of a sandboxed zygote, and the device nodes of the broker's GPUs (each
zygote's sandbox holds all of them; each worker keeps those of its program, see
:mod:`kcoral.worker.confinement`), told to the zygote as its settings' ``gpu_nodes``. Fake GPUs get
stand-in files for nodes, so that the confinement is exercised on machines without GPUs.

Example::

    specs = slot_specs(settings, target, run_dir, connect)  # raises SandboxUnavailable when bwrap fails
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

import structlog

from kcoral.broker.settings import BrokerSettings, slots_per_gpu
from kcoral.broker.supervisor import SlotSpec
from kcoral.broker.target import TargetInfo
from kcoral.protocol.zygote_link import ZYGOTE_MODULE, ZygoteSettings
from kcoral.sandbox.bubblewrap import WORKSPACE, GpuBind, SandboxSpec, check_bwrap, sandbox_argv
from kcoral.worker.memory_cgroup import SlotCgroups

__all__ = ["Bubblewrap", "Unsandboxed", "slot_specs", "zygote_argv", "zygote_launcher"]

log = structlog.get_logger("kcoral.sandbox")

# A program can kill its zygote (same uid), and the next zygote of the slot starts in the same
# workspace before wiping it. Its interpreter must therefore import nothing from there: -P keeps
# the working directory (/workspace, which ``python -m`` would put first on sys.path) off sys.path,
# -s the user site-packages (under HOME=/workspace/home, where a .pth file would run code).
ZYGOTE_PYTHON_FLAGS: Final = ("-s", "-P")
# The blob cache as the sandbox sees it: enterable, not listable. A program opens the blobs whose
# digests it was given, and cannot enumerate other clients' uploads. Group and others get nothing.
BLOB_DIR_MODE: Final = 0o311
# A fake GPU's stand-in for its device node: a file anyone in the sandbox may open, as a node is.
FAKE_NODE_MODE: Final = 0o666


class Unsandboxed:
    """``--sandbox none``: the zygote runs as the broker's child, with the host's view."""

    sandboxed: ClassVar[bool] = False

    def workspace_inside(self, workspace: Path) -> Path:
        return workspace

    def gpu_binds(self, target: TargetInfo) -> dict[int, GpuBind]:
        return {}  # every GPU is visible: CUDA_VISIBLE_DEVICES alone picks a program's

    def wrap(self, argv: list[str], *, slot: int, workspace: Path, gpu_nodes: dict[int, GpuBind]) -> list[str]:
        return argv


@dataclass(frozen=True)
class Bubblewrap:
    """``--sandbox bubblewrap``: each zygote in its own sandbox (see :mod:`kcoral.sandbox.bubblewrap`)."""

    sandboxed: ClassVar[bool] = True
    bwrap: Path
    run_dir: Path
    ipc_dir: Path
    blob_dir: Path | None
    readonly_paths: tuple[Path, ...]
    environ: Mapping[str, str]

    def workspace_inside(self, workspace: Path) -> Path:
        return WORKSPACE

    def gpu_binds(self, target: TargetInfo) -> dict[int, GpuBind]:
        """Each GPU's device node by index: the driver's node of a real GPU, a stand-in file
        (``RUN_DIR/fake-dev/nvidiaN``, seen at ``/dev/nvidiaN``) for a fake one.

        Checks once that bwrap gives a sandbox what the workers' confinement needs (raises
        :class:`~kcoral.sandbox.bubblewrap.SandboxUnavailable`, saying how to fix it, otherwise).
        """
        if target.lease_gpus:
            check_bwrap(self.bwrap, with_gpus=True)
        if target.fake:
            directory = self.run_dir / "fake-dev"
            directory.mkdir(parents=True, exist_ok=True)
            binds = {}
            for index in target.lease_gpus:
                stand_in = directory / f"nvidia{index}"
                stand_in.write_text(f"fake GPU {index}\n")
                stand_in.chmod(FAKE_NODE_MODE)
                binds[index] = GpuBind(stand_in, Path(f"/dev/nvidia{index}"))
            return binds
        binds = {}
        for gpu in target.gpus:
            if gpu.minor is None:
                log.warning("gpu_without_device_node", gpu=gpu.index, pci_bus_id=gpu.pci_bus_id)
                continue
            node = Path(f"/dev/nvidia{gpu.minor}")
            binds[gpu.index] = GpuBind(node, node)
        return binds

    def wrap(self, argv: list[str], *, slot: int, workspace: Path, gpu_nodes: dict[int, GpuBind]) -> list[str]:
        shared_memory = self.run_dir / "shm" / str(slot)
        for directory in (workspace, self.ipc_dir, shared_memory):
            directory.mkdir(parents=True, exist_ok=True)  # bwrap refuses a missing bind source
        spec = SandboxSpec(
            workspace=workspace,
            ipc_dir=self.ipc_dir,
            gpu_nodes=tuple(gpu_nodes[index] for index in sorted(gpu_nodes)),
            readonly_paths=self.readonly_paths,
            blob_dir=self.blob_dir,
            shared_memory_dir=shared_memory,
        )
        if argv[:1] == [sys.executable]:
            argv = [argv[0], *ZYGOTE_PYTHON_FLAGS, *argv[1:]]
        return [*sandbox_argv(spec, self.bwrap, self.environ), "--", *argv]


def zygote_launcher(settings: BrokerSettings, run_dir: Path) -> Unsandboxed | Bubblewrap:
    """The launcher for ``settings.sandbox``; checks once that bwrap runs here.

    Raises :class:`~kcoral.sandbox.bubblewrap.SandboxUnavailable`, saying how to fix it, when the
    sandbox was asked for and bwrap cannot run: never a silent fall-back.
    """
    if settings.sandbox == "none":
        return Unsandboxed()
    if settings.sandbox != "bubblewrap":
        raise ValueError(f"unknown sandbox {settings.sandbox!r}; expected 'bubblewrap' or 'none'")
    bwrap = check_bwrap()
    blob_dir = settings.cache_dir
    if blob_dir is not None:
        blob_dir.mkdir(parents=True, exist_ok=True)
        _hide_listing(blob_dir)
    return Bubblewrap(
        bwrap=bwrap,
        run_dir=run_dir,
        ipc_dir=run_dir / "ipc",
        blob_dir=blob_dir,
        readonly_paths=tuple(settings.sandbox_readonly_paths),
        environ=dict(os.environ),
    )


def _hide_listing(blob_dir: Path) -> None:
    """Make the blob cache unlistable inside the sandbox, where its owner is the sandbox's user.

    Only a broker running as root can afford it: root keeps listing the directory (its start-up
    scan does) through CAP_DAC_OVERRIDE, whereas an unprivileged broker would lock itself out.
    """
    if os.geteuid() != 0:
        log.warning(
            "blob_cache_listable",
            cache_dir=str(blob_dir),
            reason="the broker does not run as root, so programs can list /blobs (not only open known digests)",
        )
        return
    os.chmod(blob_dir, BLOB_DIR_MODE)


def slot_specs(
    settings: BrokerSettings,
    target: TargetInfo,
    run_dir: Path,
    connect: str,
    cgroups: SlotCgroups | None = None,
) -> list[SlotSpec]:
    """One slot per worker: ``workers_per_gpu`` on each leased GPU, or ``workers`` without GPUs;
    each a zygote command in its sandbox (checked once here: SandboxUnavailable otherwise).
    ``cgroups``: the slots' memory cgroups, each zygote given its own slot's descriptor."""
    launcher = zygote_launcher(settings, run_dir)
    if target.lease_gpus:
        per_gpu = slots_per_gpu(settings)
        placement: list[int | None] = [g for g in target.lease_gpus for _ in range(per_gpu)]
    else:
        placement = [None] * settings.workers
    # Every slot's sandbox holds every GPU's node; each worker keeps its program's (confinement).
    gpu_binds = launcher.gpu_binds(target)
    gpu_nodes = {index: str(bind.inside) for index, bind in sorted(gpu_binds.items())} or None
    specs: list[SlotSpec] = []
    for slot, gpu in enumerate(placement):
        workspace = run_dir / "slots" / str(slot)
        cgroup_fd = cgroups.fd(slot) if cgroups is not None else None
        zygote = ZygoteSettings(
            connect=connect,
            slot=slot,
            gpu=gpu,
            workspace=launcher.workspace_inside(workspace),
            max_programs=settings.max_programs_per_worker,
            preload=tuple(name for name in settings.preload.split(",") if name),
            limits=dict(settings.limits),
            gpu_nodes=gpu_nodes,
            sandboxed=launcher.sandboxed,
            # Fake GPUs have no device to make a context on.
            cuda_context=settings.cuda_context if not target.fake else "lazy",
            gpu_handover=settings.gpu_handover,
            memory_cgroup_fd=cgroup_fd,
        )
        argv = launcher.wrap(zygote_argv(zygote), slot=slot, workspace=workspace, gpu_nodes=gpu_binds)
        passed = (cgroup_fd,) if cgroup_fd is not None else ()
        specs.append(SlotSpec(slot, gpu, workspace, tuple(argv), pass_fds=passed))
    return specs


def zygote_argv(zygote: ZygoteSettings) -> list[str]:
    """The command that starts a zygote with these settings (outside any sandbox)."""
    return [sys.executable, "-m", ZYGOTE_MODULE, *zygote.to_argv()]
