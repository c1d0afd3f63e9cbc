"""``kcoral remote``: evaluate a packaged workload on the service and print its report.

The trusted way: a workload whose ``workload.py`` defines ``make_inputs(seed)``, ``reference`` and
optionally ``check``, ``baseline``, ``TIMING`` and ``TOLERANCE`` (see ``kcoral.workloads.format``).
``kcoral remote -- WORKLOAD_DIR CANDIDATE.py`` sends both; the service makes fresh inputs from a new
seed every run, computes the reference, runs the candidate in a process of its own (timed by
``benchmark`` with fresh inputs per call) and checks every output it receives in a process into
which the candidate's code is never loaded. The report gives ``correct``, ``check``, ``timing``,
``baseline``, ``speedup`` and ``integrity`` (verdict and reasons); the times are the harness's
own (``kcoral.workloads.harness``). Without a candidate the baseline is evaluated. With two,
``kcoral remote -- WORKLOAD_DIR A.py B.py`` compares them in paired rounds timed by the harness
(``kcoral.workloads.pair``): the report gives ``verdict`` (``faster``, ``slower``, ``same`` or
``unclear``: B against A), ``ratio`` (B/A) with its 95% interval, each side's net time and checks,
and what ended the sampling; ``correct`` is true when both pass their checks. A tampered
measurement fails the program with ``integrity`` (exit 70). The report is the only thing on
stdout: the program's own output, the candidate's included, goes to stderr.

The free-form way: a folder whose ``workload.py`` defines::

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

from kcoral.tools.adapter import EXIT_OK, UsageError, execute, options_from_args, plan_send, tool_deadline
from kcoral.tools.service_side import WORKLOAD_FILE
from kcoral.workloads.format import is_trusted_workload

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
    if is_trusted_workload(folder):
        if len(evaluate_args) > 2:
            raise UsageError("a workload with make_inputs takes one candidate (or two, to compare) after the folder")
        candidates = []
        for name in evaluate_args:
            if not Path(name).is_file():
                raise UsageError(f"the candidate {name} is not a file")
            try:
                sent = plan_send(name)
            except UsageError:  # a path through "..": sent under its base name
                sent = plan_send(str(Path(name).resolve()))
            options.sends = [send for send in options.sends if send.dest != sent.dest] + [sent]
            candidates.append(sent.dest)
        if len(candidates) == 2 and candidates[0] == candidates[1]:
            raise UsageError("the two candidates are sent to the same path: give them different names")
        candidate = candidates[0] if candidates else None
        deadline = tool_deadline(options.timeout_seconds)
        # The report is the harness's alone: the program's stdout (which the candidate never shares,
        # but a workload might print to) goes to stderr, and stdout carries the report only.
        if len(candidates) == 2:
            # A against B in paired rounds timed by the harness (kcoral.workloads.pair).
            status, outcome = execute(
                options, "evaluate_trusted_pair", [workload.dest, *candidates, deadline], report_only_on_stdout=True
            )
        else:
            status, outcome = execute(
                options, "evaluate_trusted", [workload.dest, candidate, deadline], report_only_on_stdout=True
            )
    else:
        status, outcome = execute(options, "evaluate_workload", [workload.dest, evaluate_args])
    if outcome is None:
        return status
    report = outcome.get("report")
    print(json.dumps(report, indent=2, sort_keys=True))
    sys.stdout.flush()
    if isinstance(report, dict) and not report.get("correct", True):
        return EXIT_INCORRECT
    return EXIT_OK
