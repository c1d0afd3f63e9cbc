"""CurveZMQ key files: make a key pair, read one back, read a directory of authorized keys.

A key pair is two files in ZeroMQ's certificate format (the one ``zmq.auth.load_certificate``
and czmq's ``zcert`` read), named as zmq names them:

- ``NAME.key``: the public key, safe to copy to servers (into their ``--authorized-keys DIR``)
  and to clients (as the server key they check);
- ``NAME.key_secret``: the public and the secret key; created with mode 0600 and never
  world-readable, not even for a moment.

Each file is text::

    #   KCoral CURVE secret key
    metadata
    curve
        public-key = "<40 characters of Z85>"
        secret-key = "<40 characters of Z85>"

Keys are the 40-character Z85 text of a 32-byte Curve25519 key, as bytes. This module reads only
the paths it is given; which paths (flags, environment variables) is the CLI's business.

Example::

    public_path, secret_path = generate_keypair(Path("keys"), "alice")
    pair = load_keypair(secret_path)
    assert pair.public == load_public_key(public_path)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

__all__ = (
    "ClientKeys",
    "KeyFileError",
    "KeyPair",
    "check_key",
    "generate_keypair",
    "load_authorized_keys",
    "load_keypair",
    "load_public_key",
)

Z85_KEY_LENGTH = 40
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
SECRET_FILE_MODE = 0o600
MAX_KEY_FILE_BYTES = 64 << 10  # a key file is a few hundred bytes; refuse to read a huge one
_Z85_ALPHABET = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


class KeyFileError(ValueError):
    """Raised when a key or key file is missing, unreadable, or not a CURVE key."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves as 40 bytes of Z85 text."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print a secret key in a log or a traceback
        return f"KeyPair(public={self.public!r}, secret=<hidden>)"


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs to reach a service that runs CURVE: the server's public key, which the
    client checks (so nobody can stand in for the server), and the client's own key pair, whose
    public half the server must list among its authorized keys."""

    server_public: bytes
    client: KeyPair

    def __post_init__(self) -> None:
        check_key(self.server_public, "server public key")

    @classmethod
    def from_files(cls, server_public_file: Path, client_secret_file: Path) -> ClientKeys:
        """Read the server's ``NAME.key`` and the client's ``NAME.key_secret``."""
        return cls(load_public_key(server_public_file), load_keypair(client_secret_file))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of the server (before it connects)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client.public
        sock.curve_secretkey = self.client.secret


def check_key(key: object, what: str = "key") -> bytes:
    """``key`` as 40 bytes of Z85 (a str is encoded); KeyFileError if it is anything else."""
    if isinstance(key, str):
        key = key.encode("ascii", errors="replace")
    if not isinstance(key, bytes) or len(key) != Z85_KEY_LENGTH or not set(key) <= _Z85_ALPHABET:
        raise KeyFileError(f"the {what} is not a CURVE key (40 characters of Z85)")
    return key


def generate_keypair(directory: Path, name: str = "kcoral") -> tuple[Path, Path]:
    """Write a new key pair as ``DIRECTORY/NAME.key`` and ``DIRECTORY/NAME.key_secret``; return
    both paths. Refuses to replace an existing file (a lost secret key locks its owner out)."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"a key name is a plain file name, not {name!r}")
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            raise KeyFileError(f"{path} exists already; choose another name or directory")
    public, secret = zmq.curve_keypair()
    # The secret file is created 0600 by open() itself (O_EXCL: never through an existing file or
    # link), so it is not readable by others between its creation and a chmod.
    _write_new(secret_path, _certificate("secret key", public, secret), SECRET_FILE_MODE)
    _write_new(public_path, _certificate("public key", public, None), 0o644)
    return public_path, secret_path


def load_public_key(source: Path) -> bytes:
    """The public key in a key file (either half of a pair)."""
    public, _ = _read_certificate(source)
    return public


def load_keypair(source: Path) -> KeyPair:
    """The key pair in a ``NAME.key_secret`` file."""
    public, secret = _read_certificate(source)
    if secret is None:
        raise KeyFileError(f"{source} holds no secret key (give the NAME{SECRET_SUFFIX} file)")
    return KeyPair(public, secret)


def load_authorized_keys(directory: Path) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``directory`` (not in its subdirectories)."""
    if not directory.is_dir():
        raise KeyFileError(f"{directory} is not a directory of authorized keys")
    keys = {load_public_key(path) for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}")) if path.is_file()}
    if not keys:
        raise KeyFileError(f"{directory} holds no *{PUBLIC_SUFFIX} file: no client could connect")
    return frozenset(keys)


def _certificate(what: str, public: bytes, secret: bytes | None) -> bytes:
    lines = [f"#   KCoral CURVE {what}", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def _write_new(path: Path, content: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away from a public file; give them back
        os.write(fd, content)
    finally:
        os.close(fd)


def _read_certificate(source: Path) -> tuple[bytes, bytes | None]:
    try:
        if source.stat().st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"{source} is too large to be a key file")
        public, secret = zmq.auth.load_certificate(source)
    except KeyFileError:
        raise
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read a key from {source}: {exc}") from None
    check_key(public, f"public key in {source}")
    if secret is not None:
        check_key(secret, f"secret key in {source}")
    return public, secret
