"""``kcoral broker``: its flags and the BrokerSettings built from them (what the broker decides
from those, the sandbox and the default limits included, is :func:`kcoral.broker.settings.resolve`)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog

from kcoral import protocol
from kcoral.broker.intake import NEGOTIATION_TIMEOUT_SECONDS
from kcoral.broker.settings import (
    CUDA_CONTEXTS,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_OPEN_FILES,
    DEFAULT_MAX_PROCESSES,
    DEFAULT_WORKERS_PER_REAL_GPU,
    GPU_HANDOVERS,
    MEMORY_CGROUPS,
    SANDBOXES,
    BrokerSettings,
)
from kcoral.cli.arguments import (
    EXIT_CONFIG,
    HelpFormatter,
    absolute_path,
    add_max_request_bytes,
    add_service_arguments,
    endpoint,
    existing_path,
    gpu_list,
    node_id,
    non_negative,
    positive,
    positive_seconds,
    size,
)
from kcoral.cli.service import access_refusal, run_service, server_security, shared_settings
from kcoral.units import format_bytes

DEFAULT_BROKER_URL = "tcp://127.0.0.1:5555"


def add_broker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kcoral broker`` and its flags."""
    broker = sub.add_parser(
        "broker", help="serve programs on this host's GPUs (or CPUs)", formatter_class=HelpFormatter
    )
    broker.add_argument(
        "--listen", type=endpoint, default=DEFAULT_BROKER_URL, help="where clients connect, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--device", choices=("gpu", "cpu"), default=None, help="serve GPUs or CPU workers (default: GPUs if any)"
    )
    broker.add_argument("--gpus", type=gpu_list, default=None, help="GPU indices to serve, e.g. 0,1 (default: all)")
    broker.add_argument("--fake-gpus", type=non_negative, default=0, help="lease tokens on a CPU host")
    broker.add_argument(
        "--workers-per-gpu",
        type=positive,
        default=None,
        help=f"worker slots per GPU (default: {DEFAULT_WORKERS_PER_REAL_GPU} per real GPU, 1 per fake one)",
    )
    broker.add_argument(
        "--workers", type=positive, default=None, help="CPU workers when there are no GPUs (default: cores, 1 to 4)"
    )
    broker.add_argument(
        "--sandbox",
        choices=SANDBOXES,
        default="bubblewrap",
        help="isolate each worker with bubblewrap (the default: the broker refuses to start where bwrap "
        "cannot run), 'none' for no isolation, or 'auto' for bubblewrap where it runs and none, with a "
        "warning, where it does not",
    )
    broker.add_argument(
        "--sandbox-readonly-path",
        action="append",
        type=existing_path,
        default=[],
        help="a host path that workers may read, at the same path (repeatable)",
    )
    broker.add_argument(
        "--max-programs-per-worker", type=non_negative, default=1, help="programs a worker runs; 0: reuse workers"
    )
    broker.add_argument(
        "--session-idle",
        type=positive_seconds,
        default=10.0,
        help="a client session ends this long after its last program (its GPU is the others' again)",
    )
    broker.add_argument(
        "--session-max",
        type=positive_seconds,
        default=300.0,
        help="a client session ends with the program running this long after its first",
    )
    broker.add_argument(
        "--cuda-context",
        choices=CUDA_CONTEXTS,
        default=CUDA_CONTEXTS[0],
        help="eager: each worker on a real GPU makes its CUDA context before its program comes (the "
        "next one while the program before it runs); lazy: the program makes it",
    )
    broker.add_argument(
        "--gpu-handover",
        choices=GPU_HANDOVERS,
        default=GPU_HANDOVERS[0],
        help="when a finished program's GPU lease goes back where its worker made a CUDA context: at "
        "the worker's exit (its context torn down), or as soon as none of its processes can run code",
    )
    broker.add_argument(
        "--cache-dir",
        type=absolute_path,
        default=None,
        help="disk blob cache (default: RUN_DIR/cache, deleted with a temporary run dir; "
        "give this or --run-dir for a cache that survives a restart)",
    )
    broker.add_argument("--cache-bytes", type=size, default=1 << 30, help="memory blob cache")
    broker.add_argument("--cache-disk-bytes", type=size, default=32 << 30, help="disk blob cache")
    broker.add_argument("--max-queued", type=positive, default=1024, help="programs waiting before 'busy'")
    broker.add_argument(
        "--queue-timeout", type=positive_seconds, default=3600.0, help="seconds a program may wait to start"
    )
    add_max_request_bytes(broker)
    broker.add_argument(
        "--max-response-bytes",
        type=size,
        default=protocol.DEFAULT_MAX_RESPONSE_BYTES,
        help="data returned by one program",
    )
    broker.add_argument(
        "--negotiation-timeout",
        type=positive_seconds,
        default=None,
        help="seconds a program waits for each round of its missing blobs (default 60)",
    )
    broker.add_argument(
        "--memory-limit",
        type=size,
        default=None,
        help="private memory per worker, all its processes together; 0: none "
        "(default: 80%% of RAM shared among the slots, at least 4 GiB)",
    )
    broker.add_argument(
        "--memory-cgroup",
        choices=MEMORY_CGROUPS,
        default=MEMORY_CGROUPS[0],
        help="auto: each worker in a memory cgroup of its own where the cgroup v1 memory controller is "
        "writable (the kernel then holds all its processes to --memory-limit, however short their bursts); "
        "off: the watchdog's 50 ms samples alone",
    )
    broker.add_argument(
        "--max-processes",
        type=non_negative,
        default=None,
        help=f"processes per worker, itself included; 0: none (default {DEFAULT_MAX_PROCESSES})",
    )
    broker.add_argument(
        "--max-file-bytes",
        type=size,
        default=None,
        help=f"largest file a worker may write; 0: none (default {format_bytes(DEFAULT_MAX_FILE_BYTES)})",
    )
    broker.add_argument(
        "--max-open-files",
        type=non_negative,
        default=None,
        help=f"open files per worker process; 0: the inherited limit (default {DEFAULT_MAX_OPEN_FILES})",
    )
    broker.add_argument(
        "--max-workspace-bytes",
        type=size,
        default=None,
        help="disk space one program's files may take in its workspace, checked several times a second; 0: "
        "none (default: half the free space of the run directory's disk shared among the slots, at most 64 GiB)",
    )
    broker.add_argument(
        "--run-dir", type=absolute_path, default=None, help="sockets and workspaces (default: a temp dir)"
    )
    broker.add_argument(
        "--upstream", type=endpoint, default=None, help="a router's nodes endpoint to join, tcp://HOST:PORT"
    )
    broker.add_argument(
        "--node-id", type=node_id, default=None, help="this host's name at the router (default: HOSTNAME:PORT)"
    )
    broker.add_argument(
        "--upstream-server-key",
        type=existing_path,
        default=None,
        metavar="FILE",
        help="the router's public key file: CurveZMQ on the link to --upstream",
    )
    broker.add_argument(
        "--upstream-key",
        type=existing_path,
        default=None,
        metavar="FILE",
        help="this node's secret key file for the link (default: --curve-secret-key)",
    )
    add_service_arguments(broker)
    broker.set_defaults(run=run_broker)


