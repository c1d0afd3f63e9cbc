"""``kcoral iket``: capture an In-Kernel Event Tracing (IKET) timeline on the service.

Example::

    kcoral iket --output-dir gemm-trace -- gemm_iket.py --m 4096

runs ``run-iket --output-dir gemm-trace --clobber profile --postprocess all -- python3 gemm_iket.py
--m 4096`` holding the GPU lease, brings the ``gemm-trace`` folder back, and then says which trace
files came (``iket_pid_<PID>.pftrace`` for https://ui.perfetto.dev, ``.trace.json``, ``.html``) with
their sizes, and one line per named stage read from the JSON: how many ranges, their median
duration. ``--keep`` keeps run-iket's intermediates (``tracker/``, ``gen-config/``, ``iket/``) in the
folder; name other files to bring back with ``--fetch``.

The kernel supplies its own named IKET markers (CuTe DSL: ``cutlass.cute.experimental.iket``'s
``range_start``/``range_end``, ``range_push``/``range_pop``, ``mark``); run-iket runs the script
twice (a tracker pass, then the traced pass) and turns the markers on through
``CUTE_DSL_COMPILER_OPT=iket``, so outside run-iket they compile to nothing. A kernel without markers
gets run-iket's own message and exit status, and a trace with no named stage (run-iket 4.8.1 writes
one that records no launch). ``run-iket`` ships with the
``nvidia-cutlass-dsl`` wheels (``pip install 'kcoral[iket]'``) and needs an SM90 or newer GPU; where
it is not installed the command says so and exits with 127. Timelines are diagnostic evidence:
instrumentation changes execution costs, so compare performance with ordinary benchmarks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kcoral.protocol import check_relative_path
from kcoral.tools.adapter import (
    SAVED_KEY,
    UsageError,
    execute,
    fetch_automatically,
    script_options,
    split_extra,
    tool_deadline,
)
from kcoral.tools.iket_trace import TRACE_JSON, read_summary, summary_lines, trace_files
from kcoral.tools.service_side import PYTHON

NAME = "iket"
HELP = "capture an IKET (In-Kernel Event Tracing) timeline with run-iket and fetch the traces"
DEFAULT_OUTPUT_DIR = "iket-trace"
# run-iket profile --postprocess: its choices; its own default is perfetto, ours all (the JSON is
# what the stage summary reads).
POSTPROCESS_CHOICES = ("perfetto", "json", "html", "all", "none")
DEFAULT_POSTPROCESS = "all"
LOG_LEVELS = ("error", "warn", "info")
MISSING = (
    "kcoral iket: run-iket is not installed on the service (it ships with the nvidia-cutlass-dsl "
    "wheels: pip install 'kcoral[iket]' there); no trace was captured"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help="run-iket's output folder, below the working directory, fetched as a folder "
        f"(default {DEFAULT_OUTPUT_DIR}); run-iket replaces it on every run",
    )
    parser.add_argument(
        "--postprocess",
        choices=POSTPROCESS_CHOICES,
        default=DEFAULT_POSTPROCESS,
        help=f"which traces run-iket writes (default {DEFAULT_POSTPROCESS}: Perfetto, JSON and HTML); "
        "the stage summary needs the JSON",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep run-iket's intermediates (tracker/, gen-config/, iket/) in the folder, fetched with it",
    )
    # Not --log-level: that is kcoral's own, on every subcommand.
    parser.add_argument("--iket-log-level", choices=LOG_LEVELS, default=None, help="run-iket's --log-level")
    parser.add_argument(
        "--iket-args",
        default=None,
        help='more options of "run-iket profile" as one string, e.g. "--enabled-cluster 0,0,0"',
    )


def output_dir(text: str) -> str:
    """The output folder as run-iket may own it: below the working directory, never the directory
    itself (run-iket deletes and recreates it). UsageError otherwise."""
    try:
        return check_relative_path(text, "--output-dir")
    except ValueError as exc:
        raise UsageError(f"{exc}: give a folder below the working directory, which run-iket may replace") from None


def command(args: argparse.Namespace, folder: str, tool_args: list[str]) -> list[str]:
    """The run-iket command line: its own options, then ``profile`` and its options, then the script."""
    argv = ["run-iket", "--output-dir", folder, "--clobber"]
    if args.iket_log_level:
        argv += ["--log-level", args.iket_log_level]
    argv += ["profile", "--postprocess", args.postprocess]
    if args.keep:
        argv.append("--keep")
    return [*argv, *split_extra(args.iket_args), "--", PYTHON, *tool_args]


def main(args: argparse.Namespace) -> int:
    folder = output_dir(args.output_dir)
    options = script_options(NAME, args, "trace")
    fetch_automatically(options, folder)
    step = {"argv": command(args, folder, options.tool_args), "missing": MISSING}
    status, outcome = execute(options, "run_steps", [[step], tool_deadline(options.timeout_seconds)])
    if outcome is not None:
        report(folder, args.postprocess, list(outcome.get(SAVED_KEY) or []), status)
    return status


def _say(message: str) -> None:
    print(f"kcoral {NAME}: {message}", file=sys.stderr, flush=True)


def report(folder: str, postprocess: str, saved: list[str], status: int) -> None:
    """Say which trace files came back (name, size) and summarize the stages of each trace JSON."""
    traces = trace_files(saved, folder)
    if not traces:
        if postprocess == "none":
            _say(f"no trace was asked for (--postprocess none); {folder} holds what run-iket kept")
        else:
            _say(
                f"run-iket wrote no trace in {folder} (exit status {status}): a kernel without IKET markers, "
                "or a run that failed before run-iket's postprocessing, leaves none; its own messages are above"
            )
        return
    for path in traces:
        size = Path(path).stat().st_size if Path(path).exists() else 0
        _say(f"trace {path} ({size} bytes)")
    jsons = [path for path in traces if TRACE_JSON.match(Path(path).name)]
    if not jsons:
        _say(f"no trace JSON (--postprocess {postprocess}), so no stage summary")
    for path in jsons:
        try:
            summary = read_summary(Path(path))
        except (OSError, ValueError) as exc:  # TraceFormatError is a ValueError, and so is bad JSON
            _say(f"{path}: cannot summarize it: {exc}")
            continue
        for line in summary_lines(summary):
            _say(f"{Path(path).name}: {line}")
