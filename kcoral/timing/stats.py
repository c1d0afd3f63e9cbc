"""Pure arithmetic of ``benchmark``: latency statistics, activity stability and call counts."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Final

# A single benchmark() stays bounded even with careless configs: no count, given or derived from a
# budget, goes past this.
MAX_COUNT: Final = 10_000


def summarize(samples_ms: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max and sample standard deviation of latencies in milliseconds."""
    if not samples_ms:
        raise ValueError("no samples to summarize")
    return {
        "latency_ms_median": float(statistics.median(samples_ms)),
        "latency_ms_mean": float(statistics.fmean(samples_ms)),
        "latency_ms_min": float(min(samples_ms)),
        "latency_ms_max": float(max(samples_ms)),
        "latency_ms_std": float(statistics.stdev(samples_ms)) if len(samples_ms) > 1 else 0.0,
    }


def activities_stable(signatures: Sequence[Sequence[tuple[str, str]]]) -> bool:
    """True when every call launched the same activities (kind and name), in any order."""
    canonical = {tuple(sorted(signature)) for signature in signatures}
    return len(canonical) <= 1


def count_from_budget(budget_ms: float, per_call_ms: float, *, minimum: int) -> int:
    """How many calls of ``per_call_ms`` fit the budget, between ``minimum`` and ``MAX_COUNT``."""
    if per_call_ms <= 0 or not math.isfinite(per_call_ms):
        return MAX_COUNT if budget_ms > 0 else minimum
    return max(minimum, min(MAX_COUNT, math.ceil(budget_ms / per_call_ms)))
