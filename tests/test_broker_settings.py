"""What the broker decides from its settings (``resolve``), and that ``kcoral broker`` without flags
asks for the library's own defaults."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from kcoral.broker.settings import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_OPEN_FILES,
    DEFAULT_MAX_PROCESSES,
    LIMIT_NAMES,
    BrokerSettings,
    default_cpu_workers,
    default_memory_limit,
    resolve,
    slot_count,
)
from kcoral.cli import build_parser
from kcoral.cli.broker import broker_settings
from tests.helpers import start_broker


def test_the_flags_left_out_ask_for_the_library_defaults() -> None:
    args = build_parser().parse_args(["broker"])
    assert broker_settings(args, None, None) == BrokerSettings()
    assert BrokerSettings().sandbox == "bubblewrap"
    assert BrokerSettings().workers == default_cpu_workers()


def test_resolve_gives_every_limit_its_default_shared_among_the_slots(tmp_path: Path) -> None:
    settings = resolve(BrokerSettings(fake_gpus=2, workers_per_gpu=2, sandbox="none", run_dir=tmp_path))
    assert slot_count(settings) == 4
    assert tuple(settings.limits) == LIMIT_NAMES
    assert settings.limits["memory_bytes"] == default_memory_limit(4)
    assert settings.limits["processes"] == DEFAULT_MAX_PROCESSES
    assert settings.limits["file_size_bytes"] == DEFAULT_MAX_FILE_BYTES
    assert settings.limits["open_files"] == DEFAULT_MAX_OPEN_FILES
    assert settings.sandbox == "none" and settings.sandbox_reason


def test_resolve_keeps_given_limits_and_drops_zero() -> None:
    given = BrokerSettings(device="cpu", workers=1, sandbox="none", limits={"processes": 0, "memory_bytes": 5 << 30})
    settings = resolve(given)
    assert "processes" not in settings.limits
    assert settings.limits["memory_bytes"] == 5 << 30


def test_resolve_decides_auto_and_refuses_what_it_does_not_know() -> None:
    decided = resolve(BrokerSettings(device="cpu", sandbox="auto"))
    assert decided.sandbox in ("bubblewrap", "none")
    assert (decided.sandbox == "none") == bool(decided.sandbox_reason)
    with pytest.raises(ValueError, match="unknown sandbox"):
        resolve(BrokerSettings(sandbox="docker"))
    with pytest.raises(ValueError, match="unknown worker limits"):
        resolve(dataclasses.replace(BrokerSettings(sandbox="none"), limits={"cpu_seconds": 1}))


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_a_memory_limit_no_worker_can_start_under_stops_the_broker_with_what_to_give(
    tmp_path: Path, sandbox: str
) -> None:
    """Each worker starts with its zygote's private data (torch and the rest preloaded) under its
    RLIMIT_DATA: below that no thread of it can start. The broker says so once and exits
    (EX_CONFIG), rather than fork workers that abort one after another and never get ready."""
    with pytest.raises(RuntimeError) as failed:
        start_broker(
            tmp_path,
            *("--workers", "2", "--device", "cpu", "--memory-limit", "64m", "--sandbox", sandbox),
            skip_if_limit_refused=False,
        )
    text = str(failed.value)
    assert f"exited with {os.EX_CONFIG}" in text, text[-3000:]
    assert "--memory-limit 64 MiB is below what a worker holds before its program runs" in text, text[-3000:]
    assert "give at least" in text
    assert "cannot allocate memory" not in text  # no worker was forked to find out
