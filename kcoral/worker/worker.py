"""The worker: connect to the broker, execute programs, send results back.

A worker is a process forked by its slot's zygote (``kcoral.worker.zygote``). It creates its own zmq
context after the fork, says READY, executes one program (or more with
``--max-programs-per-worker``), and exits. The instructions themselves are executed by
:class:`kcoral.worker.interpreter.Interpreter`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

# kcoral.builtins brings every module the timer watches: imported here, in the zygote, arming the
# timer before a program costs about 1 ms instead of about 100 ms of imports in each worker.
import kcoral.builtins  # noqa: F401
from kcoral import protocol
from kcoral.timing.trust import arm_in_worker as arm_timer
from kcoral.worker import confinement, processes
from kcoral.worker.capture import OutputCapture, OutputFollower
from kcoral.worker.interpreter import Interpreter, LeaseChannel, describe_exception
from kcoral.worker.state import ProcessState, cuda_view_mismatch

# How long a worker waits for the broker before it takes the broker for gone.
BROKER_SILENCE_SECONDS = 3600.0


@dataclass(frozen=True)
class WorkerSettings:
    connect: str  # the broker's ipc:// endpoint for workers
    identity: str
    slot: int
    gpu: int | None
    workspace: Path
    max_programs: int = 1  # 0: reuse until retired


@dataclass
class ExecutionOutcome:
    body: dict[str, Any]
    frames: list[Any]
    retire: bool = False
    retire_reason: str = ""
    notes: dict[str, Any] = field(default_factory=dict)  # merged into the result's "worker" map


# --- one execution ------------------------------------------------------------------------------


def execute_program(
    request: dict[str, Any],
    blobs: Mapping[str, memoryview],
    workspace: Path,
    socket: zmq.Socket[bytes] | None,
    progress: Callable[[int], None] = lambda index: None,
    *,
    last: bool = False,
    follow_output: Callable[[str, int, str], None] | None = None,
    socket_lock: threading.Lock | None = None,
) -> ExecutionOutcome:
    """Execute one PROGRAM message in a fresh directory under ``workspace``; always clean up.

    A program that returns but leaves processes or threads running: its processes are killed
    before the result is sent, and the result's ``worker`` map says so, in
    ``leftover_processes`` (``"PID (name)"`` each) and ``leftover_threads`` (thread names), with
    ``reusable`` false and a ``retire_reason``: the worker is not used again. Its stdout and
    stderr stay exactly what it wrote.

    Unless this is the worker's ``last`` program, the process-wide state the program may change
    is put back afterwards (see :mod:`kcoral.worker.state`). A last program skips that: the worker
    exits anyway, and the snapshot would touch (and so copy, after the fork) megabytes of pages.
    """
    request_id = protocol.check_id(request.get("request_id"), "request_id")
    options = request.get("options") or {}
    gpu_ids = [int(g) for g in request.get("gpu_ids", [])]
    output_limit = int(options.get("output_limit_bytes", protocol.DEFAULT_OUTPUT_LIMIT_BYTES))
    run_dir = workspace / f"run-{request_id}"
    saved = None if last else ProcessState.capture()
    lease = LeaseChannel(socket, request_id, gpu_ids, socket_lock)
    interpreter = Interpreter(request, blobs, run_dir, lease, progress)
    interpreter.max_response_bytes = int(request.get("max_response_bytes", protocol.DEFAULT_MAX_RESPONSE_BYTES))
    capture = OutputCapture(run_dir / "output", output_limit)
    follower = OutputFollower(capture, follow_output) if follow_output is not None else contextlib.nullcontext()
    threads_before = set(threading.enumerate())
    start = time.monotonic()
    try:
        # First of all: in a sandbox, keep only this program's GPUs and drop every capability.
        refusal = confinement.confine(gpu_ids)
        for sub in ("work", "home", "tmp"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        os.environ.update(
            HOME=str(run_dir / "home"),
            TMPDIR=str(run_dir / "tmp"),
            KCORAL_REQUEST_ID=request_id,
            KCORAL_GPU_IDS=",".join(str(g) for g in gpu_ids),  # the host's indices, whatever CUDA calls them
        )
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            os.environ["CUDA_VISIBLE_DEVICES"] = confinement.visible_devices(gpu_ids)
        os.chdir(run_dir / "work")
        sys.path.insert(0, str(run_dir / "work"))
        if refusal is None and confinement.confined_to() is None:
            refusal = cuda_view_mismatch(gpu_ids)
        # The output follower's thread starts before the timer is armed: benchmark() counts the
        # threads started after arming as the program's, and this one is the worker's own.
        with follower:
            if gpu_ids and refusal is None:
                # Before any uploaded code runs, and after CUDA_VISIBLE_DEVICES is set (CUPTI may
                # initialise the driver): what benchmark() trusts (see kcoral.timing.trust).
                arm_timer()
            with capture:
                error = interpreter.execute() if refusal is None else protocol.error_map("unavailable", refusal)
        # Before reading the output: what the program left running may still be writing to it.
        leftover_processes = [p.describe() for p in processes.kill_descendants(os.getpid())]
        output = capture.read()
        elapsed_ms = (time.monotonic() - start) * 1000
        leftover = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        retire = bool(interpreter.retire_reason)
        body = protocol.program_result(
            request_id,
            error=error,
            results=interpreter.results,
            stdout=output.stdout,
            stderr=output.stderr,
            stdout_truncated=output.stdout_truncated,
            stderr_truncated=output.stderr_truncated,
            elapsed_ms=elapsed_ms,
            lease_wait_ms=interpreter.lease.times.wait_ms,
            lease_held_ms=interpreter.lease.times.held_ms,
            gpu_ids=gpu_ids,
        )
        reason = refusal or interpreter.retire_reason
        retire = retire or refusal is not None
        # A program that returns but leaves work running is reported in the result's "worker" map
        # (its output stays exactly what the program wrote); the worker is not used again.
        notes: dict[str, Any] = {}
        if leftover:
            notes["leftover_threads"] = leftover
            retire, reason = True, f"the program left threads running: {', '.join(leftover[:5])}"
        if leftover_processes:
            notes["leftover_processes"] = leftover_processes
            retire = True
            reason = f"the program left {len(leftover_processes)} process(es) running, now killed: " + ", ".join(
                leftover_processes[:5]
            )
        if error is not None:
            hint = processes.explain_limit_error(str(error.get("message")), processes.current_limits())
            if hint is not None:
                error["message"] = f"{error['message']} ({hint})"
        return ExecutionOutcome(body, interpreter.frames, retire, reason, notes)
    finally:
        if saved is not None:
            saved.restore(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def run_worker(settings: WorkerSettings) -> int:
    """The worker's main loop; returns the process exit code."""
    started_at = time.time()
    if os.environ.get("KCORAL_EAGER_CUDA") == "1":
        # A sandboxed worker confines itself to its slot's GPU first: the context is made there.
        if settings.gpu is not None and confinement.confine((settings.gpu,)) is None:
            os.environ["CUDA_VISIBLE_DEVICES"] = confinement.visible_devices((settings.gpu,))
        _create_cuda_context()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, settings.identity.encode())
    socket.setsockopt(zmq.LINGER, 10_000)  # results must reach the broker before exit
    socket.connect(settings.connect)
    socket.send_multipart(
        protocol.message(protocol.READY, {"slot": settings.slot, "pid": os.getpid(), "gpu": settings.gpu})
    )
    ready_at = time.time()
    if settings.gpu is not None:
        # While no program is here yet: the broker gives a program the slot's own GPU first.
        confinement.prepare((settings.gpu,))
    done = 0
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(int(BROKER_SILENCE_SECONDS * 1000)):
                return 0
            raw = socket.recv_multipart(copy=False)
            try:
                command, body, data = protocol.split_message([f.buffer for f in raw])
            except protocol.WireError:
                continue
            if command == protocol.DISCONNECT:
                return 0
            if command != protocol.PROGRAM:
                continue
            outcome = _execute_message(body, data, settings, socket)
            processes.note_progress(None)
            reusable = not outcome.retire and (settings.max_programs == 0 or done + 1 < settings.max_programs)
            outcome.body["worker"] = {
                "identity": settings.identity,
                "pid": os.getpid(),
                "slot": settings.slot,
                "reusable": reusable,
                "retire_reason": outcome.retire_reason,
                # Wall-clock times, for measuring how fast a slot gets a fresh worker.
                "started_at": started_at,
                "ready_at": ready_at,
                "finished_at": time.time(),
                "confinement_ms": confinement.confinement_ms(),  # None: not sandboxed with GPUs
                # The only GPUs this worker can serve again (None: any), see kcoral.worker.confinement.
                "gpu_view": _listed(confinement.confined_to()),
                **outcome.notes,
            }
            socket.send_multipart(protocol.message(protocol.RESULT, outcome.body, *outcome.frames), copy=False)
            done += 1
            if not reusable:
                return 0
    finally:
        socket.close()
        context.term()


