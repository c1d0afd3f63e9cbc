"""What ``kcoral iket`` reads back from run-iket's output folder: the trace files it wrote, and a
one-line summary of each named IKET stage (range) and marker from the postprocessed JSON.

run-iket (``nvidia-cutlass-dsl-libs-base`` 4.8.1, ``iket/cli/run_iket.py``) writes, per traced
process, into its ``--output-dir``::

    iket_pid_<PID>.pftrace          --postprocess perfetto or all (the Perfetto timeline; PID in hex, 0x32)
    iket_pid_<PID>.trace.json       --postprocess json or all (decoded events, as JSON)
    iket_pid_<PID>.html             --postprocess html or all, with iket_pid_<PID>.pftrace.gz
    tracker/ gen-config/ iket/      intermediates, removed unless ``--keep``

The JSON comes from the decoder in a native library (``RawCaptureDecoder.export_decoded_json``),
whose schema is not documented. What is known: its top level holds ``launches`` (the TVM TIRx
wrapper of run-iket reads ``trace["launches"]``), and the decoder's field names include ``ranges``,
``markers``, ``rangeName``, ``rangeNameIdx``, ``markerNameIdx``, ``stringTable``, ``startTs``,
``endTs``, ``timestamp``, ``kernelName`` and ``timerSource``. So the reader below looks for those
keys wherever they are, rather than at fixed places: a range is a map with a name (``rangeName``,
or ``rangeNameIdx`` into the nearest ``stringTable``) and numeric ``startTs`` and ``endTs``; a
marker a map in a ``markers`` list with ``markerName`` or ``markerNameIdx``. A file where it finds
neither list is reported as unread, with its top-level keys, instead of as a trace without stages.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# run-iket 4.8.1 names the process in hex (iket_pid_0x32.trace.json, seen on the H200); decimal too.
PID = r"(0x[0-9a-fA-F]+|\d+)"
TRACE_JSON = re.compile(rf"^iket_pid_{PID}\.trace\.json$")
TRACE_FILE = re.compile(rf"^iket_pid_{PID}\.(trace\.json|pftrace|pftrace\.gz|html)$")
# The decoder's field names (strings of libiket_cubin_info.so), read in any of these spellings.
RANGE_LISTS = ("ranges",)
MARKER_LISTS = ("markers",)
STRING_TABLES = ("stringTable", "strings")
RANGE_NAMES = ("rangeName", "name")
RANGE_NAME_INDICES = ("rangeNameIdx", "nameIdx")
MARKER_NAMES = ("markerName", "name")
MARKER_NAME_INDICES = ("markerNameIdx", "nameIdx")
START, END = "startTs", "endTs"
# run-iket 4.8.1's JSON (seen on the H200): {"launches": [{"kernelName", "ranges": [...], "markers":
# [...], "warpLifetimes", ...}], "stringTable", "locationTable", "graphLaunches", "meta"}; a kernel
# without markers gives an empty launches list. It names no timer source; its stamps are
# %globaltimer's, nanoseconds since the Unix epoch, so stamps past 2001 (1e18 ns) are read as those.
LAUNCH_LISTS = ("launches",)
GLOBALTIMER = "%globaltimer"
GLOBALTIMER_SINCE = 10**18
TIMER_SOURCE = "timerSource"
KERNEL_NAME = "kernelName"
# A trace JSON larger than this is listed but not read (a whole-grid trace of a large kernel).
MAX_READ_BYTES = 512 << 20


class TraceFormatError(ValueError):
    """Raised when a trace JSON holds none of the lists that IKET ranges and markers come in."""


@dataclass
class StageSummary:
    """One named range (a stage) or marker: how often it was recorded and, for a range, how long."""

    name: str
    kind: str  # "range" or "marker"
    count: int = 0
    durations: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.durations) if self.durations else None


@dataclass
class TraceSummary:
    """What one ``iket_pid_<PID>.trace.json`` holds."""

    path: Path
    stages: list[StageSummary]
    kernels: list[str]
    timer_source: str | None

    @property
    def unit(self) -> str:
        # %globaltimer counts nanoseconds; any other source is reported in its own ticks.
        if self.timer_source is None:
            return "ticks"
        return "ns" if "global" in self.timer_source.lower() else f"ticks ({self.timer_source})"


def trace_files(paths: Sequence[str], output_dir: str) -> list[str]:
    """The files among ``paths`` (relative paths just fetched) that run-iket writes at the top of
    ``output_dir``, in order of name."""
    prefix = output_dir.rstrip("/") + "/"
    found = [p for p in paths if p.startswith(prefix) and TRACE_FILE.match(p[len(prefix) :])]
    return sorted(found)


def _walk(value: Any, tables: tuple[Sequence[Any], ...] = ()) -> Iterator[tuple[str, Any, tuple[Sequence[Any], ...]]]:
    """Every (key, value, string tables in scope) below ``value``, depth first."""
    if isinstance(value, Mapping):
        table = next((value[k] for k in STRING_TABLES if isinstance(value.get(k), list)), None)
        scope = (table, *tables) if table is not None else tables
        for key, item in value.items():
            yield str(key), item, scope
            yield from _walk(item, scope)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item, tables)


def _name(
    item: Mapping[str, Any], names: tuple[str, ...], indices: tuple[str, ...], tables: tuple[Sequence[Any], ...]
) -> str | None:
    for key in names:
        if isinstance(item.get(key), str):
            return str(item[key])
    for key in indices:
        index = item.get(key)
        if isinstance(index, int) and not isinstance(index, bool):
            for table in tables:
                if 0 <= index < len(table) and isinstance(table[index], str):
                    return str(table[index])
            return f"#{index}"
    return None


def _named(
    items: list[Any], names: tuple[str, ...], indices: tuple[str, ...], tables: tuple[Sequence[Any], ...]
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The entries of a ranges or markers list that are maps with a name, each with its name."""
    for item in items:
        if isinstance(item, Mapping):
            name = _name(item, names, indices, tables)
            if name is not None:
                yield name, item


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _span(start: int | float, end: int | float) -> float:
    """``end - start``, taken exactly before it becomes a float: %globaltimer stamps are nanoseconds
    since the Unix epoch (about 2**61), which a float holds only to 256 ns."""
    return float(end - start)


