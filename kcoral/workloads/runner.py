"""The candidate's process: ``python -m kcoral.workloads.runner``, started by the harness.

It takes no arguments and reads nothing from its environment or files: everything comes over its
standard input, a socket to the harness, when the harness offers it. Its standard output and error
are the harness's standard error (never the stream the report is printed on).

What it is told, in order (``kcoral.workloads.harness`` drives it; every message is answered):

- ``start``: the workload folder and the candidate file, the shared buffers (one set of inputs and
  one output per call of a batch, the gate's word, the completion word) as IPC handles. It opens them, loads the
  workload and answers ``ready`` (with whether the gate works here).
- ``role``: ``null`` (a call that launches nothing), ``baseline``, or ``candidate``; the candidate
  file is imported only now, after the null and baseline roles are done. Answer: ``loaded``.
- ``call``: a batch of bracketed calls. Queue a wait on the gate (the batch's sequence number),
  each call on its set of shared inputs, the copy of its output into its shared output buffer, and
  the sequence number written into the completion word; answer ``queued`` at once (the harness then
  opens the gate and times the batch).
- ``measure``: time the role with ``benchmark``'s CUPTI timer (``kcoral.timing``); each of its calls
  asks for fresh inputs (``need``, answered ``inputs`` once the harness has put them in the shared
  buffers), having first handed the previous call's output over in the first shared output buffer
  (``handed``). Answer: ``timing`` with the report.
- ``finish``: answer ``done`` and exit.

A failure is answered ``error`` (``kind``, ``message``). Nothing is checked here, and nothing this
process says is taken on its word: the harness times each call itself, takes each output from the
shared buffer when the call completes, and checks them in its own process.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.timing import trust
from kcoral.workloads.channel import ChannelError, MessageReader, send_message
from kcoral.workloads.format import load_candidate, load_workload
from kcoral.workloads.ipc import BufferMeta, IpcError, OpenedBuffer, StreamWait

CHANNEL_FD: Final = 0
ROLES: Final = ("null", "baseline", "candidate")
WAIT_SECONDS: Final = 3600.0


class Runner:
    """The candidate's process's side of the conversation (its state lives here, not in globals)."""

    def __init__(self, torch: Any, fd: int) -> None:
        self.torch = torch
        self.fd = fd
        self.reader = MessageReader(fd, lambda: WAIT_SECONDS)
        self.sets: list[tuple[Any, ...]] = []  # one set of shared inputs per call of a batch
        self.outputs: list[Any] = []  # and one shared output
        self.inputs: tuple[Any, ...] = ()  # the first set: the correctness call's and the timer's
        self.output: Any = None
        self.done: Any = None
        self.gate: StreamWait | None = None
        self.workload: Any = None
        self.role = ""
        self.fn: Callable[..., Any] | None = None
        self.candidate: str | None = None
        self.device = 0

    def send(self, header: dict[str, Any]) -> None:
        send_message(self.fd, header)

    def receive(self) -> dict[str, Any]:
        message = self.reader.read()
        if message is None:
            raise ChannelError("the harness closed the channel")
        return message[0]

    def start(self, message: dict[str, Any]) -> None:
        torch = self.torch
        self.device = int(message.get("device") or 0)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device="cuda")  # the CUDA context, before the driver is asked to open handles
        self.workload = load_workload(str(message["folder"]))
        self.candidate = message.get("candidate")
        self.sets = [
            tuple(
                OpenedBuffer(torch, str(item["handle"]), BufferMeta.parse(item["meta"]), self.device).tensor
                for item in inputs
            )
            for inputs in message["inputs"]
        ]
        self.outputs = [
            OpenedBuffer(torch, str(item["handle"]), BufferMeta.parse(item["meta"]), self.device).tensor
            for item in message["outputs"]
        ]
        if not self.sets or len(self.sets) != len(self.outputs):
            raise ExecutionError("parse", "the harness sent no buffers, or not one output per set of inputs")
        self.inputs, self.output = self.sets[0], self.outputs[0]
        flag = OpenedBuffer(torch, str(message["flag"]), BufferMeta("int32", (1,)), self.device)
        self.gate = StreamWait(torch, flag.pointer)
        self.done = OpenedBuffer(torch, str(message["done"]), BufferMeta("int32", (1,)), self.device).tensor

    def set_role(self, role: str) -> None:
        torch = self.torch
        if role == "null":
            made = torch.empty_like(self.output)
            self.fn = lambda *inputs: made
        elif role == "baseline":
            self.fn = self.workload.baseline
        elif role == "candidate" and self.candidate:
            self.fn = load_candidate(self.candidate, self.workload.entry)
        else:
            raise ExecutionError("parse", f"no such role: {role!r}")
        self.role = role

    def call(self, seq: int, gated: bool, count: int) -> None:
        """Queue a batch of ``count`` bracketed calls behind the gate: call ``j`` on the ``j``-th set
        of shared inputs, its output copied to the ``j``-th shared output; then the completion word."""
        torch = self.torch
        assert self.fn is not None and self.gate is not None
        if not 1 <= count <= len(self.sets):
            raise ExecutionError("parse", f"a batch of {count} calls, with {len(self.sets)} sets of buffers")
        if gated:
            self.gate.wait(seq)
        for inputs, output in zip(self.sets[:count], self.outputs, strict=False):
            value = self.fn(*inputs)
            _check_output(torch, value, output)
            with torch._C.DisableTorchFunction():
                torch.Tensor.copy_(output, value)
            del value
        with torch._C.DisableTorchFunction():
            torch.Tensor.fill_(self.done, seq)

    def hand_over(self, value: Any) -> None:
        """Copy one output to the first shared output buffer and wait for it (the timer's calls)."""
        torch = self.torch
        _check_output(torch, value, self.output)
        with torch._C.DisableTorchFunction():
            torch.Tensor.copy_(self.output, value)
        torch.cuda.synchronize()

    def measure(self, config: dict[str, Any]) -> dict[str, Any]:
        """The timer's CUPTI measurement. Each of its calls gets fresh inputs from the harness, and
        hands its output over when the next one asks for them (in the timer's gap, untimed): the
        harness keeps a sample of these too and checks them."""
        from kcoral.timing.benchmark import measure

        fn = self.fn
        assert fn is not None
        last: list[Any] = []

        def timed(*inputs: Any) -> Any:
            value = fn(*inputs)
            last[:] = [value]
            return value

        def fresh(index: int) -> tuple[Any, ...]:
            handed = bool(last)
            if handed:
                self.hand_over(last.pop())
            self.send({"type": "need", "index": index, "handed": handed})
            reply = self.receive()
            if reply.get("type") != "inputs" or reply.get("index") != index:
                raise ChannelError(f"expected inputs for call {index}, got {reply.get('type')!r}")
            return self.inputs

        run = measure(timed, config=config, inputs=fresh, keep_outputs=0)
        return _plain(run.report)

    def serve(self) -> None:
        while True:
            message = self.receive()
            kind = message.get("type")
            try:
                if kind == "start":
                    self.start(message)
                    assert self.gate is not None
                    self.send({"type": "ready", "gate": self.gate.available, "gate_error": self.gate.why_not})
                elif kind == "role":
                    self.set_role(str(message.get("role")))
                    self.send({"type": "loaded", "role": self.role})
                elif kind == "call":
                    self.call(int(message["seq"]), bool(message.get("gated")), int(message.get("count") or 1))
                    self.send({"type": "queued", "call": message.get("call")})
                elif kind == "measure":
                    report = self.measure(dict(message.get("config") or {}))
                    self.send({"type": "timing", "role": self.role, "report": report})
                elif kind == "finish":
                    self.send({"type": "done"})
                    return
                else:
                    raise ExecutionError("parse", f"unknown message {kind!r}")
            except (ChannelError, OSError):
                raise
            except ExecutionError as exc:
                self.send({"type": "error", "role": self.role, "kind": exc.kind, "message": exc.message})
            except IpcError as exc:
                self.send({"type": "error", "role": self.role, "kind": "unavailable", "message": str(exc)})
            except BaseException as exc:
                self.send(
                    {
                        "type": "error",
                        "role": self.role,
                        "kind": "runtime",
                        "message": f"{type(exc).__name__}: {exc}"[:2000],
                        "traceback": traceback.format_exc()[-4000:],
                    }
                )


def _check_output(torch: Any, value: Any, output: Any) -> None:
    """ExecutionError("correctness") unless ``value`` is a plain tensor shaped like the shared ``output``."""
    if type(value) is not torch.Tensor:
        raise ExecutionError("correctness", f"the output is a {type(value).__name__}, not a plain tensor")
    with torch._C.DisableTorchFunction():
        if value.shape != output.shape or value.dtype != output.dtype or value.device != output.device:
            raise ExecutionError(
                "correctness",
                f"the output is a {value.dtype} tensor of shape {list(value.shape)} on {value.device}; "
                f"expected {output.dtype} of shape {list(output.shape)} on {output.device}",
            )


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


def main() -> int:
    import torch

    trust.arm(in_worker=True)  # before the workload or the candidate is imported
    runner = Runner(torch, CHANNEL_FD)
    try:
        runner.serve()
    except ChannelError as exc:
        print(f"kcoral runner: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
