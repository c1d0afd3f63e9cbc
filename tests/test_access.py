"""Only known clients, each its fair share, and no flood drops an answer: real ``kcoral broker``
processes on loopback, honest clients through the public API, misbehaving ones as raw sockets."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
import zmq.asyncio

from kcoral import AsyncClient, Client, KCoralError, Program, protocol, testing
from kcoral.keys import ClientKeys, generate_keypair
from tests.helpers import BrokerFactory, free_port

pytestmark = pytest.mark.timeout(240)

NAP_SOURCE = "import time\ndef nap(seconds):\n    time.sleep(seconds)\n    return seconds\n"
# Uploaded code that floods the broker with PROGRESS through its own worker's socket, as a hostile
# program could: the socket is a local of the worker's frame that runs the program.
PROGRESS_FLOOD_SOURCE = """
import sys, time
from kcoral import protocol

def flood(seconds):
    frame = sys._getframe()
    while frame is not None and not hasattr(frame.f_locals.get("socket"), "send_multipart"):
        frame = frame.f_back
    sock = frame.f_locals["socket"]
    message = protocol.message(protocol.PROGRESS, {"request_id": "flood", "index": 1})
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(100):
            sock.send_multipart(message)
        sent += 100
    return sent
"""


def nap_program(seconds: float) -> Program:
    program = Program()
    module = program.upload(kind="module", source=NAP_SOURCE)
    nap = program.get_function(module=module, name="nap", cpu_only=True)
    program.return_(key="slept", value=program.run(fn=nap, args=[seconds]))
    return program


def constant_program(value: int = 42) -> Program:
    program = Program()
    program.return_(key="value", value=value)
    return program


def execute_message(program: Program, request_id: str | None = None) -> tuple[str, list[Any]]:
    body, blobs = program.to_wire()
    assert not blobs
    request_id = request_id or uuid.uuid4().hex
    return request_id, protocol.message(protocol.EXECUTE, {"request_id": request_id, "program": body})


def raw_dealer(context: zmq.Context[Any], url: str, keys: ClientKeys | None = None) -> zmq.Socket[Any]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if keys is not None:
        keys.apply(sock)
    sock.connect(url)
    return sock


def read(sock: zmq.Socket[Any], timeout_s: float) -> tuple[bytes, dict[str, Any]] | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    command, body, _ = protocol.split_message(sock.recv_multipart())
    return command, body


def broker_pid_rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# --- CurveZMQ ---


@pytest.fixture
def key_dirs(tmp_path: Path) -> dict[str, Path]:
    dirs = {name: tmp_path / "keys" / name for name in ("server", "clients", "strangers")}
    generate_keypair(dirs["server"], "server")
    generate_keypair(dirs["clients"], "alice")
    generate_keypair(dirs["strangers"], "mallory")
    return dirs


def client_keys(dirs: dict[str, Path], server: str = "server", who: str = "clients/alice") -> ClientKeys:
    folder, name = who.split("/")
    return ClientKeys.from_files(dirs["server"] / f"{server}.key", dirs[folder] / f"{name}.key_secret")


def test_with_keys_only_an_authorized_client_is_served(
    broker_factory: BrokerFactory, key_dirs: dict[str, Path]
) -> None:
    alice = client_keys(key_dirs)
    broker = broker_factory(
        "--workers",
        "1",
        "--curve-secret-key",
        str(key_dirs["server"] / "server.key_secret"),
        "--authorized-keys",
        str(key_dirs["clients"]),
        client_options={"keys": alice},
    )
    with Client(broker.url, keys=alice) as client:
        assert client.execute(constant_program(7)).results == {"value": 7}

    mallory = client_keys(key_dirs, who="strangers/mallory")
    with pytest.raises(KCoralError) as refused:
        Client(broker.url, keys=mallory, connect_timeout_seconds=5).open()
    assert refused.value.kind == "unauthorized"
    # A client that trusts the wrong server key is not served either (and learns it at once).
    impostor = ClientKeys(alice.client.public, alice.client)
    with pytest.raises(KCoralError) as wrong_server:
        Client(broker.url, keys=impostor, connect_timeout_seconds=5).open()
    assert wrong_server.value.kind == "unauthorized"
    # Without keys nothing comes back at all: not even an error.
    with pytest.raises(KCoralError) as plain:
        Client(broker.url, connect_timeout_seconds=1.5).open()
    assert plain.value.kind == "transport"
    context: zmq.Context[Any] = zmq.Context()
    try:
        raw = raw_dealer(context, broker.url)
        _, message = execute_message(constant_program())
        # Between two refused handshakes the DEALER has no pipe to queue on, and a blocking send
        # would wait for a peer that never comes (it hung the test for its whole timeout once).
        deadline = time.monotonic() + 5.0
        while True:
            try:
                raw.send_multipart(message, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert read(raw, 1.0) is None
    finally:
        context.destroy(linger=0)
    # The refused key is logged once, however often it knocked.
    for _ in range(3):
        with pytest.raises(KCoralError):
            Client(broker.url, keys=mallory, connect_timeout_seconds=2).open()
    assert broker.log().count("peer_refused") >= 1
    assert broker.log().count(mallory.client.public.decode()) == 1


def test_with_keys_a_router_serves_known_clients_through_known_nodes(
    tmp_path: Path, broker_factory: BrokerFactory, key_dirs: dict[str, Path]
) -> None:
    generate_keypair(key_dirs["server"], "node")  # the host broker's pair, known to the router
    node_keys = tmp_path / "keys" / "nodes"
    node_keys.mkdir()
    (node_keys / "node.key").write_bytes((key_dirs["server"] / "node.key").read_bytes())
    alice = client_keys(key_dirs)
    router = testing.start_router(
        tmp_path,
        "--curve-secret-key",
        str(key_dirs["server"] / "server.key_secret"),
        "--authorized-keys",
        str(key_dirs["clients"]),
        "--authorized-node-keys",
        str(node_keys),
        client_options={"keys": alice},
    )
    try:
        assert router.nodes_url is not None
        server_key = str(key_dirs["server"] / "server.key")
        broker_factory(
            "--workers",
            "1",
            "--upstream",
            router.nodes_url,
            "--node-id",
            "known",
            "--upstream-server-key",
            server_key,
            "--upstream-key",
            str(key_dirs["server"] / "node.key_secret"),
        )
        # A stranger's broker: a node key the router does not list. It never registers.
        broker_factory(
            "--workers",
            "1",
            "--upstream",
            router.nodes_url,
            "--node-id",
            "stranger",
            "--upstream-server-key",
            server_key,
            "--upstream-key",
            str(key_dirs["strangers"] / "mallory.key_secret"),
        )
        deadline = time.monotonic() + 30
        while "known" not in router.nodes():
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        with Client(router.url, keys=alice) as client:
            result = client.execute(constant_program(3))
        assert result.results == {"value": 3} and result.node_id == "known"
        time.sleep(2.0)  # the stranger has had time to try, more than once
        assert set(router.nodes()) == {"known"}
        assert "peer_refused" in router.log() and "domain=nodes" in router.log()

        mallory = client_keys(key_dirs, who="strangers/mallory")
        with pytest.raises(KCoralError) as refused:
            Client(router.url, keys=mallory, connect_timeout_seconds=5).open()
        assert refused.value.kind == "unauthorized"
        with pytest.raises(KCoralError) as plain:
            Client(router.url, connect_timeout_seconds=1.5).open()
        assert plain.value.kind == "transport"
        # A client's key is no node's: alice cannot register on the nodes endpoint.
        context: zmq.Context[Any] = zmq.Context()
        try:
            fake_node = raw_dealer(context, router.nodes_url, ClientKeys(alice.server_public, alice.client))
            fake_node.send_multipart(protocol.message(protocol.NODE_REGISTER, {"node_id": "impostor"}))
            assert read(fake_node, 1.5) is None
        finally:
            context.destroy(linger=0)
        assert set(router.nodes()) == {"known"}
    finally:
        router.stop()


def test_without_keys_a_service_stays_on_loopback(tmp_path: Path) -> None:
    for command in (
        ["broker", "--listen", f"tcp://0.0.0.0:{free_port()}", "--run-dir", str(tmp_path / "run")],
        ["router", "--listen", f"tcp://127.0.0.1:{free_port()}", "--nodes-listen", f"tcp://*:{free_port()}"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kcoral.cli", *command], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 78, done.stderr
        assert "--insecure-listen-any" in done.stderr


# --- fair share and orphans ---


def test_a_client_topping_up_the_queue_leaves_room_and_turns_for_others(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(
        "--fake-gpus", "1", "--max-queued", "16", "--max-queued-per-client", "4", "--orphan-grace", "1"
    )
    nap = 0.4
    context: zmq.Context[Any] = zmq.Context()
    flooder = raw_dealer(context, broker.url)
    finished_order: list[str] = []
    refused_busy = 0
    flooder_ids: set[str] = set()

    def top_up(count: int) -> None:
        for _ in range(count):
            request_id, message = execute_message(nap_program(nap))
            flooder_ids.add(request_id)
            flooder.send_multipart(message)

    stop = threading.Event()

    def flood() -> None:
        nonlocal refused_busy
        top_up(12)  # one runs, four wait, the rest are refused
        while not stop.is_set():
            reply = read(flooder, 0.1)
            if reply is None:
                continue
            command, body = reply
            if command != protocol.FINAL:
                continue
            if not body["ok"] and body["error"]["kind"] == "busy":
                refused_busy += 1
            else:
                finished_order.append("flooder")
            top_up(1)  # keep the queue topped up

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        time.sleep(1.0)
        assert refused_busy >= 6  # over its share of the queue, not over the whole queue

        async def honest() -> list[float]:
            async with AsyncClient(broker.url) as client:

                async def one() -> float:
                    result = await client.execute(nap_program(nap))
                    finished_order.append("honest")
                    return result.queue_ms

                return await asyncio.gather(*(one() for _ in range(3)))

        mark = len(finished_order)
        asyncio.run(honest())
    finally:
        stop.set()
        thread.join()
    # Round robin: the honest programs alternate with the flooder's (the running one, then one
    # each), never waiting behind the flooder's whole queue.
    window = finished_order[mark:]
    honest_at = [i for i, who in enumerate(window) if who == "honest"]
    assert len(honest_at) == 3, window
    # Before the first: the client's own connect (a HEALTH round trip), the running program and
    # at most one more; between the honest ones, one flooder program each (slack of one).
    assert window[: honest_at[0]].count("flooder") <= 4, window
    assert window[honest_at[0] : honest_at[-1]].count("flooder") <= 3, window

    # The flooder vanishes without a word: its waiting programs are cancelled at the next
    # heartbeat, its running one after --orphan-grace.
    flooder.close(linger=0)
    context.term()
    deadline = time.monotonic() + 6
    load: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with Client(broker.url) as client:
            load = client.health()["load"]
        if load["requests_waiting"] == 0 and load["requests_in_progress"] == 0:
            break
        time.sleep(0.2)
    assert load["requests_waiting"] == 0 and load["requests_in_progress"] == 0, load
    assert "client_gone_cancelling" in broker.log()


STALLED_CLIENT = """
import sys, time, zmq
sys.path.insert(0, sys.argv[3])
from tests.test_access import execute_message, nap_program
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
for _ in range(int(sys.argv[2])):
    sock.send_multipart(execute_message(nap_program(60))[1])
