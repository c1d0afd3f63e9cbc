"""What a program gives back: ProgramResult, ReturnedFile and ReturnedFolder."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcoral.protocol import check_relative_path


@dataclass(frozen=True)
class ReturnedFile:
    """A file that a program returned with ``return_file``."""

    name: str
    data: bytes = field(repr=False)
    mode: int = 0o644

    def read_bytes(self) -> bytes:
        return self.data

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the file to ``path``; refuses to replace an existing file unless ``overwrite``."""
        dest = Path(path)
        if dest.exists() and not overwrite:
            raise FileExistsError(f"{dest} exists; pass overwrite=True to replace it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.kcoral-tmp")
        tmp.write_bytes(self.data)
        os.chmod(tmp, self.mode & 0o755 or 0o644)
        os.replace(tmp, dest)
        return dest


@dataclass(frozen=True)
class ReturnedFolder:
    """A folder that a program returned with ``return_folder``: relative path -> file."""

    files: dict[str, ReturnedFile] = field(repr=False)

    def __iter__(self) -> Any:
        return iter(sorted(self.files))

    def __len__(self) -> int:
        return len(self.files)

    def read_bytes(self, path: str) -> bytes:
        return self.files[check_relative_path(path)].data

    def save(self, dest: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Create ``dest`` as the folder, holding the returned files."""
        root = Path(dest)
        if root.exists() and (not root.is_dir() or any(root.iterdir())) and not overwrite:
            raise FileExistsError(f"{root} exists and is not an empty folder")
        root.mkdir(parents=True, exist_ok=True)
        for rel, returned in self.files.items():
            returned.save(root / check_relative_path(rel), overwrite=overwrite)
        return root


@dataclass
class ProgramResult:
    """The outcome of one program. A failed program is data: ``status == "FAILED"`` and ``error``
    says which instruction failed and why; results returned before the failure are kept."""

    status: str
    results: dict[str, Any]
    error: dict[str, Any] | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    request_id: str
    queue_ms: float
    elapsed_ms: float
    lease_wait_ms: float
    lease_held_ms: float
    gpu_ids: list[int]
    worker: dict[str, Any] = field(default_factory=dict)
    node_id: str | None = None  # the host that ran the program, when it came through a router
    # Where, on what and under which conditions it ran (docs/protocol.md, section 8, "Provenance").
    provenance: dict[str, Any] = field(default_factory=dict)
    # Wall-clock times (s since the epoch) of its way through the broker: received_at, queued_at,
    # started_at (sent to its worker), result_at; with ``worker["program_at"]`` and
    # ``worker["finished_at"]``, where its time went (benchmarks/overhead.py --phases).
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.status == "COMPLETED"

    def __repr__(self) -> str:
        what = (
            f"error={self.error.get('kind')}:{self.error.get('message')!r}"
            if self.error
            else (f"results={sorted(self.results)}")
        )
        return f"ProgramResult(status={self.status!r}, {what}, request_id={self.request_id!r})"
