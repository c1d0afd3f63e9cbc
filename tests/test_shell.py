"""The service shell in-process, on real zmq sockets over loopback: dispatch, refusals, unreadable
messages, a handler that raises, a drain that ends on an event, and sends that fail at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from kcoral import protocol
from kcoral.service.shell import ClientMessage, ServiceShell, ShellSettings
from kcoral.service.sockets import receive_forever, router_socket, send_now
from kcoral.service.tasks import TaskSet, cancel_and_wait
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(60)


@dataclass(eq=False)
class Job:
    id: str
    client: bytes


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


class Harness:
    """A shell that takes JOB-like EXECUTEs (kept in flight until finished) and one DEALER client."""

    def __init__(self) -> None:
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.failed: list[tuple[str, str]] = []
        self.shell: ServiceShell[Job] = ServiceShell("broker", ShellSettings(listen=self.url), fail_request=self.fail)
        self.shell.handlers[protocol.EXECUTE] = self.on_execute
        self.shell.handlers[protocol.HEALTH] = self.shell.answer(lambda: {"status": "ok"})
        self.shell.handlers[protocol.CANCEL] = self.explode
        self.client = self.shell.context.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)

    def on_execute(self, message: ClientMessage) -> None:
        self.shell.requests.add(Job(message.request_id, message.client))

    def explode(self, message: ClientMessage) -> None:
        raise RuntimeError("a bug")

    def fail(self, job: Job, kind: str, text: str) -> None:
        self.failed.append((kind, text))
        self.finish(job.id)

    def finish(self, request_id: str) -> None:
        job = self.shell.requests.pop(request_id)
        assert job is not None
        self.shell.reply_ok(job.client, job.id, {"done": True})

    async def start(self) -> asyncio.Task[None]:
        self.shell.bind()
        self.client.connect(self.url)
        return asyncio.get_running_loop().create_task(self.shell.run())

    async def ask(self, command: bytes, body: dict[str, Any]) -> dict[str, Any]:
        await self.client.send_multipart(protocol.message(command, body))
        return await self.reply()

    async def reply(self) -> dict[str, Any]:
        frames = await asyncio.wait_for(self.client.recv_multipart(), 5)
        command, body, _ = protocol.split_message(frames)
        assert command == protocol.FINAL
        return body

    async def close(self, running: asyncio.Task[None]) -> None:
        self.shell.stop()
        await running
        await self.shell.close()
        self.client.close(linger=0)
        self.shell.terminate()


def test_dispatch_refusals_unreadable_messages_and_a_handler_that_raises() -> None:
    async def main() -> None:
        h = Harness()
        running = await h.start()
        assert (await h.ask(protocol.HEALTH, {"request_id": "h1"}))["result"] == {"status": "ok"}
        unknown = await h.ask(b"\x7f", {"request_id": "u1"})
        assert unknown["error"]["kind"] == "parse" and "unknown command" in unknown["error"]["message"]
        # Unreadable (an unknown extension), but its request id can be read: answered parse.
        await h.client.send_multipart(
            [protocol.VERSION, protocol.HEALTH, msgpack.packb({"request_id": "x1", "e": msgpack.ExtType(42, b"")})]
        )
        unreadable = await h.reply()
        assert unreadable["request_id"] == "x1" and unreadable["error"]["kind"] == "parse"
        # A handler that raises answers engine, and the loop goes on.
        broken = await h.ask(protocol.CANCEL, {"request_id": "c1"})
        assert broken["error"]["kind"] == "engine" and "internal error in the broker" in broken["error"]["message"]
        # ... and fails the request in flight with that id, when it is this client's.
        await h.client.send_multipart(protocol.message(protocol.EXECUTE, {"request_id": "j1"}))
        await asyncio.sleep(0.05)
        assert "j1" in h.shell.requests
        assert (await h.ask(protocol.CANCEL, {"request_id": "j1"}))["result"] == {"done": True}
        assert h.failed and h.failed[0][0] == "engine"
        assert h.shell.refused == 3
        await h.close(running)

    run(main)


def test_a_hook_refuses_before_the_handler() -> None:
    async def main() -> None:
        h = Harness()
        h.shell.hooks.append(lambda m: ("busy", "too many") if m.command == protocol.HEALTH else None)
        running = await h.start()
        answer = await h.ask(protocol.HEALTH, {"request_id": "h1"})
        assert answer["error"] == {"kind": "busy", "message": "too many"}
        await h.close(running)

    run(main)


def test_a_drain_ends_when_the_last_request_is_answered() -> None:
    async def main() -> None:
        h = Harness()
        running = await h.start()
        await h.client.send_multipart(protocol.message(protocol.EXECUTE, {"request_id": "j1"}))
        await asyncio.sleep(0.05)
        h.shell.drain()
        await asyncio.sleep(0.1)
        assert not running.done(), "stopped with a request in flight"
        h.finish("j1")
        # The drain waits on an event, not a poll: the shell stops within a few turns of the loop.
        for _ in range(10):
            await asyncio.sleep(0)
        assert running.done()
        assert (await h.reply())["result"] == {"done": True}
        await h.close(running)

    run(main)


def test_a_stop_answers_what_is_in_flight() -> None:
    async def main() -> None:
        h = Harness()
        running = await h.start()
        await h.client.send_multipart(protocol.message(protocol.EXECUTE, {"request_id": "j1"}))
        await asyncio.sleep(0.05)
        h.shell.stop()
        await running
        await h.shell.close()
        answer = await h.reply()
        assert (
            answer["error"]["kind"] == "engine" and "stopped before the program finished" in answer["error"]["message"]
        )
        h.client.close(linger=0)
        h.shell.terminate()

    run(main)


def test_a_send_to_an_unknown_peer_fails_at_once_and_replies_never_stall() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        server = router_socket(context)
        url = f"tcp://127.0.0.1:{free_port()}"
        server.bind(url)
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: no such peer
            send_now(server, [b"nobody", b"x"])
        # Replies sent from other tasks while the receive waits (as a broker answers from timers
        # and lease grants): with 8 in flight, every round trip completes quickly.
        loop = asyncio.get_running_loop()

        def echo_later(frames: list[zmq.Frame]) -> None:
            loop.call_soon(send_now, server, [bytes(f.buffer) for f in frames])

        tasks = TaskSet()
        tasks.spawn(receive_forever(server, echo_later, "echo_failed"))
        client = context.socket(zmq.DEALER)
        client.connect(url)
        started = time.monotonic()
        for _ in range(8):
            await client.send_multipart([b"ping"])
        for _ in range(400):
            await asyncio.wait_for(client.recv_multipart(), 2)
            await client.send_multipart([b"ping"])
        assert time.monotonic() - started < 10
        await tasks.cancel_all()
        await cancel_and_wait([])  # nothing to wait for
        client.close(linger=0)
        server.close(linger=0)
        context.term()

    run(main)


def test_the_shell_takes_every_service_setting_by_name() -> None:
    """ShellSettings.of copies the properties of ServiceSettings named in SERVICE_SETTINGS: each
    is a property of the protocol and a field of the dataclass, and comes across from both services."""
    import dataclasses

    from kcoral.broker.settings import BrokerSettings
    from kcoral.router.settings import RouterSettings
    from kcoral.service.shell import SERVICE_SETTINGS, ServiceSettings

    properties = {name for name, value in vars(ServiceSettings).items() if isinstance(value, property)}
    assert set(SERVICE_SETTINGS) <= properties  # the rest (max_request_bytes) is read by the services
    assert set(SERVICE_SETTINGS) <= {f.name for f in dataclasses.fields(ShellSettings)}
    broker = BrokerSettings(listen="tcp://127.0.0.1:1", metrics_listen="127.0.0.1:2", max_connections_per_address=3)
    shell = ShellSettings.of(broker)
    fields = (shell.listen, shell.metrics_listen, shell.max_connections_per_address)
    assert fields == ("tcp://127.0.0.1:1", "127.0.0.1:2", 3)
    assert ShellSettings.of(RouterSettings(listen="tcp://127.0.0.1:4")).listen == "tcp://127.0.0.1:4"
