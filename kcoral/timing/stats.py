"""Pure arithmetic of ``benchmark``: latency statistics, activity stability and call counts."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Final

# A single benchmark() stays bounded even with careless configs: no count, given or derived from a
# budget, goes past this.
MAX_COUNT: Final = 10_000


# A clock step this small against the median changes nothing worth interpolating.
MIN_RESOLUTION_SHARE: Final = 0.002
# A "step" this large against the median is no clock's step but a coincidence of few values.
MAX_RESOLUTION_SHARE: Final = 0.05
# How often a value comes up to count as a point of the clock's grid, and the share of samples
# that must lie on the grid.
GRID_MIN_COUNT: Final = 3
GRID_SHARE: Final = 0.75


def clock_resolution_ns(samples_ms: Sequence[float]) -> int | None:
    """The step of the clock the samples were read with (ns), where it is coarse; else None.

    The step is the greatest common divisor of the values that come up at least
    :data:`GRID_MIN_COUNT` times (two of them at least), where most samples are whole multiples
    of it: a few samples off the grid (a call whose span was trimmed) do not hide it, as they did
    with a divisor of all samples. None for samples that are not whole nanoseconds (CUDA events).
    """
    whole: list[int] = []
    for value in samples_ms:
        ns = value * 1e6
        if abs(ns - round(ns)) > 1e-3:
            return None
        whole.append(round(ns))
    counts = Counter(whole)
    frequent = [value for value, count in counts.items() if count >= GRID_MIN_COUNT and value > 0]
    if len(frequent) < 2:
        return None
    step = 0
    for value in frequent:
        step = math.gcd(step, value)
    on_grid = sum(count for value, count in counts.items() if value % step == 0)
    if step < 2 or step > MAX_RESOLUTION_SHARE * statistics.median(whole) or on_grid < GRID_SHARE * len(whole):
        return None
    return step


def summarize(samples_ms: Sequence[float]) -> dict[str, float | int | None]:
    """Median, mean, min, max and sample standard deviation of latencies in milliseconds.

    Where every sample is a whole number of a clock's steps (CUPTI's timestamps on the H200 move
    in 32 ns steps), the median is that of grouped data: interpolated within the step the middle
    falls in (``statistics.median_grouped``), so that it can land between two steps as the true
    duration does. The plain median of such samples jumps a whole step: a 256K add read 1.856 or
    1.888 us from one program to the next (1.7%), and at times 1.920 (3.4%), for the same kernel.
    """
    if not samples_ms:
        raise ValueError("no samples to summarize")
    resolution = clock_resolution_ns(samples_ms)
    median = float(statistics.median(samples_ms))
    if resolution is not None and resolution * 1e-6 > MIN_RESOLUTION_SHARE * median:
        median = float(statistics.median_grouped(samples_ms, interval=resolution * 1e-6))
    return {
        "latency_ms_median": median,
        "clock_resolution_ns": resolution,
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
