"""What the broker decides about a worker slot, from what it knows itself rather than from what the
worker says.

A worker runs code nobody checked, so its messages are claims: its RESULT may be of any size or
shape, its ``reusable`` flag may lie, and its timings are its own. The broker acts on what the
zygote reports (exits, from the kernel) and on its own records: how many programs it sent a worker,
which lease a worker holds, when that lease was asked for and granted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kcoral import protocol
from kcoral.broker.requests import Worker

# The broker adds a few fields to a RESULT body to make the client's FINAL, which must stay under
# protocol.MAX_BODY_BYTES too; the worker keeps its bodies this far under the limit.
FINAL_BODY_MARGIN_BYTES = 16 << 10
MS_PER_S = 1000.0


def oversized_result(frames: Sequence[Any]) -> str | None:
    """Why a worker message is too large to answer a client with, or None when it is not."""
    if len(frames) > protocol.MAX_FRAMES:
        return (
            f"the result has {len(frames) - 3} data frames, over the {protocol.MAX_FRAMES - 3} "
            "that one message may hold"
        )
    if len(frames) >= 3 and bytes(frames[1]) == protocol.RESULT:
        size = len(frames[2])
        most = protocol.MAX_BODY_BYTES - FINAL_BODY_MARGIN_BYTES
        if size > most:
            return f"the result's body is {size} bytes, over the {most} that one message may hold"
    return None


# The fields of a RESULT body the client reads as they are, by type (the broker sets the others).
RESULT_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "stdout": str,
    "stderr": str,
    "stdout_truncated": bool,
    "stderr_truncated": bool,
    "elapsed_ms": (int, float),
    "lease_wait_ms": (int, float),
    "lease_held_ms": (int, float),
    "worker": dict,
}
ERROR_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "message": str,
    "instruction_index": (int, type(None)),
    "instruction_op": (str, type(None)),
    "instruction_id": (str, type(None)),
    "traceback": str,
}


def malformed_result(body: dict[str, Any]) -> str | None:
    """Why a RESULT body is not a program's result the client can read, or None.

    Only its outline: the status, an error map where it FAILED, the results as a map by name and
    the fields of :data:`RESULT_FIELD_TYPES`. The returned values inside are the client's to decode
    (a walk of them here would hold the event loop for as long as they are large); one it cannot
    read is a ``protocol`` error of that program's own client.
    """
    status, error, results = body.get("status"), body.get("error"), body.get("results")
    if status not in (protocol.COMPLETED, protocol.FAILED):
        return f"its status is {str(status)[:40]!r}, not {protocol.COMPLETED} or {protocol.FAILED}"
    if (error is None) != (status == protocol.COMPLETED):
        return f"a {status} result with{'out' if error is None else ''} an error"
    if not isinstance(results, dict) or not all(isinstance(name, str) for name in results):
        return "its results are not a map by name"
    if error is not None and not isinstance(error, dict):
        return "its error is not a map"
    fields = [(body, RESULT_FIELD_TYPES)] + ([(error, ERROR_FIELD_TYPES)] if error is not None else [])
    for values, types in fields:
        for name, kind in types.items():
            value = values.get(name)
            if name in values and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                return f"its {name} is a {type(value).__name__}"
    return None


def reusable(worker: Worker, max_programs: int) -> bool:
    """Whether ``worker`` may take another program: the broker's settings and records decide.

    Reuse (``--max-programs-per-worker`` other than 1) is the operator's choice to trust a worker
    between programs (the programs of one process are kept apart by the worker itself, see
    :mod:`kcoral.worker.state`); the GPU lease of a reused worker goes back with its result.
    """
    return max_programs == 0 or worker.programs < max_programs


def lease_times(asked_and_granted: tuple[float, float] | None, now: float) -> tuple[float, float]:
    """A result's ``lease_wait_ms`` and ``lease_held_ms`` from the broker's own clock.

    Held is counted until the result arrived (``now``); the lease itself stays with the worker
    until it has exited.
    """
    if asked_and_granted is None:
        return 0.0, 0.0
    asked, granted = asked_and_granted
    return (granted - asked) * MS_PER_S, (now - granted) * MS_PER_S


__all__ = ["FINAL_BODY_MARGIN_BYTES", "lease_times", "malformed_result", "oversized_result", "reusable"]
