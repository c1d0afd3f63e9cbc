"""The service shell: the client side that the host broker and the router share.

A service holds one :class:`ServiceShell` (composition: the shell knows nothing of workers, nodes or
blobs) and fills its dispatch table, one handler per command. The shell owns:

- the zmq context and the client ROUTER socket: options, bind, close;
- the receive loop: each message is read (``split_message``), checked (a readable ``request_id``),
  passed through the message hooks, then to its command's handler; an unreadable message that still
  names a request id is answered ``parse`` (docs/protocol.md, section 9), and a handler that raises
  answers its request ``engine`` instead of leaving the client waiting;
- local clients: a client in the service's own process (a broker's router relay,
  kcoral/broker/upstream.py) hands its messages to :meth:`receive_local`, which takes them the way
  the loop takes a socket's, and is handed what the service sends to its identity: no socket
  between them, so no send, wake-up of the loop and receive per message each way;
- one set of replies: :meth:`reply`, :meth:`reply_ok`, :meth:`refuse`, :meth:`heartbeat_clients`;
- the requests in flight (:class:`InFlightTable`), whose emptiness ends a drain;
- the service's tasks (:class:`~kcoral.service.tasks.TaskSet`), cancelled together;
- the lifecycle, as one runner owns it in aiohttp's ``web_runner``. A service's ``serve`` is
  ``await shell.serve(start, release)``, which runs these steps::

      bind()                  # socket options, then bind: a bad endpoint raises zmq.ZMQError
      await start()           # the service's own sockets and loops (spawned as the shell's tasks)
      await run()             # the client loop, until stop(); drain() finishes what is in flight first
      await close()           # always: answer what is still in flight, cancel the tasks,
      await release()         # let the service close its own sockets and processes,
      terminate()             # and end the context

``serve`` touches no signals: the entry point (``kcoral/cli/service.py``) maps SIGTERM and SIGINT to
:meth:`drain` and a second SIGINT to :meth:`stop`, as arq leaves them to its runner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

import structlog
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.service import auth
from kcoral.service.auth import peer_identity
from kcoral.service.connections import ConnectionCap
from kcoral.service.fairness import RateLimit
from kcoral.service.metrics import MetricsServer, ServiceMetrics
from kcoral.service.sockets import receive_forever, router_socket, send_now
from kcoral.service.tasks import TaskSet

log = structlog.get_logger("kcoral.service")

# A drain waits this long for the programs in flight: the longest a program may run, and a margin.
SHUTDOWN_DRAIN_SECONDS = protocol.MAX_TIMEOUT_SECONDS + 60
# Refusals are logged at most this often (per kind; bursts of REFUSAL_LOG_BURST): a flood of
# refused requests (HEALTH over its rate, EXECUTE over a client's share) would otherwise cost the
# loop a log line each. Those not logged are counted in the next line that is.
# HEALTH and TARGET per client: plenty for a status page or a load balancer (a poll every 100 ms
# is 10/s), while a flood of them is answered `busy` at a fraction of the cost.
STATUS_REQUESTS_PER_SECOND = 20.0
STATUS_REQUESTS_BURST = 50.0
STATUS_BUSY_MESSAGE = f"more than {STATUS_REQUESTS_PER_SECOND:g} HEALTH or TARGET requests a second from this client"
REFUSAL_LOGS_PER_SECOND = 10.0
REFUSAL_LOG_BURST = 50.0


@dataclass(frozen=True)
class ClientMessage:
    """One readable message from a client."""

    client: bytes  # the client's routing identity
    command: bytes
    request_id: str
    body: dict[str, Any]
    frames: list[zmq.Frame]  # the message as received, without the identity: what a router forwards
    data: list[memoryview]  # the frames after the body: blobs
    # Who sent it, for fair share: the client's CURVE key (all its connections), else ``client``.
    owner: bytes = b""

    @property
    def data_bytes(self) -> int:
        return sum(len(frame) for frame in self.data)


Handler = Callable[[ClientMessage], None]
# A local client takes a message the service sends it (the frames after the identity); it returns
# False once it is gone, as a send to a closed connection fails.
LocalClient = Callable[[list[Any]], bool]
# A hook sees every readable message before its handler; it returns (kind, message) to refuse it.
MessageHook = Callable[[ClientMessage], "tuple[str, str] | None"]


class InFlight(Protocol):
    """A request the service has taken and not yet answered with a FINAL."""

    @property
    def id(self) -> str: ...

    @property
    def client(self) -> bytes: ...


RequestT = TypeVar("RequestT", bound=InFlight)


class InFlightTable(Generic[RequestT]):
    """The requests in flight by id; ``empty`` is set whenever there are none (a drain waits on it)."""

    def __init__(self) -> None:
        self._by_id: dict[str, RequestT] = {}
        self.empty = asyncio.Event()
        self.empty.set()

    def add(self, request: RequestT) -> None:
        self._by_id[request.id] = request
        self.empty.clear()

    def pop(self, request_id: str) -> RequestT | None:
        request = self._by_id.pop(request_id, None)
        if not self._by_id:
            self.empty.set()
        return request

    def get(self, request_id: str) -> RequestT | None:
        return self._by_id.get(request_id)

    def of(self, client: bytes, request_id: str) -> RequestT | None:
        """The request with this id, if it is this client's."""
        request = self._by_id.get(request_id)
        return request if request is not None and request.client == client else None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RequestT]:
        return iter(list(self._by_id.values()))

    def clients(self) -> set[bytes]:
        return {request.client for request in self._by_id.values()}


