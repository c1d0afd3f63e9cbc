"""What a trusted workload folder holds, and how it is loaded.

A workload folder holds ``workload.py``; beside it, any helper modules and data it reads. It
defines::

    NAME = "add_f32_16m"                     # optional: a name for reports (default: the folder's)
    TIMING = {"warmup_ms": 25, "repeat_ms": 100}   # optional: benchmark() config for both runs
    TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}       # optional: for the default check
    ENTRY = "custom_kernel"                  # optional: the candidate's function name

    def make_inputs(seed: int) -> tuple:     # the inputs of one call, on the GPU, from a seed
        ...
    def reference(*inputs):                  # the expected output (computed by the service)
        ...
    def check(output, expected) -> None:     # optional: raise AssertionError when wrong
        ...                                  # (default: torch.testing.assert_close, TOLERANCE)
    def baseline(*inputs):                   # optional: what the speedup is over (default: reference)
        ...

A candidate is a Python file that defines ``ENTRY`` (``custom_kernel(*inputs)`` by default),
returning one tensor. ``kcoral remote -- WORKLOAD_DIR CANDIDATE.py`` evaluates it; without a
candidate, the baseline is evaluated against itself. A folder whose ``workload.py`` defines
``evaluate`` instead of ``make_inputs`` is a free-form workload (see ``kcoral.tools.remote``).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing.config import BenchmarkConfig

WORKLOAD_FILE: Final = "workload.py"
DEFAULT_ENTRY: Final = "custom_kernel"
DEFAULT_TOLERANCE: Final = {"rtol": 1e-5, "atol": 1e-5}
TIMING_KEYS_REFUSED: Final = frozenset({"defences"})


def defines(folder: str | Path, name: str) -> bool:
    """Whether ``folder/workload.py`` defines a top-level function ``name`` (read, not imported)."""
    path = Path(folder) / WORKLOAD_FILE
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def is_trusted_workload(folder: str | Path) -> bool:
    """A workload that the service evaluates itself (it defines ``make_inputs``)."""
    return defines(folder, "make_inputs")


@dataclass
class Workload:
    """A loaded workload: its functions and settings."""

    name: str
    folder: Path
    make_inputs: Callable[[int], Any]
    reference: Callable[..., Any]
    baseline: Callable[..., Any]
    check: Callable[[Any, Any], Any] | None
    timing: dict[str, Any] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))
    entry: str = DEFAULT_ENTRY

    def inputs(self, seed: int) -> tuple[Any, ...]:
        made = self.make_inputs(seed)
        return tuple(made) if isinstance(made, (tuple, list)) else (made,)

    def verify(self, torch: Any, output: Any, expected: Any) -> None:
        """Raise AssertionError (or another exception) when ``output`` is not ``expected``."""
        if self.check is not None:
            verdict = self.check(output, expected)
            if verdict is False:
                raise AssertionError("the workload's check returned False")
            return
        torch.testing.assert_close(output, expected, **self.tolerance)


def _callable(module: Any, name: str, *, required: bool) -> Callable[..., Any] | None:
    value = getattr(module, name, None)
    if value is None:
        if required:
            raise ExecutionError("parse", f"{WORKLOAD_FILE} defines no {name}(...)")
        return None
    if not callable(value):
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: {name} is a {type(value).__name__}, not a function")
    return value  # type: ignore[no-any-return]


def _timing(module: Any) -> dict[str, Any]:
    timing = getattr(module, "TIMING", None) or {}
    if not isinstance(timing, Mapping):
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: TIMING must be a dict of benchmark config keys")
    refused = sorted(TIMING_KEYS_REFUSED & set(timing))
    if refused:
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: TIMING may not set {refused}")
    BenchmarkConfig.from_mapping(timing)  # a parse error names the bad key
    return dict(timing)


def _tolerance(module: Any) -> dict[str, float]:
    tolerance = getattr(module, "TOLERANCE", None)
    if tolerance is None:
        return dict(DEFAULT_TOLERANCE)
    if not isinstance(tolerance, Mapping) or set(tolerance) - {"rtol", "atol"}:
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: TOLERANCE must be a dict with rtol and atol")
    values = {key: float(tolerance[key]) for key in ("rtol", "atol") if key in tolerance}
    if set(values) != {"rtol", "atol"} or any(v < 0 for v in values.values()):
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: TOLERANCE needs non-negative rtol and atol")
    return values


def _exec_module(spec: Any, search_dir: Path, what: str) -> Any:
    """Import ``spec``'s module with ``search_dir`` first on ``sys.path``; a failure is ``compile``."""
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(search_dir))
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except ExecutionError:
        raise
    except Exception as exc:
        raise ExecutionError("compile", f"importing {what} raised {type(exc).__name__}: {exc}") from exc
    return module


def load_workload(folder: str | Path, module_name: str = "kcoral_workload") -> Workload:
    """Import ``folder/workload.py`` (with the folder first on ``sys.path``) and validate it."""
    root = Path(folder).resolve()
    source = root / WORKLOAD_FILE
    if not source.is_file():
        raise ExecutionError("parse", f"{folder} is not a workload folder: it has no {WORKLOAD_FILE}")
    spec = importlib.util.spec_from_file_location(module_name, source)
    if spec is None or spec.loader is None:
        raise ExecutionError("parse", f"{source} cannot be imported")
    module = _exec_module(spec, root, WORKLOAD_FILE)
    make_inputs = _callable(module, "make_inputs", required=True)
    reference = _callable(module, "reference", required=True)
    assert make_inputs is not None and reference is not None
    entry = getattr(module, "ENTRY", DEFAULT_ENTRY)
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ExecutionError("parse", f"{WORKLOAD_FILE}: ENTRY must be a function name, not {entry!r}")
    name = getattr(module, "NAME", None) or root.name
    return Workload(
        name=str(name),
        folder=root,
        make_inputs=make_inputs,
        reference=reference,
        baseline=_callable(module, "baseline", required=False) or reference,
        check=_callable(module, "check", required=False),
        timing=_timing(module),
        tolerance=_tolerance(module),
        entry=entry,
    )


def load_candidate(path: str | Path, entry: str, module_name: str = "kcoral_candidate") -> Callable[..., Any]:
    """Import the candidate file and return its entry function (in the candidate's process only)."""
    source = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(module_name, source)
    if spec is None or spec.loader is None or not source.is_file():
        raise ExecutionError("parse", f"the candidate {path} is not a Python file")
    module = _exec_module(spec, source.parent, "the candidate")
    fn = getattr(module, entry, None)
    if not callable(fn):
        raise ExecutionError("compile", f"the candidate {Path(path).name} defines no {entry}(...)")
    return fn  # type: ignore[no-any-return]
