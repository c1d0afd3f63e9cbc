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
# A worker's messages but RESULT are small: READY and LEASE a few dozen bytes, PROGRESS at most
# protocol.OUTPUT_PIECE_BYTES characters of output (4 bytes each at most). Larger ones are dropped
# unread (measured: a program that sent LEASEs of 32 MiB for 3 s held the broker's loop decoding
# them for over 10 s, and the broker's clients took it for gone).
MAX_CONTROL_MESSAGE_BYTES = 4 * protocol.OUTPUT_PIECE_BYTES + (4 << 10)
# A READY the broker cannot place yet is kept a while (kcoral.broker.workers): from any identity,
# so it is bounded tighter.
MAX_READY_BYTES = 4 << 10


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


def oversized_control(command: bytes, frames: Sequence[Any]) -> bool:
    """Whether a worker message that is not a RESULT is larger than any a worker sends."""
    most = MAX_READY_BYTES if command == protocol.READY else MAX_CONTROL_MESSAGE_BYTES
    return sum(len(frame) for frame in frames) > most


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


__all__ = [
    "FINAL_BODY_MARGIN_BYTES",
    "MAX_CONTROL_MESSAGE_BYTES",
    "MAX_READY_BYTES",
    "lease_times",
    "oversized_control",
    "oversized_result",
    "reusable",
]
