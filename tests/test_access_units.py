"""The pure parts of access control and fair share: key files, the ZAP verdict, the loopback rule,
rate limits, upload bounds, orphan grace and the per-client queue, each in milliseconds."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from kcoral import keys
from kcoral.service import auth
from kcoral.service.fairness import OrphanWatch, RateLimit, UploadBudget
from kcoral.service.queue import RequestQueue


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- key files ---


def test_generated_key_pair_reads_back_and_the_secret_is_private(tmp_path: Path) -> None:
    public_path, secret_path = keys.generate_keypair(tmp_path / "keys", "alice")
    assert public_path.name == "alice.key" and secret_path.name == "alice.key_secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    pair = keys.load_keypair(secret_path)
    assert keys.load_public_key(public_path) == pair.public
    assert len(pair.secret) == 40 and b"secret-key" not in public_path.read_bytes()
    assert "hidden" in repr(pair) and pair.secret.decode() not in repr(pair)
    # zmq's own reader agrees: the files are in its certificate format.
    assert zmq.auth.load_certificate(secret_path) == (pair.public, pair.secret)


def test_key_pairs_are_never_overwritten(tmp_path: Path) -> None:
    keys.generate_keypair(tmp_path, "alice")
    with pytest.raises(keys.KeyFileError, match="exists"):
        keys.generate_keypair(tmp_path, "alice")
    with pytest.raises(keys.KeyFileError):
        keys.generate_keypair(tmp_path, "../escape")


def test_bad_key_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    public_path, _ = keys.generate_keypair(tmp_path, "alice")
    with pytest.raises(keys.KeyFileError, match="no secret key"):
        keys.load_keypair(public_path)
    garbage = tmp_path / "garbage.key"
    garbage.write_text('curve\n    public-key = "short"\n')
    with pytest.raises(keys.KeyFileError, match="not a CURVE key"):
        keys.load_public_key(garbage)
    with pytest.raises(keys.KeyFileError):
        keys.load_public_key(tmp_path / "missing.key")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(keys.KeyFileError, match=r"no \*\.key"):
        keys.load_authorized_keys(empty)


def test_authorized_keys_are_every_public_key_file_of_a_directory(tmp_path: Path) -> None:
    a, _ = keys.generate_keypair(tmp_path, "a")
    b, _ = keys.generate_keypair(tmp_path, "b")
    assert keys.load_authorized_keys(tmp_path) == {keys.load_public_key(a), keys.load_public_key(b)}


# --- ZAP ---


def zap_request(key: bytes, *, domain: bytes = b"clients", mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", domain, b"10.0.0.9", b"", mechanism, z85.decode(key)]


def test_zap_allows_only_authorized_keys_per_domain() -> None:
    alice, mallory = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    authorized = {"clients": frozenset({alice}), "nodes": frozenset()}
    assert auth.decide(zap_request(alice), authorized).allowed
    assert auth.decide(zap_request(alice), authorized).user_id == alice
    assert not auth.decide(zap_request(mallory), authorized).allowed
    assert not auth.decide(zap_request(alice, domain=b"nodes"), authorized).allowed  # a client is no node
    assert not auth.decide(zap_request(alice, domain=b"other"), authorized).allowed
    assert not auth.decide([b"1.0", b"7", b"clients", b"", b"", b"NULL"], authorized).allowed
    assert not auth.decide([b"2.0"], authorized).allowed


def test_refused_peers_are_logged_once_per_interval_and_in_bounded_number() -> None:
    clock = Clock()
    refusals = auth.RefusalLog(interval_seconds=60, lines_per_interval=3, clock=clock)
    assert refusals.should_log("clients", "10.0.0.1", b"k")
    assert not refusals.should_log("clients", "10.0.0.1", b"k")  # the same peer again
    assert refusals.should_log("clients", "10.0.0.2", b"k")
    assert refusals.should_log("clients", "10.0.0.3", b"k")
    assert not refusals.should_log("clients", "10.0.0.4", b"k")  # over the lines per interval
    assert refusals.suppressed == 2
    clock.now += 61
    assert refusals.should_log("clients", "10.0.0.1", b"k")


def test_listening_beyond_loopback_needs_keys_or_the_insecure_flag() -> None:
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x", "inproc://a"):
        auth.check_listen(endpoint, secured=False, insecure_listen_any=False)
    for endpoint in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555"):
        with pytest.raises(auth.ListenRefused, match="--insecure-listen-any"):
            auth.check_listen(endpoint, secured=False, insecure_listen_any=False)
        auth.check_listen(endpoint, secured=True, insecure_listen_any=False)
        auth.check_listen(endpoint, secured=False, insecure_listen_any=True)


# --- rate limits, upload bounds, orphans ---


def test_rate_limit_allows_a_burst_then_the_rate() -> None:
    clock = Clock()
    limit: RateLimit[bytes] = RateLimit(rate=10, burst=5, clock=clock)
    assert all(limit.allow(b"a") for _ in range(5))
    assert not limit.allow(b"a")
    assert limit.allow(b"b")  # each client its own bucket
    clock.now += 0.15  # one token and a half back
    assert limit.allow(b"a") and not limit.allow(b"a")
    assert limit.refused == 2


def test_rate_limit_state_is_bounded_in_clients() -> None:
    limit: RateLimit[int] = RateLimit(rate=1, burst=1, clock=Clock(), max_keys=10)
    for key in range(1000):
        limit.allow(key)
    assert len(limit._buckets) == 10


def test_upload_budget_bounds_each_client_and_all() -> None:
    budget: UploadBudget[bytes] = UploadBudget(total_bytes=100, per_client_bytes=60)
    assert budget.reserve("r1", b"a", 50) is None
    refusal = budget.reserve("r2", b"a", 20)
    assert refusal is not None and refusal.kind == "busy" and "this client" in refusal.message
    assert budget.reserve("r3", b"b", 50) is None
    refusal = budget.reserve("r4", b"c", 10)
    assert refusal is not None and refusal.kind == "busy" and "the service" in refusal.message
    too_big = budget.reserve("r5", b"d", 61)
    assert too_big is not None and too_big.kind == "request_too_large"
    budget.release("r3")
    assert budget.reserve("r1", b"a", 55) is None  # growing one's own reservation
    assert budget.held == 55 and budget.held_by(b"a") == 55
    budget.release("r1")
    budget.release("r1")  # idempotent
    assert budget.held == 0 and budget.held_by(b"a") == 0
    assert budget.reserve("r4", b"c", 10) is None


@dataclass
class InFlight:
    client: bytes
    running: bool


def test_orphans_get_a_grace_and_are_forgiven_when_they_come_back() -> None:
    clock = Clock()
    orphans = OrphanWatch(5.0, clock=clock)
    requests = [InFlight(b"gone", False), InFlight(b"gone", True), InFlight(b"here", False)]

    def cancelled() -> list[tuple[bytes, bool]]:
        return [(r.client, running) for r, running in orphans.to_cancel(requests, lambda r: r.running)]

    assert orphans.gone([b"gone"]) == {b"gone": False}
    assert cancelled() == [(b"gone", False)]  # waiting at once, running not yet
    clock.now += 5
    assert orphans.gone([b"gone"]) == {b"gone": True}
    assert cancelled() == [(b"gone", False), (b"gone", True)]
    orphans.gone([])  # it came back
    assert cancelled() == []
    clock.now += 10
    orphans.gone([b"gone"])
    assert cancelled() == [(b"gone", False)]  # a new grace


@dataclass(eq=False)
class Queued:
    name: str
    owner: bytes
    client: bytes = field(default=b"")


def test_queue_serves_owners_in_turn_however_many_connections_they_use() -> None:
    queue: RequestQueue[Queued] = RequestQueue()
    for i in range(4):
        queue.push(Queued(f"a{i}", b"key:alice", client=f"conn-{i}".encode()))
    queue.push(Queued("b0", b"key:bob"))
    queue.push(Queued("b1", b"key:bob"))
    assert queue.queued_by(b"key:alice") == 4 and queue.queued_by(b"key:bob") == 2
    order = []
    while (item := queue.pop()) is not None:
        order.append(item.name)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
