"""What ``kcoral broker`` can be told: one frozen dataclass that the CLI fills from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kcoral import protocol
from kcoral.broker.intake import NEGOTIATION_TIMEOUT_SECONDS
from kcoral.keys import ClientKeys
from kcoral.service.auth import ServerSecurity

# Fair share. Without --max-queued-per-client one client may fill this fraction of --max-queued:
# four busy clients together can fill the queue, one alone leaves room for everyone else.
CLIENT_QUEUE_SHARE = 4
# How long a vanished client's running programs go on before they are cancelled: a short network
# blip (the DEALER reconnects under the same identity) costs nothing, a gone client little GPU time.
ORPHAN_GRACE_SECONDS = 10.0


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
    sandbox_reason: str = ""  # why there is none, when bubblewrap could not run (--sandbox auto)
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
    # Access (kcoral/service/auth.py, kcoral/service/fairness.py). Without security the broker
    # listens on loopback only, unless insecure_listen_any.
    security: ServerSecurity | None = None
    insecure_listen_any: bool = False
    upstream_keys: ClientKeys | None = None  # CURVE on the link to the router
    max_queued_per_client: int | None = None  # None: max_queued // CLIENT_QUEUE_SHARE
    orphan_grace_seconds: float = ORPHAN_GRACE_SECONDS
    # Bytes of uploads in progress (programs still negotiating their blobs); None: twice
    # max_request_bytes in all, and max_request_bytes per client.
    max_upload_bytes: int | None = None
    max_upload_bytes_per_client: int | None = None

    @property
    def client_queue_limit(self) -> int:
        return client_queue_limit(self.max_queued, self.max_queued_per_client)

    @property
    def upload_bounds(self) -> tuple[int, int]:
        """(in all, per client) bytes of uploads in progress."""
        per_client = self.max_upload_bytes_per_client or self.max_request_bytes
        return self.max_upload_bytes or 2 * self.max_request_bytes, per_client
    # HOST:PORT of the Prometheus endpoint (kcoral/metrics.py), or None for none.
    metrics_listen: str | None = None


def client_queue_limit(max_queued: int, max_queued_per_client: int | None) -> int:
    """Programs one client may have waiting: as given, or a fair fraction of the queue."""
    if max_queued_per_client is not None:
        return max_queued_per_client
    return max(1, max_queued // CLIENT_QUEUE_SHARE)


__all__ = ["CLIENT_QUEUE_SHARE", "ORPHAN_GRACE_SECONDS", "BrokerSettings", "client_queue_limit"]
