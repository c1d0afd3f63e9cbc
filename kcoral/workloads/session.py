"""The harness's side of one candidate's process (``kcoral.workloads.harness`` says what the
harness keeps and why): the process started with nothing but a socket, the seeds and inputs copied
into shared buffers just before each call, the bracketed batches behind a gate, the committed
outputs kept by the harness's own draw, and the roles run in order. The report is made of what it
saw in ``kcoral.workloads.harness``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kcoral.errors import ExecutionError
from kcoral.workloads.channel import ChannelError, MessageReader, deadline_after, send_message
from kcoral.workloads.format import Workload
from kcoral.workloads.ipc import BufferMeta, IpcError, SharedBuffer, StreamWait

SEED_BITS: Final = 62
OUTPUTS_KEPT: Final = 16
# Calls are bracketed in batches: the gate opens once for BATCH calls queued back to back, each on
# its own set of shared inputs, so the bracket's fixed overhead (the two processes taking turns on
# the GPU: about 0.45 ms, +-0.05 ms, on the H200) is shared by the batch's calls. At most BATCH_MAX
# calls, and as many as fit in SHARED_BYTES of shared inputs and outputs.
BATCH_MAX: Final = 32
SHARED_BYTES: Final = 8 << 30
BRACKET_BATCHES: Final = 12
WARM_BATCHES: Final = 2
L2_FLUSH_FACTOR: Final = 2
FALLBACK_L2_BYTES: Final = 64 << 20
EXIT_GRACE_SECONDS: Final = 10.0
POLL_SECONDS: Final = 20e-6
# How long the harness waits for a gated call to be queued before it opens the gate anyway: a call
# that synchronises on the host while it launches (a first cuBLAS call, a lazy module load) would
# otherwise wait for a gate that opens only once it has said it is queued. Its bracket then holds
# its host time, which can only make it longer.
QUEUE_WAIT_SECONDS: Final = 0.25


class RoleFailed(Exception):
    """The candidate's process answered ``error`` (or left) during a role."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.error = error


@dataclass
class RoleResult:
    """What the harness saw of one role."""

    name: str
    error: dict[str, Any] | None = None
    correctness: str | None = None  # None: not run; "pass"; or why not
    brackets_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    kept: list[tuple[int, Any]] = field(default_factory=list)  # (seed, committed output)
    timing: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    calls: int = 0  # bracketed calls whose outputs were committed


def fresh_seed() -> int:
    return secrets.randbits(SEED_BITS)


class Reservoir:
    """Which committed outputs are kept: each call's chance is decided when it completes."""

    def __init__(self, size: int, randbelow: Any = secrets.randbelow) -> None:
        self.size = size
        self.seen = 0
        self._randbelow = randbelow

    def slot(self) -> int | None:
        """The slot for the call that just completed (None: not kept)."""
        index = self.seen
        self.seen += 1
        if index < self.size:
            return index
        drawn = int(self._randbelow(index + 1))
        return drawn if drawn < self.size else None


