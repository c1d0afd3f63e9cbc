"""End to end: programs through a real ``kcoral broker`` process, through the public API only."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kcoral import AsyncClient, Client, KCoralError, Program, ReturnedFile, ReturnedFolder, TransportError

ECHO = "def echo(x):\n    return x\n"


def echo_program(value: object) -> Program:
    program = Program()
    module = program.upload(kind="module", source=ECHO)
    fn = program.get_function(module=module, name="echo")
    program.return_(key="v", value=program.run(fn=fn, args=[value]))
    return program


def run_source(client: Client, source: str, name: str, args: list[object] | None = None, **options: object):
    program = Program()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name)
    program.return_(key="out", value=program.run(fn=fn, args=args or []))
    return client.execute(program, **options)  # type: ignore[arg-type]


def test_scalar_and_structural_round_trip(client: Client) -> None:
    value = {
        "none": None,
        "bools": [True, False],
        "int": -(2**63),
        "big": 2**64 - 1,
        "float": 1.5,
        "str": "héllo",
        "bytes": b"\x00\xff" * 10,
        "tuple": (1, (2, 3)),
        "nested": {"a": [1, {"b": (None,)}]},
        7: "int key",
    }
    result = client.execute(echo_program(value))
    assert result.completed, result.error
    assert result.results["v"] == value
    assert isinstance(result.results["v"]["tuple"], tuple)


def test_large_bytes_round_trip(client: Client) -> None:
    data = os.urandom(3 << 20)
    program = Program()
    blob = program.upload(kind="bytes", value=data)
    program.return_(key="b", value=blob)
    result = client.execute(program)
    assert result.results["b"] == data


NUMPY_DTYPES = ["float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (0,), (3, 4), (2, 0, 5)]


def test_numpy_tensor_round_trip_all_dtypes(client: Client) -> None:
    program = Program()
    expected = {}
    for dtype in NUMPY_DTYPES:
        for shape in SHAPES:
            array = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
            key = f"{dtype}{shape}"
            expected[key] = array
            program.return_(key=key, value=program.upload(kind="tensor", value=array))
    result = client.execute(program)
    assert result.completed, result.error
    for key, array in expected.items():
        got = result.results[key]
        assert isinstance(got, np.ndarray)
        assert got.dtype == array.dtype and got.shape == array.shape, key
        np.testing.assert_array_equal(got, array)


def test_torch_tensor_round_trip_all_dtypes(client: Client) -> None:
    source = (
        "import torch\n"
        "def check(t):\n"
        "    assert isinstance(t, torch.Tensor)\n"
        "    exact = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bool)\n"
        "    return t if t.dtype in exact else t * 1\n"
    )
    program = Program()
    module = program.upload(kind="module", source=source)
    check = program.get_function(module=module, name="check")
    expected = {}
    for dtype in TORCH_DTYPES:
        for shape in SHAPES:
            tensor = (torch.arange(int(np.prod(shape))) % 5).to(dtype).reshape(shape)
            key = f"{dtype}{shape}"
            expected[key] = tensor
            program.return_(key=key, value=program.run(fn=check, args=[program.upload(kind="tensor", value=tensor)]))
    result = client.execute(program)
    assert result.completed, result.error
    for key, tensor in expected.items():
        got = result.results[key]
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            assert isinstance(got, torch.Tensor) and got.dtype == tensor.dtype, key
            assert torch.equal(got.float(), tensor.float()), key
        else:
            assert isinstance(got, np.ndarray), key
            np.testing.assert_array_equal(got, tensor.numpy())


def test_raw_bytes_tensor_and_literal_tensor_args(client: Client) -> None:
    program = Program()
    raw = np.arange(6, dtype=np.float32).tobytes()
    tensor = program.upload(kind="tensor", value=raw, dtype="float32", shape=[2, 3])
    module = program.upload(kind="module", source="def add(a, b):\n    return a + b\n")
    add = program.get_function(module=module, name="add")
    program.return_(key="sum", value=program.run(fn=add, args=[tensor, np.ones((2, 3), np.float32)]))
    result = client.execute(program)
    np.testing.assert_array_equal(result.results["sum"], np.arange(6, dtype=np.float32).reshape(2, 3) + 1)


def test_references_and_callable_returned_by_run(client: Client) -> None:
    source = "def make_adder(n):\n    return lambda x: x + n\n\ndef twice(f, x):\n    return f(f(x))\n"
    program = Program()
    module = program.upload(kind="module", source=source)
    make = program.get_function(module=module, name="make_adder")
    twice = program.get_function(module=module, name="twice")
    add5 = program.run(fn=make, args=[5])
    direct = program.run(fn=add5, args=[1])
    nested = program.run(fn=twice, args=[add5, direct])
    program.return_(key="direct", value=direct)
    program.return_(key="nested", value=nested)
    program.return_(key="literal", value=[1, "two"])
    result = client.execute(program)
    assert result.completed, result.error
    assert result.results == {"direct": 6, "nested": 16, "literal": [1, "two"]}


def test_same_program_twice_and_new_process_each_time(client: Client) -> None:
    program = Program()
    module = program.upload(kind="module", source="import os\ndef pid():\n    return os.getpid()\n")
    program.return_(key="pid", value=program.run(fn=program.get_function(module=module, name="pid")))
    first = client.execute(program)
    second = client.execute(program)
    assert first.completed and second.completed
    assert first.results["pid"] != second.results["pid"]


@pytest.mark.parametrize(
    ("source", "name", "kind", "op"),
    [
        ("def f(:\n", "f", "parse", "upload"),
        ("raise ImportError('no such thing')\n", "f", "compile", "upload"),
        ("def f():\n    return 1\n", "missing", "compile", "get_function"),
        ("def f():\n    return 1 / 0\n", "f", "runtime", "run"),
        ("def f():\n    assert 1 == 2, 'wrong answer'\n", "f", "correctness", "run"),
        ("def f():\n    return object()\n", "f", "serialization", "return"),
        (
            "from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('unavailable', 'no tool')\n",
            "f",
            "unavailable",
            "run",
        ),
        (
            "from kcoral.errors import ExecutionError\n"
            "def f():\n    raise ExecutionError('integrity', 'timer patched')\n",
            "f",
            "integrity",
            "run",
        ),
    ],
)
def test_instruction_error_kinds(client: Client, source: str, name: str, kind: str, op: str) -> None:
    program = Program()
    program.return_(key="before", value="kept")
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name)
    program.return_(key="out", value=program.run(fn=fn))
    result = client.execute(program)
    assert result.status == "FAILED" and not result.completed
    assert result.error is not None
    assert result.error["kind"] == kind, result.error
    assert result.error["instruction_op"] == op
    ops = [i["op"] for i in program.instructions]
    assert result.error["instruction_index"] == len(ops) - 1 - ops[::-1].index(op)
    assert result.error["instruction_id"]
    assert result.results == {"before": "kept"}
    if kind in ("runtime", "correctness"):
        assert "Traceback" in result.error["traceback"]


def test_parse_error_for_bad_reference_in_wire_program(shared_broker) -> None:  # type: ignore[no-untyped-def]
    # The builder refuses bad references, so forge one the way a raw tool could.
    program = echo_program(1)
    program._instructions[2]["fn"] = "nowhere"
    with Client(shared_broker.url) as client:
        result = client.execute(program)
    assert result.status == "FAILED" and result.error is not None
    assert result.error["kind"] == "parse" and result.error["instruction_index"] == 2


def test_crash_inside_run_then_next_program_completes(client: Client) -> None:
    result = run_source(client, "import os\ndef f():\n    os._exit(3)\n", "f")
    assert result.status == "FAILED"
    assert result.error["kind"] == "runtime"
    assert "worker exited while executing the instruction" in result.error["message"]
    assert "3" in result.error["message"] and result.error["instruction_op"] == "run"
    assert client.execute(echo_program(1)).results == {"v": 1}


def test_timeout_then_next_program_completes(client: Client) -> None:
    start = time.monotonic()
    with pytest.raises(KCoralError) as info:
        run_source(client, "import time\ndef f():\n    time.sleep(60)\n", "f", timeout_seconds=1.0)
    assert info.value.kind == "timeout"
    assert info.value.request_id
    assert time.monotonic() - start < 10
    assert client.execute(echo_program(2)).results == {"v": 2}


def test_stdout_stderr_capture_and_truncation(client: Client) -> None:
    source = (
        "import os, sys, subprocess\n"
        "def f():\n"
        "    print('from print')\n"
        "    os.write(1, b'from fd\\n')\n"
        "    print('to stderr', file=sys.stderr)\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"from child\")'], check=True)\n"
        "    sys.stdout.write('x' * 5000)\n"
    )
    result = run_source(client, source, "f")
    assert result.completed, result.error
    assert "from print\nfrom fd\nfrom child\n" in result.stdout
    assert result.stderr == "to stderr\n"
    assert not result.stdout_truncated
    cut = run_source(client, source, "f", output_limit_bytes=100)
    assert cut.stdout_truncated and len(cut.stdout) == 100
    assert not cut.stderr_truncated


def test_files_and_folders_both_ways(client: Client, tmp_path: Path) -> None:
    local = tmp_path / "inputs"
    (local / "sub").mkdir(parents=True)
    (local / "a.txt").write_text("alpha")
    (local / "sub" / "b.bin").write_bytes(b"\x01\x02")
    source = (
        "import os, pathlib\n"
        "def work(folder, cfg):\n"
        "    cwd = pathlib.Path.cwd()\n"
        "    os.makedirs('out/deep', exist_ok=True)\n"
        "    pathlib.Path('out/deep/c.txt').write_text(pathlib.Path(folder, 'a.txt').read_text() + open(cfg).read())\n"
        "    pathlib.Path('report.txt').write_text('done')\n"
        "    return [p.name for p in sorted(cwd.iterdir())]\n"
    )
    program = Program()
    folder = program.upload_folder(local, path="data")
    cfg = program.upload_file(blob=b"-cfg", path="conf/settings.txt")
    module = program.upload(kind="module", source=source)
    listing = program.run(fn=program.get_function(module=module, name="work"), args=[folder, cfg])
    program.return_(key="listing", value=listing)
    program.return_file(key="report", path="report.txt")
    program.return_folder(key="out", path="out")
    program.return_folder(key="data", path="data")
    result = client.execute(program)
    assert result.completed, result.error
    assert result.results["listing"] == ["conf", "data", "out", "report.txt"]
    report = result.results["report"]
    assert isinstance(report, ReturnedFile) and report.read_bytes() == b"done"
    saved = report.save(tmp_path / "r.txt")
    with pytest.raises(FileExistsError):
        report.save(saved)
    report.save(saved, overwrite=True)
    out = result.results["out"]
    assert isinstance(out, ReturnedFolder)
    assert out.read_bytes("deep/c.txt") == b"alpha-cfg"
    dest = out.save(tmp_path / "fetched")
    assert (dest / "deep" / "c.txt").read_text() == "alpha-cfg"
    assert result.results["data"].read_bytes("sub/b.bin") == b"\x01\x02"


def test_return_file_outside_workdir_is_refused(client: Client) -> None:
    program = Program()
    module = program.upload(kind="module", source="import os\ndef f():\n    os.symlink('/etc/hostname', 'link')\n")
    program.run(fn=program.get_function(module=module, name="f"))
    program.return_file(key="leak", path="link")
    result = client.execute(program)
    assert result.status == "FAILED" and result.error is not None
    assert "outside the working directory" in result.error["message"]


def test_working_directory_environment(client: Client) -> None:
    source = (
        "import os, tempfile\n"
        "def env():\n"
        "    return {'cwd': os.getcwd(), 'home': os.environ['HOME'], 'tmp': tempfile.gettempdir(),\n"
        "            'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), 'files': os.listdir('.')}\n"
    )
    result = run_source(client, source, "env")
    env = result.results["out"]
    assert env["files"] == []
    root = os.path.dirname(env["cwd"])
    assert env["home"].startswith(root) and env["tmp"].startswith(root)
    assert env["cvd"] in ("0", "1") and [int(env["cvd"])] == result.gpu_ids


def test_seed_example_on_cpu(client: Client) -> None:
    source = """
