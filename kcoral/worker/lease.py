"""The worker's side of a program's GPU lease: LEASE, then GRANT, on the worker's own socket.

The broker keeps the lease until the zygote reports that the worker and everything it started have
exited. GRANT carries the broker's word on the GPU's other processes (``gpu_pids``, see
:mod:`kcoral.timing.neighbours`), which the timer keeps for the program's measurements; the timer
may ask for it again after a measurement (:meth:`LeaseChannel.refresh`), since a spare forked on the
GPU while the program measured was not yet there to be named at the grant.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import zmq

from kcoral import protocol
from kcoral.timing.trust import note_grant

# How long the timer waits for the broker's second GRANT (the broker answers it at once).
REFRESH_TIMEOUT_MS: Final = 2000


@dataclass
class LeaseTimes:
    wait_ms: float = 0.0
    held_ms: float = 0.0


class LeaseChannel:
    """The worker's side of GPU leases: ask the broker once, before the program's first GPU run.

    There is no release: the broker keeps the lease until the zygote reports that this process
    and everything it started have exited, since until then they could still run work on the GPU
    (a program could otherwise give the lease back and keep going). ``cpu_only`` runs before the
    first GPU run hold nothing.
    """

    def __init__(
        self,
        socket: zmq.Socket[bytes] | None,
        request_id: str,
        gpu_ids: list[int],
        lock: threading.Lock | None = None,
        grant: Any = None,
    ) -> None:
        self.socket = socket
        self.request_id = request_id
        self.gpu_ids = gpu_ids
        self.times = LeaseTimes()
        self.granted_at: float | None = None
        # GRANT's body sent with the PROGRAM, where the worker holds the lease already (a session's).
        self.grant = grant if isinstance(grant, dict) and grant.get("request_id") == request_id else None
        # Held around every use of the socket: the output follower's thread sends on it too.
        self.lock = lock or threading.Lock()

    def needed(self) -> bool:
        return self.socket is not None and bool(self.gpu_ids)

    def acquire(self) -> None:
        """Wait for the grant, once (not at all where it came with the PROGRAM); later runs find it
        held."""
        if self.granted_at is not None:
            return
        assert self.socket is not None
        start = time.monotonic()
        body = self.grant if self.grant is not None else self._ask(None)
        assert body is not None  # without a deadline, _ask returns only with the GRANT
        # The broker's word on the GPU's other processes, for the findings of benchmark() and
        # compare() (kcoral.timing.neighbours): taken here, after the program's import-time code.
        note_grant(body.get("gpu_pids"), self.refresh)
        self.granted_at = time.monotonic()
        self.times.wait_ms += (self.granted_at - start) * 1000

    def refresh(self) -> Any:
        """The GRANT's ``gpu_pids`` as the broker sees them now (it answers a holder's LEASE at
        once), or None where no answer came within ``REFRESH_TIMEOUT_MS`` or the lease is not held."""
        if self.socket is None or self.granted_at is None:
            return None
        body = self._ask(time.monotonic() + REFRESH_TIMEOUT_MS / 1000)
        return body.get("gpu_pids") if body is not None else None

    def note_end(self) -> None:
        """The program is over: count the time it held the lease (the broker measures its own)."""
        if self.granted_at is not None:
            self.times.held_ms = (time.monotonic() - self.granted_at) * 1000

    def _ask(self, deadline: float | None) -> dict[str, Any] | None:
        """Send LEASE and read until this program's GRANT (its body), or None at ``deadline``
        (monotonic; None: wait as long as it takes)."""
        assert self.socket is not None
        with self.lock:
            self.socket.send_multipart(protocol.message(protocol.LEASE, {"request_id": self.request_id}))
            while True:
                if deadline is not None:
                    left_ms = int((deadline - time.monotonic()) * 1000)
                    if left_ms <= 0 or not self.socket.poll(left_ms):
                        return None
                command, body, _ = protocol.split_message(self.socket.recv_multipart())
                if command == protocol.GRANT and body.get("request_id") == self.request_id:
                    return body
