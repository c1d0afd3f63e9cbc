"""What ``kcoral broker`` can be told, and what the broker decides from it.

:class:`BrokerSettings` is one frozen dataclass that the CLI fills from its flags (a field left out
keeps the same default as the flag left out); :func:`resolve` makes the broker's own decisions from
it (the sandbox for ``auto``, the default limits shared among the worker slots) once, for the CLI
and the tests alike.

Example::

    settings = resolve(BrokerSettings(fake_gpus=2, sandbox="auto"))  # SandboxUnavailable for "bubblewrap" without bwrap
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kcoral import protocol
from kcoral.broker.blobs import BlobStoreSettings
from kcoral.broker.intake import NEGOTIATION_TIMEOUT_SECONDS, IntakeSettings
from kcoral.keys import ClientKeys
from kcoral.service.auth import ServerSecurity
from kcoral.service.fairness import ORPHAN_GRACE_SECONDS, client_queue_limit, upload_bounds

# CPU workers where there are no GPUs: the host's cores, 1 to this many.
MAX_DEFAULT_CPU_WORKERS = 4
# Worker slots per real GPU unless told: with a CUDA context made ahead in each worker, the slots of
# a GPU overlap one program's context teardown and the next worker's context with the programs of
# the others (benchmarks/RESULTS.md, "Fresh GPU programs at the driver's floor"). Fake GPUs get one.
DEFAULT_WORKERS_PER_REAL_GPU = 4
SANDBOXES = ("auto", "bubblewrap", "none")
CUDA_CONTEXTS = ("eager", "lazy")
GPU_HANDOVERS = ("exit", "quiet")
MEMORY_CGROUPS = ("auto", "off")

# Default per-worker limits (see kcoral.worker.processes for how each is enforced). Generous for
# real work, tight enough that a runaway program fails with a message naming the limit before it
# starves the host: a parallel nvcc/ninja build on a large host runs a few hundred processes; no
# single file a kernel program writes (profiles, datasets) nears 16 GiB; 16384 descriptors are
# more than any program needs, and a descriptor leak then fails fast.
DEFAULT_MAX_PROCESSES = 1024
DEFAULT_MAX_FILE_BYTES = 16 << 30
DEFAULT_MAX_OPEN_FILES = 16384
# Memory: the workers together may use this share of the host's RAM, so that a memory bomb meets
# its worker's limit before the kernel's OOM killer picks a victim (the broker, perhaps). The floor
# keeps room for a CUDA context, which alone counts about 1.4 GiB of private memory.
DEFAULT_MEMORY_SHARE = 0.8
MIN_DEFAULT_MEMORY_BYTES = 4 << 30
# Workspace: the slots together may fill this share of the free disk under the run directory, so
# that one program cannot fill the host's disk; the cap keeps it a per-program bound on big disks.
DEFAULT_WORKSPACE_DISK_SHARE = 0.5
MAX_DEFAULT_WORKSPACE_BYTES = 64 << 30
MIN_DEFAULT_WORKSPACE_BYTES = 1 << 30
# The worker limits by name (kcoral.worker.limits), and those whose default is a fixed number.
LIMIT_NAMES = ("memory_bytes", "processes", "file_size_bytes", "open_files", "workspace_bytes")
FIXED_DEFAULT_LIMITS = {
    "processes": DEFAULT_MAX_PROCESSES,
    "file_size_bytes": DEFAULT_MAX_FILE_BYTES,
    "open_files": DEFAULT_MAX_OPEN_FILES,
}


def default_cpu_workers() -> int:
    """CPU workers where there are no GPUs: the host's cores, 1 to MAX_DEFAULT_CPU_WORKERS."""
    return max(1, min(MAX_DEFAULT_CPU_WORKERS, os.cpu_count() or 2))


