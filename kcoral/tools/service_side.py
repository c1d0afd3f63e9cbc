"""The code that the command-line adapters upload: it runs on the service, inside a worker.

It is uploaded as source with every program (``Program.upload(kind="module")``) rather than
imported from the service's own ``kcoral``, so an adapter works against a service of another
version; for the same reason it imports the standard library only.

Two entry points, each called by one ``run`` instruction in the worker's working directory:

- ``run_steps(steps, timeout_seconds, fetch)`` runs commands one after the other (the tool, then
  helpers such as an ``ncu --import`` export). Each step is a map: ``argv`` (``PYTHON`` stands for
  the worker's own interpreter), and optionally ``missing`` (the message when the program is not
  installed), ``stdout`` (a file that receives the step's standard output), ``if_exists`` (run the
  step only when this path exists) and ``makedirs`` (folders to create first). The exit status is the
  first step's; a program that is not found gives 127 and a message, one killed at the deadline 124.
- ``evaluate_workload(folder, args, fetch)`` imports ``folder/workload.py`` and returns
  ``evaluate(*args)`` (see ``kcoral.tools.remote``).
- ``evaluate_trusted(folder, candidate, timeout_seconds, fetch)`` evaluates a candidate on a
  workload that defines ``make_inputs`` (see ``kcoral.workloads``); it imports the service's own
  ``kcoral``, the one exception to the rule below; ``evaluate_trusted_pair(folder, a, b,
  timeout_seconds, fetch)`` compares two candidates that way (``kcoral.workloads.pair``).

Both copy the paths named in ``fetch`` into ``FETCH_STAGE`` (``0``, ``1``, ... by position), which
the program then returns with ``return_folder``, and say what each one was: ``"file"``,
``"folder"``, ``"missing"`` or ``"outside"`` (a symlink that leaves the working directory). A missing
path is reported, not an error, so the tool's output and exit status still come back.

Commands inherit the worker's file descriptors 1 and 2, which the service captures at the
descriptor level: their output becomes the program's ``stdout`` and ``stderr``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PYTHON = "<kcoral:python>"  # in a step's argv: the worker's interpreter (sys.executable)
FETCH_STAGE = ".kcoral-fetch"
WORKLOAD_FILE = "workload.py"
EXIT_TIMED_OUT = 124  # as coreutils' timeout(1)
EXIT_CANNOT_EXECUTE = 126  # as a POSIX shell: found but not executable
EXIT_NOT_FOUND = 127  # as a POSIX shell: command not found
TERMINATE_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL, so a profiler can flush its report
# Where tools live when the sandbox's PATH does not name them: the interpreter's own bin folder
# (console scripts of the worker's virtual environment, such as run-iket), then the CUDA toolkit.
CUDA_HOME_VARIABLES = ("CUDA_HOME", "CUDA_PATH")
DEFAULT_CUDA_BIN = "/usr/local/cuda/bin"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_tool(name: str) -> str | None:
    """The executable for ``name``: a path as given, else PATH, the interpreter's folder, CUDA's."""
    if os.sep in name:
        return name if os.path.isfile(name) else None
    found = shutil.which(name)
    if found:
        return found
    folders = [Path(sys.executable).parent]
    folders += [Path(os.environ[var]) / "bin" for var in CUDA_HOME_VARIABLES if os.environ.get(var)]
    folders.append(Path(DEFAULT_CUDA_BIN))
    for folder in folders:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End the command and everything in its process group: SIGTERM, a grace period, SIGKILL."""
    for sig, wait in ((signal.SIGTERM, TERMINATE_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: dict[str, Any], deadline: float) -> int:
    """Run one step to completion or until ``deadline`` (time.monotonic); its exit status."""
    argv = [sys.executable if arg == PYTHON else str(arg) for arg in step["argv"]]
    name = "python" if step["argv"][0] == PYTHON else argv[0]  # for messages
    executable = find_tool(argv[0])
    if executable is None:
        _say(step.get("missing") or f"kcoral: {name}: command not found on the service")
        return EXIT_NOT_FOUND
    for folder in step.get("makedirs") or ():
        os.makedirs(folder, exist_ok=True)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        _say(f"kcoral: no time left to run {name} (raise --timeout)")
        return EXIT_TIMED_OUT
    sys.stdout.flush()
    sys.stderr.flush()
    out = None
    if step.get("stdout"):
        Path(step["stdout"]).parent.mkdir(parents=True, exist_ok=True)
        out = open(step["stdout"], "wb")  # closed below, once the process has ended
    try:
        try:
            # Its own process group, so that a timeout ends the tool's children too (ncu runs the
            # target as a child); stdin is empty because nobody can type into a remote tool.
            process = subprocess.Popen(
                [executable, *argv[1:]], stdin=subprocess.DEVNULL, stdout=out, start_new_session=True
            )
        except OSError as exc:
            _say(f"kcoral: cannot run {name}: {exc}")
            return EXIT_CANNOT_EXECUTE
        try:
            code = process.wait(remaining)
        except subprocess.TimeoutExpired:
            _stop(process)
            _say(f"kcoral: {name} ran past the time limit and was stopped (raise --timeout)")
            return EXIT_TIMED_OUT
    finally:
        if out is not None:
            out.close()
    # A signal shows as 128 + its number, as a shell reports it.
    return code if code >= 0 else 128 - code


def run_steps(steps: list[dict[str, Any]], timeout_seconds: float, fetch: list[str]) -> dict[str, Any]:
    """Run ``steps`` in order, then stage ``fetch``; the first step's exit status and the fetches."""
    deadline = time.monotonic() + timeout_seconds
    exit_code = 0
    for index, step in enumerate(steps):
        guard = step.get("if_exists")
        if guard and not os.path.exists(guard):
            continue
        code = run_step(step, deadline)
        if index == 0:
            exit_code = code
        elif code != 0:
            _say(f"kcoral: {step['argv'][0]} {' '.join(step['argv'][1:3])} ... exited with {code}")
    return {"exit_code": exit_code, "fetched": stage_fetches(fetch)}


def _link_or_copy(source: str, target: str) -> str:
    # A hard link costs no space or time for a large report; a copy where links are not allowed.
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target


def stage_fetches(paths: list[str]) -> list[str]:
    """Copy each path into FETCH_STAGE/<position>; what each one was."""
    stage = Path(FETCH_STAGE)
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    root = Path.cwd().resolve()
    kinds: list[str] = []
    for index, rel in enumerate(paths):
        source = Path(rel)
        resolved = source.resolve()
        target = stage / str(index)
        if resolved != root and root not in resolved.parents:
            kinds.append("outside")
        elif source.is_file():
            _link_or_copy(str(source), str(target))
            kinds.append("file")
        elif source.is_dir():
            # Symlinks are copied as links, and return_folder leaves them behind.
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
            kinds.append("folder")
        else:
            kinds.append("missing")
    return kinds


def jsonable(value: Any) -> Any:
    """``value`` with numpy and torch values turned into lists and numbers, anything else into text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def evaluate_trusted(folder: str, candidate: str | None, timeout_seconds: float, fetch: list[str]) -> dict[str, Any]:
    """Evaluate ``candidate`` on the workload in ``folder`` the trusted way (``kcoral.workloads``):
    the candidate runs in a process of its own, the check runs here. Needs the service's kcoral."""
    from kcoral.workloads.harness import evaluate

    report = evaluate(folder, candidate, timeout_seconds)
    return {"report": jsonable(report), "fetched": stage_fetches(fetch)}


def evaluate_trusted_pair(folder: str, a: str, b: str, timeout_seconds: float, fetch: list[str]) -> dict[str, Any]:
    """Compare candidates ``a`` and ``b`` on the workload in ``folder`` the trusted way, in paired
    rounds timed by the harness (``kcoral.workloads.pair``). Needs the service's kcoral."""
    from kcoral.workloads.pair import evaluate_pair

    report = evaluate_pair(folder, a, b, timeout_seconds)
    return {"report": jsonable(report), "fetched": stage_fetches(fetch)}


def evaluate_workload(folder: str, args: list[str], fetch: list[str]) -> dict[str, Any]:
    """Import ``folder/workload.py`` and return ``evaluate(*args)``, run inside ``folder``."""
    root = Path(folder).resolve()
    source = root / WORKLOAD_FILE
    if not source.is_file():
        raise FileNotFoundError(f"{folder}/{WORKLOAD_FILE} is missing: a workload folder defines evaluate() there")
    spec = importlib.util.spec_from_file_location("kcoral_workload", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved_cwd = os.getcwd()
    # The workload may import its sibling modules and open its data files by relative paths.
    sys.path.insert(0, str(root))
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    try:
        os.chdir(root)
        spec.loader.exec_module(module)
        evaluate = getattr(module, "evaluate", None)
        if not callable(evaluate):
            raise AttributeError(f"{folder}/{WORKLOAD_FILE} defines no evaluate(...) function")
        report = evaluate(*args)
    finally:
        os.chdir(saved_cwd)
        sys.path.remove(str(root))
    if not isinstance(report, dict):
        raise TypeError(f"evaluate() must return a dict (the report), not {type(report).__name__}")
    return {"report": jsonable(report), "fetched": stage_fetches(fetch)}
