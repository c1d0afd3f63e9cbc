"""A reused worker's run directory: emptied in place between its programs instead of removed and
made again.

Every program runs in ``run-<request_id>`` under the slot's workspace, with ``work`` (its working
directory), ``home``, ``tmp`` and ``output`` (its captured stdout and stderr) inside. A worker that
runs one program makes them and leaves them to the zygote's wipe after its exit. A worker that runs
several (its client's session, ``--max-programs-per-worker``) must hand the next program a
workspace as a fresh worker finds it, and removing the five directories to make them again cost
more than the rest of a constant program: ``rmdir`` of an empty directory took 0.1 ms on the quiet
2-core VM and 2 ms under the other engineers' disk load, against 0.01 ms to unlink an empty file
(ext4, which puts every removed directory on its orphan list; ``benchmarks/RESULTS.md``, "Where a
constant program's time goes"). So after each program its run directory keeps those five
directories, emptied, and the next program gets them renamed to its own ``run-<request_id>``: the
same entries, names and contents as new ones.

A directory is kept only while it is still the one made (same inode, a directory, not a link, same
owner), and only once its mode, its extended attributes (ACLs among them: a default ACL would reach
every file the next program makes) and its inode flags (``chattr``'s: a synchronous-updates flag
would slow every later write) and its access and modification times are back to what they were
when made. Anything else, or anything that cannot be emptied, and the whole workspace is wiped as
before, the next program getting new directories. What a kept directory still shows is its inode
number and a change time of the wipe's: within one worker, whose programs are one client's (a
session) or, with ``--max-programs-per-worker``, the operator's choice of one process for several.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from kcoral.worker import workspace as workspace_files
from kcoral.worker.capture import OUTPUT_FILES

OUTPUT_DIRECTORY = "output"  # the program's captured stdout and stderr (kcoral.worker.capture)
SUBDIRECTORIES = ("work", "home", "tmp", OUTPUT_DIRECTORY)
# The run directory the zygote hands the slot's next worker, emptied, under this name: the worker
# renames it to its program's own (RunDirectory.make).
READY_NAME = "run-ready"
_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h, _IOR('f', 1, long); the kernel reads and writes an int
_FS_IOC_SETFLAGS = 0x40086602


@dataclass(frozen=True)
class _Made:
    """What a directory of the run directory was when it was made."""

    device: int
    inode: int
    uid: int
    gid: int
    mode: int
    times_ns: tuple[int, int]  # access and modification
    size: int  # a directory's size: on ext4 it grows with its entries and never shrinks
    xattrs: dict[str, bytes]
    flags: int | None  # None: the filesystem has no inode flags


class RunDirectory:
    """The run directory of a worker's programs: made for the first, kept for the next ones.

    ``make(run_dir)`` before a program gives it its directories (the first one of a worker, the
    zygote's READY_NAME where it is there); ``wipe(run_dir)`` after it empties the slot's
    workspace, keeping the run directory for the next ``make`` when it can. The zygote keeps one
    too (``take_ready`` false): after each worker it finds the directory it made
    (:meth:`find_made`), under the program's name, empties it the same way and makes it
    READY_NAME again for the next worker.
    """

    def __init__(self, workspace: Path, *, take_ready: bool = True) -> None:
        self.workspace = workspace
        self.take_ready = take_ready  # a worker's first program takes the zygote's READY_NAME
        self._kept: Path | None = None
        self._made: dict[str, _Made] = {}

    @property
    def kept(self) -> Path | None:
        """The emptied run directory that the next program gets, or None."""
        return self._kept

    def make(self, run_dir: Path, *, keep: bool = True) -> None:
        """``run_dir`` and its subdirectories, for the program about to run; ``keep``: noted as made,
        to be kept after it (not for a worker's last program, whose workspace the zygote wipes)."""
        kept, self._kept = self._kept, None
        times_ns = self._made[""].times_ns if kept is not None else (0, 0)
        if kept is None and not self._made and (ready := self._ready()) is not None:
            kept, times_ns = ready
        if kept is not None and kept != run_dir:
            try:
                os.rename(kept, run_dir)
                # (ext4 stamps a renamed directory's modification time)
                os.utime(run_dir, ns=times_ns, follow_symlinks=False)
            except OSError:
                workspace_files.wipe(self.workspace)
                kept = None
        if kept is None:
            self._made = {}
            for name in ("", *SUBDIRECTORIES):
                (run_dir / name).mkdir(parents=True, exist_ok=True)
        else:
            # Emptied and checked as made: a subdirectory is made only where it is missing, from one
            # listing (five mkdir calls that fail walked a fresh worker's cold path for 0.2 ms on the
            # 2-core VM). An entry of that name that is no directory fails the mkdir, as before.
            with os.scandir(run_dir) as entries:
                present = {entry.name for entry in entries if entry.is_dir(follow_symlinks=False)}
            for name in SUBDIRECTORIES:
                if name not in present:
                    os.mkdir(run_dir / name)
        if keep and not self._made:  # as made, once all are (each subdirectory changes the run directory)
            self._made = {name: _describe(run_dir / name) for name in ("", *SUBDIRECTORIES)}

    def _ready(self) -> tuple[Path, tuple[int, int]] | None:
        """The zygote's emptied run directory (READY_NAME) for this worker's first program, and its
        times; None where there is none to take. Only the directory itself is looked at:
        the zygote made it ready after every process of the slot's last program had gone, and
        nothing but this worker has run in the slot since (a missing subdirectory is made)."""
        if not self.take_ready:
            return None
        ready = self.workspace / READY_NAME
        try:
            now = os.lstat(ready)
        except OSError:
            return None
        if not stat.S_ISDIR(now.st_mode):
            return None
        return ready, (now.st_atime_ns, now.st_mtime_ns)

    def find_made(self) -> Path | None:
        """The entry of the workspace that is the run directory this keeper made (the worker
        renamed it to its program's), or None."""
        made = self._made.get("")
        if made is None:
            return None
        try:
            with os.scandir(self.workspace) as entries:
                for entry in entries:
                    now = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == (made.device, made.inode):
                        return Path(entry.path)
        except OSError:
            return None
        return None

    def wipe(self, run_dir: Path) -> None:
        """Empty the slot's workspace after the program that ran in ``run_dir``, keeping that
        directory (emptied, as made) for the next program when nothing in it stands in the way."""
        if self._empty_in_place(run_dir):
            self._kept = run_dir
            for entry in self.workspace.iterdir():
                if entry != run_dir:
                    workspace_files.remove_entry(entry)
        else:
            self._kept = None
            self._made = {}
            workspace_files.wipe(self.workspace)

    def _empty_in_place(self, run_dir: Path) -> bool:
        if set(self._made) != {"", *SUBDIRECTORIES}:
            return False
        try:
            for name in ("", *SUBDIRECTORIES):
                path = run_dir / name
                made = self._made[name]
                now = os.lstat(path)
                if not stat.S_ISDIR(now.st_mode) or (now.st_dev, now.st_ino, now.st_uid, now.st_gid) != (
                    made.device,
                    made.inode,
                    made.uid,
                    made.gid,
                ):
                    return False
                if stat.S_IMODE(now.st_mode) & stat.S_IRWXU != stat.S_IRWXU:
                    os.chmod(path, stat.S_IRWXU)  # a directory the program closed to its owner
                keep = set(SUBDIRECTORIES) if name == "" else set()
                with os.scandir(path) as entries:
                    for entry in [e for e in entries if e.name not in keep]:
                        workspace_files.remove_entry(Path(entry.path))
                if set(os.listdir(path)) != keep or os.lstat(path).st_size > made.size:
                    return False  # (a directory grown by a million entries stays that large)
                if not _put_back(path, made):
                    return False
        except OSError:
            return False
        return True


def leftovers(workspace: Path, *, besides: Collection[str] = ()) -> list[str]:
    """What a slot's workspace holds beyond a clean slot, sorted: a clean one holds only the
    zygote's READY_NAME for the next worker, its four directories empty but for the two empty
    output files made ahead (:func:`kcoral.worker.capture.prepare_output_files`). Entries named in
    ``besides`` (a sandbox's mount points) are not counted."""
    left = [p.name for p in workspace.iterdir() if p.name not in besides and p.name != READY_NAME]
    ready = workspace / READY_NAME
    if ready.is_symlink() or (ready.exists() and not ready.is_dir()):
        return sorted([*left, f"{READY_NAME} (not a directory)"])
    if ready.is_dir():
        left += [
            f"{READY_NAME}/{p.name}" for p in ready.iterdir() if p.name not in SUBDIRECTORIES or not _a_directory(p)
        ]
        left += [
            f"{READY_NAME}/{name}/{p.name}"
            for name in SUBDIRECTORIES
            if _a_directory(ready / name)
            for p in (ready / name).iterdir()
            if not (name == OUTPUT_DIRECTORY and _made_ahead(p))
        ]
    return sorted(left)


def _a_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _made_ahead(path: Path) -> bool:
    """An output file as the zygote makes it for the next worker: regular and empty."""
    return path.name in OUTPUT_FILES and not path.is_symlink() and path.is_file() and path.stat().st_size == 0


def _describe(path: Path) -> _Made:
    now = os.lstat(path)
    return _Made(
        device=now.st_dev,
        inode=now.st_ino,
        uid=now.st_uid,
        gid=now.st_gid,
        mode=stat.S_IMODE(now.st_mode),
        times_ns=(now.st_atime_ns, now.st_mtime_ns),
        size=now.st_size,
        xattrs=_xattrs(path),
        flags=_flags(path),
    )


def _put_back(path: Path, made: _Made) -> bool:
    """Give ``path`` the extended attributes, inode flags, mode and times it was made with; whether
    it has them."""
    xattrs = _xattrs(path)
    if xattrs != made.xattrs:
        for name in xattrs.keys() - made.xattrs.keys():
            os.removexattr(path, name, follow_symlinks=False)
        for name, value in made.xattrs.items():
            if xattrs.get(name) != value:
                os.setxattr(path, name, value, follow_symlinks=False)
        if _xattrs(path) != made.xattrs:
            return False
    flags = _flags(path)
    if flags != made.flags:
        if made.flags is None or flags is None:
            return False
        _set_flags(path, made.flags)
        if _flags(path) != made.flags:
            return False
    if stat.S_IMODE(os.lstat(path).st_mode) != made.mode:
        os.chmod(path, made.mode)
    os.utime(path, ns=made.times_ns, follow_symlinks=False)
    now = os.lstat(path)
    return stat.S_IMODE(now.st_mode) == made.mode and (now.st_atime_ns, now.st_mtime_ns) == made.times_ns


def _xattrs(path: Path) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}  # a filesystem without extended attributes
    return {name: os.getxattr(path, name, follow_symlinks=False) for name in names}


def _flags(path: Path) -> int | None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        raw = fcntl.ioctl(descriptor, _FS_IOC_GETFLAGS, bytes(8))
    except OSError:
        return None  # no inode flags here (tmpfs on older kernels, overlayfs)
    finally:
        os.close(descriptor)
    return int(struct.unpack("i", raw[:4])[0])


def _set_flags(path: Path, flags: int) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        with contextlib.suppress(OSError):
            fcntl.ioctl(descriptor, _FS_IOC_SETFLAGS, struct.pack("i", flags) + bytes(4))
    finally:
        os.close(descriptor)
