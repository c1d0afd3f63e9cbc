"""What a service says of itself in HEALTH, the same for the broker and the router: the versions
of what it runs."""

from __future__ import annotations

import platform
from importlib import metadata

import zmq

from kcoral import protocol


def versions() -> dict[str, str]:
    """Versions of what runs here: Python, the protocol, kcoral and the libraries it is built on."""
    found = {"python": platform.python_version(), "protocol": protocol.VERSION.decode()}
    for package in ("kcoral", "pyzmq", "msgpack", "torch", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    found["libzmq"] = zmq.zmq_version()
    return found


__all__ = ["versions"]
