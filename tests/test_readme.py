"""The README's commands and examples, run as a newcomer would run them.

- Its first ```bash block holds the two commands, exactly; ``.ci/run`` runs those lines verbatim (it
  reads them from the README), so here they are checked, not re-installed.
- ``kcoral broker``, the first command's service, is started from a shell in the background on a
  free loopback port (CPU workers and ``--sandbox none``, as the other tests run it), and every
  other ```bash block and every ```python block runs against it, unchanged but for the port.
- A Python example that needs a GPU (the seed's) runs unchanged on a GPU broker under the ``gpu``
  marker; without a GPU, its Program is built, and against the CPU broker it fails as the README
  says (the script raises with the service's error).

A ``print(...)  # TEXT`` line in an example, or a shell line ``python3 FILE  # TEXT``, says what it
prints: TEXT must be in the output.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kcoral import Program
from kcoral.protocol.program import check_instructions
from kcoral.testing import RunningService, broker_ready, free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

SERVE = "python3 -m pip install -e . && kcoral broker"
TEST = "python3 -m pip install -e '.[test]' && python3 -m pytest -q -p no:cacheprovider"
README_URL = "tcp://127.0.0.1:5555"  # the first command's broker, on its default address
EXAMPLE_TIMEOUT_S = 120
BROKER_STOP_TIMEOUT_S = 20

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
SAVED_AS = re.compile(r"save this as `([\w.-]+\.py)`[^`]*$")
PRINTS = re.compile(r"^\s*print\(.*#\s*(.+?)\s*$", re.M)
RUNS_FILE = re.compile(r"^python3 ([\w.-]+\.py)\s+#\s*(.+?)\s*$", re.M)


@dataclass(frozen=True)
class Block:
    language: str
    source: str
    saved_as: str | None  # the file name the README tells the reader to save it as

    @property
    def needs_gpu(self) -> bool:
        return '"cuda"' in self.source


def readme_blocks() -> list[Block]:
    text = README.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        saved = SAVED_AS.search(text[: match.start()].rstrip().splitlines()[-1])
        blocks.append(Block(match[1], match[2], saved[1] if saved else None))
    return blocks


BLOCKS = readme_blocks()
SHELL = [block for block in BLOCKS if block.language == "bash"]
PYTHON = [block for block in BLOCKS if block.language == "python"]
CPU_EXAMPLES = [block for block in PYTHON if not block.needs_gpu]
GPU_EXAMPLES = [block for block in PYTHON if block.needs_gpu]


def command_lines(block: Block) -> list[str]:
    """A shell block's lines without their comments, as .ci/run reads them."""
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in block.source.splitlines())
    return [line for line in lines if line]


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert SHELL and CPU_EXAMPLES and GPU_EXAMPLES, "the README lost its commands or examples"
    assert any(block.saved_as for block in CPU_EXAMPLES)


def test_the_two_commands_come_first_exactly_as_ci_runs_them() -> None:
    assert command_lines(SHELL[0])[:2] == [SERVE, TEST]
    ci = CI_RUN.read_text()
    # .ci/run takes its commands from the README's first ```bash block, and runs both.
    assert "README.md" in ci and "```bash" in ci
    assert 'bash -c "$serve"' in ci and 'bash -c "$test_command"' in ci


def test_the_cpu_torch_note_is_there() -> None:
    text = README.read_text()
    assert "python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    # "where a local wheel index carries the CPU build, `python3 -m pip install torch==2.13.0` is the
    # same; `.ci/run` does that"
    assert "`python3 -m pip install torch==2.13.0`" in text
    assert re.search(r"^python3 -m pip install (-q )?torch==2\.13\.0$", CI_RUN.read_text(), re.M)


def start_readme_broker(work: Path, *flags: str) -> RunningService:
    """The README's ``kcoral broker``, from a shell in the background on a free loopback port, ready."""
    url = f"tcp://127.0.0.1:{free_port()}"
    serve = SERVE.split("&&")[-1].strip()
    argv = [*serve.split(), "--listen", url, "--run-dir", str(work / "run"), *flags]
    log_path = work / "broker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {shlex.join(argv)}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=shell_environment(),
            start_new_session=True,
        )
    broker = RunningService(url, process, log_path)
    try:
        wait_ready(broker, broker_ready)
    except BaseException:
        broker.stop(signal.SIGKILL)
        raise
    return broker


