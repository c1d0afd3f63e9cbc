"""The statistics of compare() on synthetic samples: the interval of B/A, its coverage, the
verdicts, the adaptive stop, the clock filter and the config."""

from __future__ import annotations

import random
from typing import TypedDict

import pytest

from kcoral.errors import ExecutionError
from kcoral.timing import ab_stats
from kcoral.timing.ab_config import CompareConfig
from kcoral.timing.ab_stats import (
    Interval,
    block_order,
    decide,
    noise,
    ratio_interval,
    round_ratio,
    stop_reason,
    trimmed_mean,
)
from kcoral.timing.conditions import wait_cool_idle
from kcoral.timing.nvml import sample_left_out


def paired_rounds(ratio: float, rounds: int, *, noise_sd: float, seed: int, drift: float = 0.02) -> list[float]:
    """Round ratios from synthetic samples: both sides share a per-round drift (a clock step, say),
    and each sample has its own noise; B's true time is ``ratio`` x A's."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        common = 1.0 + rng.uniform(-drift, drift)
        a = [0.044 * common * (1 + rng.gauss(0, noise_sd)) for _ in range(16)]
        b = [0.044 * ratio * common * (1 + rng.gauss(0, noise_sd)) for _ in range(16)]
        value = round_ratio(a, b)
        assert value is not None
        out.append(value)
    return out


def test_the_same_kernel_reads_same_and_the_interval_holds_one() -> None:
    verdicts = []
    for seed in range(10):
        interval = ratio_interval(paired_rounds(1.0, 30, noise_sd=0.01, seed=seed), seed=seed)
        assert interval.low is not None and interval.high is not None
        assert interval.low < interval.estimate < interval.high
        verdicts.append(decide(interval))
    assert verdicts.count("same") >= 9, verdicts


def test_three_percent_more_work_reads_slower_and_less_reads_faster() -> None:
    for seed in range(10):
        slower = ratio_interval(paired_rounds(1.03, 20, noise_sd=0.01, seed=seed), seed=seed)
        assert decide(slower) == "slower" and not slower.contains(1.0)
        assert slower.estimate == pytest.approx(1.03, rel=0.005)
        faster = ratio_interval(paired_rounds(1 / 1.5, 20, noise_sd=0.02, seed=seed), seed=seed)
        assert decide(faster) == "faster" and faster.high is not None and faster.high < 1


def test_noise_wider_than_the_difference_reads_unclear() -> None:
    interval = ratio_interval(paired_rounds(1.01, 6, noise_sd=0.3, seed=1, drift=0.0), seed=1)
    assert decide(interval) == "unclear"


def test_the_interval_covers_the_true_ratio_about_95_percent_of_the_time() -> None:
    trials = 200
    covered = sum(
        ratio_interval(paired_rounds(1.02, 24, noise_sd=0.02, seed=seed), resamples=1000, seed=seed).contains(1.02)
        for seed in range(trials)
    )
    # The bootstrap of a trimmed mean runs a little narrow on 24 rounds; 85% to 100% is a sound interval.
    assert 0.85 * trials <= covered <= trials, covered


def test_the_interval_is_reproducible_from_its_seed() -> None:
    ratios = paired_rounds(1.0, 12, noise_sd=0.01, seed=3)
    assert ratio_interval(ratios, seed=7) == ratio_interval(ratios, seed=7)
    assert ratio_interval(ratios, seed=7).low != ratio_interval(ratios, seed=8).low


def test_verdict_bounds_and_too_few_rounds() -> None:
    def interval(low: float, high: float) -> Interval:
        return Interval((low + high) / 2, low, high, 10, 0.95, 0)

    assert decide(interval(1.006, 1.02)) == "slower"
    assert decide(interval(1.004, 1.02)) == "unclear"  # above 1, but not clear of the threshold
    assert decide(interval(0.996, 1.004)) == "same"
    assert decide(interval(1.001, 1.004)) == "same"  # a real difference, under the threshold
    assert decide(interval(0.95, 0.99)) == "faster"
    assert decide(interval(0.95, 1.05)) == "unclear"
    # Holding 1 at a half-width within the threshold: no difference seen (the H200's two budget-cut
    # runs of a 16M add against itself).
    assert decide(interval(0.9944, 1.0025)) == "same"
    assert decide(interval(0.9998, 1.0063)) == "same"
    assert decide(interval(0.990, 1.0015)) == "unclear"  # holds 1, but wider than the threshold
    assert decide(interval(1.0002, 1.0085)) == "unclear"  # narrow enough, but 1 is outside it
    assert decide(interval(1.006, 1.02), threshold=0.05) == "same"
    few = ratio_interval([1.0, 1.01, 0.99])
    assert few.low is None and few.halfwidth is None and decide(few) == "unclear"
    assert interval(0.99, 1.01).halfwidth == pytest.approx(0.01)


def test_round_ratio_and_trimmed_mean() -> None:
    assert round_ratio([1.0, 2.0, 3.0], [4.0, 4.0]) == 2.0
    assert round_ratio([], [1.0]) is None and round_ratio([0.0], [1.0]) is None
    # On CUPTI's 32 ns grid a round's median is interpolated within the step, not a whole step apart.
    a = [0.005024] * 6 + [0.005056] * 4
    b = [0.005024] * 4 + [0.005056] * 6
    grid_ratio = round_ratio(a, b)
    assert grid_ratio is not None and 1.0 < grid_ratio < 1.006
    assert trimmed_mean([1.0] * 9 + [100.0]) == 1.0  # one outlier in ten trimmed away
    assert noise([1.0]) is None and noise([1.0, 1.0]) == 0.0


class StopLimits(TypedDict):
    min_rounds: int
    max_rounds: int
    target_halfwidth: float
    budget_ms: float


def test_the_adaptive_stop_says_which_ended_it() -> None:
    base: StopLimits = {"min_rounds": 8, "max_rounds": 100, "target_halfwidth": 0.002, "budget_ms": 1000.0}
    assert stop_reason(rounds=8, halfwidth=0.001, elapsed_ms=10, **base) == "target"
    assert stop_reason(rounds=7, halfwidth=0.001, elapsed_ms=10, **base) is None  # too few rounds yet
    assert stop_reason(rounds=8, halfwidth=0.01, elapsed_ms=10, **base) is None
    assert stop_reason(rounds=3, halfwidth=None, elapsed_ms=1000, **base) == "budget"
    assert stop_reason(rounds=100, halfwidth=0.01, elapsed_ms=10, **base) == "max_rounds"


def test_block_orders() -> None:
    assert [block_order("abba", random.Random(0).randrange, index) for index in range(4)] == ["ABBA", "BAAB"] * 2
    seen = {block_order("shuffled", random.Random(seed).randrange) for seed in range(50)}
    assert all(sorted(order) == list("AABB") for order in seen) and len(seen) > 2


def test_samples_left_out_by_clock() -> None:
    assert sample_left_out(1980, 0, 1485.0) is None
    assert sample_left_out(1980, 0x1, 1485.0) is None  # idle is a state, not a slowdown
    assert sample_left_out(1980, 0x4, 1485.0) is None  # the power cap alone: a steady GEMM's state
    assert sample_left_out(1400, 0x4, 1485.0) == "below_clock_floor"  # capped under the floor
    assert sample_left_out(1980, 0x4 | 0x20, 1485.0) == "throttled"  # software thermal slowdown
    assert sample_left_out(1980, 0x8, 1485.0) == "throttled"  # hardware slowdown
    assert sample_left_out(1400, 0, 1485.0) == "below_clock_floor"
    assert sample_left_out(None, None, 1485.0) is None and sample_left_out(1400, 0, None) is None


class ScriptedNvml:
    def __init__(self, temperatures: list[int], utilization: int = 0) -> None:
        self.temperatures = temperatures
        self.utilization = utilization

    def temperature_c(self) -> int:
        return self.temperatures.pop(0) if len(self.temperatures) > 1 else self.temperatures[0]

    def utilization_pct(self) -> int:
        return self.utilization


def test_the_wait_for_a_cool_idle_gpu() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    cooled = wait_cool_idle(
        ScriptedNvml([70, 60, 45]),  # type: ignore[arg-type]
        max_wait_ms=5000,
        cool_temp_c=50,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert cooled.reached is True and cooled.temperature_c == 45 and cooled.waited_ms == pytest.approx(100)
    busy = wait_cool_idle(
        ScriptedNvml([40], utilization=90),  # type: ignore[arg-type]
        max_wait_ms=200,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert busy.reached is False and "90% busy" in busy.reason
    assert wait_cool_idle(None, max_wait_ms=0, clock=lambda: 0.0, sleep=sleep).asked is False
    assert wait_cool_idle(None, max_wait_ms=10, clock=lambda: 0.0, sleep=sleep).reached is None


def test_compare_config() -> None:
    default = CompareConfig.from_mapping(None)
    assert default.threshold == ab_stats.DEFAULT_THRESHOLD == 0.005 and default.order == "abba"
    custom = CompareConfig.from_mapping({"threshold": 0.01, "budget_ms": 500, "flush_l2": False, "seed": 4})
    assert custom.threshold == 0.01 and custom.budget_ms == 500 and custom.timing.flush_l2 is False
    for bad in (
        {"repeat": 10},
        {"order": "abab"},
        {"threshold": -1},
        {"seed": "x"},
        {"min_rounds": 9, "max_rounds": 8},
    ):
        with pytest.raises(ExecutionError) as caught:
            CompareConfig.from_mapping(bad)
        assert caught.value.kind == "parse"