class ServiceSettings(Protocol):
    """What a service's settings (BrokerSettings, RouterSettings) tell its shell."""

    @property
    def listen(self) -> str: ...

    @property
    def max_request_bytes(self) -> int: ...

    @property
    def max_frame_bytes(self) -> int: ...

    @property
    def security(self) -> auth.ServerSecurity | None: ...

    @property
    def insecure_listen_any(self) -> bool: ...

    @property
    def metrics_listen(self) -> str | None: ...

    @property
    def max_connections_per_address(self) -> int: ...


# What ShellSettings.of takes from a service's settings: the properties of ServiceSettings.
SERVICE_SETTINGS: Final = (
    "listen",
    "max_frame_bytes",
    "security",
    "insecure_listen_any",
    "metrics_listen",
    "max_connections_per_address",
)


@dataclass(frozen=True)
class ShellSettings:
    """Where and how the client socket listens."""

    listen: str
    # libzmq disconnects a peer that sends a larger frame (docs/protocol.md, section 1).
    max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES
    # CURVE keys and the authorized clients (kcoral/service/auth.py); None: no CURVE, and then a
    # TCP endpoint beyond loopback is refused unless insecure_listen_any.
    security: auth.ServerSecurity | None = None
    insecure_listen_any: bool = False
    # More options for the client socket, set before it binds.
    socket_options: Mapping[int, int | bytes] = field(default_factory=dict)
    drain_seconds: float = SHUTDOWN_DRAIN_SECONDS
    # HOST:PORT of the Prometheus endpoint (kcoral/service/metrics.py), or None for none.
    metrics_listen: str | None = None
    # TCP connections one peer address may hold (kcoral/service/connections.py); 0: no cap.
    max_connections_per_address: int = 0

    @classmethod
    def of(cls, service: ServiceSettings) -> ShellSettings:
        """The shell's part of a broker's or a router's settings: the fields of ``ServiceSettings``."""
        return cls(**{name: getattr(service, name) for name in SERVICE_SETTINGS})


