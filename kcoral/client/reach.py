"""Why a service did not answer: a name that does not resolve, a refused port, or a silent peer.

ZeroMQ connects in the background and retries for ever, so a DEALER never says why nothing came
back. When a client gives up, these checks turn the silence into a message a user can act on.
"""

from __future__ import annotations

import asyncio
import os
import socket
from urllib.parse import urlsplit

# How long the closing TCP probe may take: a refused port answers at once, a filtered one never.
PROBE_TIMEOUT_SECONDS = 1.0


class Unresolvable(Exception):
    """Raised when the host name of a tcp:// URL does not resolve."""


def tcp_host_port(url: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// URL, or None for other schemes or a URL without a port."""
    if not url.startswith("tcp://"):
        return None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None or port is None:
        return None
    return parts.hostname, port


async def check_resolves(url: str) -> None:
    """Raise Unresolvable when the URL's host name has no address: no wait can fix that."""
    endpoint = tcp_host_port(url)
    if endpoint is None or endpoint[0] == "*":
        return
    host, port = endpoint
    try:
        await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolvable(f"cannot resolve the host name {host!r} of {url}: {_reason(exc)}") from exc


async def silence_reason(url: str, waited_seconds: float) -> str:
    """A one-line explanation of why ``url`` gave no answer within ``waited_seconds``."""
    return f"no answer from {url} within {waited_seconds:g} s: {await _why_silent(url)}"


async def _why_silent(url: str) -> str:
    if url.startswith("ipc://"):
        path = url.removeprefix("ipc://")
        if not os.path.exists(path):
            return f"there is no socket file {path}; is the broker running?"
        return "the socket file exists but no KCoral service answered on it"
    endpoint = tcp_host_port(url)
    if endpoint is None:
        return "nothing answered"
    host, port = endpoint
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_SECONDS)
    except ConnectionRefusedError:
        return f"connection refused (nothing listens at {host}:{port}); is the service running?"
    except (OSError, TimeoutError) as exc:
        return f"cannot connect to {host}:{port}: {_reason(exc)}"
    writer.close()
    return f"{host}:{port} accepts connections but no KCoral service answered (not one, or overloaded)"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
