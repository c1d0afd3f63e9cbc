"""The trusted harness of ``kcoral remote`` without a GPU: what crosses between the harness and the
candidate's process, the bracket arithmetic, the report's fields, and the stdout separation."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kcoral.errors import ExecutionError
from kcoral.timing import findings
from kcoral.workloads import bracket, harness
from kcoral.workloads.channel import MessageReader, deadline_after, send_message
from kcoral.workloads.format import load_workload
from kcoral.workloads.ipc import BufferMeta, SharedBuffer
from kcoral.workloads.session import OUTPUTS_KEPT, Reservoir, RoleFailed, RoleResult, Session, fresh_seed

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = """
import torch

def make_inputs(seed):
    return (torch.ones(4) * seed,)

def reference(x):
    return x * 2
"""


def _session(tmp_path: Path, stub: str, role: str = "candidate") -> Session:
    folder = tmp_path / "double"
    folder.mkdir(exist_ok=True)
    (folder / "workload.py").write_text(WORKLOAD)
    script = tmp_path / "stub.py"
    script.write_text(textwrap.dedent(stub))
    session = Session(
        None, load_workload(folder, f"kcoral_test_wl_{tmp_path.name}"), None, 30.0, [sys.executable, str(script)]
    )
    session.spawn()
    session.role = role
    return session


STUB_PROLOGUE = f"""
import json, os, stat, struct, sys
sys.path.insert(0, {str(REPO)!r})
from kcoral.workloads.channel import MessageReader, send_message
reader = MessageReader(0, lambda: 30.0)
"""


# ----------------------------------------------------------------------------- what crosses


def test_the_candidates_process_starts_with_nothing_of_the_harness(tmp_path: Path) -> None:
    """No argument, no seed in its environment, no descriptor but its stdin (a socket) and an
    stdout and stderr that are the harness's stderr."""
    seed = fresh_seed()
    out = tmp_path / "seen.json"
    session = _session(
        tmp_path,
        STUB_PROLOGUE
        + f"""
fds = {{}}
for name in os.listdir("/proc/self/fd"):
    try:
        st = os.fstat(int(name))
    except OSError:
        continue
    fds[name] = [stat.S_ISSOCK(st.st_mode), st.st_dev, st.st_ino]
open({str(out)!r}, "w").write(json.dumps({{"argv": sys.argv, "env": dict(os.environ), "fds": fds}}))
send_message(0, {{"type": "ready"}})
""",
    )
    try:
        assert session.expect("ready") == {"type": "ready", "payload_bytes": 0}
    finally:
        session.close()
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(tmp_path / "stub.py")]
    assert not any(str(seed) in value for value in seen["env"].values())
    fds = seen["fds"]
    assert fds["0"][0] is True  # stdin: the socket to the harness
    mine = os.fstat(2)
    for fd in ("1", "2"):  # stdout and stderr: this process's stderr
        assert fds[fd][1:] == [mine.st_dev, mine.st_ino]
    # Nothing else is inherited (the listing itself may hold one descriptor of /proc/self/fd).
    assert len(set(fds) - {"0", "1", "2"}) <= 1


def test_a_message_out_of_turn_from_the_candidate_fails_with_integrity(tmp_path: Path) -> None:
    session = _session(tmp_path, STUB_PROLOGUE + 'send_message(0, {"type": "timing", "report": {}})\nreader.read()\n')
    try:
        with pytest.raises(ExecutionError) as caught:
            session.expect("loaded", role="candidate")
        assert caught.value.kind == "integrity"
        assert "broke the harness's protocol" in caught.value.message
    finally:
        session.close()


def test_the_same_message_from_the_workload_is_a_runtime_error(tmp_path: Path) -> None:
    session = _session(
        tmp_path, STUB_PROLOGUE + 'send_message(0, {"type": "timing", "report": {}})\nreader.read()\n', role="baseline"
    )
    try:
        with pytest.raises(ExecutionError) as caught:
            session.expect("loaded", role="baseline")
        assert caught.value.kind == "runtime"
    finally:
        session.close()


