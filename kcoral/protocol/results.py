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
    "provenance",
    "timeline",
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
    provenance: dict[str, Any] | None = None,
    timeline: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A program's result: FAILED when there is an ``error`` (results returned before it are kept).
    ``provenance``: where and how it ran (the broker's, see ``kcoral.broker.provenance``);
    ``timeline``: the broker's wall-clock times of it (``kcoral.broker.requests.Request.timeline``)."""
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
        "provenance": {} if provenance is None else provenance,
        "timeline": {} if timeline is None else timeline,
    }


# The fields of a worker's RESULT body a client reads as they are, by type (the broker sets the others).
_RESULT_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "stdout": str,
    "stderr": str,
    "stdout_truncated": bool,
    "stderr_truncated": bool,
    "elapsed_ms": (int, float),
    "lease_wait_ms": (int, float),
    "lease_held_ms": (int, float),
    "worker": dict,
    "provenance": dict,
    "timeline": dict,
}
_ERROR_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "message": str,
    "instruction_index": (int, type(None)),
    "instruction_op": (str, type(None)),
    "instruction_id": (str, type(None)),
    "traceback": str,
}


def malformed_result(body: Mapping[str, Any]) -> str | None:
    """Why a worker's RESULT body is not a program's result a client can read, or None.

    Only its outline: the status, an error map where it FAILED, the results as a map by name and
    the fields of ``_RESULT_FIELD_TYPES``. The returned values inside are the client's to decode
    (a walk of them in the broker would hold its event loop for as long as they are large); one it
    cannot read is a ``protocol`` error of that program's own client.
    """
    status, error, results = body.get("status"), body.get("error"), body.get("results")
    if status not in (COMPLETED, FAILED):
        return f"its status is {str(status)[:40]!r}, not {COMPLETED} or {FAILED}"
    if (error is None) != (status == COMPLETED):
        return f"a {status} result with{'out' if error is None else ''} an error"
    if not isinstance(results, dict) or not all(isinstance(name, str) for name in results):
        return "its results are not a map by name"
    if error is not None and not isinstance(error, dict):
        return "its error is not a map"
    fields = [(body, _RESULT_FIELD_TYPES)] + ([(error, _ERROR_FIELD_TYPES)] if error is not None else [])
    for values, types in fields:
        for name, kind in types.items():
            value = values.get(name)
            if name in values and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                return f"its {name} is a {type(value).__name__}"
    return None


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
