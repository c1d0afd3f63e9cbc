"""The candidate's process: ``python -m kcoral.workloads.runner CONFIG_JSON``, started by the harness.

Order matters. The timer is armed first (CUPTI checked, references and code captured) and the
workload imported; the baseline is then run on the correctness seed and timed; only after its
numbers are sent is the candidate imported, so nothing it does can reach the baseline's
measurement. The candidate is run the same way. Every output goes to the harness as bytes over the
result pipe (``kcoral.workloads.channel``): the correctness call's output, the timing report, and
the outputs of a random sample of timed calls with the index of the inputs they were made for.
Nothing is checked here: the check runs in the harness, which the candidate's code never reaches.

CONFIG_JSON: ``folder``, ``candidate`` (a path, or null for the baseline alone), ``seed`` (the
correctness call's inputs), ``bases`` (``{"baseline": N, "candidate": M}``: timed call ``i`` of a
role gets ``make_inputs(base + i)``), ``fd`` (the result pipe's write end), ``keep`` (outputs kept).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, BinaryIO

from kcoral.errors import ExecutionError
from kcoral.timing import trust
from kcoral.workloads.channel import tensor_to_wire, write_message
from kcoral.workloads.format import Workload, load_candidate, load_workload

ROLES = ("baseline", "candidate")


def _send_tensor(stream: BinaryIO, torch: Any, header: dict[str, Any], value: Any) -> None:
    """Send one output; ExecutionError("correctness") when it is not a plain tensor."""
    try:
        meta, data = tensor_to_wire(torch, value)
    except TypeError as exc:
        raise ExecutionError("correctness", str(exc)) from exc
    write_message(stream, {**header, **meta}, data)


def _run_role(stream: BinaryIO, torch: Any, workload: Workload, role: str, fn: Any, config: dict[str, Any]) -> bool:
    """Correctness call, then the timing; False when the role failed (the error is sent)."""
    from kcoral.timing.benchmark import measure

    seed = int(config["seed"])
    base = int(config["bases"][role])
    try:
        output = fn(*workload.inputs(seed))
        torch.cuda.synchronize()
        _send_tensor(stream, torch, {"type": "output", "role": role, "seed": seed}, output)
        del output
        run = measure(
            fn,
            config=workload.timing,
            inputs=lambda index: workload.inputs(base + index),
            keep_outputs=int(config["keep"]),
        )
    except ExecutionError as exc:
        write_message(stream, {"type": "error", "role": role, "kind": exc.kind, "message": exc.message})
        return False
    except BaseException as exc:
        write_message(
            stream,
            {
                "type": "error",
                "role": role,
                "kind": "runtime",
                "message": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        return False
    write_message(stream, {"type": "timing", "role": role, "report": _plain(run.report)})
    for kept in run.kept:  # snapshots: plain tensors already
        _send_tensor(
            stream,
            torch,
            {"type": "kept", "role": role, "call": kept.call, "seed": base + kept.input_index},
            kept.output,
        )
    return True


def _plain(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 6:
        return str(value)
    if isinstance(value, dict):
        return {str(key): _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    return str(value)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    stream = os.fdopen(int(config["fd"]), "wb")
    import torch

    state = trust.arm(in_worker=True)  # before the workload or the candidate is imported

    write_message(stream, {"type": "ready", "cupti_error": state.cupti_error, "pid": os.getpid()})
    try:
        workload = load_workload(config["folder"])
        torch.zeros(1, device="cuda")
    except ExecutionError as exc:
        write_message(stream, {"type": "error", "role": "workload", "kind": exc.kind, "message": exc.message})
        return 0
    if _run_role(stream, torch, workload, "baseline", workload.baseline, config) and config.get("candidate"):
        try:
            candidate = load_candidate(config["candidate"], workload.entry)
        except ExecutionError as exc:
            write_message(stream, {"type": "error", "role": "candidate", "kind": exc.kind, "message": exc.message})
        else:
            _run_role(stream, torch, workload, "candidate", candidate, config)
    write_message(stream, {"type": "done"})
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
