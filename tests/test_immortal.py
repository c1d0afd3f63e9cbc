"""The zygote's objects made immortal before its first fork (kcoral.worker.immortal)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kcoral.worker import immortal
from tests.helpers import run_function, start_broker

# CPython 3.12 and 3.13 (64-bit, with the GIL) keep immortal objects as immortalize() marks them.
HAS_IMMORTAL_OBJECTS = (3, 12) <= sys.version_info[:2] <= (3, 13) and sys.implementation.name == "cpython"


def run_script(script: str) -> str:
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_interpreter_is_told_apart() -> None:
    assert immortal.supported() is HAS_IMMORTAL_OBJECTS


@pytest.mark.skipif(HAS_IMMORTAL_OBJECTS, reason="this interpreter has immortal objects")
def test_nothing_is_marked_where_the_interpreter_has_no_immortal_objects() -> None:
    out = run_script(
        "import json, sys\n"
        "from kcoral.worker import immortal\n"
        "before = sys.getrefcount(json.dumps)\n"
        "print(immortal.immortalize(), sys.getrefcount(json.dumps) == before)\n"
    )
    assert out.split() == ["Marked(marked=0,", "already=0)", "True"]


@pytest.mark.skipif(not HAS_IMMORTAL_OBJECTS, reason="immortal objects need CPython 3.12 or 3.13")
def test_what_was_reachable_stays_put_and_what_comes_later_is_freed() -> None:
    out = run_script(
        "import gc, json, sys, weakref\n"
        "from kcoral.worker import immortal\n"
        "class Kept: pass\n"
        "kept = Kept()\n"
        "gc.collect()\n"
        "marked = immortal.immortalize()\n"
        "count = sys.getrefcount(kept)\n"
        "held = [kept] * 1000\n"
        "assert sys.getrefcount(kept) == count == 0xFFFFFFFF, sys.getrefcount(kept)\n"
        "del held\n"
        "assert sys.getrefcount(json.dumps) == 0xFFFFFFFF\n"  # reached through its module
        "later = Kept()\n"  # made after: counted and freed as usual
        "gone = weakref.ref(later)\n"
        "del later\n"
        "assert gone() is None\n"
        "print(marked.marked)\n"
    )
    assert int(out) > 1000


@pytest.mark.skipif(not HAS_IMMORTAL_OBJECTS, reason="immortal objects need CPython 3.12 or 3.13")
def test_a_worker_finds_what_its_zygote_imported_immortal(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu")
    try:
        source = (
            "import sys\n"
            "import kcoral.worker.worker as worker\n"
            "def counts():\n"
            "    made_here = object()\n"
            "    return [sys.getrefcount(worker.__dict__), sys.getrefcount(made_here)]\n"
        )
        for _ in range(2):  # a fresh worker each time, forked from the same zygote
            result = run_function(broker.url, source, "counts")
            assert result.completed, result.error
            preloaded, made_here = result.results["out"]
            assert preloaded == 0xFFFFFFFF
            assert made_here < 10
    finally:
        broker.stop()
