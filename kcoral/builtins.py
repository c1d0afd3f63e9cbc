"""Helpers for uploaded code: GPU timing (``benchmark``) and the CPU-only guard (``GpuAccessGuard``).

Uploaded code imports this module (``from kcoral.builtins import benchmark``), so its top level
imports nothing heavy: torch, cupti-python and pynvml are imported inside the functions that need
them.

How ``benchmark`` times a call
------------------------------
Each timed call is bracketed with a CUPTI *external correlation id* (``activity_push_external_
correlation_id`` before the call, ``activity_pop_external_correlation_id`` after it). CUPTI then
writes, for every CUDA runtime and driver API call made on this thread inside the bracket, an
``EXTERNAL_CORRELATION`` record that maps the API call's correlation id to our id; every kernel,
memcpy and memset record carries the correlation id of the API call that launched it, on whatever
stream.

Why external correlation rather than a callback subscription: a subscription runs a Python
function on *every* CUDA API call (torch makes several per op), which perturbs the host side of the
measurement, and CUPTI allows one subscriber per process, which ``GpuAccessGuard`` (and profilers)
also want. External correlation costs two C calls per timed call. CUPTI only writes the
correlation records while API activity (``RUNTIME``/``DRIVER``) is enabled, so those kinds are
enabled around the probe and the counted calls only, not during warm-up.

Before each counted call the L2 cache is flushed by *reading* a buffer twice the L2 size (a read
leaves clean lines, so the next call pays no write-back for the flush) and the device is
synchronised, so nothing of the call overlaps the flush. Then a one-thread spin kernel *holds* the
current stream (for 0.1 to 0.5 ms on the H200) while the host launches the call behind it.

Why the hold: after a host synchronisation the GPU waits for every launch, so a call that launches
several pieces of work is timed with the host's launch gaps between them. torch.mm on the H200
launches a workspace memset, then the GEMM about 10 us later; their span read 185-189 us where the
GEMM takes 175-176 us (Nsight Compute: 176-177 us), the +7% first seen. Queued behind the hold,
the same call reads 176-179 us (two sessions). The hold is sized from the call's host launch time
and lengthened while CUPTI's API records show launches still running when it ended. A call with
work on another stream gets no hold: that work is not held, starts beside the spin kernel, and a
kernel that wants every SM waits for the spin's SM (a side-stream GEMM read 211 us with a hold,
184-188 us without).

A call's latency is the span from the first start to the last end of its activities. For a single
kernel that is CUPTI's kernel duration (what Nsight Systems shows). Nsight Compute's
``gpu__time_duration`` reads about 1.1 us more per kernel (H200: 44.69 against 43.62 us for a
16M-float add, 5.31 against 4.13 us for a 1M-float add, 175.9 against 176.1 us for a 4096^3 bf16
GEMM whose memset and GEMM the span both covers): its timestamps are written by the GPU's front
end before the launch and after completion, so they include the launch processing that CUPTI's
kernel timestamps leave out. That is 2-3% for the add and under 1% for the GEMM, but 22% for a
4 us kernel. Nothing on this side of the GPU reproduces ncu's offset: CUDA events around the held
call read about 2.5 us more than CUPTI's duration (6.6 us for the 4 us kernel), the same whether
the stream was held by the spin kernel or by a wait on a host flag, and an event recorded right
after another costs 1.3 us; timing from the end of the hold (``ready_span``) reads the same 6.6
us. ``latency_ms_median_by`` in the result gives the median by each of these. Before counting, the
call runs until NVML reports a steady SM clock (bounded), then for the warm-up budget.

Without cupti-python (or when it fails to initialise) the fallback is a pair of CUDA events around
each call on the current stream, with the same flush and hold; ``method`` in the result says which
was used. Events see only work ordered on the current stream, and cannot tell a call that launched
nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, NamedTuple, Self

from kcoral.errors import ExecutionError

__all__ = ["CONFIG_KEYS", "BenchmarkConfig", "GpuAccessGuard", "benchmark", "gpu_access_guard"]

# Limits: a single benchmark() stays bounded even with careless configs.
MAX_COUNT: Final = 10_000
MAX_BUDGET_MS: Final = 10_000.0
MAX_CLOCK_WARMUP_MS: Final = 10_000.0

DEFAULT_WARMUP_MS: Final = 25.0
DEFAULT_REPEAT_MS: Final = 100.0
DEFAULT_CLOCK_WARMUP_MS: Final = 1_000.0

# The clock is "steady" once this many NVML samples, at least this far apart, lie within this
# fraction of their maximum. NVML refreshes clocks every few ms; 10 ms apart avoids re-reading one.
CLOCK_STEADY_SAMPLES: Final = 5
CLOCK_SAMPLE_INTERVAL_S: Final = 0.010
CLOCK_STEADY_TOLERANCE: Final = 0.01

# Calls run to estimate one iteration's wall time when no clock warm-up ran.
ESTIMATE_CALLS: Final = 5
# Flush buffer size as a multiple of the L2 size; used when torch does not report the L2 size.
L2_FLUSH_FACTOR: Final = 2
FALLBACK_L2_BYTES: Final = 64 * 1024 * 1024
# CUPTI activity buffer handed out per request (records are small; 8 MiB holds ~100k).
CUPTI_BUFFER_BYTES: Final = 8 * 1024 * 1024
# The launch hold: a one-thread GPU spin before each counted call, long enough for the host to
# launch the whole call behind it. First guess: this multiple of the untraced launch time plus the
# margin (tracing slows launches down), then doubled while traced calls still launch late.
HOLD_LAUNCH_FACTOR: Final = 3.0
HOLD_MARGIN_US: Final = 30.0
MIN_HOLD_US: Final = 30.0
MAX_HOLD_US: Final = 5_000.0
HOLD_FIT_ROUNDS: Final = 4
HOLD_FIT_CALLS: Final = 3
# Spin length used to measure how many SM cycles the spin counts per microsecond (~50 us at 2 GHz).
HOLD_CALIBRATION_CYCLES: Final = 100_000

METHODS: Final = frozenset({"auto", "cupti", "cuda_event"})
CONFIG_KEYS: Final = frozenset(
    {"warmup_ms", "repeat_ms", "warmup", "repeat", "flush_l2", "launch_hold", "clock_warmup_ms", "method"}
)

# NVML clock event ("throttle") reason bits, named as nvidia-smi names them. Kept here rather than
# read from pynvml because the constant names moved between nvidia-ml-py releases.
THROTTLE_REASONS: Final[tuple[tuple[int, str], ...]] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# Reasons that mean the clock was pulled below what the work asked for. Idle, application clocks and
# display settings are states, not slowdowns.
SLOWDOWN_MASK: Final = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


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
        flags = {key: values.get(key, True) for key in ("flush_l2", "launch_hold")}
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
        )


def _budget(values: Mapping[str, Any], key: str, default: float, cap: float) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ExecutionError("parse", f"{key} must be a non-negative number of milliseconds, not {value!r}")
    return min(float(value), cap)


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


# ----------------------------------------------------------------------------- pure helpers


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


def clock_is_steady(
    samples_mhz: Sequence[float],
    *,
    window: int = CLOCK_STEADY_SAMPLES,
    tolerance: float = CLOCK_STEADY_TOLERANCE,
) -> bool:
    """True when the last ``window`` clock samples lie within ``tolerance`` of their maximum."""
    if len(samples_mhz) < window:
        return False
    recent = samples_mhz[-window:]
    top = max(recent)
    return top > 0 and (top - min(recent)) <= tolerance * top


def throttle_reason_names(mask: int | None) -> list[str] | None:
    """Names of the NVML clock event reasons set in ``mask`` (None when NVML gave none)."""
    if mask is None:
        return None
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"other_0x{mask & ~known:x}")
    return names


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


# ----------------------------------------------------------------------------- CUPTI


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


class _CuptiTracer:
    """Process-wide CUPTI activity collector (CUPTI takes one set of buffer callbacks per process)."""

    _instance: _CuptiTracer | None = None
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
    def get(cls) -> _CuptiTracer:
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
# hold launched before it base + HOLD_ID_OFFSET + i (MAX_COUNT stays below the offset).
_EXTERNAL_ID_BLOCK: Final = 1 << 20
HOLD_ID_OFFSET: Final = 1 << 19
_external_id_lock = threading.Lock()
_next_external_block = 1


def _reserve_external_ids() -> int:
    global _next_external_block
    with _external_id_lock:
        base = _next_external_block * _EXTERNAL_ID_BLOCK
        _next_external_block += 1
    return base


def hold_ends_by_call(activities: Iterable[Activity], external_ids: Mapping[int, int]) -> dict[int, int]:
    """Call id -> end (ns) of the hold kernel launched before that call."""
    ends: dict[int, int] = {}
    for activity in activities:
        external = external_ids.get(activity.correlation_id)
        if external is not None and external % _EXTERNAL_ID_BLOCK >= HOLD_ID_OFFSET:
            call = external - HOLD_ID_OFFSET
            ends[call] = max(ends.get(call, 0), activity.end_ns)
    return ends


# ----------------------------------------------------------------------------- NVML


class _Nvml:
    """SM clock and clock-event reasons of one GPU; every method returns None when NVML cannot answer."""

    def __init__(self, handle: Any, module: Any) -> None:
        self._handle = handle
        self._nvml = module

    @classmethod
    def open(cls, torch: Any, device: int) -> _Nvml | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()  # reference-counted by NVML: repeated calls are cheap and harmless
        except pynvml.NVMLError:
            return None
        props = torch.cuda.get_device_properties(device)
        # CUDA_VISIBLE_DEVICES renumbers devices, so match NVML's device by UUID, then by PCI id.
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            text = str(uuid)  # torch prints the bare UUID; NVML wants the "GPU-" prefix
            candidate = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
            with contextlib.suppress(pynvml.NVMLError):
                return cls(pynvml.nvmlDeviceGetHandleByUUID(candidate), pynvml)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
            with contextlib.suppress(pynvml.NVMLError):
                return cls(pynvml.nvmlDeviceGetHandleByPciBusId(pci), pynvml)
        return None

    def sm_clock_mhz(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except self._nvml.NVMLError:
            return None

    def clock_event_reasons(self) -> int | None:
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            getter = getattr(self._nvml, name, None)
            if getter is None:
                continue
            with contextlib.suppress(self._nvml.NVMLError):
                return int(getter(self._handle))
        return None


# ----------------------------------------------------------------------------- benchmark


def _import_torch_with_gpu() -> Any:
    try:
        import torch
    except Exception as exc:
        raise ExecutionError(
            "unavailable", f"benchmark needs PyTorch with CUDA; torch is not importable: {exc}"
        ) from exc
    if not torch.cuda.is_available():
        raise ExecutionError(
            "unavailable",
            "benchmark needs a CUDA GPU, and torch.cuda.is_available() is False on this host "
            "(no GPU assigned to this program, or a CPU-only torch build)",
        )
    return torch


class _Runner:
    """Runs the user's call with the L2 flush, the launch hold and synchronisation around it."""

    def __init__(self, torch: Any, fn: Callable[..., Any], args: tuple[Any, ...], flush_l2: bool) -> None:
        self.torch = torch
        self._fn = fn
        self._args = args
        self._flush_buffer: Any = None
        # torch's one-thread spin kernel (clock64 loop) on the current stream; private but present
        # since torch 1.x. Without it there is no hold and spans include host launch gaps.
        self._spin: Callable[[int], None] | None = getattr(torch.cuda, "_sleep", None)
        if flush_l2:
            device = torch.cuda.current_device()
            l2_bytes = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
            l2_bytes = l2_bytes if l2_bytes > 0 else FALLBACK_L2_BYTES
            # float32 so the read-reduction runs at full bandwidth; zeroed once so sums stay finite.
            elements = L2_FLUSH_FACTOR * l2_bytes // 4
            self._flush_buffer = torch.zeros(elements, dtype=torch.float32, device=device)

    @property
    def can_hold(self) -> bool:
        return self._spin is not None

    def flush(self) -> None:
        if self._flush_buffer is not None:
            self._flush_buffer.sum()

    def call(self) -> None:
        self._fn(*self._args)

    def hold(self, cycles: int) -> None:
        if self._spin is not None and cycles > 0:
            self._spin(cycles)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def iteration(self) -> float:
        """Flush, call, synchronise; return the host time the call took to launch its work (ms)."""
        self.flush()
        tick = time.perf_counter()
        self.call()
        launched = time.perf_counter()
        self.synchronize()
        return (launched - tick) * 1e3

    def spin_cycles_per_us(self) -> float | None:
        """SM cycles the spin kernel counts per microsecond now (calibrated with CUDA events)."""
        if self._spin is None:
            return None
        torch = self.torch
        # The first launch of the spin kernel loads its module (lazy loading) and takes milliseconds:
        # timed cold, it made the hold ~100 times too short on the H200.
        self._spin(1)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.synchronize()
        start.record()
        self._spin(HOLD_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        elapsed_us = float(start.elapsed_time(end)) * 1e3
        return HOLD_CALIBRATION_CYCLES / elapsed_us if elapsed_us > 0 else None


@dataclass
class _Measurement:
    samples_ms: list[float]
    stable: bool
    empty_calls: int
    activities_per_call: int | None
    by_estimate: dict[str, float | None] = field(default_factory=dict)
    late_calls: int | None = None


def _timed_calls(
    runner: _Runner,
    count: int,
    *,
    hold_cycles: int,
    tracer: _CuptiTracer | None = None,
    base: int = 0,
) -> list[float]:
    """Run ``count`` calls, each after a flush, a synchronisation and a hold; return event times (ms).

    The host synchronises after the flush so no work of the call (on any stream) overlaps it. Then
    a one-thread spin kernel holds the current stream while the host records the start event and
    launches the call behind it: when the hold ends, the call's work is already queued, so the
    host's launch overhead stays out of the measurement, as it does for Nsight Compute. Work on
    other streams is not held and may start during the spin, which occupies one SM only.
    """
    torch = runner.torch
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    runner.synchronize()
    if tracer is not None:
        tracer.enable(correlation=True)
    try:
        for index, (start, end) in enumerate(events):
            runner.flush()
            runner.synchronize()
            if tracer is not None and hold_cycles > 0:
                tracer.push(base + HOLD_ID_OFFSET + index)
                try:
                    runner.hold(hold_cycles)
                finally:
                    tracer.pop()
            else:
                runner.hold(hold_cycles)
            start.record()
            if tracer is not None:
                tracer.push(base + index)
            try:
                runner.call()
            finally:
                if tracer is not None:
                    tracer.pop()
            end.record()
            runner.synchronize()
    finally:
        if tracer is not None:
            tracer.disable()
    return [float(start.elapsed_time(end)) for start, end in events]


class _CuptiTimer:
    method = "cupti"

    def __init__(self, tracer: _CuptiTracer) -> None:
        self._tracer = tracer

    def probe(self, runner: _Runner) -> None:
        """Run one traced call; a call that launches no GPU work cannot be timed."""
        base = _reserve_external_ids()
        _timed_calls(runner, 1, hold_cycles=0, tracer=self._tracer, base=base)
        records = self._tracer.drain()
        if spans_by_call(records.activities, records.external, [base]).empty_calls:
            raise ExecutionError(
                "unavailable",
                "the benchmarked call launched no GPU work (no kernel, memcpy or memset was recorded); "
                "there is nothing to time",
            )

    def fit_hold(self, runner: _Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        """Lengthen the hold until traced calls finish launching before it ends (bounded).

        Returns the hold (0 for none) and why. A call with work on another stream gets no hold:
        that work starts at once, beside the spin kernel, and a kernel that wants every SM (a
        persistent GEMM) then waits for the spin's SM; measured on the H200, a side-stream 4096^3
        matmul read 211 us with the hold and 184-188 us without.
        """
        for _ in range(HOLD_FIT_ROUNDS):
            base = _reserve_external_ids()
            _timed_calls(
                runner, HOLD_FIT_CALLS, hold_cycles=int(hold_us * cycles_per_us), tracer=self._tracer, base=base
            )
            records = self._tracer.drain()
            holds = hold_ends_by_call(records.activities, records.external)
            timings = spans_by_call(
                records.activities,
                records.external,
                [base + index for index in range(HOLD_FIT_CALLS)],
                hold_ends=holds,
                api_ends=records.api_ends,
            )
            if timings.unheld_calls:
                return 0.0, "off: the call runs work on another stream, which a hold cannot hold"
            if timings.late_calls == 0:
                return hold_us, "on"
            if hold_us >= MAX_HOLD_US:
                return hold_us, "on, but the host launches more slowly than the longest hold"
            hold_us = min(MAX_HOLD_US, hold_us * 2)
        return hold_us, "on, but the host still launched late after the last lengthening"

    def measure(
        self, runner: _Runner, repeat: int, hold_cycles: int, nvml: _Nvml | None
    ) -> tuple[_Measurement, dict[str, Any]]:
        base = _reserve_external_ids()
        call_ids = [base + index for index in range(repeat)]
        event_ms = _timed_calls(runner, repeat, hold_cycles=hold_cycles, tracer=self._tracer, base=base)
        after = _clock_state(nvml)
        records = self._tracer.drain()
        holds = hold_ends_by_call(records.activities, records.external) if hold_cycles > 0 else {}
        timings = spans_by_call(
            records.activities, records.external, call_ids, hold_ends=holds, api_ends=records.api_ends
        )
        if not timings.spans_ms:
            raise ExecutionError("unavailable", "the benchmarked call launched no GPU work during the counted calls")
        counts = {len(signature) for signature in timings.signatures}
        events = [event_ms[index] for index in timings.indices]
        by_estimate: dict[str, float | None] = {
            "span": _median(timings.spans_ms),
            "ready_span": _median(timings.ready_spans_ms),
            "busy": _median(timings.busy_ms),
            "cuda_event": _median(events),
        }
        return (
            _Measurement(
                samples_ms=timings.spans_ms,
                stable=timings.empty_calls == 0 and activities_stable(timings.signatures),
                empty_calls=timings.empty_calls,
                activities_per_call=counts.pop() if len(counts) == 1 else None,
                by_estimate=by_estimate,
                late_calls=timings.late_calls if hold_cycles > 0 else None,
            ),
            after,
        )


class _EventTimer:
    method = "cuda_event"

    def probe(self, runner: _Runner) -> None:
        runner.iteration()

    def fit_hold(self, runner: _Runner, hold_us: float, cycles_per_us: float) -> tuple[float, str]:
        return hold_us, "on"  # without CUPTI neither lateness nor other streams can be seen

    def measure(
        self, runner: _Runner, repeat: int, hold_cycles: int, nvml: _Nvml | None
    ) -> tuple[_Measurement, dict[str, Any]]:
        samples = _timed_calls(runner, repeat, hold_cycles=hold_cycles)
        after = _clock_state(nvml)
        measurement = _Measurement(
            samples_ms=samples,
            stable=True,
            empty_calls=0,
            activities_per_call=None,
            by_estimate={"cuda_event": _median(samples)},
        )
        return measurement, after


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _clock_state(nvml: _Nvml | None) -> dict[str, Any]:
    if nvml is None:
        return {"sm_clock_mhz": None, "reasons": None}
    return {"sm_clock_mhz": nvml.sm_clock_mhz(), "reasons": nvml.clock_event_reasons()}


def _warm_clock(
    runner: _Runner, nvml: _Nvml | None, budget_ms: float, launch_ms: list[float]
) -> tuple[bool | None, float, list[float]]:
    """Run the call until the SM clock is steady or the budget is spent.

    Returns (steady, milliseconds spent, wall time of each iteration in ms); steady is None when
    NVML cannot read the clock or the budget is zero. Each call's host launch time is appended to
    ``launch_ms``.
    """
    if nvml is None or budget_ms <= 0 or nvml.sm_clock_mhz() is None:
        return None, 0.0, []
    began = time.perf_counter()
    deadline = began + budget_ms / 1e3
    next_sample = began
    samples: list[float] = []
    iterations: list[float] = []
    steady = False
    while True:
        tick = time.perf_counter()
        launch_ms.append(runner.iteration())
        now = time.perf_counter()
        iterations.append((now - tick) * 1e3)
        if now >= next_sample:
            clock = nvml.sm_clock_mhz()
            if clock is not None:
                samples.append(float(clock))
            next_sample = now + CLOCK_SAMPLE_INTERVAL_S
            if clock_is_steady(samples):
                steady = True
                break
        if now >= deadline:
            break
    return steady, (time.perf_counter() - began) * 1e3, iterations


def _choose_timer(method: str) -> tuple[_CuptiTimer | _EventTimer, str | None]:
    if method == "cuda_event":
        return _EventTimer(), None
    try:
        return _CuptiTimer(_CuptiTracer.get()), None
    except CuptiUnavailable as exc:
        if method == "cupti":
            raise ExecutionError("unavailable", f"CUPTI timing was requested but is unavailable: {exc}") from exc
        return _EventTimer(), str(exc)


def initial_hold_us(launch_ms: Sequence[float]) -> float:
    """A first guess at the hold: a multiple of the call's untraced host launch time, bounded."""
    launch_us = float(statistics.median(launch_ms)) * 1e3 if launch_ms else 0.0
    return min(MAX_HOLD_US, max(MIN_HOLD_US, HOLD_LAUNCH_FACTOR * launch_us + HOLD_MARGIN_US))


def benchmark(fn: Callable[..., Any], *args: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Time ``fn(*args)`` on the GPU and return latency statistics in milliseconds.

    Each counted call is timed from CUPTI activity records of every kernel, memcpy and memset it
    launches, on any stream: from the first activity's start to the last one's end. Before each
    call the L2 cache is flushed and the device synchronised; then, unless the call runs work on
    another stream, a short GPU spin holds the current stream while the host launches the call
    behind it, so host launch gaps between the call's kernels stay out of the time (as they do in
    Nsight Compute). Before counting, the call runs until the SM clock is steady (at most
    ``clock_warmup_ms``), then for the warm-up budget.

    Config keys (``config={...}`` or a trailing dict argument): ``warmup_ms`` (25), ``repeat_ms``
    (100), ``warmup`` and ``repeat`` (counts; they override the budgets), ``flush_l2`` (True),
    ``launch_hold`` (True; False times from the first activity's start after a host
    synchronisation, host launch gaps included), ``clock_warmup_ms`` (1000; 0 skips the clock
    warm-up), ``method`` (``"auto"``, ``"cupti"`` or ``"cuda_event"``). Counts are capped at 10000
    and budgets at 10 s.

    The result holds ``latency_ms_median``/``_mean``/``_min``/``_max``/``_std``, ``warmup`` and
    ``repeat`` (counts used), ``flush_l2``, ``activities_stable`` (False when calls launched
    different activities; always True with CUDA events, which cannot tell), ``method``
    (``"cupti"`` or ``"cuda_event"``), ``latency_ms_median_by`` (the median by each way of
    measuring: ``span``, the one reported; ``ready_span``, from the end of the hold; ``busy``, the
    time any activity ran; ``cuda_event``), ``launch_hold`` (on, or off and why), ``launch_hold_us``,
    ``launch_late_calls``, ``sm_clock_mhz_before``/``_after``, ``throttle_reasons_before``/``_after``,
    ``throttled`` (None where NVML is missing) and ``gpu``.

    Raises ``ExecutionError("parse")`` for a bad config and ``ExecutionError("unavailable")`` when
    there is no GPU or the call launches no GPU work.

    Example::

        import torch
        from kcoral.builtins import benchmark

        a = torch.randn(1 << 24, device="cuda")
        b = torch.randn_like(a)
        out = torch.empty_like(a)
        result = benchmark(lambda x, y: torch.add(x, y, out=out), a, b, {"repeat": 200})
        print(result["latency_ms_median"], result["method"])   # e.g. 0.0437 cupti
    """
    call_args, settings = split_config(args, config)
    torch = _import_torch_with_gpu()
    device = torch.cuda.current_device()
    timer, cupti_error = _choose_timer(settings.method)
    runner = _Runner(torch, fn, call_args, settings.flush_l2)
    nvml = _Nvml.open(torch, device)

    # The first call pays one-off costs (compilation, autotuning, handles); keep it out of the probe.
    launch_ms = [runner.iteration()]
    if isinstance(timer, _CuptiTimer):
        try:
            timer.probe(runner)
        except ExecutionError:
            raise
        except Exception as exc:
            if settings.method == "cupti" or _is_user_error(exc):
                raise
            # CUPTI loaded but refused to trace (e.g. another profiler owns it): fall back.
            cupti_error = f"CUPTI tracing failed: {exc!r}"
            timer = _EventTimer()

    clock_steady, clock_warmup_ms, iteration_ms = _warm_clock(runner, nvml, settings.clock_warmup_ms, launch_ms)
    if len(iteration_ms) < ESTIMATE_CALLS:
        for _ in range(ESTIMATE_CALLS - len(iteration_ms)):
            tick = time.perf_counter()
            launch_ms.append(runner.iteration())
            iteration_ms.append((time.perf_counter() - tick) * 1e3)

    hold_us = 0.0
    hold_state = "off: launch_hold is false"
    cycles_per_us = runner.spin_cycles_per_us() if settings.launch_hold else None
    if cycles_per_us:
        hold_us, hold_state = timer.fit_hold(runner, initial_hold_us(launch_ms[1:] or launch_ms), cycles_per_us)
    elif settings.launch_hold:
        hold_state = "off: torch has no spin kernel (torch.cuda._sleep)"
    hold_cycles = int(hold_us * cycles_per_us) if cycles_per_us else 0

    # The median of the latest iterations: early ones can still include clock ramp-up.
    per_call_ms = float(statistics.median(iteration_ms[-max(ESTIMATE_CALLS, len(iteration_ms) // 2) :]))
    per_call_ms += hold_us / 1e3
    warmup = (
        settings.warmup
        if settings.warmup is not None
        else count_from_budget(settings.warmup_ms, per_call_ms, minimum=1)
    )
    repeat = (
        settings.repeat
        if settings.repeat is not None
        else count_from_budget(settings.repeat_ms, per_call_ms, minimum=1)
    )
    for _ in range(warmup):
        runner.iteration()

    before = _clock_state(nvml)
    measurement, after = timer.measure(runner, repeat, hold_cycles, nvml)

    result: dict[str, Any] = summarize(measurement.samples_ms)
    reasons_after = after["reasons"]
    result.update(
        {
            "warmup": warmup,
            "repeat": repeat,
            "samples": len(measurement.samples_ms),
            "empty_calls": measurement.empty_calls,
            "flush_l2": settings.flush_l2,
            "activities_stable": measurement.stable,
            "activities_per_call": measurement.activities_per_call,
            "method": timer.method,
            "cupti_error": cupti_error,
            "latency_ms_median_by": measurement.by_estimate,
            "launch_hold": hold_state,
            "launch_hold_us": round(hold_us, 1) if hold_cycles else 0.0,
            "launch_late_calls": measurement.late_calls,
            "clock_steady": clock_steady,
            "clock_warmup_ms": round(clock_warmup_ms, 3),
            "sm_clock_mhz_before": before["sm_clock_mhz"],
            "sm_clock_mhz_after": after["sm_clock_mhz"],
            "throttle_reasons_before": throttle_reason_names(before["reasons"]),
            "throttle_reasons_after": throttle_reason_names(reasons_after),
            "throttled": None if reasons_after is None else bool(reasons_after & SLOWDOWN_MASK),
            "gpu": str(torch.cuda.get_device_name(device)),
            "device_index": int(device),
        }
    )
    return result


def _is_user_error(exc: BaseException) -> bool:
    """True when the exception came from the user's function rather than from CUPTI."""
    module = type(exc).__module__ or ""
    return not module.startswith("cupti")


# ----------------------------------------------------------------------------- GPU access guard

# CUDA calls that only ask what exists (version, device count, error state) and touch no device:
# torch.cuda.is_available() makes them, and CPU-only code may reasonably ask that.
_HARMLESS_CUDA_CALLS: Final = frozenset(
    {
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuDeviceGetName",
        "cuDeviceGetUuid",
        "cuDeviceTotalMem",
        "cuDeviceComputeCapability",
        "cuGetProcAddress",
        "cuGetExportTable",
        "cuGetErrorString",
        "cuGetErrorName",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        "cudaGetDeviceCount",
        "cudaGetDevice",
        "cudaDriverGetVersion",
        "cudaRuntimeGetVersion",
        "cudaGetLastError",
        "cudaPeekAtLastError",
        "cudaGetErrorString",
        "cudaGetErrorName",
    }
)
_VERSION_SUFFIX: Final = re.compile(r"_v\d+$")


def is_harmless_cuda_call(function_name: str) -> bool:
    """True for CUDA API calls that only query (``cuCtxGetDevice_v2`` counts as ``cuCtxGetDevice``)."""
    return _VERSION_SUFFIX.sub("", function_name) in _HARMLESS_CUDA_CALLS


_guard_lock = threading.Lock()
_cupti_guard_active = False


class GpuAccessGuard:
    """Fail CUDA use inside a ``cpu_only`` function.

    Two layers, because neither alone is enough:

    * Python: while active, ``torch.cuda._lazy_init`` (through which every torch CUDA entry point
      initialises CUDA in a process where it is not yet initialised) raises
      ``ExecutionError("gpu_access", ...)``. This needs no CUPTI, but only stops torch, and only
      before CUDA was initialised in the process (torch imported before the guard is entered).
    * CUPTI: a callback subscription on the runtime and driver API domains records the first CUDA
      call that is more than a query, from any thread and any library. A CUPTI callback cannot make
      the call fail, so it is recorded in ``violation``; after the function returns the worker calls
      ``check()`` (or reads ``violation``) and fails the instruction with ``gpu_access``.

    Example::

        with GpuAccessGuard() as guard:
            result = fn(*args)
        guard.check()   # raises ExecutionError("gpu_access", "... cudaMalloc ...") if CUDA was used
    """

    def __init__(self, *, use_cupti: bool = True) -> None:
        self.violation: str | None = None
        self.cupti_active = False
        self._use_cupti = use_cupti
        self._patched: list[tuple[Any, Any]] = []
        self._subscriber: int | None = None
        self._cupti: Any = None
        self._callback: Callable[..., None] | None = None
        self._active = False

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("GpuAccessGuard is not reentrant")
        self._active = True
        self.violation = None
        self._patch_torch()
        if self._use_cupti:
            self._subscribe()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self._unsubscribe()
        finally:
            self._restore_torch()
            self._active = False

    def check(self) -> None:
        """Raise ``ExecutionError("gpu_access", ...)`` when CUDA was used while the guard was active."""
        if self.violation is not None:
            raise ExecutionError("gpu_access", f"a cpu_only function used the GPU: {self.violation}")

    def _record(self, what: str) -> None:
        if self.violation is None:
            self.violation = what

    def _patch_torch(self) -> None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        original = getattr(cuda, "_lazy_init", None) if cuda is not None else None
        if original is None:
            return

        def refuse_cuda_init() -> None:
            self._record("CUDA initialisation (torch.cuda._lazy_init)")
            raise ExecutionError("gpu_access", "a cpu_only function tried to initialise CUDA (torch.cuda._lazy_init)")

        # Submodules such as torch.cuda.random bind _lazy_init by name at import time.
        for name, module in list(sys.modules.items()):
            if (name == "torch.cuda" or name.startswith("torch.cuda.")) and getattr(
                module, "_lazy_init", None
            ) is original:
                self._patched.append((module, original))
                setattr(module, "_lazy_init", refuse_cuda_init)  # noqa: B010

    def _restore_torch(self) -> None:
        while self._patched:
            module, original = self._patched.pop()
            setattr(module, "_lazy_init", original)  # noqa: B010

    def _subscribe(self) -> None:
        global _cupti_guard_active
        with _guard_lock:
            if _cupti_guard_active:
                return  # CUPTI takes one subscriber per process; an outer guard already watches
            try:
                from cupti import cupti
            except (ImportError, OSError, RuntimeError):
                return  # the Python layer still guards torch

            def on_api_call(userdata: Any, domain: Any, callback_id: Any, cbdata: Any) -> None:
                try:
                    if self.violation is not None:
                        return
                    if cbdata.callback_site != cupti.ApiCallbackSite.API_ENTER:
                        return
                    name = str(cbdata.function_name)
                    if not is_harmless_cuda_call(name):
                        self._record(f"CUDA API call {name}")
                except Exception:
                    pass

            try:
                subscriber = cupti.subscribe(on_api_call, None)
            except cupti.cuptiError:
                return  # e.g. a profiler already subscribed: the Python layer remains
            try:
                cupti.enable_domain(1, subscriber, cupti.CallbackDomain.DRIVER_API)
                cupti.enable_domain(1, subscriber, cupti.CallbackDomain.RUNTIME_API)
            except cupti.cuptiError:
                cupti.unsubscribe(subscriber)
                return
            self._cupti = cupti
            self._callback = on_api_call  # CUPTI holds a raw pointer; keep the function alive
            self._subscriber = subscriber
            self.cupti_active = True
            _cupti_guard_active = True

    def _unsubscribe(self) -> None:
        global _cupti_guard_active
        if self._subscriber is None:
            return
        with _guard_lock:
            try:
                self._cupti.unsubscribe(self._subscriber)
            finally:
                self._subscriber = None
                self._callback = None
                self.cupti_active = False
                _cupti_guard_active = False


def gpu_access_guard(*, use_cupti: bool = True) -> GpuAccessGuard:
    """A new ``GpuAccessGuard``: ``with gpu_access_guard() as guard: ...; guard.check()``."""
    return GpuAccessGuard(use_cupti=use_cupti)
