"""Results and error maps: the builders in kcoral.protocol.results, and the same keys from every producer.

A real broker and a real router (with a node behind it) are driven to each kind of ending with a raw
DEALER socket, and the FINAL bodies they send are compared key by key: a client never has to guess
which fields a result or an error has from the way a program ended or from the service it asked.
"""

from __future__ import annotations

import ast
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kcoral import Client, Program, protocol
from kcoral.testing import RunningService, start_router
from tests.helpers import start_broker

pytestmark = pytest.mark.timeout(120)

REPLY_TIMEOUT_SECONDS = 30.0

# --- the builders ---------------------------------------------------------------------------------


def test_error_map_has_every_key_and_an_instruction_error_names_its_instruction() -> None:
    assert tuple(protocol.error_map("runtime", "boom")) == protocol.ERROR_KEYS
    error = protocol.instruction_error("runtime", "boom", 2, {"op": "run", "id": "run_2"}, "Traceback ...")
    assert error == {
        "kind": "runtime",
        "message": "boom",
        "instruction_index": 2,
        "instruction_op": "run",
        "instruction_id": "run_2",
        "traceback": "Traceback ...",
    }


@pytest.mark.parametrize("instruction", [None, 7, [], {"op": 3, "id": ["x"]}, {}])
def test_a_malformed_instruction_leaves_op_and_id_empty(instruction: object) -> None:
    error = protocol.instruction_error("parse", "bad", 0, instruction)
    assert tuple(error) == protocol.ERROR_KEYS
    assert error["instruction_op"] is None and error["instruction_id"] is None and error["instruction_index"] == 0


def test_program_result_is_failed_exactly_when_it_has_an_error() -> None:
    completed = protocol.program_result("r1", results={"v": 1}, gpu_ids=(0, 1))
    assert tuple(completed) == protocol.RESULT_KEYS
    assert completed["status"] == protocol.COMPLETED and completed["error"] is None and completed["gpu_ids"] == [0, 1]
    failed = protocol.program_result("r1", error=protocol.error_map("runtime", "boom"))
    assert tuple(failed) == protocol.RESULT_KEYS
    assert failed["status"] == protocol.FAILED and failed["results"] == {}


def test_the_broker_fills_in_what_only_it_knows() -> None:
    worker_result = {**protocol.program_result("r1", results={"v": 1}), protocol.WORKER_KEY: {"pid": 1}}
    returned = protocol.with_broker_fields(worker_result, request_id="r1", queue_ms=2.5, gpu_ids=[1], node_id="n")
    assert returned["queue_ms"] == 2.5 and returned["gpu_ids"] == [1] and returned["node_id"] == "n"
    assert returned[protocol.WORKER_KEY] == {"pid": 1}
    assert worker_result["queue_ms"] == 0.0  # the worker's map is left as it was


def test_request_errors_travel_in_a_final_with_ok_false() -> None:
    command, body, frames = protocol.split_message(protocol.final_error("r1", "busy", "queue full"))
    assert command == protocol.FINAL and frames == []
    assert body == protocol.final_error_body("r1", "busy", "queue full")
    assert body == {"request_id": "r1", "ok": False, "error": {"kind": "busy", "message": "queue full"}}
    assert tuple(body["error"]) == protocol.REQUEST_ERROR_KEYS
    assert protocol.final_body("r1", {"status": "ok"}) == {"request_id": "r1", "ok": True, "result": {"status": "ok"}}


# --- every producer, through a real broker and a real router ------------------------------------------

NAP_SOURCE = "import time\ndef nap(seconds):\n    time.sleep(seconds)\n    return seconds\n"


def _call(source: str, name: str, *args: Any) -> dict[str, Any]:
    program = Program()
    module = program.upload(kind="module", source=source)
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name=name), args=list(args)))
    return program.to_wire()[0]


def _constant() -> dict[str, Any]:
    program = Program()
    program.return_(key="v", value=[1, "two"])
    return program.to_wire()[0]


