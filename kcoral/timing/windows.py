"""Which GPU work belongs to which timed call: attribution by time window (pure, CPU-testable).

Every timed call runs between two device-wide synchronisations, each followed by a reading of
CUPTI's clock (the time base of the activity records):

    ... flush, sync, begin_ns | hold, call, sync | end_ns, gap work (snapshots, next inputs) ...

so the device is idle at ``begin_ns`` and again at ``end_ns``. Every kernel, memcpy and memset of
the process that starts inside ``[begin_ns, end_ns]`` belongs to that call, whatever thread, stream
or correlation id launched it, except the timer's own hold; work still running when the call
returned is inside the window too, since ``end_ns`` comes after the synchronisation. Work that starts
*between* windows and is not the timer's own (its external ids say which is) was launched outside
any timed call, by another thread, a finaliser or a signal handler: it is reported as foreign work,
which makes the verdict ``suspect``. Correlation ids only tell the timer's own work apart and which
launches were the calling thread's; they never decide whether work is counted.

Why windows rather than external correlation alone: CUPTI keeps external ids per thread, so a call
that hands its GEMM to a helper thread had the GEMM dropped (a 0.18 ms matmul read 0.0012 ms).

The windows are read on the host (``cupti.get_timestamp``), the activities on the GPU and mapped to
the host's clock by CUPTI, and the two can disagree by hundreds of microseconds: an honest program
then had all of the timer's flushes "inside" the windows (forged, an integrity failure), now and
then, on the H200 and on H100 hosts. Before attributing, :func:`clock_offsets` reads how far the
device's records are off from what causality allows, from the timer's own gap work alone
(launched by the calling thread between two windows: after the host read the first one's end,
done before it read the next one's begin), and :func:`align` moves the records back by the
smallest such offset: none at all while no offset is needed (the usual case), and never further
than causality allows, so no candidate can move its own work out of a window with it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kcoral.timing.cupti import (
    EXTERNAL_ID_BLOCK,
    GAP_ID_OFFSET,
    HOLD_ID_OFFSET,
    SENTINEL_ID_OFFSET,
    Activity,
    busy_ns,
)

# CUPTI's clock against the host's over the timed windows and the gaps between them
# (clock_disagreement): the host's readings bracket each one's length within a few hundred
# nanoseconds, so an honest clock is inside by construction; what is allowed beyond the bracket is
# a rate (NTP slews a clock by at most 500 ppm) and a step of either clock's readings apiece, and
# over all windows (or all gaps) a floor plus a share of their host time.
CLOCK_RATE_TOLERANCE = 0.002
CLOCK_STEP_NS = 1_000
CLOCK_DISAGREEMENT_FLOOR_NS = 20_000
CLOCK_DISAGREEMENT_SHARE = 0.01
# CUPTI's timestamps follow the host's wall clock (CLOCK_REALTIME: the two read within 4 us on an
# H100 host), which an operator or NTP may step; the trusted readings are CLOCK_MONOTONIC, which is
# never stepped. A step past this while the calls ran makes the windows untrustworthy (suspect), and
# a clock disagreement then is the step's, not tampering: a program in the sandbox holds no
# CAP_SYS_TIME to step the clock with.
WALL_CLOCK_STEP_NS = 10_000

ROLE_CALL = "call"
ROLE_HOLD = "hold"
ROLE_GAP = "gap"
ROLE_SENTINEL = "sentinel"
# Foreign activities named in a reason, at most.
FOREIGN_NAMES_SHOWN = 3


@dataclass(frozen=True)
class CallWindow:
    """One timed call on CUPTI's clock: device idle at ``begin_ns`` and at ``end_ns``."""

    index: int
    begin_ns: int
    call_ns: int  # the host called the function
    return_ns: int  # the function returned
    end_ns: int
    hold_ns: int = 0  # the hold asked for; where CUPTI gives no hold record, its end is estimated
    # The trusted host clock (ns) read just before and just after begin_ns, and just before and
    # just after end_ns: the window's length on a clock the program cannot replace (see
    # clock_disagreement). None where the calls were stamped on that clock itself.
    host_ns: tuple[int, int, int, int] | None = None


