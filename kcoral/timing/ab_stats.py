"""The statistics of ``compare``: paired rounds of A and B, the ratio B/A with a confidence
interval, the verdict, and when to stop sampling (pure: no GPU, no torch).

The method, stated once:

- The calls run in *rounds*; each round times A and B in blocks on the same inputs (``ABBA`` and
  its mirror ``BAAB`` in turn, or the four blocks ``AABB`` in a shuffled order). A round's ratio
  is the median of its B samples over the median of its A samples. The mirror matters: between
  rounds the stop check leaves the GPU idle, and a block next to that gap does not run as one
  between two blocks; with ``ABBA`` alone it was always A's (on the H200 a 16M add against itself
  read B/A 1.0019, its interval [1.0005, 1.0034], and on the CPU the same callable read faster
  than itself), so each side takes the outer blocks in every other round. Pairing within the
  round cancels what A and B share at that moment (a clock step, the other tenant of the host,
  thermal drift) instead of leaving it in the noise of both sides.
- The estimate of B/A is the geometric mean of the round ratios, trimmed by ``TRIM`` at each end
  (a round hit by a context switch moves it little): ``exp(trimmed mean of log ratio)``.
- Its interval is a percentile bootstrap over rounds: ``BOOTSTRAP_RESAMPLES`` resamples of the
  rounds with replacement (a paired block bootstrap), the same trimmed mean of each, and the
  ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles, from a seeded generator (the
  report gives the seed, so the interval can be computed again from the samples).
- The verdict against a threshold ``t`` (default 0.5%, NVBench compare's "0.5% clear of the
  noise"): ``slower`` when the whole interval lies above ``1 + t``, ``faster`` when it lies below
  ``1 - t``, ``same`` when it lies within ``[1 - t, 1 + t]`` or holds 1 with a relative half-width
  of at most ``t`` (no difference seen at the resolution asked for), and ``unclear`` otherwise (the
  interval straddles a bound: more samples, or a quieter GPU, would decide it).
- The adaptive stop: after ``min_rounds``, sampling stops when the interval's relative
  half-width, ``(high - low) / 2 / estimate``, is at most the target, or when the time budget or
  the most rounds are spent; the report says which ended it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kcoral.timing.stats import summarize

VERDICT_FASTER: Final = "faster"
VERDICT_SLOWER: Final = "slower"
VERDICT_SAME: Final = "same"
VERDICT_UNCLEAR: Final = "unclear"
VERDICTS: Final = (VERDICT_FASTER, VERDICT_SLOWER, VERDICT_SAME, VERDICT_UNCLEAR)

DEFAULT_THRESHOLD: Final = 0.005
DEFAULT_CONFIDENCE: Final = 0.95
# 2000 resamples put the 2.5% quantile on 50 resamples: its own error stays well under the
# interval's width. The stop checks after each round use fewer (they only decide when to stop).
BOOTSTRAP_RESAMPLES: Final = 2000
CHECK_RESAMPLES: Final = 500
TRIM: Final = 0.1
# Fewer rounds than this give no interval: a bootstrap of three ratios says nothing.
MIN_ROUNDS_FOR_INTERVAL: Final = 4


class StopReason(StrEnum):
    """What ended the sampling: the interval reached the target half-width, the time budget ran
    out, or the most rounds were run."""

    TARGET = "target"
    BUDGET = "budget"
    MAX_ROUNDS = "max_rounds"


METHOD: Final = (
    f"percentile bootstrap over rounds ({BOOTSTRAP_RESAMPLES} resamples) of the {TRIM:.0%}-trimmed geometric "
    "mean of the per-round ratios median(B)/median(A)"
)


@dataclass(frozen=True)
class Interval:
    """The estimate of B/A and its interval; ``low``/``high`` are None with too few rounds."""

    estimate: float
    low: float | None
    high: float | None
    rounds: int
    confidence: float
    seed: int

    @property
    def halfwidth(self) -> float | None:
        """Relative half-width: ``(high - low) / 2 / estimate``."""
        if self.low is None or self.high is None or self.estimate <= 0:
            return None
        return (self.high - self.low) / 2 / self.estimate

    def contains(self, value: float) -> bool:
        return self.low is not None and self.high is not None and self.low <= value <= self.high


def round_ratio(a_ms: Sequence[float], b_ms: Sequence[float]) -> float | None:
    """median(B) / median(A) of one round; None when a side has no sample or A's median is not positive.

    The medians are ``benchmark``'s (``stats.summarize``): on a coarse clock grid (CUPTI's 32 ns on
    the H200) interpolated within the step, so that a round's ratio for a 5 us kernel does not jump
    by whole steps of 0.6%.
    """
    if not a_ms or not b_ms:
        return None
    a = float(summarize(a_ms)["latency_ms_median"] or 0.0)
    b = float(summarize(b_ms)["latency_ms_median"] or 0.0)
    if a <= 0 or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return b / a


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``values`` without the ``trim`` share at each end (at least one value kept)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    cut = int(trim * len(ordered))
    kept = ordered[cut : len(ordered) - cut] or ordered
    return math.fsum(kept) / len(kept)


def ratio_interval(
    ratios: Sequence[float],
    *,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The estimate of B/A from per-round ratios and its bootstrap interval (see the module)."""
    if not ratios:
        raise ValueError("no rounds")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, not {confidence}")
    logs = [math.log(r) for r in ratios]
    estimate = math.exp(trimmed_mean(logs))
    if len(logs) < MIN_ROUNDS_FOR_INTERVAL:
        return Interval(estimate, None, None, len(logs), confidence, seed)
    import numpy

    values = numpy.asarray(logs, dtype=numpy.float64)
    count = len(values)
    generator = numpy.random.Generator(numpy.random.PCG64(seed))
    drawn = numpy.sort(values[generator.integers(0, count, size=(resamples, count))], axis=1)
    cut = int(TRIM * count)
    means = drawn[:, cut : count - cut].mean(axis=1) if count - 2 * cut > 0 else drawn.mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = numpy.quantile(means, [alpha, 1 - alpha])
    return Interval(estimate, math.exp(float(low)), math.exp(float(high)), count, confidence, seed)


