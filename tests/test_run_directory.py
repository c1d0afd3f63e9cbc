"""A reused worker's run directory (kcoral.worker.run_directory): the next program finds the
workspace as a fresh worker would (one run directory of its own name, its subdirectories empty,
with the mode, extended attributes and inode flags they were made with), and whatever a program
did to them that cannot be put back gets it new directories instead."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from kcoral.worker import run_directory
from kcoral.worker.capture import OUTPUT_FILE_MODE, OUTPUT_FILES, OutputCapture, prepare_output_files
from kcoral.worker.run_directory import OUTPUT_DIRECTORY, READY_NAME, SUBDIRECTORIES, RunDirectory, leftovers

FS_NODUMP_FL = 0x40  # chattr +d: an inode flag a file's owner may set


def state(run_dir: Path) -> dict[str, tuple[int, int, list[str], dict[str, bytes], int | None, int]]:
    """Each directory's inode, mode, entries, extended attributes, flags and modification time."""
    found = {}
    for name in ("", *SUBDIRECTORIES):
        path = run_dir / name
        info = os.lstat(path)
        found[name] = (
            info.st_ino,
            stat.S_IMODE(info.st_mode),
            sorted(os.listdir(path)),
            run_directory._xattrs(path),
            run_directory._flags(path),
            info.st_mtime_ns,
        )
    return found


def first_program(tmp_path: Path) -> tuple[RunDirectory, Path, dict[str, tuple]]:
    directories = RunDirectory(tmp_path)
    run_dir = tmp_path / "run-first"
    directories.make(run_dir)
    return directories, run_dir, state(run_dir)


def test_the_next_program_gets_the_emptied_directories_under_its_own_name(tmp_path: Path) -> None:
    directories, run_dir, made = first_program(tmp_path)
    (run_dir / "work" / "data").mkdir()
    (run_dir / "work" / "data" / "x.txt").write_text("left by the first program")
    (run_dir / "home" / ".cache").write_text("x")
    (run_dir / "output" / "stdout").write_text("printed")
    (run_dir / "modules").mkdir()
    (tmp_path / "beside.txt").write_text("outside its run directory")
    os.symlink("/etc", tmp_path / "link")
    os.chmod(run_dir / "tmp", 0)  # closed to its owner too
    os.chmod(run_dir / "work", 0o2700)
    directories.wipe(run_dir)
    assert directories.kept == run_dir
    assert os.listdir(tmp_path) == ["run-first"]

    second = tmp_path / "run-second"
    directories.make(second)
    assert os.listdir(tmp_path) == ["run-second"]
    assert state(second) == made  # the same directories, emptied, as they were made


def test_extended_attributes_and_inode_flags_are_put_back(tmp_path: Path) -> None:
    directories, run_dir, made = first_program(tmp_path)
    try:
        os.setxattr(run_dir / "home", "user.kcoral-test", b"from the first program")
    except OSError:
        pytest.skip("no user extended attributes on this filesystem")
    with contextlib.suppress(OSError):  # where the filesystem has inode flags
        flags = run_directory._flags(run_dir / "work")
        if flags is not None:
            run_directory._set_flags(run_dir / "work", flags | FS_NODUMP_FL)
    directories.wipe(run_dir)
    directories.make(tmp_path / "run-second")
    assert state(tmp_path / "run-second") == made


@pytest.mark.parametrize("replace", ["a link", "a file", "a new directory"])
def test_a_subdirectory_replaced_means_new_directories(tmp_path: Path, replace: str) -> None:
    directories, run_dir, made = first_program(tmp_path)
    target = tmp_path.parent / f"{tmp_path.name}-target"
    target.mkdir()
    (target / "keep.txt").write_text("not the program's to have removed")
    os.rename(run_dir / "tmp", run_dir / "tmp-old")
    if replace == "a link":
        os.symlink(target, run_dir / "tmp")
    elif replace == "a file":
        (run_dir / "tmp").write_text("x")
    else:
        (run_dir / "tmp").mkdir()
    directories.wipe(run_dir)
    assert directories.kept is None
    assert os.listdir(tmp_path) == []  # wiped as a fresh worker's, the link's target left alone
    assert (target / "keep.txt").read_text() == "not the program's to have removed"

    directories.make(tmp_path / "run-second")
    now = state(tmp_path / "run-second")
    # (made anew: ext4 may give them the inode numbers it just freed)
    assert {name: entry[1:5] for name, entry in now.items()} == {name: entry[1:5] for name, entry in made.items()}


def test_a_last_program_keeps_nothing(tmp_path: Path) -> None:
    directories = RunDirectory(tmp_path)
    directories.make(tmp_path / "run-last", keep=False)
    directories.wipe(tmp_path / "run-last")
    assert directories.kept is None and os.listdir(tmp_path) == []


# --- the zygote's run directory for its next fresh worker -------------------------------------------


def zygote_made(tmp_path: Path) -> tuple[RunDirectory, dict[str, tuple]]:
    keeper = RunDirectory(tmp_path, take_ready=False)
    keeper.make(tmp_path / READY_NAME)
    return keeper, state(tmp_path / READY_NAME)