@pytest.fixture(scope="module")
def readme_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """The README's broker on CPU workers, without a sandbox, as the other tests run it."""
    broker = start_readme_broker(
        tmp_path_factory.mktemp("readme"), "--device", "cpu", "--sandbox", "none", "--workers", "1"
    )
    yield broker
    code = broker.stop(signal.SIGTERM, BROKER_STOP_TIMEOUT_S)
    assert code == 0, f"the README's broker exited with {code} on SIGTERM:\n{broker.log()}"


def shell_environment(url: str | None = None) -> dict[str, str]:
    """This interpreter's ``kcoral`` and ``python3`` first on PATH, and ``KCORAL_URL`` when given."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if url:
        env["KCORAL_URL"] = url
    return env


def run_example(block: Block, url: str, work: Path) -> subprocess.CompletedProcess[str]:
    path = work / (block.saved_as or "example.py")
    path.write_text(block.source)
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        cwd=work,
        env=shell_environment(url),
        timeout=EXAMPLE_TIMEOUT_S,
    )


def assert_prints_what_it_says(source: str, stdout: str, pattern: re.Pattern[str] = PRINTS) -> None:
    for said in pattern.findall(source):
        said = said[-1] if isinstance(said, tuple) else said
        assert said in stdout, f"the README says this prints {said!r}; it printed:\n{stdout}"


@pytest.mark.parametrize("block", CPU_EXAMPLES, ids=lambda block: block.saved_as or "example")
def test_each_python_example_runs_against_the_readmes_broker(
    block: Block, readme_broker: RunningService, tmp_path: Path
) -> None:
    run = run_example(block, readme_broker.url, tmp_path)
    assert run.returncode == 0, run.stderr
    assert_prints_what_it_says(block.source, run.stdout)


@pytest.mark.parametrize("number", range(1, len(SHELL)), ids=lambda number: f"bash-{number}")
def test_each_shell_block_runs_against_the_readmes_broker(
    number: int, readme_broker: RunningService, tmp_path: Path
) -> None:
    """The shell session after the two commands, in a fresh directory holding the README's saved files."""
    block = SHELL[number]
    for example in CPU_EXAMPLES:
        if example.saved_as:
            (tmp_path / example.saved_as).write_text(example.source)
    script = block.source.replace(README_URL, readme_broker.url)
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=shell_environment(),
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert run.returncode == 0, f"{script}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert_prints_what_it_says(block.source, run.stdout, RUNS_FILE)
    if "kcoral status" in script:
        assert readme_broker.url in run.stdout and "capacity" in run.stdout


@pytest.mark.parametrize("block", GPU_EXAMPLES, ids=lambda block: block.saved_as or "gpu-example")
def test_each_gpu_example_builds_its_program(block: Block) -> None:
    """Up to the client, the example runs anywhere: it compiles and builds a Program that encodes."""
    compile(block.source, "README.md", "exec")
    prefix = block.source[: block.source.index("with Client(")]
    namespace: dict[str, object] = {}
    exec(compile(prefix, "README.md", "exec"), namespace)
    program = namespace["program"]
    assert isinstance(program, Program)
    assert [instruction["op"] for instruction in program.instructions] == ["upload", "get_function", "run", "return"]
    body, _blobs = program.to_wire()
    check_instructions(body["instructions"])  # what the broker's intake checks


@pytest.mark.parametrize("block", GPU_EXAMPLES, ids=lambda block: block.saved_as or "gpu-example")
def test_each_gpu_example_without_a_gpu_fails_with_the_services_error(
    block: Block, readme_broker: RunningService, tmp_path: Path
) -> None:
    """On CPU workers the program reaches the service, fails there, and the script raises saying why."""
    run = run_example(block, readme_broker.url, tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "RuntimeError" in run.stderr and "'instruction_op': 'run'" in run.stderr, run.stderr
    assert "CUDA" in run.stderr, run.stderr
    # Not `correctness` (torch raises an AssertionError for it): the host lacks what the program needs.
    assert "'kind': 'unavailable'" in run.stderr, run.stderr


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", GPU_EXAMPLES, ids=lambda block: block.saved_as or "gpu-example")
def test_each_gpu_example_runs_unchanged_on_a_gpu_broker(block: Block, tmp_path: Path) -> None:
    """The seed's example against ``kcoral broker`` on this host's GPUs (bubblewrap where it runs)."""
    pytest.importorskip("cupti", reason="the seed's example times with CUPTI (the gpu extra)")
    broker = start_readme_broker(tmp_path, "--sandbox", "auto", "--workers-per-gpu", "1")
    try:
        run = run_example(block, broker.url, tmp_path)
    finally:
        broker.stop()
    assert run.returncode == 0, run.stderr
    assert "'correct': True" in run.stdout and "latency_ms_median" in run.stdout, run.stdout
