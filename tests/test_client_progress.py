"""Progress on a terminal: the blocking client and the adapters draw a status line on stderr while
they wait, only when stderr is a terminal, and wipe it at the end."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from kcoral.client.progress import ProgressEvent, TerminalProgress
from tests.helpers import RunningBroker

CLIENT_SCRIPT = """
import sys
from kcoral import Client, Program
program = Program()
module = program.upload(kind="module", source="import time\\ndef nap(s):\\n    time.sleep(s)\\n    return s\\n")
data = program.upload(kind="bytes", value=b"x" * (3 << 20))
program.return_(key="v", value=program.run(fn=program.get_function(module=module, name="nap"), args=[1.5]))
with Client(sys.argv[1]) as client:
    result = client.execute(program)
print(result.status)
"""


def run_with_stderr_on_a_terminal(argv: list[str]) -> tuple[int, str, str]:
    """Run ``argv`` with stderr on a pseudo-terminal and stdout on a pipe; (status, stdout, stderr)."""
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    os.close(leader)
    assert process.stdout is not None
    out = process.stdout.read().decode()
    process.wait(30)
    return process.returncode, out, seen.decode(errors="replace")


def test_a_blocking_client_draws_progress_on_a_terminal(shared_broker: RunningBroker, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    status, out, err = run_with_stderr_on_a_terminal([sys.executable, str(script), shared_broker.url])
    assert status == 0 and out.strip() == "COMPLETED", err
    assert "kcoral: uploading 3 MiB (1 blob)" in err
    assert "queued" in err
    assert "kcoral: running on GPU" in err
    assert err.endswith("\r\x1b[K")  # wiped: the terminal is left as it was


def test_no_progress_when_stderr_is_not_a_terminal(shared_broker: RunningBroker, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, str(script), shared_broker.url], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "COMPLETED"
    assert done.stderr == ""


def test_an_adapter_draws_progress_on_a_terminal(shared_broker: RunningBroker) -> None:
    argv = [sys.executable, "-m", "kcoral", "python", "--remote", shared_broker.url, "--"]
    argv += ["-c", "import time; time.sleep(1.5); print('done')"]
    status, out, err = run_with_stderr_on_a_terminal(argv)
    assert status == 0 and "done" in out, err
    assert "kcoral: running on GPU" in err


class FakeTerminal:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_the_status_line_moves_out_of_the_way_of_output() -> None:
    err, out = FakeTerminal(), FakeTerminal()
    display = TerminalProgress(err, out=out, show_output=True)  # type: ignore[arg-type]
    display(ProgressEvent("queued", "r", position=3))
    assert "kcoral: queued (3 ahead) 0.0 s" in err.text
    display(ProgressEvent("running", "r", gpu_ids=(0, 1), node="node-a"))
    assert "running on GPUs 0,1 at node-a" in err.text
    display(ProgressEvent("output", "r", stream="stdout", offset=0, text="hello\n"))
    assert out.text == "hello\n"
    assert err.text.endswith("\r\x1b[K\rkcoral: running on GPUs 0,1 at node-a 0.0 s\x1b[K")  # wiped, redrawn
    display(ProgressEvent("output", "r", stream="stdout", offset=99, text="after a lost piece\n"))
    assert out.text == "hello\n" and display.shown == {"stdout": 6, "stderr": 0}
    display.close()
    assert err.text.endswith("\r\x1b[K")


def test_an_adapter_streams_the_remote_output_while_it_runs(shared_broker: RunningBroker) -> None:
    code = "import sys, time; print('first', flush=True); time.sleep(2); print('second'); print('e', file=sys.stderr)"
    argv = [sys.executable, "-m", "kcoral", "python", "--remote", shared_broker.url, "--", "-c", code]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first = process.stdout.readline()
    seen_first_while_running = process.poll() is None
    rest, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert first == b"first\n" and seen_first_while_running
    assert rest == b"second\n"  # what was shown live is not written again
    assert err == b"e\n"
