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
from kcoral.timing import seeds
from kcoral.timing.trust import arm_in_worker as arm_timer
from kcoral.worker import confinement, limits, processes
from kcoral.worker.capture import OutputCapture, OutputFollower
from kcoral.worker.interpreter import Interpreter, describe_exception
from kcoral.worker.lease import LeaseChannel
from kcoral.worker.rehearsal import rehearse
from kcoral.worker.result_bounds import bounded_result, failed_body
from kcoral.worker.run_directory import OUTPUT_DIRECTORY, RunDirectory
from kcoral.worker.state import ProcessState, cuda_view_mismatch

# How long a worker waits for the broker before it takes the broker for gone.
BROKER_SILENCE_SECONDS = 3600.0
READY_REPEAT_SECONDS = 5.0  # READY again this often until the first program comes
MAX_NAMES_REPORTED = 20  # leftover threads and processes named in a result
MAX_NAME_CHARS = 100  # a thread's name is the program's to choose, of any length
# The instruction now running goes to the broker at most this often (the broker reads at most 50
# PROGRESS a second of a worker, kcoral.broker.worker_messages): a program of many instructions
# does not flood the socket its RESULT used to share. The zygote's board has every index.
PROGRESS_INTERVAL_SECONDS = 0.02
RESULT_LINGER_MS = 10_000  # a RESULT must reach the broker before the worker goes on or exits


