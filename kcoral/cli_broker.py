"""``kcoral broker``: its flags, the defaults of the worker limits, and the BrokerSettings built
from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog

from kcoral import protocol
from kcoral.cli_arguments import (
    EXIT_CONFIG,
    _absolute_path,
    _add_access_arguments,
    _add_max_request_bytes,
    _add_metrics_listen,
    _endpoint,
    _existing_path,
    _gpu_list,
    _HelpFormatter,
    _name_values,
    _node_id,
    _non_negative,
    _positive,
    _positive_seconds,
    _size,
)
from kcoral.cli_service import access_refusal, run_service, server_security, shared_settings

DEFAULT_BROKER_URL = "tcp://127.0.0.1:5555"

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


def add_broker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kcoral broker`` and its flags."""
    broker = sub.add_parser(
        "broker", help="serve programs on this host's GPUs (or CPUs)", formatter_class=_HelpFormatter
    )
    broker.add_argument(
        "--listen", type=_endpoint, default=DEFAULT_BROKER_URL, help="where clients connect, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--device", choices=("gpu", "cpu"), default=None, help="serve GPUs or CPU workers (default: GPUs if any)"
    )
    broker.add_argument("--gpus", type=_gpu_list, default=None, help="GPU indices to serve, e.g. 0,1 (default: all)")
    broker.add_argument("--fake-gpus", type=_non_negative, default=0, help="lease tokens on a CPU host")
    broker.add_argument("--workers-per-gpu", type=_positive, default=1, help="worker slots per GPU")
    broker.add_argument(
        "--workers", type=_positive, default=None, help="CPU workers when there are no GPUs (default: cores, 1 to 4)"
    )
    broker.add_argument(
        "--sandbox",
        choices=("auto", "bubblewrap", "none"),
        default="bubblewrap",
        help="isolate each worker with bubblewrap (the default: the broker refuses to start where bwrap "
        "cannot run), 'none' for no isolation, or 'auto' for bubblewrap where it runs and none, with a "
        "warning, where it does not",
    )
    broker.add_argument(
        "--sandbox-readonly-path",
        action="append",
        type=_existing_path,
        default=[],
        help="a host path that workers may read, at the same path (repeatable)",
    )
    broker.add_argument(
        "--max-programs-per-worker", type=_non_negative, default=1, help="programs a worker runs; 0: reuse workers"
    )
    broker.add_argument(
        "--cache-dir",
        type=_absolute_path,
        default=None,
        help="disk blob cache (default: RUN_DIR/cache, deleted with a temporary run dir; "
        "give this or --run-dir for a cache that survives a restart)",
    )
    broker.add_argument("--cache-bytes", type=_size, default=1 << 30, help="memory blob cache")
    broker.add_argument("--cache-disk-bytes", type=_size, default=32 << 30, help="disk blob cache")
    broker.add_argument("--max-queued", type=_positive, default=1024, help="programs waiting before 'busy'")
    broker.add_argument(
        "--queue-timeout", type=_positive_seconds, default=3600.0, help="seconds a program may wait to start"
    )
    _add_max_request_bytes(broker)
    broker.add_argument(
        "--max-response-bytes",
        type=_size,
        default=protocol.DEFAULT_MAX_RESPONSE_BYTES,
        help="data returned by one program",
    )
    broker.add_argument(
        "--negotiation-timeout",
        type=_positive_seconds,
        default=None,
        help="seconds a program waits for each round of its missing blobs (default 60)",
    )
    broker.add_argument(
        "--memory-limit",
        type=_size,
        default=None,
        help="private memory per worker, all its processes together; 0: none "
        "(default: 80%% of RAM shared among the slots, at least 4 GiB)",
    )
    broker.add_argument(
        "--max-processes",
        type=_non_negative,
        default=DEFAULT_MAX_PROCESSES,
        help=f"processes per worker, itself included; 0: none (default {DEFAULT_MAX_PROCESSES})",
    )
    broker.add_argument(
        "--max-file-bytes",
        type=_size,
        default=DEFAULT_MAX_FILE_BYTES,
        help="largest file a worker may write; 0: none (default 16 GiB)",
    )
    broker.add_argument(
        "--max-open-files",
        type=_non_negative,
        default=DEFAULT_MAX_OPEN_FILES,
        help=f"open files per worker process; 0: the inherited limit (default {DEFAULT_MAX_OPEN_FILES})",
    )
    broker.add_argument(
        "--max-workspace-bytes",
        type=_size,
        default=None,
        help="disk space one program's files may take in its workspace, checked several times a second; 0: "
        "none (default: half the free space of the run directory's disk shared among the slots, at most 64 GiB)",
    )
    broker.add_argument(
        "--run-dir", type=_absolute_path, default=None, help="sockets and workspaces (default: a temp dir)"
    )
    broker.add_argument(
        "--upstream", type=_endpoint, default=None, help="a router's nodes endpoint to join, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--node-id", type=_node_id, default=None, help="this host's name at the router (default: HOSTNAME:PORT)"
    )
    broker.add_argument(
        "--upstream-server-key",
        type=_existing_path,
        default=None,
        metavar="FILE",
        help="the router's public key file: CurveZMQ on the link to --upstream",
    )
    broker.add_argument(
        "--upstream-key",
        type=_existing_path,
        default=None,
        metavar="FILE",
        help="this node's secret key file for the link (default: --curve-secret-key)",
    )
    _add_access_arguments(broker)
    broker.add_argument(
        "--max-upload-bytes",
        type=_size,
        default=None,
        help="bytes of uploads in progress, all clients together (default: twice --max-request-bytes)",
    )
    broker.add_argument(
        "--max-upload-bytes-per-client",
        type=_size,
        default=None,
        help="bytes of uploads in progress per client (default: --max-request-bytes)",
    )
    _add_metrics_listen(broker)
    _name_values(broker)
    broker.set_defaults(run=run_broker)


