"""CUPTI activity tracing for ``benchmark``: the tracer, the external ids that bracket each timed
call, and the grouping of activity records into per-call timings.

cupti-python is imported inside ``CuptiTracer``: this module is imported with ``kcoral.builtins``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

# CUPTI activity buffer handed out per request (records are small; 8 MiB holds ~100k).
CUPTI_BUFFER_BYTES: Final = 8 * 1024 * 1024


class Activity(NamedTuple):
    """One GPU activity record, reduced to what timing needs."""

    kind: str
    correlation_id: int
    start_ns: int
    end_ns: int
    name: str


def busy_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Length of the union of ``(start, end)`` intervals: the time during which at least one ran."""
    total = 0
    open_start: int | None = None
    open_end = 0
    for start, end in sorted(intervals):
        if open_start is None or start > open_end:
            if open_start is not None:
                total += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_start is not None:
        total += open_end - open_start
    return total


@dataclass(frozen=True)
class CallTimings:
    """What CUPTI saw of each timed call (lists in call order, calls that launched nothing left out).

    - ``spans_ms``: first activity start to last activity end.
    - ``ready_spans_ms``: from the moment the call's stream was released (the end of the launch hold)
      to the last activity end; from the first activity start when that came earlier (work on a
      stream the hold does not hold). Like Nsight Compute's duration, it includes the GPU's own time
      to take up the first launch; unlike a span after a host synchronisation, it excludes the
      host's launch overhead. Equal to ``spans_ms`` where no hold ran.
    - ``busy_ms``: the time during which at least one of the call's activities ran.
    - ``late_calls``: calls whose last CUDA API call returned after the hold had ended, so the GPU
      may have waited for the host inside the call.
    - ``unheld_calls``: calls with work that started before their hold ended (work on another
      stream, which the hold does not hold, ran beside the spin kernel).
    """

    spans_ms: list[float]
    signatures: list[list[tuple[str, str]]]
    empty_calls: int
    ready_spans_ms: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    late_calls: int = 0
    unheld_calls: int = 0
    indices: list[int] = field(default_factory=list)


def spans_by_call(
    activities: Iterable[Activity],
    external_ids: Mapping[int, int],
    call_ids: Sequence[int],
    *,
    hold_ends: Mapping[int, int] | None = None,
    api_ends: Mapping[int, int] | None = None,
) -> CallTimings:
    """Group activities by the timed call that launched them and measure each call.

    ``external_ids`` maps a CUPTI correlation id to the external id pushed around the call that made
    it; ``hold_ends`` maps a call id to the end (ns) of the hold launched before it; ``api_ends``
    maps a CUPTI correlation id to the end of that CUDA API call on the host. Calls that launched
    nothing are counted in ``empty_calls`` and left out of the lists.
    """
    wanted = set(call_ids)
    holds = hold_ends or {}
    bounds: dict[int, list[int]] = {}
    intervals: dict[int, list[tuple[int, int]]] = {}
    launched: dict[int, list[tuple[str, str]]] = {}
    for activity in activities:
        call = external_ids.get(activity.correlation_id)
        if call is None or call not in wanted:
            continue
        span = bounds.get(call)
        if span is None:
            bounds[call] = [activity.start_ns, activity.end_ns]
            intervals[call] = []
            launched[call] = []
        else:
            span[0] = min(span[0], activity.start_ns)
            span[1] = max(span[1], activity.end_ns)
        intervals[call].append((activity.start_ns, activity.end_ns))
        launched[call].append((activity.kind, activity.name))
    last_api: dict[int, int] = {}
    for correlation_id, end in (api_ends or {}).items():
        call = external_ids.get(correlation_id)
        if call is not None and call in wanted and end > last_api.get(call, 0):
            last_api[call] = end
    timings = CallTimings(spans_ms=[], signatures=[], empty_calls=0)
    late = unheld = empty = 0
    for index, call in enumerate(call_ids):
        hold_end = holds.get(call)
        if hold_end is not None and last_api.get(call, 0) > hold_end:
            late += 1
        if call not in bounds:
            empty += 1
            continue
        start, end = bounds[call]
        if hold_end is not None and start < hold_end:
            unheld += 1
        ready = min(start, hold_end) if hold_end is not None else start
        timings.spans_ms.append(max(0, end - start) / 1e6)
        timings.ready_spans_ms.append(max(0, end - ready) / 1e6)
        timings.busy_ms.append(busy_ns(intervals[call]) / 1e6)
        timings.signatures.append(launched[call])
        timings.indices.append(index)
    return dataclasses.replace(timings, empty_calls=empty, late_calls=late, unheld_calls=unheld)


class CuptiUnavailable(Exception):
    """Raised when cupti-python cannot be imported or set up; the caller falls back to events."""


# Our own external-correlation kind: torch's profiler (Kineto) pushes CUSTOM0 and CUSTOM1.
_EXTERNAL_KIND_NAME: Final = "CUSTOM2"


@dataclass
class TraceRecords:
    """What CUPTI delivered: device activities, correlation -> external id, correlation -> API end."""

    activities: list[Activity] = field(default_factory=list)
    external: dict[int, int] = field(default_factory=dict)
    api_ends: dict[int, int] = field(default_factory=dict)


