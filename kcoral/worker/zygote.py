"""The zygote: imports the heavy modules once, then forks one fresh worker at a time.

``import torch`` costs seconds on a GPU host; ``os.fork()`` of a process that already imported it
costs milliseconds. Once its memory is in huge pages the zygote has its forker make the workers
(:mod:`kcoral.worker.forker`): still its own children, made by a process that writes nothing
between two forks. The zygote never initialises CUDA, opens no zmq context and starts no threads,
so each forked worker begins clean and makes its own (see :mod:`kcoral.worker.children`).

It talks to the broker's supervisor through its standard streams, one JSON object a line:
commands on stdin, events on stdout (``alive`` once a second, by which the supervisor knows that
the zygote still watches), each with its fields in :mod:`kcoral.protocol.zygote_link`. An
``exited`` event's ``instruction_index`` is read from a page shared with the worker: one that dies
at once takes its unsent progress messages with it.

The zygote is the trusted side of the slot: the program in a worker can neither write to it nor
speak for it. A worker closes every inherited descriptor but its standard streams (pointed away
from the zygote's) and its go pipe before any program runs; the zygote is not dumpable. What the
zygote reports comes from the kernel: a worker's exit from its pidfd and ``waitpid``, its
processes from the process table. The next worker is forked ahead but announced only once the
previous one has exited, everything the program started is dead and the workspace is wiped, so no
program ever shares a slot with the one before it. The GPU lease goes back at ``exited``, or at
``gpu_free`` where the finished worker and all it started were killed holding no GPU device (or,
with ``--gpu-handover quiet``, once none of them can run code any more: see :meth:`Zygote.check_quiet`).

On a slot with a real GPU every worker makes its CUDA context as soon as it is forked
(``--cuda-context eager``, the default), the spare forked ahead too: a fresh program then finds
its context made, and the next worker's context is made while the program before it runs. A
slot whose last program did not take the GPU lease forks its next spares without one (such
programs then cost no context, made and torn down, on the GPU) until a program takes it again.

Nothing a worker starts outlives it: the zygote is a child subreaper, so whatever a worker leaves
behind (``setsid`` children, double-forked daemons) is re-parented to the zygote, and a child made
with ``clone(CLONE_PARENT)`` is the zygote's own child from the start. Every process below the
zygote but the spare belongs to the program that runs now: the watchdog counts and measures all of
them against the process and memory limits (see :mod:`kcoral.worker.processes` for why those two
are not rlimits alone), and kills all of them when the worker ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import secrets
import selectors
import signal
import sys
import time
from typing import Any

from kcoral.protocol.zygote_link import (
    ZygoteCommand,
    ZygoteEvent,
    ZygoteSettings,
    read_command_lines,
    worker_exit_fields,
    zygote_event_line,
)
from kcoral.worker import handover, huge_pages, limits, processes, workspace
from kcoral.worker.capture import prepare_output_files
from kcoral.worker.children import (
    FIRST_INHERITED_FD,
    PARENT_DEATH_SIGNAL,
    Child,
    SpareState,
    become_worker,
    close_go,
    close_inherited_descriptors,
    eager_cuda_possible,
    fit_to_serve,
    let_go,
    preload_for_workers,
)
from kcoral.worker.forker import FORKER_READY_SECONDS, Forker, ForkRequest
from kcoral.worker.memory_cgroup import WorkerCgroup, WorkerCgroupPool
from kcoral.worker.run_directory import OUTPUT_DIRECTORY, READY_NAME, RunDirectory
from kcoral.worker.watchdog import WATCH_INTERVAL_SECONDS, Watchdog

FAST_EXIT_SECONDS = 1.0
CRASH_LOOP_AFTER = 3  # this many fast, unexplained deaths in a row slow the forking down
CRASH_BACKOFF_FIRST_SECONDS = 0.1
MAX_FORK_BACKOFF_SECONDS = 5.0
RETIRE_GRACE_SECONDS = 5.0  # a worker the broker has the last result of has this long to exit
# With --gpu-handover quiet: how often a killed worker that holds a GPU device is looked at until
# none of its processes can run code (a /proc read per task, tens of microseconds).
QUIET_POLL_SECONDS = 0.002
ALIVE_INTERVAL_SECONDS = 1.0  # the supervisor takes a zygote silent for several of these for stuck
READ_CHUNK_BYTES = 65536
MAX_FREE_CGROUPS = 2  # exited workers' memory cgroups kept for the next forks of the slot
# The zygote's memory goes into huge pages (kcoral.worker.huge_pages) once it has forked this many
# workers, a piece at a time when no event waits: collapsing took 60 to 400 ms of the 2-core VM's
# CPU, which each fork and exit then saves about 5 ms of, and a slot that serves a handful of
# programs (a test's) never gains it back. Then it starts its forker (kcoral.worker.forker),
# which keeps those pages whole.
HUGE_PAGES_AFTER_FORKS = 8


def emit(event: ZygoteEvent, **fields: Any) -> None:
    os.write(1, zygote_event_line(event, **fields))


class Zygote:
    """Forks workers for one slot and reports their exits; one worker serves at a time.

    The ``current`` worker is the one the broker knows (announced with ``forked``). The next one is
    forked ahead as a ``spare`` as soon as the current one is announced (again at command ``busy``,
    the current one has a program, where that spare was lost, and at ``retire_worker``, the broker
    has its last result); where workers make their CUDA context while idle, the spare makes its own
    then, beside the current one (what that does to a measurement on the GPU:
    ``benchmarks/RESULTS.md``). A spare is unannounced and says nothing to the broker
    until the zygote writes to its go pipe, so the broker gives it nothing. Only once the current
    worker has exited, everything it started is dead and the workspace is wiped is the spare
    checked (:func:`~kcoral.worker.children.fit_to_serve`) and announced.

    Forked at the last result instead, the spare's fork (a few milliseconds for a process with
    torch mapped) stood between the worker's exit and the zygote seeing it, and so between a
    program's end and its GPU's next holder; forked when the program came, it still did for short
    programs. A worker that does not exit within RETIRE_GRACE_SECONDS of its last result is killed.
    """

    def __init__(self, settings: ZygoteSettings, *, eager_cuda: bool = False, private_ipc: bool = False) -> None:
        self.settings = settings
        self.eager_cuda = eager_cuda  # workers create their CUDA context as soon as forked (real GPUs only)
        self.lazy_next = False  # the broker asked for a worker without a CUDA context next
        self.programs_use_gpu = True  # the last program (as the broker saw it) took the GPU lease
        self.private_ipc = private_ipc  # the IPC namespace is the slot's own: System V objects go between programs
        self.watchdog = Watchdog(settings.limits, settings.workspace, private_ipc=private_ipc)
        self.runs = RunDirectory(settings.workspace, take_ready=False)  # the next worker's run directory
        self.collapse: huge_pages.Collapse | None = None  # under way: see HUGE_PAGES_AFTER_FORKS
        self.generation = 0
        self.stopping = False
        self.current: Child | None = None
        self.spare: Child | None = None
        self.selector = selectors.DefaultSelector()
        self.pending_input = b""
        self.crashes = 0
        self.next_alive = 0.0
        self.expected = SpareState.of_this_process(settings.limits)
        # While the forker's answer is awaited: the processes that became our children since the
        # request went (the clone among them, its pid not known yet), left to the spare's side.
        self.unanswered: set[int] = set()
        self.pid = os.getpid()
        self.parent = os.getppid()  # the broker, or the sandbox's init: PARENT_DEATH_SIGNAL is its death
        self.forker: Forker | None = None  # forks the workers once ready (kcoral.worker.forker)
        self.forker_due: int | None = None  # the fork at which a new one starts, after one was retired
        # The slot's directory in the broker's memory cgroup: each worker gets a cgroup of its own
        # in it, held to the memory limit by the kernel (kcoral.worker.memory_cgroup).
        memory_limit = settings.limits.get("memory_bytes") or 0
        self.cgroups = (
            WorkerCgroupPool(settings.memory_cgroup_fd, memory_limit, keep_free=MAX_FREE_CGROUPS)
            if memory_limit and settings.memory_cgroup_fd is not None
            else None
        )

    def serve(self) -> int:
        preload_for_workers(self.settings.preload)
        refusal = limits.memory_limit_refusal(self.settings.limits, limits.own_data_bytes())
        if refusal is not None:
            # Said once, not a worker crash after another (each one's thread could not start).
            emit(ZygoteEvent.REFUSED, slot=self.settings.slot, reason=refusal)
            return os.EX_CONFIG
        processes.set_process_name("kcoral-zygote")
        # Workers run as the same user: without this one of them could write the zygote's memory
        # through /proc/<zygote>/mem and so take over every later worker of the slot.
        processes.set_dumpable(False)
        processes.set_child_subreaper()
        # Not SIGKILL when the broker dies: we first take the worker's tree with us. Not SIGTERM
        # either: that one (and SIGINT, from a terminal) also reaches the whole process group when
        # a service manager stops the broker, and the broker, draining, still needs its workers.
        # The broker stops us through our stdin.
        processes.set_parent_death_signal(PARENT_DEATH_SIGNAL)
        signal.signal(PARENT_DEATH_SIGNAL, self._on_broker_death)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.set_blocking(0, False)  # a command read never waits, whatever woke us
        self.selector.register(0, selectors.EVENT_READ, "commands")
        emit(ZygoteEvent.READY, pid=os.getpid(), slot=self.settings.slot, eager_cuda=self.eager_cuda)
        while not self.stopping:
            if self.current is None:
                if self.crashes > CRASH_LOOP_AFTER:
                    time.sleep(
                        min(
                            MAX_FORK_BACKOFF_SECONDS,
                            CRASH_BACKOFF_FIRST_SECONDS * 2 ** (self.crashes - CRASH_LOOP_AFTER),
                        )
                    )
                self.clear_slot()
                self.announce_next()
                if self.cgroups is not None:
                    self.cgroups.tidy()
            self.wait_for_event()
        for child in self.children():
            self.kill(child, "")
        while self.current is not None or self.spare is not None:
            self.wait_for_event()
        self.clear_slot(ready=False)
        if self.cgroups is not None:
            self.cgroups.remove_all()
        if self.forker is not None:
            self.forker.close()
        return 0

    def clear_slot(self, *, ready: bool = True) -> None:
        """Empty what a program can leave in the slot: its workspace, System V IPC objects and
        (inside the sandbox) keys and POSIX message queues. ``ready``: make the next worker's run
        directory (READY_NAME): the one the last worker got, emptied and as made, where nothing
        in it stands in the way (:mod:`kcoral.worker.run_directory`), else a new one. Removing
        and making its five directories each time cost the zygote a sixth of its busy time on the
        2-core VM, and the worker its making on the program's path."""
        last_run = self.runs.find_made() if ready else None
        if last_run is not None:
            self.runs.wipe(last_run)  # kept where it can be (else everything goes), the rest removed
        else:
            self.wipe_workspace()
        if ready:
            try:
                self.runs.make(self.settings.workspace / READY_NAME)
            except OSError:  # a full disk, say: the next worker makes its own, as before
                self.wipe_workspace()
            else:
                prepare_output_files(self.settings.workspace / READY_NAME / OUTPUT_DIRECTORY)
        if self.cgroups is not None:
            self.cgroups.remove_leftovers({c.cgroup.name for c in self.children() if c.cgroup is not None})
        if self.private_ipc:
            workspace.remove_ipc_objects()
        if self.settings.sandboxed:
            workspace.clear_keyrings()
            workspace.remove_message_queues()

    def wipe_workspace(self) -> None:
        """Remove everything in the slot's workspace, the run directory made for the next worker
        included (the next one is made anew)."""
        self.runs = RunDirectory(self.settings.workspace, take_ready=False)
        workspace.wipe(self.settings.workspace)

    def children(self) -> list[Child]:
        return [c for c in (self.current, self.spare) if c is not None]

    def spared(self) -> set[int]:
        """The spare's pid and the forker's (and, while its answer is awaited, what became our
        child meanwhile): the processes below us that are not the running program's."""
        pids = {self.spare.pid} if self.spare is not None else set()
        if self.forker is not None:
            pids.add(self.forker.pid)
        return pids | self.unanswered

    def fork_worker(self, eager: bool | None = None) -> Child:
        """Fork a worker, eager (its CUDA context made at once) as the slot's setting and its last
        program say unless told."""
        eager = self.eager_cuda and self.programs_use_gpu if eager is None else eager
        self.generation += 1
        identity = self.new_identity()
        board = processes.ProgressBoard()
        sys.stdout.flush()
        sys.stderr.flush()
        go_read, go_write = os.pipe()
        cgroup = self.cgroups.take(identity) if self.cgroups is not None else None
        # It joins its cgroup itself, at once: migrating a process took a tenth of a busy
        # zygote's time on the 2-core VM (cgroup v1), which then held up the slot's next worker.
        cgroup_directory = cgroup.fd if cgroup is not None else None
        pid, handed = self._fork_by_forker(identity, eager, board, go_read, cgroup_directory)
        if pid is None and handed:
            # A clone the forker made before it stopped holds these and is connected under this
            # identity: one forked here gets its own (that clone reads the end of its go pipe
            # then, and exits without a word).
            identity = self.new_identity()
            os.close(go_read)
            os.close(go_write)
            board.let_go()
            board = processes.ProgressBoard()
            go_read, go_write = os.pipe()
        if pid is None:
            pid = os.fork()
            if pid == 0:
                become_worker(
                    self.settings,
                    identity,
                    self.pid,
                    board,
                    go_read,
                    eager_cuda=eager,
                    cgroup_directory=cgroup_directory,
                )
        os.close(go_read)
        board.let_go()
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None  # old kernels: wait_for_event polls instead
        # Its limits set from here as well as by itself: fit_to_serve compares them at once.
        for which, value in limits.rlimit_values(self.settings.limits).items():
            with contextlib.suppress(OSError):
                resource.prlimit(pid, which, value)
        child = Child(pid, identity, pidfd, time.monotonic(), board, go=go_write, eager=eager, cgroup=cgroup)
        if pidfd is not None:
            self.selector.register(pidfd, selectors.EVENT_READ, child)
        if cgroup is not None:
            self.selector.register(cgroup.events, selectors.EVENT_READ, cgroup)
        return child

    def start_forker(self) -> None:
        """Once our memory is in huge pages: the forker, which forks the workers once it says it is
        ready (its own memory collapsed too) and keeps those pages whole (:mod:`kcoral.worker.forker`)."""
        if self.forker is None and not self.stopping:  # Forker.start says where there can be none
            self.forker = Forker.start(self._start_forked_worker)
            if self.forker is not None:
                self.selector.register(self.forker.link, selectors.EVENT_READ, "forker")

    def on_forker_ready(self) -> None:
        """The forker's first word: ready (or its end)."""
        if self.forker is None:
            return
        self.selector.unregister(self.forker.link)
        if not self.forker.read_ready():
            self.retire_forker("it did not start")

    def new_identity(self) -> str:
        """A worker's identity: unguessable and never reused (inside a sandbox every zygote is pid
        2, and the broker only takes work-carrying READYs from the identity this zygote reports as
        forked)."""
        return f"w{self.settings.slot}-{self.generation}-{secrets.token_hex(8)}"

    def _fork_by_forker(
        self, identity: str, eager: bool, board: processes.ProgressBoard, go: int, cgroup_directory: int | None
    ) -> tuple[int | None, bool]:
        """The worker's pid, forked by the forker (None where there is none, any more), and
        whether the forker was handed the descriptors."""
        if self.forker is None or board.descriptor is None:
            return None, False
        if not self.forker.ready:
            if time.monotonic() - self.forker.started > FORKER_READY_SECONDS:
                self.retire_forker("it was not ready in time")  # stopped while it collapsed, say
            return None, False
        named = {"go": go, "board": board.descriptor}
        if cgroup_directory is not None:
            named["cgroup"] = cgroup_directory
        before = set(processes.children(self.pid)) if self.watchdog.watched else set()
        try:
            pid = self.forker.fork(
                ForkRequest(identity, eager, tuple(named)),
                list(named.values()),
                meanwhile=lambda: self._watch_while_forking(before),
                every=WATCH_INTERVAL_SECONDS,
            )
        finally:
            self.unanswered = set()
        if pid is None:
            self.retire_forker("it did not answer")  # gone, or stopped: a program can signal it
        return pid, True

    def _watch_while_forking(self, before: set[int]) -> None:
        """A watchdog sample while the forker's answer is not in. A program can stop the forker
        and then use the wait (up to FORKER_ANSWER_SECONDS), so its samples go on. What became our
        child since the request went is left out: the clone is among it, and its pid is not known
        yet (counted, its memory would be taken for the program's). A process the program makes
        our child meanwhile (``CLONE_PARENT``) is counted once the wait is over."""
        current = self.current
        if current is None or not self.watchdog.due(time.monotonic()):
            return
        self.unanswered = set(processes.children(self.pid)) - before
        self.watch(current)

    def retire_forker(self, why: str) -> None:
        """End the forker: we fork ourselves until a new one starts, HUGE_PAGES_AFTER_FORKS forks
        later (a program that ends every forker it can costs a fork a few programs, no more)."""
        if self.forker is None:
            return
        print(f"kcoral-zygote: forker {self.forker.pid} ended ({why}); forking here", file=sys.stderr)
        with contextlib.suppress(KeyError, ValueError):  # registered until its first word
            self.selector.unregister(self.forker.link)
        self.forker.close()
        self.forker = None
        self.forker_due = self.generation + HUGE_PAGES_AFTER_FORKS

    def _start_forked_worker(self, request: ForkRequest, descriptors: dict[str, int]) -> None:
        """In a worker the forker made (the zygote's child): become the worker; never returns."""
        board = processes.ProgressBoard.attach(descriptors["board"])
        become_worker(
            self.settings,
            request.identity,
            self.pid,
            board,
            descriptors["go"],
            eager_cuda=request.eager_cuda,
            cgroup_directory=descriptors.get("cgroup"),
        )

    def confirm_cgroup(self, child: Child) -> None:
        """See that a worker about to get its go is in its memory cgroup, before it has a program
        (whatever it forks later is then in it too): it joined right after its fork, and one forked
        just now may not have yet. Where it cannot be, it serves without one, as the FORKED event
        says."""
        cgroup = child.cgroup
        if cgroup is None or cgroup.holds(child.pid):
            return
        try:
            cgroup.join(child.pid)
        except OSError:
            child.cgroup = None
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(cgroup.events)
            cgroup.remove()

    def release_cgroup(self, child: Child) -> None:
        """The cgroup of a worker that has exited with all it started, back to the slot's pool."""
        cgroup, child.cgroup = child.cgroup, None
        if cgroup is None or self.cgroups is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(cgroup.events)
        self.cgroups.give_back(cgroup)

    def on_out_of_memory(self, cgroup: WorkerCgroup) -> None:
        """The kernel says a worker's processes asked for memory over the limit (they wait in the
        kernel): kill the program now, before a process of it that still runs can send a result."""
        if not cgroup.out_of_memory():
            return
        current, spare = self.current, self.spare
        if current is not None and current.cgroup is cgroup:
            self.kill(current, f"the zygote killed it: {cgroup.breach()}")
        elif spare is not None and spare.cgroup is cgroup:
            self.discard(spare)  # over the limit before any program: it cannot serve one
            self.spare = None
            emit(ZygoteEvent.SPARE_GONE, worker=spare.identity)

    def announce_next(self) -> None:
        """Make the spare (or, failing that, a new worker) the current one, and tell the broker."""
        spare, self.spare = self.spare, None
        lazy, self.lazy_next = self.lazy_next, False
        if spare is not None and lazy and spare.eager:
            self.discard(spare)  # its context serves the slot's GPU alone; the program needs others
            spare = None
        if spare is not None and not fit_to_serve(spare, self.expected):
            emit(ZygoteEvent.SPARE_DISCARDED, worker=spare.identity)
            self.discard(spare)
            spare = None
            # The program beside it may have changed the forker it came from (the same user can
            # change another's priority, CPUs or limits): the next ones come from us.
            self.retire_forker("a worker it made was not as forked")
        child = spare if spare is not None else self.fork_worker(eager=False if lazy else None)
        self.current = child
        self.confirm_cgroup(child)
        let_go(child)
        self.watchdog.program_may_start(time.monotonic())
        # Where the slot has memory cgroups, whether this worker is in one (its making can fail).
        cgroup = {"memory_cgroup": child.cgroup is not None} if self.cgroups is not None else {}
        emit(ZygoteEvent.FORKED, worker=child.identity, pid=child.pid, **cgroup)
        self.fork_spare_ahead()

    def fork_spare_ahead(self) -> None:
        """Fork the next worker now, while the current one waits for or runs its program: then no
        fork (and, on a GPU slot, no CUDA context) is under way when the current one exits (see the
        class's docstring)."""
        if self.spare is None and self.current is not None and not self.stopping:
            self.fork_spare()

    def fork_spare(self) -> None:
        """Fork the spare, and tell the broker its pid: its CUDA context on the slot's GPU is none
        of a program's (the broker tells the GPU's next lease holder so, see GRANT)."""
        self.spare = self.fork_worker()
        emit(ZygoteEvent.SPARE, worker=self.spare.identity, pid=self.spare.pid)
        if self.generation == HUGE_PAGES_AFTER_FORKS:
            # Once, a piece at a time whenever no event waits (wait_for_event); then the forker.
            self.collapse = huge_pages.Collapse()
        elif self.forker_due is not None and self.generation >= self.forker_due:
            self.forker_due = None
            self.start_forker()

    def discard(self, child: Child) -> None:
        """Kill and reap a spare that will not serve (it ran nothing: nothing to report)."""
        processes.kill_group(child.pid)
        close_go(child)
        if child.pidfd is not None:
            self.selector.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None
        try:
            os.waitpid(child.pid, 0)
        except ChildProcessError:
            pass
        self.release_cgroup(child)

    def wait_for_event(self) -> None:
        """Handle what happens next: a command, a worker's exit, a watchdog sample."""
        now = time.monotonic()
        timeout = max(0.0, self.next_alive - now)
        if any(c.pidfd is None for c in self.children()) or (self.current is not None and self.watchdog.watched):
            timeout = min(timeout, WATCH_INTERVAL_SECONDS)
        if self.current is not None and self.current.quiet_watch:
            timeout = min(timeout, QUIET_POLL_SECONDS)
        if self.collapse is not None:
            timeout = 0.0
        ready = self.selector.select(timeout=timeout)
        if not ready and self.collapse is not None and not self.collapse.step():
            self.collapse = None
            self.start_forker()
        for key, _ in ready:
            if key.data == "commands":
                self.read_commands()
            elif key.data == "forker":
                self.on_forker_ready()
            elif isinstance(key.data, WorkerCgroup):
                self.on_out_of_memory(key.data)
            else:
                self.on_exit(key.data)
        for child in self.children():
            if child.pidfd is None:
                self.on_exit(child)
        now = time.monotonic()
        current = self.current
        if current is not None and current.quiet_watch:
            self.check_quiet(current)
        if current is not None and current.done_at is not None and now - current.done_at > RETIRE_GRACE_SECONDS:
            self.kill(current, f"it did not exit within {RETIRE_GRACE_SECONDS:g} s of its last result")
        if current is not None and self.watchdog.due(now):
            self.watch(current)
        if now >= self.next_alive:
            self.next_alive = now + ALIVE_INTERVAL_SECONDS
            emit(ZygoteEvent.ALIVE)

    def on_exit(self, child: Child) -> None:
        if child is not self.current and child is not self.spare:
            return  # reported already, in the same round of events
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = child.pid, None
        if pid == 0:
            return  # not yet
        if child.pidfd is not None:
            self.selector.unregister(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = None
        close_go(child)
        if child is self.spare:
            self.spare = None  # killed before it served (by the program beside it, say)
            self.release_cgroup(child)
            emit(ZygoteEvent.SPARE_GONE, worker=child.identity)  # the broker asks for another
            return
        # Everything below us now but the spare is what the program left (we are the subreaper,
        # and children it made with CLONE_PARENT are ours from the start): kill all of it before
        # saying "exited".
        leftovers = processes.kill_descendants(os.getpid(), spare=self.spared())
        if child.cgroup is not None and not child.kill_reason and child.cgroup.oom_events():
            # Over the limit at its very end, after its event was last read: said all the same.
            child.kill_reason = child.cgroup.breach()
        self.current = None
        returncode = os.waitstatus_to_exitcode(status) if status is not None else None
        emit(
            ZygoteEvent.EXITED,
            **worker_exit_fields(
                child.identity,
                child.pid,
                returncode,
                leftovers_killed=len(leftovers),
                reason=child.kill_reason,
                instruction_index=child.board.read(),
            ),
        )
        self.release_cgroup(child)  # after the event: its removal is off the way to the next program
        # Only workers that die fast, unasked and unexplained (a broken install, a crash at
        # start-up) count: programs end workers all the time, and that must not slow us.
        crashed = (
            returncode not in (None, 0)
            and not child.kill_requested
            and not child.kill_reason
            and time.monotonic() - child.started < FAST_EXIT_SECONDS
        )
        self.crashes = self.crashes + 1 if crashed else 0

    def watch(self, child: Child) -> None:
        """One watchdog sample of the program's processes and workspace: kill it over a limit."""
        if child.kill_reason:
            return
        breach = self.watchdog.breach(spare=self.spared())
        if breach is not None:
            self.kill(child, f"the zygote killed it: {breach}")

    def kill(self, child: Child, reason: str) -> None:
        """Kill a worker; the current one with every other process below us but the spare.
        on_exit reaps it and reports."""
        if not child.kill_reason:
            child.kill_reason = reason
        processes.kill_group(child.pid)
        if child is self.current:  # the group kill got the bulk; kill_descendants in on_exit the rest
            processes.kill_below(os.getpid(), spare=self.spared())

    def end_without_gpu(self, child: Child) -> None:
        """The broker has the worker's last result: kill it and all it started now, and say
        ``gpu_free`` where the GPU lease may go back before the exit is through (kcoral.worker.handover)."""
        child.kill_requested = True
        self.kill(child, "")
        if self.settings.gpu is None:
            return  # a slot without a GPU has no lease to give back early (and reading every
            # process's maps for a device cost 6% of a busy zygote's time on the 2-core VM)
        # Walked again after the kill: what was forked during the kill's own walk is found too.
        free = handover.holds_no_gpu(child.pid, self.spared())
        if free is None:
            return  # some processes went unread: the exit decides
        if free:
            emit(ZygoteEvent.GPU_FREE, worker=child.identity)
        elif self.settings.gpu_handover == "quiet":
            child.quiet_watch = True
            self.check_quiet(child)

    def check_quiet(self, child: Child) -> None:
        """With ``--gpu-handover quiet``: say ``gpu_free`` (with ``teardown``) for a killed worker that
        still holds a GPU device once none of its processes can run code."""
        if handover.past_user_code(child.pid, self.spared()):
            child.quiet_watch = False
            after_ms = round((time.monotonic() - (child.done_at or 0.0)) * 1000, 2)
            emit(ZygoteEvent.GPU_FREE, worker=child.identity, teardown=True, after_ms=after_ms)

    def read_commands(self) -> None:
        try:
            chunk = os.read(0, READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        if not chunk:  # the broker is gone: stop, taking the workers with us
            self.selector.unregister(0)
            self.stop("the broker went away")
            return
        commands, self.pending_input = read_command_lines(self.pending_input + chunk)
        for command in commands:
            self.on_command(command)

    def on_command(self, command: dict[str, Any]) -> None:
        """One command from the broker (see the module's docstring)."""
        try:
            what = ZygoteCommand(str(command.get("cmd")))
        except ValueError:
            return
        # A command that names a worker is for that one alone: sent before it exited, it must
        # not end the successor the broker may already have given a program.
        named = command.get("worker")
        if named is not None and (self.current is None or named != self.current.identity):
            return
        if what is ZygoteCommand.KILL_WORKER and self.current is not None:
            if command.get("next") == "lazy" and self.eager_cuda:
                self.lazy_next = True
            self.current.kill_requested = True
            self.kill(self.current, "")
        elif what is ZygoteCommand.FORK_SPARE:
            self.fork_spare_ahead()  # where the one forked ahead was lost (killed, say)
        elif what is ZygoteCommand.RETIRE_WORKER and self.current is not None and not self.stopping:
            if isinstance(command.get("gpu"), bool):
                self.programs_use_gpu = command["gpu"]
            if self.current.done_at is None:
                self.current.done_at = time.monotonic()
                self.end_without_gpu(self.current)
            spare = self.spare
            if spare is not None and self.programs_use_gpu and self.eager_cuda and not spare.eager:
                # Forked ahead without a context while programs did not use the GPU: this one did.
                self.discard(spare)
                self.spare = None
            if self.spare is None:
                self.fork_spare()
        elif what is ZygoteCommand.STOP:
            self.stop("")

    def stop(self, reason: str) -> None:
        self.stopping = True
        for child in self.children():
            child.kill_requested = True
            self.kill(child, reason)

    def _on_broker_death(self, signum: int, frame: Any) -> None:
        if os.getppid() == self.parent:
            return  # not the kernel's: a program sent it (we are re-parented before that one comes)
        self.stop("the broker went away")


def main(argv: list[str] | None = None) -> int:
    settings = ZygoteSettings.from_argv(argv)
    # The slot's memory cgroup, the one descriptor the broker passes on purpose: kept, at the first
    # inherited number (a worker's own close, which keeps only its go pipe there, closes it).
    close_inherited_descriptors(keep=settings.memory_cgroup_fd)
    if settings.memory_cgroup_fd is not None:
        settings = dataclasses.replace(settings, memory_cgroup_fd=FIRST_INHERITED_FD)
    zygote = Zygote(
        settings,
        eager_cuda=settings.cuda_context == "eager" and eager_cuda_possible(settings.gpu),
        # Without a sandbox, one of our own where we may make it (root): else the host's, shared.
        private_ipc=settings.sandboxed or workspace.private_ipc_namespace(),
    )
    return zygote.serve()


if __name__ == "__main__":
    sys.exit(main())