@dataclass(frozen=True)
class WorkerSettings:
    connect: str  # the broker's ipc:// endpoint for workers
    identity: str
    slot: int
    gpu: int | None
    workspace: Path
    max_programs: int = 1  # 0: reuse until retired
    # A pipe from the zygote: the worker says READY only once it is readable (see Zygote). None:
    # at once (a worker started on its own).
    go_fd: int | None = None
    # Make the CUDA context of the slot's GPU before READY (and, for a spare forked ahead, while
    # the program before it runs): the program then finds it made.
    eager_cuda: bool = False


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
    wipe_later: list[Callable[[], None]] | None = None,
    directories: RunDirectory | None = None,
    output_follower: OutputFollower | None = None,
) -> ExecutionOutcome:
    """Execute one PROGRAM message in a fresh directory under ``workspace``; always clean up.

    A program that returns but leaves processes or threads running: its processes are killed
    before the result is sent, and the result's ``worker`` map says so, in
    ``leftover_processes`` (``"PID (name)"`` each) and ``leftover_threads`` (thread names), with
    ``reusable`` false and a ``retire_reason``: the worker is not used again. Its stdout and
    stderr stay exactly what it wrote.

    Unless this is the worker's ``last`` program, the process-wide state the program may change
    is put back afterwards (see :mod:`kcoral.worker.state`) and the workspace emptied, its run
    directory kept for the next program (``directories``, :mod:`kcoral.worker.run_directory`). A
    last program skips both: the worker exits anyway (the zygote wipes the workspace after the
    exit), and the snapshot would touch (and so copy, after the fork) megabytes of pages.
    """
    request_id = protocol.check_id(request.get("request_id"), "request_id")
    options = request.get("options") or {}
    gpu_ids = [int(g) for g in request.get("gpu_ids", [])]
    output_limit = int(options.get("output_limit_bytes", protocol.DEFAULT_OUTPUT_LIMIT_BYTES))
    run_dir = workspace / f"run-{request_id}"
    directories = directories or RunDirectory(workspace)
    saved = None if last else ProcessState.capture()
    lease = LeaseChannel(socket, request_id, gpu_ids, socket_lock, request.get("grant"))
    interpreter = Interpreter(request, blobs, run_dir, lease, progress)
    interpreter.max_response_bytes = int(request.get("max_response_bytes", protocol.DEFAULT_MAX_RESPONSE_BYTES))
    capture = OutputCapture(run_dir / OUTPUT_DIRECTORY, output_limit)
    following: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if follow_output is not None:
        output_follower = output_follower or OutputFollower()
        output_follower.start()  # the worker's thread, before the threads of the program are told apart
        following = output_follower.following(capture, follow_output)
    threads_before = set(threading.enumerate())
    start = time.monotonic()
    try:
        # First of all: in a sandbox, keep only this program's GPUs and drop every capability.
        refusal = confinement.confine(gpu_ids)
        directories.make(run_dir, keep=not last)
        # One item at a time, not os.environ.update(): that is MutableMapping's, whose Mapping
        # check walks the ABC caches cold in a fresh worker (0.6 ms of a constant program's 3.3 on
        # the 2-core VM); an assignment is the path the spare's rehearsal has walked.
        for name, value in (
            ("HOME", str(run_dir / "home")),
            ("TMPDIR", str(run_dir / "tmp")),
            ("KCORAL_REQUEST_ID", request_id),
            ("KCORAL_GPU_IDS", ",".join(str(g) for g in gpu_ids)),  # the host's indices, whatever CUDA calls them
        ):
            os.environ[name] = value
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            os.environ["CUDA_VISIBLE_DEVICES"] = confinement.visible_devices(gpu_ids)
        os.chdir(run_dir / "work")
        sys.path.insert(0, str(run_dir / "work"))
        if refusal is None and confinement.confined_to() is None:
            refusal = cuda_view_mismatch(gpu_ids)
        # The output follower's thread starts before the timer is armed: benchmark() counts the
        # threads started after arming as the program's, and this one is the worker's own.
        seeds.forget()
        with following:
            # Before any uploaded code runs: the zygote armed the timer (see kcoral.timing.trust);
            # the threads alive now are the worker's own, not the program's.
            arm_timer()
            with capture:
                error = interpreter.execute() if refusal is None else protocol.error_map("unavailable", refusal)
        # Before reading the output: what the program left running may still be writing to it.
        leftover_processes = [p.describe() for p in processes.kill_descendants(os.getpid())]
        output = capture.read()
        elapsed_ms = (time.monotonic() - start) * 1000
        leftover = [
            str(t.name)[:MAX_NAME_CHARS] for t in threading.enumerate() if t not in threads_before and t.is_alive()
        ]
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
        body["provenance"] = program_claims()
        reason = refusal or interpreter.retire_reason
        retire = retire or refusal is not None
        # A program that returns but leaves work running is reported in the result's "worker" map
        # (its output stays exactly what the program wrote); the worker is not used again.
        notes: dict[str, Any] = {}
        if leftover:
            notes["leftover_threads"] = leftover[:MAX_NAMES_REPORTED]
            retire, reason = True, f"the program left threads running: {', '.join(leftover[:5])}"
        if leftover_processes:
            notes["leftover_processes"] = leftover_processes[:MAX_NAMES_REPORTED]
            retire = True
            reason = f"the program left {len(leftover_processes)} process(es) running, now killed: " + ", ".join(
                leftover_processes[:5]
            )
        if error is not None:
            hint = limits.explain_limit_error(str(error.get("message")), limits.current_limits())
            if hint is not None:
                error["message"] = f"{error['message']} ({hint})"
        interpreter.lease.note_end()
        return ExecutionOutcome(body, interpreter.frames, retire, reason, notes)
    finally:
        # The next program of this worker (reuse, or the client's session) finds the process state
        # put back and the workspace empty, as a fresh worker would: at once, or (``wipe_later``)
        # once the caller has sent the RESULT (the program's word), before it reads the next one.
        later = wipe_later.append if wipe_later is not None else lambda step: step()
        if saved is not None:
            later(lambda: saved.restore(run_dir))
        if not last:
            later(lambda: directories.wipe(run_dir))
        # A last program's directory goes with the slot's workspace, which the zygote wipes after
        # this process has exited and before the next worker is announced: off the program's path
        # (removing its five directories here took 5 to 25 ms before the RESULT on the loaded
        # 2-core VM, benchmarks/RESULTS.md, "Where a constant program's time goes").


