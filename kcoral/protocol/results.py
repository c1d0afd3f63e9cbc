"""Results and errors as data: the one definition of a program's result and of an error map.

Every side that writes one builds it here (the worker and its interpreter, the broker when a worker
dies or a request is refused, the router and the node relay), so a client sees the same keys
whichever way a program ended and whichever service answered. ``docs/protocol.md`` section 8 lists
the fields, section 9 the error kinds.

- An *error map* (``error_map``, ``instruction_error``) says why a program FAILED: ``kind``,
  ``message``, ``instruction_index``, ``instruction_op``, ``instruction_id``, ``traceback``.
- A *result* (``program_result``) is the outcome of a program that ran, COMPLETED or FAILED. The
  worker sends it in RESULT; the broker completes it (``with_broker_fields``) and sends it in FINAL.
- A *request error* (``error_body``) says why a request could not run at all: ``kind`` and
  ``message`` only, in a FINAL with ``ok`` false (``final_error_body``, ``final_error``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from kcoral.protocol.codec import message
from kcoral.protocol.frames import FINAL

COMPLETED: Final = "COMPLETED"
FAILED: Final = "FAILED"

ERROR_KEYS: Final = ("kind", "message", "instruction_index", "instruction_op", "instruction_id", "traceback")
REQUEST_ERROR_KEYS: Final = ("kind", "message")
RESULT_KEYS: Final = (
    "request_id",
    "status",
    "results",
    "error",
    "stdout",
    "stderr",
    "stdout_truncated",
    "stderr_truncated",
    "queue_ms",
    "elapsed_ms",
    "lease_wait_ms",
    "lease_held_ms",
    "gpu_ids",
    "node_id",
)
# Beside RESULT_KEYS: "worker" (diagnostics of the worker that answered; absent when it died).
WORKER_KEY: Final = "worker"


def error_map(
    kind: str,
    message: str,
    *,
    index: int | None = None,
    op: str | None = None,
    id: str | None = None,
    traceback: str = "",
) -> dict[str, Any]:
    """The error of a FAILED program; without an index, it failed before any instruction ran."""
    return {
        "kind": kind,
        "message": message,
        "instruction_index": index,
        "instruction_op": op,
        "instruction_id": id,
        "traceback": traceback,
    }


def instruction_error(
    kind: str, message: str, index: int | None, instruction: object, traceback: str = ""
) -> dict[str, Any]:
    """The error of instruction ``index``, naming its op and id where the instruction map has them
    (it may be malformed: that can be the error)."""
    fields = instruction if isinstance(instruction, Mapping) else {}
    op, ident = fields.get("op"), fields.get("id")
    return error_map(
        kind,
        message,
        index=index,
        op=op if isinstance(op, str) else None,
        id=ident if isinstance(ident, str) else None,
        traceback=traceback,
    )


def program_result(
    request_id: str,
    *,
    error: dict[str, Any] | None = None,
    results: dict[str, Any] | None = None,
    stdout: str = "",
    stderr: str = "",
    stdout_truncated: bool = False,
    stderr_truncated: bool = False,
    queue_ms: float = 0.0,
    elapsed_ms: float = 0.0,
    lease_wait_ms: float = 0.0,
    lease_held_ms: float = 0.0,
    gpu_ids: Sequence[int] = (),
    node_id: str | None = None,
) -> dict[str, Any]:
    """A program's result: FAILED when there is an ``error`` (results returned before it are kept)."""
    return {
        "request_id": request_id,
        "status": FAILED if error is not None else COMPLETED,
        "results": {} if results is None else results,
        "error": error,
        "stdout": stdout,
        "stderr": stderr,
        "stdout_truncated": stdout_truncated,
        "stderr_truncated": stderr_truncated,
        "queue_ms": queue_ms,
        "elapsed_ms": elapsed_ms,
        "lease_wait_ms": lease_wait_ms,
        "lease_held_ms": lease_held_ms,
        "gpu_ids": list(gpu_ids),
        "node_id": node_id,
    }


def with_broker_fields(
    result: Mapping[str, Any], *, request_id: str, queue_ms: float, gpu_ids: Sequence[int], node_id: str | None
) -> dict[str, Any]:
    """A worker's result as the broker returns it: what only the broker knows filled in. ``node_id``
    is the broker's own where it serves a router (``--upstream``), else None."""
    return {**result, "request_id": request_id, "queue_ms": queue_ms, "gpu_ids": list(gpu_ids), "node_id": node_id}


def error_body(kind: str, message: str) -> dict[str, Any]:
    """The error of a request that could not run (FINAL with ``ok`` false)."""
    return {"kind": kind, "message": message}


def final_body(request_id: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """A FINAL body with ``ok`` true: a program's result, or the map HEALTH or TARGET asked for."""
    return {"request_id": request_id, "ok": True, "result": result}


def final_error_body(request_id: str, kind: str, text: str) -> dict[str, Any]:
    """A FINAL body for a request that could not run."""
    return {"request_id": request_id, "ok": False, "error": error_body(kind, text)}


def final_error(request_id: str, kind: str, text: str) -> list[Any]:
    """A FINAL message for a request that could not run."""
    return message(FINAL, final_error_body(request_id, kind, text))
