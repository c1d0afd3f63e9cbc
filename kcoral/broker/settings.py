"""What ``kcoral broker`` can be told: one frozen dataclass that the CLI fills from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kcoral import protocol
from kcoral.broker.intake import NEGOTIATION_TIMEOUT_SECONDS


@dataclass(frozen=True)
class BrokerSettings:
    """Everything ``kcoral broker`` can be told; the CLI fills it from flags."""

    listen: str = "tcp://127.0.0.1:5555"
    device: str = "auto"  # "gpu", "cpu" or "auto"
    gpus: tuple[int, ...] | None = None  # None: every local GPU
    fake_gpus: int = 0
    workers_per_gpu: int = 1
    workers: int = 2  # CPU workers where there are no GPUs
    sandbox: str = "none"
    sandbox_readonly_paths: tuple[Path, ...] = ()
    max_programs_per_worker: int = 1
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
    limits: dict[str, int] = field(default_factory=dict)
    preload: str = "numpy,torch"
    # Join a kcoral router at this nodes endpoint (kcoral/broker/upstream.py), as this node id.
    upstream: str | None = None
    node_id: str | None = None
    # HOST:PORT of the Prometheus endpoint (kcoral/metrics.py), or None for none.
    metrics_listen: str | None = None


__all__ = ["BrokerSettings"]