def run_broker(args: argparse.Namespace) -> int:
    """``kcoral broker``: its settings from the flags, then serve until stopped."""
    from kcoral.broker.broker import Broker
    from kcoral.broker.settings import resolve
    from kcoral.broker.target import TargetError
    from kcoral.sandbox.bubblewrap import SandboxUnavailable
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
    settings = broker_settings(args, security, upstream_keys)
    try:
        settings = resolve(settings)
    except SandboxUnavailable as exc:  # never run programs without the walls unless told to
        log.error("broker_cannot_start", error=f"{exc} (or --sandbox auto to run without it here)")
        return EXIT_CONFIG
    # The CLI makes the temporary run directory, so that it goes away however the broker ends
    # (a port in use, a sandbox that cannot start).
    temporary_run_dir = None if args.run_dir else Path(tempfile.mkdtemp(prefix="kcoral-"))
    settings = dataclasses.replace(settings, run_dir=args.run_dir or temporary_run_dir)
    try:
        return run_service("broker", lambda: Broker(settings), (TargetError, SandboxUnavailable, ListenRefused))
    finally:
        if temporary_run_dir is not None:
            shutil.rmtree(temporary_run_dir, ignore_errors=True)


# The flags whose value a BrokerSettings field takes as it is (the flag's dest is the field's name);
# the others are read below.
SAME_NAME_FIELDS = (
    "gpus",
    "fake_gpus",
    "sandbox",
    "max_programs_per_worker",
    "cuda_context",
    "gpu_handover",
    "memory_cgroup",
    "cache_dir",
    "cache_bytes",
    "cache_disk_bytes",
    "max_response_bytes",
    "run_dir",
    "upstream",
    "node_id",
)
# Flags left out (None) for the field's own default, which resolve() may decide from the host.
DEFAULTED_FIELDS = ("workers_per_gpu", "workers")
# The flag of each worker limit (kcoral.worker.limits' names).
LIMIT_FLAGS = {
    "memory_bytes": "memory_limit",
    "processes": "max_processes",
    "file_size_bytes": "max_file_bytes",
    "open_files": "max_open_files",
    "workspace_bytes": "max_workspace_bytes",
}


def broker_settings(args: argparse.Namespace, security: Any, upstream_keys: Any) -> BrokerSettings:
    """The BrokerSettings that the flags ask for, before the broker decides the rest (``resolve``):
    a flag left out gives the field's own default."""
    limits = {name: getattr(args, flag) for name, flag in LIMIT_FLAGS.items() if getattr(args, flag) is not None}
    return BrokerSettings(
        **shared_settings(args, security),
        **{name: getattr(args, name) for name in SAME_NAME_FIELDS},
        **{name: getattr(args, name) for name in DEFAULTED_FIELDS if getattr(args, name) is not None},
        device=args.device or "auto",
        sandbox_readonly_paths=tuple(args.sandbox_readonly_path),
        session_idle_seconds=args.session_idle,
        session_max_seconds=args.session_max,
        negotiation_timeout_seconds=args.negotiation_timeout or NEGOTIATION_TIMEOUT_SECONDS,
        limits=limits,
        upstream_keys=upstream_keys,
    )


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