def _listed(gpus: tuple[int, ...] | None) -> list[int] | None:
    return None if gpus is None else list(gpus)


def _create_cuda_context() -> None:
    """Create the CUDA context while idle, so that the first program does not wait for it.

    The zygote asks for this (``KCORAL_EAGER_CUDA=1``) only on slots with a real GPU. A failure
    here is not fatal: the program then meets the same error, with its own traceback.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.zeros(1, device="cuda")
    except Exception as exc:
        print(f"kcoral worker: no CUDA context while idle: {describe_exception(exc)}", file=sys.stderr, flush=True)


def _map_blob(path: Path) -> memoryview:
    """A large blob from the broker's disk cache, mapped copy-on-write rather than read.

    Its pages are the page cache's until the program writes to one, which then becomes private
    (the file is opened read-only, and it is read-only in the sandbox). The broker keeps the file
    pinned while the program runs; a mapping also outlives the file's removal.
    """
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return memoryview(bytearray())  # mmap refuses empty files
        return memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY))


class ProgramBlobs(Mapping[str, memoryview]):
    """A program's blobs by digest: the frames of its PROGRAM message, and the large blobs that
    the broker named by path in its disk cache.

    A path is mapped anew (copy-on-write) on every lookup, so two tensors made from one blob never
    share memory, and neither is copied until the program writes to it.
    """

    def __init__(self, frames: dict[str, memoryview], paths: dict[str, Path]) -> None:
        self._frames = frames
        self._paths = paths

    def __getitem__(self, digest: str) -> memoryview:
        path = self._paths.get(digest)
        return self._frames[digest] if path is None else _map_blob(path)

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self._frames), **dict.fromkeys(self._paths)})

    def __len__(self) -> int:
        return len(self._frames.keys() | self._paths.keys())


def _execute_message(
    body: dict[str, Any], data: list[Any], settings: WorkerSettings, socket: zmq.Socket[bytes]
) -> ExecutionOutcome:
    request_id = str(body.get("request_id", ""))
    try:
        digests = body.get("blobs", [])
        if not isinstance(digests, list) or len(digests) != len(data):
            raise protocol.WireError("PROGRAM blob list does not match its frames")
        frames = {protocol.check_digest(d): memoryview(f) for d, f in zip(digests, data)}
        named = body.get("blob_paths") or {}
        if not isinstance(named, dict):
            raise protocol.WireError("PROGRAM blob_paths must be a map")
        paths: dict[str, Path] = {}
        for digest, path in named.items():
            if not isinstance(path, str):
                raise protocol.WireError("PROGRAM blob_paths values must be paths")
            paths[protocol.check_digest(digest)] = Path(path)
            _map_blob(paths[digest])  # unreadable: fail now, as a program the worker cannot read
        blobs = ProgramBlobs(frames, paths)

        lock = threading.Lock()  # the output follower's thread shares the socket

        def progress(index: int) -> None:
            processes.note_progress(index)  # survives the worker, unlike a message still queued
            with lock:
                socket.send_multipart(protocol.message(protocol.PROGRESS, {"request_id": request_id, "index": index}))

        def output(stream: str, offset: int, text: str) -> None:
            body = {"request_id": request_id, "stream": stream, "offset": offset, "text": text}
            with lock:
                socket.send_multipart(protocol.message(protocol.PROGRESS, body))

        outcome = execute_program(
            body,
            blobs,
            settings.workspace,
            socket,
            progress,
            last=settings.max_programs == 1,
            follow_output=output,
            socket_lock=lock,
        )
        error = outcome.body.get("error")
        if isinstance(error, dict) and error.get("kind") == "response_too_large":
            # The broker refuses the whole response: do not send it the part that fitted.
            outcome.body["results"], outcome.frames = {}, []
        return outcome
    except (protocol.WireError, OSError, ValueError, TypeError) as exc:
        error = protocol.error_map("parse", f"the worker could not read the program: {exc}")
        return ExecutionOutcome(protocol.program_result(request_id, error=error), [])
