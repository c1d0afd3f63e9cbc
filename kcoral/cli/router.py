"""``kcoral router``: its flags and the RouterSettings built from them."""

from __future__ import annotations

import argparse

from kcoral.cli.arguments import (
    HelpFormatter,
    add_max_request_bytes,
    add_service_arguments,
    endpoint,
    positive,
    positive_seconds,
)
from kcoral.cli.service import access_refusal, run_service, server_security, shared_settings

DEFAULT_ROUTER_URL = "tcp://127.0.0.1:6000"
DEFAULT_ROUTER_NODES_URL = "tcp://127.0.0.1:6001"


def add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kcoral router`` and its flags."""
    router = sub.add_parser(
        "router", help="one endpoint for the brokers of many GPU hosts", formatter_class=HelpFormatter
    )
    router.add_argument("--listen", type=endpoint, default=DEFAULT_ROUTER_URL, help="where clients connect")
    router.add_argument(
        "--nodes-listen", type=endpoint, default=DEFAULT_ROUTER_NODES_URL, help="where host brokers connect"
    )
    router.add_argument("--max-queued", type=positive, default=1024, help="programs waiting before 'busy'")
    router.add_argument("--queue-timeout", type=positive_seconds, default=3600.0, help="seconds a program may wait")
    router.add_argument(
        "--node-wait",
        type=positive_seconds,
        default=None,
        help="seconds programs wait for a node while none is registered, then are refused (default 10)",
    )
    add_max_request_bytes(router)
    add_service_arguments(router, nodes=True)
    router.set_defaults(run=run_router)


def run_router(args: argparse.Namespace) -> int:
    """``kcoral router``: its settings from the flags, then serve until stopped."""
    from kcoral.router.router import NODE_WAIT_SECONDS, Router, RouterSettings
    from kcoral.service.auth import ListenRefused

    security, failed = access_refusal("router", lambda: server_security(args, nodes=True))
    if failed is not None:
        return failed
    settings = RouterSettings(
        **shared_settings(args, security),
        nodes_listen=args.nodes_listen,
        node_wait_seconds=args.node_wait or NODE_WAIT_SECONDS,
    )
    return run_service("router", lambda: Router(settings), (ListenRefused,))
