"""Content-addressed blob store of the broker: a memory LRU in front of an optional disk LRU.

A client sends a program with the sha256 digests of its blobs; the broker answers with
:meth:`BlobStore.missing` and receives only those, then :meth:`BlobStore.put` verifies each one
against its digest. Blobs are plain bytes: nothing here ever unpickles or interprets them.

Tiers:

* memory: an LRU bounded by ``memory_bytes``. With a disk tier, a blob larger than
  ``memory_bytes // memory_blob_divisor`` is never held there, so one big upload cannot flush
  every small blob out of memory. Without a disk tier, every blob lives in memory.
* disk (``disk_dir``): an LRU bounded by ``disk_bytes``, written through for every blob, so a
  restarted broker keeps its cache. Files are named by digest and written to a temporary name,
  then moved with :func:`os.replace`, so a reader never sees half a file. The LRU order is kept
  in memory and mirrored in file mtimes (refreshed on use), which the start-up scan sorts by.

Integrity of the disk tier: the start-up scan trusts file names and only drops empty files
(a crash before the data reached the disk can leave a file of length zero, whereas hashing a
cache of many GiB would delay start-up). A file is hashed the first time this process reads it
or hands out its path (:meth:`BlobStore.get`, :meth:`BlobStore.disk_path`); a file that does not
match its name is deleted and the blob is reported absent. Blobs written by this process were
hashed by :meth:`BlobStore.put` and are not hashed again. One broker owns a cache directory.
Where others can write the directory (``--sandbox none``: workers run as the broker's user),
``disk_writable_by_others`` makes every read from disk hash the bytes it read, so a program that
rewrites a cached blob poisons nothing: the file is dropped and the client sends the blob again.

Pins: while a request runs, its blobs are pinned with the request id as owner; pinned blobs are
evicted from no tier, even when they alone exceed a tier's capacity, so a tiny cache still runs
a program with big blobs. Pin before the upload arrives (pinning an absent digest is allowed and
takes effect on :meth:`BlobStore.put`), so that nothing between the upload and the pin can evict
it. A put never evicts the blob it stores; the next eviction pass (a later put, a read that
fills memory, or :meth:`BlobStore.unpin_owner`) does, once it is unpinned.

Example::

    store = BlobStore(BlobStoreSettings(memory_bytes=1 << 20, disk_dir=Path("/var/cache/kcoral")))
    digest = BlobStore.digest_of(b"data")
    store.pin(digest, owner="request-1")
    if store.missing([digest]):
        store.put(digest, b"data")
    assert bytes(store.get(digest)) == b"data"
    store.unpin_owner("request-1")
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from kcoral.broker.incoming import (
    DIGEST_PATTERN,
    BlobAssembly,
    BlobDigestMismatch,
    PreparedBlob,
    as_bytes_view,
    check_digest,
)

__all__ = ("BlobAssembly", "BlobDigestMismatch", "BlobStore", "BlobStoreSettings")

_log = structlog.get_logger(__name__)

# Temporary files start with a dot so that they can never be mistaken for a digest.
_TEMP_PREFIX: Final = ".incoming-"
_EMPTY_DIGEST: Final = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class BlobStoreSettings:
    """Capacities of the blob store tiers; defaults suit one GPU host."""

    memory_bytes: int = 1 << 30
    """Capacity of the memory LRU, in bytes."""
    disk_dir: Path | None = None
    """Directory of the disk tier; None keeps blobs in memory only."""
    disk_bytes: int = 32 << 30
    """Capacity of the disk LRU, in bytes."""
    memory_blob_divisor: int = 4
    """With a disk tier, blobs over ``memory_bytes // memory_blob_divisor`` stay on disk only."""
    hash_chunk_bytes: int = 1 << 20
    """Read size when hashing a disk file, so that verifying a big file holds little memory."""
    disk_writable_by_others: bool = False
    """Hash every read from disk, not only the first: other processes can rewrite the files."""

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("blob store capacities must not be negative")
        if self.memory_blob_divisor < 1 or self.hash_chunk_bytes < 1:
            raise ValueError("memory_blob_divisor and hash_chunk_bytes must be positive")


