"""The node link: commands between a host broker (a node) and the router it serves.

A host broker started with --upstream runs a relay (kcoral/broker/upstream.py) that connects a
DEALER to the router's nodes endpoint. Besides the commands below, that link carries client
messages unchanged: router -> node EXECUTE, BLOBS, CANCEL; node -> router PARTIAL, FINAL. Both
sides send NODE_HEARTBEAT every HEARTBEAT_INTERVAL_SECONDS and take the other for dead after
HEARTBEAT_LIVENESS intervals of silence; the node then registers again, under a new identity.
"""

from __future__ import annotations

from typing import Final

from kcoral.protocol.frames import command_names

# node -> router, repeated every interval until answered: node_id, instance_id, hostname,
# gpu_count, fake_gpus, status, load, target, versions (the fields of the broker's health)
NODE_REGISTER: Final = b"\x30"
NODE_REGISTERED: Final = b"\x31"  # router -> node: instance_id (the router's)
# node -> router: status, load, and quiet_seconds (optional: how long the node may be silent, as
# it is about to store a large upload on its event loop); router -> node: {}
NODE_HEARTBEAT: Final = b"\x32"
NODE_DISCONNECT: Final = b"\x33"  # router -> node: "unknown node, register again"; node -> router: leaving

NODE_COMMANDS: Final = frozenset({NODE_REGISTER, NODE_REGISTERED, NODE_HEARTBEAT, NODE_DISCONNECT})
NODE_COMMAND_NAMES: Final = command_names(
    globals(), "NODE_REGISTER", "NODE_REGISTERED", "NODE_HEARTBEAT", "NODE_DISCONNECT"
)
