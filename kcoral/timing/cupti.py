"""CUPTI activity tracing for ``benchmark``: the tracer, its clock, and the external ids that mark
the timer's own work.

cupti-python is imported inside ``CuptiTracer``: this module is imported with ``kcoral.builtins``.
Which records belong to which timed call is decided in ``kcoral.timing.windows`` (by time window,
not by correlation id); this module only collects the records.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

# CUPTI activity buffer handed out per request (records are small; 8 MiB holds ~100k).
CUPTI_BUFFER_BYTES: Final = 8 * 1024 * 1024

# External ids: each measurement takes a fresh, random block, so that neither stray records of an
# earlier run nor a candidate that guesses ids can pass work off as the timer's own. Inside a block,
# timed call i is ``base + i``, the hold launched before it ``base + HOLD_ID_OFFSET + i``, the
# timer's work between calls (L2 flush, inputs, output snapshots) ``base + GAP_ID_OFFSET + i``, and
# the sentinel work that checks the activity kinds ``base + SENTINEL_ID_OFFSET``. stats.MAX_COUNT
# stays below the offsets.
EXTERNAL_ID_BLOCK: Final = 1 << 20
HOLD_ID_OFFSET: Final = 1 << 18
GAP_ID_OFFSET: Final = 2 << 18
SENTINEL_ID_OFFSET: Final = 3 << 18
EXTERNAL_BLOCK_BITS: Final = 40


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


def cupti_thread_id() -> int:
    """The calling thread as CUPTI's API records name it (their ``threadId``): on Linux the thread's
    pthread id cut to 32 bits, which is ``threading.get_ident()``'s, not the OS thread id of
    ``threading.get_native_id()`` (measured on the H200: ``benchmarks/cupti_clock.py``)."""
    return threading.get_ident() & 0xFFFF_FFFF


def reserve_external_ids() -> int:
    """The base of a fresh, unpredictable block of external ids."""
    return (secrets.randbits(EXTERNAL_BLOCK_BITS) + 1) * EXTERNAL_ID_BLOCK


class CuptiUnavailable(Exception):
    """Raised when cupti-python cannot be imported or set up."""


# Our own external-correlation kind: torch's profiler (Kineto) pushes CUSTOM0 and CUSTOM1.
_EXTERNAL_KIND_NAME: Final = "CUSTOM2"


@dataclass
class TraceRecords:
    """What CUPTI delivered: device activities, correlation -> external id, correlation -> API end,
    correlation -> the OS thread that made the API call."""

    activities: list[Activity] = field(default_factory=list)
    external: dict[int, int] = field(default_factory=dict)
    api_ends: dict[int, int] = field(default_factory=dict)
    api_threads: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class CuptiTracer:
    """Process-wide CUPTI activity collector (CUPTI takes one set of buffer callbacks per process).

    Built once, by ``kcoral.timing.trust.arm`` before any uploaded code runs; the timer then uses
    that instance, never a lookup through a class attribute that uploaded code could reset.
    """

    # Kept from the old process-wide lookup, for code that still resets them. The timer never
    # reads them: it uses the tracer armed before uploaded code ran (``kcoral.timing.trust``), and
    # the trusted-state snapshot notices a candidate that resets them to force the CUDA-event
    # fallback.
    _instance: CuptiTracer | None = None
    _instance_error: str | None = None
    _instance_lock = threading.Lock()

    def __init__(self, module: Any = None) -> None:
        """``module``: cupti-python's ``cupti`` module as captured earlier (by the timer's arm),
        rather than looked up now through ``sys.modules``, which uploaded code can replace."""
        if module is None:
            try:
                from cupti import cupti as imported
            except Exception as exc:  # ImportError, or a missing libcupti raised from inside the import
                raise CuptiUnavailable(f"cupti-python is not importable: {exc}") from exc
            module = imported
        cupti = module
        self._cupti: Any = cupti
        kinds = cupti.ActivityKind
        self._device_kinds: tuple[Any, ...] = (kinds.CONCURRENT_KERNEL, kinds.MEMCPY, kinds.MEMSET) + (
            (kinds.MEMCPY2,) if hasattr(kinds, "MEMCPY2") else ()
        )
        self._correlation_kinds: tuple[Any, ...] = (kinds.RUNTIME, kinds.DRIVER, kinds.EXTERNAL_CORRELATION)
        self._kind_names = {int(kind): kind.name.lower() for kind in self._device_kinds}
        self._kernel_kind = int(kinds.CONCURRENT_KERNEL)
        self._memcpy_kinds = {int(kinds.MEMCPY)} | ({int(kinds.MEMCPY2)} if hasattr(kinds, "MEMCPY2") else set())
        self._api_kinds = {int(kinds.RUNTIME), int(kinds.DRIVER)}
        self._external_record_kind = int(kinds.EXTERNAL_CORRELATION)
        self.external_kind: Any = getattr(cupti.ExternalCorrelationKind, _EXTERNAL_KIND_NAME)
        self._lock = threading.Lock()
        self._records = TraceRecords()
        self._enabled: list[Any] = []
        # Bound once: CUPTI keeps raw pointers to the callbacks, and a fresh bound method per
        # registration would be a different object from the one checked later.
        self._on_requested = self._buffer_requested
        self._on_completed = self._buffer_completed
        try:
            cupti.activity_register_callbacks(self._on_requested, self._on_completed)
            self.timestamp()
        except Exception as exc:
            raise CuptiUnavailable(f"CUPTI activity callbacks could not be registered: {exc}") from exc

    @property
    def kinds(self) -> tuple[str, ...]:
        """The activity kinds the timer enables (for messages and the trusted-state snapshot)."""
        return tuple(kind.name for kind in self._device_kinds + self._correlation_kinds)

    def timestamp(self) -> int:
        """CUPTI's clock now (ns), the time base of the activity records."""
        return int(self._cupti.get_timestamp())

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
                    # The end tells whether the host was still launching when the GPU ran out of
                    # held work; the thread tells whose launch it was. Read defensively.
                    correlation = int(record.correlation_id)
                    end = getattr(record, "end", None)
                    if end is not None:
                        batch.api_ends[correlation] = int(end)
                    thread = getattr(record, "thread_id", None)
                    if thread is not None:
                        batch.api_threads[correlation] = int(thread)
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
                self._records.api_threads.update(batch.api_threads)
        except Exception as exc:
            with self._lock:
                self._records.errors.append(repr(exc))
            print(f"kcoral.timing: CUPTI record processing failed: {exc!r}", file=sys.stderr)

    def enable(self, *, correlation: bool) -> None:
        kinds = self._device_kinds + (self._correlation_kinds if correlation else ())
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
                print(f"kcoral.timing: CUPTI activity_disable failed: {exc!r}", file=sys.stderr)

    def push(self, external_id: int) -> None:
        self._cupti.activity_push_external_correlation_id(self.external_kind, external_id)

    def pop(self) -> int | None:
        """Pop this thread's innermost external id; the id popped (None where CUPTI does not say)."""
        popped = self._cupti.activity_pop_external_correlation_id(self.external_kind)
        return int(popped) if isinstance(popped, int) else None

    def drain(self) -> TraceRecords:
        """Flush every buffer (complete or not) and take what was recorded so far."""
        self._cupti.activity_flush_all(1)  # 1 = CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        with self._lock:
            records, self._records = self._records, TraceRecords()
        return records

    def foreign_subscriber(self) -> str | None:
        """Whether someone else holds a CUPTI callback subscription (None: nobody, as far as we can tell).

        CUPTI takes one subscriber per process: a subscription made by uploaded code could run its
        code inside the timer's own CUDA calls. Trying to subscribe (and at once unsubscribing)
        tells; a CUPTI that allows several subscribers answers None, which is no worse.
        """
        cupti = self._cupti
        try:
            subscriber = cupti.subscribe(_ignore_callback, None)
        except Exception as exc:
            text = str(exc)
            if "MULTIPLE_SUBSCRIBERS" in text.upper() or "SUBSCRIBER" in text.upper():
                return text
            return None
        try:
            cupti.unsubscribe(subscriber)
        except Exception:
            pass
        return None


def _ignore_callback(userdata: Any, domain: Any, callback_id: Any, cbdata: Any) -> None:
    return None
