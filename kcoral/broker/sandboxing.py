"""How the broker wraps each zygote's command: in bubblewrap, or as it is with ``--sandbox none``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kcoral.worker.sandbox import SandboxSpec, check_bwrap, sandbox_argv

if TYPE_CHECKING:
    from kcoral.broker.broker import BrokerSettings


def wrap_in_sandbox(
    settings: BrokerSettings,
    argv: list[str],
    workspace: Path,
    ipc_dir: Path,
    gpu: int | None,
    fake: int,
) -> tuple[list[str], dict[str, str] | None]:
    """The zygote's full argv and environment for this broker's sandbox setting."""
    if settings.sandbox == "none":
        return argv, None
    bwrap = check_bwrap()
    workspace.mkdir(parents=True, exist_ok=True)
    ipc_dir.mkdir(parents=True, exist_ok=True)
    spec = SandboxSpec(
        workspace=workspace,
        ipc_dir=ipc_dir,
        gpu_indices=(gpu,) if gpu is not None and not fake else (),
        readonly_paths=tuple(settings.sandbox_readonly_paths),
        blob_dir=settings.cache_dir,
    )
    inner = [a.replace(str(workspace), "/workspace") for a in argv]
    return [*sandbox_argv(spec, bwrap, os.environ), *inner], None
