"""Command-line adapters that run GPU tools remotely through KCoral (``kcoral python``, ``ncu``,
``sanitizer``, ``iket``, ``remote``); what they share is in ``kcoral.tools.adapter``."""

from __future__ import annotations

import argparse
from functools import partial
from types import ModuleType

from kcoral.tools import iket, ncu, python, remote, sanitizer
from kcoral.tools.adapter import UsageError, add_common_arguments, usage_error

ADAPTERS: tuple[ModuleType, ...] = (python, ncu, sanitizer, iket, remote)


def add_adapter_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    default_url: str | None,
    default_keys: tuple[str | None, str | None] = (None, None),
) -> None:
    """Add one subcommand per adapter; ``args.adapter(args)`` then runs it and returns the exit status.
    ``default_url`` and ``default_keys`` are the caller's reading of KCORAL_URL, KCORAL_SERVER_KEY
    and KCORAL_CLIENT_KEY (only the CLI reads the environment)."""
    for module in ADAPTERS:
        parser = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_common_arguments(parser, default_url=default_url, default_keys=default_keys)
        module.add_arguments(parser)
        parser.set_defaults(adapter=partial(_run_adapter, module))


def _run_adapter(module: ModuleType, args: argparse.Namespace) -> int:
    try:
        return int(module.main(args))
    except UsageError as exc:
        return usage_error(module.NAME, str(exc))
