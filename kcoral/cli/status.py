"""``kcoral status``: a broker's or a router's health() as a page of text, once or live.

The page: the service and its capacity; programs running and waiting (client, age, GPU, node);
per-GPU lease holder and waiters; worker slots and their states; the blob cache; through a router,
one row per node. ``--watch`` redraws it every ``--interval`` seconds (``--json`` then prints one
JSON object per line instead), until Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from kcoral.client.blocking import Client
from kcoral.errors import KCoralError
from kcoral.keys import ClientKeys
from kcoral.units import format_bytes

# ANSI: cursor home, clear the screen.
CLEAR_SCREEN = "\x1b[H\x1b[2J"
PROGRAM_ROWS = 20  # programs listed on the page; the rest are counted
SHORT_ID = 12


def render(health: Mapping[str, Any], url: str, *, now: float | None = None) -> str:
    """The status page of one health() map."""
    now = time.time() if now is None else now
    lines: list[str] = []
    role = str(health.get("role") or "broker")
    versions = health.get("versions") or {}
    started = health.get("started_at")
    uptime = _duration(now - started) if isinstance(started, int | float) else "?"
    lines.append(
        f"{role} {url}  {health.get('status')}  host {health.get('hostname', '?')}  up {uptime}  "
        f"kcoral {versions.get('kcoral', '?')}  instance {health.get('instance_id')}"
    )
    load = health.get("load") or {}
    gpus = health.get("gpu_count", 0)
    fake = " (fake)" if health.get("fake_gpus") else ""
    lines.append(
        f"capacity  {load.get('request_capacity')} at once on {gpus} GPU{'s' if gpus != 1 else ''}{fake}: "
        f"{load.get('requests_in_progress')} running, {load.get('requests_waiting')} waiting "
        f"(at most {load.get('max_queued')})"
    )
    counters = health.get("counters") or {}
    if counters:
        kinds = {**(counters.get("failed_by_kind") or {}), **(counters.get("errors_by_kind") or {})}
        detail = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        lines.append(
            f"ended     {counters.get('completed', 0)} completed, {counters.get('failed', 0)} failed, "
            f"{counters.get('errors', 0)} errors" + (f" ({detail})" if detail else "")
        )
    lines += _programs(health, now)
    lines += _gpus(health.get("target"))
    lines += _leases(health.get("leases"))
    lines += _sessions(health.get("sessions"))
    lines += _workers(health.get("workers"))
    lines += _cache(health.get("cache"))
    lines += _upstream(health.get("upstream"))
    lines += _nodes(health.get("nodes"))
    return "\n".join(lines) + "\n"


def not_ready(health: Mapping[str, Any]) -> str | None:
    """Why the service is not ready to take programs, or None when it is: ``kcoral status --ready``,
    the readiness probe of deploy/. A router is ready while it serves (it queues programs until a
    node registers); a broker once every worker slot has had a worker ready and, with
    ``--upstream``, while it is registered with its router."""
    if health.get("status") != "ok":
        return f"status {health.get('status')!r}"
    if health.get("role") == "router":
        return None
    if health.get("ready") is False:
        workers = health.get("workers")
        workers = workers if isinstance(workers, Mapping) else {}
        return f"worker slots starting: {workers.get('idle')} of {workers.get('slots')} ready"
    upstream = health.get("upstream")
    if isinstance(upstream, Mapping) and not upstream.get("registered"):
        return f"not registered with the router at {upstream.get('url')} as node {upstream.get('node_id')}"
    return None


def _upstream(upstream: Any) -> list[str]:
    if not isinstance(upstream, Mapping):
        return []
    registered = upstream.get("registered")
    state = f"registered (router {upstream.get('router_instance_id')})" if registered else "not registered"
    return [f"upstream  {upstream.get('url')} as node {upstream.get('node_id')}: {state}"]


def _programs(health: Mapping[str, Any], now: float) -> list[str]:
    programs = health.get("programs")
    if not isinstance(programs, list):
        return []
    total = health.get("programs_total", len(programs))
    if not programs:
        return ["programs  none"]
    through_router = any("node" in p for p in programs if isinstance(p, Mapping))
    rows = []
    for program in programs[:PROGRAM_ROWS]:
        if not isinstance(program, Mapping):
            continue
        gpus = ",".join(str(g) for g in program.get("gpu_ids") or []) or "-"
        row = [
            _short(program.get("request_id")),
            _short(program.get("client")),
            str(program.get("state")),
            _duration(program.get("age_s")),
            gpus,
        ]
        if through_router:
            row.append(str(program.get("node") or "-"))
        rows.append(row)
    header = ["request", "client", "state", "age", "gpu"] + (["node"] if through_router else [])
    more = int(total) - len(rows) if isinstance(total, int) else 0
    lines = [f"programs  {total} in flight" + (f", first {len(rows)} shown" if more > 0 else "")]
    return lines + _table(header, rows)


def _gpus(target: Any) -> list[str]:
    """The GPUs by the indices that gpu_ids and the leases use (through a router, with their node)."""
    listed = target.get("gpus") if isinstance(target, Mapping) else None
    gpus = [g for g in listed or [] if isinstance(g, Mapping)]
    if not gpus:
        return []
    through_router = any("node" in g for g in gpus)
    header = ["gpu", "name", "pci", "device", *(["node"] if through_router else [])]
    rows = []
    for gpu in gpus:
        keys = ("index", "name", "pci_bus_id", "device_node")
        row = ["-" if gpu.get(key) is None else str(gpu.get(key)) for key in keys]
        rows.append(row + ([str(gpu.get("node") or "-")] if through_router else []))
    return ["gpus", *_table(header, rows)]


def _leases(leases: Any) -> list[str]:
    if not isinstance(leases, Mapping) or not leases:
        return []
    rows = []
    for gpu, lease in sorted(leases.items(), key=lambda item: int(item[0]) if str(item[0]).isdigit() else 0):
        if not isinstance(lease, Mapping):
            continue
        held = lease.get("held_for_ms")
        waiters = [str(w) for w in lease.get("waiters") or []]
        shown = ", ".join(_short(w) for w in waiters[:3]) + (" ..." if len(waiters) > 3 else "")
        rows.append(
            [
                str(gpu),
                _short(lease.get("holder")) if lease.get("holder") else "-",
                _duration(held / 1000) if isinstance(held, int | float) else "-",
                f"{len(waiters)}" + (f": {shown}" if waiters else ""),
            ]
        )
    return ["leases", *_table(["gpu", "holder", "held", "waiting"], rows)]


def _sessions(sessions: Any) -> list[str]:
    """Client sessions (a client's programs in one worker, holding its GPUs' lease)."""
    if not isinstance(sessions, list) or not sessions:
        return []
    rows = []
    for session in sessions:
        if not isinstance(session, Mapping):
            continue
        age, idle = session.get("age_s"), session.get("idle_s")
        rows.append(
            [
                _short(session.get("client")),
                _short(session.get("worker")),
                ",".join(str(g) for g in session.get("gpu_ids") or []) or "-",
                str(session.get("programs")),
                "running" if session.get("running") else "idle",
                _duration(age) if isinstance(age, int | float) else "-",
                _duration(idle) if isinstance(idle, int | float) else "-",
            ]
        )
    return ["sessions", *_table(["client", "worker", "gpus", "programs", "now", "age", "idle"], rows)]


def _workers(workers: Any) -> list[str]:
    if not isinstance(workers, Mapping):
        return []
    lines = [f"workers   {workers.get('slots')} slots: {workers.get('idle')} idle, {workers.get('busy')} busy"]
    rows = []
    for zygote in workers.get("zygotes") or []:
        if isinstance(zygote, Mapping):
            gpu = "-" if zygote.get("gpu") is None else str(zygote.get("gpu"))
            rows.append(
                [
                    str(zygote.get("slot")),
                    gpu,
                    str(zygote.get("state")),
                    str(zygote.get("restarts", 0)),
                    str(zygote.get("last_error") or "-")[:60],
                ]
            )
    return lines + _table(["slot", "gpu", "state", "restarts", "last error"], rows)


def _cache(cache: Any) -> list[str]:
    if not isinstance(cache, Mapping):
        return []
    return [
        f"cache     memory {cache.get('entries', 0)} blobs, {format_bytes(cache.get('bytes') or 0)}; "
        f"disk {cache.get('disk_entries', 0)} blobs, {format_bytes(cache.get('disk_bytes') or 0)}; "
        f"{cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses, {cache.get('evictions', 0)} evictions"
    ]


def _nodes(nodes: Any) -> list[str]:
    if not isinstance(nodes, list):
        return []
    live = sum(1 for n in nodes if isinstance(n, Mapping) and n.get("state") == "live")
    rows = []
    for node in nodes:
        if not isinstance(node, Mapping):
            continue
        load = node.get("load") or {}
        rows.append(
            [
                str(node.get("node_id")),
                str(node.get("state")),
                str(node.get("gpus")),
                str(load.get("request_capacity", "-")),
                str(load.get("requests_in_progress", "-")),
                str(load.get("requests_waiting", "-")),
                str(node.get("in_flight", 0)),
                str(node.get("dispatched", 0)),
                _duration(node.get("last_heard_s")),
            ]
        )
    header = ["node", "state", "gpus", "slots", "running", "waiting", "in flight", "dispatched", "heard"]
    return [f"nodes     {live} live of {len(rows)}", *_table(header, rows)]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _short(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= SHORT_ID else text[: SHORT_ID - 1] + "…"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def check_ready(url: str, *, keys: ClientKeys | None = None) -> str | None:
    """:func:`not_ready` of the service's health; KCoralError when it cannot be asked."""
    with Client(url, connect_timeout_seconds=5.0, keys=keys) as client:
        return not_ready(client.health())


