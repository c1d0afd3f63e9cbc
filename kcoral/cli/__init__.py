"""The ``kcoral`` command (``kcoral.cli:main``, ``python -m kcoral``, ``python -m kcoral.cli``).

One module a role: :mod:`~kcoral.cli.main` parses, sets up logging and reads the environment;
:mod:`~kcoral.cli.arguments` holds the flag types, shared flag groups and exit statuses;
:mod:`~kcoral.cli.broker` and :mod:`~kcoral.cli.router` are the service subcommands (their flags
and the settings built from them; what the broker decides from those settings is the broker's own,
:func:`kcoral.broker.settings.resolve`); :mod:`~kcoral.cli.service` is what the two services share
(signals, one-line start failures, keys); :mod:`~kcoral.cli.status` draws ``kcoral status``. The
client adapters (``kcoral python``, ``ncu``, ...) live in :mod:`kcoral.tools`.
"""

from kcoral.cli.arguments import EXIT_CONFIG, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from kcoral.cli.main import build_parser, configure_logging, main

__all__ = [
    "EXIT_CONFIG",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "build_parser",
    "configure_logging",
    "main",
]
