"""The hostile campaign: mixed honest and hostile programs, with hostile raw peers, against one broker.

    python3 benchmarks/campaign.py --count 200 --sandbox bubblewrap --json campaign.json
    python3 benchmarks/campaign.py --count 1000 --sandbox none --cache-bytes 64M

The broker runs with one fake GPU and two slots (``--fake-gpus 1 --workers-per-gpu 2``) and the
limits of tests/test_slot.py. Programs go ``--concurrency`` at a time from several connections, in
a shuffled mix of the kinds below, each with its goal; meanwhile raw ZMTP peers hold unfinished
frames (4 declaring 6 GiB frames, 4 holding all but a byte of a frame at the limit). At the end:
one row per kind (count, outcomes, goal met), and the campaign's own rows: every program answered,
no honest program lost or wrong, the broker alive and serving, no process of a program left below
it, no lease held, every slot's workspace empty, no memory cgroup left after the stop, and the
broker's memory (RSS before, at its peak and after, with its blob cache's memory tier beside it:
the tier is what holds memory between programs, bounded by ``--cache-bytes``). The exit status is
1 when any row misses its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import let_go_of, print_table, save_json
from kcoral import AsyncClient, KCoralError, Program, ProgramResult, protocol
from kcoral.sandbox.bubblewrap import SHARED_MEMORY
from kcoral.testing import RunningService, preloaded_data_bytes, start_broker
from kcoral.worker import run_directory
from tests.hostile_programs import FLOOD, SPREAD

FLAGS = (
    "--fake-gpus", "1", "--workers-per-gpu", "2", "--max-processes", "64",
    "--max-file-bytes", "256m", "--max-workspace-bytes", str(96 << 20),
)  # fmt: skip
# --memory-limit: 1 GiB, the room it leaves a program beside a CPU build of torch's preload (about
# 220 MiB of private data); beside a bigger preload (a CUDA build: about 770 MiB) the limit grows to
# leave the same room, so that the honest kinds fit as there and the hostile ones still pass it.
MEMORY_LIMIT_BYTES = 1 << 30
ROOM_BYTES = 768 << 20
TIMEOUT_S = 30.0
QUEUE_NAME = "/kcoral-campaign"

# The hostile kinds' functions, one module; flood and spread are the ones tests/test_hostile.py runs.
HOSTILE = (
    r"""
import ctypes, os, socket, time

def constant(x):
    return x

def total(x):
    return float(x.sum())

def nap(s):
    time.sleep(s)
    return s

def crash():
    os._exit(3)

def fail():
    raise RuntimeError("on purpose")

def bomb(mib):
    return len(b"\x01" * (mib << 20))

def forks(n):
    for _ in range(n):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    time.sleep(5)
    return n

def fill(mib):
    with open("fill.bin", "wb") as f:
        for _ in range(mib):
            f.write(b"\0" * (1 << 20))
    time.sleep(1)
    return mib

def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(1000)
        os._exit(0)
    return "left"

rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int

def mq_leave(name):
    fd = rt.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    return "left" if fd >= 0 else os.strerror(ctypes.get_errno())

def mq_find(name):
    return "found" if rt.mq_open(name.encode(), os.O_RDWR) >= 0 else "absent"

def listen(name, hold_s):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(1)
    time.sleep(hold_s)
    return "listened"

def reach(name):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect("\0" + name)
        return "reached"
    except OSError:
        return "unreachable"
