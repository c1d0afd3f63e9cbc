"""The trusted side of ``kcoral remote``: runs in the worker, never loads the candidate's code, and
makes every number of the report itself.

The candidate's process (``kcoral.workloads.runner``) starts with nothing: no argument, no seed, no
path or descriptor of the harness but its standard input, a socket over which the harness says what
to do next (its standard output and error go to the harness's standard error). The harness keeps:

- the seeds (fresh from ``secrets`` for every call) and every call's inputs, made in its own process
  and memory. Just before a call it copies them into buffers shared with the candidate's process
  (``kcoral.workloads.ipc``, one driver allocation each: nothing else of the harness is visible);
- the clock. Each *bracketed* batch: the candidate's process queues its calls behind a gate (a
  stream wait on a shared word) and says so; the harness then records its start event, copies the
  inputs in, flushes the L2 cache, opens the gate, waits (on its own stream) for the candidate's
  completion word, copies the outputs into its own memory and records its end event
  (``kcoral.workloads.bracket`` says why this holds the calls' GPU work). The null role calibrates
  the fixed overhead in the same run;
- the outputs. Each bracketed call's output is committed (copied into the harness's memory) inside
  its bracket; whether it is kept for the check is decided after the call, by the harness's own
  random draw (reservoir sampling of ``OUTPUTS_KEPT`` of the (``WARM_BATCHES`` +
  ``BRACKET_BATCHES``) x ``batch`` calls: 16 of 448 for the shipped workloads), so no call can know
  it. The calls the candidate's own timer makes hand their outputs over too, and 16 of those are
  kept the same way. All kept outputs are checked here, against this process's reference for the
  seed, after the candidate's process is done with the GPU. A candidate whose outputs are stale in
  half of the calls passes with probability 0.5 ** OUTPUTS_KEPT (1.5e-5);
- the judgement. The candidate's own CUPTI figure (``benchmark``'s timer in its process, fed with
  fresh harness inputs) is the reported time only where it agrees with the bracket; otherwise the
  role is ``suspect`` and the bracket is its time. A suspect baseline makes the speedup suspect.

Order: the baseline (correctness call, CUPTI measurement, brackets), then the null role's brackets,
both before the candidate is imported; then the candidate the same way.

The report (``evaluate``): ``correct``, ``check`` and ``baseline_check``, ``timing`` and ``baseline``
(the CUPTI report's fields, ``latency_ms_median`` being the reported time, with
``latency_ms_median_cupti``, ``time_source`` and ``bracket``), ``null``, ``speedup``, ``integrity``
(verdict and reasons), ``workload``, ``seed`` (the correctness call's), ``error``. A candidate's
process that breaks the harness's protocol fails the instruction with ``integrity``.
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
from kcoral.timing.findings import verdict
from kcoral.workloads import bracket
from kcoral.workloads.channel import ChannelError, MessageReader, deadline_after, send_message
from kcoral.workloads.format import Workload, load_workload
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
TIMING_FIELDS: Final = (
    "latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max", "latency_ms_std",
    "host_ms_median", "host_ms_min", "host_ms_max", "method", "cupti_error", "warmup", "repeat",
    "activities_stable", "activities_per_call", "launch_hold", "inputs", "outputs_checked",
    "sm_clock_mhz_after", "throttled", "gpu", "integrity", "integrity_details", "latency_measure",
)  # fmt: skip


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


def _check(workload: Workload, torch: Any, output: Any, seed: int) -> str | None:
    """None when ``output`` is right for ``seed``; otherwise why not."""
    expected = workload.reference(*workload.inputs(seed))
    try:
        workload.verify(torch, output, expected)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:600]}"
    return None


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


def check_role(workload: Workload, torch: Any, role: RoleResult, seed: int, first: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"correctness_call": None, "timed_outputs_checked": 0, "failures": []}
    if role.error is not None:
        section["failures"].append(f"{role.error.get('kind')}: {role.error.get('message')}")
    if role.correctness == "committed":
        problem = _check(workload, torch, first, seed)
        section["correctness_call"] = "pass" if problem is None else problem
        if problem is not None:
            section["failures"].append(f"correctness call: {problem}")
    elif role.error is None:
        section["failures"].append("no output of the correctness call was committed")
    for kept_seed, output in role.kept:
        problem = _check(workload, torch, output, kept_seed)
        section["timed_outputs_checked"] += 1
        if problem is not None:
            section["failures"].append(f"a timed call's committed output: {problem}")
    if role.error is None and not role.kept:
        section["failures"].append("no output of a timed call was committed")
    failures = section["failures"]
    if len(failures) > 4:
        section["failures"] = [*failures[:4], f"... and {len(failures) - 4} more"]
    section["failures_total"] = len(failures)
    return section


def _cupti_ms(timing: dict[str, Any] | None) -> float | None:
    value = (timing or {}).get("latency_ms_median")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timing_section(
    role: RoleResult, null: bracket.BracketSummary | None, baseline: dict[str, Any] | None, gated: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's timing section of one role and the reasons that make it suspect."""
    timing = role.timing
    if timing is None or not role.brackets_ms:
        return None, []
    section = {key: timing.get(key) for key in TIMING_FIELDS}
    own = [str(r) for r in ((timing.get("integrity") or {}).get("reasons") or []) if isinstance(r, str)]
    reasons = bracket.timer_reasons(own, timing, baseline if role.name == "candidate" else timing)
    summary = bracket.BracketSummary.of(role.brackets_ms, role.host_ms)
    section["latency_ms_median_cupti"] = _cupti_ms(timing)
    described: dict[str, Any] = {**summary.describe(), "gated": gated, "calls_committed": role.calls}
    section["bracket"] = described
    if null is None:
        reasons.append("the null call was not bracketed: the bracket has no calibration")
        section["latency_ms_median"] = max(summary.median_ms, _cupti_ms(timing) or 0.0)
        section["time_source"] = bracket.TIME_BRACKET
    else:
        judgement = bracket.judge(summary, null, _cupti_ms(timing))
        described.update(judgement.describe())
        described["null_median_ms"] = round(null.median_ms, 6)
        section["latency_ms_median"] = judgement.time_ms
        section["time_source"] = judgement.time_source
        if judgement.reason:
            reasons.append(judgement.reason)
    section["integrity"] = verdict(reasons)
    return section, reasons


