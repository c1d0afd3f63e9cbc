"""The argument types, shared flag groups and exit statuses of the ``kcoral`` command (``kcoral.cli``
and the subcommands' modules build the parsers from them): each type turns one flag's text into a
value or a one-line error."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, NoReturn

from kcoral import protocol
from kcoral.units import format_bytes, parse_size

EXIT_OK = 0
EXIT_NOT_READY = 1  # kcoral status --ready: the service answers but is not ready for programs
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # the service could not be reached
EXIT_CONFIG = 78  # the service cannot start with these settings
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the full usage of ``kcoral broker`` is 20 lines, which
    buries the message; ``--help`` is named instead."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default (sizes human-readable) unless its help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text or default is None or default is False:
            return text
        if default == [] or default is argparse.SUPPRESS:
            return text
        shown = format_bytes(default) if action.type is size else "%(default)s"
        return f"{text} (default: {shown})"


def size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def frame_size(text: str) -> int:
    value = size(text)
    if not protocol.MIN_FRAME_BYTES <= value <= protocol.MAX_BODY_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected {protocol.MIN_FRAME_BYTES} to {protocol.MAX_BODY_BYTES} bytes, got {text}"
        )
    return value


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, not {text!r}")
    return text.lower()


def gpu_list(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes indices like 0,1, not {text!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"--gpus takes distinct indices >= 0, not {text!r}")
    return gpus


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None


def integer_at_least(text: str, low: int) -> int:
    value = integer(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
    return value


def positive(text: str) -> int:
    return integer_at_least(text, 1)


def non_negative(text: str) -> int:
    return integer_at_least(text, 0)


def seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def endpoint(text: str) -> str:
    if not re.fullmatch(r"tcp://.+:[0-9]+|ipc://.+", text):
        hint = f" (did you mean tcp://{text}?)" if re.fullmatch(r"[^/:]+:[0-9]+", text) else ""
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, not {text!r}{hint}")
    return text


def metrics_listen(text: str) -> str:
    from kcoral.service.metrics import parse_listen

    try:
        parse_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def node_id(text: str) -> str:
    if not protocol.ID_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a node id is 1 to 200 of letters, digits and '_.:-', not {text!r}")
    return text


def absolute_path(text: str) -> Path:
    # Absolute from here on: a sandboxed zygote runs in /workspace, where a relative ipc:// path
    # or bind source would point elsewhere.
    return Path(text).absolute()


def existing_path(text: str) -> Path:
    path = absolute_path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return path


def add_logging_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The global flags; on a subcommand too (``kcoral broker --log-json``), where they default to
    nothing so that they do not undo the same flag given before the subcommand."""
    parser.add_argument(
        "--log-level",
        metavar="LEVEL",
        type=log_level,
        default=None if top else argparse.SUPPRESS,
        help=f"one of {', '.join(LOG_LEVELS)} (default: $KCORAL_LOG_LEVEL or info)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="one JSON object per log line",
    )


def add_access_arguments(parser: argparse.ArgumentParser, *, nodes: bool = False) -> None:
    """CurveZMQ and fair share, the same for broker and router (kcoral/service/)."""
    parser.add_argument(
        "--curve-secret-key",
        type=existing_path,
        default=None,
        metavar="FILE",
        help="this service's secret key file (kcoral keys generate): CurveZMQ on its TCP endpoints",
    )
    parser.add_argument(
        "--authorized-keys",
        type=existing_path,
        default=None,
        metavar="DIR",
        help="a directory of the clients' public key files (*.key); only those clients may connect",
    )
    if nodes:
        parser.add_argument(
            "--authorized-node-keys",
            type=existing_path,
            default=None,
            metavar="DIR",
            help="a directory of the host brokers' public key files; only those may register as nodes",
        )
    parser.add_argument(
        "--insecure-listen-any",
        action="store_true",
        help="without keys, listen beyond loopback anyway (anyone who reaches the port may use it)",
    )
    parser.add_argument(
        "--max-queued-per-client",
        type=positive,
        default=None,
        help="programs one client (one key, or one connection without keys) may have waiting "
        "(default: a quarter of --max-queued)",
    )
    parser.add_argument(
        "--orphan-grace",
        type=positive_seconds,
        default=None,
        help="seconds a disconnected client's running programs go on before they are cancelled (default 10)",
    )


def add_max_request_bytes(parser: argparse.ArgumentParser) -> None:
    """The one program-size bound that broker and router both check (kcoral/service/admission.py)."""
    parser.add_argument(
        "--max-request-bytes",
        type=size,
        default=protocol.DEFAULT_MAX_REQUEST_BYTES,
        help="declared sizes and blob bytes of one program",
    )


def add_upload_bounds(parser: argparse.ArgumentParser) -> None:
    """What uploads may hold of a service's memory, the same for broker and router."""
    parser.add_argument(
        "--max-upload-bytes",
        type=size,
        default=None,
        help="bytes of uploads in progress, all clients together (default: twice --max-request-bytes)",
    )
    parser.add_argument(
        "--max-upload-bytes-per-client",
        type=size,
        default=None,
        help="bytes of uploads in progress per client (default: --max-request-bytes)",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=frame_size,
        default=protocol.DEFAULT_MAX_FRAME_BYTES,
        help="the largest frame a client may send (libzmq MAXMSGSIZE): what one connection can make "
        "the service hold with a frame it never finishes; larger blobs are uploaded in pieces",
    )


def add_connection_cap(parser: argparse.ArgumentParser) -> None:
    """How many TCP connections one peer address may hold, the same for broker and router."""
    parser.add_argument(
        "--max-connections-per-address",
        type=non_negative,
        default=0,
        help="TCP connections one peer address may hold to the client socket (the loopback: all local "
        "clients together); each can hold an unfinished frame of --max-frame-bytes; 0: no cap (the default)",
    )


def add_metrics_listen(parser: argparse.ArgumentParser) -> None:
    """The Prometheus endpoint, the same for broker and router (kcoral/service/metrics.py)."""
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        type=metrics_listen,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
    )


METAVARS: dict[Any, str] = {
    size: "SIZE",
    frame_size: "SIZE",
    endpoint: "URL",
    positive: "N",
    non_negative: "N",
    positive_seconds: "S",
    gpu_list: "LIST",
    absolute_path: "DIR",
    existing_path: "PATH",
    node_id: "NAME",
}


def name_values(parser: argparse.ArgumentParser) -> None:
    """``--cache-bytes SIZE`` in the usage rather than ``--cache-bytes CACHE_BYTES``."""
    for action in parser._actions:
        if action.metavar is None and action.type in METAVARS:
            action.metavar = METAVARS[action.type]


def add_service_arguments(parser: argparse.ArgumentParser, *, nodes: bool = False) -> None:
    """What both services take last: access (keys, insecure listening), the upload bounds, the cap on
    connections per address and the metrics endpoint; then the values named in the usage."""
    add_access_arguments(parser, nodes=nodes)
    add_upload_bounds(parser)
    add_connection_cap(parser)
    add_metrics_listen(parser)
    name_values(parser)