@dataclass(frozen=True)
class BrokerSettings:
    """Everything ``kcoral broker`` can be told; the CLI fills it from flags."""

    listen: str = "tcp://127.0.0.1:5555"
    device: str = "auto"  # "gpu", "cpu" or "auto"
    gpus: tuple[int, ...] | None = None  # None: every local GPU
    fake_gpus: int = 0
    workers_per_gpu: int = 0  # 0: DEFAULT_WORKERS_PER_REAL_GPU per real GPU, 1 per fake one (resolve())
    workers: int = field(default_factory=default_cpu_workers)  # CPU workers where there are no GPUs
    # "bubblewrap": never run programs without the walls unless told to; "auto": bubblewrap where it
    # runs, none with a warning where it does not (resolve() decides); "none".
    sandbox: str = "bubblewrap"
    sandbox_reason: str = ""  # why there is none, when bubblewrap could not run (--sandbox auto)
    sandbox_readonly_paths: tuple[Path, ...] = ()
    max_programs_per_worker: int = 1
    # "eager": every worker on a real GPU makes its CUDA context as soon as it is forked, before its
    # program comes (the spare forked ahead too); "lazy": the program makes it, on its own time.
    cuda_context: str = "eager"
    # When the GPU lease of a finished program whose worker made a CUDA context goes back: "exit",
    # once the worker has exited (its context torn down); "quiet", once none of its processes can
    # run code any more, while the driver may still tear the context down.
    gpu_handover: str = "exit"
    # "auto": each worker in a memory cgroup of its own, held to the memory limit by the kernel,
    # where the cgroup v1 memory controller is writable (kcoral.worker.memory_cgroup); "off": the
    # zygote's samples alone.
    memory_cgroup: str = "auto"
    # Client sessions (kcoral.broker.sessions): one ends this long after its last program, and at
    # the end of the program running this long after its first; its GPU is the others' again then.
    session_idle_seconds: float = 10.0
    session_max_seconds: float = 300.0
    # None: <run_dir>/cache, which a temporary run dir takes with it when the broker stops; give
    # --cache-dir (or --run-dir) for a disk cache that survives a restart.
    cache_dir: Path | None = None
    cache_bytes: int = 1 << 30
    cache_disk_bytes: int = 32 << 30
    max_queued: int = 1024
    queue_timeout_seconds: float = 3600.0
    max_request_bytes: int = protocol.DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = protocol.DEFAULT_MAX_RESPONSE_BYTES
    # How long a program waits for a round of its missing blobs; it must cover their upload time.
    negotiation_timeout_seconds: float = NEGOTIATION_TIMEOUT_SECONDS
    # Blobs at least this large that are in the disk cache reach the worker as a path to map, not
    # as a frame: no copy through the broker's memory and the ipc socket.
    blob_path_min_bytes: int = 1 << 20
    run_dir: Path | None = None
    # Per-worker limits by LIMIT_NAMES; resolve() gives a missing one its default and drops a 0 (none).
    limits: dict[str, int] = field(default_factory=dict)
    preload: str = "numpy,torch"
    # Join a kcoral router at this nodes endpoint (kcoral/broker/upstream.py), as this node id.
    upstream: str | None = None
    node_id: str | None = None
    # Access (kcoral/service/auth.py, kcoral/service/fairness.py). Without security the broker
    # listens on loopback only, unless insecure_listen_any.
    security: ServerSecurity | None = None
    insecure_listen_any: bool = False
    upstream_keys: ClientKeys | None = None  # CURVE on the link to the router
    max_queued_per_client: int | None = None  # None: a fair share (kcoral.service.fairness)
    orphan_grace_seconds: float = ORPHAN_GRACE_SECONDS
    # Bytes of uploads in progress (programs still negotiating their blobs); None: twice
    # max_request_bytes in all, and max_request_bytes per client.
    max_upload_bytes: int | None = None
    max_upload_bytes_per_client: int | None = None
    # The largest frame a client may send (libzmq's MAXMSGSIZE on the client socket).
    max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES

    @property
    def client_queue_limit(self) -> int:
        return client_queue_limit(self.max_queued, self.max_queued_per_client)

    @property
    def upload_bounds(self) -> tuple[int, int]:
        """(in all, per client) bytes of uploads in progress."""
        return upload_bounds(self.max_request_bytes, self.max_upload_bytes, self.max_upload_bytes_per_client)

    def blob_store(self) -> BlobStoreSettings:
        """The blob store's part of these settings (the broker sets ``cache_dir`` where it is None)."""
        return BlobStoreSettings(
            memory_bytes=self.cache_bytes,
            disk_dir=self.cache_dir,
            disk_bytes=self.cache_disk_bytes,
            disk_writable_by_others=self.sandbox != "bubblewrap",
        )

    def intake(self, gpu_count: int) -> IntakeSettings:
        """Intake's part of these settings, on a host of ``gpu_count`` GPUs."""
        return IntakeSettings(
            gpu_count=gpu_count,
            max_queued=self.max_queued,
            max_request_bytes=self.max_request_bytes,
            negotiation_timeout_seconds=self.negotiation_timeout_seconds,
            blob_path_min_bytes=self.blob_path_min_bytes,
            sandboxed=self.sandbox == "bubblewrap",
            max_queued_per_client=self.client_queue_limit,
        )

    # HOST:PORT of the Prometheus endpoint (kcoral/service/metrics.py), or None for none.
    metrics_listen: str | None = None
    max_connections_per_address: int = 0  # kcoral.service.connections; 0: no cap


