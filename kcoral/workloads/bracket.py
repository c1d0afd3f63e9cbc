"""The harness's own measurement of a role's calls, and what it makes of the candidate's CUPTI figure
(pure arithmetic: no torch, CPU-testable).

A *bracket* is one batch of calls timed by the harness on the GPU clock of its own process: its
start event, then the calls' inputs copied into the shared buffers and the L2 flushed, then the
gate opened (the candidate's queued calls may start), a wait for the candidate's completion word,
the copy of the outputs into the harness's own memory (the commit), and its end event; divided by
the calls of the batch. The inputs exist only after
the start event, and a committed output is checked, so the GPU work of a correct call lies inside
the bracket; two processes' contexts take turns on the GPU, so the bracket also holds the harness's
own work around it. The *null* role (a call that launches nothing: its output is a tensor made
beforehand) is bracketed the same way in the same run, before the candidate is imported; its median
is the bracket's fixed overhead. A role's *net* time is its bracket median less the null's.

The CUPTI figure of the candidate's process (``latency_ms_median`` of its benchmark report) is kept
as the time where it agrees with the net bracket: not above it by more than ``ABOVE_SHARE`` plus the
absolute tolerance, and not below it by more than ``BELOW_SHARE`` plus the absolute tolerance (the
larger of ``ABS_TOLERANCE_MS`` and ``NULL_SPREAD_FACTOR`` times the null's interquartile range).
Otherwise the role is ``suspect`` and its time is the net bracket (or the CUPTI figure, where that is
the larger: a time is never taken below what either clock says).

What the bracket does not hold: a candidate that sets the completion word before its work is done
shortens the bracket by at most the harness's latency in noticing it (about 0.085 ms a batch on the
H200), and its outputs are then committed while its work still runs (a failed check, unless the two
processes' turns on the GPU happen to let the work finish first).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kcoral.timing.findings import HOST_GAP_REASON, OTHER_PROCESS_REASON

ABOVE_SHARE: Final = 0.25
BELOW_SHARE: Final = 0.10
ABS_TOLERANCE_MS: Final = 0.004
NULL_SPREAD_FACTOR: Final = 3.0
# The brackets summarised: the latest share of the calls (the first ones can still see the SM clock
# ramp up); at least this many.
SUMMARY_SHARE: Final = 0.75
SUMMARY_MIN: Final = 8
# The host-time finding of the candidate's timer ("host time far above GPU time") stands only where
# the candidate's host time is this far above the baseline's of the same run.
HOST_FACTOR: Final = 1.5
HOST_MARGIN_MS: Final = 0.05


class TimeSource(StrEnum):
    """Which figure a role's time is: its CUPTI figure (where the bracket confirms it) or the bracket."""

    CUPTI = "cupti"
    BRACKET = "bracket"


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


@dataclass(frozen=True)
class BracketSummary:
    """A role's brackets in milliseconds per call (harness GPU clock; one sample per batch of calls),
    summarised over its latest samples."""

    calls: int
    median_ms: float
    min_ms: float
    iqr_ms: float
    host_median_ms: float | None = None

    @classmethod
    def of(cls, brackets_ms: Sequence[float], host_ms: Sequence[float] = ()) -> BracketSummary:
        if not brackets_ms:
            raise ValueError("no brackets to summarise")
        keep = max(min(SUMMARY_MIN, len(brackets_ms)), int(len(brackets_ms) * SUMMARY_SHARE))
        latest = list(brackets_ms[-keep:])
        low, high = _quartiles(latest)
        host = list(host_ms[-keep:])
        return cls(
            calls=len(latest),
            median_ms=float(statistics.median(latest)),
            min_ms=float(min(latest)),
            iqr_ms=float(high - low),
            host_median_ms=float(statistics.median(host)) if host else None,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "samples": self.calls,
            "median_ms": round(self.median_ms, 6),
            "min_ms": round(self.min_ms, 6),
            "iqr_ms": round(self.iqr_ms, 6),
            "host_median_ms": None if self.host_median_ms is None else round(self.host_median_ms, 6),
        }