# Each ending: how to reach it (program, options, cancel after seconds), and what it is.
ENDINGS: dict[str, tuple[dict[str, Any], dict[str, Any], float | None]] = {
    "completed": (_constant(), {}, None),
    "instruction_failed": (_call("def f():\n    raise ValueError('no')\n", "f"), {}, None),
    "checked_before_running": ({"instructions": [{"op": "no_such_op", "id": "x"}]}, {}, None),
    "syntax_error": (_call("def f(:\n", "f"), {}, None),
    "worker_died": (_call("import os\ndef f():\n    os._exit(3)\n", "f"), {}, None),
    "timeout": (_call(NAP_SOURCE, "nap", 10), {"timeout_seconds": 0.5}, None),
    "cancelled": (_call(NAP_SOURCE, "nap", 10), {}, 0.3),
    "capacity": (_constant(), {"gpu_count": 8}, None),
    "bad_options": (_constant(), {"no_such_option": 1}, None),
}


class RawClient:
    """A DEALER that sends EXECUTE and CANCEL and returns the FINAL body it gets back."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(url)

    def close(self) -> None:
        self.socket.close(linger=0)

    def execute(self, program: dict[str, Any], options: dict[str, Any], cancel_after: float | None) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        body = {"request_id": request_id, "program": program, "options": options, "blobs": []}
        self.socket.send_multipart(protocol.message(protocol.EXECUTE, body))
        cancel_at = None if cancel_after is None else time.monotonic() + cancel_after
        deadline = time.monotonic() + REPLY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if cancel_at is not None and time.monotonic() >= cancel_at:
                self.socket.send_multipart(protocol.message(protocol.CANCEL, {"request_id": request_id}))
                cancel_at = None
            if not self.socket.poll(50):
                continue
            command, reply, _ = protocol.split_message(self.socket.recv_multipart())
            if command == protocol.FINAL and reply.get("request_id") == request_id:
                return reply
        raise AssertionError(f"no FINAL for {request_id} within {REPLY_TIMEOUT_SECONDS} s")


def _shape(final: dict[str, Any]) -> dict[str, Any]:
    """The keys of a FINAL body, of its result or error, and of the result's error."""
    shape: dict[str, Any] = {"final": sorted(final)}
    if final.get("ok"):
        result = final["result"]
        shape["result"] = sorted(result)
        shape["status"] = result["status"]
        if result["error"] is not None:
            shape["error"] = sorted(result["error"])
            shape["kind"] = result["error"]["kind"]
    else:
        shape["request_error"] = sorted(final["error"])
        shape["kind"] = final["error"]["kind"]
    return shape


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A broker on its own, and a router with a node of the same shape behind it."""
    root = tmp_path_factory.mktemp("results")
    started: list[RunningService] = []
    try:
        started.append(start_broker(root, "--fake-gpus", "1", "--workers-per-gpu", "2"))
        router = start_router(root)
        started.append(router)
        assert router.nodes_url is not None
        node = ("--upstream", router.nodes_url, "--node-id", "node-a")
        started.append(start_broker(root, "--fake-gpus", "1", "--workers-per-gpu", "2", *node))
        _wait(lambda: [n["state"] for n in router.nodes().values()] == ["live"], "the node to register")
        yield {"broker": started[0].url, "router": router.url}
    finally:
        for service in reversed(started):
            service.stop()


def _wait(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def finals(services: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """The FINAL body of each ending, from the broker and from the router."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        replies: dict[str, dict[str, dict[str, Any]]] = {}
        for service, url in services.items():
            client = RawClient(context, url)
            try:
                replies[service] = {name: client.execute(*how) for name, how in ENDINGS.items()}
            finally:
                client.close()
        return replies
    finally:
        context.term()


def test_broker_and_router_end_each_way_with_the_same_keys(finals: dict[str, dict[str, dict[str, Any]]]) -> None:
    for name in ENDINGS:
        assert _shape(finals["router"][name]) == _shape(finals["broker"][name]), name


