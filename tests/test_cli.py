"""The ``kcoral`` command as a newcomer meets it: one-line errors, exit statuses, flags, help."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kcoral import Client, TransportError
from kcoral.cli import EXIT_CONFIG, EXIT_UNAVAILABLE, EXIT_USAGE
from kcoral.units import format_bytes, parse_size
from tests.helpers import free_port

CLI_TIMEOUT_S = 60


def kcoral(
    *argv: str, env: dict[str, str] | None = None, module: str = "kcoral.cli"
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=full_env
    )


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["broker", "--listen", "localhost:5555"], "did you mean tcp://localhost:5555?"),
        (["router", "--nodes-listen", "127.0.0.1:6001"], "did you mean tcp://127.0.0.1:6001?"),
        (["broker", "--cache-bytes", "12X"], "--cache-bytes: expected a byte count or a size like 512K"),
        (["broker", "--max-queued", "many"], "--max-queued: expected an integer, not 'many'"),
        (["--log-level", "verbose", "status"], "--log-level: expected one of debug, info"),
        (["status", "--log-level", "verbose"], "--log-level: expected one of debug, info"),
    ],
)
def test_bad_flags_get_one_line_naming_the_flag(argv: list[str], expected: str) -> None:
    done = kcoral(*argv)
    assert done.returncode == EXIT_USAGE
    line = one_line(done.stderr)
    assert expected in line and "_size" not in line and "--help" in line


def test_a_bad_log_level_in_the_environment_is_named() -> None:
    done = kcoral("status", env={"KCORAL_LOG_LEVEL": "loud"})
    assert done.returncode == EXIT_USAGE
    assert "$KCORAL_LOG_LEVEL" in one_line(done.stderr)


def test_status_of_a_web_url_is_one_line() -> None:
    done = kcoral("status", "http://127.0.0.1:5555")
    assert done.returncode == EXIT_USAGE
    assert "bad service URL 'http://127.0.0.1:5555'" in one_line(done.stderr)


def test_status_of_nothing_says_connection_refused() -> None:
    done = kcoral("status", f"tcp://127.0.0.1:{free_port()}")
    assert done.returncode == EXIT_UNAVAILABLE
    assert "connection refused" in one_line(done.stderr)


@pytest.mark.parametrize("service", ["broker", "router"])
def test_a_port_in_use_is_one_line_and_leaves_no_run_directory(service: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        url = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        argv = [service, "--listen", url]
        argv += ["--fake-gpus", "1", "--sandbox", "none"] if service == "broker" else []
        done = kcoral(*argv, env={"TMPDIR": str(tmp_path)})
    assert done.returncode == EXIT_CONFIG
    line = one_line(done.stderr)
    assert f"cannot listen on {url}: Address already in use" in line
    assert list(tmp_path.iterdir()) == []  # the temporary run directory went too


def test_version_and_python_dash_m() -> None:
    from kcoral import __version__

    assert kcoral("--version").stdout.strip() == f"kcoral {__version__}"
    assert kcoral("--version", module="kcoral").stdout.strip() == f"kcoral {__version__}"


def test_help_shows_defaults_with_sizes_human_readable() -> None:
    text = " ".join(kcoral("broker", "--help").stdout.split())
    assert "--cache-bytes SIZE memory blob cache (default: 1 GiB)" in text
    assert "--max-queued N programs waiting before 'busy' (default: 1024)" in text
    assert "--listen URL where clients connect, tcp://HOST:PORT (default: tcp://127.0.0.1:5555)" in text


def test_sizes_read_and_print_as_people_write_them() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("8 g") == 8 << 30
    assert parse_size("4096") == 4096
    for bad in ("", "-1G", "1X", "G"):
        with pytest.raises(ValueError, match="expected a byte count"):
            parse_size(bad)
    assert format_bytes(1 << 30) == "1 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"


def test_global_flags_after_the_subcommand_and_a_ready_line(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "broker.log"
    argv = [sys.executable, "-m", "kcoral", "broker", "--listen", url, "--fake-gpus", "1", "--sandbox", "none"]
    argv += ["--run-dir", str(tmp_path / "run"), "--log-json", "--log-level", "info"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        events: list[dict[str, object]] = []
        while not any(e.get("event") == "broker_ready" for e in events):
            assert time.monotonic() < deadline and process.poll() is None, log_path.read_text()
            time.sleep(0.1)
            events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        ready = next(e for e in events if e["event"] == "broker_ready")
        assert ready["endpoint"] == url and ready["slots"] == 1
        with Client(url, connect_timeout_seconds=5) as client:  # ready means it takes work now
            assert client.health()["workers"]["idle"] == 1
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_the_connect_timeout_is_waited_in_full_and_says_connection_refused() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TransportError) as caught, Client(url, connect_timeout_seconds=4):
        pass
    waited = time.monotonic() - started
    assert 4 <= waited < 4 + 3
    assert f"no answer from {url} within 4 s: connection refused" in str(caught.value)


def test_an_unresolvable_host_name_is_told_apart_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"cannot resolve the host name 'no-such-host\.invalid'"):
        Client("tcp://no-such-host.invalid:5555", connect_timeout_seconds=20).open()
    assert time.monotonic() - started < 10  # a resolver answers at once; not the 20 s timeout