def show(url: str, *, as_json: bool, out: TextIO = sys.stdout, keys: ClientKeys | None = None) -> None:
    """Print the status once; KCoralError when the service cannot be asked."""
    with Client(url, connect_timeout_seconds=5.0, keys=keys) as client:
        health = client.health()
    out.write(json.dumps(health, indent=2, default=str) + "\n" if as_json else render(health, url))


def watch(
    url: str,
    *,
    as_json: bool,
    interval: float,
    count: int | None = None,
    out: TextIO = sys.stdout,
    keys: ClientKeys | None = None,
) -> None:
    """Redraw the status every ``interval`` seconds (``count`` times, or until Ctrl-C). On a
    terminal the page replaces the last one; otherwise pages follow each other, one JSON object per
    line with ``--json``. A service that stops answering is said so on the page, and asked again."""
    tty = out.isatty()
    shown = 0
    with Client(url, connect_timeout_seconds=5.0, keys=keys) as client:
        while count is None or shown < count:
            started = time.monotonic()
            try:
                health: dict[str, Any] | None = client.health()
                problem = ""
            except KCoralError as exc:  # silent for a while (restarting?): said on the page, asked again
                health, problem = None, str(exc)
            if as_json:
                out.write(json.dumps(health if health is not None else {"error": problem}, default=str) + "\n")
            else:
                page = render(health, url) if health is not None else f"{url}: {problem}\n"
                stamp = time.strftime("%H:%M:%S")
                out.write((CLEAR_SCREEN if tty else "\n" if shown else "") + f"{stamp}  every {interval:g} s\n" + page)
            out.flush()
            shown += 1
            if count is None or shown < count:
                time.sleep(max(0.0, interval - (time.monotonic() - started)))


__all__ = ["KCoralError", "check_ready", "not_ready", "render", "show", "watch"]