def test_a_fresh_worker_takes_the_zygote_s_directory_and_the_zygote_makes_it_ready_again(tmp_path: Path) -> None:
    keeper, made = zygote_made(tmp_path)
    worker = RunDirectory(tmp_path)  # a fresh worker's, its first program
    run_dir = tmp_path / "run-first"
    worker.make(run_dir, keep=False)
    assert os.listdir(tmp_path) == ["run-first"]
    assert state(run_dir) == made  # the same directories, emptied, with the times they were made with
    (run_dir / "work" / "result.bin").write_bytes(b"x" * 4096)
    (run_dir / "output" / "stdout").write_text("printed")
    (tmp_path / "beside").mkdir()
    assert keeper.find_made() == run_dir  # by its inode, under the program's name
    keeper.wipe(run_dir)
    keeper.make(tmp_path / READY_NAME)
    assert os.listdir(tmp_path) == [READY_NAME]
    assert state(tmp_path / READY_NAME) == made


def test_a_directory_the_program_replaced_or_grew_is_not_handed_on(tmp_path: Path) -> None:
    keeper, _ = zygote_made(tmp_path)
    run_dir = tmp_path / "run-first"
    RunDirectory(tmp_path).make(run_dir)
    os.rename(run_dir, tmp_path / "elsewhere")
    os.rename(tmp_path / "elsewhere", tmp_path / "run-first-moved")
    (tmp_path / "run-first-moved" / "work" / "inner").mkdir()
    os.rename(tmp_path / "run-first-moved", tmp_path / "run-first-moved-again")
    os.makedirs(tmp_path / "deeper")
    os.rename(tmp_path / "run-first-moved-again", tmp_path / "deeper" / "hidden")
    assert keeper.find_made() is None  # not in the workspace's top level: the zygote wipes it all
    # A directory grown by many entries keeps its size once emptied (ext4): never handed on.
    keeper, _ = zygote_made(tmp_path / "second")
    work = tmp_path / "second" / READY_NAME / "work"
    for number in range(3000):
        (work / f"a-long-name-for-a-file-{number:06d}").touch()
    if os.lstat(work).st_size <= os.lstat(tmp_path / "second" / READY_NAME / "home").st_size:
        pytest.skip("this filesystem's directories do not grow with their entries")
    keeper.wipe(tmp_path / "second" / READY_NAME)
    assert keeper.kept is None
    keeper.make(tmp_path / "second" / READY_NAME)
    assert os.lstat(work).st_size == os.lstat(tmp_path / "second" / READY_NAME / "home").st_size  # made anew


def test_a_taken_directory_missing_a_subdirectory_gets_it_and_a_file_in_its_place_fails(tmp_path: Path) -> None:
    keeper = RunDirectory(tmp_path, take_ready=False)
    keeper.make(tmp_path / READY_NAME)
    os.rmdir(tmp_path / READY_NAME / "tmp")
    RunDirectory(tmp_path).make(tmp_path / "run-a", keep=False)
    assert sorted(os.listdir(tmp_path / "run-a")) == sorted(SUBDIRECTORIES)

    os.rename(tmp_path / "run-a", tmp_path / READY_NAME)
    os.rmdir(tmp_path / READY_NAME / "home")
    (tmp_path / READY_NAME / "home").write_text("not a directory")
    with pytest.raises(FileExistsError):
        RunDirectory(tmp_path).make(tmp_path / "run-b", keep=False)


def test_output_files_made_ahead_hold_only_what_the_program_writes(tmp_path: Path) -> None:
    ready = tmp_path / READY_NAME / OUTPUT_DIRECTORY
    ready.mkdir(parents=True)
    prepare_output_files(ready)
    assert sorted(os.listdir(ready)) == sorted(OUTPUT_FILES)
    assert all(stat.S_IMODE(os.lstat(ready / name).st_mode) == OUTPUT_FILE_MODE for name in OUTPUT_FILES)
    (ready / OUTPUT_FILES[0]).write_text("stale, from before")
    # In a child: the capture takes fds 1 and 2 (and leaves them on /dev/null), which this test
    # process's runner needs.
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(reader)
            capture = OutputCapture(ready, limit=10)
            with capture:
                os.write(1, b"fresh")
                os.write(2, b"0123456789abc")
            output = capture.read()
            report = [output.stdout, output.stdout_truncated, output.stderr, output.stderr_truncated]
            os.write(writer, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        report = json.loads(pipe.read() or b"null")
    assert os.waitpid(pid, 0)[1] == 0
    assert report == ["fresh", False, "0123456789", True]


def test_a_clean_slot_holds_only_the_next_workers_directory_and_anything_else_is_named(tmp_path: Path) -> None:
    zygote_made(tmp_path)
    prepare_output_files(tmp_path / READY_NAME / OUTPUT_DIRECTORY)
    (tmp_path / ".shm").mkdir()  # a sandbox's mount point
    assert leftovers(tmp_path, besides=(".shm",)) == []
    assert leftovers(tmp_path) == [".shm"]
    ready = tmp_path / READY_NAME
    (ready / OUTPUT_DIRECTORY / OUTPUT_FILES[1]).write_text("written before the wipe")
    (ready / "tmp" / "left.bin").write_bytes(b"x")
    (ready / "extra").mkdir()
    (tmp_path / "run-0123").mkdir()
    assert leftovers(tmp_path, besides=(".shm",)) == [
        "run-0123",
        f"{READY_NAME}/extra",
        f"{READY_NAME}/output/stderr",
        f"{READY_NAME}/tmp/left.bin",
    ]
    shutil.rmtree(ready)
    ready.symlink_to(tmp_path / "run-0123")
    assert leftovers(tmp_path, besides=(".shm",)) == ["run-0123", f"{READY_NAME} (not a directory)"]
