"""How the broker starts each zygote: inside bubblewrap, or as it is with ``--sandbox none``.

The broker knows a slot's workspace by its host path; a sandboxed zygote sees the same directory
at ``/workspace`` and is told that path (the broker hands paths to the zygote only on its command
line, so nothing else needs translating). What the sandbox holds is
:mod:`kcoral.sandbox.bubblewrap`'s business; this module supplies the broker's side of it: the bwrap
that was found to work, the ipc and blob cache directories, a shared-memory directory per slot,
and the interpreter flags of a sandboxed zygote.

Example::

    launcher = zygote_launcher(settings, run_dir)  # raises SandboxUnavailable when bwrap fails
    argv = zygote_command(..., workspace=launcher.workspace_inside(workspace))
    argv = launcher.wrap(argv, slot=0, workspace=workspace, gpu=None)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import structlog

from kcoral.sandbox.bubblewrap import WORKSPACE, SandboxSpec, check_bwrap, sandbox_argv

if TYPE_CHECKING:
    from kcoral.broker.broker import BrokerSettings

__all__ = ["Bubblewrap", "Unsandboxed", "zygote_launcher"]

log = structlog.get_logger("kcoral.sandbox")

# A program can kill its zygote (same uid), and the next zygote of the slot starts in the same
# workspace before wiping it. Its interpreter must therefore import nothing from there: -P keeps
# the working directory (/workspace, which ``python -m`` would put first on sys.path) off sys.path,
# -s the user site-packages (under HOME=/workspace/home, where a .pth file would run code).
ZYGOTE_PYTHON_FLAGS: Final = ("-s", "-P")
# The blob cache as the sandbox sees it: enterable, not listable. A program opens the blobs whose
# digests it was given, and cannot enumerate other clients' uploads. Group and others get nothing.
BLOB_DIR_MODE: Final = 0o311


class Unsandboxed:
    """``--sandbox none``: the zygote runs as the broker's child, with the host's view."""

    def workspace_inside(self, workspace: Path) -> Path:
        return workspace

    def wrap(self, argv: list[str], *, slot: int, workspace: Path, gpu: int | None) -> list[str]:
        return argv


@dataclass(frozen=True)
class Bubblewrap:
    """``--sandbox bubblewrap``: each zygote in its own sandbox (see :mod:`kcoral.sandbox.bubblewrap`)."""

    bwrap: Path
    run_dir: Path
    ipc_dir: Path
    blob_dir: Path | None
    readonly_paths: tuple[Path, ...]
    environ: Mapping[str, str]

    def workspace_inside(self, workspace: Path) -> Path:
        return WORKSPACE

    def wrap(self, argv: list[str], *, slot: int, workspace: Path, gpu: int | None) -> list[str]:
        shared_memory = self.run_dir / "shm" / str(slot)
        for directory in (workspace, self.ipc_dir, shared_memory):
            directory.mkdir(parents=True, exist_ok=True)  # bwrap refuses a missing bind source
        spec = SandboxSpec(
            workspace=workspace,
            ipc_dir=self.ipc_dir,
            gpu_indices=(gpu,) if gpu is not None else (),
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
