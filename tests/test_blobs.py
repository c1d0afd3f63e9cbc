"""Tests of the broker's content-addressed blob store (memory LRU, disk LRU, pins)."""

from __future__ import annotations

import array
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kcoral.broker.blobs import BlobDigestMismatch, BlobStore, BlobStoreSettings

MIB = 1 << 20


def blob(size: int, fill: int = 0) -> bytes:
    """Bytes of ``size`` whose digest differs with ``fill``."""
    return bytes([fill % 256]) * size


StoreFactory = Callable[..., BlobStore]


@pytest.fixture
def make_store(tmp_path: Path) -> StoreFactory:
    """A BlobStore from settings keywords; ``disk=True`` gives it a disk tier under tmp_path."""

    def make(*, disk: bool = False, **settings: Any) -> BlobStore:
        disk_dir = tmp_path / "blobs" if disk else None
        return BlobStore(BlobStoreSettings(disk_dir=disk_dir, **settings))

    return make


def store_blob(store: BlobStore, data: bytes) -> str:
    digest = BlobStore.digest_of(data)
    store.put(digest, data)
    return digest


def test_digest_of_is_lowercase_hex_sha256() -> None:
    assert BlobStore.digest_of(b"") == ("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    assert BlobStore.digest_of(memoryview(b"abc")) == BlobStore.digest_of(b"abc")


def test_put_refuses_data_that_does_not_match_its_digest(make_store: StoreFactory) -> None:
    store = make_store(disk=True)
    digest = BlobStore.digest_of(b"expected")
    with pytest.raises(BlobDigestMismatch):
        store.put(digest, b"something else")
    assert not store.has(digest)
    assert store.stats()["disk_entries"] == 0
    assert issubclass(BlobDigestMismatch, ValueError)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "abc",
        "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
        "g" * 64,
        "a" * 63,
        "a" * 65,
        "../" + "a" * 61,
        "a" * 63 + "\n",
        b"a" * 64,
        None,
    ],
)
def test_bad_digest_strings_are_refused(make_store: StoreFactory, bad: object) -> None:
    store = make_store(disk=True)
    calls: list[Callable[[], object]] = [
        lambda: store.has(bad),  # type: ignore[arg-type]
        lambda: store.missing([bad]),  # type: ignore[list-item]
        lambda: store.put(bad, b""),  # type: ignore[arg-type]
        lambda: store.get(bad),  # type: ignore[arg-type]
        lambda: store.disk_path(bad),  # type: ignore[arg-type]
        lambda: store.size_of(bad),  # type: ignore[arg-type]
        lambda: store.pin(bad, "request-1"),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(ValueError, match="not a sha256 hex digest"):
            call()
    assert store.stats()["misses"] == 0


def test_missing_counts_hits_and_misses_keeps_order_and_drops_duplicates(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    present = store_blob(store, b"present")
    absent_a = BlobStore.digest_of(b"absent a")
    absent_b = BlobStore.digest_of(b"absent b")

    assert store.missing([absent_b, present, absent_a, absent_b, present]) == [absent_b, absent_a]
    stats = store.stats()
    assert (stats["hits"], stats["misses"]) == (1, 2)

    # has() is a plain question and counts nothing.
    assert store.has(present)
    assert not store.has(absent_a)
    assert (store.stats()["hits"], store.stats()["misses"]) == (1, 2)


def test_missing_with_a_bad_digest_counts_nothing(make_store: StoreFactory) -> None:
    store = make_store()
    with pytest.raises(ValueError, match="not a sha256 hex digest"):
        store.missing([BlobStore.digest_of(b"x"), "nope"])
    assert (store.stats()["hits"], store.stats()["misses"]) == (0, 0)


def test_memory_tier_evicts_least_recently_used_first(make_store: StoreFactory) -> None:
    store = make_store(memory_bytes=30)
    first, second, third = (store_blob(store, blob(10, fill)) for fill in range(3))
    store.get(first)  # now second is the oldest
    fourth = store_blob(store, blob(10, 3))
    assert not store.has(second)
    assert all(store.has(d) for d in (first, third, fourth))

    store.put(third, blob(10, 2))  # an idempotent put is a use too: first is now the oldest
    store_blob(store, blob(10, 4))
    assert not store.has(first)
    assert store.has(third)
    assert store.stats()["evictions"] == 2
    assert store.stats()["bytes"] == 30


def test_get_and_size_of_raise_key_error_for_absent_blobs(make_store: StoreFactory) -> None:
    store = make_store(disk=True)
    digest = BlobStore.digest_of(b"never stored")
    with pytest.raises(KeyError):
        store.get(digest)
    with pytest.raises(KeyError):
        store.size_of(digest)
    assert store.disk_path(digest) is None


def test_put_accepts_any_buffer_and_keeps_its_own_copy(make_store: StoreFactory) -> None:
    store = make_store()
    source = bytearray(b"mutable payload")
    digest = store_blob(store, bytes(source))
    store.put(digest, memoryview(source))  # idempotent with a different buffer type
    source[:] = b"X" * len(source)
    assert bytes(store.get(digest)) == b"mutable payload"

    # A buffer of 4-byte items, like a tensor's: stored as its raw bytes.
    items = array.array("I", [1, 2, 3])
    digest = BlobStore.digest_of(items.tobytes())
    store.put(digest, memoryview(items))
    assert bytes(store.get(digest)) == items.tobytes()
    assert store.size_of(digest) == 12
    assert store.get(digest).readonly


def test_put_with_adopt_keeps_the_callers_buffer_without_a_copy(make_store: StoreFactory) -> None:
    store = make_store()
    frame = bytearray(b"a received zmq frame")
    digest = BlobStore.digest_of(frame)
    store.put(digest, memoryview(frame), adopt=True)
    kept = store.get(digest)
    assert kept.readonly
    # The same memory: a write the caller promised never to make shows through.
    frame[0:1] = b"A"
    assert bytes(kept[:1]) == b"A"
    assert store.stats()["bytes"] == len(frame)


def test_disk_tier_survives_a_new_store_on_the_same_directory(make_store: StoreFactory) -> None:
    store = make_store(disk=True)
    digests = [store_blob(store, blob(100, fill)) for fill in range(3)]
    assert store.stats()["disk_entries"] == 3

    reopened = make_store(disk=True)
    assert reopened.missing(digests) == []
    assert reopened.stats()["disk_bytes"] == 300
    assert reopened.stats()["entries"] == 0  # nothing is read until asked for
    assert bytes(reopened.get(digests[1])) == blob(100, 1)
    assert reopened.stats()["entries"] == 1  # small enough to be kept in memory after the read
    assert reopened.size_of(digests[2]) == 100


def test_restart_keeps_disk_lru_order_and_applies_a_smaller_capacity(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store(disk=True)
    digests = [store_blob(store, blob(100, fill)) for fill in range(3)]
    # Make the ages explicit rather than rely on the file system's timestamp resolution.
    for age, digest in zip((10, 30, 20), digests, strict=True):
        stamp = 1_000_000 - age
        os.utime(tmp_path / "blobs" / digest, (stamp, stamp))

    reopened = make_store(disk=True, disk_bytes=200)
    assert not reopened.has(digests[1])  # the oldest one
    assert not (tmp_path / "blobs" / digests[1]).exists()
    assert reopened.has(digests[0])
    assert reopened.has(digests[2])


def test_start_up_scan_drops_leftovers_and_empty_files(make_store: StoreFactory, tmp_path: Path) -> None:
    disk_dir = tmp_path / "blobs"
    disk_dir.mkdir()
    (disk_dir / ".incoming-abc").write_bytes(b"half a blob")
    truncated = BlobStore.digest_of(b"lost in a crash")
    (disk_dir / truncated).write_bytes(b"")
    empty = BlobStore.digest_of(b"")
    (disk_dir / empty).write_bytes(b"")
    (disk_dir / "README").write_text("not a blob")

    store = make_store(disk=True)
    assert not store.has(truncated)
    assert store.has(empty)
    assert sorted(p.name for p in disk_dir.iterdir()) == sorted(["README", empty])


def test_a_corrupt_disk_file_is_dropped_when_read(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store(disk=True)
    good = store_blob(store, b"good data")
    other = store_blob(store, b"other data")
    (tmp_path / "blobs" / good).write_bytes(b"rotten data")
    (tmp_path / "blobs" / other).write_bytes(b"rotten data")

    reopened = make_store(disk=True)
    with pytest.raises(KeyError):
        reopened.get(good)
    assert not reopened.has(good)
    assert reopened.disk_path(other) is None
    assert not reopened.has(other)
    assert list((tmp_path / "blobs").iterdir()) == []


def test_large_blob_goes_to_disk_only(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store(disk=True, memory_bytes=40)  # blobs over 10 bytes stay on disk only
    small = store_blob(store, blob(10, 1))
    large = store_blob(store, blob(11, 2))

    stats = store.stats()
    assert (stats["entries"], stats["bytes"]) == (1, 10)
    assert (stats["disk_entries"], stats["disk_bytes"]) == (2, 21)
    # Small blobs are written through, so a restart keeps them too.
    assert store.disk_path(small) == tmp_path / "blobs" / small
    path = store.disk_path(large)
    assert path is not None
    assert path.read_bytes() == blob(11, 2)

    assert bytes(store.get(large)) == blob(11, 2)
    assert store.stats()["entries"] == 1  # reading it did not pull it into memory


def test_without_disk_tier_a_large_blob_is_kept_in_memory(make_store: StoreFactory) -> None:
    store = make_store(memory_bytes=40)
    large = store_blob(store, blob(30, 1))
    assert store.stats()["entries"] == 1
    assert store.disk_path(large) is None
    assert bytes(store.get(large)) == blob(30, 1)


@pytest.mark.parametrize("disk", [False, True])
def test_pinned_blob_is_not_evicted_under_pressure(make_store: StoreFactory, disk: bool) -> None:
    store = make_store(disk=disk, memory_bytes=40, disk_bytes=40)
    pinned = store_blob(store, blob(10, 0))
    store.pin(pinned, "request-1")
    others = [store_blob(store, blob(10, fill)) for fill in range(1, 10)]

    assert store.has(pinned)
    assert bytes(store.get(pinned)) == blob(10, 0)
    assert not store.has(others[0])  # the oldest unpinned blob went instead
    assert store.stats()["bytes"] <= 40
    assert store.stats()["pinned"] == 1


def test_pin_before_upload_protects_the_blob_from_the_moment_it_is_put(
    make_store: StoreFactory,
) -> None:
    store = make_store(memory_bytes=16)
    first, second = blob(MIB, 1), blob(MIB, 2)
    first_digest, second_digest = BlobStore.digest_of(first), BlobStore.digest_of(second)
    store.pin(first_digest, "request-1")
    store.pin(second_digest, "request-1")
    assert store.stats()["pinned"] == 0  # pins of absent blobs are not stored blobs
    store.put(first_digest, first)
    store.put(second_digest, second)
    assert store.missing([first_digest, second_digest]) == []
    assert store.stats()["pinned"] == 2
    store.unpin_owner("request-1")
    assert store.stats()["entries"] == 0


@pytest.mark.parametrize("disk", [False, True])
def test_tiny_cache_serves_a_pinned_large_blob_and_evicts_it_after_unpin(make_store: StoreFactory, disk: bool) -> None:
    store = make_store(disk=disk, memory_bytes=16, disk_bytes=16)
    data = blob(MIB, 7)
    digest = store_blob(store, data)
    store.pin(digest, "request-1")
    store.pin(digest, "request-2")
    store_blob(store, blob(MIB, 8))  # pressure from another, unpinned, upload

    assert store.get(digest) == data
    assert store.size_of(digest) == MIB

    store.unpin_owner("request-1")
    assert store.has(digest)  # request-2 still holds it
    store.unpin_owner("request-2")
    assert not store.has(digest)
    stats = store.stats()
    assert (stats["bytes"], stats["disk_bytes"], stats["pinned"]) == (0, 0, 0)


def test_stats_report_every_counter(make_store: StoreFactory) -> None:
    store = make_store(disk=True, memory_bytes=40, disk_bytes=25)
    empty = store.stats()
    assert empty == {
        "entries": 0,
        "bytes": 0,
        "disk_entries": 0,
        "disk_bytes": 0,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "pinned": 0,
    }
    a = store_blob(store, blob(10, 1))
    b = store_blob(store, blob(10, 2))
    store.pin(a, "request-1")
    store.missing([a, BlobStore.digest_of(b"nope")])
    c = store_blob(store, blob(10, 3))  # disk holds 25 bytes: b, the oldest unpinned, goes
    assert store.disk_path(b) is None
    assert store.has(b)
    assert store.stats() == {
        "entries": 3,
        "bytes": 30,
        "disk_entries": 2,
        "disk_bytes": 20,
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "pinned": 1,
    }
    assert store.disk_path(c) is not None


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="negative"):
        BlobStoreSettings(memory_bytes=-1)
    with pytest.raises(ValueError, match="positive"):
        BlobStoreSettings(memory_blob_divisor=0)


@pytest.mark.parametrize("on_disk", [True, False])
def test_a_blob_in_pieces_is_filed_once_complete_and_checked(tmp_path: Path, on_disk: bool) -> None:
    store = BlobStore(BlobStoreSettings(memory_bytes=1 << 20, disk_dir=tmp_path / "cache" if on_disk else None))
    data = bytes(range(256)) * 40
    digest = BlobStore.digest_of(data)
    assembly = store.begin(digest, len(data))
    for offset in range(0, len(data), 4096):
        assert not store.has(digest)
        assembly.add(memoryview(data)[offset : offset + 4096])
    with pytest.raises(ValueError):
        assembly.add(b"x")  # past the blob's size
    store.finish(assembly)
    assert bytes(store.get(digest)) == data
    if on_disk:
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [digest]  # no temporary file left

    wrong = store.begin("0" * 64, 3)
    wrong.add(b"abc")
    with pytest.raises(BlobDigestMismatch):
        store.finish(wrong)
    assert not store.has("0" * 64)
    unfinished = store.begin(BlobStore.digest_of(b"abcd"), 4)
    unfinished.add(b"ab")
    with pytest.raises(ValueError):
        store.finish(unfinished)
    unfinished.discard()
    if on_disk:
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [digest]
