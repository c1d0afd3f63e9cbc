"""A slot's workspace: emptied between programs, and measured against the workspace quota.

Both run in the zygote, the trusted side of the slot, on the host path the slot's workers write
under (``/workspace`` inside bubblewrap). Neither follows a symbolic link, so a link that a program
leaves pointing at another place is removed, never its target.

The quota (``--max-workspace-bytes``) is the disk space a program's files take (allocated blocks,
so a sparse file counts for what it really holds) plus a block per directory entry (an empty file
still costs an inode). It is checked by sampling, the same way under both sandboxes, and the zygote
kills the worker and everything it started when a sample is over: a kernel quota would need a
filesystem per slot (a size-limited tmpfs holds the files in RAM, and a loop device or project
quotas need privileges the broker may not have). A program can therefore overshoot by what it
writes between two samples; see :data:`kcoral.worker.zygote.WORKSPACE_SAMPLE_SECONDS`.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

ENTRY_BYTES = 4096  # what an entry costs at least: one inode and one block on common filesystems
BLOCK_BYTES = 512  # the unit of st_blocks


@dataclass(frozen=True)
class WorkspaceUsage:
    bytes: int  # allocated bytes, plus ENTRY_BYTES per entry
    entries: int
    complete: bool  # False when the walk stopped at the entry bound


def wipe(directory: Path) -> None:
    """Empty the slot's workspace, including directories a program made unreadable (mode 0),
    which a plain rmtree would leave behind for the next program to open again."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
        else:
            try:
                entry.unlink()
            except OSError:
                pass


def remove_tree(path: Path) -> None:
    """rmtree that first makes every directory of the tree accessible again (top down)."""
    pending = [path]
    while pending:
        current = pending.pop()
        try:
            os.chmod(current, stat.S_IRWXU)
            with os.scandir(current) as entries:
                pending.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


def usage(directory: Path, most_entries: int) -> WorkspaceUsage:
    """What ``directory`` holds, counted as the quota counts it; stop after ``most_entries``.

    A directory the program made unreadable is made readable again (by its owner, which the
    zygote is) rather than skipped: hiding files from the count must not work.
    """
    total = 0
    entries = 0
    pending = [str(directory)]
    while pending:
        current = pending.pop()
        try:
            scan = os.scandir(current)
        except PermissionError:
            try:
                os.chmod(current, stat.S_IRWXU)
                scan = os.scandir(current)
            except OSError:
                continue
        except OSError:
            continue
        with scan:
            for entry in scan:
                entries += 1
                if entries > most_entries:
                    return WorkspaceUsage(total + entries * ENTRY_BYTES, entries, complete=False)
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += info.st_blocks * BLOCK_BYTES
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
    return WorkspaceUsage(total + entries * ENTRY_BYTES, entries, complete=True)


__all__ = ["ENTRY_BYTES", "WorkspaceUsage", "remove_tree", "usage", "wipe"]
