"""The zygote's objects made immortal before its first fork: a worker's reference counting stops
copying the pages they live on.

A forked worker shares the zygote's memory until either process writes to a page; the first write
copies it (4 KiB, and a page fault). CPython writes to an object every time a reference to it is
taken or dropped, so a worker that only calls a function, reads a module's attribute or looks up a
method copies the page of every object it touches. On the 2-core VM a fresh CPU worker's page
faults were two thirds of its CPU, most of them such copies (``perf``, 2026-12-04; the numbers in
``benchmarks/RESULTS.md``, "Immortal objects in the zygote"). The zygote copies its own pages back
the same way after every fork.

CPython 3.12 (PEP 683) leaves the count of an *immortal* object alone: its increments and
decrements are no-ops, and it is never freed. The interpreter marks its own static objects so
(``None``, the small ints, interned strings); :func:`immortalize` marks every object reachable
from the collector's objects the same way, by writing the interpreter's own immortal count into
each one's header, as PEP 683 foresees for applications that fork. It runs in the zygote once,
after the preload and a collection and before ``gc.freeze()`` (:func:`kcoral.worker.children.
preload_for_workers`), so what it marks is what the zygote keeps for its whole life anyway: the
imported modules, their functions, classes and constants, the armed timer.

What it costs: the objects so marked are never freed, in the zygote or a worker; the walk takes
about 1.4 us an object, once per zygote (67,000 objects of a zygote without torch in 0.09 s on the
2-core VM). What it does not change: a write to an object's contents (a dict's new key, a list's item) still copies its
page, and what a worker allocates is its own, as before.

Only where the interpreter is known to work so: CPython with the GIL on a 64-bit build, whose own
immortal objects carry :data:`IMMORTAL_COUNT` in the whole of their count field (3.12 and 3.13),
checked on the running interpreter itself (:func:`supported`), counts that stay put included. On
3.11 there are no immortal objects (each change of a count writes), on 3.14 the count's encoding
changed, and a free-threaded build counts references elsewhere: there nothing is marked and
nothing else changes.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from dataclasses import dataclass

# _Py_IMMORTAL_REFCNT of 64-bit CPython 3.12 and 3.13: the low 32 bits of the count all set. An
# increment wraps them to zero and is then not stored; a decrement sees them negative as a 32-bit
# number and returns.
IMMORTAL_COUNT = 0xFFFFFFFF
# Any count whose low 32 bits are negative as a signed number is immortal to the interpreter.
IMMORTAL_FROM = 0x80000000
LOW_32_BITS = 0xFFFFFFFF


def _count_field(obj: object) -> ctypes.c_ssize_t:
    """The reference count field of ``obj``: the first word of its header (``ob_refcnt``)."""
    return ctypes.c_ssize_t.from_address(id(obj))


def supported() -> bool:
    """Whether this interpreter keeps immortal objects the way :func:`immortalize` marks them:
    its own immortal ``None`` carries IMMORTAL_COUNT, and an object so marked keeps that count
    through new references and dropped ones."""
    if sys.implementation.name != "cpython" or sys.maxsize < 2**32:
        return False
    if _count_field(None).value != IMMORTAL_COUNT:  # 3.11 and before, 3.14, free-threaded builds
        return False
    probe = ["an object marked for the check"]
    field = _count_field(probe)
    before = field.value
    field.value = IMMORTAL_COUNT
    held = [probe, probe, probe]
    held.clear()
    kept = field.value == IMMORTAL_COUNT
    field.value = before  # it is freed as usual
    return kept


@dataclass(frozen=True)
class Marked:
    """What :func:`immortalize` did: the objects it marked, and those it found already immortal."""

    marked: int
    already: int


def immortalize() -> Marked:
    """Mark every object reachable from the collector's objects immortal (see the module's
    docstring). Returns the counts; marks nothing where :func:`supported` says no."""
    if not supported():
        return Marked(0, 0)
    pending = gc.get_objects()
    seen: set[int] = set()
    marked = already = 0
    while pending:
        obj = pending.pop()
        address = id(obj)
        if address in seen:
            continue
        seen.add(address)
        field = _count_field(obj)
        if (field.value & LOW_32_BITS) >= IMMORTAL_FROM:
            already += 1
        else:
            field.value = IMMORTAL_COUNT
            marked += 1
        # What an object holds: the untracked ones (strings, numbers, tuples of them) are found
        # only through their holders.
        pending.extend(gc.get_referents(obj))
    return Marked(marked, already)
