"""Prometheus metrics of a broker or a router, served on ``--metrics-listen HOST:PORT``.

Each service instance has a registry of its own (never prometheus_client's global one), so two
services in one process, or one test after another, never share counts. Two sources feed it:

* events: every program that ends is recorded once (:meth:`ServiceMetrics.program_finished`), by
  outcome (``completed``, ``failed``: an instruction failed, ``error``: the request could not run)
  and error kind, with histograms of its queue, lease wait, lease hold and end-to-end times;
* state: at each scrape, the service's ``health()`` map gives the gauges (queue depth, programs
  running, workers by state, restarts, cache, GPU leases, nodes by state), so there is no second
  copy of that state to drift.

The HTTP endpoint is a small asyncio server on the service's own loop, not prometheus_client's
thread: ``health()`` reads the loop's data structures, which only the loop may touch.

Example scrape (abridged)::

    kcoral_programs_total{outcome="completed",error_kind=""} 120.0
    kcoral_programs_total{outcome="error",error_kind="timeout"} 2.0
    kcoral_queue_depth 3.0
    kcoral_end_to_end_seconds_bucket{le="0.5"} 97.0
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = structlog.get_logger("kcoral.service.metrics")

# Programs take from a millisecond (a constant) to the 900 s timeout.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
OUTCOMES = ("completed", "failed", "error")
# A scrape is a few kB; a request bigger than this is not a Prometheus server.
MAX_REQUEST_BYTES = 16 << 10
REQUEST_READ_TIMEOUT_SECONDS = 5.0
_LISTEN = re.compile(r"(?:tcp://)?(\[[0-9a-fA-F:.]+\]|[^:/\[\]]*):([0-9]{1,5})")


class MetricsListenError(Exception):
    """Raised when the metrics endpoint cannot listen where it was told (an address in use)."""


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``tcp://`` optional, ``[::1]:PORT`` for IPv6) -> (host, port); ValueError."""
    match = _LISTEN.fullmatch(text.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9464, not {text!r}")
    host = match.group(1).strip("[]") or "0.0.0.0"
    return host, int(match.group(2))


def outcome_of(final: Mapping[str, Any]) -> tuple[str, str]:
    """(outcome, error kind) of a FINAL body that answers an EXECUTE."""
    if not final.get("ok"):
        error = final.get("error")
        return "error", str(error.get("kind", "engine")) if isinstance(error, Mapping) else "engine"
    result = final.get("result")
    result = result if isinstance(result, Mapping) else {}
    if result.get("status") == "COMPLETED":
        return "completed", ""
    error = result.get("error")
    return "failed", str(error.get("kind", "runtime")) if isinstance(error, Mapping) else "runtime"


class ServiceMetrics:
    """The metrics of one broker or router. ``health`` is the service's health() map."""

    def __init__(self, role: str, health: Callable[[], Mapping[str, Any]]) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=False)
        self.programs: Counter[tuple[str, str]] = Counter()

        def histogram(name: str, what: str) -> Histogram:
            return Histogram(f"kcoral_{name}_seconds", what, buckets=SECONDS_BUCKETS, registry=self.registry)

        self.queue_time = histogram("queue", "Time programs waited between queued and running")
        self.lease_wait = histogram("lease_wait", "Time programs waited for their GPU lease")
        self.lease_hold = histogram("lease_hold", "Time programs held their GPU lease")
        self.end_to_end = histogram("end_to_end", "Time from a program's arrival to its answer")
        self.registry.register(_StateCollector(self, health))

    def program_finished(
        self,
        final: Mapping[str, Any],
        *,
        end_to_end_seconds: float,
        queue_seconds: float | None = None,
    ) -> None:
        """Record one ended program from the FINAL body it was answered with."""
        outcome, kind = outcome_of(final)
        self.programs[(outcome, kind)] += 1
        self.end_to_end.observe(max(0.0, end_to_end_seconds))
        result = final.get("result")
        result = result if isinstance(result, Mapping) else {}
        queue_ms = result.get("queue_ms")
        if queue_seconds is None and isinstance(queue_ms, int | float):
            queue_seconds = queue_ms / 1000
        if queue_seconds is not None:
            self.queue_time.observe(max(0.0, queue_seconds))
        for histogram, key in ((self.lease_wait, "lease_wait_ms"), (self.lease_hold, "lease_held_ms")):
            value = result.get(key)
            if isinstance(value, int | float) and value > 0:
                histogram.observe(value / 1000)

    def program_refused(self, kind: str) -> None:
        """An EXECUTE answered with an error before it became a program (``busy``, ``parse``)."""
        self.programs[("error", kind)] += 1

    def counters(self) -> dict[str, Any]:
        """The counts for ``health()["counters"]``: totals per outcome and counts per error kind."""
        totals = {outcome: 0 for outcome in OUTCOMES}
        by_kind: dict[str, dict[str, int]] = {"failed": {}, "error": {}}
        for (outcome, kind), count in sorted(self.programs.items()):
            totals[outcome] += count
            if kind:
                by_kind[outcome][kind] = count
        return {
            "completed": totals["completed"],
            "failed": totals["failed"],
            "errors": totals["error"],
            "failed_by_kind": by_kind["failed"],
            "errors_by_kind": by_kind["error"],
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges from the service's health() at scrape time, plus the program counts."""

    def __init__(self, metrics: ServiceMetrics, health: Callable[[], Mapping[str, Any]]) -> None:
        self.metrics = metrics
        self.health = health

    def collect(self) -> Iterator[Metric]:
        programs = CounterMetricFamily(
            "kcoral_programs", "Programs that ended, by outcome and error kind", labels=["outcome", "error_kind"]
        )
        for outcome in OUTCOMES:  # every outcome present, at 0 too, so rate() works from the start
            if not any(o == outcome for o, _ in self.metrics.programs):
                programs.add_metric([outcome, ""], 0)
        for (outcome, kind), count in sorted(self.metrics.programs.items()):
            programs.add_metric([outcome, kind], count)
        yield programs
        health = self.health()
        info = GaugeMetricFamily("kcoral_info", "The service: role and instance", labels=["role", "instance_id"])
        info.add_metric([self.metrics.role, str(health.get("instance_id", ""))], 1)
        yield info
        load = health.get("load") or {}
        yield _gauge("kcoral_capacity", "Programs that can run at once", load.get("request_capacity"))
        yield _gauge("kcoral_programs_running", "Programs running now", load.get("requests_in_progress"))
        yield _gauge("kcoral_queue_depth", "Programs waiting (negotiating or queued)", load.get("requests_waiting"))
        yield _gauge("kcoral_gpus", "GPU lease tokens", health.get("gpu_count"))
        yield from _workers(health.get("workers"))
        yield from _leases(health.get("leases"))
        yield from _cache(health.get("cache"))
        yield from _nodes(health.get("nodes"))


def _gauge(name: str, what: str, value: Any) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, what)
    gauge.add_metric([], float(value) if isinstance(value, int | float) else 0.0)
    return gauge


