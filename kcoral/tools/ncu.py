"""``kcoral ncu``: profile a Python script with Nsight Compute on the service.

Example::

    kcoral ncu --ncu-args "--set full -k regex:gemm" -- bench.py --size 4096

runs ``ncu --clock-control none --target-processes all -f -o kcoral-ncu [NCU_ARGS] python3 bench.py
--size 4096`` holding the GPU lease, exports the report's raw page as CSV (``ncu --import
kcoral-ncu.ncu-rep --csv --page raw``), and brings back ``kcoral-ncu.ncu-rep`` and
``kcoral-ncu.csv``. Clock control is off because KCoral's own benchmark manages clocks, and a
profile taken at locked base clocks would not compare with it. Profiles are diagnostic evidence:
compare performance with ordinary benchmarks. Where ncu is not installed the command says so and
exits with 127.
"""

from __future__ import annotations

import argparse

from kcoral.tools.adapter import fetch_automatically, run_steps, script_options, split_extra
from kcoral.tools.service_side import PYTHON

NAME = "ncu"
HELP = "profile a Python script with Nsight Compute (ncu) and fetch the report"
REPORT_SUFFIX = ".ncu-rep"
MISSING = (
    "kcoral ncu: ncu (NVIDIA Nsight Compute) is not installed on the service, or not on its PATH; nothing was profiled"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report",
        default="kcoral-ncu",
        help="report name, relative to the working directory; NAME.ncu-rep comes back (default kcoral-ncu)",
    )
    parser.add_argument("--ncu-args", default=None, help='more ncu options as one string, e.g. "--set full"')
    parser.add_argument("--no-csv", action="store_true", help="skip the CSV export of the report's raw page")


def main(args: argparse.Namespace) -> int:
    options = script_options(NAME, args, "profile")
    base = args.report.removesuffix(REPORT_SUFFIX)
    report, csv = base + REPORT_SUFFIX, base + ".csv"
    folder = base.rpartition("/")[0]
    profile = {
        "argv": [
            "ncu",
            "--clock-control",
            "none",
            "--target-processes",
            "all",
            "-f",
            "-o",
            base,
            *split_extra(args.ncu_args),
            PYTHON,
            *options.tool_args,
        ],
        "missing": MISSING,
        "makedirs": [folder] if folder else [],
    }
    steps = [profile]
    if args.no_csv:
        fetch_automatically(options, report)
    else:
        export = ["ncu", "--import", report, "--csv", "--page", "raw"]
        steps.append({"argv": export, "stdout": csv, "if_exists": report})
        fetch_automatically(options, report, csv)
    return run_steps(options, steps)