def program_claims() -> dict[str, Any]:
    """What only the program's process can say of its run, for the result's ``provenance``: the
    seeds it noted and the CUDA version torch was built with. The broker takes these as the
    program's claims (they come from the process that ran its code)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    cuda = getattr(version, "cuda", None)
    return {"seeds": seeds.noted(), "torch_cuda": cuda if isinstance(cuda, str) else None}


def run_worker(settings: WorkerSettings) -> int:
    """The worker's main loop; returns the process exit code."""
    started_at = time.time()
    cuda_view: list[int] | None = None
    if settings.eager_cuda and settings.gpu is not None:
        # A sandboxed worker confines itself to its slot's GPU first: the context is made there.
        if confinement.confine((settings.gpu,)) is None:
            os.environ["CUDA_VISIBLE_DEVICES"] = confinement.visible_devices((settings.gpu,))
        if _create_cuda_context():
            cuda_view = [settings.gpu]  # the only GPU it can serve now (see state.cuda_view_mismatch)
    context_at = time.time()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, protocol.worker_id(settings.identity))
    socket.setsockopt(zmq.LINGER, 0)  # results go on sockets of their own (_send_result)
    socket.connect(settings.connect)
    # For the RESULTs (_send_result): made while no program is here, its sockets and threads
    # only after the first program; a reused worker keeps it for the next ones.
    results = zmq.Context()
    # While the slot's current program runs (a spare) or before READY: the pages the first
    # program's path writes, copied now rather than on that path (kcoral.worker.rehearsal).
    rehearse(program_claims)
    if settings.go_fd is not None:
        # A spare waits here, connected, while the program before it runs. EOF: the zygote is gone.
        announced = bool(os.read(settings.go_fd, 1))  # Python retries a read a signal interrupts
        os.close(settings.go_fd)
        if not announced:
            socket.close(linger=0)
            context.term()
            results.term()
            return 0
    follower = OutputFollower()  # the live output of every program of this worker
    follower.start()
    ready_body: dict[str, Any] = {"slot": settings.slot, "pid": os.getpid(), "gpu": settings.gpu}
    if cuda_view is not None:
        ready_body["gpu_view"] = cuda_view
    ready = protocol.message(protocol.READY, ready_body)
    socket.send_multipart(ready)
    ready_at = time.time()
    if settings.gpu is not None:
        # While no program is here yet: the broker gives a program the slot's own GPU first.
        confinement.prepare((settings.gpu,))
    done = 0
    directories = RunDirectory(settings.workspace)  # kept, emptied, between the programs of a reused worker
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    silent_since = time.monotonic()
    try:
        while True:
            if not poller.poll(int(READY_REPEAT_SECONDS * 1000)):
                if time.monotonic() - silent_since > BROKER_SILENCE_SECONDS:
                    return 0
                if done == 0:
                    # The broker forgets a READY it cannot place yet after a while (a spare's comes
                    # before the zygote announces it, which waits for the previous worker's exit).
                    socket.send_multipart(ready)
                continue
            silent_since = time.monotonic()
            raw = socket.recv_multipart(copy=False)
            program_at = time.time()
            try:
                command, body, data = protocol.split_message([f.buffer for f in raw])
            except protocol.WireError:
                continue
            if command != protocol.PROGRAM:
                continue
            # Dumpable from now on, so that the zygote's watchdog can read this process's memory
            # use; not before, while a spare beside the previous program (see the zygote).
            processes.set_dumpable(True)
            wipe_later: list[Callable[[], None]] = []
            threads_before = processes.thread_ids()
            try:
                outcome = _execute_message(body, data, settings, socket, wipe_later, directories, follower)
            except Exception as exc:  # a bug of ours, or a program that broke the worker's own state
                outcome = ExecutionOutcome(
                    failed_body(str(body.get("request_id", "")), "runtime", f"the worker failed: {exc!r}"),
                    [],
                    retire=True,
                    retire_reason="the worker failed",
                )
            executed_at = time.time()
            processes.note_progress(None)
            # A program of its client's session keeps the worker for the next one (the broker
            # decides whether it does: kcoral.broker.sessions).
            session = _in_session(body)
            reusable = not outcome.retire and (
                settings.max_programs == 0 or done + 1 < settings.max_programs or session
            )
            outcome.body["worker"] = {
                "identity": settings.identity,
                "pid": os.getpid(),
                "slot": settings.slot,
                "reusable": reusable,
                "retire_reason": outcome.retire_reason,
                # Wall-clock times, for measuring how fast a slot gets a fresh worker.
                "started_at": started_at,
                "context_at": context_at,  # its CUDA context made (eager), or started_at's moment
                "ready_at": ready_at,
                "program_at": program_at,  # its PROGRAM read
                "executed_at": executed_at,  # the program executed, its result not yet built
                "finished_at": time.time(),
                "confinement_ms": confinement.confinement_ms(),  # None: not sandboxed with GPUs
                # The only GPUs this worker can serve again (None: any), see kcoral.worker.confinement.
                "gpu_view": _listed(confinement.confined_to()),
                **outcome.notes,
            }
            packed, frames = bounded_result(outcome.body, outcome.frames)
            message = [protocol.VERSION, protocol.RESULT, packed, *frames]
            # The worker's own socket where no thread but the worker's is left (none of the
            # program's can use it then), else a connection of its own (_send_result).
            threads_after = processes.thread_ids()
            alone = threads_before is not None and threads_after is not None and threads_after <= threads_before
            on_own = _send_result(results, settings, done, message, wait=not reusable, own=socket if alone else None)
            done += 1
            if not reusable:
                if on_own:
                    _await_retirement()
                return 0
            for wipe in wipe_later:  # off the program's path: its RESULT is out
                wipe()
    finally:
        results.term()
        # What is still queued here is output and PROGRESS (the RESULT went on its own socket, or
        # on this one, closed then with a linger of its own): a program's flood of them is
        # dropped, not waited for.
        socket.close(linger=0)
        context.term()


