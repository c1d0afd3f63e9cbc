"""The ``kcoral`` command: argument parsing, logging set-up and the environment, nothing else.

Each service subcommand lives in a module of its own (``kcoral.cli.broker``, ``kcoral.cli.router``;
what they share, signals included, in ``kcoral.cli.service``), the flag types in
``kcoral.cli.arguments``, the adapters in ``kcoral.tools``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import structlog

from kcoral import __version__
from kcoral.cli.arguments import (
    EXIT_CONFIG,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    HelpFormatter,
    Parser,
    absolute_path,
    add_logging_flags,
    log_level,
    positive,
    positive_seconds,
)
from kcoral.cli.broker import DEFAULT_BROKER_URL, add_broker_parser
from kcoral.cli.router import add_router_parser


def configure_logging(level: str, as_json: bool) -> None:
    """Key-value structlog events on stderr; called once, here."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def build_parser() -> argparse.ArgumentParser:
    from kcoral.tools import add_adapter_parsers
    from kcoral.tools.adapter import add_key_arguments

    key_defaults = (os.environ.get("KCORAL_SERVER_KEY"), os.environ.get("KCORAL_CLIENT_KEY"))
    parser = Parser(prog="kcoral", description="KCoral: a GPU evaluation service.")
    parser.add_argument("--version", action="version", version=f"kcoral {__version__}")
    add_logging_flags(parser, top=True)
    sub: argparse._SubParsersAction[argparse.ArgumentParser]
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)  # type: ignore[assignment]
    add_broker_parser(sub)
    add_router_parser(sub)

    keys = sub.add_parser("keys", help="CurveZMQ key pairs for services, clients and nodes")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    generate.add_argument("directory", type=absolute_path, metavar="DIR")
    generate.add_argument("--name", default="kcoral", help="the files' base name (default: kcoral)")
    generate.set_defaults(run=_keys)

    status = sub.add_parser(
        "status",
        help="show a broker's or router's capacity, queue, leases, workers",
        formatter_class=HelpFormatter,
    )
    status.add_argument(
        "url", nargs="?", default=None, help=f"tcp://HOST:PORT (default: $KCORAL_URL or {DEFAULT_BROKER_URL})"
    )
    status.add_argument("--json", action="store_true", help="the full health map as JSON (one per line with --watch)")
    status.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    status.add_argument("--interval", type=positive_seconds, default=1.0, metavar="S", help="seconds between pages")
    status.add_argument(
        "--count", type=positive, default=None, metavar="N", help="stop after N pages (implies --watch)"
    )
    status.add_argument(
        "--ready",
        action="store_true",
        help=f"print nothing; exit {EXIT_OK} when the service is ready for programs, {EXIT_NOT_READY} when it "
        f"is not (why on stderr), {EXIT_UNAVAILABLE} when it does not answer: a readiness probe",
    )
    add_key_arguments(status, key_defaults)
    status.set_defaults(run=_status)

    # The seed's adapters: python, ncu, sanitizer, iket, remote (their flags live in kcoral/tools).
    add_adapter_parsers(sub, default_url=os.environ.get("KCORAL_URL"), default_keys=key_defaults)
    for subcommand in sub.choices.values():
        add_logging_flags(subcommand, top=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level
    if level is None:
        try:
            level = log_level(os.environ.get("KCORAL_LOG_LEVEL", "info"))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"$KCORAL_LOG_LEVEL: {exc}")
    configure_logging(level, args.log_json)
    if getattr(args, "run", None) is not None:
        return int(args.run(args))
    if getattr(args, "adapter", None) is not None:
        return int(args.adapter(args))
    return EXIT_USAGE


def _keys(args: argparse.Namespace) -> int:
    from kcoral.keys import KeyFileError, generate_keypair

    try:
        public, secret = generate_keypair(args.directory, args.name)
    except (KeyFileError, OSError) as exc:
        print(f"kcoral keys: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"public key  {public}  (give it to the services, or to clients as --server-key)")
    print(f"secret key  {secret}  (mode 0600; keep it on this machine)")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from kcoral import KCoralError
    from kcoral.cli.status import check_ready, show, watch
    from kcoral.tools.adapter import UsageError, keys_from_args

    url = args.url or os.environ.get("KCORAL_URL") or DEFAULT_BROKER_URL
    try:
        keys = keys_from_args(args)
    except UsageError as exc:
        print(f"kcoral status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.ready and (args.watch or args.count or args.json):
        print("kcoral status: --ready goes without --watch, --count and --json", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.ready:
            reason = check_ready(url, keys=keys)
            if reason is not None:
                print(f"kcoral status: {url} is not ready: {reason}", file=sys.stderr)
                return EXIT_NOT_READY
        elif args.watch or args.count:
            watch(url, as_json=args.json, interval=args.interval, count=args.count, keys=keys)
        else:
            show(url, as_json=args.json, keys=keys)
    except ValueError as exc:  # not a zmq URL (http://...)
        print(f"kcoral status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KCoralError as exc:
        print(f"kcoral status: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `kcoral status --watch | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


__all__ = ["build_parser", "configure_logging", "main"]