def test_a_candidate_that_leaves_cleanly_in_the_middle_fails_with_integrity(tmp_path: Path) -> None:
    session = _session(tmp_path, STUB_PROLOGUE + "os._exit(0)\n")
    try:
        with pytest.raises(ExecutionError) as caught:
            session.expect("queued")
        assert caught.value.kind == "integrity" and "left in the middle" in caught.value.message
    finally:
        session.close()


def test_a_crashed_candidate_is_a_role_failure(tmp_path: Path) -> None:
    session = _session(tmp_path, STUB_PROLOGUE + "os._exit(3)\n")
    try:
        with pytest.raises(RoleFailed) as caught:
            session.expect("queued")
        assert caught.value.error["kind"] == "runtime" and "exit status 3" in caught.value.error["message"]
    finally:
        session.close()


def test_an_error_answer_is_a_role_failure_with_its_kind(tmp_path: Path) -> None:
    session = _session(
        tmp_path,
        STUB_PROLOGUE + 'send_message(0, {"type": "error", "kind": "compile", "message": "no custom_kernel"})\n',
    )
    try:
        with pytest.raises(RoleFailed) as caught:
            session.expect("loaded")
        assert caught.value.error["kind"] == "compile"
    finally:
        session.close()


def test_processes_left_behind_are_found_and_killed(tmp_path: Path) -> None:
    session = _session(
        tmp_path,
        STUB_PROLOGUE
        + 'import subprocess\nsubprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])\n'
        + 'send_message(0, {"type": "done"})\n',
    )
    try:
        session.expect("done")
    finally:
        session.close()
    assert session.leftovers


def test_messages_cross_both_ways_on_one_socket() -> None:
    import socket

    left, right = socket.socketpair()
    try:
        send_message(left.fileno(), {"type": "call", "seq": 3})
        send_message(right.fileno(), {"type": "queued", "call": 3})
        assert MessageReader(os.dup(right.fileno()), deadline_after(5)).read() == (
            {"type": "call", "seq": 3, "payload_bytes": 0},
            b"",
        )
        assert MessageReader(os.dup(left.fileno()), deadline_after(5)).read() == (
            {"type": "queued", "call": 3, "payload_bytes": 0},
            b"",
        )
    finally:
        left.close()
        right.close()


def test_the_runner_takes_no_argument() -> None:
    from kcoral.workloads import runner

    source = Path(runner.__file__).read_text()
    assert "sys.argv" not in source and "os.environ" not in source
    assert Session(None, None, None, 1.0).command == [sys.executable, "-m", "kcoral.workloads.runner"]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- bracket arithmetic


def _summary(values: list[float]) -> bracket.BracketSummary:
    return bracket.BracketSummary.of(values)


def test_a_cupti_figure_that_agrees_with_the_bracket_is_the_time() -> None:
    null = _summary([0.050] * 40)
    role = _summary([0.230] * 40)
    judged = bracket.judge(role, null, 0.178)
    assert judged.agrees and judged.time_source == "cupti" and judged.time_ms == 0.178
    assert judged.net_ms == pytest.approx(0.180)


def test_a_cupti_figure_below_the_bracket_is_suspect_and_the_bracket_is_the_time() -> None:
    null = _summary([0.050] * 40)
    role = _summary([0.230] * 40)
    judged = bracket.judge(role, null, 0.009)
    assert not judged.agrees and judged.time_source == "bracket"
    assert judged.time_ms == pytest.approx(0.180)
    assert judged.reason is not None and "below the harness's bracket" in judged.reason


def test_a_cupti_figure_above_the_bracket_is_suspect_and_the_larger_figure_is_kept() -> None:
    judged = bracket.judge(_summary([0.230] * 40), _summary([0.050] * 40), 0.5)
    assert not judged.agrees and judged.time_ms == 0.5 and judged.reason is not None


