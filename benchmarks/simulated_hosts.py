"""Simulated hosts: a router and host brokers, each in a network namespace of its own, on one switch.

For the federation test (tests/test_deploy_federation.py) and its benchmark
(benchmarks/federation.py): the services talk over real TCP between separate network stacks, as on
separate machines, and a host's link can be cut and restored. Everything is made by this module and
removed by it (root only; :func:`unavailable_reason` says why not where it cannot run):

- one namespace is the switch: a bridge and nothing else (no address, so it forwards only);
- each host is a namespace with one veth pair to the switch, its ``eth0``, and one address of a
  /24 taken from 198.18.0.0/15 (RFC 2544: kept for network benchmarks, routed nowhere);
- the process that builds the network (the test, with its clients) is a host too: one veth pair
  from the root namespace to the switch, with the /24's last address. Its only route to the hosts is
  that /24 itself; no other address is ever a destination.

Cutting a host (:meth:`Network.cut`) sets its port on the switch down, as a pulled cable would:
the host keeps its address and its services run on, but nothing reaches it or leaves it.

The services start with the command lines of the systemd units in deploy/systemd/
(:func:`unit_command`), their environment standing in for the units' EnvironmentFile.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kcoral.keys import ClientKeys, generate_keypair
from kcoral.testing import RunningService, wait_ready

# 198.18.0.0/15 (RFC 2544) holds 512 /24s: each network takes one that no route covers yet.
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")
SUBNET_PREFIX = 24
CLIENT_HOST_INDEX = 254  # the root namespace's address in the /24: the test's own host
IP_TIMEOUT_SECONDS = 10.0
# Every namespace and root link of a network is named kcPID-...: a network whose process is gone
# (killed before its clean-up) is found by its name and removed by the next one.
NAME_PREFIX = "kc"
_OWN_NAME = re.compile(rf"{NAME_PREFIX}(\d+)-[a-z0-9]+")
MAX_HOSTS = 16  # a bound on what one network may make
ROUTER_PORT, NODES_PORT, ROUTER_METRICS_PORT = 6000, 6001, 9464
REPOSITORY = Path(__file__).resolve().parent.parent
UNITS = REPOSITORY / "deploy" / "systemd"
ROUTER_UNIT = UNITS / "kcoral-router.service"
BROKER_UNIT = UNITS / "kcoral-broker.service"
STOP_TIMEOUT_SECONDS = 30.0


class NetworkUnavailable(RuntimeError):
    """Raised when network namespaces cannot be made here (not root, no ``ip``, no netns support)."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None where they can (a probe namespace is made and removed)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"kcprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        bridge = _ip("-n", probe, "link", "add", "probe2", "type", "bridge", check=False)
    finally:
        _ip("netns", "delete", probe, check=False)
    for what, done in (("veth", veth), ("bridge", bridge)):
        if done.returncode != 0:
            return f"cannot make a {what} link: {done.stderr.strip()}"
    return None