def run_broker(args: argparse.Namespace) -> int:
    """``kcoral broker``: its settings from the flags, then serve until stopped."""
    from kcoral.broker.broker import NEGOTIATION_TIMEOUT_SECONDS, Broker, BrokerSettings
    from kcoral.broker.target import TargetError
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
    from kcoral.service.auth import ListenRefused, check_listen

    log = structlog.get_logger("kcoral.cli")

    def access() -> tuple[Any, Any]:
        security = server_security(args)
        # Checked again when the broker binds; here, before a run directory exists.
        check_listen(args.listen, secured=security is not None, insecure_listen_any=args.insecure_listen_any)
        return security, _upstream_keys(args)

    keys, failed = access_refusal("broker", access)
    if failed is not None:
        return failed
    security, upstream_keys = keys
    sandbox, sandbox_reason = args.sandbox, ""
    if sandbox == "none":
        sandbox_reason = "--sandbox none was given"
    else:
        try:
            check_bwrap()
            sandbox = "bubblewrap"
        except SandboxUnavailable as exc:
            if sandbox == "bubblewrap":  # never run programs without the walls unless told to
                log.error("broker_cannot_start", error=f"{exc} (or --sandbox auto to run without it here)")
                return EXIT_CONFIG
            sandbox, sandbox_reason = "none", f"--sandbox auto, and bubblewrap cannot run here: {exc}"
    workers = args.workers or max(1, min(4, (os.cpu_count() or 2)))
    limits = {
        "memory_bytes": args.memory_limit if args.memory_limit is not None else _default_memory_limit(args, workers),
        "processes": args.max_processes,
        "file_size_bytes": args.max_file_bytes,
        "open_files": args.max_open_files,
        "workspace_bytes": (
            args.max_workspace_bytes
            if args.max_workspace_bytes is not None
            else _default_workspace_bytes(args.run_dir, _slot_count(args, workers))
        ),
    }
    settings = BrokerSettings(
        **shared_settings(args, security),
        device=args.device or "auto",
        gpus=args.gpus,
        fake_gpus=args.fake_gpus,
        workers_per_gpu=args.workers_per_gpu,
        workers=workers,
        sandbox=sandbox,
        sandbox_reason=sandbox_reason,
        sandbox_readonly_paths=tuple(args.sandbox_readonly_path),
        max_programs_per_worker=args.max_programs_per_worker,
        cache_dir=args.cache_dir,
        cache_bytes=args.cache_bytes,
        cache_disk_bytes=args.cache_disk_bytes,
        max_response_bytes=args.max_response_bytes,
        negotiation_timeout_seconds=args.negotiation_timeout or NEGOTIATION_TIMEOUT_SECONDS,
        run_dir=args.run_dir,
        limits={k: v for k, v in limits.items() if v},
        upstream=args.upstream,
        node_id=args.node_id,
        upstream_keys=upstream_keys,
        max_upload_bytes=args.max_upload_bytes,
        max_upload_bytes_per_client=args.max_upload_bytes_per_client,
    )
    # The CLI makes the temporary run directory, so that it goes away however the broker ends
    # (a port in use, a sandbox that cannot start).
    temporary_run_dir = None if args.run_dir else Path(tempfile.mkdtemp(prefix="kcoral-"))
    settings = dataclasses.replace(settings, run_dir=args.run_dir or temporary_run_dir)
    try:
        return run_service("broker", lambda: Broker(settings), (TargetError, SandboxUnavailable, ListenRefused))
    finally:
        if temporary_run_dir is not None:
            shutil.rmtree(temporary_run_dir, ignore_errors=True)


def _default_memory_limit(args: argparse.Namespace, cpu_workers: int) -> int:
    """DEFAULT_MEMORY_SHARE of the RAM divided among the worker slots the broker will run."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(MIN_DEFAULT_MEMORY_BYTES, int(ram * DEFAULT_MEMORY_SHARE / _slot_count(args, cpu_workers)))


def _slot_count(args: argparse.Namespace, cpu_workers: int) -> int:
    """The worker slots the broker will run."""
    if args.fake_gpus:
        slots = args.fake_gpus * args.workers_per_gpu
    elif args.gpus:
        slots = len(args.gpus) * args.workers_per_gpu
    else:
        # Counting device nodes finds the GPUs without initialising CUDA in this process.
        gpus = 0 if args.device == "cpu" else len(list(Path("/dev").glob("nvidia[0-9]*")))
        slots = gpus * args.workers_per_gpu if gpus else cpu_workers
    return max(1, slots)


def _default_workspace_bytes(run_dir: Path | None, slots: int) -> int:
    """DEFAULT_WORKSPACE_DISK_SHARE of the free disk under the run directory, divided among the slots."""
    where = run_dir or Path(tempfile.gettempdir())
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    share = int(free * DEFAULT_WORKSPACE_DISK_SHARE / max(1, slots))
    return max(MIN_DEFAULT_WORKSPACE_BYTES, min(MAX_DEFAULT_WORKSPACE_BYTES, share))


def _upstream_keys(args: argparse.Namespace) -> Any:
    from kcoral.keys import ClientKeys, KeyFileError

    if args.upstream_server_key is None:
        if args.upstream_key is not None:
            raise KeyFileError("--upstream-key needs --upstream-server-key (the router's public key)")
        return None
    own = args.upstream_key or args.curve_secret_key
    if own is None:
        raise KeyFileError("--upstream-server-key needs this node's key pair: --upstream-key or --curve-secret-key")
    return ClientKeys.from_files(args.upstream_server_key, own)
