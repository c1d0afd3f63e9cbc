"""KCoral's exceptions and error kinds.

The hierarchy::

    KCoralError                 a request that could not run (``.kind``, ``.request_id``)
    +-- TransportError          the service could not be reached or stopped answering
    +-- ProtocolError           a message broke the wire protocol
    ExecutionError              raised by uploaded code to fail an instruction with a kind

A program that runs and fails is *data* (``ProgramResult.status == "FAILED"``), not an exception.
Errors cross process boundaries as dicts (``kind``, ``message``, ...), never as pickled objects.
"""

from __future__ import annotations

from typing import Final

# Kinds of an instruction that failed inside a program (``ProgramResult.error["kind"]``).
INSTRUCTION_ERROR_KINDS: Final = frozenset(
    {"parse", "compile", "runtime", "gpu_access", "correctness", "serialization", "unavailable", "integrity"}
)
# Kinds of a request that could not run at all (``KCoralError.kind``).
REQUEST_ERROR_KINDS: Final = frozenset(
    {
        "parse",
        "request_too_large",
        "response_too_large",
        "busy",
        "timeout",
        "cancelled",
        "node_lost",
        "capacity",
        "unauthorized",
        "engine",
    }
)
# Kinds raised by the client library itself, without a reply from the service.
CLIENT_ERROR_KINDS: Final = frozenset({"transport", "protocol"})


class KCoralError(Exception):
    """Raised when a request cannot run: the service refused it, lost it, or could not be reached."""

    def __init__(self, kind: str, message: str, *, request_id: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.request_id = request_id

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message}


class TransportError(KCoralError):
    """Raised when the service does not answer in time or the connection cannot be made."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__("transport", message, request_id=request_id)


class ProtocolError(KCoralError):
    """Raised when a message does not follow the wire protocol (bad frames, version, body)."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__("protocol", message, request_id=request_id)


class ExecutionError(Exception):
    """Raised by uploaded code to fail the current instruction with a chosen kind.

    Example::

        from kcoral.errors import ExecutionError
        raise ExecutionError("correctness", "max abs error 0.3 > 1e-3")
    """

    def __init__(self, kind: str, message: str) -> None:
        if kind not in INSTRUCTION_ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}; expected one of {sorted(INSTRUCTION_ERROR_KINDS)}")
        super().__init__(message)
        self.kind = kind
        self.message = message