def _workers(workers: Any) -> Iterator[Metric]:
    if not isinstance(workers, Mapping):
        return
    states = GaugeMetricFamily("kcoral_workers", "Worker slots by state", labels=["state"])
    states.add_metric(["idle"], float(workers.get("idle") or 0))
    states.add_metric(["busy"], float(workers.get("busy") or 0))
    slots = [z for z in workers.get("zygotes") or [] if isinstance(z, Mapping)]
    other = Counter(str(z.get("state")) for z in slots if z.get("state") != "running")
    for state, count in sorted(other.items()):
        states.add_metric([state], float(count))
    yield states
    restarts = CounterMetricFamily("kcoral_worker_restarts", "Zygote restarts per slot", labels=["slot", "gpu"])
    for zygote in slots:
        gpu = "" if zygote.get("gpu") is None else str(zygote.get("gpu"))
        restarts.add_metric([str(zygote.get("slot")), gpu], float(zygote.get("restarts") or 0))
    yield restarts


def _leases(leases: Any) -> Iterator[Metric]:
    if not isinstance(leases, Mapping):
        return
    held = GaugeMetricFamily("kcoral_gpu_lease_held", "1 while a program holds the GPU's lease", labels=["gpu"])
    waiting = GaugeMetricFamily("kcoral_gpu_lease_waiters", "Programs waiting for the GPU's lease", labels=["gpu"])
    for gpu, lease in sorted(leases.items()):
        if isinstance(lease, Mapping):
            held.add_metric([str(gpu)], 1.0 if lease.get("holder") else 0.0)
            waiting.add_metric([str(gpu)], float(len(lease.get("waiters") or [])))
    yield held
    yield waiting


