"""The zygote link (kcoral.protocol.zygote_link): the zygote's command line read back as it was
written, commands and events as the other side reads them, the exit record."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from kcoral.protocol.worker_link import worker_id
from kcoral.protocol.zygote_link import (
    WorkerExit,
    ZygoteCommand,
    ZygoteEvent,
    ZygoteSettings,
    worker_exit_fields,
    zygote_command_line,
    zygote_event_line,
)


@pytest.mark.parametrize(
    "settings",
    [
        ZygoteSettings(connect="ipc:///run/workers.sock", slot=0, workspace=Path("/tmp/slot-0")),
        ZygoteSettings(
            connect="ipc:///run/workers.sock",
            slot=3,
            workspace=Path("/workspace"),
            gpu=1,
            max_programs=0,
            preload=("numpy",),
            limits={"memory_bytes": 4 << 30, "processes": 64},
            gpu_nodes={0: "/dev/nvidia1", 1: "/dev/nvidia0"},
            sandboxed=True,
        ),
        ZygoteSettings(connect="ipc:///x", slot=1, workspace=Path("/w"), preload=()),
    ],
)
def test_settings_round_trip_through_the_command_line(settings: ZygoteSettings) -> None:
    assert ZygoteSettings.from_argv(settings.to_argv()) == settings


def test_a_bad_command_line_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        ZygoteSettings.from_argv(["--slot", "x"])


def test_commands_and_events_are_json_lines() -> None:
    assert json.loads(zygote_command_line(ZygoteCommand.RETIRE_WORKER, worker_id("w0-1"))) == {
        "cmd": "retire_worker",
        "worker": "w0-1",
    }
    assert json.loads(zygote_command_line(ZygoteCommand.STOP)) == {"cmd": "stop"}
    assert json.loads(zygote_event_line(ZygoteEvent.FORKED, worker="w0-1", pid=7)) == {
        "event": "forked",
        "worker": "w0-1",
        "pid": 7,
    }


def test_an_exit_event_reads_back_as_the_exit_it_reports() -> None:
    killed = worker_exit_fields(
        "w0-2", 9, -signal.SIGKILL, leftovers_killed=2, reason="over its limit", instruction_index=4
    )
    exit = WorkerExit.from_event(0, json.loads(zygote_event_line(ZygoteEvent.EXITED, **killed)))
    expected = WorkerExit(0, worker_id("w0-2"), None, signal.SIGKILL, 2, reason="over its limit", instruction_index=4)
    assert exit == expected
    assert exit.describe() == "killed by signal 9 (SIGKILL); over its limit"
    clean = WorkerExit.from_event(
        1, worker_exit_fields("w1-1", 5, 0, leftovers_killed=0, reason="", instruction_index=None)
    )
    assert (clean.returncode, clean.signal, clean.describe()) == (0, None, "exit code 0")
    forged = WorkerExit.from_event(1, {"worker": "w", "instruction_index": True, "leftovers_killed": None})
    assert forged.instruction_index is None and forged.leftovers_killed == 0
