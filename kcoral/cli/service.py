"""What ``kcoral broker`` and ``kcoral router`` share on the command line: running a service under
the entry point's signals, the one-line start failures, the service's keys from its flags, and the
settings that both take from the same flags."""

from __future__ import annotations

import argparse
import asyncio
import errno
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, TypedDict, cast

import structlog

from kcoral.cli.arguments import EXIT_CONFIG, EXIT_OK

if TYPE_CHECKING:
    from kcoral.service.auth import ServerSecurity
    from kcoral.service.shell import ServiceShell


class Service(Protocol):
    """A broker or a router, as the entry point runs it: it serves, and its shell drains or stops."""

    shell: ServiceShell[Any]

    async def serve(self) -> int: ...


class SharedSettings(TypedDict):
    """The fields of BrokerSettings and RouterSettings that come from the same flags."""

    listen: str
    max_queued: int
    queue_timeout_seconds: float
    max_request_bytes: int
    max_upload_bytes: int | None
    max_upload_bytes_per_client: int | None
    max_frame_bytes: int
    security: ServerSecurity | None
    insecure_listen_any: bool
    max_queued_per_client: int | None
    orphan_grace_seconds: float
    metrics_listen: str | None
    max_connections_per_address: int


# The flag a shared field is read from, where the flag's name is not the field's.
FLAG_OF_FIELD: Final = {"queue_timeout_seconds": "queue_timeout", "orphan_grace_seconds": "orphan_grace"}


def shared_settings(args: argparse.Namespace, security: ServerSecurity | None) -> SharedSettings:
    """The settings both services take from the flags they share (kcoral.cli.arguments)."""
    from kcoral.service.fairness import ORPHAN_GRACE_SECONDS

    values: dict[str, Any] = {"security": security, "orphan_grace_seconds": args.orphan_grace or ORPHAN_GRACE_SECONDS}
    for name in SharedSettings.__annotations__.keys() - values.keys():
        values[name] = getattr(args, FLAG_OF_FIELD.get(name, name))
    return cast(SharedSettings, values)


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

    from kcoral.service.metrics import MetricsListenError

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


def server_security(args: argparse.Namespace, *, nodes: bool = False) -> ServerSecurity | None:
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


def access_refusal(service: str, check: Callable[[], Any]) -> tuple[Any, int | None]:
    """``check()``, or one line and EXIT_CONFIG for keys that do not fit or a listen beyond
    loopback without them."""
    from kcoral.keys import KeyFileError
    from kcoral.service.auth import ListenRefused

    try:
        return check(), None
    except (KeyFileError, ListenRefused) as exc:
        structlog.get_logger("kcoral.cli").error(f"{service}_cannot_start", error=str(exc))
        return None, EXIT_CONFIG