def summarize(decoded: Any, path: Path = Path("trace.json")) -> TraceSummary:
    """The stages and markers of one decoded trace; TraceFormatError when it holds neither list."""
    stages: dict[tuple[str, str], StageSummary] = {}
    kernels: list[str] = []
    timer_source: str | None = None
    seen_lists = False
    earliest: int | float | None = None
    for key, value, tables in _walk(decoded):
        if key == KERNEL_NAME and isinstance(value, str) and value not in kernels:
            kernels.append(value)
        elif key == TIMER_SOURCE and isinstance(value, str | int) and timer_source is None:
            timer_source = str(value)
        elif key in LAUNCH_LISTS and value == []:
            seen_lists = True  # run-iket's trace of a kernel without markers: no launch recorded
        elif key in RANGE_LISTS and isinstance(value, list):
            seen_lists = True
            for name, item in _named(value, RANGE_NAMES, RANGE_NAME_INDICES, tables):
                start, end = _number(item.get(START)), _number(item.get(END))
                if start is None or end is None:
                    continue
                stage = stages.setdefault(("range", name), StageSummary(name, "range"))
                stage.count += 1
                stage.durations.append(_span(start, end))
                earliest = start if earliest is None else min(earliest, start)
        elif key in MARKER_LISTS and isinstance(value, list):
            seen_lists = True
            for name, _ in _named(value, MARKER_NAMES, MARKER_NAME_INDICES, tables):
                stages.setdefault(("marker", name), StageSummary(name, "marker")).count += 1
    if not seen_lists:
        keys = sorted(decoded) if isinstance(decoded, Mapping) else type(decoded).__name__
        raise TraceFormatError(f"no 'ranges' or 'markers' list in it (top level: {keys})")
    # Ranges first, each kind in the order the trace first records it (a kernel's stages in turn).
    ordered = sorted(stages.values(), key=lambda s: s.kind != "range")
    if timer_source is None and earliest is not None and earliest >= GLOBALTIMER_SINCE:
        timer_source = GLOBALTIMER
    return TraceSummary(path, ordered, kernels, timer_source)


def read_summary(path: Path) -> TraceSummary:
    """Read and summarize one trace JSON; OSError, ValueError (bad JSON) or TraceFormatError."""
    size = path.stat().st_size
    if size > MAX_READ_BYTES:
        raise TraceFormatError(f"{size} bytes, more than the {MAX_READ_BYTES} this summary reads")
    with path.open("rb") as stream:
        return summarize(json.load(stream), path)


def _duration(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def summary_lines(summary: TraceSummary) -> list[str]:
    """One line per stage (count, median duration) and per marker (count)."""
    lines = []
    if summary.kernels:
        lines.append(f"kernels: {', '.join(summary.kernels)}")
    for stage in summary.stages:
        if stage.kind == "range":
            median = stage.median
            shown = _duration(median) if median is not None else "-"
            lines.append(f"stage {stage.name}: {_count(stage.count, 'range')}, median {shown} {summary.unit}")
        else:
            lines.append(f"marker {stage.name}: {_count(stage.count, 'event')}")
    if not summary.stages:
        lines.append("no named IKET range or marker in it (a kernel without IKET markers records none)")
    return lines