def test_no_cupti_figure_gives_the_bracket() -> None:
    judged = bracket.judge(_summary([0.3] * 10), _summary([0.1] * 10), None)
    assert not judged.agrees and judged.time_ms == pytest.approx(0.2)


def test_the_tolerance_grows_with_the_nulls_spread() -> None:
    steady = _summary([0.050] * 40)
    noisy = _summary([0.040, 0.060] * 20)
    assert bracket.tolerance_ms(steady) == bracket.ABS_TOLERANCE_MS
    assert bracket.tolerance_ms(noisy) == pytest.approx(bracket.NULL_SPREAD_FACTOR * noisy.iqr_ms)
    role = _summary([0.100] * 40)
    # 0.05 ms net; 0.03 is out of bounds with a steady null and within them with a noisy one.
    assert not bracket.judge(role, steady, 0.03).agrees
    assert bracket.judge(role, noisy, 0.03).agrees


def test_the_summary_keeps_the_latest_calls() -> None:
    summary = _summary([9.0] * 25 + [1.0] * 75)
    assert summary.calls == 75 and summary.median_ms == 1.0 and summary.min_ms == 1.0
    assert _summary([2.0, 4.0]).calls == 2
    with pytest.raises(ValueError):
        bracket.BracketSummary.of([])


def test_host_time_is_judged_against_the_baseline_of_the_same_run() -> None:
    gap = findings.HOST_GAP_REASON + " (0.1942 ms median) is far above the GPU time (0.0417 ms): ..."
    other = findings.OTHER_PROCESS_REASON + ": pid 12 (3% SM)"
    honest = {"host_ms_median": 0.20}
    baseline = {"host_ms_median": 0.19}
    assert bracket.timer_reasons([gap, other], honest, baseline) == []
    slow = {"host_ms_median": 0.9}
    kept = bracket.timer_reasons([gap], slow, baseline)
    assert len(kept) == 1 and "above 1.5x the baseline's" in kept[0]
    assert bracket.timer_reasons(["threads the program started are running: x"], honest, baseline) == [
        "threads the program started are running: x"
    ]


def test_a_half_stale_candidate_passes_the_checks_rarely() -> None:
    assert bracket.stale_pass_probability(OUTPUTS_KEPT, 0.5) == pytest.approx(0.5**16)
    assert bracket.stale_pass_probability(OUTPUTS_KEPT, 0.5) < 2e-5


def test_the_reservoir_keeps_each_call_with_the_same_chance() -> None:
    import random

    draws = random.Random(7)
    counts = [0] * 110
    for _ in range(3000):
        reservoir = Reservoir(16, draws.randrange)
        slots: dict[int, int] = {}
        for call in range(110):
            slot = reservoir.slot()
            if slot is not None:
                slots[slot] = call
        assert len(slots) == 16
        for call in slots.values():
            counts[call] += 1
    share = [count / 3000 for count in counts]
    assert all(abs(s - 16 / 110) < 0.04 for s in share), share


def test_speedup() -> None:
    assert bracket.speedup(0.2, 0.1) == 2.0
    assert bracket.speedup(None, 0.1) is None and bracket.speedup(0.2, 0.0) is None


# ----------------------------------------------------------------------------- report fields


def _role(name: str, cupti: float, brackets: list[float], reasons: list[str] | None = None) -> RoleResult:
    timing = {"latency_ms_median": cupti, "method": "cupti", "integrity": {"verdict": "ok", "reasons": reasons or []}}
    return RoleResult(name, brackets_ms=brackets, host_ms=[0.3] * len(brackets), timing=timing)