def report_reasons(
    reasons: list[str],
    baseline_reasons: list[str],
    *,
    null_error: dict[str, Any] | None = None,
    gate_error: str | None = None,
    leftovers: bool = False,
) -> list[str]:
    """The report's integrity reasons: the evaluated role's, then what makes its comparison or the
    whole run suspect (a suspect baseline makes the speedup suspect)."""
    combined = list(reasons)
    if baseline_reasons:
        combined.append(f"the baseline's measurement is suspect, and with it the speedup: {baseline_reasons[0]}")
    if null_error is not None:
        combined.append(f"the null call failed: {null_error.get('message')}")
    if gate_error is not None:
        combined.append(
            f"the gate (a stream wait on shared memory) is not available here ({gate_error}): "
            "the brackets include the host's launch time"
        )
    if leftovers:
        combined.append("the candidate's process left processes running; they were killed")
    return combined


def evaluate(folder: str, candidate: str | None, timeout_s: float, command: list[str] | None = None) -> dict[str, Any]:
    """Evaluate ``candidate`` (a file in the working directory; None: the baseline alone)."""
    import torch

    workload = load_workload(folder)
    candidate_path = Path(candidate).resolve() if candidate else None
    if candidate_path is not None and not candidate_path.is_file():
        raise ExecutionError("parse", f"the candidate {candidate} was not sent (no such file)")
    seed = fresh_seed()
    first_inputs = workload.inputs(seed)
    expected = workload.reference(*first_inputs)
    session = Session(torch, workload, candidate_path, timeout_s, command)
    roles = {name: RoleResult(name) for name in ("baseline", "null", "candidate")}
    try:
        session.start(first_inputs, expected)
        firsts = {name: torch.empty_like(expected) for name in ("baseline", "candidate")}
        del first_inputs
        run_role(session, roles["baseline"], seed, firsts["baseline"])
        run_role(session, roles["null"], seed, None)
        if candidate_path is not None and roles["baseline"].error is None:
            run_role(session, roles["candidate"], seed, firsts["candidate"])
        session.finish()
    finally:
        session.close()
    torch.cuda.synchronize()
    evaluated = "candidate" if candidate_path is not None else "baseline"
    mine = roles[evaluated]
    if mine.error is not None and mine.error.get("kind") == "integrity":
        raise ExecutionError("integrity", f"{evaluated}: {mine.error.get('message')}")
    checks = {
        name: check_role(workload, torch, roles[name], seed, firsts[name])
        for name in ("baseline", "candidate")
        if name == "baseline" or candidate_path is not None
    }
    null = bracket.BracketSummary.of(roles["null"].brackets_ms) if roles["null"].brackets_ms else None
    baseline_timing, baseline_reasons = timing_section(roles["baseline"], null, None, session.gated)
    timing, reasons = (
        timing_section(mine, null, roles["baseline"].timing, session.gated)
        if evaluated == "candidate"
        else (baseline_timing, list(baseline_reasons))
    )
    reasons = report_reasons(
        reasons,
        baseline_reasons if evaluated == "candidate" else [],
        null_error=roles["null"].error,
        gate_error=None if session.gated else session.gate_error or "unknown",
        leftovers=session.leftovers,
    )
    baseline_ms = (baseline_timing or {}).get("latency_ms_median")
    candidate_ms = (timing or {}).get("latency_ms_median")
    correct = all(not section["failures"] for section in checks.values()) and timing is not None
    return {
        "workload": workload.name,
        "seed": seed,
        "evaluated": evaluated,
        "correct": correct,
        "check": checks[evaluated],
        "baseline_check": checks["baseline"] if evaluated != "baseline" else None,
        "timing": timing,
        "baseline": baseline_timing,
        "null": bracket.BracketSummary.describe(null) if null is not None else None,
        "speedup": bracket.speedup(baseline_ms, candidate_ms),
        "outputs_kept": OUTPUTS_KEPT,
        "integrity": verdict(reasons),
        "error": mine.error,
    }
