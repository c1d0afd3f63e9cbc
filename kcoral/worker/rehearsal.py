"""A spare's rehearsal: the pages a program's path writes, written before the program comes.

A worker is forked from its zygote, so every page of its heap is the zygote's until the worker
writes to it; then the kernel copies it. A fresh worker's first program writes thousands of them
on the way through the worker's own code (the reference counts of the objects it uses, the caches
filled on first use: msgpack's, the protocol checks', the interpreter's), and each copy is a page
fault: a constant program's ``execute_program`` took 15 to 17 ms cold in a worker forked from a
process that imported the worker and torch, against 0.55 ms once the same path had run in it
(``benchmarks/RESULTS.md``, "A spare's rehearsal").

A spare waits, forked ahead, while the slot's current program runs: it walks that path once
there, on a program of its own (:func:`rehearse`), off every program's path. The rehearsal makes
no file, process, thread, socket or CUDA call, sets no process-wide state (the environment, the
directory, ``sys.path``, the timer, the capabilities: a spare of a GPU slot still holds its
capabilities here, and a file path of the slot's workspace is the current program's to point
elsewhere), and reads nothing of another program: it only decodes, interprets and encodes a
program it made itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kcoral import protocol
from kcoral.worker import processes
from kcoral.worker.capture import OutputCapture, rehearse_capture, rehearse_following
from kcoral.worker.interpreter import Interpreter
from kcoral.worker.lease import LeaseChannel
from kcoral.worker.result_bounds import bounded_result

REHEARSAL_ID = "rehearsal"
# A literal of each kind a program's values are made of, returned: the decoding and the
# encoding of every kind run once.
REHEARSED_VALUE: dict[str, Any] = {"int": 1, "float": 0.5, "text": "x", "list": [1, 2], "none": None, "flag": True}


def rehearsal_program() -> dict[str, Any]:
    """The PROGRAM body the spare executes: one return of :data:`REHEARSED_VALUE`, on no GPU."""
    instruction = {"op": "return", "id": "return_0", "key": "v", "value": REHEARSED_VALUE}
    return {
        "request_id": REHEARSAL_ID,
        "program": {"instructions": [instruction]},
        "options": {},
        "gpu_ids": [],
        "blobs": [],
    }


def rehearse(claims: Callable[[], dict[str, Any]]) -> bool:
    """Walk a constant program's path through this worker's code once; whether it came out as the
    program would have (a failure is not the spare's end: its first program then runs cold).

    ``claims``: the worker's ``program_claims``, part of every result's path.
    """
    try:
        frames = protocol.message(protocol.PROGRAM, rehearsal_program())
        command, body, _ = protocol.split_message(frames)
        lease = LeaseChannel(None, protocol.check_id(body.get("request_id"), "request_id"), [], None, None)
        # A path nothing is made in: a constant program touches no file.
        interpreter = Interpreter(body, {}, Path(os.devnull), lease)
        error = interpreter.execute()
        result = protocol.program_result(
            REHEARSAL_ID, error=error, results=interpreter.results, elapsed_ms=0.0, gpu_ids=[]
        )
        result["provenance"] = claims()
        bounded_result(result, interpreter.frames)
        threading.enumerate()
        # The paths a program's run is given (computed only: nothing is made), its output's follow
        # job (made and closed: no file is opened) and a generator's context manager, as the
        # output follower's is entered and left around every program.
        capture = OutputCapture(
            Path(os.devnull) / f"run-{REHEARSAL_ID}" / "output", protocol.DEFAULT_OUTPUT_LIMIT_BYTES
        )
        rehearse_following(capture)
        rehearse_capture(protocol.DEFAULT_OUTPUT_LIMIT_BYTES)
        with _nothing():
            pass
        _same_environment()
        if not processes.descendants(os.getpid(), processes.WALK_MOST):
            # What a program leaves running is killed after it. A spare has started nothing: the
            # same walk finds no process and kills none (and where one is found, it is not made).
            processes.kill_descendants(os.getpid())
        # Read only: the threads before and after a program, and the call that makes the worker
        # dumpable once its program is there (its state read, not changed).
        processes.thread_ids()
        processes.is_dumpable()
    except Exception:  # a rehearsal that fails costs only its speed-up
        return False
    return command == protocol.PROGRAM and error is None and interpreter.results.get("v") is not None


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _same_environment() -> None:
    """Set the variables every program sets to the values they have: the environment's pages
    and ``os.environ``'s are then this process's, and nothing changes."""
    for key in ("HOME", "TMPDIR", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(key)
        if value is not None:
            os.environ[key] = value
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.cuda.is_initialized()


__all__ = ["REHEARSAL_ID", "rehearsal_program", "rehearse"]
