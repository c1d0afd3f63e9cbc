"""benchmarks/loadgen.py: the mix is parsed strictly, and every program of a run is accounted for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.loadgen import main, parse_mix
from tests.helpers import RunningBroker


def test_the_mix_reads_kinds_parameters_and_weights() -> None:
    kinds = parse_mix("constant=4,sleep:0.2,tensor:1M=2,timeout:0.5=1", default_timeout=60)
    assert [(k.label, k.weight, k.expected) for k in kinds] == [
        ("constant", 4.0, "COMPLETED"),
        ("sleep:0.2", 1.0, "COMPLETED"),
        ("tensor:1M", 2.0, "COMPLETED"),
        ("timeout:0.5", 1.0, "error:timeout"),
    ]
    assert kinds[3].timeout_seconds == 0.5 and kinds[0].timeout_seconds == 60
    for bad, message in (
        ("nap", "unknown kind 'nap'"),
        ("constant=0", "weight must be > 0"),
        ("constant,constant", "appears twice"),
        ("sleep:x", "could not convert"),
        ("", "empty"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_mix(bad, default_timeout=60)


def test_every_program_is_accounted_for(shared_broker: RunningBroker, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    argv = ["--url", shared_broker.url, "--count", "12", "--clients", "3", "--quiet", "--strict"]
    argv += ["--mix", "constant=2,raise=1,crash=1,timeout:0.5=1", "--json", str(summary_path)]
    assert main(argv) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["submitted"] == 12 == summary["completed"] + summary["failed"] + summary["errors"]
    assert summary["accounted"] and summary["engine_errors"] == 0 and summary["unexpected"] == 0
    assert len(summary["samples"]) == 12
    assert sum(entry["count"] for label, entry in summary["kinds"].items() if label != "all") == 12