def resolve(settings: BrokerSettings) -> BrokerSettings:
    """The settings as the broker runs them: the sandbox decided, every worker limit given a value.

    ``sandbox="auto"`` becomes ``"bubblewrap"`` where bwrap runs, else ``"none"`` with the reason in
    ``sandbox_reason``; ``"bubblewrap"`` where bwrap cannot run raises
    :class:`~kcoral.sandbox.bubblewrap.SandboxUnavailable`. A limit left out of ``settings.limits``
    gets its default (memory and workspace: a share of the host's shared among the slots), and a
    limit of 0 means none and is dropped.
    """
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap

    unknown = sorted(set(settings.limits) - set(LIMIT_NAMES))
    if unknown:
        raise ValueError(f"unknown worker limits {unknown}; expected some of {', '.join(LIMIT_NAMES)}")
    if settings.sandbox not in SANDBOXES:
        raise ValueError(f"unknown sandbox {settings.sandbox!r}; expected one of {', '.join(SANDBOXES)}")
    sandbox, reason = settings.sandbox, settings.sandbox_reason
    if sandbox == "none":
        reason = reason or "--sandbox none was given"
    else:
        try:
            check_bwrap()
            sandbox = "bubblewrap"
        except SandboxUnavailable as exc:
            if sandbox == "bubblewrap":
                raise
            sandbox, reason = "none", f"--sandbox auto, and bubblewrap cannot run here: {exc}"
    for name, value, allowed in (
        ("cuda_context", settings.cuda_context, CUDA_CONTEXTS),
        ("gpu_handover", settings.gpu_handover, GPU_HANDOVERS),
        ("memory_cgroup", settings.memory_cgroup, MEMORY_CGROUPS),
    ):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")
    settings = dataclasses.replace(settings, workers_per_gpu=slots_per_gpu(settings))
    slots = slot_count(settings)
    limits = {**FIXED_DEFAULT_LIMITS, **settings.limits}
    if "memory_bytes" not in limits:
        limits["memory_bytes"] = default_memory_limit(slots)
    if "workspace_bytes" not in limits:
        limits["workspace_bytes"] = default_workspace_bytes(settings.run_dir, slots)
    return dataclasses.replace(
        settings,
        sandbox=sandbox,
        sandbox_reason=reason,
        limits={name: limits[name] for name in LIMIT_NAMES if limits.get(name)},
    )


def slots_per_gpu(settings: BrokerSettings) -> int:
    """Worker slots per GPU: as given, else DEFAULT_WORKERS_PER_REAL_GPU on real GPUs, 1 on fake ones."""
    if settings.workers_per_gpu:
        return settings.workers_per_gpu
    return 1 if settings.fake_gpus else DEFAULT_WORKERS_PER_REAL_GPU


def slot_count(settings: BrokerSettings) -> int:
    """The worker slots the broker will run, found before it starts (and without CUDA)."""
    per_gpu = slots_per_gpu(settings)
    if settings.fake_gpus:
        slots = settings.fake_gpus * per_gpu
    elif settings.gpus:
        slots = len(settings.gpus) * per_gpu
    else:
        # Counting device nodes finds the GPUs without initialising CUDA in this process.
        gpus = 0 if settings.device == "cpu" else len(list(Path("/dev").glob("nvidia[0-9]*")))
        slots = gpus * per_gpu if gpus else settings.workers
    return max(1, slots)


def default_memory_limit(slots: int) -> int:
    """DEFAULT_MEMORY_SHARE of the RAM divided among the worker slots."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(MIN_DEFAULT_MEMORY_BYTES, int(ram * DEFAULT_MEMORY_SHARE / slots))


def default_workspace_bytes(run_dir: Path | None, slots: int) -> int:
    """DEFAULT_WORKSPACE_DISK_SHARE of the free disk under the run directory, divided among the slots."""
    where = run_dir or Path(tempfile.gettempdir())
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    share = int(free * DEFAULT_WORKSPACE_DISK_SHARE / max(1, slots))
    return max(MIN_DEFAULT_WORKSPACE_BYTES, min(MAX_DEFAULT_WORKSPACE_BYTES, share))


__all__ = [
    "CUDA_CONTEXTS",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_OPEN_FILES",
    "DEFAULT_MAX_PROCESSES",
    "DEFAULT_WORKERS_PER_REAL_GPU",
    "GPU_HANDOVERS",
    "MEMORY_CGROUPS",
    "SANDBOXES",
    "BrokerSettings",
    "default_cpu_workers",
    "resolve",
    "slot_count",
    "slots_per_gpu",
]