class ServiceShell(Generic[RequestT]):
    """The client socket, receive loop, replies, requests in flight, tasks and lifecycle of one
    service; ``fail_request`` is how the service ends one of its requests with an error."""

    def __init__(
        self,
        name: str,
        settings: ShellSettings,
        *,
        fail_request: Callable[[RequestT, str, str], None],
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.name = name  # "broker" or "router": in log events and messages
        self.settings = settings
        self.context = zmq.asyncio.Context()
        self.clients = router_socket(self.context)
        self.handlers: dict[bytes, Handler] = {}
        self.hooks: list[MessageHook] = []
        self.requests: InFlightTable[RequestT] = InFlightTable()
        self.tasks = TaskSet()
        self.draining = False
        self.refused = 0
        self._refusal_log: RateLimit[str] = RateLimit(REFUSAL_LOGS_PER_SECOND, REFUSAL_LOG_BURST)
        self._refusals_not_logged = 0
        self.status_limit: RateLimit[bytes] = RateLimit(STATUS_REQUESTS_PER_SECOND, STATUS_REQUESTS_BURST)
        self._fail_request = fail_request
        self._stopped = asyncio.Event()
        self.exit_code = 0  # what serve returns: see stop
        # One ZAP handler for every CURVE socket of the context: the clients', and a router's nodes'.
        security = settings.security
        self.zap = auth.ZapAuthenticator(self.context, security.authorized) if security is not None else None
        self.metrics = metrics
        self._metrics_server: MetricsServer | None = None
        self._dispatching: bytes | None = None  # the command whose handler runs now
        self.connections = ConnectionCap(settings.max_connections_per_address)
        self._monitor: zmq.asyncio.Socket | None = None
        self._local_clients: dict[bytes, LocalClient] = {}  # by identity: see attach_local_client

    # --- lifecycle ---

    async def serve(
        self,
        start: Callable[[], Awaitable[None]],
        release: Callable[[], Awaitable[None]],
        counters: Callable[[], dict[str, Any]] = dict,
    ) -> int:
        """Bind, ``start`` the service, serve clients until stopped, then close everything (also
        when a step fails): the steps in the module docstring. Returns the exit code; a service
        that served logs ``<name>_stopped`` with its ``counters()`` last."""
        served = False
        try:
            auth.check_listen(
                self.settings.listen,
                secured=self.settings.security is not None,
                insecure_listen_any=self.settings.insecure_listen_any,
            )
            if self.zap is not None:
                self.zap.start()  # before any socket binds: no handshake goes unchecked
            self.bind()
            if self.metrics is not None and self.settings.metrics_listen:
                self._metrics_server = MetricsServer(self.metrics, self.settings.metrics_listen)
                await self._metrics_server.start()
            await start()
            served = True
            await self.run()
        finally:
            await self.close()
            try:
                await release()
            finally:
                if self.zap is not None:
                    await self.zap.close()
                self.terminate()
        if served:
            log.info(f"{self.name}_stopped", **counters())
        return self.exit_code

    def bind(self, *more_endpoints: str) -> None:
        """Set the socket's options and bind it to ``settings.listen`` (and ``more_endpoints``)."""
        self.clients.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes)
        options = {
            **auth.client_socket_options(self.settings.security, auth.CLIENTS_DOMAIN),
            **self.settings.socket_options,
        }
        for option, value in options.items():
            self.clients.set(option, value)
        if self._monitor is None:
            self._monitor = self.connections.watch(self.clients)  # before a connection is accepted
            if self._monitor is not None:
                self.spawn(self.connections.run(self._monitor), name="connections")
        for endpoint in (self.settings.listen, *more_endpoints):
            self.clients.bind(endpoint)
            self.connections.bound(str(self.clients.get_string(zmq.LAST_ENDPOINT)))

    def spawn(self, coroutine: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coroutine`` as one of the service's tasks (cancelled by :meth:`close`)."""
        return self.tasks.spawn(coroutine, name=name)

    async def run(self) -> None:
        """Serve clients until :meth:`stop` (which a finished :meth:`drain` calls)."""
        self.spawn(receive_forever(self.clients, self._on_message, "client_message_failed"), name="clients")
        await self._stopped.wait()

    def drain(self) -> None:
        """Take no more programs; stop once those in flight are answered (or the drain time is up)."""
        if self.draining:
            return
        self.draining = True
        log.info(f"{self.name}_draining", in_flight=len(self.requests))
        self.spawn(self._stop_when_drained(), name="drain")

    async def _stop_when_drained(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.requests.empty.wait(), self.settings.drain_seconds)
        self.stop()

    def stop(self, exit_code: int = 0) -> None:
        """Stop now: :meth:`run` returns, and :meth:`close` answers what is still in flight;
        :meth:`serve` returns ``exit_code`` (the first nonzero one given)."""
        self.exit_code = self.exit_code or exit_code
        self._stopped.set()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    async def close(self) -> None:
        """Answer every request still in flight (``engine``), then cancel the service's tasks."""
        for request in self.requests:
            self.requests.pop(request.id)
            message = f"the {self.name} stopped before the program finished"
            self.send(request.client, protocol.final_error(request.id, "engine", message), request.id)
        await self.tasks.cancel_all()
        if self._metrics_server is not None:
            await self._metrics_server.close()

    def terminate(self) -> None:
        """Close the client socket, any socket the service left open (with its own linger), and
        the context."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.clients.disable_monitor()
            self._monitor.close(linger=0)
        self.clients.close(linger=0)
        self.context.destroy()

    # --- the receive loop ---

    def attach_local_client(self, identity: bytes, client: LocalClient) -> None:
        """Hand what the service sends to ``identity`` to ``client``, in this process; ``identity``
        is then what the client's messages to :meth:`receive_local` come from."""
        self._local_clients[identity] = client

    def receive_local(self, identity: bytes, message: list[zmq.Frame]) -> None:
        """Take a message (the frames after the identity) from the local client ``identity`` as
        the receive loop takes one from the socket; it is its own owner (no CURVE key)."""
        self._on_client_message(identity, message, identity)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        self._on_client_message(bytes(frames[0].buffer), frames[1:], None)

    def _on_client_message(self, client: bytes, message: list[zmq.Frame], owner: bytes | None) -> None:
        try:
            command, body, data = protocol.split_message([f.buffer for f in message])
        except protocol.WireError as exc:
            log.warning("bad_client_message", error=str(exc), frames=len(message))
            self._answer_unreadable(client, message, exc)
            return
        try:
            request_id = protocol.check_id(body.get("request_id"), "request_id")
        except protocol.WireError as exc:
            log.warning("bad_client_message", error=str(exc), command=command.hex())
            return
        if owner is None:
            # Only CURVE gives a message its sender's key; without, asking costs an exception.
            owner = peer_identity(message[-1], client) if self.settings.security is not None else client
        self.dispatch(ClientMessage(client, command, request_id, body, message, data, owner))

    def dispatch(self, message: ClientMessage) -> None:
        """Pass ``message`` through the hooks to its handler; a handler that raises answers ``engine``."""
        self._dispatching = message.command
        try:
            for hook in self.hooks:
                refusal = hook(message)
                if refusal is not None:
                    self.refuse(message.client, message.request_id, *refusal)
                    return
            handler = self.handlers.get(message.command)
            if handler is None:
                self.refuse(message.client, message.request_id, "parse", f"unknown command {message.command.hex()}")
                return
            handler(message)
        except Exception as exc:
            self.fail_internal(message, exc)
        finally:
            self._dispatching = None

    def fail_internal(self, message: ClientMessage, exc: Exception) -> None:
        """A bug must not leave a request in limbo with its client waiting: answer it."""
        log.exception("client_command_failed", request_id=message.request_id, command=message.command.hex())
        text = f"internal error in the {self.name}: {exc!r}"
        request = self.requests.of(message.client, message.request_id)
        if request is not None:
            self._fail_request(request, "engine", text)
        else:
            self.refuse(message.client, message.request_id, "engine", text)

    def _answer_unreadable(self, client: bytes, message: list[zmq.Frame], exc: protocol.WireError) -> None:
        """Answer a message that cannot be read, where its request id can still be found, so its
        sender is told why instead of waiting."""
        if len(message) < 3 or bytes(message[0].buffer) != protocol.VERSION:
            return
        try:
            request_id = protocol.peek_request_id(message[2].buffer)
        except protocol.WireError:
            return
        if request_id not in self.requests:
            self.refuse(client, request_id, "parse", f"unreadable message: {exc}")

    def answer(self, result: Callable[[], dict[str, Any]]) -> Handler:
        """A handler that answers every request with ``result()`` (HEALTH, TARGET), at most
        STATUS_REQUESTS_PER_SECOND per client (``busy`` beyond)."""

        def handler(message: ClientMessage) -> None:
            if not self.status_limit.allow(message.owner or message.client):
                self.refuse(message.client, message.request_id, "busy", STATUS_BUSY_MESSAGE)
            else:
                self.reply_ok(message.client, message.request_id, result())

        return handler

    # --- replies ---

    def send(self, client: bytes, message: list[Any], request_id: str | None = None) -> bool:
        """Send ``message`` to ``client`` now; False when the client is gone (its connection
        closed: ROUTER_MANDATORY), True when sent or only dropped because the client does not
        read (its queue is full)."""
        local = self._local_clients.get(client)
        if local is not None:
            return local(message)
        try:
            send_now(self.clients, [client, *message])
        except zmq.ZMQError as exc:
            log.info("client_unreachable", request_id=request_id, error=str(exc))
            return exc.errno != zmq.EHOSTUNREACH
        return True

    def reply(self, client: bytes, command: bytes, body: dict[str, Any], *data: Any) -> bool:
        return self.send(client, protocol.message(command, body, *data), body.get("request_id"))

    def reply_ok(self, client: bytes, request_id: str, result: dict[str, Any]) -> None:
        self.reply(client, protocol.FINAL, protocol.final_body(request_id, result))

    def refuse(self, client: bytes, request_id: str, kind: str, message: str) -> None:
        """Answer a request that was not taken with FINAL ``kind``."""
        self.refused += 1
        if self.metrics is not None and self._dispatching == protocol.EXECUTE:
            self.metrics.program_refused(kind)
        if self._refusal_log.allow(kind):
            log.info(
                "request_refused",
                request_id=request_id,
                kind=kind,
                reason=message,
                not_logged=self._refusals_not_logged,
            )
            self._refusals_not_logged = 0
        else:
            self._refusals_not_logged += 1
        self.send(client, protocol.final_error(request_id, kind, message), request_id)

    def heartbeat_clients(self) -> list[bytes]:
        """A HEARTBEAT to every client with a request in flight, so it knows the service lives;
        the clients found gone (their requests are orphans: see kcoral.service.fairness)."""
        beat = protocol.message(protocol.HEARTBEAT, {})
        return [client for client in self.requests.clients() if not self.send(client, beat)]


__all__ = [
    "SHUTDOWN_DRAIN_SECONDS",
    "ClientMessage",
    "InFlight",
    "InFlightTable",
    "LocalClient",
    "MessageHook",
    "ServiceShell",
    "ShellSettings",
]
