"""The ``kcoral`` command: argument parsing, logging set-up and the environment, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from kcoral import __version__, protocol
from kcoral.cli_arguments import (
    EXIT_USAGE,
    _absolute_path,
    _add_access_arguments,
    _add_logging_flags,
    _add_max_request_bytes,
    _endpoint,
    _existing_path,
    _gpu_list,
    _HelpFormatter,
    _log_level,
    _metrics_listen,
    _node_id,
    _non_negative,
    _Parser,
    _positive,
    _positive_seconds,
    _size,
)

if TYPE_CHECKING:
    from kcoral.service.shell import ServiceShell

EXIT_OK = 0
EXIT_UNAVAILABLE = 69  # the service could not be reached
EXIT_CONFIG = 78  # the broker cannot start with these settings


DEFAULT_BROKER_URL = "tcp://127.0.0.1:5555"
DEFAULT_ROUTER_URL = "tcp://127.0.0.1:6000"
DEFAULT_ROUTER_NODES_URL = "tcp://127.0.0.1:6001"

# Default per-worker limits (see kcoral.worker.processes for how each is enforced). Generous for
# real work, tight enough that a runaway program fails with a message naming the limit before it
# starves the host: a parallel nvcc/ninja build on a large host runs a few hundred processes; no
# single file a kernel program writes (profiles, datasets) nears 16 GiB; 16384 descriptors are
# more than any program needs, and a descriptor leak then fails fast.
DEFAULT_MAX_PROCESSES = 1024
DEFAULT_MAX_FILE_BYTES = 16 << 30
DEFAULT_MAX_OPEN_FILES = 16384
# Memory: the workers together may use this share of the host's RAM, so that a memory bomb meets
# its worker's limit before the kernel's OOM killer picks a victim (the broker, perhaps). The floor
# keeps room for a CUDA context, which alone counts about 1.4 GiB of private memory.
DEFAULT_MEMORY_SHARE = 0.8
MIN_DEFAULT_MEMORY_BYTES = 4 << 30
# Workspace: the slots together may fill this share of the free disk under the run directory, so
# that one program cannot fill the host's disk; the cap keeps it a per-program bound on big disks.
DEFAULT_WORKSPACE_DISK_SHARE = 0.5
MAX_DEFAULT_WORKSPACE_BYTES = 64 << 30
MIN_DEFAULT_WORKSPACE_BYTES = 1 << 30


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


class Service(Protocol):
    """A broker or a router, as the entry point runs it: it serves, and its shell drains or stops."""

    shell: ServiceShell[Any]

    async def serve(self) -> int: ...


def install_event_loop_policy() -> None:
    """Use uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_service(name: str, make: Callable[[], Service], cannot_start: tuple[type[Exception], ...] = ()) -> int:
    """Run a service until it stops and return the exit code; the signals are the entry point's,
    not the service's.

    SIGTERM and SIGINT (Ctrl-C) drain: no new programs, those in flight finish. A second SIGINT
    stops at once (programs in flight are answered ``engine``). The broker starts its zygotes in
    their own session, so a terminal's Ctrl-C reaches the broker alone, as SIGTERM does. An
    endpoint that cannot be bound, or one of ``cannot_start``, ends it with one line and
    EXIT_CONFIG.
    """
    import zmq

    from kcoral.metrics import MetricsListenError

    log = structlog.get_logger("kcoral.cli")

    async def serve() -> int:
        service = make()  # inside the loop: the service's events and sockets belong to it
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if sig == signal.SIGINT and service.shell.draining:
                log.warning("stopping_now", signal=sig.name)
                service.shell.stop()
            else:
                log.info("signal_received", signal=sig.name)
                service.shell.drain()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await service.serve()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    install_event_loop_policy()
    try:
        return asyncio.run(serve())
    except cannot_start as exc:
        log.error(f"{name}_cannot_start", error=str(exc))
        return EXIT_CONFIG
    except zmq.ZMQError as exc:  # an endpoint that cannot be bound (in use, not this host's address)
        return _cannot_listen(name, exc)
    except MetricsListenError as exc:
        print(f"kcoral {name}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # before the handlers were installed
        return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from kcoral.tools import add_adapter_parsers
    from kcoral.tools.adapter import add_key_arguments

    key_defaults = (os.environ.get("KCORAL_SERVER_KEY"), os.environ.get("KCORAL_CLIENT_KEY"))
    parser = _Parser(prog="kcoral", description="KCoral: a GPU evaluation service.")
    parser.add_argument("--version", action="version", version=f"kcoral {__version__}")
    _add_logging_flags(parser, top=True)
    sub: argparse._SubParsersAction[argparse.ArgumentParser]
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)  # type: ignore[assignment]

    broker = sub.add_parser(
        "broker", help="serve programs on this host's GPUs (or CPUs)", formatter_class=_HelpFormatter
    )
    broker.add_argument(
        "--listen", type=_endpoint, default=DEFAULT_BROKER_URL, help="where clients connect, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--device", choices=("gpu", "cpu"), default=None, help="serve GPUs or CPU workers (default: GPUs if any)"
    )
    broker.add_argument("--gpus", type=_gpu_list, default=None, help="GPU indices to serve, e.g. 0,1 (default: all)")
    broker.add_argument("--fake-gpus", type=_non_negative, default=0, help="lease tokens on a CPU host")
    broker.add_argument("--workers-per-gpu", type=_positive, default=1, help="worker slots per GPU")
    broker.add_argument(
        "--workers", type=_positive, default=None, help="CPU workers when there are no GPUs (default: cores, 1 to 4)"
    )
    broker.add_argument(
        "--sandbox",
        choices=("auto", "bubblewrap", "none"),
        default="bubblewrap",
        help="isolate each worker with bubblewrap (the default: the broker refuses to start where bwrap "
        "cannot run), 'none' for no isolation, or 'auto' for bubblewrap where it runs and none, with a "
        "warning, where it does not",
    )
    broker.add_argument(
        "--sandbox-readonly-path",
        action="append",
        type=_existing_path,
        default=[],
        help="a host path that workers may read, at the same path (repeatable)",
    )
    broker.add_argument(
        "--max-programs-per-worker", type=_non_negative, default=1, help="programs a worker runs; 0: reuse workers"
    )
    broker.add_argument(
        "--cache-dir",
        type=_absolute_path,
        default=None,
        help="disk blob cache (default: RUN_DIR/cache, deleted with a temporary run dir; "
        "give this or --run-dir for a cache that survives a restart)",
    )
    broker.add_argument("--cache-bytes", type=_size, default=1 << 30, help="memory blob cache")
    broker.add_argument("--cache-disk-bytes", type=_size, default=32 << 30, help="disk blob cache")
    broker.add_argument("--max-queued", type=_positive, default=1024, help="programs waiting before 'busy'")
    broker.add_argument(
        "--queue-timeout", type=_positive_seconds, default=3600.0, help="seconds a program may wait to start"
    )
    _add_max_request_bytes(broker)
    broker.add_argument(
        "--max-response-bytes",
        type=_size,
        default=protocol.DEFAULT_MAX_RESPONSE_BYTES,
        help="data returned by one program",
    )
    broker.add_argument(
        "--negotiation-timeout",
        type=_positive_seconds,
        default=None,
        help="seconds a program waits for each round of its missing blobs (default 60)",
    )
    broker.add_argument(
        "--memory-limit",
        type=_size,
        default=None,
        help="private memory per worker, all its processes together; 0: none "
        "(default: 80%% of RAM shared among the slots, at least 4 GiB)",
    )
    broker.add_argument(
        "--max-processes",
        type=_non_negative,
        default=DEFAULT_MAX_PROCESSES,
        help=f"processes per worker, itself included; 0: none (default {DEFAULT_MAX_PROCESSES})",
    )
    broker.add_argument(
        "--max-file-bytes",
        type=_size,
        default=DEFAULT_MAX_FILE_BYTES,
        help="largest file a worker may write; 0: none (default 16 GiB)",
    )
    broker.add_argument(
        "--max-open-files",
        type=_non_negative,
        default=DEFAULT_MAX_OPEN_FILES,
        help=f"open files per worker process; 0: the inherited limit (default {DEFAULT_MAX_OPEN_FILES})",
    )
    broker.add_argument(
        "--max-workspace-bytes",
        type=_size,
        default=None,
        help="disk space one program's files may take in its workspace, checked several times a second; 0: "
        "none (default: half the free space of the run directory's disk shared among the slots, at most 64 GiB)",
    )
    broker.add_argument(
        "--run-dir", type=_absolute_path, default=None, help="sockets and workspaces (default: a temp dir)"
    )
    broker.add_argument(
        "--upstream", type=_endpoint, default=None, help="a router's nodes endpoint to join, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--node-id", type=_node_id, default=None, help="this host's name at the router (default: HOSTNAME:PORT)"
    )
    broker.add_argument(
        "--upstream-server-key",
        type=_existing_path,
        default=None,
        metavar="FILE",
        help="the router's public key file: CurveZMQ on the link to --upstream",
    )
    broker.add_argument(
        "--upstream-key",
        type=_existing_path,
        default=None,
        metavar="FILE",
        help="this node's secret key file for the link (default: --curve-secret-key)",
    )
    _add_access_arguments(broker)
    broker.add_argument(
        "--max-upload-bytes",
        type=_size,
        default=None,
        help="bytes of uploads in progress, all clients together (default: twice --max-request-bytes)",
    )
    broker.add_argument(
        "--max-upload-bytes-per-client",
        type=_size,
        default=None,
        help="bytes of uploads in progress per client (default: --max-request-bytes)",
    )

    router = sub.add_parser(
        "router", help="one endpoint for the brokers of many GPU hosts", formatter_class=_HelpFormatter
    )
    router.add_argument("--listen", type=_endpoint, default=DEFAULT_ROUTER_URL, help="where clients connect")
    router.add_argument(
        "--nodes-listen", type=_endpoint, default=DEFAULT_ROUTER_NODES_URL, help="where host brokers connect"
    )
    router.add_argument("--max-queued", type=_positive, default=1024, help="programs waiting before 'busy'")
    router.add_argument("--queue-timeout", type=_positive_seconds, default=3600.0, help="seconds a program may wait")
    router.add_argument(
        "--node-wait",
        type=_positive_seconds,
        default=None,
        help="seconds programs wait for a node while none is registered, then are refused (default 10)",
    )
    _add_max_request_bytes(router)
    _add_access_arguments(router, nodes=True)

    keys = sub.add_parser("keys", help="CurveZMQ key pairs for services, clients and nodes")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    generate.add_argument("directory", type=_absolute_path, metavar="DIR")
    generate.add_argument("--name", default="kcoral", help="the files' base name (default: kcoral)")

    for service in (broker, router):
        service.add_argument(
            "--metrics-listen",
            metavar="HOST:PORT",
            type=_metrics_listen,
            default=None,
            help="serve Prometheus metrics at http://HOST:PORT/metrics (default: none)",
        )

    status = sub.add_parser(
        "status",
        help="show a broker's or router's capacity, queue, leases, workers",
        formatter_class=_HelpFormatter,
    )
    status.add_argument(
        "url", nargs="?", default=None, help=f"tcp://HOST:PORT (default: $KCORAL_URL or {DEFAULT_BROKER_URL})"
    )
    status.add_argument("--json", action="store_true", help="the full health map as JSON (one per line with --watch)")
    status.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    status.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="S", help="seconds between pages")
    status.add_argument(
        "--count", type=_positive, default=None, metavar="N", help="stop after N pages (implies --watch)"
    )
    add_key_arguments(status, key_defaults)

    # The seed's adapters: python, ncu, sanitizer, iket, remote (their flags live in kcoral/tools).
    add_adapter_parsers(sub, default_url=os.environ.get("KCORAL_URL"), default_keys=key_defaults)
    for subcommand in sub.choices.values():
        _add_logging_flags(subcommand, top=False)
    for service in (broker, router):
        _name_values(service)
    return parser