def remove_stale() -> list[str]:
    """Remove the namespaces and root links of networks whose process is gone (killed before its
    clean-up ran); only names of this module's own pattern, ``kcPID-...``. The names removed."""
    removed = []
    namespaces = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@\s]+)", _ip("-o", "link", "show", check=False).stdout, re.MULTILINE)
    for name in [*namespaces, *links]:
        match = _OWN_NAME.fullmatch(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        if name in namespaces:
            _ip("netns", "delete", name, check=False)
        else:
            _ip("link", "delete", name, check=False)
        removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of ADDRESS_RANGE that no route of this machine covers yet, starting from one chosen by
    the process id (so that two runs at once take two)."""
    taken = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(line.split()[0], strict=False))
    subnets = [n for n in ADDRESS_RANGE.subnets(new_prefix=SUBNET_PREFIX) if isinstance(n, ipaddress.IPv4Network)]
    start = os.getpid() % len(subnets)
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(route) for route in taken if route.prefixlen > 0):
            return subnet
    raise NetworkUnavailable(f"every /{SUBNET_PREFIX} of {ADDRESS_RANGE} is routed already")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_SECONDS, check=False)
    if check and done.returncode != 0:
        raise NetworkUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address, and its port on the switch."""

    name: str
    namespace: str
    address: str
    switch_port: str


class Network:
    """A switch and the hosts on it, each a network namespace; :meth:`close` removes them all.

    Example::

        with Network.create() as network:
            router = network.add_host("router")
            network.popen(router, ["python3", "-m", "http.server", "--bind", router.address, "8000"])
    """

    def __init__(self, prefix: str, subnet: ipaddress.IPv4Network) -> None:
        self.prefix = prefix
        self.subnet = subnet
        self.switch = f"{prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self.client_address = str(subnet.network_address + CLIENT_HOST_INDEX)
        self._root_link = f"{prefix}-h"
        self._processes: list[subprocess.Popen[bytes]] = []

    @classmethod
    @contextlib.contextmanager
    def create(cls) -> Iterator[Network]:
        """A new network (switch and the caller's own link to it), removed on exit."""
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkUnavailable(reason)
        remove_stale()
        network = cls(f"{NAME_PREFIX}{os.getpid()}", _free_subnet())
        try:
            network._make_switch()
            yield network
        finally:
            network.close()

    def _make_switch(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        # The caller's host: the veth's switch end is made in the root namespace and moved.
        port = f"{self.prefix}-p0"
        _ip("link", "add", self._root_link, "type", "veth", "peer", "name", port)
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("addr", "add", f"{self.client_address}/{SUBNET_PREFIX}", "dev", self._root_link)
        _ip("link", "set", self._root_link, "up")

    def add_host(self, name: str) -> Host:
        """A new host on the switch, with the next address of the subnet."""
        if len(self.hosts) >= MAX_HOSTS:
            raise NetworkUnavailable(f"at most {MAX_HOSTS} hosts on one simulated network")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", name) or name in self.hosts:
            raise ValueError(f"a host name is 1 to 6 lower-case letters and digits, unique: not {name!r}")
        index = len(self.hosts) + 1
        namespace = f"{self.prefix}-{name}"
        port = f"{self.prefix}-p{index}"
        host = Host(name, namespace, str(self.subnet.network_address + index), port)
        _ip("netns", "add", namespace)
        self.hosts[name] = host  # recorded before it is complete, so that close() removes it
        _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{host.address}/{SUBNET_PREFIX}", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return host

    def cut(self, host: Host) -> None:
        """Take the host's link down at the switch: nothing reaches it or leaves it."""
        _ip("-n", self.switch, "link", "set", host.switch_port, "down")

    def restore(self, host: Host) -> None:
        """Bring the host's link back up."""
        _ip("-n", self.switch, "link", "set", host.switch_port, "up")

    def popen(self, host: Host, argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (``ip netns exec`` execs it, so the process is the command itself)."""
        process = subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv], **options)
        self._processes.append(process)
        return process

    def close(self) -> None:
        """Kill what was started on the hosts and still runs, then remove every namespace and link."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for host in self.hosts.values():
            _ip("netns", "delete", host.namespace, check=False)
        self.hosts.clear()
        # Removing the switch removes the far ends of every veth pair, the root namespace's included.
        _ip("netns", "delete", self.switch, check=False)
        _ip("link", "delete", self._root_link, check=False)


# --- systemd units -----------------------------------------------------------------------------

_SPECIFIER = re.compile(r"%(.)")
_VARIABLE_WORD = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")
_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def unit_settings(unit: Path, key: str) -> list[str]:
    """The values of every ``key=`` line of the unit's [Service] section, in order."""
    values, section = [], ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line
        elif section == "[Service]" and line.startswith(f"{key}="):
            values.append(line[len(key) + 1 :])
    return values


def _specifiers(text: str, specifiers: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        letter = match.group(1)
        if letter == "%":
            return "%"
        if letter not in specifiers:
            raise ValueError(f"the unit uses the specifier %{letter}, which this expansion does not know")
        return specifiers[letter]

    return _SPECIFIER.sub(one, text)


def unit_command(unit: Path, environment: Mapping[str, str], specifiers: Mapping[str, str]) -> list[str]:
    """The unit's ExecStart as systemd would run it: its Environment= defaults overridden by
    ``environment`` (which stands in for its EnvironmentFile), ``${VAR}`` as one word, ``$VAR`` as
    words split at whitespace (none when empty), and the specifiers (``%d``, ``%S``, ...) given."""
    env: dict[str, str] = {}
    for assignment in unit_settings(unit, "Environment"):
        for word in shlex.split(assignment):
            name, _, value = word.partition("=")
            env[name] = _specifiers(value, specifiers)
    env.update(environment)
    (exec_start,) = unit_settings(unit, "ExecStart")
    argv: list[str] = []
    for word in shlex.split(exec_start):
        whole = _VARIABLE_WORD.fullmatch(word)
        if whole is not None:
            argv += env.get(whole.group(1), "").split()
            continue
        expanded = _BRACED.sub(lambda m: env.get(m.group(1), ""), _specifiers(word, specifiers))
        argv.append(expanded)
    return argv


def python_command(argv: list[str]) -> list[str]:
    """A unit's command with its installed ``kcoral`` replaced by this interpreter's ``-m kcoral.cli``."""
    if not argv or Path(argv[0]).name != "kcoral":
        raise ValueError(f"the unit does not run kcoral: {argv[:1]}")
    return [sys.executable, "-m", "kcoral.cli", *argv[1:]]


# --- a federation on the simulated hosts ---------------------------------------------------------


@dataclass
class Keys:
    """The key files of a federation, laid out as deploy/systemd expects them under /etc/kcoral."""

    root: Path
    nodes: tuple[str, ...]
    clients: tuple[str, ...]
    strangers: tuple[str, ...] = ()  # nodes with a key pair the router does not list

    def __post_init__(self) -> None:
        generate_keypair(self.root / "keys", "router")
        for client in self.clients:
            generate_keypair(self.root / "client-secrets", client)
            os.link(self.root / "client-secrets" / f"{client}.key", self._dir("clients") / f"{client}.key")
        for node in (*self.nodes, *self.strangers):
            generate_keypair(self.root / "node-secrets", node)
            if node in self.nodes:
                os.link(self.root / "node-secrets" / f"{node}.key", self._dir("nodes") / f"{node}.key")

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    @property
    def router_public(self) -> Path:
        return self.root / "keys" / "router.key"

    def client(self, name: str) -> ClientKeys:
        return ClientKeys.from_files(self.router_public, self.root / "client-secrets" / f"{name}.key_secret")

    def client_files(self, name: str) -> tuple[Path, Path]:
        """(server public key, client secret key): what ``--server-key`` and ``--client-key`` take."""
        return self.router_public, self.root / "client-secrets" / f"{name}.key_secret"

    def node_secret(self, name: str) -> Path:
        return self.root / "node-secrets" / f"{name}.key_secret"


@dataclass
class Federation:
    """A router and host brokers on a :class:`Network`, started from the systemd units' command lines."""

    network: Network
    keys: Keys
    work_dir: Path
    broker_args: str = "--device cpu --workers 1"
    log_level: str = "info"
    router: RunningService | None = None
    brokers: dict[str, RunningService] = field(default_factory=dict)
    _hosts: dict[str, str] = field(default_factory=dict)  # node id -> host name

    def start_router(self, host: Host) -> RunningService:
        credentials = self._host_dir(host, "credentials")
        shutil.copy(self.keys.root / "keys" / "router.key_secret", credentials / "router.key_secret")
        environment = {
            "KCORAL_KEYS": str(self.keys.root / "keys"),
            "KCORAL_CLIENT_KEYS": str(self.keys.root / "clients"),
            "KCORAL_NODE_KEYS": str(self.keys.root / "nodes"),
        }
        argv = unit_command(ROUTER_UNIT, environment, {"d": str(credentials)})
        url = f"tcp://{host.address}:{ROUTER_PORT}"
        self.router = self._start(host, argv, url, self.keys.client(self.keys.clients[0]))
        self.router.nodes_url = f"tcp://{host.address}:{NODES_PORT}"
        wait_ready(self.router, timeout_seconds=30)
        return self.router

    def start_broker(self, host: Host, node_id: str | None = None, *, key: str | None = None) -> RunningService:
        """A broker on ``host`` joining the router as ``node_id`` (the host's name), with the key pair
        ``key`` (the node's own); not waited for: see :meth:`wait_live`."""
        assert self.router is not None and self.router.nodes_url is not None
        node_id = node_id or host.name
        credentials = self._host_dir(host, "credentials")
        shutil.copy(self.keys.node_secret(key or node_id), credentials / "node.key_secret")
        environment = {
            "KCORAL_UPSTREAM": self.router.nodes_url,
            "KCORAL_NODE_ID": node_id,
            "KCORAL_KEYS": str(self.keys.root / "keys"),
            "KCORAL_BROKER_ARGS": self.broker_args,
        }
        specifiers = {
            "d": str(credentials),
            "S": str(self._host_dir(host, "state")),
            "C": str(self._host_dir(host, "cache")),
            "H": host.name,
        }
        argv = unit_command(BROKER_UNIT, environment, specifiers)
        # The broker listens on its host's loopback, as the unit says: only the router (through the
        # link the broker dials) and the host itself reach it.
        service = self._start(host, argv, argv[argv.index("--listen") + 1], None)
        self.brokers[node_id] = service
        self._hosts[node_id] = host.name
        return service

    def _start(self, host: Host, argv: list[str], url: str, keys: ClientKeys | None) -> RunningService:
        command = python_command(argv)
        command[3:3] = ["--log-level", self.log_level]
        log_path = self.work_dir / f"{host.name}.log"
        with open(log_path, "ab") as log:
            process = self.network.popen(host, command, stdout=log, stderr=subprocess.STDOUT)
        return RunningService(url, process, log_path, client_options={"keys": keys} if keys else {})

    def _host_dir(self, host: Host, name: str) -> Path:
        path = self.work_dir / host.name / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def nodes(self) -> dict[str, dict[str, Any]]:
        assert self.router is not None
        return self.router.nodes()

    def wait_live(self, *node_ids: str, timeout_seconds: float = 120.0) -> dict[str, dict[str, Any]]:
        """Wait until each node is live and idle at the router and ready by ``kcoral status`` on
        its own host (every worker slot idle, as a readiness probe would ask); the router's nodes."""
        deadline = time.monotonic() + timeout_seconds
        ready: set[str] = set()
        while True:
            for node_id in node_ids:
                broker = self.brokers[node_id]
                if broker.process.poll() is not None:
                    raise RuntimeError(f"broker {node_id} exited with {broker.process.returncode}:\n{broker.log()}")
            nodes: dict[str, dict[str, Any]] = {}
            with contextlib.suppress(Exception):
                nodes = self.nodes()
            for node_id in node_ids:
                if node_id not in ready and _idle(nodes.get(node_id)) and self.broker_ready(node_id):
                    ready.add(node_id)
            if ready >= set(node_ids) and all(_idle(nodes.get(n)) for n in node_ids):
                return nodes
            if time.monotonic() > deadline:
                logs = "\n".join(self.brokers[n].log()[-3000:] for n in node_ids)
                raise TimeoutError(f"nodes {node_ids} not live within {timeout_seconds:g} s:\n{logs}")
            time.sleep(0.5)

    def broker_ready(self, node_id: str) -> bool:
        """``kcoral status --ready`` on the broker's host, against its loopback endpoint, as the
        Kubernetes readiness probe asks: every slot has had a worker ready, and the node is registered."""
        broker = self.brokers[node_id]
        host = self.network.hosts[self._hosts[node_id]]
        status = [sys.executable, "-m", "kcoral.cli", "status", "--ready", broker.url]
        argv = ["ip", "netns", "exec", host.namespace, *status]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def stop(self) -> dict[str, int]:
        """One SIGTERM (a unit's stop) to every broker, then to the router; their exit statuses.

        Once each: a second SIGTERM that reaches a service after its drain has ended, while it
        closes, would find the default action again and kill it."""
        services = list(self.brokers.items())
        for _, broker in services:
            _terminate(broker)
        statuses = {node_id: _wait(broker) for node_id, broker in services}
        if self.router is not None:
            _terminate(self.router)
            statuses["router"] = _wait(self.router)
        return statuses


def _terminate(service: RunningService) -> None:
    if service.process.poll() is None and service.process.returncode is None:
        service.process.send_signal(signal.SIGTERM)


def _wait(service: RunningService) -> int:
    try:
        return service.process.wait(STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        service.process.kill()
        return service.process.wait()


def _idle(node: Mapping[str, Any] | None) -> bool:
    if node is None or node.get("state") != "live":
        return False
    load = node.get("load") or {}
    return bool(load.get("request_capacity")) and not load.get("requests_in_progress")


__all__ = [
    "Federation",
    "Host",
    "Keys",
    "Network",
    "NetworkUnavailable",
    "python_command",
    "unavailable_reason",
    "unit_command",
    "unit_settings",
]
