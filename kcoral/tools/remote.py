"""``kcoral remote``: evaluate a packaged workload on the service and print its report.

A *workload* is a folder holding ``workload.py``, which defines::

    def evaluate(*args: str) -> dict:
        ...   # build inputs, run the baseline or candidate, check it, time it
        return {"correct": True, "latency_ms_median": 0.123, ...}

with the folder's other files beside it (kernels, reference data, helper modules). ``kcoral remote
-- WORKLOAD_DIR [ARGS...]`` sends the folder (at the same relative path, or under its base name when
absolute), imports ``workload.py`` on the service with the folder as the current directory and first
on ``sys.path``, calls ``evaluate(*ARGS)`` (the arguments are strings) in the worker itself holding
the GPU lease, and prints the returned report as JSON on stdout, after the workload's own output.
Numpy and torch values in the report become numbers and lists; other objects become text.

Exit status: 0 when the report's ``correct`` is true or absent, 1 when it is false (or falsy); 70 when
``evaluate`` raised (the error and its traceback are printed), or did not return a dict.

Example::

    kcoral remote --timeout 120 -- workloads/gemm_fp8 candidate
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kcoral.tools.adapter import EXIT_OK, UsageError, execute, options_from_args, plan_send
from kcoral.tools.service_side import WORKLOAD_FILE

NAME = "remote"
HELP = "evaluate a packaged workload (a folder with workload.py defining evaluate) and print its report"
EXIT_INCORRECT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags of its own: the workload folder and its arguments come after ``--``."""


def main(args: argparse.Namespace) -> int:
    options = options_from_args(NAME, args)
    if not options.tool_args:
        raise UsageError("give the workload folder (and evaluate's arguments) after --")
    folder, *evaluate_args = options.tool_args
    if not (Path(folder) / WORKLOAD_FILE).is_file():
        raise UsageError(f"{folder} is not a workload folder: it has no {WORKLOAD_FILE} defining evaluate(...)")
    try:
        workload = plan_send(folder)
    except UsageError:
        # "." or a path through "..": it has no relative place remotely, so it goes by its name.
        workload = plan_send(str(Path(folder).resolve()))
    options.sends = [send for send in options.sends if send.dest != workload.dest] + [workload]
    status, outcome = execute(options, "evaluate_workload", [workload.dest, evaluate_args])
    if outcome is None:
        return status
    report = outcome.get("report")
    print(json.dumps(report, indent=2, sort_keys=True))
    sys.stdout.flush()
    if isinstance(report, dict) and not report.get("correct", True):
        return EXIT_INCORRECT
    return EXIT_OK
