"""A blob on its way into the store (:mod:`kcoral.broker.blobs`): checked against its digest whole
(:class:`PreparedBlob`) or in pieces as they arrive (:class:`BlobAssembly`)."""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# A sha256 digest as it travels on the wire: lowercase hex only, so one blob has one name.
DIGEST_PATTERN: Final = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PreparedBlob:
    """A blob whose digest was checked, and maybe written to a temporary disk file."""

    digest: str
    data: bytes | bytearray | memoryview
    view: memoryview
    temp_file: Path | None


class BlobAssembly:
    """A blob that arrives in pieces (a client's upload in frames of bounded size), in order.

    The pieces go to a temporary file of the disk tier as they come (to memory where the store
    has none), hashed on the way, so a blob of any size holds at most one piece in memory.
    :meth:`BlobStore.begin` makes one, :meth:`add` takes each piece, and
    :meth:`BlobStore.finish` files the complete blob; :meth:`discard` drops an unfinished one.
    """

    def __init__(self, digest: str, size: int, temp_file: Path | None) -> None:
        self.digest = digest
        self.size = size
        self.received = 0
        self.temp_file = temp_file
        self._hasher = hashlib.sha256()
        self._memory = bytearray() if temp_file is None else None

    @property
    def complete(self) -> bool:
        return self.received == self.size

    def add(self, piece: bytes | bytearray | memoryview) -> None:
        """Append the next piece; raises ValueError for one past the blob's size."""
        view = as_bytes_view(piece)
        if self.received + view.nbytes > self.size:
            raise ValueError(f"piece of {view.nbytes} bytes at {self.received} passes the blob's {self.size} bytes")
        self._hasher.update(view)
        if self._memory is not None:
            self._memory += view
        elif self.temp_file is not None:
            with self.temp_file.open("ab") as file:
                file.write(view)
        self.received += view.nbytes

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    def memory(self) -> bytearray | None:
        return self._memory

    def discard(self) -> None:
        """Forget an unfinished blob and its temporary file; idempotent."""
        if self.temp_file is not None:
            with contextlib.suppress(OSError):
                self.temp_file.unlink()
            self.temp_file = None
        self._memory = None


class BlobDigestMismatch(ValueError):
    """Raised when the bytes given to :meth:`BlobStore.put` do not hash to the digest given."""


def check_digest(digest: object) -> str:
    # Digests come from the network and name files on disk: refuse anything but 64 lowercase hex
    # characters, which also rules out path separators and "..".
    if not isinstance(digest, str) or DIGEST_PATTERN.fullmatch(digest) is None:
        raise ValueError(f"not a sha256 hex digest: {digest!r:.80}")
    return digest


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        # Rare (a strided view); hashing and writing need contiguous bytes, so copy once here.
        view = memoryview(view.tobytes())
    # Byte-level view of any format or shape (a zmq.Frame buffer, a numpy array) without copying.
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


__all__ = ["DIGEST_PATTERN", "BlobAssembly", "BlobDigestMismatch", "PreparedBlob", "as_bytes_view", "check_digest"]