def decide(interval: Interval, threshold: float = DEFAULT_THRESHOLD) -> str:
    """``faster``, ``slower``, ``same`` or ``unclear`` for B against A (see the module)."""
    if interval.low is None or interval.high is None:
        return VERDICT_UNCLEAR
    if interval.low > 1 + threshold:
        return VERDICT_SLOWER
    if interval.high < 1 - threshold:
        return VERDICT_FASTER
    if interval.low >= 1 - threshold and interval.high <= 1 + threshold:
        return VERDICT_SAME
    # NVBench's "clear of the noise": an interval that holds 1 and is no wider than the threshold
    # on each side saw no difference at the resolution asked for. (On the H200 a 16M add against
    # itself gave [0.9944, 1.0025] and [0.9998, 1.0063] in 2 of 10 runs cut by the budget.)
    halfwidth = interval.halfwidth
    if interval.low <= 1 <= interval.high and halfwidth is not None and halfwidth <= threshold:
        return VERDICT_SAME
    return VERDICT_UNCLEAR


def answer(interval: Interval, threshold: float, integrity_verdict: str) -> dict[str, Any]:
    """The report's answer: the verdict (``unclear`` where the run's integrity verdict is not
    ``ok``), the one the interval gives (``verdict_if_trusted``), and the ratio B/A with its
    interval."""
    statistical = decide(interval, threshold)
    return {
        "verdict": statistical if integrity_verdict == "ok" else VERDICT_UNCLEAR,
        "verdict_if_trusted": statistical,
        "ratio": interval.estimate,
        "ratio_low": interval.low,
        "ratio_high": interval.high,
        "halfwidth": interval.halfwidth,
    }


def stop_reason(
    *,
    rounds: int,
    halfwidth: float | None,
    elapsed_ms: float,
    min_rounds: int,
    max_rounds: int,
    target_halfwidth: float,
    budget_ms: float,
) -> StopReason | None:
    """Why sampling stops now (``target``, ``budget``, ``max_rounds``), or None to go on.

    The budget ends a run even before ``min_rounds``: it bounds the wall time whatever the call costs.
    """
    if rounds >= min_rounds and halfwidth is not None and halfwidth <= target_halfwidth:
        return StopReason.TARGET
    if elapsed_ms >= budget_ms:
        return StopReason.BUDGET
    if rounds >= max_rounds:
        return StopReason.MAX_ROUNDS
    return None


def noise(samples_ms: Sequence[float]) -> float | None:
    """Relative standard deviation (stdev / mean), NVBench's "noise"; None for fewer than two samples."""
    if len(samples_ms) < 2:
        return None
    mean = statistics.fmean(samples_ms)
    return float(statistics.stdev(samples_ms) / mean) if mean > 0 else None


def block_order(order: str, randbelow: Any, round_index: int = 0) -> str:
    """The four blocks of round ``round_index``: ``ABBA`` in even rounds and ``BAAB`` in odd ones,
    or a shuffle of ``AABB`` (``randbelow(n)`` draws)."""
    if order == "abba":
        return "ABBA" if round_index % 2 == 0 else "BAAB"
    blocks = list("AABB")
    for i in range(len(blocks) - 1, 0, -1):
        j = randbelow(i + 1)
        blocks[i], blocks[j] = blocks[j], blocks[i]
    return "".join(blocks)