def test_the_timing_section_names_both_figures() -> None:
    null = _summary([0.05] * 40)
    section, reasons = harness.timing_section(_role("candidate", 0.18, [0.23] * 40), null, None, True)
    assert section is not None and reasons == []
    assert section["latency_ms_median"] == 0.18 and section["latency_ms_median_cupti"] == 0.18
    assert section["time_source"] == "cupti" and section["integrity"] == {"verdict": "ok", "reasons": []}
    assert section["bracket"]["net_ms"] == pytest.approx(0.18) and section["bracket"]["gated"] is True
    assert section["bracket"]["null_median_ms"] == 0.05 and section["bracket"]["agrees"] is True
    forged, why = harness.timing_section(_role("candidate", 0.009, [0.23] * 40), null, None, True)
    assert forged is not None and forged["latency_ms_median"] == pytest.approx(0.18)
    assert forged["latency_ms_median_cupti"] == 0.009 and forged["integrity"]["verdict"] == "suspect" and why


def test_a_suspect_baseline_makes_the_speedup_suspect() -> None:
    null = _summary([0.05] * 40)
    _, baseline_reasons = harness.timing_section(_role("baseline", 0.001, [0.23] * 40), null, None, True)
    assert baseline_reasons
    reasons = harness.report_reasons([], baseline_reasons)
    assert len(reasons) == 1 and "the speedup" in reasons[0]
    assert harness.report_reasons([], []) == []


def test_the_run_is_suspect_without_the_gate_or_with_leftovers() -> None:
    assert harness.report_reasons([], [], gate_error="CUDA error 801")[0].startswith("the gate")
    assert "left processes" in harness.report_reasons([], [], leftovers=True)[0]


# ----------------------------------------------------------------------------- stdout separation


def test_kcoral_remote_prints_only_the_report_on_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kcoral.tools import remote

    folder = tmp_path / "double"
    folder.mkdir()
    (folder / "workload.py").write_text(WORKLOAD)
    (tmp_path / "cand.py").write_text("def custom_kernel(x):\n    return x * 2\n")
    seen: dict[str, Any] = {}

    def fake_execute(options: Any, function: str, args: list[Any], **kwargs: Any) -> tuple[int, dict[str, Any]]:
        seen.update(kwargs, function=function)
        return 0, {"report": {"correct": True, "speedup": 1.0}}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(remote, "execute", fake_execute)
    args = argparse.Namespace(
        remote="tcp://127.0.0.1:1", send=[], fetch=[], timeout=60.0, connect_timeout=1.0,
        tool_args=["--", "double", "cand.py"], server_key=None, client_key=None,
    )  # fmt: skip
    assert remote.main(args) == 0
    assert seen == {"function": "evaluate_trusted", "report_only_on_stdout": True}
    out = capsys.readouterr().out
    assert json.loads(out) == {"correct": True, "speedup": 1.0}


