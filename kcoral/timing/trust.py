"""The timer's trusted state: captured before uploaded code runs, checked around every measurement.

A zygote calls :func:`arm` once, before it forks any worker, and each worker inherits the armed
state and marks its program's start (:func:`arm_in_worker`), so that what the timer relies on is
taken from a process that no candidate has touched:

- whether CUPTI works here: outside a worker, cupti-python imports, the activity callbacks register
  and its clock reads; in a worker, cupti-python's module is taken (the zygote imported it) and the
  tracer is made from that module at the first measurement (:func:`ensure_tracer`). Where it
  imported, a later failure fails the instruction with ``integrity``: no silent fallback to CUDA
  events, which a candidate could force (a 0.18 ms matmul on a side stream then read 0.02 ms);
- the CUPTI tracer itself (one per process), used through this object and never looked up again
  through a class attribute that uploaded code could reset;
- references to the torch, CUPTI and standard-library functions the timer calls (``sync``,
  ``spin``, ``Event``, ``perf_counter``, ...), taken now rather than looked up at measure time;
- a snapshot of the timer's own code: every name in the ``kcoral.timing`` modules and
  ``kcoral.builtins``, every attribute of their classes, each function's code object and
  defaults, and the tracer's attributes.

:func:`verify` compares the present with the snapshot and names every difference; ``benchmark``
calls it before and after the timed calls and fails with ``integrity`` on any. One interpreter
cannot fully guard itself (a candidate that rewrites this module's own checker defeats it); the
check that cannot be tampered with runs in another process (``kcoral remote``).

Outside a worker (tests, scripts), ``benchmark`` arms on its first call.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import pkgutil
import secrets
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.timing.cupti import CuptiTracer, CuptiUnavailable
from kcoral.timing.neighbours import KnownPids

# The modules whose names and code the snapshot covers (imported by arm, so all of them exist):
# every module of the kcoral.timing package, found in the package itself (timing_modules), so that
# a module added to the package is watched without being listed, and those around it.
WATCHED_AROUND: Final = ("kcoral.errors", "kcoral.timing", "kcoral.builtins")


def timing_modules() -> tuple[str, ...]:
    """Every module of the kcoral.timing package, by name, sorted."""
    import kcoral.timing as package

    return tuple(sorted(f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)))


WATCHED_MODULES: Final = (*WATCHED_AROUND, *timing_modules())
# Watched too where already imported at arm: the candidate's process of ``kcoral remote`` runs
# kcoral.workloads.runner as __main__, and a patched runner could rewrite the report it sends.
WATCHED_IF_LOADED: Final = (
    "kcoral.workloads.channel",
    "kcoral.workloads.format",
    "kcoral.workloads.ipc",
    "kcoral.workloads.runner",
)
# Names in those modules that legitimately change after arm (the armed state itself).
VOLATILE_NAMES: Final = frozenset({"_ARMED", "_ARM_LOCK"})
# Functions of other libraries the timer calls, as (module, dotted attribute).
WATCHED_FOREIGN: Final = (
    ("torch", "cuda.synchronize"),
    ("torch", "cuda._sleep"),
    ("torch", "cuda.Event"),
    ("torch", "cuda.Event.record"),
    ("torch", "cuda.Event.elapsed_time"),
    ("torch", "cuda.current_device"),
    ("torch", "cuda.get_device_name"),
    ("torch", "cuda.get_device_properties"),
    ("torch", "Tensor.sum"),
    ("torch", "Tensor.clone"),
    ("torch", "Tensor.copy_"),
    ("torch", "Tensor.detach"),
    ("torch", "zeros"),
    ("torch", "empty_like"),
    ("torch", "testing.assert_close"),
    ("cupti.cupti", "activity_enable"),
    ("cupti.cupti", "activity_disable"),
    ("cupti.cupti", "activity_flush_all"),
    ("cupti.cupti", "activity_register_callbacks"),
    ("cupti.cupti", "activity_push_external_correlation_id"),
    ("cupti.cupti", "activity_pop_external_correlation_id"),
    ("cupti.cupti", "get_timestamp"),
    ("time", "perf_counter"),
    ("time", "time_ns"),
    ("statistics", "median"),
    ("statistics", "fmean"),
    ("statistics", "stdev"),
    ("secrets", "randbelow"),
    ("gc", "disable"),
    ("gc", "enable"),
    ("gc", "isenabled"),
    ("threading", "enumerate"),
    ("time", "time"),
    ("os", "getpid"),
    ("os", "readlink"),
    ("pynvml", "nvmlDeviceGetProcessUtilization"),
    ("pynvml", "nvmlDeviceGetComputeRunningProcesses"),
    ("pynvml", "nvmlDeviceGetClockInfo"),
    ("pynvml", "nvmlDeviceGetMaxClockInfo"),
    ("pynvml", "nvmlDeviceGetCurrentClocksEventReasons"),
    ("pynvml", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    ("numpy", "sort"),
    ("numpy", "quantile"),
    ("numpy", "asarray"),
    ("numpy", "random.Generator"),
    ("numpy", "random.PCG64"),
    ("statistics", "median_grouped"),
)
WATCHED_BUILTINS: Final = (
    "min", "max", "sorted", "sum", "len", "isinstance", "range", "float", "int", "list", "dict",
    "tuple", "set", "frozenset", "abs", "round", "zip", "enumerate", "any", "all", "iter", "next",
    "getattr", "hasattr", "id", "type", "repr", "str", "bool", "print",
)  # fmt: skip
# Changes named in one integrity message, at most.
CHANGES_SHOWN: Final = 6


def _resolve(root: Any, dotted: str) -> Any:
    value = root
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Fingerprint:
    """What one watched object was: itself, and for a function its code, defaults and closure."""

    obj_id: int
    code_id: int | None
    defaults_id: int | None
    kwdefaults_id: int | None
    closure: tuple[int, ...] | None

    @classmethod
    def of(cls, obj: Any) -> Fingerprint:
        function = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if isinstance(function, types.FunctionType):
            closure = function.__closure__
            return cls(
                id(obj),
                id(function.__code__),
                id(function.__defaults__),
                id(function.__kwdefaults__),
                tuple(id(cell.cell_contents) for cell in closure) if closure else None,
            )
        return cls(id(obj), None, None, None, None)

    def change(self, now: Fingerprint) -> str | None:
        if now.obj_id != self.obj_id:
            return "was replaced"
        if now.code_id != self.code_id:
            return "had its code replaced"
        if now.defaults_id != self.defaults_id or now.kwdefaults_id != self.kwdefaults_id:
            return "had its default arguments replaced"
        if now.closure != self.closure:
            return "had its closure changed"
        return None


@dataclass
class Snapshot:
    """Fingerprints by name (``module.name``, ``module.Class.attr``, ``torch.cuda.synchronize``...)."""

    entries: dict[str, Fingerprint] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)  # keeps fingerprinted objects alive (ids stay unique)


def _watch(snapshot: Snapshot, name: str, obj: Any) -> None:
    snapshot.entries[name] = Fingerprint.of(obj)
    snapshot.objects[name] = obj


def take_snapshot(modules: dict[str, types.ModuleType], tracer: CuptiTracer | None) -> Snapshot:
    snapshot = Snapshot()
    for module_name, module in modules.items():
        _watch(snapshot, f"sys.modules[{module_name!r}]", module)
        for name, value in list(vars(module).items()):
            if name in VOLATILE_NAMES or name.startswith("__"):
                continue
            _watch(snapshot, f"{module_name}.{name}", value)
            if isinstance(value, type) and value.__module__ == module_name:
                for attr, member in list(vars(value).items()):
                    if not attr.startswith("__") or attr in ("__init__", "__call__"):
                        _watch(snapshot, f"{module_name}.{name}.{attr}", member)
    for module_name, dotted in WATCHED_FOREIGN:
        foreign = sys.modules.get(module_name)
        if foreign is None:
            continue
        try:
            _watch(snapshot, f"{module_name}.{dotted}", _resolve(foreign, dotted))
        except AttributeError:
            continue
    for name in WATCHED_BUILTINS:
        _watch(snapshot, f"builtins.{name}", getattr(builtins, name))
    if tracer is not None:
        _watch_tracer(snapshot, tracer)
    return snapshot


def _watch_tracer(snapshot: Snapshot, tracer: CuptiTracer) -> None:
    _watch(snapshot, "CuptiTracer instance class", type(tracer))
    for attr, value in list(vars(tracer).items()):
        if attr not in ("_records", "_enabled"):
            _watch(snapshot, f"CuptiTracer instance .{attr}", value)


def compare(before: Snapshot, now: Snapshot) -> list[str]:
    """Every difference between two snapshots, as ``"NAME was replaced"``-style phrases."""
    changes: list[str] = []
    for name, fingerprint in before.entries.items():
        current = now.entries.get(name)
        if current is None:
            changes.append(f"{name} was removed")
            continue
        change = fingerprint.change(current)
        if change is not None:
            changes.append(f"{name} {change}")
    for name in now.entries.keys() - before.entries.keys():
        if name.startswith("CuptiTracer instance"):
            changes.append(f"{name} was added")
    return changes


@dataclass(frozen=True)
class Trusted:
    """References the timer calls, captured at arm (None where the library is missing)."""

    torch: Any
    synchronize: Callable[[], None] | None
    spin: Callable[[int], None] | None
    event: Any
    perf_counter: Callable[[], float]
    # The host's wall clock, which CUPTI's timestamps follow (CLOCK_REALTIME on Linux; read
    # against perf_counter's CLOCK_MONOTONIC it tells a step of the wall clock: Runner.wall_offset_ns).
    wall_ns: Callable[[], int]
    median: Callable[..., float]
    randbelow: Callable[[int], int]
    gc_disable: Callable[[], None]
    gc_enable: Callable[[], None]
    gc_isenabled: Callable[[], bool]
    enumerate_threads: Callable[[], list[threading.Thread]]
    # A context in which torch calls skip every torch-function mode and subclass override: the
    # timer's own torch calls (flush, snapshots, sentinel) run no candidate code through a mode.
    plain_torch: Callable[[], Any]
    # What the report is made with after the last check: nothing looked up then.
    device_name: Callable[[Any], str] | None = None


@dataclass
class ArmedState:
    """What :func:`arm` captured: the tracer (or why CUPTI does not work), references, the snapshot."""

    tracer: CuptiTracer | None
    cupti_error: str | None
    trusted: Trusted
    modules: dict[str, types.ModuleType]
    snapshot: Snapshot
    # The threads themselves, not their ids: an id is reused once a thread object is collected.
    threads_at_arm: frozenset[threading.Thread]
    armed_at: float
    in_worker: bool
    # cupti-python's module as imported at arm, where the tracer is made later (in a worker).
    cupti_module: Any = None
    # What the broker's GRANT said of the GPU's other processes (kcoral.timing.neighbours), and
    # how to ask it again (the worker's lease channel: the broker's answer, as the wire has it).
    known_pids: KnownPids | None = None
    ask_known_pids: Callable[[], Any] | None = None

    @property
    def cupti_ok(self) -> bool:
        return self.tracer is not None or self.cupti_module is not None


def ensure_tracer(state: ArmedState) -> CuptiTracer | None:
    """The armed tracer, made now from the module captured at arm where arm deferred it.

    None only where CUPTI did not import at arm. Where it did, a tracer that cannot be made now
    raises ``CuptiUnavailable``: the caller fails the instruction rather than fall back, since a
    candidate could otherwise force the fallback. The new tracer's attributes join the arm
    snapshot, so that later checks watch them too.
    """
    if state.tracer is None and state.cupti_module is not None:
        tracer = CuptiTracer(state.cupti_module)
        state.tracer = tracer
        _watch_tracer(state.snapshot, tracer)
    return state.tracer


_ARMED: ArmedState | None = None
_ARM_LOCK = threading.Lock()


def _capture_trusted() -> Trusted:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return Trusted(
        torch=torch,
        synchronize=getattr(cuda, "synchronize", None),
        spin=getattr(cuda, "_sleep", None),
        event=getattr(cuda, "Event", None),
        perf_counter=time.perf_counter,
        wall_ns=time.time_ns,
        median=statistics.median,
        randbelow=secrets.randbelow,
        gc_disable=gc.disable,
        gc_enable=gc.enable,
        gc_isenabled=gc.isenabled,
        enumerate_threads=threading.enumerate,
        plain_torch=getattr(getattr(torch, "_C", None), "DisableTorchFunction", None) or contextlib.nullcontext,
        device_name=getattr(cuda, "get_device_name", None),
    )


def arm(*, in_worker: bool = False, use_cupti: bool = True) -> ArmedState:
    """Capture the trusted state now (once per process; later calls return the first).

    Call before any uploaded code runs. Imports no GPU library but cupti-python, initialises no
    CUDA context and launches no GPU work (a spare worker holds no lease).
    """
    global _ARMED
    with _ARM_LOCK:
        if _ARMED is not None:
            return _ARMED
        modules = {name: importlib.import_module(name) for name in WATCHED_MODULES}
        for name in WATCHED_IF_LOADED:
            if name in sys.modules:
                modules[name] = sys.modules[name]
        main = sys.modules.get("__main__")
        if getattr(getattr(main, "__spec__", None), "name", None) in WATCHED_IF_LOADED:
            modules["__main__"] = main  # type: ignore[assignment]
        with contextlib.suppress(ImportError):
            import pynvml  # noqa: F401  (watched: the findings read NVML through it)
        tracer: CuptiTracer | None = None
        error: str | None = None
        cupti_module: Any = None
        if not use_cupti:
            error = "CUPTI was not armed (use_cupti=False)"
        elif in_worker:
            # In a worker only the module is taken now (the zygote imported it, so this is free):
            # registering CUPTI's activity callbacks initialises CUPTI, measured at 43 ms on the
            # H200, and on every GPU program's path that cut fresh workers from 122 to 14 a second.
            # The tracer is made from this very module at the first measurement (ensure_tracer);
            # from then on a failure of it fails the instruction, as for a tracer made here.
            try:
                from cupti import cupti as imported

                cupti_module = imported
            except Exception as exc:  # ImportError, or a missing libcupti raised from inside the import
                error = f"cupti-python is not importable: {exc}"
        else:
            try:
                tracer = CuptiTracer()
            except CuptiUnavailable as exc:
                error = str(exc)
        _ARMED = ArmedState(
            tracer=tracer,
            cupti_error=error,
            cupti_module=cupti_module,
            trusted=_capture_trusted(),
            modules=modules,
            snapshot=take_snapshot(modules, tracer),
            threads_at_arm=frozenset(threading.enumerate()),
            armed_at=time.time(),
            in_worker=in_worker,
        )
        return _ARMED


def arm_in_zygote() -> None:
    """:func:`arm` once in a zygote, before it forks any worker; a failure is printed, never raised.

    Every worker inherits the armed state by the fork: the same objects at the same addresses, so
    the snapshot's fingerprints hold in the worker as taken, from a process that has run no
    uploaded code (a spare worker beside a running program can neither read nor write the zygote
    or itself: neither is dumpable). Taken in each worker instead, the snapshot cost every GPU
    program 2 ms of walking and 4 to 7 ms of CPU in all on the 2-core VM, with the copy-on-write
    faults of the pages it touches (``benchmarks/spawn.py --checkout``, see RESULTS.md).
    """
    try:
        arm(in_worker=True)
    except Exception as exc:
        print(f"kcoral zygote: the timer could not be armed: {exc!r}", file=sys.stderr, flush=True)


def arm_in_worker() -> None:
    """Mark the start of a program in a worker, before any of its code runs; a failure is
    printed, never raised (the program then meets it in ``benchmark``).

    Arms where the zygote did not (a worker started on its own), and in any case counts the
    threads alive now (the worker's own: its output follower) as not the program's, and the
    program's start as the armed time.
    """
    try:
        state = arm(in_worker=True)
    except Exception as exc:
        print(f"kcoral worker: the timer could not be armed: {exc!r}", file=sys.stderr, flush=True)
        return
    state.threads_at_arm = frozenset(threading.enumerate())
    state.armed_at = time.time()
    state.known_pids, state.ask_known_pids = None, None


def note_grant(gpu_pids: Any, ask: Callable[[], Any] | None = None) -> None:
    """Keep the GRANT's ``gpu_pids`` (kcoral.timing.neighbours) for this program's measurements,
    and ``ask``, which gets them as they are now: called by the worker's lease channel when the
    broker grants the lease, never by a program."""
    state = _ARMED
    if state is not None:
        state.known_pids, state.ask_known_pids = KnownPids.from_wire(gpu_pids), ask


def ask_again(state: ArmedState) -> Callable[[], KnownPids | None] | None:
    """What the broker says of the GPU's other processes now, joined to what it said at the grant
    (a spare forked while the program measured was not there to be named then); None outside a
    worker's lease, and the call's None where the broker does not answer."""
    ask = state.ask_known_pids
    if ask is None:
        return None

    def now() -> KnownPids | None:
        later = KnownPids.from_wire(ask())
        if later is None or state.known_pids is None:
            return None
        state.known_pids = state.known_pids.joined(later)
        return state.known_pids

    return now


def armed() -> ArmedState:
    """The armed state, arming now where nothing armed it (outside a worker)."""
    state = _ARMED
    return state if state is not None else arm()


def verify(state: ArmedState) -> list[str]:
    """What changed in the timer's watched state since arm (empty: nothing)."""
    changes = compare(state.snapshot, take_snapshot(state.modules, state.tracer))
    for name, module in state.modules.items():
        if sys.modules.get(name) is not module:
            changes.append(f"sys.modules[{name!r}] was replaced")
    return changes


def describe_changes(changes: list[str]) -> str:
    shown = "; ".join(changes[:CHANGES_SHOWN])
    more = f" (and {len(changes) - CHANGES_SHOWN} more)" if len(changes) > CHANGES_SHOWN else ""
    return shown + more


class QuietInterpreter:
    """While the timed calls run: no garbage collection (a collection runs candidates' finalisers at
    any point of the timer's own code), no trace or profile function, no ``sys.monitoring`` events
    (each runs arbitrary code inside the timer). Everything is put back afterwards."""

    def __init__(self, trusted: Trusted) -> None:
        self._trusted = trusted
        self._gc_was_enabled = True
        self._trace: Any = None
        self._profile: Any = None
        self._monitoring: dict[int, int] = {}

    def __enter__(self) -> QuietInterpreter:
        self._gc_was_enabled = self._trusted.gc_isenabled()
        self._trusted.gc_disable()
        self._trace, self._profile = sys.gettrace(), sys.getprofile()
        sys.settrace(None)
        sys.setprofile(None)
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is not None:
            for tool in range(6):
                try:
                    events = monitoring.get_events(tool)
                except ValueError:
                    continue
                if events:
                    self._monitoring[tool] = events
                    monitoring.set_events(tool, 0)
        return self

    def __exit__(self, *exc: object) -> None:
        monitoring = getattr(sys, "monitoring", None)
        for tool, events in self._monitoring.items():
            try:
                monitoring.set_events(tool, events)  # type: ignore[union-attr]
            except ValueError:
                pass
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        if self._gc_was_enabled:
            self._trusted.gc_enable()
