"""The settings of one ``benchmark`` run: the config keys, their defaults and limits, and how a
user's config dict (``config=`` or a trailing dict argument) is read and validated."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.conditions import DEFAULT_COOL_TEMP_C, DEFAULT_IDLE_UTIL_PCT, MAX_COOL_WAIT_MS
from kcoral.timing.stats import MAX_COUNT

# Limits: a single benchmark() stays bounded even with careless configs (counts: MAX_COUNT).
MAX_BUDGET_MS: Final = 10_000.0
MAX_CLOCK_WARMUP_MS: Final = 10_000.0

DEFAULT_WARMUP_MS: Final = 25.0
DEFAULT_REPEAT_MS: Final = 100.0
DEFAULT_CLOCK_WARMUP_MS: Final = 1_000.0

# Calls run to estimate one iteration's wall time when no clock warm-up ran.
ESTIMATE_CALLS: Final = 5

METHODS: Final = frozenset({"auto", "cupti", "cuda_event"})


@dataclass(frozen=True)
class BenchmarkConfig:
    """Settings of one ``benchmark`` run; build it with ``BenchmarkConfig.from_mapping``."""

    warmup_ms: float = DEFAULT_WARMUP_MS
    repeat_ms: float = DEFAULT_REPEAT_MS
    warmup: int | None = None
    repeat: int | None = None
    flush_l2: bool = True
    launch_hold: bool = True
    clock_warmup_ms: float = DEFAULT_CLOCK_WARMUP_MS
    method: str = "auto"
    # False only to measure what the defences cost (benchmarks/timing.py --defences-cost): no rotated
    # inputs, no output checks, no trusted-state checks, no environment watch; the report then
    # says suspect, "the integrity defences were turned off".
    defences: bool = True
    # Before measuring, wait up to this long for a GPU at most cool_temp_c and at most
    # idle_util_pct busy (kcoral.timing.conditions); 0: no wait.
    wait_cool_ms: float = 0.0
    cool_temp_c: float = DEFAULT_COOL_TEMP_C
    idle_util_pct: float = DEFAULT_IDLE_UTIL_PCT

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BenchmarkConfig:
        """Validate a user's config dict; any problem raises ``ExecutionError("parse", ...)``."""
        if not isinstance(values, Mapping):
            raise ExecutionError("parse", f"benchmark config must be a dict, not {type(values).__name__}")
        unknown = sorted(str(key) for key in values if key not in CONFIG_KEYS)
        if unknown:
            raise ExecutionError(
                "parse",
                f"unknown benchmark config key(s) {unknown}; known keys: {sorted(CONFIG_KEYS)}",
            )
        method = values.get("method", "auto")
        if method not in METHODS:
            raise ExecutionError("parse", f"benchmark method must be one of {sorted(METHODS)}, not {method!r}")
        flags = {key: values.get(key, True) for key in ("flush_l2", "launch_hold", "defences")}
        for key, flag in flags.items():
            if not isinstance(flag, bool):
                raise ExecutionError("parse", f"{key} must be true or false, not {flag!r}")
        return cls(
            warmup_ms=_budget(values, "warmup_ms", DEFAULT_WARMUP_MS, MAX_BUDGET_MS),
            repeat_ms=_budget(values, "repeat_ms", DEFAULT_REPEAT_MS, MAX_BUDGET_MS),
            warmup=_count(values, "warmup", minimum=0),
            repeat=_count(values, "repeat", minimum=1),
            flush_l2=flags["flush_l2"],
            launch_hold=flags["launch_hold"],
            clock_warmup_ms=_budget(values, "clock_warmup_ms", DEFAULT_CLOCK_WARMUP_MS, MAX_CLOCK_WARMUP_MS),
            method=method,
            defences=flags["defences"],
            wait_cool_ms=_budget(values, "wait_cool_ms", 0.0, MAX_COOL_WAIT_MS),
            cool_temp_c=_bounded(values, "cool_temp_c", DEFAULT_COOL_TEMP_C, 120.0, "degrees C"),
            idle_util_pct=_bounded(values, "idle_util_pct", DEFAULT_IDLE_UTIL_PCT, 100.0, "percent"),
        )


# The config keys are the settings' fields: a setting added is a key.
CONFIG_KEYS: Final = frozenset(f.name for f in fields(BenchmarkConfig))


def _budget(values: Mapping[str, Any], key: str, default: float, cap: float) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ExecutionError("parse", f"{key} must be a non-negative number of milliseconds, not {value!r}")
    return min(float(value), cap)


def _bounded(values: Mapping[str, Any], key: str, default: float, cap: float, unit: str) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= cap:
        raise ExecutionError("parse", f"{key} must be from 0 to {cap:g} {unit}, not {value!r}")
    return float(value)


def _count(values: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ExecutionError("parse", f"{key} must be an integer >= {minimum}, not {value!r}")
    return min(value, MAX_COUNT)


def split_config(args: Sequence[Any], config: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], BenchmarkConfig]:
    """Separate the call's arguments from the benchmark config.

    The config is ``config=`` when given; otherwise a trailing non-empty dict whose keys are all
    config keys. A trailing dict that mixes config keys with other keys is taken for a mistyped
    config (a parse error) rather than silently passed on to the function.
    """
    call_args = tuple(args)
    if config is not None:
        return call_args, BenchmarkConfig.from_mapping(config)
    if call_args and isinstance(call_args[-1], dict) and call_args[-1]:
        last: dict[Any, Any] = call_args[-1]
        known = [key for key in last if key in CONFIG_KEYS]
        if len(known) == len(last):
            return call_args[:-1], BenchmarkConfig.from_mapping(last)
        if known:
            BenchmarkConfig.from_mapping(last)  # raises the parse error naming the unknown keys
    return call_args, BenchmarkConfig()
