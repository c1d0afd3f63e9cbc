"""CPU tests of trusted workloads (``kcoral remote``): the workload format, the message stream from
the candidate's process, and the harness's side (collecting, checking, cleaning up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from kcoral.errors import ExecutionError
from kcoral.workloads.channel import (
    ChannelError,
    MessageReader,
    deadline_after,
    tensor_from_wire,
    tensor_to_wire,
    write_message,
)
from kcoral.workloads.format import is_trusted_workload, load_candidate, load_workload

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]

CPU_WORKLOAD = """
import torch

NAME = "double_cpu"
TIMING = {"repeat": 5}
TOLERANCE = {"rtol": 0.0, "atol": 0.0}


def make_inputs(seed):
    generator = torch.Generator()
    generator.manual_seed(seed)
    return (torch.randn(16, generator=generator),)


def reference(x):
    return x * 2
"""


def write_workload(folder: Path, source: str = CPU_WORKLOAD) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workload.py").write_text(textwrap.dedent(source))
    return folder


# ----------------------------------------------------------------------------- format


def test_a_workload_with_make_inputs_is_trusted_and_loads(tmp_path: Path) -> None:
    folder = write_workload(tmp_path / "double")
    assert is_trusted_workload(folder)
    workload = load_workload(folder, "kcoral_test_workload_a")
    assert workload.name == "double_cpu" and workload.entry == "custom_kernel"
    assert workload.timing == {"repeat": 5}
    assert workload.baseline is workload.reference
    (x,) = workload.inputs(7)
    assert torch.equal(x, workload.inputs(7)[0]) and not torch.equal(x, workload.inputs(8)[0])
    workload.verify(torch, x * 2, workload.reference(x))
    with pytest.raises(AssertionError):
        workload.verify(torch, x * 3, workload.reference(x))


def test_a_free_form_workload_is_not_trusted(tmp_path: Path) -> None:
    folder = write_workload(tmp_path / "free", "def evaluate(*args):\n    return {}\n")
    assert not is_trusted_workload(folder)
    assert not is_trusted_workload(tmp_path / "missing")


@pytest.mark.parametrize(
    ("extra", "kind", "words"),
    [
        ("TIMING = {'repeats': 3}\n", "parse", "repeats"),
        ("TIMING = {'defences': False}\n", "parse", "defences"),
        ("TOLERANCE = {'rtol': -1, 'atol': 0}\n", "parse", "TOLERANCE"),
        ("ENTRY = 'not a name'\n", "parse", "ENTRY"),
        ("reference = 3\n", "parse", "reference"),
        ("raise RuntimeError('broken import')\n", "compile", "broken import"),
    ],
)
def test_bad_workloads_are_refused_with_a_clear_error(tmp_path: Path, extra: str, kind: str, words: str) -> None:
    folder = write_workload(tmp_path / "bad", CPU_WORKLOAD + extra)
    with pytest.raises(ExecutionError) as caught:
        load_workload(folder, "kcoral_test_workload_bad")
    assert caught.value.kind == kind and words in caught.value.message


def test_a_candidate_without_its_entry_is_a_compile_error(tmp_path: Path) -> None:
    path = tmp_path / "cand.py"
    path.write_text("def other(x):\n    return x\n")
    with pytest.raises(ExecutionError) as caught:
        load_candidate(path, "custom_kernel", "kcoral_test_candidate")
    assert caught.value.kind == "compile"


# ----------------------------------------------------------------------------- channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_tensors_cross_as_plain_bytes(dtype: Any) -> None:
    value = (torch.arange(12) % 3).reshape(3, 4).to(dtype)
    header, data = tensor_to_wire(torch, value.t())  # not contiguous: sent contiguous
    back = tensor_from_wire(torch, header, data)
    assert type(back) is torch.Tensor and back.dtype == dtype and torch.equal(back, value.t())


def test_empty_and_scalar_tensors_cross() -> None:
    for value in (torch.zeros(0, 3), torch.tensor(2.5)):
        header, data = tensor_to_wire(torch, value)
        assert torch.equal(tensor_from_wire(torch, header, data), value)


def test_a_tensor_subclass_does_not_cross() -> None:
    class Lying(torch.Tensor):  # type: ignore[name-defined]  # torch: importorskip's module, a variable to mypy
        pass

    with pytest.raises(TypeError):
        tensor_to_wire(torch, torch.ones(2).as_subclass(Lying))


@pytest.mark.parametrize(
    ("header", "size"),
    [
        ({"dtype": "complex64", "shape": [1]}, 8),
        ({"dtype": "float32", "shape": [3]}, 8),
        ({"dtype": "float32", "shape": [-1]}, 4),
        ({"dtype": "float32", "shape": "x"}, 4),
    ],
)
def test_inconsistent_tensor_headers_are_refused(header: dict[str, Any], size: int) -> None:
    with pytest.raises(ChannelError):
        tensor_from_wire(torch, header, b"\0" * size)


def _pipe_with(messages: list[tuple[dict[str, Any], bytes]], tail: bytes = b"") -> int:
    read_end, write_end = os.pipe()

    def writer() -> None:
        with os.fdopen(write_end, "wb") as stream:
            for header, payload in messages:
                write_message(stream, header, payload)
            stream.write(tail)

    threading.Thread(target=writer, daemon=True).start()
    return read_end


def test_messages_are_read_back_in_order() -> None:
    big = os.urandom(3 << 20)
    reader = MessageReader(_pipe_with([({"type": "a"}, b""), ({"type": "b"}, big)]), deadline_after(10))
    try:
        assert reader.read() == ({"type": "a", "payload_bytes": 0}, b"")
        header, payload = reader.read()  # type: ignore[misc]
        assert header["type"] == "b" and payload == big
        assert reader.read() is None
    finally:
        reader.close()


@pytest.mark.parametrize(
    "tail",
    [b'\x05\x00\x00\x00{"a"', b"\xff\xff\xff\x7f", b"\x02\x00\x00\x00[]", b"\x01"],
    ids=["cut-header", "huge-header", "not-a-map", "cut-length"],
)
def test_a_malformed_stream_is_a_channel_error(tail: bytes) -> None:
    reader = MessageReader(_pipe_with([({"type": "ok"}, b"")], tail), deadline_after(10))
    try:
        assert reader.read() is not None
        with pytest.raises(ChannelError):
            reader.read()
    finally:
        reader.close()


def test_a_silent_stream_runs_out_of_time() -> None:
    read_end, write_end = os.pipe()
    reader = MessageReader(read_end, deadline_after(0.3))
    try:
        with pytest.raises(ChannelError, match="time limit"):
            reader.read()
    finally:
        reader.close()
        os.close(write_end)


# ----------------------------------------------------------------------------- the command line

# (The harness and the candidate's process: tests/test_remote_harness.py.)


@pytest.fixture(autouse=True)
def _children_import_this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def test_a_trusted_workload_takes_one_candidate_or_two(tmp_path: Path) -> None:
    folder = write_workload(tmp_path / "double")
    done = subprocess.run(
        [sys.executable, "-m", "kcoral.cli", "remote", "--remote", "tcp://127.0.0.1:1", "--", str(folder), *"abc"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2, done.stderr
    assert "one candidate (or two, to compare)" in done.stderr


def test_the_shipped_workloads_are_trusted() -> None:
    for name in ("add", "matmul"):
        folder = REPO / "examples" / "workloads" / name
        assert is_trusted_workload(folder)
        assert (folder / "candidate.py").is_file()
