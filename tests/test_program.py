"""The Program builder: every mistake raises at once, before anything is sent; to_wire's content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kcoral import Program, protocol
from kcoral.client.program import Ref
from kcoral.protocol import check_relative_path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def module(program: Program, source: str = "def f(*a):\n    return a\n") -> Ref:
    return program.upload(kind="module", source=source)


# --- ids and references --------------------------------------------------------------------------


def test_generated_ids_are_op_and_index() -> None:
    program = Program()
    mod = module(program)
    fn = program.get_function(module=mod, name="f")
    out = program.run(fn=fn, args=[1])
    program.return_(key="out", value=out)
    program.return_file(key="file", path="a.txt")
    program.return_folder(key="folder", path="d")
    path = program.upload_file(blob=b"x", path="a.txt")
    assert [mod.id, fn.id, out.id, path.id] == ["upload_0", "get_function_1", "run_2", "upload_file_6"]
    assert [i["id"] for i in program.instructions] == [
        "upload_0",
        "get_function_1",
        "run_2",
        "return_3",
        "return_file_4",
        "return_folder_5",
        "upload_file_6",
    ]
    assert len(program) == 7
    assert repr(mod) == "Ref('upload_0')"


def test_explicit_ids() -> None:
    program = Program()
    mod = program.upload(id="kernels.v2:main-1", kind="module", source="")
    assert mod.id == "kernels.v2:main-1"
    with pytest.raises(ValueError, match="duplicate instruction id"):
        program.upload(id="kernels.v2:main-1", kind="bytes", value=b"")
    for bad in ("", "a b", "a/b", "x" * 201, "id\n"):
        with pytest.raises(ValueError, match="bad id"):
            program.upload(id=bad, kind="bytes", value=b"")
    # a generated id steps around an explicit one that took its name
    program.upload(id="upload_1", kind="bytes", value=b"")
    program2 = Program()
    program2.upload(id="upload_1", kind="bytes", value=b"")
    assert program2.upload(kind="bytes", value=b"").id == "upload_1_"
    assert len(program) == 2  # the refused calls added nothing


def test_references_must_come_from_this_program() -> None:
    program, other = Program(), Program()
    foreign = module(other)
    with pytest.raises(ValueError, match="another Program"):
        program.get_function(module=foreign, name="f")
    mod = module(program)
    fn = program.get_function(module=mod, name="f")
    with pytest.raises(ValueError, match="another Program"):
        program.run(fn=fn, args=[foreign])
    with pytest.raises(ValueError, match="another Program"):
        program.return_(key="k", value={"nested": [foreign]})
    with pytest.raises(TypeError, match="must be a reference"):
        program.run(fn="get_function_1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a reference"):
        program.get_function(module="upload_0", name="f")  # type: ignore[arg-type]
    forged = Ref("run_9", "run", fn._program)
    with pytest.raises(ValueError, match="no earlier instruction"):
        program.run(fn=forged)
    # A reference outlives its Program; a new Program at the same address must still refuse it.
    for _ in range(20):
        orphan = module(Program())
        with pytest.raises(ValueError, match="another Program"):
            Program().get_function(module=orphan, name="f")
    with pytest.raises(ValueError, match="must be an upload or a run"):
        program.get_function(module=fn, name="f")
    assert len(program) == 2


def test_references_in_args_and_returns_become_ref_values() -> None:
    program = Program()
    mod = module(program)
    fn = program.get_function(module=mod, name="f")
    out = program.run(fn=fn, args=[mod, [fn, {"k": (3, mod)}]])
    program.return_(key="out", value=out)
    run, ret = program.instructions[2], program.instructions[3]
    R = protocol.RefValue
    assert run["args"] == [R("upload_0"), [R("get_function_1"), {"k": (3, R("upload_0"))}]]
    assert ret == {"op": "return", "id": "return_3", "key": "out", "value": R("run_2")}


# --- names, keys and arguments -------------------------------------------------------------------


def test_get_function_checks_its_name_and_flag() -> None:
    program = Program()
    mod = module(program)
    for bad in ("", "1abc", "a-b", "a..b", ".a"):
        with pytest.raises(ValueError):
            program.get_function(module=mod, name=bad)
    with pytest.raises(TypeError, match="cpu_only"):
        program.get_function(module=mod, name="f", cpu_only=1)  # type: ignore[arg-type]
    fn = program.get_function(module=mod, name="Model.forward", cpu_only=True)
    assert program.instructions[fn_index(program, fn)] == {
        "op": "get_function",
        "id": fn.id,
        "module": "upload_0",
        "name": "Model.forward",
        "cpu_only": True,
    }


def fn_index(program: Program, ref: Ref) -> int:
    return [i["id"] for i in program.instructions].index(ref.id)


def test_return_keys_are_non_empty_and_unique() -> None:
    program = Program()
    program.return_(key="a", value=1)
    with pytest.raises(ValueError, match="duplicate return key"):
        program.return_file(key="a", path="x")
    with pytest.raises(ValueError, match="non-empty"):
        program.return_(key="", value=1)
    with pytest.raises(ValueError, match="non-empty"):
        program.return_folder(key=None, path="x")  # type: ignore[arg-type]
    assert len(program) == 1


def test_run_args() -> None:
    program = Program()
    fn = program.get_function(module=module(program), name="f")
    with pytest.raises(TypeError, match="must be a list"):
        program.run(fn=fn, args="abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot send"):
        program.run(fn=fn, args=[object()])
    with pytest.raises(TypeError, match="64 bits"):
        program.run(fn=fn, args=[1 << 70])
    deep: Any = 0
    for _ in range(protocol.MAX_NESTING + 2):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        program.run(fn=fn, args=[deep])
    out = program.run(fn=fn)
    assert program.instructions[-1]["args"] == [] and out.id == "run_2"
    # numpy scalars are sent as plain numbers (the body is packed with strict types)
    program.run(fn=fn, args=(np.float64(0.5), np.int32(2), b"raw"))
    assert program.instructions[-1]["args"] == [0.5, 2, b"raw"]
    assert [type(a) for a in program.instructions[-1]["args"]] == [float, int, bytes]


def test_tensors_in_args_travel_as_blobs() -> None:
    program = Program()
    fn = program.get_function(module=module(program), name="f")
    array = np.arange(4, dtype=np.float32)
    program.run(fn=fn, args=[{"x": array}])
    spec = program.instructions[-1]["args"][0]["x"]
    assert spec == protocol.TensorSpec("numpy", "float32", (4,), sha(array.tobytes()))
    _, blobs = program.to_wire()
    assert bytes(blobs[spec.source]) == array.tobytes()


# --- uploads -------------------------------------------------------------------------------------


def test_upload_kinds_and_their_arguments() -> None:
    program = Program()
    with pytest.raises(ValueError, match="upload kind"):
        program.upload(kind="python", source="")
    with pytest.raises(TypeError, match="source="):
        program.upload(kind="module", value="x = 1")
    with pytest.raises(TypeError, match="source="):
        program.upload(kind="module", source=b"x = 1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not value="):
        program.upload(kind="module", source="", value=b"")
    with pytest.raises(ValueError, match="not source="):
        program.upload(kind="bytes", source="x", value=b"")
    with pytest.raises(TypeError, match="must be bytes"):
        program.upload(kind="library", value="lib.so")
    with pytest.raises(ValueError, match="not source="):
        program.upload(kind="tensor", source="x", value=np.zeros(1))
    for kind in ("module", "bytes", "library"):
        with pytest.raises(ValueError, match="only for upload\\(kind='tensor'\\)"):
            program.upload(
                kind=kind,
                source="" if kind == "module" else None,
                value=None if kind == "module" else b"",
                dtype="int8",
            )
    assert len(program) == 0


def test_module_source_inline_or_blob() -> None:
    program = Program()
    small = "x = 1\n"
    large = "# " + "y" * protocol.INLINE_SOURCE_BYTES + "\n"
    program.upload(kind="module", source=small)
    program.upload(kind="module", source=large)
    body, blobs = program.to_wire()
    first, second = body["instructions"]
    assert first == {"op": "upload", "id": "upload_0", "kind": "module", "source": small}
    encoded = large.encode()
    assert second == {"op": "upload", "id": "upload_1", "kind": "module", "blob": sha(encoded), "size": len(encoded)}
    assert blobs == {sha(encoded): encoded}


def test_bytes_and_library_uploads() -> None:
    program = Program()
    program.upload(kind="bytes", value=b"abc")
    program.upload(kind="library", value=bytearray(b"\x7fELF"))
    program.upload(kind="bytes", value=memoryview(b"abc"))  # same bytes: one blob
    body, blobs = program.to_wire()
    assert body["instructions"][0] == {
        "op": "upload",
        "id": "upload_0",
        "kind": "bytes",
        "blob": sha(b"abc"),
        "size": 3,
    }
    assert body["instructions"][1]["kind"] == "library" and body["instructions"][1]["size"] == 4
    assert sorted(blobs) == sorted([sha(b"abc"), sha(b"\x7fELF")])


def test_tensor_uploads() -> None:
    program = Program()
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    program.upload(kind="tensor", value=array)
    program.upload(kind="tensor", value=torch.ones(2, dtype=torch.bfloat16))
    program.upload(kind="tensor", value=[1.0, 2.0])  # a list becomes a numpy array
    program.upload(kind="tensor", value=b"\x00" * 8, dtype="float32", shape=[2])
    program.upload(kind="tensor", value=bytearray(2), dtype="bfloat16", shape=())
    specs = [i["tensor"] for i in program.instructions]
    assert specs[0] == protocol.TensorSpec("numpy", "int16", (2, 3), sha(array.tobytes()))
    assert specs[1] == protocol.TensorSpec("torch", "bfloat16", (2,), sha(b"\x80\x3f" * 2))
    assert (specs[2].framework, specs[2].dtype, specs[2].shape) == ("numpy", "float64", (2,))
    assert specs[3] == protocol.TensorSpec("numpy", "float32", (2,), sha(b"\x00" * 8))
    assert specs[4] == protocol.TensorSpec("numpy", "bfloat16", (), sha(b"\x00\x00"))
    _, blobs = program.to_wire()
    assert len(blobs) == 5 and bytes(blobs[specs[0].source]) == array.tobytes()


def test_tensor_upload_mistakes() -> None:
    program = Program()
    with pytest.raises(ValueError, match="are 7 long but dtype float32 and shape \\[2\\] need 8"):
        program.upload(kind="tensor", value=b"\x00" * 7, dtype="float32", shape=[2])
    with pytest.raises(ValueError, match="needs dtype= and shape="):
        program.upload(kind="tensor", value=b"\x00" * 4, dtype="float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        program.upload(kind="tensor", value=b"\x00" * 4, dtype="float31", shape=[1])
    with pytest.raises(ValueError, match="bad tensor shape"):
        program.upload(kind="tensor", value=b"", dtype="int8", shape=[-1])
    with pytest.raises(ValueError, match="only for tensors given as raw bytes"):
        program.upload(kind="tensor", value=np.zeros(2), dtype="float64")
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        program.upload(kind="tensor", value="abc")
    with pytest.raises(TypeError, match="not supported"):
        program.upload(kind="tensor", value=np.array(["a", "b"]))
    assert len(program) == 0


# --- paths, files and folders --------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "..", "../x", "a/../../b", "a/..", ".", "./", "a\x00b", None, 3])
def test_bad_paths_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        check_relative_path(bad)
    program = Program()
    with pytest.raises(ValueError):
        program.upload_file(blob=b"x", path=bad)
    with pytest.raises(ValueError):
        program.return_file(key="k", path=bad)
    with pytest.raises(ValueError):
        program.return_folder(key="k", path=bad)
    assert len(program) == 0


def test_paths_are_normalised() -> None:
    assert check_relative_path("./a//b/./c.txt") == "a/b/c.txt"
    assert check_relative_path(Path("d") / "e") == "d/e"
    program = Program()
    program.upload_file(blob=b"x", path="./out/x.bin")
    assert program.instructions[0]["path"] == "out/x.bin"


def test_upload_file_from_bytes_and_from_disk(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_bytes(b"#!/bin/sh\n")
    script.chmod(0o750)
    program = Program()
    program.upload_file(blob=b"data", path="in/data.bin")
    program.upload_file(blob=script, path="run.sh")
    program.upload_file(blob=str(script), path="again.sh")
    first, second, third = program.instructions
    assert first == {
        "op": "upload_file",
        "id": "upload_file_0",
        "path": "in/data.bin",
        "blob": sha(b"data"),
        "size": 4,
        "mode": 0o644,
    }
    assert second["mode"] == 0o750 and second["blob"] == sha(b"#!/bin/sh\n") and second["size"] == 10
    assert third["blob"] == second["blob"]


def test_upload_file_refuses_symlinks_and_special_files(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    program = Program()
    for bad in (link, fifo, tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            program.upload_file(blob=bad, path="x")
    with pytest.raises(FileNotFoundError):
        program.upload_file(blob=tmp_path / "missing", path="x")
    with pytest.raises(TypeError, match="must be bytes"):
        program.upload_file(blob=123, path="x")
    assert len(program) == 0


def _make_folder(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"bb")
    (root / "a.py").write_bytes(b"a = 1\n")
    (root / "sub" / "deeper" / "c.bin").write_bytes(b"\x00")
    (root / "sub" / "tool").write_bytes(b"#!")
    (root / "sub" / "tool").chmod(0o755)
    (root / "a.py").chmod(0o644)
    (root / "b.txt").chmod(0o600)
    (root / "sub" / "deeper" / "c.bin").chmod(0o644)
    return root


def test_upload_folder_lists_every_file(tmp_path: Path) -> None:
    root = _make_folder(tmp_path / "src")
    program = Program()
    ref = program.upload_folder(root, path="pkg")
    assert ref.id == "upload_folder_0"
    (ins,) = program.instructions
    assert ins["path"] == "pkg"
    assert ins["files"] == [
        ["a.py", sha(b"a = 1\n"), 0o644, 6],
        ["b.txt", sha(b"bb"), 0o600, 2],
        ["sub/tool", sha(b"#!"), 0o755, 2],
        ["sub/deeper/c.bin", sha(b"\x00"), 0o644, 1],
    ]
    _, blobs = program.to_wire()
    assert {bytes(v) for v in blobs.values()} == {b"a = 1\n", b"bb", b"#!", b"\x00"}


def test_upload_folder_refuses_links_and_special_files(tmp_path: Path) -> None:
    program = Program()
    cases = {}
    linked_file = _make_folder(tmp_path / "linked_file")
    (linked_file / "sub" / "evil").symlink_to("/etc/passwd")
    cases["linked_file"] = (linked_file, "not a regular file")
    linked_dir = _make_folder(tmp_path / "linked_dir")
    (linked_dir / "sub" / "up").symlink_to(tmp_path)
    cases["linked_dir"] = (linked_dir, "is a symlink")
    with_fifo = _make_folder(tmp_path / "with_fifo")
    os.mkfifo(with_fifo / "sub" / "pipe")
    cases["with_fifo"] = (with_fifo, "not a regular file")
    link_root = tmp_path / "link_root"
    link_root.symlink_to(linked_file)
    cases["link_root"] = (link_root, "not a folder")
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    cases["a_file"] = (a_file, "not a folder")
    cases["missing"] = (tmp_path / "missing", "not a folder")
    for name, (folder, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            program.upload_folder(folder, path=name)
    with pytest.raises(ValueError, match=r"contains '\.\.'"):
        program.upload_folder(_make_folder(tmp_path / "fine"), path="../up")
    assert len(program) == 0


# --- to_wire -------------------------------------------------------------------------------------


def test_to_wire_is_a_packable_body_with_its_blobs(tmp_path: Path) -> None:
    program = Program()
    mod = program.upload(kind="module", source="def f(x, y):\n    return x\n")
    x = program.upload(kind="tensor", value=np.ones(3, dtype=np.float32))
    program.upload_folder(_make_folder(tmp_path / "src"), path="src")
    fn = program.get_function(module=mod, name="f")
    out = program.run(fn=fn, args=[x, np.zeros(2, dtype=np.int8)])
    program.return_(key="out", value=(out, "literal"))
    body, blobs = program.to_wire()
    assert list(body) == ["instructions"]
    assert [i["op"] for i in body["instructions"]] == [
        "upload",
        "upload",
        "upload_folder",
        "get_function",
        "run",
        "return",
    ]
    # every digest the program names is a blob it carries, and each blob hashes to its name
    assert sorted(protocol.program_digests(body)) == sorted(blobs)
    assert all(sha(bytes(data)) == digest for digest, data in blobs.items())
    # the body goes through the codec unchanged
    assert protocol.unpack(protocol.pack(body)) == body
    # to_wire hands out copies: changing them does not change the program
    body["instructions"].clear()
    blobs.clear()
    assert len(program.to_wire()[0]["instructions"]) == 6 and program.to_wire()[1]


def test_instruction_limit() -> None:
    program = Program()
    for _ in range(protocol.MAX_INSTRUCTIONS):
        program.upload(kind="bytes", value=b"")
    with pytest.raises(ValueError, match="at most"):
        program.upload(kind="bytes", value=b"")