class Session:
    """The harness's side of one candidate's process."""

    def __init__(
        self, torch: Any, workload: Workload, candidate: Path | None, timeout_s: float, command: list[str] | None = None
    ) -> None:
        self.torch = torch
        self.workload = workload
        self.candidate = candidate
        self.remaining = deadline_after(timeout_s)
        self.command = command or [sys.executable, "-m", "kcoral.workloads.runner"]
        self.device = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.fd = -1
        self.reader: MessageReader | None = None
        self.sets: list[list[SharedBuffer]] = []  # the inputs of each call of a batch
        self.outputs: list[SharedBuffer] = []
        self.inputs: list[SharedBuffer] = []  # the first set (the correctness call's, the timer's)
        self.output: SharedBuffer | None = None
        self.batch = 1
        self.flag: SharedBuffer | None = None
        self.done: SharedBuffer | None = None
        self.done_wait: StreamWait | None = None
        self.gated = False
        self.gate_error: str | None = None
        self.seq = 0
        self.role = ""
        self._flush_buffer: Any = None
        self.returncode: int | None = None
        self.leftovers = False

    # ------------------------------------------------------------------ messages

    def send(self, header: dict[str, Any]) -> None:
        try:
            send_message(self.fd, header)
        except OSError as exc:
            raise self._gone(f"the channel broke ({exc})") from None

    def receive(self) -> dict[str, Any]:
        assert self.reader is not None
        try:
            message = self.reader.read()
        except ChannelError as exc:
            raise self._broken(str(exc)) from None
        if message is None:
            raise self._gone("it closed the channel")
        header = message[0]
        if header.get("type") == "error":
            raise RoleFailed(
                {
                    "kind": str(header.get("kind") or "runtime"),
                    "message": str(header.get("message"))[:2000],
                    "traceback": header.get("traceback"),
                }
            )
        return header

    def expect(self, kind: str, **fields: Any) -> dict[str, Any]:
        header = self.receive()
        if header.get("type") != kind or any(header.get(key) != value for key, value in fields.items()):
            raise self._broken(f"expected {kind!r}, got {str(header)[:300]}")
        return header

    def _broken(self, why: str) -> Exception:
        if self.role == "candidate":
            return ExecutionError("integrity", f"the candidate's process broke the harness's protocol: {why}")
        return ExecutionError("runtime", f"the workload's process broke the harness's protocol ({self.role}): {why}")

    def _gone(self, why: str) -> Exception:
        code = self.process.poll() if self.process is not None else None
        if code is None and self.process is not None:
            try:
                code = self.process.wait(EXIT_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                code = None
        self.returncode = code
        if self.role == "candidate" and code == 0:
            return ExecutionError(
                "integrity", f"the candidate's process left in the middle of the evaluation ({why}, exit status 0)"
            )
        message = f"the {self.role or 'workload'}'s process ended: {why} (exit status {code})"
        return RoleFailed({"kind": "runtime", "message": message})

    # ------------------------------------------------------------------ setup

    def spawn(self) -> None:
        """Start the candidate's process: no argument, its stdin a socket to here, its stdout and
        stderr this process's stderr (never the stream the report goes to)."""
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                self.command,
                stdin=theirs.fileno(),
                stdout=sys.stderr.fileno(),
                stderr=sys.stderr.fileno(),
                start_new_session=True,  # its own process group: whatever it leaves behind is found and killed
            )
        finally:
            theirs.close()
        self.fd = ours.detach()
        self.reader = MessageReader(self.fd, self.remaining)

    def start(self, first_inputs: tuple[Any, ...], expected: Any) -> None:
        torch = self.torch
        self.device = int(torch.cuda.current_device())
        for value in first_inputs:
            if not isinstance(value, torch.Tensor) or not value.is_cuda:
                raise ExecutionError("parse", "make_inputs must return CUDA tensors")
        if not isinstance(expected, torch.Tensor):
            raise ExecutionError("parse", "the reference must return one tensor")
        try:
            metas = [BufferMeta.of(torch, value) for value in first_inputs]
            out_meta = BufferMeta.of(torch, expected)
            per_call = sum(meta.nbytes(torch) for meta in metas) + out_meta.nbytes(torch)
            self.batch = max(1, min(BATCH_MAX, SHARED_BYTES // max(1, per_call)))
            for _ in range(self.batch):
                self.sets.append([SharedBuffer(torch, meta, self.device) for meta in metas])
                self.outputs.append(SharedBuffer(torch, out_meta, self.device))
            self.inputs, self.output = self.sets[0], self.outputs[0]
            self.flag = SharedBuffer(torch, BufferMeta("int32", (1,)), self.device)
            self.done = SharedBuffer(torch, BufferMeta("int32", (1,)), self.device)
        except IpcError as exc:
            raise ExecutionError("unavailable", f"the harness cannot share GPU memory here: {exc}") from exc
        self.flag.tensor.zero_()
        self.done.tensor.zero_()
        torch.cuda.synchronize()
        self.done_wait = StreamWait(torch, self.done.pointer)
        l2_bytes = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 0)
        elements = L2_FLUSH_FACTOR * (l2_bytes if l2_bytes > 0 else FALLBACK_L2_BYTES) // 4
        self._flush_buffer = torch.zeros(elements, dtype=torch.float32, device=f"cuda:{self.device}")
        torch.cuda.synchronize()
        self.spawn()
        self.role = "workload"
        self.send(
            {
                "type": "start",
                "device": self.device,
                "folder": str(self.workload.folder),
                "candidate": str(self.candidate) if self.candidate is not None else None,
                "inputs": [[{"meta": b.meta.describe(), "handle": b.handle} for b in one] for one in self.sets],
                "outputs": [{"meta": b.meta.describe(), "handle": b.handle} for b in self.outputs],
                "flag": self.flag.handle,
                "done": self.done.handle,
            }
        )
        try:
            ready = self.expect("ready")
        except RoleFailed as exc:
            raise ExecutionError(
                str(exc.error.get("kind") or "runtime"), f"the workload's process: {exc.error.get('message')}"
            ) from None
        self.gated = bool(ready.get("gate")) and self.done_wait.available
        self.gate_error = None if self.gated else str(ready.get("gate_error") or self.done_wait.why_not)

    def set_role(self, role: str) -> None:
        self.role = role
        self.send({"type": "role", "role": role})
        self.expect("loaded", role=role)

    # ------------------------------------------------------------------ calls

    def _flush(self) -> None:
        self._flush_buffer.sum()

    def _place(self, inputs: tuple[Any, ...], index: int = 0) -> None:
        torch = self.torch
        buffers = self.sets[index]
        if len(inputs) != len(buffers):
            raise ExecutionError("parse", f"make_inputs gave {len(inputs)} inputs, then {len(buffers)}")
        for buffer, value in zip(buffers, inputs, strict=True):
            if BufferMeta.of(torch, value) != buffer.meta:
                raise ExecutionError("parse", "make_inputs gave inputs of another dtype or shape for another seed")
            buffer.tensor.copy_(value)

    def _wait_for(self, event: Any) -> None:
        while not event.query():
            if self.remaining() <= 0:
                raise ExecutionError("runtime", f"the {self.role}'s call did not complete within the time limit")
            time.sleep(POLL_SECONDS)

    def _poll_done(self) -> None:
        """Without stream waits: read the completion word from the host until the call is done."""
        assert self.done is not None
        while int(self.done.tensor.item()) < self.seq:
            if self.remaining() <= 0:
                raise ExecutionError("runtime", f"the {self.role}'s call did not complete within the time limit")
            time.sleep(POLL_SECONDS)

    def bracketed(self, seeds: list[int], commits: list[Any]) -> tuple[float, float]:
        """A batch of calls timed by the harness, call ``j`` on the inputs of ``seeds[j]`` and its output
        copied into ``commits[j]``. (GPU ms, host ms) per call."""
        torch = self.torch
        assert self.flag is not None and len(seeds) == len(commits) <= self.batch
        made = [self.workload.inputs(seed) for seed in seeds]
        torch.cuda.synchronize()
        self.seq += 1
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        call = {"type": "call", "call": self.seq, "seq": self.seq, "count": len(seeds)}
        if self.gated:
            assert self.reader is not None
            self.send({**call, "gated": True})
            queued = self.reader.ready(QUEUE_WAIT_SECONDS)
            if queued:
                self.expect("queued", call=self.seq)
            start.record()
            for index, inputs in enumerate(made):
                self._place(inputs, index)
            self._flush()
            self.flag.tensor.fill_(self.seq)
            if not queued:
                self.expect("queued", call=self.seq)
        else:
            start.record()
            for index, inputs in enumerate(made):
                self._place(inputs, index)
            self._flush()
            torch.cuda.synchronize()
            self.send({**call, "gated": False})
            self.expect("queued", call=self.seq)
        if self.gated:
            assert self.done_wait is not None
            self.done_wait.wait(self.seq)
        else:
            self._poll_done()
        for commit, output in zip(commits, self.outputs, strict=False):
            commit.copy_(output.tensor)
        end.record()
        self._wait_for(end)
        host_ms = (time.perf_counter() - began) * 1e3
        del made
        return float(start.elapsed_time(end)) / len(seeds), host_ms / len(seeds)

    def measure(self, result: RoleResult, keep: int = OUTPUTS_KEPT) -> dict[str, Any]:
        """The candidate's own CUPTI measurement, every call on fresh inputs from here; each call's
        output, handed over when the next call asks for its inputs, is kept by the harness's draw
        (``keep`` of them) and checked with the rest."""
        torch = self.torch
        assert self.output is not None
        slots = [torch.empty_like(self.output.tensor) for _ in range(keep)]
        seeds: list[int | None] = [None] * keep
        reservoir = Reservoir(keep)
        previous: int | None = None
        self.send({"type": "measure", "config": self.workload.timing})
        expected_index = 0
        while True:
            header = self.receive()
            kind = header.get("type")
            if kind == "need":
                # The timer asks for call 0, 1, 2, ... in turn; anything else is someone else asking.
                if header.get("index") != expected_index:
                    raise self._broken(f"inputs asked for call {header.get('index')!r}, expected {expected_index}")
                if header.get("handed") is not (previous is not None):
                    raise self._broken(f"call {expected_index - 1}'s output was not handed over")
                if previous is not None:
                    slot = reservoir.slot()
                    if slot is not None:
                        slots[slot].copy_(self.output.tensor)
                        seeds[slot] = previous
                expected_index += 1
                previous = fresh_seed()
                self._place(self.workload.inputs(previous))
                torch.cuda.synchronize()
                self.send({"type": "inputs", "index": header.get("index")})
            elif kind == "timing" and isinstance(header.get("report"), dict):
                result.kept.extend((seed, slot) for seed, slot in zip(seeds, slots, strict=True) if seed is not None)
                result.calls += reservoir.seen
                return dict(header["report"])
            else:
                raise self._broken(f"expected 'need' or 'timing', got {str(header)[:300]}")

    def brackets(self, result: RoleResult, keep: int) -> None:
        torch = self.torch
        assert self.output is not None
        scratch = [torch.empty_like(self.output.tensor) for _ in range(self.batch)]
        slots = [torch.empty_like(self.output.tensor) for _ in range(keep)]
        seeds: list[int | None] = [None] * keep
        reservoir = Reservoir(keep)
        for batch in range(WARM_BATCHES + BRACKET_BATCHES):
            made = [fresh_seed() for _ in range(self.batch)]
            bracket_ms, host_ms = self.bracketed(made, scratch)
            # Which outputs are kept is drawn only now, after the calls: each one was committed the same way.
            for seed, committed in zip(made, scratch, strict=True):
                slot = reservoir.slot()
                if slot is not None:
                    slots[slot].copy_(committed)
                    seeds[slot] = seed
            if batch >= WARM_BATCHES:
                result.brackets_ms.append(bracket_ms)
                result.host_ms.append(host_ms)
        torch.cuda.synchronize()
        result.kept.extend((seed, slot) for seed, slot in zip(seeds, slots, strict=True) if seed is not None)
        result.calls += reservoir.seen

    def finish(self) -> None:
        self.role = "finish"
        try:
            self.send({"type": "finish"})
            self.expect("done")
        except (RoleFailed, ExecutionError):
            pass

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        process = self.process
        if process is not None:
            try:
                self.returncode = process.wait(EXIT_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self.returncode = None
            try:
                os.killpg(process.pid, 0)
                self.leftovers = True
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if process.poll() is None:
                process.kill()
                self.returncode = process.wait()
        for buffer in [*(b for one in self.sets for b in one), *self.outputs, self.flag, self.done]:
            if buffer is not None:
                buffer.close()


def run_role(session: Session, role: RoleResult, seed: int, first: Any) -> None:
    """Correctness call, CUPTI measurement, brackets (the null role: brackets only)."""
    try:
        session.set_role(role.name)
        if role.name != "null":
            session.bracketed([seed], [first])
            session.torch.cuda.synchronize()
            role.correctness = "committed"
            role.timing = session.measure(role)
        session.brackets(role, OUTPUTS_KEPT if role.name != "null" else 0)
    except RoleFailed as exc:
        role.error = exc.error
