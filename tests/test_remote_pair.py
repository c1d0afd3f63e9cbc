"""``kcoral remote -- WORKLOAD A.py B.py``: the paired rounds of two candidates (with a stand-in for
the harness's brackets) and the command line that asks for them."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kcoral.tools import remote
from kcoral.tools.adapter import UsageError
from kcoral.workloads.pair import PairSettings, paired_rounds

WORKLOAD = """
import torch

def make_inputs(seed):
    return (torch.ones(4) * seed,)

def reference(x):
    return x * 2
"""
NULL_MS = 0.014


def brackets(a_ms: float, b_ms: float, noise: float, seen: list[tuple[str, tuple[int, ...]]]) -> Any:
    """A harness stand-in: a batch's per-call bracket is the side's net time, the null's overhead and
    noise shared by the round (a drift both sides see)."""
    rng = random.Random(3)

    def bracket_batch(side: str, seeds: list[int]) -> float:
        seen.append((side, tuple(seeds)))
        drift = 1 + rng.gauss(0, noise)
        return (a_ms if side == "a" else b_ms) * drift + NULL_MS

    return bracket_batch


def test_the_rounds_pair_both_candidates_on_the_same_seeds_abba() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []
    counter = itertools.count(1)
    done = paired_rounds(
        brackets(0.176, 0.176 * 1.5, 0.002, seen), batch=4, null_ms=NULL_MS, settings=PairSettings(), seed=1,
        new_seed=lambda: next(counter),
    )  # fmt: skip
    rounds = [seen[i : i + 4] for i in range(0, len(seen), 4)]
    # ABBA and its mirror in turn: each side takes the outer batches every other round.
    assert ["".join(side for side, _ in one) for one in rounds] == ["abba", "baab"] * (len(rounds) // 2) + (
        ["abba"] if len(rounds) % 2 else []
    )
    assert all(len({seeds for _, seeds in one}) == 1 for one in rounds)  # the same inputs for A and B
    assert len({one[0][1] for one in rounds}) == len(rounds)  # fresh inputs each round
    assert done.stop == "target" and done.interval is not None
    assert done.interval.estimate == pytest.approx(1.5, rel=0.01)  # the null's overhead left out


def test_the_same_candidate_twice_is_same_and_a_slower_one_is_slower() -> None:
    from kcoral.timing.ab_stats import decide, ratio_interval

    same = paired_rounds(brackets(0.044, 0.044, 0.002, []), batch=8, null_ms=NULL_MS, settings=PairSettings(), seed=2)
    assert decide(ratio_interval(same.ratios)) == "same"
    slower = paired_rounds(
        brackets(0.044, 0.0453, 0.002, []), batch=8, null_ms=NULL_MS, settings=PairSettings(), seed=2
    )
    assert decide(ratio_interval(slower.ratios)) == "slower"


def test_noise_ends_on_the_budget() -> None:
    clock = itertools.count(0.0, 0.5)
    done = paired_rounds(
        brackets(0.044, 0.045, 0.3, []), batch=8, null_ms=NULL_MS, seed=3, clock=lambda: next(clock),
        settings=PairSettings(budget_s=5.0, target_halfwidth=0.0001),
    )  # fmt: skip
    assert done.stop == "budget" and done.elapsed_s >= 5.0


def _remote_args(tmp_path: Path, *tool_args: str) -> argparse.Namespace:
    folder = tmp_path / "double"
    folder.mkdir(exist_ok=True)
    (folder / "workload.py").write_text(WORKLOAD)
    return argparse.Namespace(
        remote="tcp://127.0.0.1:1", send=[], fetch=[], timeout=60.0, connect_timeout=1.0,
        tool_args=["--", "double", *tool_args], server_key=None, client_key=None,
    )  # fmt: skip


def test_kcoral_remote_with_two_candidates_asks_for_the_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("def custom_kernel(x):\n    return x * 2\n")
    seen: dict[str, Any] = {}

    def fake_execute(options: Any, function: str, args: list[Any], **kwargs: Any) -> tuple[int, dict[str, Any]]:
        seen.update(kwargs, function=function, args=args[:3], sent=sorted(s.dest for s in options.sends))
        return 0, {"report": {"correct": True, "verdict": "same"}}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(remote, "execute", fake_execute)
    assert remote.main(_remote_args(tmp_path, "a.py", "b.py")) == 0
    assert seen["function"] == "evaluate_trusted_pair" and seen["report_only_on_stdout"] is True
    assert seen["args"] == ["double", "a.py", "b.py"] and seen["sent"] == ["a.py", "b.py", "double"]
    assert json.loads(capsys.readouterr().out) == {"correct": True, "verdict": "same"}
    with pytest.raises(UsageError):
        remote.main(_remote_args(tmp_path, "a.py", "b.py", "a.py"))
    with pytest.raises(UsageError):
        remote.main(_remote_args(tmp_path, "a.py", "missing.py"))