"""
    + FLOOD
    + SPREAD
)


@dataclass(frozen=True)
class Kind:
    name: str
    weight: int
    honest: bool
    build: Callable[[random.Random], tuple[Program, Any]]  # the program and what its result must be
    goal: str  # "COMPLETED", "FAILED", "FAILED:<text in message>", "error:<kind>", or "any"
    timeout_s: float = TIMEOUT_S


def call(name: str, *args: Any, cpu_only: bool = True, value: Any = None) -> Program:
    program = Program()
    module = program.upload(kind="module", source=HOSTILE)
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    run = program.run(fn=fn, args=[value, *args] if value is not None else list(args))
    program.return_(key="out", value=run)
    return program


def tensor_kind(size: int) -> Callable[[random.Random], tuple[Program, Any]]:
    def build(rng: random.Random) -> tuple[Program, Any]:
        values = np.random.default_rng(rng.getrandbits(32)).random(size // 8)
        program = Program()
        module = program.upload(kind="module", source=HOSTILE)
        tensor = program.upload(kind="tensor", value=values)
        fn = program.get_function(module=module, name="total", cpu_only=True)
        program.return_(key="out", value=program.run(fn=fn, args=[tensor]))
        return program, float(values.sum())

    return build


def flood_program() -> Program:
    """A flood from the program's own thread that goes on while the worker sends its RESULT: the
    run is the last instruction (a later one would meet the flood on the worker's socket)."""
    program = Program()
    module = program.upload(kind="module", source=HOSTILE)
    program.run(fn=program.get_function(module=module, name="flood", cpu_only=True), args=[0.3])
    return program


def constant_program(rng: random.Random) -> tuple[Program, Any]:
    value = rng.randrange(1 << 30)
    return call("constant", value=value), value


def kinds(sandbox: str) -> list[Kind]:
    isolated = sandbox == "bubblewrap"
    absent = "absent" if isolated else None
    return [
        Kind("constant", 6, True, constant_program, "COMPLETED"),
        Kind("tensor_256k", 4, True, tensor_kind(256 << 10), "COMPLETED"),
        Kind("tensor_20m_pieces", 1, True, tensor_kind(20 << 20), "COMPLETED"),
        Kind("nap_gpu", 3, True, lambda r: (call("nap", 0.05, cpu_only=False), 0.05), "COMPLETED"),
        Kind("crash", 1, False, lambda r: (call("crash"), None), "FAILED:exit code 3"),
        Kind("raise", 1, False, lambda r: (call("fail"), None), "FAILED:on purpose"),
        Kind("timeout", 1, False, lambda r: (call("nap", 5.0), None), "error:timeout", timeout_s=1.0),
        Kind("progress_flood", 2, False, lambda r: (flood_program(), None), "COMPLETED"),
        Kind("clone_parent_spread", 1, False, lambda r: (call("spread", 3, 600, 3.0), None), "FAILED:memory-limit"),
        Kind("memory_bomb", 1, False, lambda r: (call("bomb", 3000), None), "FAILED"),
        Kind("fork_bomb", 1, False, lambda r: (call("forks", 200), None), "FAILED:--max-processes"),
        Kind("workspace_fill", 1, False, lambda r: (call("fill", 200), None), "FAILED"),
        Kind("leftover_daemon", 1, False, lambda r: (call("daemon"), "left"), "COMPLETED"),
        Kind("mqueue_leave", 1, False, lambda r: (call("mq_leave", QUEUE_NAME), "left"), "COMPLETED"),
        # Inside bubblewrap no queue reaches a later program; without a sandbox the slot's (or the
        # host's) IPC namespace keeps them: no goal there.
        Kind("mqueue_find", 1, True, lambda r: (call("mq_find", QUEUE_NAME), absent), "COMPLETED"),
        # Without a sandbox two slots' programs share one name: the second listen fails (no goal).
        Kind(
            "abstract_listen",
            1,
            False,
            lambda r: (call("listen", "kcoral-campaign", 2.0), "listened"),
            "COMPLETED" if isolated else "any",
        ),
        Kind(
            "abstract_reach",
            1,
            True,
            lambda r: (call("reach", "kcoral-campaign"), "unreachable" if isolated else None),
            "COMPLETED",
        ),
    ]


@dataclass
class Outcome:
    kind: str
    fate: str  # "COMPLETED", "FAILED:<kind>: <message>", "error:<kind>"
    met: bool
    seconds: float


@dataclass
class Campaign:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_samples: list[int] = field(default_factory=list)


def met(kind: Kind, expected: Any, result: ProgramResult | None, error: KCoralError | None) -> tuple[str, bool]:
    if error is not None:
        return f"error:{error.kind}", kind.goal in (f"error:{error.kind}", "any")
    assert result is not None
    if result.completed:
        out: Any = result.results.get("out")  # whatever the program returned (None: nothing)
        close = isinstance(expected, float) and abs(out - expected) <= 1e-6 * max(1.0, abs(expected))
        right = expected is None or out == expected or close
        return "COMPLETED", kind.goal == "any" or (kind.goal == "COMPLETED" and right)
    error_map = result.error or {}
    fate = f"FAILED:{error_map.get('kind')}: {str(error_map.get('message'))[:120]}"
    if kind.goal in ("FAILED", "any"):
        return fate, True
    if kind.goal.startswith("FAILED:"):
        return fate, kind.goal.removeprefix("FAILED:") in str(error_map.get("message"))
    return fate, False


async def run_programs(url: str, count: int, concurrency: int, sandbox: str, seed: int, campaign: Campaign) -> None:
    table = kinds(sandbox)
    rng = random.Random(seed)
    plan = rng.choices(table, [k.weight for k in table], k=count)
    clients = [AsyncClient(url, connect_timeout_seconds=30) for _ in range(concurrency)]
    for client in clients:
        await client.open()
    queue: asyncio.Queue[Kind] = asyncio.Queue()
    for kind in plan:
        queue.put_nowait(kind)

    async def drive(client: AsyncClient) -> None:
        while not queue.empty():
            kind = queue.get_nowait()
            program, expected = kind.build(rng)
            start = time.monotonic()
            result, error = None, None
            try:
                result = await client.execute(program, timeout_seconds=kind.timeout_s)
            except KCoralError as exc:
                error = exc
            fate, ok = met(kind, expected, result, error)
            campaign.outcomes.append(Outcome(kind.name, fate, ok, time.monotonic() - start))
            done = len(campaign.outcomes)
            if done % 50 == 0:
                print(f"campaign: {done}/{count} programs", file=sys.stderr, flush=True)

    try:
        await asyncio.gather(*(drive(c) for c in clients))
    finally:
        for client in clients:
            await client.aclose()


@contextlib.contextmanager
def raw_peers(url: str) -> Iterator[None]:
    """4 peers declaring 6 GiB frames (and sending 64 MiB of each), 4 holding all but the last byte
    of a frame at the default limit: for the whole campaign."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    peers: list[socket.socket] = []

    def connect() -> socket.socket:
        peer = socket.create_connection((host, int(port)))
        greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
        name, value = b"Socket-Type", b"DEALER"
        ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        peer.sendall(greeting + bytes([0x04, len(ready)]) + ready)
        peers.append(peer)
        return peer

    try:
        for _ in range(4):
            peer = connect()
            peer.settimeout(10)
            with contextlib.suppress(OSError):  # refused at the header: the connection is reset
                peer.sendall(struct.pack(">BQ", 0x02, 6 << 30) + bytes(64 << 20))
        almost = getattr(protocol, "DEFAULT_MAX_FRAME_BYTES", 8 << 20)  # (a checkout from before it)
        for _ in range(4):
            with contextlib.suppress(OSError):
                connect().sendall(struct.pack(">BQ", 0x02, almost) + bytes(almost - 1))
        yield
    finally:
        for peer in peers:
            peer.close()


def fate_class(fate: str) -> str:
    """``COMPLETED``, ``FAILED:<kind>`` or ``error:<kind>``: a fate without its message."""
    return ":".join(fate.split(":")[:2])


def program_processes(broker: psutil.Process) -> int:
    """Processes below the broker that are not its zygotes' standing workers: what programs left."""
    count = 0
    for process in broker.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name = process.name()
            standing = name in ("kcoral-zygote", "kcoral-forker", "kcoral-worker", "bwrap")
            if not standing and "zygote" not in " ".join(process.cmdline()[:4]):
                count += 1
    return count


def sample_rss(pid: int, campaign: Campaign, stop: threading.Event) -> None:
    process = psutil.Process(pid)
    while not stop.wait(0.5):
        with contextlib.suppress(psutil.Error):
            campaign.rss_samples.append(process.memory_info().rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--sandbox", choices=("none", "bubblewrap"), default="bubblewrap")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cache-bytes", default=None, help="the broker's --cache-bytes (default its own)")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kcoral-campaign-"))
    memory_limit = max(MEMORY_LIMIT_BYTES, (preloaded_data_bytes() or 0) + ROOM_BYTES)
    flags = [*FLAGS, "--memory-limit", str(memory_limit), "--sandbox", args.sandbox]
    if args.cache_bytes:
        flags += ["--cache-bytes", args.cache_bytes]
    service: RunningService = start_broker(work, *flags, log_level="warning", timeout_seconds=180)
    campaign = Campaign()
    try:
        broker = psutil.Process(service.process.pid)
        rss_before = broker.memory_info().rss
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(service.process.pid, campaign, stop), daemon=True)
        sampler.start()
        started = time.monotonic()
        with raw_peers(service.url):
            time.sleep(1.0)
            rss_with_peers = broker.memory_info().rss
            asyncio.run(run_programs(service.url, args.count, args.concurrency, args.sandbox, args.seed, campaign))
        wall = time.monotonic() - started
        time.sleep(2.0)  # the last workers' exits
        stop.set()
        health = service.health()
        leftovers = program_processes(broker)
        rss_after = broker.memory_info().rss
        slots = service.run_dir / "slots" if service.run_dir else None
        slot_dirs = list(slots.iterdir()) if slots is not None and slots.exists() else []
        # Beyond a clean slot's: the run directory made ready for the next worker is one.
        workspace_left = [
            f"{slot.name}/{entry}"
            for slot in slot_dirs
            for entry in run_directory.leftovers(slot, besides=(SHARED_MEMORY.name,))
        ]
        alive = service.process.poll() is None and health["status"] == "ok"
        accounting = health.get("memory_accounting") or {"kind": "unknown"}
    finally:
        code = service.stop()
    # The memory cgroups of the workers and the broker's own directory, all gone after the stop.
    cgroup = Path(accounting["cgroup"]) if accounting.get("cgroup") else None
    cgroups_left = sum(1 for _ in cgroup.rglob("*") if _.is_dir()) + 1 if cgroup and cgroup.exists() else 0

    table = kinds(args.sandbox)
    honest = {k.name for k in table if k.honest}
    by_kind: dict[str, Counter[str]] = {}
    rows = []
    for kind in table:
        mine = [o for o in campaign.outcomes if o.kind == kind.name]
        by_kind[kind.name] = Counter(fate_class(o.fate) for o in mine)
        role = "honest" if kind.honest else "hostile"
        rows.append([kind.name, role, len(mine), kind.goal, sum(o.met for o in mine), dict(by_kind[kind.name])])
    print_table(f"campaign ({args.sandbox})", ["kind", "", "programs", "goal", "at goal", "outcomes"], rows)
    honest_bad = sum(1 for o in campaign.outcomes if not o.met and o.kind in honest)
    peak = max(campaign.rss_samples or [rss_before])
    cache = health["cache"]
    summary = {
        "count": args.count,
        "sandbox": args.sandbox,
        "memory_limit_mib": round(memory_limit / 2**20, 1),
        "answered": len(campaign.outcomes),
        "at_goal": sum(o.met for o in campaign.outcomes),
        "honest_lost_or_wrong": honest_bad,
        "broker_alive": alive,
        "broker_exit_code": code,
        "program_processes_left": leftovers,
        "leases_held": sum(1 for lease in health["leases"].values() if lease["holder"] is not None),
        "workspace_entries_left": len(workspace_left),
        "memory_accounting": accounting.get("kind"),
        "memory_cgroups_left": cgroups_left,
        "rss_mib": {
            "before": round(rss_before / 2**20, 1),
            "with_raw_peers": round(rss_with_peers / 2**20, 1),
            "peak": round(peak / 2**20, 1),
            "after": round(rss_after / 2**20, 1),
        },
        "cache_memory_mib": round(cache["bytes"] / 2**20, 1),
        "cache_entries": cache["entries"],
        "wall_s": round(wall, 1),
        "misses": [f"{o.kind}: {o.fate}" for o in campaign.outcomes if not o.met][:40],
        "workspace_left": workspace_left[:40],
    }
    print(textwrap.indent("\n".join(f"{k}: {v}" for k, v in summary.items() if not isinstance(v, list)), "  "))
    for miss in summary["misses"]:
        print("  missed:", miss)
    for entry in summary["workspace_left"]:
        print("  left in a slot's workspace:", entry)
    if args.json:
        save_json(args.json, {"summary": summary, "kinds": {k: dict(v) for k, v in by_kind.items()}})
    good = (
        summary["answered"] == args.count
        and summary["at_goal"] == args.count
        and alive
        and leftovers == 0
        and summary["leases_held"] == 0
        and not workspace_left
        and cgroups_left == 0
    )
    let_go_of(work, failed=not good)  # its blob cache held 0.8 GiB after 1,000 programs
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
