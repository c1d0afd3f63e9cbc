"""``kcoral iket``: capture an In-Kernel Event Tracing (IKET) timeline on the service.

Example::

    kcoral iket --output-dir gemm-trace -- gemm_iket.py --m 4096

runs ``run-iket --output-dir gemm-trace --clobber profile --postprocess all -- python3 gemm_iket.py
--m 4096`` holding the GPU lease and brings the ``gemm-trace`` folder back (Perfetto timelines and
JSON); name retained intermediates elsewhere with ``--fetch``. The kernel supplies its own named IKET
markers. ``run-iket`` ships with the ``nvidia-cutlass-dsl`` wheel and needs an SM90 or newer GPU;
where it is not installed the command says so and exits with 127. Timelines are diagnostic
evidence: instrumentation changes execution costs, so compare performance with ordinary benchmarks.
"""

from __future__ import annotations

import argparse

from kcoral.tools.adapter import fetch_automatically, run_steps, script_options, split_extra
from kcoral.tools.service_side import PYTHON

NAME = "iket"
HELP = "capture an IKET (In-Kernel Event Tracing) timeline with run-iket and fetch the traces"
DEFAULT_PROFILE_ARGS = "--postprocess all"
MISSING = (
    "kcoral iket: run-iket is not installed on the service (it ships with the nvidia-cutlass-dsl "
    "wheel: pip install nvidia-cutlass-dsl there); no trace was captured"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-dir", default="iket-trace", help="run-iket's output folder, fetched as a folder (default iket-trace)"
    )
    parser.add_argument(
        "--iket-args",
        default=DEFAULT_PROFILE_ARGS,
        help=f'options of "run-iket profile" as one string (default "{DEFAULT_PROFILE_ARGS}")',
    )


def main(args: argparse.Namespace) -> int:
    options = script_options(NAME, args, "trace")
    fetch_automatically(options, args.output_dir)
    argv = [
        "run-iket",
        "--output-dir",
        args.output_dir,
        "--clobber",
        "profile",
        *split_extra(args.iket_args),
        "--",
        PYTHON,
        *options.tool_args,
    ]
    return run_steps(options, [{"argv": argv, "missing": MISSING}])
