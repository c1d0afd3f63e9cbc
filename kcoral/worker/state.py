"""What a program may change in its worker process, saved before it runs and put back after.

With ``--max-programs-per-worker`` other than 1 one process runs several programs, and nothing one
program sets may reach the next: environment variables, the working directory, ``sys.path``, the
modules it uploaded or imported from its own directory, signal handlers and the signal mask,
pending alarms, the umask, the standard stream objects, warning filters, the root logger, and
torch's global settings (threads, default dtype and device, grad mode, determinism, matmul
precision, cuDNN and TF32 switches, anomaly mode, print options). The global random generators of
``random``, ``numpy`` and ``torch`` are not put back but seeded afresh, as a new interpreter's would
be, so two programs never draw the same numbers unless they seed them.

Modules that a program imported from the installed packages stay loaded (importing them again
would cost each program the time the zygote exists to save); their own module-level state is the
one thing that can still leak between the programs of a reused worker.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import signal
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MT19937_WORDS = 624  # numpy's legacy generator: its state, and its position once a state is new
MT19937_FIRST_WORD = 0x80000000  # as numpy's RandomState.seed() sets it
# Signals whose handlers a program cannot change or that the worker does not own.
_FIXED_SIGNALS = {signal.SIGKILL, signal.SIGSTOP}
# The others, listed once: signal.valid_signals() makes an enum member of each on every call
# (0.17 ms of each reused worker's program on the 2-core VM).
_SAVED_SIGNALS = tuple(sorted(s for s in signal.valid_signals() if s not in _FIXED_SIGNALS))


@dataclass
class TorchSettings:
    """torch's process-wide switches, read without initialising CUDA."""

    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, torch: Any) -> TorchSettings:
        backends = torch.backends
        values: dict[str, Any] = {
            "num_threads": torch.get_num_threads(),
            "default_dtype": torch.get_default_dtype(),
            "grad_enabled": torch.is_grad_enabled(),
            "deterministic": (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            "cudnn": (
                backends.cudnn.enabled,
                backends.cudnn.benchmark,
                backends.cudnn.deterministic,
                backends.cudnn.allow_tf32,
            ),
            "cuda_matmul": (
                backends.cuda.matmul.allow_tf32,
                backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            ),
            "print_options": dict(vars(torch._tensor_str.PRINT_OPTS)),
        }
        if hasattr(torch, "get_default_device"):
            values["default_device"] = torch.get_default_device()
        return cls(values)

    def restore(self, torch: Any) -> None:
        now = TorchSettings.read(torch).values
        changed = {name for name, value in self.values.items() if now.get(name) != value}
        saved = self.values
        backends = torch.backends
        for name in sorted(changed):
            with contextlib.suppress(Exception):  # one setting that cannot go back must not stop the rest
                if name == "num_threads":
                    torch.set_num_threads(saved[name])
                elif name == "default_dtype":
                    torch.set_default_dtype(saved[name])
                elif name == "grad_enabled":
                    torch.set_grad_enabled(saved[name])
                elif name == "deterministic":
                    torch.use_deterministic_algorithms(saved[name][0], warn_only=saved[name][1])
                elif name == "matmul_precision":
                    torch.set_float32_matmul_precision(saved[name])
                elif name == "anomaly":
                    torch.set_anomaly_enabled(saved[name][0], saved[name][1])
                elif name == "cudnn":
                    (
                        backends.cudnn.enabled,
                        backends.cudnn.benchmark,
                        backends.cudnn.deterministic,
                        backends.cudnn.allow_tf32,
                    ) = saved[name]
                elif name == "cuda_matmul":
                    (
                        backends.cuda.matmul.allow_tf32,
                        backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                        backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                    ) = saved[name]
                elif name == "print_options":
                    torch.set_printoptions(**saved[name])
                elif name == "default_device":
                    # The CPU is the default with no device mode at all; naming it would install
                    # a mode that every tensor factory call then goes through.
                    device = saved[name]
                    torch.set_default_device(None if str(device) == "cpu" else device)


@dataclass
class ProcessState:
    """A snapshot of the process-wide state a program could change."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    meta_path: list[Any]
    path_hooks: list[Any]
    modules: set[str]
    finders: set[str]
    argv: list[str]
    streams: tuple[Any, ...]
    hooks: tuple[Any, ...]
    recursion_limit: int
    switch_interval: float
    umask: int
    signals: dict[int, Any]
    signal_mask: set[int]
    warning_filters: list[Any]
    root_logger: tuple[list[logging.Handler], int]
    torch: TorchSettings | None

    @classmethod
    def capture(cls) -> ProcessState:
        umask = os.umask(0o022)
        os.umask(umask)
        signals: dict[int, Any] = {}
        for sig in _SAVED_SIGNALS:
            with contextlib.suppress(ValueError, OSError):
                signals[sig] = signal.getsignal(sig)
        torch = sys.modules.get("torch")
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            path=list(sys.path),
            meta_path=list(sys.meta_path),
            path_hooks=list(sys.path_hooks),
            modules=set(sys.modules),
            finders=set(sys.path_importer_cache),
            argv=list(sys.argv),
            streams=(sys.stdin, sys.stdout, sys.stderr),
            hooks=(sys.displayhook, sys.excepthook, sys.breakpointhook),
            recursion_limit=sys.getrecursionlimit(),
            switch_interval=sys.getswitchinterval(),
            umask=umask,
            signals=signals,
            signal_mask=set(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            warning_filters=list(warnings.filters),
            root_logger=(list(logging.root.handlers), logging.root.level),
            torch=TorchSettings.read(torch) if torch is not None else None,
        )

    def restore(self, scratch: Path) -> None:
        """Put everything back; forget the modules that were loaded from ``scratch``."""
        signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm the program set must not fire later
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.signal_mask)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        os.umask(self.umask)
        now = dict(os.environ)
        if now != self.environ:
            # As clear() and update() did, without unsetting first each name set again at once;
            # every saved one is set again, so one the program changed with os.putenv alone is too.
            for name in now.keys() - self.environ.keys():
                del os.environ[name]
            for name, value in self.environ.items():
                os.environ[name] = value
        sys.path[:] = self.path
        sys.meta_path[:] = self.meta_path
        sys.path_hooks[:] = self.path_hooks
        sys.argv[:] = self.argv
        sys.stdin, sys.stdout, sys.stderr = self.streams
        sys.displayhook, sys.excepthook, sys.breakpointhook = self.hooks
        sys.setrecursionlimit(self.recursion_limit)
        sys.setswitchinterval(self.switch_interval)
        warnings.filters[:] = self.warning_filters  # type: ignore[index]
        # Drop the warning registry's cached decisions (the function's name varies by version).
        mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
        if mutated is not None:
            mutated()
        handlers, level = self.root_logger
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
        self._forget_modules(scratch)
        torch = sys.modules.get("torch")
        if torch is not None and self.torch is not None:
            self.torch.restore(torch)
        reseed_generators()

    def _forget_modules(self, scratch: Path) -> None:
        """Forget the modules the program loaded from outside the installed packages.

        A module imported during the program stays only when its file lies under a directory that
        was on ``sys.path`` before the program started (the installation); uploaded modules and
        those found through paths the program added, or in its own directory, are dropped.
        """
        scratch_root = (os.path.join(os.path.abspath(scratch), ""),)
        installed = tuple(os.path.join(os.path.abspath(p), "") for p in self.path if p)
        for name in [n for n in sys.modules if n not in self.modules]:
            module = sys.modules.get(name)
            found = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
            places = [str(p) for p in found if p]
            foreign = any(_under(p, scratch_root) or not _under(p, installed) for p in places)
            if name.startswith("kcoral_upload_") or foreign:
                del sys.modules[name]
        for entry in [p for p in sys.path_importer_cache if p not in self.finders and not _under(p, installed)]:
            del sys.path_importer_cache[entry]
        importlib.invalidate_caches()


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return os.path.abspath(path).startswith(roots) if path else False


def reseed_generators() -> None:
    """Seed the global generators of ``random``, ``numpy`` and ``torch`` from fresh entropy."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        # A whole Mersenne Twister state of fresh entropy, its first word as seed() sets it (so
        # never the one state that is all zeros), without seed()'s way there: in a fresh fork
        # 0.23 ms and 65 page faults against 0.48 ms and 110 (Python 3.12, the 2-core VM).
        words = numpy.frombuffer(os.urandom(4 * MT19937_WORDS), dtype=numpy.uint32).copy()
        words[0] = MT19937_FIRST_WORD
        numpy.random.set_state(("MT19937", words, MT19937_WORDS))
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator alone (torch.seed() costs milliseconds in a fresh fork): CUDA's are
        # made when CUDA is initialised, in the worker, as in a new process.
        torch.default_generator.seed()
        if torch.cuda.is_initialized():
            torch.cuda.seed_all()


def cuda_view_mismatch(gpu_ids: list[int]) -> str | None:
    """Why this process cannot run a program on ``gpu_ids``, or None when it can.

    Once CUDA is initialised, the GPUs a process sees are fixed; a worker whose context was made
    for other GPUs (eagerly while idle, or by an earlier program) would give the program the
    wrong devices.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    seen = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    wanted = ",".join(str(g) for g in gpu_ids)
    if seen == wanted:
        return None
    return (
        f"this worker's CUDA context was created for GPU(s) [{seen}] and cannot serve a program "
        f"on [{wanted}]; the broker gives such programs a worker without one (or start it with --cuda-context lazy)"
    )
