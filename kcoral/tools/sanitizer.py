"""``kcoral sanitizer``: run a Python script under Compute Sanitizer on the service.

Example::

    kcoral sanitizer --tool racecheck --log-file race.log -- attention_test.py

runs ``compute-sanitizer --tool racecheck --log-file race.log python3 attention_test.py`` holding the
GPU lease and brings ``race.log`` back; ``--save FILE`` (the sanitizer's binary record, read later
with ``compute-sanitizer --read FILE``) comes back the same way. The exit status is the sanitizer's:
by default the script's own, and with ``--sanitizer-args "--error-exitcode 9"`` 9 when it finds
errors. Where compute-sanitizer is not installed the command says so and exits with 127.
"""

from __future__ import annotations

import argparse

from kcoral.tools.adapter import fetch_automatically, run_steps, script_options, split_extra
from kcoral.tools.service_side import PYTHON

NAME = "sanitizer"
HELP = "run a Python script under Compute Sanitizer (memcheck, racecheck, initcheck, synccheck)"
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
MISSING = (
    "kcoral sanitizer: compute-sanitizer (part of the CUDA toolkit) is not installed on the service, "
    "or not on its PATH; nothing was checked"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool", choices=SANITIZER_TOOLS, default="memcheck", help="default memcheck")
    parser.add_argument("--save", metavar="FILE", default=None, help="save the findings to FILE and fetch it")
    parser.add_argument(
        "--log-file", metavar="FILE", default=None, help="write the sanitizer's log to FILE and fetch it"
    )
    parser.add_argument("--sanitizer-args", default=None, help="more compute-sanitizer options as one string")


def main(args: argparse.Namespace) -> int:
    options = script_options(NAME, args, "check")
    argv = ["compute-sanitizer", "--tool", args.tool]
    products = []
    for flag, path in (("--save", args.save), ("--log-file", args.log_file)):
        if path:
            argv += [flag, path]
            products.append(path)
    fetch_automatically(options, *products)
    argv += [*split_extra(args.sanitizer_args), PYTHON, *options.tool_args]
    folders = sorted({path.rpartition("/")[0] for path in products} - {""})
    return run_steps(options, [{"argv": argv, "missing": MISSING, "makedirs": folders}])