def _cache(cache: Any) -> Iterator[Metric]:
    if not isinstance(cache, Mapping):
        return
    for name, key, what in (
        ("kcoral_cache_hits", "hits", "Blobs a program named that the cache held"),
        ("kcoral_cache_misses", "misses", "Blobs a program named that had to be sent"),
        ("kcoral_cache_evictions", "evictions", "Blobs evicted from the memory cache"),
    ):
        counter = CounterMetricFamily(name, what)
        counter.add_metric([], float(cache.get(key) or 0))
        yield counter
    size = GaugeMetricFamily("kcoral_cache_bytes", "Bytes in the blob cache", labels=["tier"])
    entries = GaugeMetricFamily("kcoral_cache_entries", "Blobs in the blob cache", labels=["tier"])
    size.add_metric(["memory"], float(cache.get("bytes") or 0))
    size.add_metric(["disk"], float(cache.get("disk_bytes") or 0))
    entries.add_metric(["memory"], float(cache.get("entries") or 0))
    entries.add_metric(["disk"], float(cache.get("disk_entries") or 0))
    yield size
    yield entries


def _nodes(nodes: Any) -> Iterator[Metric]:
    if not isinstance(nodes, list):
        return
    states = GaugeMetricFamily("kcoral_nodes", "Host brokers known to the router, by state", labels=["state"])
    counts = Counter(str(n.get("state")) for n in nodes if isinstance(n, Mapping))
    for state in sorted({"live", *counts}):
        states.add_metric([state], float(counts.get(state, 0)))
    yield states
    running = GaugeMetricFamily("kcoral_node_programs_running", "Programs running on each node", labels=["node"])
    for node in nodes:
        if isinstance(node, Mapping) and node.get("state") == "live":
            load = node.get("load") or {}
            running.add_metric([str(node.get("node_id"))], float(load.get("requests_in_progress") or 0))
    yield running


PROGRAMS_LISTED = 100  # programs in flight that health() lists; the rest are counted


def programs_in_flight(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """health()'s ``programs`` (running first, then the longest waiting, at most PROGRAMS_LISTED)
    and ``programs_total``, from one row per program in flight: ``request_id``, ``client``,
    ``state``, ``age_s``, ``gpu_ids`` (and ``node`` through a router)."""
    ordered = sorted(rows, key=lambda row: (row.get("state") != "running", -float(row.get("age_s") or 0)))
    return {"programs": ordered[:PROGRAMS_LISTED], "programs_total": len(rows)}


class MetricsServer:
    """``GET /metrics`` over HTTP/1.1 on the service's event loop."""

    def __init__(self, metrics: ServiceMetrics, listen: str) -> None:
        self.metrics = metrics
        self.host, self.port = parse_listen(listen)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Bind; MetricsListenError when the address is in use or not this host's."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_REQUEST_BYTES)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise MetricsListenError(f"cannot listen on {self.host}:{self.port} for metrics: {reason}") from exc
        sockets = self._server.sockets
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("metrics_listening", host=self.host, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_READ_TIMEOUT_SECONDS)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, body, kind = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
            elif path in ("/metrics", "/"):
                status, body, kind = "200 OK", self.metrics.exposition(), CONTENT_TYPE_LATEST
            else:
                status, body, kind = "404 Not Found", b"the metrics are at /metrics\n", "text/plain"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass  # not an HTTP client, or gone: nothing to answer
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


__all__ = ["MetricsListenError", "MetricsServer", "ServiceMetrics", "outcome_of", "parse_listen", "programs_in_flight"]