_METAVARS: dict[Any, str] = {
    _size: "SIZE",
    _endpoint: "URL",
    _positive: "N",
    _non_negative: "N",
    _positive_seconds: "S",
    _gpu_list: "LIST",
    _absolute_path: "DIR",
    _existing_path: "PATH",
    _node_id: "NAME",
}


def _name_values(parser: argparse.ArgumentParser) -> None:
    """``--cache-bytes SIZE`` in the usage rather than ``--cache-bytes CACHE_BYTES``."""
    for action in parser._actions:
        if action.metavar is None and action.type in _METAVARS:
            action.metavar = _METAVARS[action.type]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level
    if level is None:
        try:
            level = _log_level(os.environ.get("KCORAL_LOG_LEVEL", "info"))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"$KCORAL_LOG_LEVEL: {exc}")
    configure_logging(level, args.log_json)
    if args.command == "broker":
        return _broker(args)
    if args.command == "router":
        return _router(args)
    if args.command == "status":
        return _status(args)
    if args.command == "keys":
        return _keys(args)
    if getattr(args, "adapter", None) is not None:
        return int(args.adapter(args))
    return EXIT_USAGE


def _default_memory_limit(args: argparse.Namespace, cpu_workers: int) -> int:
    """DEFAULT_MEMORY_SHARE of the RAM divided among the worker slots the broker will run."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(MIN_DEFAULT_MEMORY_BYTES, int(ram * DEFAULT_MEMORY_SHARE / _slot_count(args, cpu_workers)))


def _slot_count(args: argparse.Namespace, cpu_workers: int) -> int:
    """The worker slots the broker will run."""
    if args.fake_gpus:
        slots = args.fake_gpus * args.workers_per_gpu
    elif args.gpus:
        slots = len(args.gpus) * args.workers_per_gpu
    else:
        # Counting device nodes finds the GPUs without initialising CUDA in this process.
        gpus = 0 if args.device == "cpu" else len(list(Path("/dev").glob("nvidia[0-9]*")))
        slots = gpus * args.workers_per_gpu if gpus else cpu_workers
    return max(1, slots)


def _default_workspace_bytes(run_dir: Path | None, slots: int) -> int:
    """DEFAULT_WORKSPACE_DISK_SHARE of the free disk under the run directory, divided among the slots."""
    where = run_dir or Path(tempfile.gettempdir())
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    share = int(free * DEFAULT_WORKSPACE_DISK_SHARE / max(1, slots))
    return max(MIN_DEFAULT_WORKSPACE_BYTES, min(MAX_DEFAULT_WORKSPACE_BYTES, share))


def _server_security(args: argparse.Namespace, *, nodes: bool = False) -> Any:
    """The service's ServerSecurity from its flags, or None without --curve-secret-key; KeyFileError
    when they do not fit together."""
    from kcoral.keys import KeyFileError
    from kcoral.service.auth import CLIENTS_DOMAIN, NODES_DOMAIN, ServerSecurity

    if args.curve_secret_key is None:
        if args.authorized_keys is not None or getattr(args, "authorized_node_keys", None) is not None:
            raise KeyFileError("--authorized-keys needs --curve-secret-key (the service's own key pair)")
        return None
    if args.authorized_keys is None:
        raise KeyFileError("--curve-secret-key needs --authorized-keys DIR (the clients' public keys)")
    directories = {CLIENTS_DOMAIN: args.authorized_keys}
    if nodes:
        if args.authorized_node_keys is None:
            raise KeyFileError(
                "a router with --curve-secret-key needs --authorized-node-keys DIR: the host brokers "
                "that may register (a client must not be able to pose as a node)"
            )
        directories[NODES_DOMAIN] = args.authorized_node_keys
    return ServerSecurity.from_files(args.curve_secret_key, directories)


def _upstream_keys(args: argparse.Namespace) -> Any:
    from kcoral.keys import ClientKeys, KeyFileError

    if args.upstream_server_key is None:
        if args.upstream_key is not None:
            raise KeyFileError("--upstream-key needs --upstream-server-key (the router's public key)")
        return None
    own = args.upstream_key or args.curve_secret_key
    if own is None:
        raise KeyFileError("--upstream-server-key needs this node's key pair: --upstream-key or --curve-secret-key")
    return ClientKeys.from_files(args.upstream_server_key, own)


def _access_refusal(service: str, check: Callable[[], Any]) -> tuple[Any, int | None]:
    """``check()``, or one line and EXIT_CONFIG for keys that do not fit or a listen beyond
    loopback without them."""
    from kcoral.keys import KeyFileError
    from kcoral.service.auth import ListenRefused

    try:
        return check(), None
    except (KeyFileError, ListenRefused) as exc:
        structlog.get_logger("kcoral.cli").error(f"{service}_cannot_start", error=str(exc))
        return None, EXIT_CONFIG


def _broker(args: argparse.Namespace) -> int:
    from kcoral.broker.broker import NEGOTIATION_TIMEOUT_SECONDS, Broker, BrokerSettings
    from kcoral.broker.settings import ORPHAN_GRACE_SECONDS
    from kcoral.broker.target import TargetError
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
    from kcoral.service.auth import ListenRefused, check_listen

    log = structlog.get_logger("kcoral.cli")

    def access() -> tuple[Any, Any]:
        security = _server_security(args)
        # Checked again when the broker binds; here, before a run directory exists.
        check_listen(args.listen, secured=security is not None, insecure_listen_any=args.insecure_listen_any)
        return security, _upstream_keys(args)

    keys, failed = _access_refusal("broker", access)
    if failed is not None:
        return failed
    security, upstream_keys = keys
    sandbox, sandbox_reason = args.sandbox, ""
    if sandbox == "none":
        sandbox_reason = "--sandbox none was given"
    else:
        try:
            check_bwrap()
            sandbox = "bubblewrap"
        except SandboxUnavailable as exc:
            if sandbox == "bubblewrap":  # never run programs without the walls unless told to
                log.error("broker_cannot_start", error=f"{exc} (or --sandbox auto to run without it here)")
                return EXIT_CONFIG
            sandbox, sandbox_reason = "none", f"--sandbox auto, and bubblewrap cannot run here: {exc}"
    workers = args.workers or max(1, min(4, (os.cpu_count() or 2)))
    limits = {
        "memory_bytes": args.memory_limit if args.memory_limit is not None else _default_memory_limit(args, workers),
        "processes": args.max_processes,
        "file_size_bytes": args.max_file_bytes,
        "open_files": args.max_open_files,
        "workspace_bytes": (
            args.max_workspace_bytes
            if args.max_workspace_bytes is not None
            else _default_workspace_bytes(args.run_dir, _slot_count(args, workers))
        ),
    }
    settings = BrokerSettings(
        listen=args.listen,
        device=args.device or "auto",
        gpus=args.gpus,
        fake_gpus=args.fake_gpus,
        workers_per_gpu=args.workers_per_gpu,
        workers=workers,
        sandbox=sandbox,
        sandbox_reason=sandbox_reason,
        sandbox_readonly_paths=tuple(args.sandbox_readonly_path),
        max_programs_per_worker=args.max_programs_per_worker,
        cache_dir=args.cache_dir,
        cache_bytes=args.cache_bytes,
        cache_disk_bytes=args.cache_disk_bytes,
        max_queued=args.max_queued,
        queue_timeout_seconds=args.queue_timeout,
        max_request_bytes=args.max_request_bytes,
        max_response_bytes=args.max_response_bytes,
        negotiation_timeout_seconds=args.negotiation_timeout or NEGOTIATION_TIMEOUT_SECONDS,
        run_dir=args.run_dir,
        limits={k: v for k, v in limits.items() if v},
        upstream=args.upstream,
        node_id=args.node_id,
        security=security,
        insecure_listen_any=args.insecure_listen_any,
        upstream_keys=upstream_keys,
        max_queued_per_client=args.max_queued_per_client,
        orphan_grace_seconds=args.orphan_grace or ORPHAN_GRACE_SECONDS,
        max_upload_bytes=args.max_upload_bytes,
        max_upload_bytes_per_client=args.max_upload_bytes_per_client,
        metrics_listen=args.metrics_listen,
    )
    # The CLI makes the temporary run directory, so that it goes away however the broker ends
    # (a port in use, a sandbox that cannot start).
    temporary_run_dir = None if args.run_dir else Path(tempfile.mkdtemp(prefix="kcoral-"))
    settings = dataclasses.replace(settings, run_dir=args.run_dir or temporary_run_dir)
    try:
        return run_service("broker", lambda: Broker(settings), (TargetError, SandboxUnavailable, ListenRefused))
    finally:
        if temporary_run_dir is not None:
            shutil.rmtree(temporary_run_dir, ignore_errors=True)


def _router(args: argparse.Namespace) -> int:
    from kcoral.broker.settings import ORPHAN_GRACE_SECONDS
    from kcoral.router.router import NODE_WAIT_SECONDS, Router, RouterSettings
    from kcoral.service.auth import ListenRefused

    security, failed = _access_refusal("router", lambda: _server_security(args, nodes=True))
    if failed is not None:
        return failed
    settings = RouterSettings(
        listen=args.listen,
        nodes_listen=args.nodes_listen,
        max_queued=args.max_queued,
        queue_timeout_seconds=args.queue_timeout,
        node_wait_seconds=args.node_wait or NODE_WAIT_SECONDS,
        max_request_bytes=args.max_request_bytes,
        security=security,
        insecure_listen_any=args.insecure_listen_any,
        max_queued_per_client=args.max_queued_per_client,
        orphan_grace_seconds=args.orphan_grace or ORPHAN_GRACE_SECONDS,
        metrics_listen=args.metrics_listen,
    )
    return run_service("router", lambda: Router(settings), (ListenRefused,))


def _cannot_listen(service: str, exc: Any) -> int:
    """One line for the usual start failure (a zmq.ZMQError), instead of a traceback from pyzmq."""
    import zmq

    named = re.search(r"\(addr='([^']*)'\)", str(exc))  # pyzmq >= 26 names the endpoint so
    where = f" on {named.group(1)}" if named else ""
    reason = zmq.strerror(exc.errno) if exc.errno else str(exc)
    hint = "; is another broker or router running there? (kcoral status URL)"
    print(
        f"kcoral {service}: cannot listen{where}: {reason}{hint if exc.errno == errno.EADDRINUSE else ''}",
        file=sys.stderr,
    )
    return EXIT_CONFIG


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
    from kcoral.status import show, watch
    from kcoral.tools.adapter import UsageError, keys_from_args

    url = args.url or os.environ.get("KCORAL_URL") or DEFAULT_BROKER_URL
    try:
        keys = keys_from_args(args)
    except UsageError as exc:
        print(f"kcoral status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.watch or args.count:
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


if __name__ == "__main__":
    sys.exit(main())
