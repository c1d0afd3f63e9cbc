"""What the broker decides from its settings (``resolve``), and that ``kcoral broker`` without flags
asks for the library's own defaults."""

from __future__ import annotations

import dataclasses
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
