"""``kcoral python``: run a Python script, module or command on the service.

Examples::

    kcoral python -- check.py --size 4096          # check.py is sent when it is a local file
    kcoral python --send kernels -- -m kernels.test
    kcoral python -- -c "import torch; print(torch.cuda.get_device_name())"

The service's interpreter (the worker's ``sys.executable``) runs with the arguments after ``--``, in
the program's working directory, holding the GPU lease; its output and exit status come back.
"""

from __future__ import annotations

import argparse

from kcoral.tools.adapter import UsageError, options_from_args, run_steps, send_script
from kcoral.tools.service_side import PYTHON

NAME = "python"
HELP = "run a Python script, -m module or -c command on the service"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags of its own: everything after ``--`` goes to the interpreter."""


def main(args: argparse.Namespace) -> int:
    options = options_from_args(NAME, args)
    if not options.tool_args:
        raise UsageError("give a script, -m module or -c code after --")
    send_script(options)
    return run_steps(options, [{"argv": [PYTHON, *options.tool_args]}])
