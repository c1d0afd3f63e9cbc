"""Operators' view: after a known sequence of programs, the Prometheus endpoint and ``kcoral status``
(``--json`` and ``--watch``) report the right counts, for a broker and through a router."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kcoral import Client, KCoralError, Program
from kcoral.service.metrics import outcome_of, parse_listen
from tests.helpers import BrokerFactory, RunningBroker, free_port
from tests.test_router import node_broker, router_factory, wait_live

__all__ = ["router_factory"]  # a fixture, used by name

SOURCE = (
    "import os, time\n"
    "def nap(s):\n    time.sleep(s)\n    return s\n"
    "def fail():\n    raise RuntimeError('no')\n"
    "def crash():\n    os._exit(3)\n"
)


def call(name: str, *args: Any, cpu_only: bool = False) -> Program:
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=SOURCE), name=name, cpu_only=cpu_only)
    program.return_(key="v", value=program.run(fn=fn, args=list(args)))
    return program


def known_sequence(url: str) -> None:
    """3 completed, 2 failed (runtime), 1 timed out."""
    with Client(url) as client:
        for _ in range(3):
            assert client.execute(call("nap", 0.01)).completed
        assert client.execute(call("fail", cpu_only=True)).error["kind"] == "runtime"  # type: ignore[index]
        assert client.execute(call("crash", cpu_only=True)).error["kind"] == "runtime"  # type: ignore[index]
        with pytest.raises(KCoralError) as caught:
            client.execute(call("nap", 30, cpu_only=True), timeout_seconds=0.5)
        assert caught.value.kind == "timeout"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def health(url: str) -> dict[str, Any]:
    with Client(url, connect_timeout_seconds=5) as client:
        return client.health()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def status(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-m", "kcoral", "status", url, *flags], capture_output=True, text=True, timeout=60, env=env
    )


def test_the_broker_counts_programs_by_outcome_and_kind(broker_factory: BrokerFactory) -> None:
    port = free_port()
    broker = broker_factory("--fake-gpus", "1", "--metrics-listen", f"127.0.0.1:{port}")
    known_sequence(broker.url)
    wait_for(lambda: health(broker.url)["workers"]["idle"] == 1, "the slot is back")

    metrics = scrape(port)
    assert metrics[("kcoral_programs_total", (("error_kind", ""), ("outcome", "completed")))] == 3
    assert metrics[("kcoral_programs_total", (("error_kind", "runtime"), ("outcome", "failed")))] == 2
    assert metrics[("kcoral_programs_total", (("error_kind", "timeout"), ("outcome", "error")))] == 1
    assert metrics[("kcoral_end_to_end_seconds_count", ())] == 6
    assert metrics[("kcoral_queue_seconds_count", ())] == 6
    assert metrics[("kcoral_lease_hold_seconds_count", ())] == 3  # the naps that held the GPU
    assert metrics[("kcoral_queue_depth", ())] == 0
    assert metrics[("kcoral_programs_running", ())] == 0
    assert metrics[("kcoral_capacity", ())] == 1 and metrics[("kcoral_gpus", ())] == 1
    assert metrics[("kcoral_workers", (("state", "idle"),))] == 1
    assert metrics[("kcoral_gpu_lease_held", (("gpu", "0"),))] == 0
    assert ("kcoral_cache_hits_total", ()) in metrics and ("kcoral_cache_bytes", (("tier", "memory"),)) in metrics
    restarts = metrics[("kcoral_worker_restarts_total", (("gpu", "0"), ("slot", "0")))]
    assert restarts >= 0

    done = status(broker.url, "--json")
    assert done.returncode == 0, done.stderr
    counters = json.loads(done.stdout)["counters"]
    assert counters["completed"] == 3 and counters["failed"] == 2 and counters["errors"] == 1
    assert counters["failed_by_kind"] == {"runtime": 2} and counters["errors_by_kind"] == {"timeout": 1}

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
        assert b"kcoral_programs_total" in answer.read()
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing", timeout=10)
    assert missing.value.code == 404


def test_watch_renders_running_and_waiting_programs(broker_factory: BrokerFactory) -> None:
    broker = broker_factory("--fake-gpus", "1")
    threads = [threading.Thread(target=_run_quietly, args=(broker, call("nap", 3))) for _ in range(2)]
    for thread in threads:
        thread.start()
    with Client(broker.url) as client:
        wait_for(lambda: client.health()["load"]["requests_waiting"] == 1, "one runs, one waits")
    done = status(broker.url, "--watch", "--count", "2", "--interval", "0.2")
    for thread in threads:
        thread.join()
    assert done.returncode == 0, done.stderr
    pages = done.stdout.split("every 0.2 s\n")[1:]
    assert len(pages) == 2
    page = pages[0]
    assert "capacity  1 at once on 1 GPU (fake): 1 running, 1 waiting" in page
    assert "programs  2 in flight" in page
    rows = [line.split() for line in page.splitlines() if line.startswith("  ") and "c-" in line]
    assert sorted(row[2] for row in rows) == ["queued", "running"]
    running = next(row for row in rows if row[2] == "running")
    assert running[-1] == "0"  # its GPU
    assert "leases" in page and "workers   1 slots: 0 idle, 1 busy" in page

    as_json = status(broker.url, "--json", "--count", "2", "--interval", "0.1")
    lines = as_json.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["instance_id"] for line in lines)


def _run_quietly(broker: RunningBroker, program: Program) -> None:
    with Client(broker.url) as client:
        client.execute(program)


def test_a_bad_metrics_address_is_a_usage_error() -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-m", "kcoral", "broker", "--metrics-listen", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert "--metrics-listen: expected HOST:PORT" in done.stderr and len(done.stderr.splitlines()) == 1


def test_listen_addresses_and_outcomes_read_as_documented() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen(":9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", "host:0", "host:99999", "http://host:1"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    assert outcome_of({"ok": True, "result": {"status": "COMPLETED"}}) == ("completed", "")
    assert outcome_of({"ok": True, "result": {"status": "FAILED", "error": {"kind": "gpu_access"}}}) == (
        "failed",
        "gpu_access",
    )
    assert outcome_of({"ok": False, "error": {"kind": "busy"}}) == ("error", "busy")
    assert outcome_of({"ok": False}) == ("error", "engine")


def test_the_router_counts_programs_and_nodes(router_factory: Any, broker_factory: BrokerFactory) -> None:
    port = free_port()
    router = router_factory("--metrics-listen", f"127.0.0.1:{port}")
    for node_id in ("a", "b"):
        node_broker(broker_factory, router, node_id)
    wait_live(router, "a", "b")
    with Client(router.url) as client:
        for _ in range(3):
            assert client.execute(call("nap", 0.01)).completed
        assert client.execute(call("fail", cpu_only=True)).error["kind"] == "runtime"  # type: ignore[index]

    metrics = scrape(port)
    assert metrics[("kcoral_programs_total", (("error_kind", ""), ("outcome", "completed")))] == 3
    assert metrics[("kcoral_programs_total", (("error_kind", "runtime"), ("outcome", "failed")))] == 1
    assert metrics[("kcoral_end_to_end_seconds_count", ())] == 4
    assert metrics[("kcoral_nodes", (("state", "live"),))] == 2
    assert metrics[("kcoral_info", (("instance_id", router.health()["instance_id"]), ("role", "router")))] == 1

    counters = json.loads(status(router.url, "--json").stdout)["counters"]
    assert counters["completed"] == 3 and counters["failed"] == 1 and counters["failed_by_kind"] == {"runtime": 1}
    page = status(router.url, "--count", "1").stdout
    assert "nodes     2 live of 2" in page
    assert {line.split()[0] for line in page.splitlines() if line.startswith("  ") and " live " in line} == {"a", "b"}


def test_a_metrics_port_in_use_is_one_line() -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "kcoral", "router", "--listen", f"tcp://127.0.0.1:{free_port()}"]
        argv += ["--nodes-listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-listen", f"127.0.0.1:{port}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 78
    assert len(done.stderr.strip().splitlines()) == 1
    assert f"cannot listen on 127.0.0.1:{port} for metrics" in done.stderr and "in use" in done.stderr