def tolerance_ms(null: BracketSummary) -> float:
    return max(ABS_TOLERANCE_MS, NULL_SPREAD_FACTOR * null.iqr_ms)


@dataclass(frozen=True)
class Judgement:
    """What the harness makes of one role's two figures."""

    net_ms: float
    cupti_ms: float | None
    time_ms: float
    time_source: TimeSource
    agrees: bool
    low_ms: float
    high_ms: float
    reason: str | None

    def describe(self) -> dict[str, Any]:
        return {
            "net_ms": round(self.net_ms, 6),
            "cupti_ms": self.cupti_ms,
            "agrees": self.agrees,
            "accepted_range_ms": [round(self.low_ms, 6), round(self.high_ms, 6)],
            "time_source": self.time_source,
        }


def judge(role: BracketSummary, null: BracketSummary, cupti_ms: float | None) -> Judgement:
    """The role's time: its CUPTI figure where it agrees with the net bracket, else the bracket."""
    net = max(0.0, role.median_ms - null.median_ms)
    slack = tolerance_ms(null)
    low = max(0.0, net * (1.0 - BELOW_SHARE) - slack)
    high = net * (1.0 + ABOVE_SHARE) + slack
    if cupti_ms is None or not cupti_ms == cupti_ms or cupti_ms <= 0:
        no_figure = "the candidate's process gave no CUPTI figure"
        return Judgement(net, None, net, TimeSource.BRACKET, False, low, high, no_figure)
    if low <= cupti_ms <= high:
        return Judgement(net, cupti_ms, cupti_ms, TimeSource.CUPTI, True, low, high, None)
    if cupti_ms < low:
        reason = (
            f"the CUPTI figure of the candidate's process ({cupti_ms:.4f} ms) is below the harness's bracket "
            f"({net:.4f} ms net of the null call's {null.median_ms:.4f} ms; accepted from {low:.4f} ms): "
            "the bracket is reported as the time"
        )
        return Judgement(net, cupti_ms, net, TimeSource.BRACKET, False, low, high, reason)
    reason = (
        f"the CUPTI figure of the candidate's process ({cupti_ms:.4f} ms) is above the harness's bracket "
        f"({net:.4f} ms net; accepted up to {high:.4f} ms): the larger figure is reported"
    )
    return Judgement(net, cupti_ms, cupti_ms, TimeSource.CUPTI, False, low, high, reason)


def _host_ms(report: dict[str, Any] | None) -> float | None:
    value = (report or {}).get("host_ms_median")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timer_reasons(reasons: Sequence[str], report: dict[str, Any] | None, baseline: dict[str, Any] | None) -> list[str]:
    """The findings of the candidate's own timer that stand in the harness's report.

    Another process on the GPU is the harness itself (it makes and hands over every call's inputs):
    the bracket, not NVML, covers work done elsewhere. The host-time finding is judged against the
    baseline's host time in the same run: a host-bound workload is host-bound for both."""
    kept: list[str] = []
    for reason in reasons:
        text = str(reason)
        if text.startswith(OTHER_PROCESS_REASON):
            continue
        if text.startswith(HOST_GAP_REASON) and baseline is not None:
            mine, theirs = _host_ms(report), _host_ms(baseline)
            if mine is not None and theirs is not None and mine <= HOST_FACTOR * theirs + HOST_MARGIN_MS:
                continue
            if mine is not None and theirs is not None:
                text += f" (and {mine:.4f} ms is above {HOST_FACTOR:g}x the baseline's {theirs:.4f} ms in this run)"
        kept.append(text)
    return kept


def stale_pass_probability(kept: int, stale_share: float) -> float:
    """The chance that a candidate whose outputs are stale in ``stale_share`` of the calls has none of
    them among ``kept`` checked calls (each chosen independently of what the candidate did)."""
    return float((1.0 - stale_share) ** kept)


def speedup(baseline_ms: float | None, candidate_ms: float | None) -> float | None:
    if not baseline_ms or not candidate_ms or baseline_ms <= 0 or candidate_ms <= 0:
        return None
    return baseline_ms / candidate_ms
