"""The inbox's served reading (kcoral.inbox.Inbox.serve, kcoral.service.sockets.receive_forever), on
real zmq sockets over loopback: nothing waiting is left unread, floods leave the loop its turns,
a handler may send on the socket it reads, and a close or a cancel ends it."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from kcoral.inbox import Inbox
from kcoral.service.sockets import receive_forever, send_now


def _pair(context: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = context.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


async def _until(condition: Any, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_what_waits_before_serving_is_all_read_in_order_and_a_flood_leaves_the_loop_turns() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        server, client = _pair(context)
        try:
            for index in range(300):
                await client.send_multipart([b"%d" % index])
            await asyncio.sleep(0.2)  # all of them queued at the server before it reads
            inbox = Inbox(server)
            seen: list[int] = []
            turns: list[int] = []  # how many had been read when another callback ran

            def tick() -> None:
                turns.append(len(seen))
                if len(seen) < 300:
                    asyncio.get_running_loop().call_soon(tick)

            asyncio.get_running_loop().call_soon(tick)
            served = inbox.serve(lambda frames: seen.append(int(bytes(frames[1].buffer))), batch=64)
            await _until(lambda: len(seen) == 300)
            assert seen == list(range(300))
            # The other callback ran between the batches, not only before and after them all.
            assert any(0 < count < 300 for count in turns), turns
            assert not served.done()
            inbox.close()
            assert served.done() and served.exception() is None
        finally:
            client.close(0)
            server.close(0)
            context.term()

    asyncio.run(main())


def test_a_handler_that_sends_on_its_own_socket_never_stalls_the_reading() -> None:
    """Each send may take the edge that announced the next message: the inbox looks again."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        server, client = _pair(context)
        failures: list[str] = []

        def echo(frames: list[zmq.Frame]) -> None:
            if bytes(frames[1].buffer) == b"boom":
                raise RuntimeError("a handler that raises is logged, and the reading goes on")
            send_now(server, frames)

        reading = asyncio.create_task(receive_forever(server, echo, "test_failed"))
        try:
            for index in range(200):
                await client.send_multipart([b"boom"] if index == 100 else [b"%d" % index])
                if index == 100:
                    continue
                reply = await asyncio.wait_for(client.recv_multipart(), 5)
                if reply != [b"%d" % index]:
                    failures.append(f"{index}: {reply!r}")
            # A burst of 100 at once, each answered.
            for index in range(100):
                await client.send_multipart([b"b%d" % index])
            replies = [await asyncio.wait_for(client.recv_multipart(), 5) for _ in range(100)]
            assert replies == [[b"b%d" % index] for index in range(100)]
            assert failures == []
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            client.close(0)
            server.close(0)
            context.term()

    asyncio.run(main())


def test_a_cancelled_reading_closes_its_inbox_and_reads_no_more() -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        server, client = _pair(context)
        seen: list[bytes] = []
        reading = asyncio.create_task(receive_forever(server, lambda frames: seen.append(frames[1].bytes), "x"))
        try:
            await client.send_multipart([b"one"])
            await _until(lambda: seen == [b"one"])
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await client.send_multipart([b"two"])
            await asyncio.sleep(0.2)
            assert seen == [b"one"]
            # The socket is free to read again, by a new inbox.
            again = Inbox(server)
            assert await again.receive(5) is not None
            again.close()
        finally:
            client.close(0)
            server.close(0)
            context.term()

    asyncio.run(main())


def test_a_send_from_elsewhere_that_takes_the_edge_still_gets_the_message_read() -> None:
    """Another task's sends on the served socket read its events (and may take the edge of a
    message that has just arrived): the inbox reads it all the same."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        server, client = _pair(context)
        seen: list[bytes] = []
        peers: list[bytes] = []

        def take(frames: list[zmq.Frame]) -> None:
            peers[:] = [frames[0].bytes]
            seen.append(frames[1].bytes)

        reading = asyncio.create_task(receive_forever(server, take, "x"))

        async def chatter() -> None:
            while True:
                if peers:
                    send_now(server, [peers[0], b"noise"])
                await asyncio.sleep(0)

        noise = asyncio.create_task(chatter())
        try:
            for round_ in range(40):
                for index in range(5):
                    await client.send_multipart([b"%d-%d" % (round_, index)])
                expected = 5 * (round_ + 1)
                await _until(lambda: len(seen) == expected, seconds=5)  # noqa: B023 (awaited here)
            assert len(set(seen)) == 200
        finally:
            noise.cancel()
            reading.cancel()
            await asyncio.gather(reading, noise, return_exceptions=True)
            client.close(0)
            server.close(0)
            context.term()

    asyncio.run(main())
