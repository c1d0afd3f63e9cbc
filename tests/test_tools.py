"""The command-line adapters (``kcoral python``, ``ncu``, ``sanitizer``, ``iket``, ``remote``), run as
real ``python -m kcoral.cli`` subprocesses against a real broker on loopback.

Nsight Compute, Compute Sanitizer and run-iket are not installed here, so their "not installed"
answers are tested as they are, and their happy paths with small stand-ins put on the broker's PATH
for the length of one test.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from kcoral.tools import service_side
from tests.helpers import BrokerFactory, RunningBroker, free_port, start_broker

ADAPTER_TIMEOUT_S = 60.0  # a bound for one adapter run, never reached when things work


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder first on the broker's PATH; empty except while a test puts a stand-in tool there."""
    return tmp_path_factory.mktemp("fake-bin")


@pytest.fixture(scope="module")
def tool_broker(tmp_path_factory: pytest.TempPathFactory, fake_bin: Path) -> Iterator[RunningBroker]:
    broker = start_broker(
        tmp_path_factory.mktemp("tools-broker"),
        "--workers",
        "2",
        env={"PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    yield broker
    broker.stop()


def kcoral(cwd: Path, url: str | None, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``kcoral ARGV`` in ``cwd`` with KCORAL_URL set to ``url``."""
    env = dict(os.environ)
    env.pop("KCORAL_URL", None)
    if url is not None:
        env["KCORAL_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "kcoral.cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=ADAPTER_TIMEOUT_S,
    )


def install_tool(folder: Path, name: str, source: str) -> Path:
    """A stand-in for a GPU tool: a Python script named ``name``, executable."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(source))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --- kcoral python ---


def test_python_prints_remote_output_and_exits_with_its_status(tool_broker: RunningBroker, tmp_path: Path) -> None:
    done = kcoral(
        tmp_path,
        tool_broker.url,
        "python",
        "--",
        "-c",
        "import sys; print('hi'); print('oops', file=sys.stderr); sys.exit(3)",
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "hi\n"
    assert "oops" in done.stderr


def test_python_sends_files_and_folders_and_fetches_them_back(tool_broker: RunningBroker, tmp_path: Path) -> None:
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "nested").mkdir()
    (tmp_path / "inputs" / "nested" / "n.txt").write_text("nested input")
    (tmp_path / "config.txt").write_text("scale=3")
    (tmp_path / "experiment.py").write_text(
        textwrap.dedent(
            """
            import pathlib, sys
            scale = int(pathlib.Path("config.txt").read_text().split("=")[1])
            text = pathlib.Path("inputs/nested/n.txt").read_text()
            print(text, scale, sys.argv[1:])
            out = pathlib.Path("results/deep")
            out.mkdir(parents=True)
            (out / "r.txt").write_text(str(scale * 2))
            pathlib.Path("results/top.txt").write_text("top")
            pathlib.Path("summary.txt").write_text("fresh")
            """
        )
    )
    (tmp_path / "summary.txt").write_text("stale")  # a fetched file replaces what is here
    done = kcoral(
        tmp_path,
        tool_broker.url,
        "python",
        "--send",
        "config.txt",
        "--send",
        "inputs",
        "--fetch",
        "summary.txt",
        "--fetch",
        "results",
        "--fetch",
        "never-written.txt",
        "--",
        "experiment.py",  # sent without --send: it is a local file
        "a",
        "b",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "nested input 3 ['a', 'b']\n"
    assert (tmp_path / "summary.txt").read_text() == "fresh"
    assert (tmp_path / "results" / "top.txt").read_text() == "top"
    assert (tmp_path / "results" / "deep" / "r.txt").read_text() == "6"
    assert "--fetch never-written.txt: no such file or folder" in done.stderr
    assert not (tmp_path / "never-written.txt").exists()


def test_python_runs_a_module_from_a_sent_package(tool_broker: RunningBroker, tmp_path: Path) -> None:
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "check.py").write_text("import sys\nprint('checked', sys.argv[1])\n")
    done = kcoral(tmp_path, tool_broker.url, "python", "--send", "kernels", "--", "-m", "kernels.check", "gemm")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "checked gemm\n"


def test_an_absolute_send_goes_under_its_base_name(tool_broker: RunningBroker, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "weights").mkdir(parents=True)
    (elsewhere / "table.txt").write_text("table")
    (elsewhere / "weights" / "w.txt").write_text("w")
    script = elsewhere / "probe.py"
    script.write_text("print(open('table.txt').read(), open('weights/w.txt').read())\n")
    work = tmp_path / "work"
    work.mkdir()
    done = kcoral(
        work,
        tool_broker.url,
        "python",
        "--send",
        str(elsewhere / "table.txt"),
        "--send",
        str(elsewhere / "weights"),
        "--",
        str(script),  # an absolute script is sent as probe.py and run under that name
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "table w\n"


def test_a_tool_past_its_timeout_is_stopped_and_its_output_kept(tool_broker: RunningBroker, tmp_path: Path) -> None:
    started = time.monotonic()
    done = kcoral(
        tmp_path,
        tool_broker.url,
        "python",
        "--timeout",
        "2",
        "--",
        "-c",
        "import time; print('started', flush=True); time.sleep(60)",
    )
    assert done.returncode == 124, done.stderr
    assert done.stdout == "started\n"
    assert "ran past the time limit" in done.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--send", "no-such-file", "--", "-c", "1"], "--send no-such-file: no such file or folder"),
        (["--send", "../outside", "--", "-c", "1"], "contains '..'"),
        (["--fetch", "/etc/hostname", "--", "-c", "1"], "is absolute"),
        ([], "after --"),
        (["--remote", "http://example.com", "--", "-c", "1"], "bad service URL"),
    ],
)
def test_usage_errors_exit_2_with_a_message(tmp_path: Path, argv: list[str], message: str) -> None:
    (tmp_path / "outside").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    done = kcoral(work, "tcp://127.0.0.1:1", "python", *argv)
    assert done.returncode == 2
    assert message in done.stderr


def test_no_service_url_is_a_usage_error(tmp_path: Path) -> None:
    done = kcoral(tmp_path, None, "python", "--", "-c", "1")
    assert done.returncode == 2
    assert "--remote URL or set KCORAL_URL" in done.stderr


def test_an_unreachable_service_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = kcoral(tmp_path, url, "python", "--connect-timeout", "1", "--", "-c", "print(1)")
    assert done.returncode == 69
    assert f"no answer from {url}" in done.stderr
    assert done.stdout == ""
    assert time.monotonic() - started < 10


@pytest.mark.bubblewrap
def test_python_sends_and_fetches_inside_the_sandbox(broker_factory: BrokerFactory, tmp_path: Path) -> None:
    try:
        check_bwrap()
    except SandboxUnavailable as exc:
        pytest.skip(f"bwrap cannot run here: {exc}")
    broker = broker_factory("--workers", "1", "--sandbox", "bubblewrap")
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "x.txt").write_text("inside")
    code = (
        "import os, pathlib; print(open('inputs/x.txt').read(), os.getcwd().startswith('/workspace'));"
        "pathlib.Path('made/sub').mkdir(parents=True); pathlib.Path('made/sub/y.txt').write_text('y')"
    )
    done = kcoral(tmp_path, broker.url, "python", "--send", "inputs", "--fetch", "made", "--", "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "inside True\n"
    assert (tmp_path / "made" / "sub" / "y.txt").read_text() == "y"


# --- ncu, sanitizer, iket ---


@pytest.mark.parametrize(
    ("adapter", "program"),
    [("ncu", "ncu"), ("sanitizer", "compute-sanitizer"), ("iket", "run-iket")],
)
def test_a_tool_missing_on_the_service_exits_127_and_says_so(
    tool_broker: RunningBroker, tmp_path: Path, adapter: str, program: str
) -> None:
    (tmp_path / "bench.py").write_text("print('should not run')\n")
    done = kcoral(tmp_path, tool_broker.url, adapter, "--", "bench.py")
    assert done.returncode == 127, done.stderr
    assert f"{program}" in done.stderr and "not installed on the service" in done.stderr
    assert "should not run" not in done.stdout
    assert "--fetch" not in done.stderr  # the report it never wrote is not complained about
    assert list(tmp_path.iterdir()) == [tmp_path / "bench.py"]


FAKE_NCU = """
import pathlib, subprocess, sys
args = sys.argv[1:]
if "--import" in args:
    print('"ID","Kernel Name","gpu__time_duration.sum"')
    print('"0","fake_kernel","1234"')
    sys.exit(0)
name = args[args.index("-o") + 1]
target = args[args.index("-o") + 2 :]
pathlib.Path(name + ".ncu-rep").write_text("report of " + " ".join(target[1:]))
print("==PROF== fake ncu", file=sys.stderr, flush=True)
sys.exit(subprocess.call(target))
"""


def test_ncu_fetches_the_report_and_its_csv(tool_broker: RunningBroker, fake_bin: Path, tmp_path: Path) -> None:
    tool = install_tool(fake_bin, "ncu", FAKE_NCU)
    try:
        (tmp_path / "bench.py").write_text("import sys\nprint('benching', sys.argv[1])\nsys.exit(5)\n")
        done = kcoral(tmp_path, tool_broker.url, "ncu", "--report", "prof/gemm", "--", "bench.py", "4096")
    finally:
        tool.unlink()
    assert done.returncode == 5, done.stderr  # the profiled script's status, through ncu
    assert done.stdout == "benching 4096\n"
    assert "==PROF== fake ncu" in done.stderr
    assert (tmp_path / "prof" / "gemm.ncu-rep").read_text() == "report of bench.py 4096"
    assert "fake_kernel" in (tmp_path / "prof" / "gemm.csv").read_text()
    assert "saved prof/gemm.ncu-rep" in done.stderr


# A stand-in for run-iket 4.8.1 (nvidia-cutlass-dsl-libs-base, iket/cli): the same command line
# (its own options, then `profile` and its options, then `--` and the workload), the same passes (the
# workload runs twice, a tracker pass and the traced pass, with CUTE_DSL_COMPILER_OPT=iket and
# IKET_INJECTION_CONFIG naming the pass's config), the same messages, files and exit statuses as its
# source reads (run on this CPU machine, the real run-iket gives the same transcript and status 1 for a
# failing workload, and the assertion below for one without a CUDA context). What the native
# injection library would record, the workload here writes itself:
# FAKE_KERNEL appends its named ranges to `ranges.json` in the pass's folder. The decoded JSON's shape
# is the one kcoral.tools.iket_trace reads (its field names are the decoder's; their nesting is not
# confirmed on a GPU yet). A workload that records no range takes the path of run_iket.py for a tracker
# that found no instrumented launch: no buffer, no raw capture, no trace, the workload's exit status.
FAKE_RUN_IKET = """
import argparse, gzip, json, os, pathlib, shutil, subprocess, sys

def say(*words):
    print("[run-iket]", *words, flush=True)

parser = argparse.ArgumentParser(prog="run-iket")
parser.add_argument("--context-buffer-size")
parser.add_argument("--log-level", choices=["error", "warn", "info"], default="error")
parser.add_argument("--working-dir")
parser.add_argument("--output-dir", "-o")
parser.add_argument("--clobber", action="store_true")
sub = parser.add_subparsers(required=True)
profile = sub.add_parser("profile")
profile.add_argument("--postprocess", choices=["perfetto", "json", "html", "none", "all"], default="perfetto")
profile.add_argument("--keep", action=argparse.BooleanOptionalAction, default=False)
profile.add_argument("--enabled-cluster")
args, unknown = parser.parse_known_args()
if not unknown or unknown == ["--"]:
    parser.error('profile requires a workload command after "--"')
if unknown[0] != "--":
    raise RuntimeError('Command MUST start with "--"!')
workload = unknown[1:]
work = pathlib.Path.cwd().resolve()
out = pathlib.Path(args.output_dir).resolve() if args.output_dir else work / "iket_output"
if out == work or out in work.parents:
    raise RuntimeError(f"Refusing to use {out} as the run-iket output directory")
if out.exists():
    if not args.clobber:
        say(f"Output directory {out} already exists. Exit now.")
        sys.exit(1)
    say(f"Removing existing output directory: {out}")
    shutil.rmtree(out)
out.mkdir(parents=True)

def launch(job):
    folder = out / job
    folder.mkdir()
    config = folder / f"{job}.config.json"
    config.write_text(json.dumps({"outputDir": str(folder), "toolName": job}))
    env = dict(os.environ, CUTE_DSL_COMPILER_OPT="iket", IKET_INJECTION_CONFIG=str(config))
    done = subprocess.run(workload, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    sys.stdout.write(done.stdout.decode())
    sys.stdout.flush()
    if done.returncode != 0:
        say(f"Launch GPU workload exits abnormally with return code: {done.returncode} => Tool: {job}, Job: {job}")
    ranges = json.loads((folder / "ranges.json").read_text()) if (folder / "ranges.json").exists() else None
    return done.returncode, ranges

say("============= Dry run application first to collect some info... =============")
code, ranges = launch("tracker")
if code != 0:
    say(f"Tracker failed with return code: {code}")
    sys.exit(1)
if ranges is None:  # no CUDA context, so no tracker record: an assertion of run_iket.py, uncaught
    print("Traceback (most recent call last):", file=sys.stderr)
    print("AssertionError: recommended_max_ts_cnt_per_warp is not found in tracker", file=sys.stderr)
    sys.exit(1)
(out / "gen-config").mkdir()
(out / "gen-config" / "instrument.config.json").write_text('{"meta": {"version": 1}, "modules": []}')
if ranges:
    say("Auto-computed context buffer size: 0.00 GB (65,536 bytes)")
else:
    say("No kernel launches require a timestamp buffer; skipping context buffer allocation.")
say("============= Run application for real profiling... =============")
code, ranges = launch("iket")
if code == 0 and ranges and args.postprocess != "none":
    pid = 4242
    (out / "iket" / f"pid_{pid}").mkdir()
    (out / "iket" / f"pid_{pid}" / "iket.data.json").write_text("{}")
    names = sorted({name for name, _, _ in ranges})
    decoded = {
        "stringTable": names,
        "launches": [{
            "kernelName": "kernel_row_sum",
            "timerSource": "globaltimer",
            "ranges": [
                {"rangeNameIdx": names.index(n), "startTs": s, "endTs": e, "warpLocIdxs": [0]} for n, s, e in ranges
            ],
            "markers": [],
        }],
    }
    trace = b"perfetto trace of " + json.dumps(ranges).encode()
    if args.postprocess in ("perfetto", "all"):
        (out / f"iket_pid_{pid}.pftrace").write_bytes(trace)
        say(f"Dumped perfetto trace to {out}/iket_pid_{pid}.pftrace")
    if args.postprocess in ("json", "all"):
        (out / f"iket_pid_{pid}.trace.json").write_text(json.dumps(decoded))
        say(f"Dumped json trace to {out}/iket_pid_{pid}.trace.json")
    if args.postprocess in ("html", "all"):
        (out / f"iket_pid_{pid}.pftrace.gz").write_bytes(gzip.compress(trace))
        (out / f"iket_pid_{pid}.html").write_text("<html></html>")
        say(f"Dumped perfetto HTML viewer to {out}/iket_pid_{pid}.html")
if not args.keep and code == 0:
    for name in ("tracker", "gen-config", "iket"):
        say(f"Removing intermediate output directory: {out / name}")
        shutil.rmtree(out / name)
sys.exit(code)
"""

# The workload: prints, then records its named ranges where the stand-in reads them (what IKET's
# injection library does on a GPU). Its argv: the ranges as NAME:START:END (none: a kernel without
# markers), or `hang`, `exit:N`, or `no-cuda` (a script that makes no CUDA context: no tracker record).
FAKE_KERNEL = """
import json, os, pathlib, sys, time
print("kernel ran", flush=True)
args = sys.argv[1:]
if args == ["hang"]:
    time.sleep(600)
if args and args[0].startswith("exit:"):
    sys.exit(int(args[0].split(":")[1]))
if args == ["no-cuda"]:
    sys.exit(0)
config = json.loads(pathlib.Path(os.environ["IKET_INJECTION_CONFIG"]).read_text())
ranges = [[n, int(s), int(e)] for n, s, e in (a.split(":") for a in args)]
pathlib.Path(config["outputDir"], "ranges.json").write_text(json.dumps(ranges))
"""

STAGES = ["load:0:100", "load:50:250", "load:10:110", "reduce:300:340", "reduce:300:360", "store:400:401"]


@pytest.fixture
def run_iket(fake_bin: Path) -> Iterator[Path]:
    tool = install_tool(fake_bin, "run-iket", FAKE_RUN_IKET)
    yield tool
    tool.unlink()


def test_iket_brings_back_the_traces_and_summarizes_each_stage(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL)
    (tmp_path / "iket-trace").mkdir()
    (tmp_path / "iket-trace" / "iket_pid_1.trace.json").write_text("{}")  # an earlier run's: not summarized
    done = kcoral(tmp_path, tool_broker.url, "iket", "--", "kernel.py", *STAGES)
    assert done.returncode == 0, done.stderr
    # Both of run-iket's passes ran the script; run-iket prints its output with its own.
    assert done.stdout.count("kernel ran\n") == 2
    assert "[run-iket] ============= Run application for real profiling... =============" in done.stdout
    trace = tmp_path / "iket-trace"
    assert sorted(p.name for p in trace.iterdir()) == [
        "iket_pid_1.trace.json",
        "iket_pid_4242.html",
        "iket_pid_4242.pftrace",
        "iket_pid_4242.pftrace.gz",
        "iket_pid_4242.trace.json",
    ]
    size = (trace / "iket_pid_4242.pftrace").stat().st_size
    assert f"kcoral iket: trace iket-trace/iket_pid_4242.pftrace ({size} bytes)" in done.stderr
    assert "iket_pid_1" not in done.stderr
    assert "iket_pid_4242.trace.json: stage load: 3 ranges, median 100 ns" in done.stderr
    assert "iket_pid_4242.trace.json: stage reduce: 2 ranges, median 50 ns" in done.stderr
    assert "iket_pid_4242.trace.json: stage store: 1 range, median 1 ns" in done.stderr


def test_iket_keeps_the_intermediates_and_fetches_named_files(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL + "pathlib.Path('kernel.ptx').write_text('// ptx')\n")
    done = kcoral(
        tmp_path,
        tool_broker.url,
        "iket",
        "--output-dir",
        "traces/row-sum",
        "--postprocess",
        "perfetto",
        "--keep",
        "--fetch",
        "kernel.ptx",
        "--",
        "kernel.py",
        *STAGES,
    )
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "traces" / "row-sum"
    assert sorted(p.name for p in trace.iterdir()) == ["gen-config", "iket", "iket_pid_4242.pftrace", "tracker"]
    assert (trace / "iket" / "pid_4242" / "iket.data.json").is_file()
    assert (tmp_path / "kernel.ptx").read_text() == "// ptx"
    assert "no trace JSON (--postprocess perfetto), so no stage summary" in done.stderr


def test_iket_on_a_kernel_without_markers_passes_run_iket_through(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL)
    done = kcoral(tmp_path, tool_broker.url, "iket", "--", "kernel.py")
    assert done.returncode == 0, done.stderr  # run-iket's: the traced pass's exit status
    assert "No kernel launches require a timestamp buffer; skipping context buffer allocation." in done.stdout
    assert "kcoral iket: run-iket wrote no trace in iket-trace (exit status 0)" in done.stderr
    assert not (tmp_path / "iket-trace").exists() or not any((tmp_path / "iket-trace").iterdir())


def test_iket_passes_a_failing_workloads_status_through_run_iket(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL)
    done = kcoral(tmp_path, tool_broker.url, "iket", "--", "kernel.py", "exit:3")
    assert done.returncode == 1, done.stderr  # run-iket exits 1 when its tracker pass fails
    assert "[run-iket] Tracker failed with return code: 3" in done.stdout
    assert "run-iket wrote no trace in iket-trace (exit status 1)" in done.stderr


def test_iket_on_a_script_without_cuda_passes_run_iket_s_assertion_through(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL)
    done = kcoral(tmp_path, tool_broker.url, "iket", "--", "kernel.py", "no-cuda")
    assert done.returncode == 1, done.stderr
    assert "AssertionError: recommended_max_ts_cnt_per_warp is not found in tracker" in done.stderr
    assert "run-iket wrote no trace in iket-trace (exit status 1)" in done.stderr


def test_iket_on_a_hanging_workload_stops_at_the_timeout(
    tool_broker: RunningBroker, run_iket: Path, tmp_path: Path
) -> None:
    (tmp_path / "kernel.py").write_text(FAKE_KERNEL)
    started = time.monotonic()
    done = kcoral(tmp_path, tool_broker.url, "iket", "--timeout", "3", "--", "kernel.py", "hang")
    assert done.returncode == 124, done.stderr
    assert "run-iket ran past the time limit and was stopped" in done.stderr
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("folder", [".", "/tmp/trace", "../trace"])
def test_iket_refuses_an_output_dir_that_run_iket_may_not_own(tmp_path: Path, folder: str) -> None:
    (tmp_path / "kernel.py").write_text("print('should not run')\n")
    done = kcoral(tmp_path, "tcp://127.0.0.1:9", "iket", "--output-dir", folder, "--", "kernel.py")
    assert done.returncode == 2, done.stderr
    assert "--output-dir" in done.stderr and "below the working directory" in done.stderr


# --- kcoral remote ---


WORKLOAD = """
import numpy as np
from reference import expected

def evaluate(variant, size="4"):
    data = open("data.txt").read().split()
    print("evaluating", variant, "on", len(data), "values")
    result = np.arange(int(size), dtype=np.float32) * 2
    return {
        "correct": variant == "candidate" and result.tolist() == expected(int(size)),
        "max_error": np.float32(0.0),
        "result": result,
        "variant": variant,
    }
"""


def make_workload(root: Path) -> Path:
    folder = root / "workloads" / "double"
    folder.mkdir(parents=True)
    (folder / "workload.py").write_text(textwrap.dedent(WORKLOAD))
    (folder / "reference.py").write_text("def expected(n):\n    return [2.0 * i for i in range(n)]\n")
    (folder / "data.txt").write_text("1 2 3")
    return folder


def report_of(stdout: str) -> dict[str, object]:
    # The report is the JSON after the workload's own output.
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    return dict(json.loads("\n".join(lines[start:])))


def test_remote_evaluates_a_workload_and_prints_its_report(tool_broker: RunningBroker, tmp_path: Path) -> None:
    make_workload(tmp_path)
    done = kcoral(tmp_path, tool_broker.url, "remote", "--", "workloads/double", "candidate", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("evaluating candidate on 3 values\n")
    assert report_of(done.stdout) == {
        "correct": True,
        "max_error": 0.0,
        "result": [0.0, 2.0, 4.0],
        "variant": "candidate",
    }


def test_remote_exits_1_when_the_report_is_not_correct(tool_broker: RunningBroker, tmp_path: Path) -> None:
    folder = make_workload(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    done = kcoral(work, tool_broker.url, "remote", "--", str(folder), "baseline")  # absolute: sent as double/
    assert done.returncode == 1, done.stderr
    assert report_of(done.stdout)["correct"] is False


def test_remote_reports_a_failing_workload_with_its_traceback(tool_broker: RunningBroker, tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "workload.py").write_text("def evaluate():\n    raise ValueError('no kernel today')\n")
    done = kcoral(tmp_path, tool_broker.url, "remote", "--", "broken")
    assert done.returncode == 70
    assert "ValueError: no kernel today" in done.stderr
    assert "workload.py" in done.stderr  # the traceback points into the workload


def test_remote_refuses_a_folder_without_workload_py(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = kcoral(tmp_path, "tcp://127.0.0.1:1", "remote", "--", "empty")
    assert done.returncode == 2
    assert "has no workload.py" in done.stderr


# --- the uploaded code, run here ---


def test_run_steps_reports_a_signal_as_128_plus_its_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    kill_self = f"import os; os.kill(os.getpid(), {int(signal.SIGKILL)})"
    outcome = service_side.run_steps([{"argv": [service_side.PYTHON, "-c", kill_self]}], 30.0, [])
    assert outcome == {"exit_code": 128 + signal.SIGKILL, "fetched": []}


def test_stage_fetches_refuses_links_out_of_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "secret.txt").write_text("secret")
    monkeypatch.chdir(work)
    Path("link.txt").symlink_to(tmp_path / "secret.txt")
    Path("real.txt").write_text("real")
    kinds = service_side.stage_fetches(["link.txt", "real.txt", "absent"])
    assert kinds == ["outside", "file", "missing"]
    assert sorted(p.name for p in Path(service_side.FETCH_STAGE).iterdir()) == ["1"]