import torch

def evaluate(n):
    x = torch.arange(n, dtype=torch.float32, device="cpu")
    y = torch.empty_like(x)

    def candidate():
        torch.add(x, 1.0, out=y)

    candidate()
    torch.testing.assert_close(y, x + 1.0)
    return {"correct": True}
"""
    program = Program()
    module = program.upload(kind="module", source=source)
    evaluate = program.get_function(module=module, name="evaluate")
    report = program.run(fn=evaluate, args=[4096])
    program.return_(key="report", value=report)
    result = client.execute(program)
    if not result.completed:
        raise RuntimeError(result.error)
    assert result.results["report"] == {"correct": True}


def test_sixteen_programs_at_once_through_one_async_client(shared_broker) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[int]:
        async with AsyncClient(shared_broker.url) as client:
            results = await asyncio.gather(*(client.execute(echo_program(i)) for i in range(16)))
        return [r.results["v"] for r in results]

    assert asyncio.run(main()) == list(range(16))


def test_cancel_by_cancelling_the_await(shared_broker) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with AsyncClient(shared_broker.url) as client:
            program = Program()
            module = program.upload(kind="module", source="import time\ndef f():\n    time.sleep(30)\n")
            program.run(fn=program.get_function(module=module, name="f"))
            task = asyncio.create_task(client.execute(program))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The worker was killed: the service answers the next program at once.
            result = await asyncio.wait_for(client.execute(echo_program(3)), 20)
            assert result.results == {"v": 3}

    asyncio.run(main())


def test_health_and_target(client: Client) -> None:
    health = client.health()
    assert health["status"] == "ok"
    for key in ("instance_id", "started_at", "gpu_count", "load", "target", "versions"):
        assert key in health
    assert set(health["load"]) >= {"request_capacity", "requests_in_progress", "requests_waiting"}
    assert health["gpu_count"] == 2
    assert client.target()["fake_gpus"] == 2


def test_no_service_raises_transport_error() -> None:
    from tests.helpers import free_port

    start = time.monotonic()
    with pytest.raises(TransportError):
        with Client(f"tcp://127.0.0.1:{free_port()}", connect_timeout_seconds=0.5):
            pass
    assert time.monotonic() - start < 5


def test_gpu_count_over_capacity(client: Client) -> None:
    with pytest.raises(KCoralError) as info:
        client.execute(echo_program(1), gpu_count=3)
    assert info.value.kind == "capacity"
    with pytest.raises(ValueError):
        client.execute(echo_program(1), gpu_count=0)
