"""The settings of one ``compare`` run: its own keys (the verdict, the adaptive stop, the clock
filter) beside the keys it shares with ``benchmark`` (the L2 flush, the launch hold, the clock
warm-up, the timer, the wait for a cool GPU), read and validated from a user's config dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.ab_stats import DEFAULT_CONFIDENCE, DEFAULT_THRESHOLD
from kcoral.timing.config import BenchmarkConfig

# The keys of benchmark() that mean the same here (counts and repeat budgets do not: the adaptive
# stop decides how many calls run).
SHARED_KEYS: Final = frozenset(
    {
        "warmup_ms",
        "flush_l2",
        "launch_hold",
        "clock_warmup_ms",
        "method",
        "wait_cool_ms",
        "cool_temp_c",
        "idle_util_pct",
    }
)
ORDERS: Final = frozenset({"abba", "shuffled"})

DEFAULT_TARGET_HALFWIDTH: Final = 0.002
DEFAULT_BUDGET_MS: Final = 3_000.0
MAX_BUDGET_MS: Final = 60_000.0
DEFAULT_MIN_ROUNDS: Final = 8
DEFAULT_MAX_ROUNDS: Final = 2_000
# A block of one side's calls lasts about this long: long enough that the per-block costs of the
# timer (enabling CUPTI's API records, draining and attributing them) stay small, short enough that
# a round sees A and B under the same conditions.
DEFAULT_BLOCK_MS: Final = 5.0
MAX_BLOCK_CALLS: Final = 256
# flashinfer's rule, from NVBench: samples taken below 0.75 x the GPU's maximum SM clock are left out.
DEFAULT_CLOCK_FLOOR: Final = 0.75
# More than this share of samples left out (throttled, below the floor) makes the run suspect.
DEFAULT_MAX_LEFT_OUT: Final = 0.2
# A round whose A and B blocks ran at median SM clocks further apart than this share of the higher
# is set aside (the clock moved under one side only); more than ``max_left_out`` of the rounds set
# aside makes the run suspect. NVML's SM clock steps by 15 MHz: 3% is four steps at the H200's 1980.
DEFAULT_CLOCK_TOLERANCE: Final = 0.03


@dataclass(frozen=True)
class CompareConfig:
    """Settings of one ``compare`` run; build it with ``CompareConfig.from_mapping``."""

    threshold: float = DEFAULT_THRESHOLD
    confidence: float = DEFAULT_CONFIDENCE
    target_halfwidth: float = DEFAULT_TARGET_HALFWIDTH
    budget_ms: float = DEFAULT_BUDGET_MS
    min_rounds: int = DEFAULT_MIN_ROUNDS
    max_rounds: int = DEFAULT_MAX_ROUNDS
    block_ms: float = DEFAULT_BLOCK_MS
    block: int | None = None  # calls per block; overrides block_ms
    order: str = "abba"
    clock_floor: float = DEFAULT_CLOCK_FLOOR
    max_left_out: float = DEFAULT_MAX_LEFT_OUT
    clock_tolerance: float = DEFAULT_CLOCK_TOLERANCE
    seed: int | None = None
    timing: BenchmarkConfig = field(default_factory=BenchmarkConfig)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> CompareConfig:
        """Validate a user's config dict; any problem raises ``ExecutionError("parse", ...)``."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ExecutionError("parse", f"compare config must be a dict, not {type(values).__name__}")
        unknown = sorted(str(key) for key in values if key not in COMPARE_KEYS)
        if unknown:
            raise ExecutionError(
                "parse", f"unknown compare config key(s) {unknown}; known keys: {sorted(COMPARE_KEYS)}"
            )
        order = values.get("order", "abba")
        if order not in ORDERS:
            raise ExecutionError("parse", f"order must be one of {sorted(ORDERS)}, not {order!r}")
        seed = values.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ExecutionError("parse", f"seed must be an integer from 0 to 2**63 - 1, not {seed!r}")
        min_rounds = _integer(values, "min_rounds", DEFAULT_MIN_ROUNDS, 1, DEFAULT_MAX_ROUNDS)
        max_rounds = _integer(values, "max_rounds", DEFAULT_MAX_ROUNDS, 1, 100_000)
        if max_rounds < min_rounds:
            raise ExecutionError("parse", f"max_rounds ({max_rounds}) is below min_rounds ({min_rounds})")
        block = values.get("block")
        return cls(
            threshold=_number(values, "threshold", DEFAULT_THRESHOLD, 0.0, 1.0),
            confidence=_number(values, "confidence", DEFAULT_CONFIDENCE, 0.5, 0.999, open_low=True),
            target_halfwidth=_number(values, "target_halfwidth", DEFAULT_TARGET_HALFWIDTH, 0.0, 1.0),
            budget_ms=_number(values, "budget_ms", DEFAULT_BUDGET_MS, 0.0, MAX_BUDGET_MS),
            min_rounds=min_rounds,
            max_rounds=max_rounds,
            block_ms=_number(values, "block_ms", DEFAULT_BLOCK_MS, 0.0, 1_000.0, open_low=True),
            block=None if block is None else _integer(values, "block", 1, 1, MAX_BLOCK_CALLS),
            order=order,
            clock_floor=_number(values, "clock_floor", DEFAULT_CLOCK_FLOOR, 0.0, 1.0),
            max_left_out=_number(values, "max_left_out", DEFAULT_MAX_LEFT_OUT, 0.0, 1.0),
            clock_tolerance=_number(values, "clock_tolerance", DEFAULT_CLOCK_TOLERANCE, 0.0, 1.0),
            seed=seed,
            timing=BenchmarkConfig.from_mapping({k: v for k, v in values.items() if k in SHARED_KEYS}),
        )


# compare's own keys are its settings' fields (``timing`` holds the shared ones).
COMPARE_KEYS: Final = SHARED_KEYS | frozenset(f.name for f in fields(CompareConfig) if f.name != "timing")


def _number(
    values: Mapping[str, Any], key: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ExecutionError("parse", f"{key} must be a number, not {value!r}")
    if value < low or value > high or (open_low and value == low):
        bound = "above" if open_low else "from"
        raise ExecutionError("parse", f"{key} must be {bound} {low:g} to {high:g}, not {value!r}")
    return float(value)


def _integer(values: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ExecutionError("parse", f"{key} must be an integer from {low} to {high}, not {value!r}")
    return value