class CuptiTracer:
    """Process-wide CUPTI activity collector (CUPTI takes one set of buffer callbacks per process)."""

    _instance: CuptiTracer | None = None
    _instance_error: str | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        try:
            from cupti import cupti
        except Exception as exc:  # ImportError, or a missing libcupti raised from inside the import
            raise CuptiUnavailable(f"cupti-python is not importable: {exc}") from exc
        self._cupti: Any = cupti
        kinds = cupti.ActivityKind
        self._device_kinds: list[Any] = [kinds.CONCURRENT_KERNEL, kinds.MEMCPY, kinds.MEMSET]
        if hasattr(kinds, "MEMCPY2"):
            self._device_kinds.append(kinds.MEMCPY2)
        self._correlation_kinds: list[Any] = [kinds.RUNTIME, kinds.DRIVER, kinds.EXTERNAL_CORRELATION]
        self._kind_names = {int(kind): kind.name.lower() for kind in self._device_kinds}
        self._kernel_kind = int(kinds.CONCURRENT_KERNEL)
        self._memcpy_kinds = {int(kinds.MEMCPY)} | ({int(kinds.MEMCPY2)} if hasattr(kinds, "MEMCPY2") else set())
        self._api_kinds = {int(kinds.RUNTIME), int(kinds.DRIVER)}
        self._external_record_kind = int(kinds.EXTERNAL_CORRELATION)
        self.external_kind: Any = getattr(cupti.ExternalCorrelationKind, _EXTERNAL_KIND_NAME)
        self._lock = threading.Lock()
        self._records = TraceRecords()
        self._enabled: list[Any] = []
        try:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        except Exception as exc:
            raise CuptiUnavailable(f"CUPTI activity callbacks could not be registered: {exc}") from exc

    @classmethod
    def get(cls) -> CuptiTracer:
        with cls._instance_lock:
            if cls._instance is None:
                if cls._instance_error is not None:
                    raise CuptiUnavailable(cls._instance_error)
                try:
                    cls._instance = cls()
                except CuptiUnavailable as exc:
                    # Remembered: a failed libcupti load does not get better within a process.
                    cls._instance_error = str(exc)
                    raise
            return cls._instance

    # CUPTI calls these from its own thread or from activity_flush_all; they must never raise.
    @staticmethod
    def _buffer_requested() -> tuple[int, int]:
        return CUPTI_BUFFER_BYTES, 0

    def _buffer_completed(self, records: Iterable[Any]) -> None:
        try:
            batch = TraceRecords()
            for record in records:
                kind = int(record.kind)
                if kind == self._external_record_kind:
                    if int(record.external_kind) == int(self.external_kind):
                        batch.external[int(record.correlation_id)] = int(record.external_id)
                    continue
                if kind in self._api_kinds:
                    # Only the end matters: it tells whether the host was still launching when the
                    # GPU ran out of held work. Read defensively: losing it only loses that check.
                    end = getattr(record, "end", None)
                    if end is not None:
                        batch.api_ends[int(record.correlation_id)] = int(end)
                    continue
                kind_name = self._kind_names.get(kind)
                if kind_name is None:
                    continue
                if kind == self._kernel_kind:
                    name = str(record.name)
                elif kind in self._memcpy_kinds:
                    name = f"copy_kind_{int(getattr(record, 'copy_kind', 0))}"
                else:
                    name = ""
                batch.activities.append(
                    Activity(kind_name, int(record.correlation_id), int(record.start), int(record.end), name)
                )
            with self._lock:
                self._records.activities.extend(batch.activities)
                self._records.external.update(batch.external)
                self._records.api_ends.update(batch.api_ends)
        except Exception as exc:
            print(f"kcoral.builtins: CUPTI record processing failed: {exc!r}", file=sys.stderr)

    def enable(self, *, correlation: bool) -> None:
        kinds = self._device_kinds + (self._correlation_kinds if correlation else [])
        for kind in kinds:
            if kind not in self._enabled:
                self._cupti.activity_enable(kind)
                self._enabled.append(kind)

    def disable(self) -> None:
        while self._enabled:
            kind = self._enabled.pop()
            try:
                self._cupti.activity_disable(kind)
            except self._cupti.cuptiError as exc:
                print(f"kcoral.builtins: CUPTI activity_disable failed: {exc!r}", file=sys.stderr)

    def push(self, external_id: int) -> None:
        self._cupti.activity_push_external_correlation_id(self.external_kind, external_id)

    def pop(self) -> None:
        self._cupti.activity_pop_external_correlation_id(self.external_kind)

    def drain(self) -> TraceRecords:
        """Flush every buffer (complete or not) and take what was recorded so far."""
        self._cupti.activity_flush_all(1)  # 1 = CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        with self._lock:
            records, self._records = self._records, TraceRecords()
        return records


# Each benchmark() takes a fresh block of external ids so stray records of an earlier run in the
# same process can never be attributed to this one. Inside a block, call i has id base + i, the
# hold launched before it base + HOLD_ID_OFFSET + i (stats.MAX_COUNT stays below the offset).
EXTERNAL_ID_BLOCK: Final = 1 << 20
HOLD_ID_OFFSET: Final = 1 << 19
_external_id_lock = threading.Lock()
_next_external_block = 1


def reserve_external_ids() -> int:
    """The base of a fresh block of external ids, never handed out before in this process."""
    global _next_external_block
    with _external_id_lock:
        base = _next_external_block * EXTERNAL_ID_BLOCK
        _next_external_block += 1
    return base


def hold_ends_by_call(activities: Iterable[Activity], external_ids: Mapping[int, int]) -> dict[int, int]:
    """Call id -> end (ns) of the hold kernel launched before that call."""
    ends: dict[int, int] = {}
    for activity in activities:
        external = external_ids.get(activity.correlation_id)
        if external is not None and external % EXTERNAL_ID_BLOCK >= HOLD_ID_OFFSET:
            call = external - HOLD_ID_OFFSET
            ends[call] = max(ends.get(call, 0), activity.end_ns)
    return ends
