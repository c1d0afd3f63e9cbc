"""A spare's rehearsal (kcoral.worker.rehearsal): it walks a program's path and changes nothing.

Each runs in a fresh interpreter of its own (a subprocess), as a spare runs it in a fresh worker:
the process-wide state a program's run sets (the directory, the environment, where descriptors 1
and 2 lead, whether the process is dumpable, its threads, ``sys.path``) is the same after as
before, and a process it did not start is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

STATE_PROBE = r"""
import json, os, sys, threading
from kcoral.worker import processes
from kcoral.worker.rehearsal import rehearse

def state():
    return {
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "fd1": os.readlink("/proc/self/fd/1"),
        "fd2": os.readlink("/proc/self/fd/2"),
        "dumpable": processes.is_dumpable(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "thread_ids": len(processes.thread_ids() or ()),
        "path": list(sys.path),
    }

processes.set_dumpable(False)  # as a spare is until its program comes
before = state()
ok = rehearse(lambda: {"claims": True})
print(json.dumps({"ok": ok, "before": before, "after": state()}))
"""

CHILD_PROBE = r"""
import json, subprocess, sys
from kcoral.worker.rehearsal import rehearse
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
ok = rehearse(lambda: {})
alive = child.poll() is None
child.kill()
child.wait()
print(json.dumps({"ok": ok, "alive": alive}))
"""


def probe(source: str, cwd: Path) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def test_a_rehearsal_completes_and_leaves_the_process_as_it_found_it(tmp_path: Path) -> None:
    report = probe(STATE_PROBE, tmp_path)
    assert report["ok"] is True
    assert report["after"] == report["before"]
    assert report["before"]["dumpable"] is False


def test_a_rehearsal_leaves_a_process_it_did_not_start_alone(tmp_path: Path) -> None:
    # A spare has started nothing; where something was, the rehearsal's walk of the kill that
    # follows a program is not made.
    assert probe(CHILD_PROBE, tmp_path) == {"ok": True, "alive": True}