def test_the_programs_stdout_can_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from kcoral.client.result import ProgramResult
    from kcoral.tools.adapter import show_output

    result = ProgramResult.__new__(ProgramResult)
    for name, value in {
        "stdout": '{"correct": true, "speedup": 25}\n', "stderr": "noise\n",
        "stdout_truncated": False, "stderr_truncated": False,
    }.items():  # fmt: skip
        object.__setattr__(result, name, value)
    show_output("remote", result, stdout=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == "" and '"speedup": 25' in captured.err and "noise" in captured.err


# ----------------------------------------------------------------------------- the timer's calls


class _Buffer(SharedBuffer):
    """A shared buffer's stand-in on the CPU: its tensor and meta, nothing allocated."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.meta = BufferMeta.of(torch, tensor)

    def close(self) -> None:
        pass


@pytest.fixture
def no_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)


def test_the_runner_hands_each_timed_output_over_before_asking_for_the_next_inputs(
    monkeypatch: pytest.MonkeyPatch, no_cuda_sync: None
) -> None:
    import socket

    import kcoral.timing.benchmark as timing_benchmark
    from kcoral.workloads import runner as runner_module

    ours, theirs = socket.socketpair()
    seen: list[Any] = []

    def fake_measure(fn: Any, *, config: Any, inputs: Any, keep_outputs: int) -> Any:
        for index in range(3):
            fn(*inputs(index))
        return SimpleNamespace(report={"latency_ms_median": 0.1})

    monkeypatch.setattr(timing_benchmark, "measure", fake_measure)
    runner = runner_module.Runner(torch, theirs.fileno())
    runner.inputs = (torch.ones(4),)
    runner.output = torch.zeros(4)
    runner.fn = lambda x: x * 2
    reader = MessageReader(os.dup(ours.fileno()), deadline_after(10))

    def harness_side() -> None:
        for index in range(3):
            header, _ = reader.read()  # type: ignore[misc]
            seen.append((header, runner.output.clone()))
            runner.inputs[0].fill_(float(index + 2))
            send_message(ours.fileno(), {"type": "inputs", "index": index})

    thread = threading.Thread(target=harness_side)
    thread.start()
    report = runner.measure({})
    thread.join(10)
    assert report == {"latency_ms_median": 0.1}
    assert [h["index"] for h, _ in seen] == [0, 1, 2]
    assert [h["handed"] for h, _ in seen] == [False, True, True]
    # The output handed with need(1) is call 0's (inputs 2 -> 4), with need(2) call 1's (3 -> 6).
    assert seen[1][1].tolist() == [4.0] * 4 and seen[2][1].tolist() == [6.0] * 4
    ours.close()
    theirs.close()


def test_an_output_of_another_shape_is_refused_when_handed_over(no_cuda_sync: None) -> None:
    import socket

    from kcoral.workloads import runner as runner_module

    left, right = socket.socketpair()
    runner = runner_module.Runner(torch, right.fileno())
    runner.output = torch.zeros(4)
    try:
        with pytest.raises(ExecutionError) as caught:
            runner.hand_over(torch.zeros(5))
        assert caught.value.kind == "correctness"
        with pytest.raises(ExecutionError):
            runner.hand_over(torch.zeros(4, dtype=torch.float64))
    finally:
        left.close()
        right.close()


def _measure_session(tmp_path: Path, stub: str) -> Session:
    session = _session(tmp_path, stub)
    session.torch = torch
    output = _Buffer(torch.zeros(4))
    session.sets = [[_Buffer(torch.zeros(4))]]
    session.inputs = session.sets[0]
    session.outputs = [output]
    session.output = output
    return session


MEASURE_STUB = (
    STUB_PROLOGUE
    + """
reader.read()  # measure
for index in range(40):
    send_message(0, {"type": "need", "index": index, "handed": index > 0})
    reader.read()
send_message(0, {"type": "timing", "report": {"latency_ms_median": 0.05}})
"""
)


def test_the_harness_keeps_a_sample_of_the_timers_outputs(tmp_path: Path, no_cuda_sync: None) -> None:
    session = _measure_session(tmp_path, MEASURE_STUB)
    result = RoleResult("candidate")
    try:
        assert session.measure(result, keep=8) == {"latency_ms_median": 0.05}
    finally:
        session.close()
    assert len(result.kept) == 8 and result.calls == 39
    assert len({seed for seed, _ in result.kept}) == 8


@pytest.mark.parametrize(
    "lie",
    [
        'send_message(0, {"type": "need", "index": 1, "handed": True})',
        'send_message(0, {"type": "need", "index": 0, "handed": True})',
        'send_message(0, {"type": "need", "index": 0, "handed": False})\nreader.read()\n'
        'send_message(0, {"type": "need", "index": 1, "handed": False})',
    ],
    ids=["index-out-of-turn", "handed-before-any-call", "output-not-handed"],
)
def test_the_timers_requests_are_checked(tmp_path: Path, no_cuda_sync: None, lie: str) -> None:
    session = _measure_session(tmp_path, STUB_PROLOGUE + "reader.read()\n" + lie + "\nreader.read()\n")
    try:
        with pytest.raises(ExecutionError) as caught:
            session.measure(RoleResult("candidate"), keep=4)
        assert caught.value.kind == "integrity"
    finally:
        session.close()