def _send_result(
    context: zmq.Context[Any],
    settings: WorkerSettings,
    number: int,
    message: list[Any],
    *,
    wait: bool,
    own: zmq.Socket[Any] | None = None,
) -> bool:
    """Send a RESULT on the worker's own socket (``own``: the caller found no thread left but the
    worker's, so none of the program's can be sending on it), or else on a connection of its own
    (protocol.RESULT_IDENTITY_SEPARATOR), made now (after the program's last instruction): a
    program's threads that flood the worker's socket can neither delay it nor interleave with it
    (a zmq socket is not for two threads; ``tests/test_hostile.py``). The worker's socket is
    connected already: a new connection's handshake cost 1.2 ms of a fresh worker's RESULT on the
    2-core VM (``benchmarks/RESULTS.md``, "A fresh worker's RESULT"). ``context`` is for RESULTs
    on connections of their own (made while the worker was idle), so that ending it waits for
    nothing else; a RESULT on the worker's socket waits, at the worker's end, behind what the
    program itself queued there before it returned.

    ``wait``: on a connection of its own, end the context, which returns once the RESULT is
    delivered, so that the worker's exit cannot lose it (one message: the broker's queue for that
    connection cannot be full); on the worker's own socket, the caller waits for its kill with the
    socket open (_await_retirement). A worker that goes on (``wait`` false: its program reusable, so no thread
    or process of it is left) keeps the context for its next RESULT, whose connection it makes
    the same way; its I/O thread delivers this one while the worker waits for its next program,
    which the broker sends only once it has this RESULT. Making and ending a context per RESULT
    (its I/O and reaper threads) cost 0.6 ms of a session's program on the quiet 2-core VM, and
    3.6 ms under load (``benchmarks/RESULTS.md``, "Where a constant program's time goes"). A later
    program of the worker that closes the kept context's descriptors loses its own RESULT with the
    worker (its exit, or its timeout), as one that closes the worker's socket does; no other's."""
    if own is not None and not own.closed:  # a program may have closed it (tests/test_slot.py)
        try:
            own.send_multipart(message, copy=False)
        except zmq.ZMQError:
            pass  # not sent: on a connection of its own, below
        else:
            return True  # delivered while the socket stays open: _await_retirement
    result = context.socket(zmq.DEALER)
    identity = protocol.worker_id(settings.identity) + protocol.RESULT_IDENTITY_SEPARATOR + str(number).encode()
    result.setsockopt(zmq.IDENTITY, identity)
    result.setsockopt(zmq.LINGER, RESULT_LINGER_MS)
    result.connect(settings.connect)
    try:
        result.send_multipart(message, copy=False)
    finally:
        result.close()  # with RESULT_LINGER_MS: still delivered after the close
        if wait:
            context.term()  # returns once the RESULT is out (or RESULT_LINGER_MS is up)
    return False


