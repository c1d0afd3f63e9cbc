"""End-to-end tests of the upload cache: digests first, only missing blobs sent, limits, pins.

Each test drives a real ``kcoral broker`` process; some speak the wire protocol through a raw
DEALER to do what the client never does (send wrong bytes, send part of a round, send nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kcoral import AsyncClient, Client, KCoralError, Program, protocol
from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from kcoral.worker.worker import ProgramBlobs, _map_blob
from tests.helpers import BrokerFactory, RunningBroker, start_broker

RAW_TIMEOUT_MS = 10_000
SUM_SOURCE = """\
import numpy as np

def total(*xs):
    return float(sum(float(np.asarray(x, dtype=np.float64).sum()) for x in xs))
"""
BIG = 2 << 20  # over the broker's blob_path_min_bytes: reaches the worker as a mapped file


def array(nbytes: int, seed: int) -> np.ndarray:
    """A float32 array of ``nbytes`` whose contents (and so digest) depend on ``seed``."""
    return np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)


def sum_program(*arrays: np.ndarray) -> Program:
    """Upload each array, return the sum of all their elements as ``total``."""
    program = Program()
    refs = [program.upload(kind="tensor", value=a) for a in arrays]
    module = program.upload(kind="module", source=SUM_SOURCE)
    fn = program.get_function(module=module, name="total")
    program.return_(key="total", value=program.run(fn=fn, args=refs))
    return program


def expected_sum(*arrays: np.ndarray) -> float:
    return float(sum(float(a.astype(np.float64).sum()) for a in arrays))


def cache_stats(client: Client) -> dict[str, Any]:
    return dict(client.health()["cache"])


@contextlib.contextmanager
def raw_dealer(url: str) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER speaking the wire protocol directly; closed with linger 0."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, RAW_TIMEOUT_MS)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close(linger=0)
        context.term()


def raw_send(sock: zmq.Socket[bytes], command: bytes, body: dict[str, Any], *frames: Any) -> None:
    sock.send_multipart(protocol.message(command, body, *frames), copy=False)


def raw_reply(sock: zmq.Socket[bytes], request_id: str) -> tuple[bytes, dict[str, Any]]:
    """The next PARTIAL or FINAL for ``request_id`` (heartbeats skipped)."""
    while True:
        command, body, _ = protocol.split_message(sock.recv_multipart())
        if command != protocol.HEARTBEAT and body.get("request_id") == request_id:
            return command, body


def raw_execute(sock: zmq.Socket[bytes], request_id: str, program: Program) -> dict[str, Any]:
    """Send EXECUTE with no blobs; return the first reply that is not 'queued'/'running'."""
    body, _ = program.to_wire()
    raw_send(sock, protocol.EXECUTE, {"request_id": request_id, "program": body, "options": {}, "blobs": []})
    return raw_reply(sock, request_id)[1]


def raw_until_final(sock: zmq.Socket[bytes], request_id: str) -> dict[str, Any]:
    while True:
        command, body = raw_reply(sock, request_id)
        if command == protocol.FINAL:
            return body


@pytest.fixture(scope="module")
def cache_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker with the default cache settings (so the cache is under its run dir)."""
    broker = start_broker(tmp_path_factory.mktemp("cache"), "--workers", "2")
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def limits_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker with 1 MiB request and response limits and a 1 s negotiation timeout."""
    broker = start_broker(
        tmp_path_factory.mktemp("limits"),
        "--workers",
        "1",
        "--max-request-bytes",
        "1m",
        "--max-response-bytes",
        "1m",
        "--negotiation-timeout",
        "1",
    )
    yield broker
    broker.stop()


# --- hits, misses and bytes sent -------------------------------------------------------------------


def test_cold_program_misses_then_completes_and_the_repeat_sends_nothing(cache_broker: RunningBroker) -> None:
    data = array(64 << 10, seed=1)
    program = sum_program(data)
    with Client(cache_broker.url) as client:
        before = cache_stats(client)
        first = client.execute(program)
        cold = cache_stats(client)
        sent_first = client.blob_bytes_sent
        second = client.execute(program)
        warm = cache_stats(client)
        sent_second = client.blob_bytes_sent - sent_first

    assert first.completed and second.completed, (first.error, second.error)
    assert first.results["total"] == pytest.approx(expected_sum(data), rel=1e-6)
    assert second.results["total"] == first.results["total"]
    assert (cold["misses"] - before["misses"], cold["hits"] - before["hits"]) == (1, 0)
    assert sent_first == data.nbytes
    assert sent_second == 0
    assert (warm["misses"] - cold["misses"], warm["hits"] - cold["hits"]) == (0, 1)
    assert cold["dir"].startswith(str(cache_broker.run_dir))  # the default: under the run dir


def test_program_sharing_one_of_two_tensors_sends_only_the_other(cache_broker: RunningBroker) -> None:
    shared, first_only, second_only = array(32 << 10, 2), array(32 << 10, 3), array(48 << 10, 4)
    with Client(cache_broker.url) as client:
        assert client.execute(sum_program(shared, first_only)).completed
        sent = client.blob_bytes_sent
        result = client.execute(sum_program(shared, second_only))
        assert result.completed, result.error
        assert client.blob_bytes_sent - sent == second_only.nbytes
    assert result.results["total"] == pytest.approx(expected_sum(shared, second_only), rel=1e-6)


def test_large_blob_reaches_the_worker_from_the_disk_cache(cache_broker: RunningBroker) -> None:
    big = array(BIG, seed=5)
    program = sum_program(big)
    with Client(cache_broker.url) as client:
        first = client.execute(program)
        second = client.execute(program)
    assert first.completed and second.completed, (first.error, second.error)
    assert first.results["total"] == second.results["total"] == pytest.approx(expected_sum(big), rel=1e-6)
    # Under --sandbox none a program could rewrite a cache file that another program maps, so the
    # broker reads (and hashes) the blob and sends it as a frame; bubblewrap maps it (test_slot.py).
    assert "blob_paths=0" in cache_broker.log()


def test_large_input_is_private_to_each_use_and_leaves_the_cache_intact(cache_broker: RunningBroker) -> None:
    import torch

    for value in (array(BIG, seed=19), torch.from_numpy(array(BIG, seed=20))):
        program = Program()
        # One blob, two uploads: each must be its own writable tensor.
        first, second = (program.upload(kind="tensor", value=value) for _ in range(2))
        source = "def zero_first(a, b):\n    a[:] = 0\n    return [float(a.sum()), float(b.sum())]\n"
        module = program.upload(kind="module", source=source)
        fn = program.get_function(module=module, name="zero_first")
        program.return_(key="sums", value=program.run(fn=fn, args=[first, second]))
        expected = expected_sum(np.asarray(value))
        with Client(cache_broker.url) as client:
            for _ in range(2):  # the second run reads the cache file the first one wrote into
                result = client.execute(program)
                assert result.completed, result.error
                zeroed, untouched = result.results["sums"]
                assert zeroed == 0.0
                assert untouched == pytest.approx(expected, rel=1e-5)


def test_returned_tensor_round_trips_through_frames(cache_broker: RunningBroker) -> None:
    big = array(BIG, seed=6)
    program = Program()
    program.return_(key="same", value=program.upload(kind="tensor", value=big))
    with Client(cache_broker.url) as client:
        result = client.execute(program)
    assert result.completed, result.error
    np.testing.assert_array_equal(result.results["same"], big)


# --- integrity and negotiation rounds --------------------------------------------------------------


def test_corrupted_blob_is_refused_with_kind_parse(cache_broker: RunningBroker) -> None:
    data = array(16 << 10, seed=7)
    with raw_dealer(cache_broker.url) as sock:
        need = raw_execute(sock, "corrupt-1", sum_program(data))
        assert need["state"] == "need_blobs"
        wrong = data.copy()
        wrong[0] += 1
        raw_send(sock, protocol.BLOBS, {"request_id": "corrupt-1", "blobs": need["blobs"]}, wrong.tobytes())
        final = raw_until_final(sock, "corrupt-1")
    assert not final["ok"]
    assert final["error"]["kind"] == "parse"
    assert "mismatch" in final["error"]["message"]
    with Client(cache_broker.url) as client:
        # The wrong bytes were not stored under the right name: the program still misses.
        sent = client.blob_bytes_sent
        assert client.execute(sum_program(data)).completed
        assert client.blob_bytes_sent - sent == data.nbytes


def test_program_runs_once_however_many_rounds_it_took(cache_broker: RunningBroker, tmp_path: Path) -> None:
    marker = tmp_path / "runs.txt"
    a, b = array(16 << 10, seed=8), array(16 << 10, seed=9)
    program = Program()
    refs = [program.upload(kind="tensor", value=x) for x in (a, b)]
    source = f"def run(a, b):\n    with open({str(marker)!r}, 'a') as f:\n        f.write('ran\\n')\n    return 1\n"
    module = program.upload(kind="module", source=source)
    program.return_(key="r", value=program.run(fn=program.get_function(module=module, name="run"), args=refs))
    _, blobs = program.to_wire()
    with Client(cache_broker.url) as client:
        completed_before = client.health()["counters"]["completed"]
    with raw_dealer(cache_broker.url) as sock:
        need = raw_execute(sock, "rounds-1", program)
        assert need["state"] == "need_blobs" and len(need["blobs"]) == 2
        first, rest = need["blobs"][0], need["blobs"][1:]
        # Round 1 sends one of the two; the broker asks again for exactly the other.
        raw_send(sock, protocol.BLOBS, {"request_id": "rounds-1", "blobs": [first]}, blobs[first])
        again = raw_reply(sock, "rounds-1")[1]
        assert again["state"] == "need_blobs" and again["blobs"] == rest
        # An empty round changes nothing.
        raw_send(sock, protocol.BLOBS, {"request_id": "rounds-1", "blobs": []})
        assert raw_reply(sock, "rounds-1")[1]["blobs"] == rest
        raw_send(sock, protocol.BLOBS, {"request_id": "rounds-1", "blobs": rest}, *(blobs[d] for d in rest))
        final = raw_until_final(sock, "rounds-1")
    assert final["ok"] and final["result"]["status"] == "COMPLETED", final
    time.sleep(0.5)  # a second dispatch, were there one, would have run by now
    assert marker.read_text() == "ran\n"
    with Client(cache_broker.url) as client:
        assert client.health()["counters"]["completed"] == completed_before + 1


# --- limits --------------------------------------------------------------------------------------


def test_request_over_max_request_bytes_is_refused_before_upload(limits_broker: RunningBroker) -> None:
    big = array(2 << 20, seed=10)
    as_argument = Program()
    module = as_argument.upload(kind="module", source=SUM_SOURCE)
    fn = as_argument.get_function(module=module, name="total")
    as_argument.return_(key="total", value=as_argument.run(fn=fn, args=[big]))
    with Client(limits_broker.url) as client:
        for program in (sum_program(big), as_argument):
            with pytest.raises(KCoralError) as info:
                client.execute(program)
            assert info.value.kind == "request_too_large"
        assert client.blob_bytes_sent == 0
        small = array(1 << 10, seed=11)
        assert client.execute(sum_program(small)).completed


def test_request_that_sends_more_than_it_declared_is_refused(limits_broker: RunningBroker) -> None:
    data = b"x" * (2 << 20)
    program = Program()
    program.upload(kind="bytes", value=data)
    body, blobs = program.to_wire()
    body["instructions"][0]["size"] = 10  # a client that under-declares its upload
    (digest,) = blobs
    with raw_dealer(limits_broker.url) as sock:
        raw_send(sock, protocol.EXECUTE, {"request_id": "liar-1", "program": body, "options": {}, "blobs": []})
        assert raw_reply(sock, "liar-1")[1]["state"] == "need_blobs"
        raw_send(sock, protocol.BLOBS, {"request_id": "liar-1", "blobs": [digest]}, data)
        final = raw_until_final(sock, "liar-1")
    assert not final["ok"] and final["error"]["kind"] == "request_too_large"


def test_response_over_max_response_bytes_is_refused(limits_broker: RunningBroker) -> None:
    program = Program()
    module = program.upload(kind="module", source="import numpy as np\n\ndef big():\n    return np.ones(1 << 19)\n")
    program.return_(key="big", value=program.run(fn=program.get_function(module=module, name="big")))
    with Client(limits_broker.url) as client:
        with pytest.raises(KCoralError) as info:
            client.execute(program)
        assert info.value.kind == "response_too_large"
        assert "1048576" in str(info.value)


def test_client_that_never_sends_its_blobs_is_dropped(limits_broker: RunningBroker) -> None:
    data = array(64 << 10, seed=12)
    with raw_dealer(limits_broker.url) as sock:
        started = time.monotonic()
        assert raw_execute(sock, "silent-1", sum_program(data))["state"] == "need_blobs"
        final = raw_until_final(sock, "silent-1")
        waited = time.monotonic() - started
    assert not final["ok"] and final["error"]["kind"] == "timeout"
    assert 0.9 < waited < 5
    with Client(limits_broker.url) as client:
        health = client.health()
    assert health["load"]["requests_waiting"] == 0
    assert health["cache"]["pinned"] == 0


# --- capacity, restarts and pins -------------------------------------------------------------------


def test_sixteen_byte_cache_still_completes_programs(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--workers", "1", "--cache-bytes", "16", "--cache-disk-bytes", "16")
    small, big = array(8 << 10, seed=13), array(BIG, seed=14)
    program = sum_program(small, big)
    with Client(broker.url) as client:
        results = [client.execute(program) for _ in range(2)]
        stats = cache_stats(client)
        # Nothing fits, so every blob is evicted once its program ends and sent again next time.
        assert client.blob_bytes_sent == 2 * (small.nbytes + big.nbytes)
    for result in results:
        assert result.completed, result.error
        assert result.results["total"] == pytest.approx(expected_sum(small, big), rel=1e-6)
    assert stats["evictions"] >= 2 and stats["pinned"] == 0
    assert stats["bytes"] <= 16 and stats["disk_bytes"] <= 16


def test_disk_cache_survives_a_restart_and_a_file_corrupted_meanwhile_is_sent_again(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "blob-cache"
    small, big, damaged_big = array(8 << 10, seed=15), array(BIG, seed=16), array(BIG, seed=21)
    program, damaged_program = sum_program(small, big), sum_program(damaged_big)
    first = broker_factory("--workers", "1", "--cache-dir", str(cache_dir))
    with Client(first.url) as client:
        assert client.execute(program).completed
        assert client.execute(damaged_program).completed
        assert client.blob_bytes_sent == small.nbytes + big.nbytes + damaged_big.nbytes
    assert first.stop() == 0
    (digest,) = damaged_program.to_wire()[1]
    damaged = bytearray((cache_dir / digest).read_bytes())
    damaged[-1] ^= 0xFF  # same size: only hashing finds it
    (cache_dir / digest).write_bytes(damaged)

    second = broker_factory("--workers", "1", "--cache-dir", str(cache_dir))
    with Client(second.url) as client:
        result = client.execute(program)
        assert client.blob_bytes_sent == 0
        assert cache_stats(client)["disk_entries"] == 3
        # Trusted by name at start-up, found corrupt when about to run, dropped and asked for again.
        again = client.execute(damaged_program)
        assert client.blob_bytes_sent == damaged_big.nbytes
    assert result.completed, result.error
    assert result.results["total"] == pytest.approx(expected_sum(small, big), rel=1e-6)
    assert again.completed, again.error
    assert again.results["total"] == pytest.approx(expected_sum(damaged_big), rel=1e-6)
    assert "request_blob_lost" in second.log()


def test_blob_pinned_by_a_queued_program_is_not_evicted(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--workers", "1", "--cache-bytes", "64k", "--cache-disk-bytes", "64k")
    pinned = array(8 << 10, seed=17)
    fillers = [array(12 << 10, seed=100 + i) for i in range(8)]  # 96 KiB: over both tiers
    sleeper = Program()
    module = sleeper.upload(kind="module", source="import time\n\ndef nap():\n    time.sleep(2)\n")
    sleeper.run(fn=sleeper.get_function(module=module, name="nap"))

    async def scenario() -> tuple[Any, dict[str, Any], int]:
        async with AsyncClient(broker.url) as client:

            async def wait_for(waiting: int) -> None:
                deadline = time.monotonic() + 10
                while (await client.health())["load"]["requests_waiting"] != waiting:
                    assert time.monotonic() < deadline, "the queue never reached the expected length"
                    await asyncio.sleep(0.02)

            sleeping = asyncio.create_task(client.execute(sleeper))
            await wait_for(0)  # the sleeper runs on the only worker
            queued = asyncio.create_task(client.execute(sum_program(pinned)))
            await wait_for(1)
            # Fill both tiers with blobs of programs that queue behind it, then cancel them, so
            # their blobs become evictable while ``pinned`` must stay.
            fill = [asyncio.create_task(client.execute(sum_program(f))) for f in fillers]
            await wait_for(1 + len(fill))
            for task in fill:
                task.cancel()
            await asyncio.gather(*fill, return_exceptions=True)
            await wait_for(1)
            stats = dict((await client.health())["cache"])
            result = await queued
            await sleeping
            return result, stats, client.blob_bytes_sent

    result, stats, sent = asyncio.run(scenario())
    assert stats["evictions"] > 0, stats
    # Sent once: had it been evicted, the broker would have had to ask for it again.
    assert sent == pinned.nbytes + sum(f.nbytes for f in fillers)
    assert "request_blob_lost" not in broker.log()
    assert result.completed, result.error
    assert result.results["total"] == pytest.approx(expected_sum(pinned), rel=1e-6)


# --- the sandbox's view of the cache -------------------------------------------------------------


def test_large_blob_is_read_from_the_read_only_mount_in_bubblewrap(broker_factory: BrokerFactory) -> None:
    try:
        check_bwrap()
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap cannot run here: {exc}")
    broker = broker_factory("--workers", "1", "--sandbox", "bubblewrap")
    big = array(BIG, seed=18)
    program = sum_program(big)
    probe = Program()
    module = probe.upload(
        kind="module",
        source="import os\n\ndef write():\n    open('/blobs/x', 'wb')\n",
    )
    probe.run(fn=probe.get_function(module=module, name="write"))
    with Client(broker.url) as client:
        result = client.execute(program)
        denied = client.execute(probe)
    assert result.completed, (result.error, broker.log()[-2000:])
    assert result.results["total"] == pytest.approx(expected_sum(big), rel=1e-6)
    assert "blob_paths=1" in broker.log()
    assert denied.error is not None and "Read-only file system" in denied.error["message"]


# --- the worker's side ---------------------------------------------------------------------------


def test_worker_maps_blob_files_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"abc" * 1000)
    blobs = ProgramBlobs({}, {"d" * 64: path})
    first, second = blobs["d" * 64], blobs["d" * 64]
    assert isinstance(first.obj, mmap.mmap) and len(first) == 3000 and not first.readonly
    first[:3] = b"xyz"  # private to this mapping: neither the file nor another use sees it
    assert bytes(second[:3]) == b"abc"
    assert path.read_bytes()[:3] == b"abc"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert len(_map_blob(empty)) == 0
