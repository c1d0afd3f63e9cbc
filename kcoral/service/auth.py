"""Who may talk to a service: CurveZMQ on its sockets, a ZAP handler that checks client keys,
the loopback rule for services without keys, and the identity each message comes from.

With ``--curve-secret-key FILE`` a service's TCP sockets are CURVE servers: every connection is
encrypted, and before its first message reaches the service libzmq asks the ZAP handler
(:class:`ZapAuthenticator`, RFC 27, on ``inproc://zeromq.zap.01`` of the service's context) whether
the client's public key may connect. Keys outside the authorized set are refused during the
handshake: the peer gets no message at all (its libzmq sees ``HANDSHAKE_FAILED_AUTH``), and the
service's code never sees a byte from it. Each socket names a ZAP domain, so one handler serves a
router's two endpoints with two key sets: clients on one, host brokers (nodes) on the other.

Why our own ZAP socket and not ``zmq.auth.asyncio.AsyncioAuthenticator``: that one logs every
refusal through the standard library (a peer that reconnects every 100 ms would write ten lines a
second for ever) and holds its key set in a form its callback API hides; this one is 100 lines,
logs each refused peer once per interval, and its decision is a pure function that the tests call.

Identity: a message from a CURVE client carries its ZAP user id, the client's public key in Z85
(``zmq.Frame.get("User-Id")``); that key is the client's identity for fair share, so one client
cannot get more than its share by opening more connections. Without CURVE (and over inproc), the
identity is the connection's routing id.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils import z85

from kcoral import keys

log = structlog.get_logger("kcoral.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq connects here
ZAP_VERSION = b"1.0"
ZAP_ALLOWED = b"200"
ZAP_DENIED = b"400"
CLIENTS_DOMAIN = "clients"
NODES_DOMAIN = "nodes"
CURVE_KEY_BYTES = 32
# A refused peer (address and key) is logged once per this many seconds; at most this many peers
# are remembered, and at most this many refusal lines are written per interval in all, so that a
# flood of connection attempts from many addresses cannot flood the log either.
REFUSAL_LOG_INTERVAL_SECONDS = 60.0
REFUSAL_MEMORY = 4096
REFUSAL_LINES_PER_INTERVAL = 100
# libzmq answers pings on its own I/O thread, so a busy client is not taken for gone; 3 missed
# intervals, as for the protocol's own heartbeats.
PEER_PING_INTERVAL_MS = 1000
PEER_TIMEOUT_MS = 3000
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class ListenRefused(ValueError):
    """Raised when a service without keys is asked to listen beyond loopback without
    ``--insecure-listen-any``."""


@dataclass(frozen=True)
class ServerSecurity:
    """A service's CURVE settings: its own key pair, and the public keys allowed per ZAP domain.

    ``None`` in a service's settings means no CURVE: the service then listens on loopback (and
    ipc) only, unless ``insecure_listen_any`` is set.
    """

    keypair: keys.KeyPair
    authorized: Mapping[str, frozenset[bytes]]

    @classmethod
    def from_files(cls, secret_key_file: Path, authorized: Mapping[str, Path]) -> ServerSecurity:
        """Read the service's ``NAME.key_secret`` and one directory of ``*.key`` files per domain."""
        return cls(
            keys.load_keypair(secret_key_file),
            {domain: keys.load_authorized_keys(directory) for domain, directory in authorized.items()},
        )

    def socket_options(self, domain: str) -> dict[int, int | bytes]:
        """What makes a socket a CURVE server whose clients are checked against ``domain``'s keys
        (set before it binds). inproc connections skip the handshake: only this process reaches
        them. ZAP_ENFORCE_DOMAIN: without a ZAP handler libzmq would let every key in."""
        if domain not in self.authorized:
            raise ValueError(f"no authorized keys for the ZAP domain {domain!r}")
        return {
            zmq.CURVE_SERVER: 1,
            zmq.CURVE_SECRETKEY: self.keypair.secret,
            zmq.CURVE_PUBLICKEY: self.keypair.public,
            zmq.ZAP_DOMAIN: domain.encode(),
            zmq.ZAP_ENFORCE_DOMAIN: 1,
        }

    def apply(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Set :meth:`socket_options` on ``sock`` (before it binds)."""
        for option, value in self.socket_options(domain).items():
            sock.set(option, value)


def check_listen(endpoint: str, *, secured: bool, insecure_listen_any: bool, flag: str = "--listen") -> None:
    """Refuse (ListenRefused) a TCP endpoint beyond loopback for a service without CURVE keys,
    unless the operator said ``--insecure-listen-any``: anyone who reaches such a port could run
    code on the GPUs, or register as a node and be sent other people's programs."""
    if secured or insecure_listen_any or not endpoint.startswith("tcp://"):
        return
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    host = host.split(";")[-1]  # tcp://source;dest: the bound address is the last part
    if host.lower() in LOOPBACK_NAMES:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass  # "*", an interface name or a host name: not known to be loopback
    raise ListenRefused(
        f"{flag} {endpoint} is reachable beyond this machine, and the service has no keys: "
        "give --curve-secret-key and --authorized-keys, or --insecure-listen-any to accept anyone"
    )


def client_socket_options(security: ServerSecurity | None, domain: str) -> dict[int, int | bytes]:
    """Options of a service's client socket: CURVE (with ``security``) and libzmq's pings of each
    peer (ZMTP heartbeats), which drop a connection that stays silent, so that a client whose host
    vanished without closing TCP shows up as gone (a send to it fails with EHOSTUNREACH) within
    PEER_TIMEOUT_MS, like one that disconnected."""
    options: dict[int, int | bytes] = {zmq.HEARTBEAT_IVL: PEER_PING_INTERVAL_MS, zmq.HEARTBEAT_TIMEOUT: PEER_TIMEOUT_MS}
    if security is not None:
        options.update(security.socket_options(domain))
    return options


def peer_identity(frame: zmq.Frame, routing_id: bytes) -> bytes:
    """Who sent the message of which ``frame`` is a part: ``b"key:" + the client's Z85 public
    key`` for a CURVE peer, else ``routing_id`` (the connection)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no metadata: a NULL-security or inproc connection
        return routing_id
    return b"key:" + str(user).encode() if user else routing_id


@dataclass(frozen=True)
class ZapDecision:
    allowed: bool
    user_id: bytes
    reason: str


def decide(request: list[bytes], authorized: Mapping[str, frozenset[bytes]]) -> ZapDecision:
    """The verdict on one ZAP request (frames after the REP envelope: version, request id, domain,
    address, routing id, mechanism, credentials...)."""
    if len(request) < 6 or request[0] != ZAP_VERSION:
        return ZapDecision(False, b"", "not a ZAP 1.0 request")
    domain, mechanism = request[2].decode(errors="replace"), request[5]
    allowed = authorized.get(domain)
    if allowed is None:
        return ZapDecision(False, b"", f"unknown ZAP domain {domain!r}")
    if mechanism != b"CURVE" or len(request) != 7 or len(request[6]) != CURVE_KEY_BYTES:
        return ZapDecision(False, b"", f"mechanism {mechanism.decode(errors='replace')} is not allowed")
    key = z85.encode(request[6])
    if key not in allowed:
        return ZapDecision(False, key, "key not authorized")
    return ZapDecision(True, key, "OK")


class RefusalLog:
    """Logs each refused peer once per interval, and at most so many lines per interval in all."""

    def __init__(
        self,
        *,
        interval_seconds: float = REFUSAL_LOG_INTERVAL_SECONDS,
        memory: int = REFUSAL_MEMORY,
        lines_per_interval: int = REFUSAL_LINES_PER_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval_seconds
        self.memory = memory
        self.lines_per_interval = lines_per_interval
        self.clock = clock
        self._last: OrderedDict[tuple[str, str, bytes], float] = OrderedDict()
        self._window_start = -float("inf")
        self._lines = 0
        self.suppressed = 0  # refusals not logged since the last line

    def should_log(self, domain: str, address: str, key: bytes) -> bool:
        now = self.clock()
        peer = (domain, address, key)
        last = self._last.get(peer)
        if last is not None and now - last < self.interval:
            self.suppressed += 1
            return False
        if now - self._window_start >= self.interval:
            self._window_start, self._lines = now, 0
        if self._lines >= self.lines_per_interval:
            self.suppressed += 1
            return False
        self._lines += 1
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > self.memory:
            self._last.popitem(last=False)
        return True


class ZapAuthenticator:
    """Answers libzmq's ZAP requests for the sockets of one context, on the service's loop."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        authorized: Mapping[str, frozenset[bytes]],
        refusals: RefusalLog | None = None,
    ) -> None:
        self.context = context
        self.authorized = dict(authorized)
        self.refusals = refusals or RefusalLog()
        self.allowed = 0
        self.refused = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind the ZAP endpoint and answer on the running loop; call before any CURVE socket of
        the context binds or connects."""
        sock = self.context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._socket = sock
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            request = await self._socket.recv_multipart()
            try:
                reply = self.answer(request)
            except Exception:  # a bug here must not stop every later handshake
                log.exception("zap_request_failed")
                reply = [ZAP_VERSION, request[1] if len(request) > 1 else b"", ZAP_DENIED, b"internal error", b"", b""]
            await self._socket.send_multipart(reply)

    def answer(self, request: list[bytes]) -> list[bytes]:
        decision = decide(request, self.authorized)
        request_id = request[1] if len(request) > 1 else b""
        if decision.allowed:
            self.allowed += 1
            return [ZAP_VERSION, request_id, ZAP_ALLOWED, b"OK", decision.user_id, b""]
        self.refused += 1
        domain = request[2].decode(errors="replace") if len(request) > 2 else ""
        address = request[3].decode(errors="replace") if len(request) > 3 else ""
        if self.refusals.should_log(domain, address, decision.user_id):
            log.warning(
                "peer_refused",
                domain=domain,
                address=address,
                key=decision.user_id.decode() or None,
                reason=decision.reason,
                suppressed_since_last=self.refusals.suppressed,
            )
            self.refusals.suppressed = 0
        return [ZAP_VERSION, request_id, ZAP_DENIED, decision.reason.encode(), b"", b""]


__all__ = [
    "CLIENTS_DOMAIN",
    "NODES_DOMAIN",
    "ListenRefused",
    "RefusalLog",
    "ServerSecurity",
    "ZapAuthenticator",
    "check_listen",
    "client_socket_options",
    "decide",
    "peer_identity",
]