def _await_retirement() -> None:
    """After a last RESULT on the worker's own socket: wait for the zygote's kill (the broker asks
    for it once it has read the RESULT), at most RESULT_LINGER_MS, with the socket open. What the
    program queued on that socket before it returned is ahead of the RESULT, and closing the socket
    (ending its context, or exiting) before the broker has read it all loses the RESULT: where the
    backlog fills the broker's queue for this connection, libzmq stops reading it, and what is
    still in the kernel when the connection closes is never read (``tests/test_slot.py``, progress
    floods: every such program, once the broker's queue was bounded at 1,000 messages; and
    ``tests/test_hostile.py``, a flood joined before the return). The socket's own I/O thread
    delivers it meanwhile."""
    time.sleep(RESULT_LINGER_MS / 1000)


def _in_session(body: dict[str, Any]) -> bool:
    """Whether a PROGRAM runs in its client's session (its options say so)."""
    options = body.get("options")
    return isinstance(options, dict) and options.get("session") is True


def _listed(gpus: tuple[int, ...] | None) -> list[int] | None:
    return None if gpus is None else list(gpus)


def _create_cuda_context() -> bool:
    """Create the CUDA context while idle, so that the program does not wait for it; whether one
    was made.

    The zygote asks for this (``--cuda-context eager``, the default) only on slots with a real GPU.
    A failure here is not fatal: the program then meets the same error, with its own traceback.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        # An allocation makes the context and launches nothing: no kernel of a spare's runs beside
        # another program's measurement (NVML counts a process that ran one as busy on the GPU),
        # and none is loaded before the program's timer registers CUPTI.
        torch.empty(1, device="cuda")
    except Exception as exc:
        print(f"kcoral worker: no CUDA context while idle: {describe_exception(exc)}", file=sys.stderr, flush=True)
        return False
    return bool(torch.cuda.is_initialized())


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
    body: dict[str, Any],
    data: list[Any],
    settings: WorkerSettings,
    socket: zmq.Socket[bytes],
    wipe_later: list[Callable[[], None]] | None = None,
    directories: RunDirectory | None = None,
    follower: OutputFollower | None = None,
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

        # The first index goes to the broker only once the program has run PROGRESS_INTERVAL_SECONDS:
        # a short program's whole run costs no PROGRESS (the board has its index all the same).
        sent_at = [time.monotonic()]

        def progress(index: int) -> None:
            processes.note_progress(index)  # survives the worker, unlike a message still queued
            now = time.monotonic()
            if now - sent_at[0] < PROGRESS_INTERVAL_SECONDS:
                return  # a program of many short instructions: its index is on the board all the same
            sent_at[0] = now
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
            last=settings.max_programs == 1 and not _in_session(body),
            follow_output=output,
            socket_lock=lock,
            wipe_later=wipe_later,
            directories=directories,
            output_follower=follower,
        )
        error = outcome.body.get("error")
        if isinstance(error, dict) and error.get("kind") == "response_too_large":
            # The broker refuses the whole response: do not send it the part that fitted.
            outcome.body["results"], outcome.frames = {}, []
        return outcome
    except (protocol.WireError, OSError, ValueError, TypeError) as exc:
        error = protocol.error_map("parse", f"the worker could not read the program: {exc}")
        return ExecutionOutcome(protocol.program_result(request_id, error=error), [])
