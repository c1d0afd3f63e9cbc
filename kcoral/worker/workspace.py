"""A slot's workspace: emptied between programs, and measured against the workspace quota.

Both run in the zygote, the trusted side of the slot, on the host path the slot's workers write
under (``/workspace`` inside bubblewrap). Neither follows a symbolic link, so a link that a program
leaves pointing at another place is removed, never its target.

The quota (``--max-workspace-bytes``) is the disk space a program's files take (allocated blocks,
so a sparse file counts for what it really holds) plus a block per directory entry (an empty file
still costs an inode; a file with several names, its blocks once). Files a program deleted but
still holds open or mapped count too (:func:`kcoral.worker.limits.unlinked_file_bytes`, in the
zygote's sample): they take the same disk. It is checked by sampling, the same way under both
sandboxes, and the zygote kills the worker and everything it started when a sample is over: a
kernel quota would need a filesystem per slot (a size-limited tmpfs holds the files in RAM, and a
loop device or project quotas need privileges the broker may not have). A program can therefore
overshoot by what it writes between two samples; see
:data:`kcoral.worker.watchdog.WORKSPACE_SAMPLE_SECONDS`.

A program can also leave System V IPC objects (shared memory segments, semaphore sets, message
queues): they outlive every process, and the next program could attach to them. Where the slot has
an IPC namespace of its own (always inside bubblewrap; without a sandbox where the zygote may make
one) the zygote removes them all with the files (:func:`remove_ipc_objects`), and counts the
segments no process has attached against the memory limit (:func:`detached_segment_bytes`). Inside
bubblewrap the keys a program adds to its user, user-session or session keyring (the slot's: its
user namespace is the sandbox's, and every worker inherits the zygote's session keyring) are
cleared too (:func:`clear_keyrings`), and so are its POSIX message queues, which live in the IPC
namespace too: the sandbox mounts the namespace's mqueue filesystem at :data:`MESSAGE_QUEUES`,
where the zygote removes every queue (:func:`remove_message_queues`). Without a sandbox they stay:
listing them needs an mqueue filesystem of the slot's own namespace mounted, and the one at
``/dev/mqueue`` there is the host's.
"""

from __future__ import annotations

import ctypes
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
        remove_entry(entry)


def remove_entry(entry: Path) -> None:
    """Remove a file, a link (never its target) or a whole directory tree."""
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
    linked: set[tuple[int, int]] = set()  # files with several names (hard links) seen so far
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
                if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
                    if (info.st_dev, info.st_ino) in linked:
                        continue  # another name of a file counted already: its blocks are on disk once
                    linked.add((info.st_dev, info.st_ino))
                total += info.st_blocks * BLOCK_BYTES
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
    return WorkspaceUsage(total + entries * ENTRY_BYTES, entries, complete=True)


# --- the slot's System V IPC objects -------------------------------------------------------------

# /proc/sysvipc/<table>: a header, then one object a line; the column of its id.
SYSV_ID_COLUMNS = {"shm": "shmid", "sem": "semid", "msg": "msqid"}
IPC_RMID = 0
CLONE_NEWIPC = 0x08000000


# Once, at import: the zygote calls these after every program (a CDLL made per call cost dlopen,
# its object and each function looked up again, in a process whose pages its workers share).
_libc = ctypes.CDLL(None, use_errno=True)


# keyctl(2): the operation that unlinks every key of a keyring, and the keyrings a program shares
# with the programs after it in the slot (user, user-session, session).
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
KEYCTL_CLEAR = 7
SHARED_KEYRINGS = (-4, -5, -3)


def clear_keyrings() -> None:
    """Unlink every key of the keyrings this process shares with its workers. Only in a user
    namespace of the slot's own: the host user's keyrings hold other programs' keys."""
    if KEYCTL is None:
        return
    for keyring in SHARED_KEYRINGS:
        _libc.syscall(KEYCTL, KEYCTL_CLEAR, keyring)  # errors ignored: no such keyring, nothing to clear


def private_ipc_namespace() -> bool:
    """Enter an IPC namespace of our own; whether we could (it needs CAP_SYS_ADMIN)."""
    return bool(_libc.unshare(CLONE_NEWIPC) == 0)


def _ipc_rows(table: str) -> list[dict[str, str]]:
    try:
        with open(f"/proc/sysvipc/{table}") as handle:
            header, *lines = handle.read().splitlines()
    except (OSError, ValueError):
        return []
    names = header.split()
    return [dict(zip(names, line.split())) for line in lines]


def remove_ipc_objects() -> int:
    """Remove every System V IPC object of this process's IPC namespace; return how many went.
    Only for a namespace of the slot's own: in the host's it would take other programs' too."""
    removers = {
        "shm": lambda ident: _libc.shmctl(ident, IPC_RMID, None),
        "sem": lambda ident: _libc.semctl(ident, 0, IPC_RMID),
        "msg": lambda ident: _libc.msgctl(ident, IPC_RMID, None),
    }
    removed = 0
    for table, column in SYSV_ID_COLUMNS.items():
        for row in _ipc_rows(table):
            ident = row.get(column)
            if ident is not None and removers[table](int(ident)) == 0:
                removed += 1
    return removed


# Where the sandbox mounts the mqueue filesystem of the slot's IPC namespace (bwrap --mqueue).
MESSAGE_QUEUES = Path("/dev/mqueue")


def remove_message_queues(directory: Path = MESSAGE_QUEUES) -> int:
    """Remove every POSIX message queue in the mqueue filesystem at ``directory``; how many went.
    Only inside the sandbox, whose mount is the slot's own namespace's."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0  # not mounted here
    for name in names:
        try:
            os.unlink(directory / name)
        except OSError:
            continue
        removed += 1
    return removed


def detached_segment_bytes() -> int:
    """The memory of this IPC namespace's shared memory segments that no process has attached.
    (An attached one is in the Pss_Shmem of the processes that attached it.)"""
    return sum(int(row.get("rss", 0)) + int(row.get("swap", 0)) for row in _ipc_rows("shm") if row.get("nattch") == "0")


__all__ = [
    "ENTRY_BYTES",
    "MESSAGE_QUEUES",
    "WorkspaceUsage",
    "clear_keyrings",
    "detached_segment_bytes",
    "private_ipc_namespace",
    "remove_ipc_objects",
    "remove_message_queues",
    "remove_tree",
    "usage",
    "wipe",
]
