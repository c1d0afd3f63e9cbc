"""What ``kcoral router`` can be told: one frozen dataclass that the CLI fills from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from kcoral import protocol
from kcoral.service import auth
from kcoral.service.fairness import ORPHAN_GRACE_SECONDS, upload_bounds

NODE_WAIT_SECONDS = 10.0
NODE_BLOB_MEMORY = 100_000  # digests remembered per node for blob affinity


@dataclass(frozen=True)
class RouterSettings:
    """Everything ``kcoral router`` can be told; the CLI fills it from flags."""

    listen: str = "tcp://127.0.0.1:6000"
    nodes_listen: str = "tcp://127.0.0.1:6001"
    max_queued: int = 1024
    queue_timeout_seconds: float = 3600.0
    # How long programs wait for a node while none is registered (see kcoral/router/router.py).
    node_wait_seconds: float = NODE_WAIT_SECONDS
    max_request_bytes: int = protocol.DEFAULT_MAX_REQUEST_BYTES
    node_blob_memory: int = NODE_BLOB_MEMORY
    # Access (kcoral/service/auth.py): CURVE with a clients and a nodes key set; without it, the
    # router listens on loopback only unless insecure_listen_any.
    security: auth.ServerSecurity | None = None
    insecure_listen_any: bool = False
    max_queued_per_client: int | None = None  # None: a fair fraction of max_queued, as the broker's
    orphan_grace_seconds: float = ORPHAN_GRACE_SECONDS
    # HOST:PORT of the Prometheus endpoint (kcoral/service/metrics.py), or None for none.
    metrics_listen: str | None = None
    max_connections_per_address: int = 0  # kcoral.service.connections; 0: no cap
    # Bytes of uploads passing through to the nodes (programs still negotiating their blobs),
    # bounded as the broker's are; None: twice max_request_bytes in all, max_request_bytes per client.
    max_upload_bytes: int | None = None
    max_upload_bytes_per_client: int | None = None
    # The largest frame a client may send (libzmq's MAXMSGSIZE on the client socket).
    max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES

    @property
    def upload_bounds(self) -> tuple[int, int]:
        """(in all, per client) bytes of uploads in progress."""
        return upload_bounds(self.max_request_bytes, self.max_upload_bytes, self.max_upload_bytes_per_client)


__all__ = ["NODE_BLOB_MEMORY", "NODE_WAIT_SECONDS", "RouterSettings"]