@pytest.mark.parametrize("service", ["broker", "router"])
def test_every_ending_uses_the_one_definition(finals: dict[str, dict[str, dict[str, Any]]], service: str) -> None:
    result_keys = sorted(protocol.RESULT_KEYS)
    with_worker = sorted((*protocol.RESULT_KEYS, protocol.WORKER_KEY))
    error_keys = sorted(protocol.ERROR_KEYS)
    expected = {
        "completed": {"result": with_worker, "status": "COMPLETED"},
        "instruction_failed": {"result": with_worker, "status": "FAILED", "error": error_keys, "kind": "runtime"},
        "checked_before_running": {"result": with_worker, "status": "FAILED", "error": error_keys, "kind": "parse"},
        "syntax_error": {"result": with_worker, "status": "FAILED", "error": error_keys, "kind": "parse"},
        # The worker is gone: the broker writes the result, without the worker's own map.
        "worker_died": {"result": result_keys, "status": "FAILED", "error": error_keys, "kind": "runtime"},
        "timeout": {"request_error": sorted(protocol.REQUEST_ERROR_KEYS), "kind": "timeout"},
        "cancelled": {"request_error": sorted(protocol.REQUEST_ERROR_KEYS), "kind": "cancelled"},
        "capacity": {"request_error": sorted(protocol.REQUEST_ERROR_KEYS), "kind": "capacity"},
        "bad_options": {"request_error": sorted(protocol.REQUEST_ERROR_KEYS), "kind": "parse"},
    }
    for name, want in expected.items():
        final = finals[service][name]
        body_keys = sorted(["ok", "request_id", "result" if final["ok"] else "error"])
        assert _shape(final) == {"final": body_keys, **want}, (name, final)


def test_a_module_with_a_syntax_error_fails_as_parse_at_its_upload(
    finals: dict[str, dict[str, dict[str, Any]]],
) -> None:
    for service in ("broker", "router"):
        error = finals[service]["syntax_error"]["result"]["error"]
        assert (error["kind"], error["instruction_index"], error["instruction_op"]) == ("parse", 0, "upload")
        assert error["instruction_id"] == "upload_0" and "SyntaxError" in error["message"]
        assert "line 1" in error["message"]


def test_a_failure_found_before_running_names_the_instruction(finals: dict[str, dict[str, dict[str, Any]]]) -> None:
    error = finals["broker"]["checked_before_running"]["result"]["error"]
    assert (error["instruction_index"], error["instruction_op"], error["instruction_id"]) == (0, "no_such_op", "x")


def test_a_result_through_a_router_names_its_node(finals: dict[str, dict[str, dict[str, Any]]]) -> None:
    for name in ("completed", "instruction_failed", "worker_died"):
        assert finals["router"][name]["result"]["node_id"] == "node-a", name
        assert finals["broker"][name]["result"]["node_id"] is None, name


def test_program_result_names_the_node(services: dict[str, str]) -> None:
    program = Program()
    program.return_(key="v", value=1)
    with Client(services["router"]) as client:
        assert client.execute(program).node_id == "node-a"
    with Client(services["broker"]) as client:
        assert client.execute(program).node_id is None


def test_a_worker_that_dies_is_reported_at_its_instruction(finals: dict[str, dict[str, dict[str, Any]]]) -> None:
    result = finals["broker"]["worker_died"]["result"]
    assert result["error"]["instruction_op"] == "run" and result["error"]["instruction_index"] == 2
    assert result["gpu_ids"] == [0] and result["queue_ms"] >= 0


def test_no_module_writes_a_result_or_an_error_map_by_hand() -> None:
    # Every producer builds through kcoral.protocol.results: a dict literal elsewhere with a key
    # that only results and error maps have is a second definition that can drift.
    # The zygote link's `exited` event (kcoral.protocol.zygote_link.worker_exit_fields) names the
    # instruction a worker died in too: an event of that link, defined once there, not a result.
    only_there = {"instruction_index", "instruction_op", "instruction_id", "stdout_truncated", "lease_wait_ms"}
    package = Path(protocol.__file__).resolve().parents[1]
    other_links = {(package / "protocol" / "zygote_link.py", "worker_exit_fields")}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "protocol" / "results.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        skipped = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and (path, node.name) in other_links
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and id(node) not in skipped:
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if keys & only_there:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not found, f"build these through kcoral.protocol.results: {found}"
