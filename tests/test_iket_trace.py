"""The parts of ``kcoral iket`` that need no service: run-iket's command line as the adapter builds
it, and the stage summary read from a decoded IKET trace (kcoral.tools.iket_trace).

The traces here are in the shape the reader expects (the decoder's field names; their nesting is
to be confirmed by the first trace taken on a GPU), plus the shapes it must not misread.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kcoral.tools import iket
from kcoral.tools.adapter import UsageError
from kcoral.tools.iket_trace import TRACE_JSON, TraceFormatError, read_summary, summarize, summary_lines, trace_files
from kcoral.tools.service_side import PYTHON


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    iket.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_iket_gets_its_own_options_before_profile_and_the_workload_after_two_dashes() -> None:
    args = parse(
        "--postprocess", "json", "--keep", "--iket-log-level", "info", "--iket-args", "--enabled-cluster 0,0,0"
    )
    assert iket.command(args, "out/t", ["k.py", "--m", "8"]) == [
        "run-iket",
        "--output-dir",
        "out/t",
        "--clobber",
        "--log-level",
        "info",
        "profile",
        "--postprocess",
        "json",
        "--keep",
        "--enabled-cluster",
        "0,0,0",
        "--",
        PYTHON,
        "k.py",
        "--m",
        "8",
    ]


def test_the_default_command_asks_for_every_trace_format() -> None:
    assert iket.command(parse(), "iket-trace", ["k.py"]) == [
        "run-iket",
        "--output-dir",
        "iket-trace",
        "--clobber",
        "profile",
        "--postprocess",
        "all",
        "--",
        PYTHON,
        "k.py",
    ]


@pytest.mark.parametrize("folder", [".", "./", "", "/abs", "a/../.."])
def test_an_output_dir_run_iket_may_not_own_is_refused(folder: str) -> None:
    with pytest.raises(UsageError, match="--output-dir"):
        iket.output_dir(folder)


def test_an_output_dir_is_normalised() -> None:
    assert iket.output_dir("./traces//gemm/") == "traces/gemm"


def launch(ranges: list[dict[str, object]], markers: list[dict[str, object]] | None = None) -> dict[str, object]:
    return {"kernelName": "kernel_gemm", "ranges": ranges, "markers": markers or []}


def test_stages_by_name_index_into_the_string_table() -> None:
    decoded = {
        "stringTable": ["mainloop", "epilogue", "tile_done"],
        "timerSource": "globaltimer",
        "launches": [
            launch(
                [
                    {"rangeNameIdx": 0, "startTs": 0, "endTs": 900},
                    {"rangeNameIdx": 0, "startTs": 10, "endTs": 1010},
                    {"rangeNameIdx": 0, "startTs": 5, "endTs": 1205},
                    {"rangeNameIdx": 1, "startTs": 1300, "endTs": 1340},
                ],
                [{"markerNameIdx": 2, "timestamp": 1500}, {"markerNameIdx": 2, "timestamp": 1501}],
            ),
            launch([{"rangeNameIdx": 1, "startTs": 0, "endTs": 60}]),
        ],
    }
    summary = summarize(decoded)
    assert [(s.kind, s.name, s.count, s.median) for s in summary.stages] == [
        ("range", "mainloop", 3, 1000.0),
        ("range", "epilogue", 2, 50.0),
        ("marker", "tile_done", 2, None),
    ]
    assert summary.kernels == ["kernel_gemm"]
    assert summary_lines(summary) == [
        "kernels: kernel_gemm",
        "stage mainloop: 3 ranges, median 1000 ns",
        "stage epilogue: 2 ranges, median 50 ns",
        "marker tile_done: 2 events",
    ]


def test_stages_with_inline_names_and_an_unknown_timer_are_in_ticks() -> None:
    decoded = {"launches": [launch([{"rangeName": "load", "startTs": 1.5, "endTs": 3.0}])]}
    assert summary_lines(summarize(decoded)) == ["kernels: kernel_gemm", "stage load: 1 range, median 1.5 ticks"]


def test_a_name_index_outside_the_table_is_shown_as_the_index() -> None:
    decoded = {"stringTable": [], "ranges": [{"rangeNameIdx": 7, "startTs": 0, "endTs": 4}]}
    assert [s.name for s in summarize(decoded).stages] == ["#7"]


def test_a_trace_without_ranges_says_the_kernel_recorded_none() -> None:
    lines = summary_lines(summarize({"launches": [launch([])]}))
    assert lines[-1].startswith("no named IKET range or marker in it")


@pytest.mark.parametrize("decoded", [{"traceEvents": []}, [], {"launches": [{"events": []}]}])
def test_a_trace_in_an_unknown_shape_is_reported_not_read_as_empty(decoded: object) -> None:
    with pytest.raises(TraceFormatError, match="no 'ranges' or 'markers' list"):
        summarize(decoded)


def test_a_malformed_entry_is_skipped() -> None:
    decoded = {
        "ranges": [{"rangeName": "a", "startTs": "0", "endTs": 1}, 3, {"rangeName": "b", "startTs": 0, "endTs": 2}]
    }
    assert [s.name for s in summarize(decoded).stages] == ["b"]


def test_read_summary_reads_a_file_and_refuses_bad_json(tmp_path: Path) -> None:
    good = tmp_path / "iket_pid_1.trace.json"
    good.write_text(json.dumps({"ranges": [{"rangeName": "a", "startTs": 0, "endTs": 2}]}))
    assert read_summary(good).stages[0].median == 2.0
    bad = tmp_path / "iket_pid_2.trace.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        read_summary(bad)


def test_trace_files_are_run_iket_s_own_at_the_top_of_the_folder() -> None:
    saved = [
        "t/iket_pid_9.trace.json",
        "t/iket_pid_9.pftrace",
        "t/iket_pid_9.pftrace.gz",
        "t/iket_pid_9.html",
        "t/iket/pid_9/iket.data.json",
        "t/tracker/pid_9/tracker.json",
        "tt/iket_pid_9.pftrace",
        "kernel.ptx",
    ]
    assert trace_files(saved, "t") == [
        "t/iket_pid_9.html",
        "t/iket_pid_9.pftrace",
        "t/iket_pid_9.pftrace.gz",
        "t/iket_pid_9.trace.json",
    ]


def test_trace_files_named_by_a_hex_pid_are_found() -> None:
    # run-iket 4.8.1 on the H200 wrote iket_pid_0x32.trace.json, .pftrace, .pftrace.gz and .html.
    saved = [f"t/iket_pid_0x32.{ending}" for ending in ("trace.json", "pftrace", "pftrace.gz", "html")]
    assert trace_files(saved, "t") == sorted(saved)
    assert TRACE_JSON.match("iket_pid_0x32.trace.json")
    assert not TRACE_JSON.match("iket_pid_0x.trace.json")


def test_globaltimer_stamps_are_subtracted_exactly_and_read_as_nanoseconds() -> None:
    # run-iket 4.8.1 on the H200: no timer source named, stamps in ns since the Unix epoch (~2**61),
    # where a float holds only multiples of 256 ns; a 32 ns stage must not read 0 or 256.
    start = 1796166365935893632
    decoded = {
        "stringTable": ["store"],
        "launches": [launch([{"rangeNameIdx": 0, "startTs": start, "endTs": start + 32}])],
    }
    summary = summarize(decoded)
    assert summary.stages[0].durations == [32.0]
    assert summary_lines(summary)[-1] == "stage store: 1 range, median 32 ns"


def test_run_iket_s_trace_of_a_kernel_without_markers_has_no_stages() -> None:
    # What run-iket 4.8.1 wrote on the H200 for the example run with --no-markers (91 bytes).
    decoded = {"graphLaunches": {}, "launches": [], "locationTable": [], "meta": {"version": 1}, "stringTable": []}
    assert summary_lines(summarize(decoded)) == [
        "no named IKET range or marker in it (a kernel without IKET markers records none)"
    ]