def role_of(external_id: int | None, base: int) -> tuple[str, int] | None:
    """(role, call index) of one of the timer's external ids in the block at ``base``; None otherwise."""
    if external_id is None or not base <= external_id < base + EXTERNAL_ID_BLOCK:
        return None
    offset = external_id - base
    if offset >= SENTINEL_ID_OFFSET:
        return ROLE_SENTINEL, offset - SENTINEL_ID_OFFSET
    if offset >= GAP_ID_OFFSET:
        return ROLE_GAP, offset - GAP_ID_OFFSET
    if offset >= HOLD_ID_OFFSET:
        return ROLE_HOLD, offset - HOLD_ID_OFFSET
    return ROLE_CALL, offset


@dataclass(frozen=True)
class WindowTimings:
    """What the records say of each timed call (lists in call order; calls with no work left out).

    - ``spans_ms``: first start to last end of the call's work (the reported latency).
    - ``ready_spans_ms``: from the end of the hold (or the first start, if earlier) to the last end.
    - ``busy_ms``: the time during which at least one of the call's activities ran.
    - ``host_ms``: synchronised host wall time per call: the call's own time on the host, plus the
      wait for the device after it returned (from the end of its hold, if later); for every call,
      empty ones included.
    - ``late_calls``: calls whose own launches returned after their hold had ended.
    - ``unheld_calls``: calls with work that started before their hold ended (another stream).
    - ``other_thread_activities``: counted activities that the calling thread did not launch.
    - ``foreign``: activities of nobody's call and not the timer's own, ``(start, end, name)``.
    - ``holds_seen`` / ``gaps_seen``: calls whose hold, and whose gap work, CUPTI recorded.
    - ``forged_activities``: work under the timer's own ids that is not the timer's (counted).
    """

    spans_ms: list[float]
    signatures: list[list[tuple[str, str]]]
    empty_calls: int
    ready_spans_ms: list[float] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    late_calls: int = 0
    unheld_calls: int = 0
    indices: list[int] = field(default_factory=list)
    other_thread_activities: int = 0
    foreign: list[tuple[int, int, str]] = field(default_factory=list)
    holds_seen: int = 0
    gaps_seen: int = 0
    sentinels_seen: frozenset[str] = frozenset()
    forged_activities: int = 0
    # Each of those: its role under the timer's ids, its name, and its start less its window's
    # begin (the first window's, where it began before all of them), in ns.
    forged: list[tuple[str, str, int]] = field(default_factory=list)
    # How far the device's records were moved to agree with the host's windows (the offset of the
    # largest size, ns; 0: not moved): see clock_offsets.
    clock_offset_ns: int = 0

    @property
    def foreign_ms(self) -> float:
        return busy_ns((start, end) for start, end, _ in self.foreign) / 1e6

    def forged_summary(self) -> str:
        """Which of the timer's ids the forged activities carried, their names, and where they began
        against their windows: tells work hidden under the ids from the timer's own work read at a
        shifted clock (a flush or sentinel all at one offset)."""
        if not self.forged:
            return ""
        roles = Counter(role for role, _, _ in self.forged)
        offsets = sorted(offset / 1e3 for _, _, offset in self.forged)
        shown = _names_shown(name for _, name, _ in self.forged)
        by_role = ", ".join(f"{role} {count}" for role, count in sorted(roles.items()))
        middle = offsets[len(offsets) // 2]
        return (
            f"ids of {by_role}; {shown}; starting {offsets[0]:.1f} to {offsets[-1]:.1f} us "
            f"(median {middle:.1f}) after their window began"
        )

    def foreign_summary(self) -> str:
        shown = _names_shown(name for _, _, name in self.foreign)
        return f"{len(self.foreign)} GPU activities ({self.foreign_ms:.4f} ms busy: {shown})"


def _names_shown(names: Iterable[str]) -> str:
    """The distinct activity names, in order, the first ``FOREIGN_NAMES_SHOWN`` of them."""
    distinct = sorted({name or "?" for name in names})
    return ", ".join(distinct[:FOREIGN_NAMES_SHOWN]) + (", ..." if len(distinct) > FOREIGN_NAMES_SHOWN else "")


def attribute(
    activities: Iterable[Activity],
    external_ids: Mapping[int, int],
    windows: Sequence[CallWindow],
    base: int,
    *,
    caller_thread: int | None = None,
    api_threads: Mapping[int, int] | None = None,
    api_ends: Mapping[int, int] | None = None,
    until_ns: int | None = None,
) -> WindowTimings:
    """Give each activity to the timed call whose window holds its start; measure each call.

    ``windows`` are in call order and do not overlap; ``base`` is the measurement's external-id
    block; ``caller_thread`` the OS thread that made the calls (with ``api_threads``, correlation ->
    thread, it counts work launched by other threads). Work outside every window is foreign unless
    the timer's ids mark it as its own; ``until_ns`` bounds the time looked at after the last window.
    The device's records are first put on the host's clock where they disagree with it (align).
    """
    listed = list(activities)
    offsets = clock_offsets(listed, external_ids, windows, base, caller_thread, api_threads, api_ends, until_ns)
    activities = align(listed, offsets)
    begins = [window.begin_ns for window in windows]
    threads = api_threads or {}
    counted: dict[int, list[Activity]] = {}
    hold_ends: dict[int, int] = {}
    gaps: set[int] = set()
    sentinels: set[str] = set()
    foreign: list[tuple[int, int, str]] = []
    other_threads = 0
    first_begin = begins[0] if begins else None
    launches = api_ends or {}
    forged = 0
    forged_seen: list[tuple[str, str, int]] = []
    for activity in sorted(activities, key=lambda a: a.start_ns):
        role = role_of(external_ids.get(activity.correlation_id), base)
        position = bisect.bisect_right(begins, activity.start_ns) - 1
        inside = position >= 0 and activity.start_ns <= windows[position].end_ns
        if role is not None and role[0] != ROLE_CALL:
            # The timer's own ids, but are they the timer's own work? Its gap work and sentinel run
            # outside every window, and its hold is one kernel launched before the call: anything
            # else under those ids was launched by someone who read the ids (from the timer's
            # frames, say) to hide work. It is counted, and the measurement fails.
            launched = launches.get(activity.correlation_id)
            genuine_hold = (
                role[0] == ROLE_HOLD
                and role[1] not in hold_ends
                and (launched is None or role[1] >= len(windows) or launched <= windows[role[1]].call_ns)
            )
            if genuine_hold:
                hold_ends[role[1]] = activity.end_ns
                continue
            if not inside and role[0] == ROLE_GAP:
                gaps.add(role[1])
                continue
            if not inside and role[0] == ROLE_SENTINEL:
                sentinels.add(activity.kind)
                continue
            forged += 1
            anchor = begins[position] if position >= 0 else begins[0] if begins else activity.start_ns
            forged_seen.append((role[0], activity.name or activity.kind, activity.start_ns - anchor))
            if not inside:
                foreign.append((activity.start_ns, activity.end_ns, activity.name or activity.kind))
                continue
            counted.setdefault(position, []).append(activity)
            continue
        if role is not None and role[0] == ROLE_CALL and role[1] < len(windows):
            # Launched by the calling thread inside call i: it is call i's, even if clock skew put
            # its start a hair outside the window.
            index = role[1]
        elif inside:
            index = position
            if caller_thread is not None and threads.get(activity.correlation_id) != caller_thread:
                other_threads += 1
        else:
            if first_begin is None or activity.start_ns < first_begin:
                continue  # before the measurement: warm-up, probes, earlier runs
            if until_ns is not None and activity.start_ns > until_ns:
                continue
            foreign.append((activity.start_ns, activity.end_ns, activity.name or activity.kind))
            continue
        counted.setdefault(index, []).append(activity)

    last_api: dict[int, int] = {}
    for correlation_id, end in (api_ends or {}).items():
        role = role_of(external_ids.get(correlation_id), base)
        if role is not None and role[0] == ROLE_CALL and end > last_api.get(role[1], 0):
            last_api[role[1]] = end

    timings = WindowTimings(spans_ms=[], signatures=[], empty_calls=0)
    late = unheld = empty = 0
    for window in windows:
        index = window.index
        hold_end = hold_ends.get(index)
        # The call's own host time, then the wait for the device after it returned, counted from the
        # end of the hold if that came later (the held GPU could not start before). Measured from the
        # end of the hold alone, a call that waits on the host for another process's GEMM hid the
        # wait inside the hold, which is sized from the call's host time.
        released = hold_end if hold_end is not None else window.begin_ns + window.hold_ns
        in_call = max(0, window.return_ns - window.call_ns)
        after = max(0, window.end_ns - max(window.return_ns, released))
        timings.host_ms.append((in_call + after) / 1e6)
        if hold_end is not None and last_api.get(index, 0) > hold_end:
            late += 1
        work = counted.get(index)
        if not work:
            empty += 1
            continue
        start = min(activity.start_ns for activity in work)
        end = max(activity.end_ns for activity in work)
        if hold_end is not None and start < hold_end:
            unheld += 1
        ready = min(start, hold_end) if hold_end is not None else start
        timings.spans_ms.append(max(0, end - start) / 1e6)
        timings.ready_spans_ms.append(max(0, end - ready) / 1e6)
        timings.busy_ms.append(busy_ns((activity.start_ns, activity.end_ns) for activity in work) / 1e6)
        timings.signatures.append([(activity.kind, activity.name) for activity in work])
        timings.indices.append(index)
    return dataclasses.replace(
        timings,
        empty_calls=empty,
        late_calls=late,
        unheld_calls=unheld,
        other_thread_activities=other_threads,
        foreign=sorted(foreign),
        holds_seen=len(hold_ends),
        forged_activities=forged,
        forged=forged_seen,
        gaps_seen=len(gaps),
        sentinels_seen=frozenset(sentinels),
        clock_offset_ns=max((offset for _, offset in offsets), key=abs, default=0),
    )


def clock_offsets(
    activities: Iterable[Activity],
    external_ids: Mapping[int, int],
    windows: Sequence[CallWindow],
    base: int,
    caller_thread: int | None,
    api_threads: Mapping[int, int] | None,
    api_ends: Mapping[int, int] | None,
    until_ns: int | None,
) -> list[tuple[int | None, int]]:
    """How far the device's records are ahead of the host's clock: ``(from, offset ns)`` pairs in
    time order, ``from`` on the device's clock (None: from the start); [] where nothing tells.

    Gap ``k`` is the host's time between window ``k - 1``'s end (nothing before the first) and
    window ``k``'s begin (``until_ns`` after the last). Work the calling thread launched in it
    (its launch call returned inside the gap) started after the host read that end and had ended
    when the host read that begin, after a device-wide synchronisation: so an offset of the
    device's clock is above ``end - begin_k`` and below ``start - end_(k-1)`` for each such
    activity of the timer's own gap and sentinel ids. Only the calling thread's: its launches are
    ordered with the host's readings, while another thread's launch may have begun before a
    reading, or after the synchronisation had begun (and so not been waited for).

    One offset for the whole measurement where one agrees with every gap: the one nearest to zero
    (0 wherever none is needed, the usual case). Where none does (a clock that drifts more than
    the gaps leave room for), each gap's own, from where that gap begins on the device's clock.
    Bounds of one gap that contradict each other tell nothing: that gap is left out.
    """
    if caller_thread is None or not api_threads or not api_ends or not windows:
        return []
    ends = [window.end_ns for window in windows]
    lowest: dict[int, int] = {}
    highest: dict[int, int] = {}
    for activity in activities:
        correlation = activity.correlation_id
        role = role_of(external_ids.get(correlation), base)
        if role is None or role[0] not in (ROLE_GAP, ROLE_SENTINEL) or api_threads.get(correlation) != caller_thread:
            continue
        launched = api_ends.get(correlation)
        if launched is None:
            continue
        gap = bisect.bisect_left(ends, launched)  # the windows that ended before the launch returned
        after = windows[gap].begin_ns if gap < len(windows) else until_ns
        if after is not None and launched >= after:
            continue  # launched inside a window (or after the measurement): not the timer's gap work
        # Strictly after the end, strictly before the begin: moved by a bound, the activity lies
        # outside both windows (a window holds its begin and its end).
        if after is not None:
            bound = activity.end_ns - after + 1
            lowest[gap] = max(lowest.get(gap, bound), bound)
        if gap > 0:
            bound = activity.start_ns - ends[gap - 1] - 1
            highest[gap] = min(highest.get(gap, bound), bound)
    gaps = [
        (gap, lowest.get(gap), highest.get(gap))
        for gap in sorted(set(lowest) | set(highest))
        if lowest.get(gap) is None or highest.get(gap) is None or lowest[gap] <= highest[gap]
    ]
    if not gaps:
        return []
    low = max((bound for _, bound, _ in gaps if bound is not None), default=None)
    high = min((bound for _, _, bound in gaps if bound is not None), default=None)
    if low is None or high is None or low <= high:
        return [(None, _nearest_zero(low, high))]
    offsets: list[tuple[int | None, int]] = []
    for gap, low_k, high_k in gaps:
        offset = _nearest_zero(low_k, high_k)
        offsets.append((None if not offsets or gap == 0 else ends[gap - 1] + offset, offset))
    return offsets


def _nearest_zero(low: int | None, high: int | None) -> int:
    """The offset nearest to zero between ``low`` and ``high`` (either may be missing)."""
    if low is not None and low > 0:
        return low
    if high is not None and high < 0:
        return high
    return 0


def align(activities: Iterable[Activity], offsets: Sequence[tuple[int | None, int]]) -> list[Activity]:
    """The activities moved back onto the host's clock by ``offsets`` (clock_offsets'): each by the
    offset from the latest ``from`` at or before its start (the first offset before them all);
    unchanged where no offset is needed."""
    listed = list(activities)
    if not any(offset for _, offset in offsets):
        return listed
    starts = [start if start is not None else -(1 << 62) for start, _ in offsets]
    values = [offset for _, offset in offsets]
    moved = []
    for activity in listed:
        offset = values[max(0, bisect.bisect_right(starts, activity.start_ns) - 1)]
        moved.append(activity._replace(start_ns=activity.start_ns - offset, end_ns=activity.end_ns - offset))
    return moved


@dataclass(frozen=True)
class ClockStray:
    """How much shorter and longer CUPTI's clock made some intervals in all than their bracketing
    host readings allow, and the host's own count of them."""

    short_ns: int = 0
    long_ns: int = 0
    host_ns: int = 0
    intervals: int = 0

    @property
    def allowed_ns(self) -> float:
        return CLOCK_DISAGREEMENT_FLOOR_NS + CLOCK_DISAGREEMENT_SHARE * self.host_ns

    @property
    def used(self) -> float:
        """The larger stray's share of what is allowed: 0 inside every bracket, past 1 too far."""
        return max(self.short_ns, self.long_ns) / self.allowed_ns

    @property
    def too_far(self) -> bool:
        return self.used > 1

    @classmethod
    def over(cls, intervals: Iterable[tuple[int, int, int]]) -> ClockStray:
        """The stray of ``intervals``, each (its length on CUPTI's clock, the least and the most the
        host's readings around it allow), beyond a step and a rate apiece."""
        short = long = host = count = 0
        for cupti_ns, least_ns, most_ns in intervals:
            slack = CLOCK_STEP_NS + CLOCK_RATE_TOLERANCE * max(least_ns, 0)
            short += max(0, int(least_ns - slack) - cupti_ns)
            long += max(0, cupti_ns - int(most_ns + slack))
            host += max(0, least_ns)
            count += 1
        return cls(short, long, host, count)


@dataclass(frozen=True)
class ClockDisagreement:
    """CUPTI's clock against the trusted host clock over the timed windows, and over the gaps
    between them (the timer's own work: flushes, next inputs, snapshots), each judged on its own."""

    windows: ClockStray
    gaps: ClockStray

    @property
    def used(self) -> float:
        """The larger share of its allowance that the windows' or the gaps' stray used."""
        return max(self.windows.used, self.gaps.used)

    @property
    def too_far(self) -> bool:
        return self.windows.too_far or self.gaps.too_far


def clock_disagreement(windows: Sequence[CallWindow]) -> ClockDisagreement | None:
    """How far CUPTI's clock strayed from the trusted host clock over the timed windows and the gaps
    between them (None where no window has host readings).

    A window's length on CUPTI's clock (``end_ns - begin_ns``) lies between the host's readings
    around it: at least from just after the begin was read to just before the end was, at most from
    just before the one to just after the other; a gap's (from one window's end to the next one's
    begin) likewise. A pre-empted reading widens the bracket and never fails it. A clock that runs
    slower or faster than the host's (a program that gave CUPTI a timestamp source of its own, say:
    every window, record and host time of the measurement is then on that clock) reads windows or
    gaps shorter or longer than the host saw them; what each strays beyond its bracket, a rate and
    a step, is summed, windows and gaps apart (the gaps are milliseconds where a window may be
    microseconds: a share of their time would hide a window's stray).
    """
    in_windows: list[tuple[int, int, int]] = []
    in_gaps: list[tuple[int, int, int]] = []
    last_end: tuple[int, int, int] | None = None  # the previous window's end_ns, with its host readings
    for window in windows:
        if window.host_ns is None:
            last_end = None
            continue
        before_begin, after_begin, before_end, after_end = window.host_ns
        in_windows.append((window.end_ns - window.begin_ns, before_end - after_begin, after_end - before_begin))
        if last_end is not None:
            end_ns, before_last_end, after_last_end = last_end
            in_gaps.append((window.begin_ns - end_ns, before_begin - after_last_end, after_begin - before_last_end))
        last_end = (window.end_ns, before_end, after_end)
    if not in_windows:
        return None
    return ClockDisagreement(ClockStray.over(in_windows), ClockStray.over(in_gaps))