print("sent", flush=True)
time.sleep(600)
"""


def test_a_client_that_stops_answering_has_its_programs_cancelled(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """A client process frozen (SIGSTOP: its TCP connection stays open, nothing answers libzmq's
    pings) is taken for gone after the ping timeout: its programs are cancelled, the running one
    after --orphan-grace."""
    broker = broker_factory("--fake-gpus", "1", "--orphan-grace", "1")
    client = subprocess.Popen(
        [sys.executable, "-c", STALLED_CLIENT, broker.url, "3", str(Path.cwd())], stdout=subprocess.PIPE
    )
    try:
        assert client.stdout is not None and client.stdout.readline().startswith(b"sent")
        deadline = time.monotonic() + 10
        while broker.health()["load"]["requests_in_progress"] < 1:
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.1)
        client.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while True:
            load = broker.health()["load"]
            if load["requests_in_progress"] == 0 and load["requests_waiting"] == 0:
                break
            # libzmq's ping timeout (3 s), the next heartbeat (1 s), the grace (1 s), and slack.
            assert time.monotonic() - stopped < 10, (load, broker.log())
            time.sleep(0.2)
        assert broker.log().count("client_gone_cancelling") == 3
    finally:
        client.kill()
        client.wait()


def test_through_a_router_a_gone_client_has_its_programs_cancelled_on_the_node(
    tmp_path: Path, broker_factory: BrokerFactory
) -> None:
    router = testing.start_router(tmp_path, "--orphan-grace", "1")
    try:
        assert router.nodes_url is not None
        node = broker_factory("--fake-gpus", "1", "--upstream", router.nodes_url, "--node-id", "n1")
        deadline = time.monotonic() + 30
        while "n1" not in router.nodes():
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        context: zmq.Context[Any] = zmq.Context()
        try:
            sock = raw_dealer(context, router.url)
            for _ in range(3):  # one runs on the node, two wait at the router
                sock.send_multipart(execute_message(nap_program(60))[1])
            deadline = time.monotonic() + 15
            while node.health()["load"]["requests_in_progress"] < 1:
                assert time.monotonic() < deadline, router.log()
                time.sleep(0.1)
        finally:
            context.destroy(linger=0)  # gone, without a CANCEL
        deadline = time.monotonic() + 10
        while node.health()["load"]["requests_in_progress"] or router.health()["load"]["queued_at_router"]:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.2)
        assert router.log().count("client_gone_cancelling") == 3
    finally:
        router.stop()


# --- a loop that stays live ---


def test_floods_do_not_delay_heartbeats_or_drop_answers(broker_factory: BrokerFactory) -> None:
    """10,000 HEALTH from one raw socket and a program flooding PROGRESS, beside 5 honest programs
    and a client that only waits (recording when each heartbeat arrives)."""
    broker = broker_factory("--fake-gpus", "2")
    context: zmq.Context[Any] = zmq.Context()
    try:
        # The waiting client: a program that needs a blob it never sends stays in negotiation,
        # which is heartbeaten like any program in flight.
        waiter = raw_dealer(context, broker.url)
        program = Program()
        program.upload(kind="bytes", value=b"x" * 100)
        body, _ = program.to_wire()
        waiter.send_multipart(protocol.message(protocol.EXECUTE, {"request_id": "waiter", "program": body}))
        reply = read(waiter, 5.0)
        assert reply is not None and reply[1].get("state") == "need_blobs"
        beats: list[float] = []
        stop = threading.Event()

        def record_heartbeats() -> None:
            while not stop.is_set():
                got = read(waiter, 0.05)
                if got is not None and got[0] == protocol.HEARTBEAT:
                    beats.append(time.monotonic())

        recorder = threading.Thread(target=record_heartbeats)
        recorder.start()

        flood_program = Program()
        module = flood_program.upload(kind="module", source=PROGRESS_FLOOD_SOURCE)
        flood_fn = flood_program.get_function(module=module, name="flood", cpu_only=True)
        flood_program.return_(key="sent", value=flood_program.run(fn=flood_fn, args=[4.0]))

        flooder = raw_dealer(context, broker.url)
        health_answers = {"ok": 0, "busy": 0}

        def flood_health() -> None:
            for _ in range(10_000):
                flooder.send_multipart(protocol.message(protocol.HEALTH, {"request_id": uuid.uuid4().hex}))
            while sum(health_answers.values()) < 10_000:
                got = read(flooder, 10.0)
                if got is None:
                    return
                health_answers["ok" if got[1]["ok"] else "busy"] += 1

        async def programs() -> tuple[list[Any], Any]:
            async with AsyncClient(broker.url) as client:
                flooding = asyncio.ensure_future(client.execute(flood_program, timeout_seconds=60))
                await asyncio.sleep(1.0)  # the PROGRESS flood is on
                health_thread = threading.Thread(target=flood_health)
                health_thread.start()
                honest = await asyncio.gather(
                    *(client.execute(constant_program(i)) for i in range(5)), return_exceptions=True
                )
                flooded = await flooding
                await asyncio.to_thread(health_thread.join)
                return honest, flooded

        started = time.monotonic()
        honest, flooded = asyncio.run(programs())
        time.sleep(1.5)  # a last heartbeat after the floods
        stop.set()
        recorder.join()
    finally:
        context.destroy(linger=0)

    assert [r.results for r in honest] == [{"value": i} for i in range(5)], honest
    # The flooder gets an answer too; whether its RESULT survived its own flood is up to libzmq
    # (see CLEAN_EXIT_RESULT_GRACE_SECONDS in kcoral/broker/workers.py).
    assert flooded.status in ("COMPLETED", "FAILED"), flooded
    assert sum(health_answers.values()) == 10_000, health_answers
    gaps = [b - a for a, b in itertools.pairwise(beats) if b > started]
    print(f"heartbeat gaps: {[round(g, 3) for g in gaps]}; {health_answers}; flooder {flooded.results}")
    assert len(gaps) >= 3
    assert max(gaps) < 1.5, gaps


# --- upload bounds ---


def test_partial_uploads_beyond_the_bound_are_refused_and_memory_stays_under_it(
    broker_factory: BrokerFactory,
) -> None:
    mib = 1 << 20
    broker = broker_factory(
        "--workers", "1", "--max-upload-bytes", f"{48 * mib}", "--max-upload-bytes-per-client", f"{24 * mib}"
    )
    rss_before = broker_pid_rss(broker.process.pid)
    context: zmq.Context[Any] = zmq.Context()
    try:
        outcomes: dict[str, int] = {}
        sockets = []
        for peer in range(4):  # four slow uploaders, each trying to hold far more than its share
            sock = raw_dealer(context, broker.url)
            sockets.append(sock)
            for upload in range(4):
                program = Program()  # two blobs of 8 MiB, distinct from every other program's
                for part in "ab":
                    program.upload(kind="bytes", value=f"{peer}-{upload}-{part}".encode() + bytes(8 * mib))
                body, blobs = program.to_wire()
                request_id = f"p{peer}-{upload}"
                sock.send_multipart(protocol.message(protocol.EXECUTE, {"request_id": request_id, "program": body}))
                while True:  # skip the need_blobs that follow this peer's earlier partial uploads
                    reply = read(sock, 5.0)
                    assert reply is not None
                    command, answer = reply
                    if answer.get("request_id") == request_id:
                        break
                if command == protocol.FINAL:
                    kind = answer["error"]["kind"]
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                    continue
                assert answer["state"] == "need_blobs"
                # Send half of the blobs and stall: the upload stays in progress.
                first = answer["blobs"][0]
                sock.send_multipart(
                    protocol.message(protocol.BLOBS, {"request_id": request_id, "blobs": [first]}, blobs[first])
                )
                outcomes["in_progress"] = outcomes.get("in_progress", 0) + 1
        time.sleep(0.5)
        rss_after = broker_pid_rss(broker.process.pid)
        # 16 programs of 16 MiB asked for; 24 MiB per client and 48 MiB in all allowed.
        assert outcomes["in_progress"] <= 6 and outcomes["busy"] >= 10, outcomes
        assert rss_after - rss_before < 48 * mib + 16 * mib, (rss_after - rss_before) / mib
        # A program that alone is over the per-client bound can never fit: told so, not "busy".
        program = Program()
        program.upload(kind="bytes", value=b"y" * (25 * mib))
        with Client(broker.url) as client, pytest.raises(KCoralError) as too_large:
            client.execute(program)
        assert too_large.value.kind == "request_too_large"
    finally:
        context.destroy(linger=0)
    # The stalled uploads went with their peers: an honest upload fits again.
    program = Program()
    program.upload(kind="bytes", value=b"z" * (20 * mib))
    program.return_(key="ok", value=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            with Client(broker.url) as client:
                assert client.execute(program).results == {"ok": 1}
            break
        except KCoralError as exc:
            assert exc.kind == "busy" and time.monotonic() < deadline, exc
            time.sleep(0.5)