class BlobStore:
    """Blobs by sha256 digest in a memory LRU and an optional disk LRU; see the module docstring."""

    def __init__(self, settings: BlobStoreSettings) -> None:
        self._settings = settings
        # Insertion order is LRU order: the first entry is the oldest; a use moves it to the end.
        # Values are bytes, or read-only views of buffers adopted from the caller (put(adopt=True)).
        self._memory: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._memory_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._disk_bytes = 0
        # Disk files this process wrote or hashed; the others were only trusted by name at scan.
        self._verified: set[str] = set()
        self._pins: dict[str, set[str]] = {}
        self._pins_by_owner: dict[str, set[str]] = {}
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._disk_dir = settings.disk_dir
        if self._disk_dir is not None:
            self._disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk(self._disk_dir)
            self._evict_disk(keep=None)

    @staticmethod
    def digest_of(data: bytes | bytearray | memoryview) -> str:
        """Lowercase hex sha256 of ``data``, the name a blob is stored under."""
        return hashlib.sha256(as_bytes_view(data)).hexdigest()

    def has(self, digest: str) -> bool:
        """Whether the blob is stored in any tier; counts neither a hit nor a miss."""
        check_digest(digest)
        return digest in self._memory or digest in self._disk

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The digests not stored, in the order given, each once; counts a hit or miss per digest.

        Every digest is validated before any is counted, so a bad request changes no statistic.
        """
        unique = list(dict.fromkeys(check_digest(digest) for digest in digests))
        absent = [digest for digest in unique if digest not in self._memory and digest not in self._disk]
        self._misses += len(absent)
        self._hits += len(unique) - len(absent)
        return absent

    def put(self, digest: str, data: bytes | bytearray | memoryview, *, adopt: bool = False) -> None:
        """Store ``data`` under ``digest`` after checking that it hashes to it; idempotent.

        Takes anything with the buffer protocol (``zmq.Frame.buffer``, ``bytearray``, ...). The
        memory tier keeps one copy (none for ``bytes``, which cannot change under us); the disk
        tier is written straight from the caller's buffer. With ``adopt`` the caller hands the
        buffer over and promises never to write to it again (a received zmq frame): the memory
        tier then keeps a read-only view of it, not a copy.
        """
        self.commit(self.prepare(digest, data), adopt=adopt)

    def prepare(self, digest: str, data: bytes | bytearray | memoryview) -> PreparedBlob:
        """The slow half of :meth:`put`: hash, and write a temporary disk file. It touches none of
        the store's state, so the broker runs it in a thread for large uploads while its event
        loop keeps serving; :meth:`commit` (on the loop) then files the blob."""
        check_digest(digest)
        view = as_bytes_view(data)
        actual = hashlib.sha256(view).hexdigest()
        if actual != digest:
            raise BlobDigestMismatch(f"blob of {view.nbytes} bytes hashes to {actual}, not {digest}")
        temp: Path | None = None
        if self._disk_dir is not None and not (self._disk_dir / digest).exists():
            temp_name: str | None = None
            try:
                fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self._disk_dir)
                with open(fd, "wb") as file:
                    file.write(view)
                temp = Path(temp_name)
            except OSError as exc:
                # The disk is a cache: a full or failing disk must not fail the upload itself.
                if temp_name is not None:
                    self._remove_disk_file(Path(temp_name))
                _log.warning("blob_disk_write_failed", digest=digest, error=str(exc))
        return PreparedBlob(digest, data, view, temp)

    def begin(self, digest: str, size: int) -> BlobAssembly:
        """A :class:`BlobAssembly` for ``digest``, a blob of ``size`` bytes to come in pieces."""
        check_digest(digest)
        if size < 1:
            raise ValueError(f"a blob in pieces has at least 1 byte, not {size}")
        temp: Path | None = None
        if self._disk_dir is not None:
            fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self._disk_dir)
            os.close(fd)
            temp = Path(temp_name)
        return BlobAssembly(digest, size, temp)

    def finish(self, assembly: BlobAssembly) -> None:
        """File a complete assembly under its digest; raises BlobDigestMismatch (and discards it)
        when its bytes hash to another digest. Large blobs stay on disk only, as with :meth:`put`."""
        if not assembly.complete:
            raise ValueError(f"blob {assembly.digest[:12]}... has {assembly.received} of {assembly.size} bytes")
        actual = assembly.hexdigest()
        if actual != assembly.digest:
            assembly.discard()
            raise BlobDigestMismatch(f"blob of {assembly.size} bytes hashes to {actual}, not {assembly.digest}")
        memory = assembly.memory()
        if memory is not None:
            self.commit(PreparedBlob(assembly.digest, memory, memoryview(memory), None), adopt=True)
            return
        assert assembly.temp_file is not None and self._disk_dir is not None
        digest, temp = assembly.digest, assembly.temp_file
        assembly.temp_file = None
        if digest in self._disk:
            self._remove_disk_file(temp)
        else:
            os.replace(temp, self._disk_dir / digest)
            self._disk[digest] = assembly.size
            self._disk_bytes += assembly.size
            self._verified.add(digest)
            self._evict_disk(keep=digest)
        self._touch_disk(digest)

    def commit(self, prepared: PreparedBlob, *, adopt: bool = False) -> None:
        """File a blob that :meth:`prepare` checked (and maybe wrote)."""
        digest, data, view = prepared.digest, prepared.data, prepared.view
        size = view.nbytes
        on_disk = digest in self._disk
        if prepared.temp_file is not None and self._disk_dir is not None:
            if on_disk:
                self._remove_disk_file(prepared.temp_file)
            else:
                os.replace(prepared.temp_file, self._disk_dir / digest)
                self._disk[digest] = size
                self._disk_bytes += size
                self._verified.add(digest)
                self._evict_disk(keep=digest)
                on_disk = True
        elif self._disk_dir is not None and not on_disk:
            on_disk = self._write_disk(self._disk_dir, digest, view)
        if on_disk:
            self._touch_disk(digest)
        if not self._fits_memory(size) and on_disk:
            return
        if digest in self._memory:
            self._memory.move_to_end(digest)
            return
        # Keep the caller's bytes object itself when it is one, or its adopted buffer; otherwise
        # this is the one copy.
        kept: bytes | memoryview
        if isinstance(data, bytes):
            kept = data
        elif adopt:
            kept = view.toreadonly()
        else:
            kept = view.tobytes()
        self._memory[digest] = kept
        self._memory_bytes += size
        self._evict_memory(keep=digest)

    def get(self, digest: str) -> memoryview:
        """The blob's bytes, read-only; raises KeyError when it is not stored.

        A blob read from disk is put into memory when it is small enough for the memory tier.
        """
        check_digest(digest)
        kept = self._memory.get(digest)
        if kept is not None:
            self._memory.move_to_end(digest)
            if digest in self._disk:
                # Keep the disk copy from ageing out while the blob is in active use.
                self._touch_disk(digest)
            return memoryview(kept)
        if digest not in self._disk or self._disk_dir is None:
            raise KeyError(digest)
        path = self._disk_dir / digest
        try:
            kept = path.read_bytes()
        except OSError as exc:
            self._drop_disk_entry(digest, reason="unreadable", error=str(exc))
            raise KeyError(digest) from exc
        if digest not in self._verified or self._settings.disk_writable_by_others:
            # We already hold the bytes, so hashing costs about as much as the read did.
            if hashlib.sha256(kept).hexdigest() != digest:
                self._drop_disk_entry(digest, reason="corrupt")
                raise KeyError(digest)
            self._verified.add(digest)
        self._touch_disk(digest)
        if self._fits_memory(len(kept)):
            self._memory[digest] = kept
            self._memory_bytes += len(kept)
            self._evict_memory(keep=digest)
        return memoryview(kept)

    def disk_path(self, digest: str) -> Path | None:
        """Path of the blob's file in the disk tier, or None when it has no disk copy.

        Workers read this file through a read-only mount; pin the blob for as long as they may.
        The file is hashed first if this process has not done so yet (once per file).
        """
        check_digest(digest)
        if digest not in self._disk or self._disk_dir is None:
            return None
        path = self._disk_dir / digest
        if digest not in self._verified:
            if not self._file_matches(path, digest):
                self._drop_disk_entry(digest, reason="corrupt")
                return None
            self._verified.add(digest)
        self._touch_disk(digest)
        return path

    def size_of(self, digest: str) -> int:
        """Size of the blob in bytes; raises KeyError when it is not stored."""
        check_digest(digest)
        kept = self._memory.get(digest)
        if kept is not None:
            return len(kept)
        return self._disk[digest]

    def pin(self, digest: str, owner: str) -> None:
        """Keep the blob from eviction until ``owner`` (a request id) is unpinned.

        The blob need not be stored yet: the pin protects it from the moment it is put.
        """
        check_digest(digest)
        self._pins.setdefault(digest, set()).add(owner)
        self._pins_by_owner.setdefault(owner, set()).add(digest)

    def unpin_owner(self, owner: str) -> None:
        """Drop every pin of ``owner``, then evict whatever is over capacity."""
        digests = self._pins_by_owner.pop(owner, set())
        for digest in digests:
            owners = self._pins[digest]
            owners.discard(owner)
            if not owners:
                del self._pins[digest]
        if digests:
            self._evict_memory(keep=None)
            self._evict_disk(keep=None)

    def stats(self) -> dict[str, int]:
        """Counters: ``entries``/``bytes`` of the memory tier, ``disk_entries``/``disk_bytes``,
        ``hits``/``misses`` counted by :meth:`missing`, ``evictions`` from either tier, and
        ``pinned``, the number of stored blobs with at least one pin."""
        return {
            "entries": len(self._memory),
            "bytes": self._memory_bytes,
            "disk_entries": len(self._disk),
            "disk_bytes": self._disk_bytes,
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "pinned": sum(1 for d in self._pins if d in self._memory or d in self._disk),
        }

    def _fits_memory(self, size: int) -> bool:
        if self._disk_dir is None:
            # Memory is the only tier; an oversized blob is kept until the next eviction pass.
            return True
        return size <= self._settings.memory_bytes // self._settings.memory_blob_divisor

    def _evict_memory(self, keep: str | None) -> None:
        for digest in self._victims(self._memory, lambda: self._memory_bytes, self._settings.memory_bytes, keep):
            self._memory_bytes -= len(self._memory.pop(digest))
            self._evictions += 1

    def _evict_disk(self, keep: str | None) -> None:
        if self._disk_dir is None:
            return
        for digest in self._victims(self._disk, lambda: self._disk_bytes, self._settings.disk_bytes, keep):
            self._remove_disk_file(self._disk_dir / digest)
            self._disk_bytes -= self._disk.pop(digest)
            self._verified.discard(digest)
            self._evictions += 1

    def _victims(
        self, tier: OrderedDict[str, Any], used: Callable[[], int], limit: int, keep: str | None
    ) -> Iterator[str]:
        """The digests to evict from ``tier``, least recently used first, for as long as ``used()``
        is over ``limit``; never ``keep`` or a pinned blob."""
        if used() <= limit:
            return  # the common case, without copying the tier's keys
        for digest in list(tier):
            if used() <= limit:
                return
            if digest != keep and digest not in self._pins:
                yield digest

    def _write_disk(self, disk_dir: Path, digest: str, view: memoryview) -> bool:
        """Write the blob to the disk tier; False (blob kept in memory instead) if that fails."""
        temp_name: str | None = None
        try:
            fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=disk_dir)
            with open(fd, "wb") as file:
                file.write(view)
            os.replace(temp_name, disk_dir / digest)
        except OSError as exc:
            # The disk is a cache: a full or failing disk must not fail the upload itself.
            if temp_name is not None:
                self._remove_disk_file(Path(temp_name))
            _log.warning("blob_disk_write_failed", digest=digest, error=str(exc))
            return False
        self._disk[digest] = view.nbytes
        self._disk_bytes += view.nbytes
        self._verified.add(digest)
        self._evict_disk(keep=digest)
        return True

    def _touch_disk(self, digest: str) -> None:
        self._disk.move_to_end(digest)
        if self._disk_dir is None:
            return
        # The mtime carries the LRU order across a restart (atime is often not kept). A failure
        # only blurs that order; the file itself is checked when it is read.
        with contextlib.suppress(OSError):
            os.utime(self._disk_dir / digest)

    def _drop_disk_entry(self, digest: str, *, reason: str, error: str | None = None) -> None:
        _log.warning("blob_disk_copy_dropped", digest=digest, reason=reason, error=error)
        self._disk_bytes -= self._disk.pop(digest)
        self._verified.discard(digest)
        if self._disk_dir is not None:
            self._remove_disk_file(self._disk_dir / digest)

    def _file_matches(self, path: Path, digest: str) -> bool:
        hasher = hashlib.sha256()
        try:
            with path.open("rb") as file:
                while chunk := file.read(self._settings.hash_chunk_bytes):
                    hasher.update(chunk)
        except OSError:
            return False
        return hasher.hexdigest() == digest

    def _scan_disk(self, disk_dir: Path) -> None:
        found: list[tuple[float, str, int]] = []
        with os.scandir(disk_dir) as entries:
            for entry in entries:
                if entry.name.startswith(_TEMP_PREFIX):
                    # Left by a broker that stopped mid-write; this broker owns the directory.
                    self._remove_disk_file(Path(entry.path))
                    continue
                if DIGEST_PATTERN.fullmatch(entry.name) is None or not entry.is_file(follow_symlinks=False):
                    continue  # Not ours: leave it alone.
                stat = entry.stat(follow_symlinks=False)
                if stat.st_size == 0 and entry.name != _EMPTY_DIGEST:
                    self._remove_disk_file(Path(entry.path))
                    continue
                found.append((stat.st_mtime, entry.name, stat.st_size))
        found.sort()
        for _, digest, size in found:
            self._disk[digest] = size
            self._disk_bytes += size
        if found:
            _log.info("blob_disk_scanned", entries=len(self._disk), bytes=self._disk_bytes)

    @staticmethod
    def _remove_disk_file(path: Path) -> None:
        # A file that cannot be removed now is found again by the next start-up scan.
        with contextlib.suppress(OSError):
            path.unlink()
