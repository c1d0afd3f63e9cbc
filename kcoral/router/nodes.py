"""The router's node table: each registered host broker, the programs it holds, and how one is chosen.

Pure logic (no sockets): :func:`parse_registration` and :func:`parse_load_report` check what a
node says, :func:`choose_node` picks where a program goes, :func:`merged_target` sums the nodes'
targets for TARGET and HEALTH.
"""

from __future__ import annotations

import platform
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kcoral import protocol

NODE_STATUSES = ("ok", "draining")
MAX_QUIET_SECONDS = protocol.MAX_TIMEOUT_SECONDS  # the most silence a node may announce


class RouterRequestState(StrEnum):
    """Where a program is, as the router knows it: queued here, then dispatched to a node, and
    queued or running there as the node's PARTIALs say."""

    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RUNNING = "running"


class NodeState(StrEnum):
    """A node the router knows: live until it is lost (silent, gone or unreachable)."""

    LIVE = "live"
    LOST = "lost"


@dataclass(eq=False)
class RouterRequest:
    id: str
    client: bytes
    gpu_count: int  # 0: the node's default, which any node can serve
    digests: list[str]
    frames: list[Any] | None  # the EXECUTE as received, kept until it goes to a node
    received_at: float = field(default_factory=time.monotonic)
    node: Node | None = None
    # What the node last said of it (PARTIAL): queued here, then dispatched, queued or running at
    # the node; for kcoral status.
    state: RouterRequestState = RouterRequestState.QUEUED
    gpu_ids: tuple[int, ...] = ()
    owner: bytes = b""  # fair-share identity: the CURVE key, or the connection (as in the broker)
    sizes: dict[str, int] = field(default_factory=dict)  # each blob's declared size
    bytes_received: int = 0  # blob bytes from the client (EXECUTE and BLOBS), passed on to the node

    def __post_init__(self) -> None:
        self.owner = self.owner or self.client


@dataclass(eq=False)
class Node:
    """A registered host broker, known by the identity of its current link."""

    identity: bytes
    node_id: str
    instance_id: str
    hostname: str
    gpu_count: int
    fake_gpus: int
    status: str
    load: dict[str, int]
    target: dict[str, Any]
    versions: dict[str, str]
    registered_at: float = field(default_factory=time.time)
    last_heard: float = field(default_factory=time.monotonic)
    # Until then the node may be silent: it announced that it is storing a large upload.
    quiet_until: float = 0.0
    state: NodeState = NodeState.LIVE
    # False after a send to it failed; true again at its next message.
    reachable: bool = True
    requests: dict[str, RouterRequest] = field(default_factory=dict)
    blobs: OrderedDict[str, None] = field(default_factory=OrderedDict)
    dispatched: int = 0
    lost_reason: str | None = None

    @property
    def capacity(self) -> int:
        return self.load.get("request_capacity", 0)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.requests)

    @property
    def dispatchable(self) -> bool:
        return self.state == NodeState.LIVE and self.status == "ok" and self.reachable and self.free_slots > 0

    def busyness(self) -> float:
        return len(self.requests) / max(1, self.capacity)

    def remember_blobs(self, digests: list[str], limit: int) -> None:
        for digest in digests:
            self.blobs[digest] = None
            self.blobs.move_to_end(digest)
        while len(self.blobs) > limit:
            self.blobs.popitem(last=False)

    def missing_blobs(self, digests: list[str]) -> int:
        return sum(1 for d in digests if d not in self.blobs)

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "state": self.state.value
            if self.state != NodeState.LIVE
            else ("draining" if self.status == "draining" else "live"),
            "hostname": self.hostname,
            "instance_id": self.instance_id,
            "gpus": self.gpu_count,
            "fake_gpus": self.fake_gpus,
            "load": dict(self.load),
            "in_flight": len(self.requests),
            "dispatched": self.dispatched,
            "last_heard_s": round(now - self.last_heard, 3),
            "registered_at": self.registered_at,
            "arch": list(self.target.get("arch") or []),
            "versions": {k: v for k, v in self.versions.items() if k in ("kcoral", "protocol", "torch")},
            "lost_reason": self.lost_reason,
        }


def parse_registration(identity: bytes, body: dict[str, Any]) -> Node:
    """The node that a NODE_REGISTER body describes, on the link ``identity``; raises
    ``protocol.WireError`` naming what is wrong."""
    target = body.get("target") or {}
    node_versions = body.get("versions") or {}
    if not isinstance(target, dict) or not isinstance(node_versions, dict):
        raise protocol.WireError("target and versions must be maps")
    status, load = parse_load_report(body)
    return Node(
        identity=identity,
        node_id=protocol.check_id(body.get("node_id"), "node id"),
        instance_id=str(body.get("instance_id")),
        hostname=str(body.get("hostname")),
        gpu_count=_count(body.get("gpu_count"), "gpu_count"),
        fake_gpus=_count(body.get("fake_gpus", 0), "fake_gpus"),
        status=status,
        load=load,
        target=target,
        versions={str(k): str(v) for k, v in node_versions.items()},
    )


def parse_load_report(body: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """(status, load) of a NODE_REGISTER or NODE_HEARTBEAT body."""
    return _status(body.get("status")), _load(body.get("load"))


def parse_quiet_seconds(value: object) -> float | None:
    """How long a node announced it may be silent (capped), or None when it announced nothing."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise protocol.WireError(f"quiet_seconds must be a number >= 0, not {value!r}")
    return min(float(value), MAX_QUIET_SECONDS)


def choose_node(request: RouterRequest, ready: list[Node], rng: random.Random) -> Node | None:
    """Where a program goes, among the nodes ready for work (see kcoral/router/router.py)."""
    fits = [n for n in ready if n.gpu_count >= request.gpu_count]
    if len(fits) > 1 and request.digests:
        missing = {n.identity: n.missing_blobs(request.digests) for n in fits}
        fewest = min(missing.values())
        fits = [n for n in fits if missing[n.identity] == fewest]
    if len(fits) > 2:
        fits = rng.sample(fits, 2)
    if not fits:
        return None
    return min(fits, key=lambda n: (n.busyness(), rng.random()))


def merged_target(live: list[Node], host_platform: str) -> dict[str, Any]:
    """The live nodes' targets merged: every GPU (with its node), the union of archs."""
    gpus = [{**gpu, "node": n.node_id} for n in live for gpu in (n.target.get("gpus") or []) if isinstance(gpu, dict)]
    arch = sorted({str(a) for n in live for a in (n.target.get("arch") or [])})
    devices = {n.target.get("device") for n in live}
    return {
        "device": "gpu" if "gpu" in devices else ("cpu" if live else "none"),
        "fake_gpus": sum(n.fake_gpus for n in live),
        "gpus": gpus,
        "arch": arch,
        "platform": host_platform,
        "python": platform.python_version(),
        "nodes": {n.node_id: n.target for n in live},
    }


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise protocol.WireError(f"{what} must be an integer >= 0, not {value!r}")
    return value


def _status(value: object) -> str:
    if value not in NODE_STATUSES:
        raise protocol.WireError(f"node status must be one of {NODE_STATUSES}, not {value!r}")
    return str(value)


def _load(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        raise protocol.WireError("load must be a map")
    return {
        key: _count(value.get(key, 0), key) for key in ("request_capacity", "requests_in_progress", "requests_waiting")
    }


__all__ = [
    "Node",
    "RouterRequest",
    "choose_node",
    "merged_target",
    "parse_load_report",
    "parse_quiet_seconds",
    "parse_registration",
]
