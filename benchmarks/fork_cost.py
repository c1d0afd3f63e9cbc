"""What a fresh worker's fork and exit cost a zygote-like process, its memory in 4 KiB or huge pages.

    python benchmarks/fork_cost.py [--forks 400] [--rounds 3] [--no-torch]

Each round starts two processes in turn that import what the zygote preloads (torch where it is
installed, the worker) and freeze the collector's view, one of them then collapsing its anonymous
memory into huge pages as the zygote does (``kcoral.worker.huge_pages``). Each forks ``--forks``
children that exit at once, writing some of its own memory between forks as the zygote's loop
does, and reports its own CPU per fork, its children's CPU per exit, the wall time per fork and
wait, and how much of its anonymous memory was in huge pages at the end. Printed: the medians
over the rounds, and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_table

CHILD = r"""
import gc, json, os, resource, sys, time
if {torch}:
    try:
        import torch  # noqa: F401 (what the zygote preloads)
    except ImportError:
        pass
import kcoral.worker.worker  # noqa: F401
from kcoral.worker import huge_pages
gc.collect()
gc.freeze()
collapsed = huge_pages.collapse_anonymous_memory() if {huge} else 0
def cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime
def write_some():  # the zygote's loop between forks: an event line, a selector, a /proc read
    json.dumps({{"event": "forked", "worker": os.urandom(8).hex(), "values": list(range(50))}})
    os.listdir("/proc/self/task")
forks = {forks}
own, children, start = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
for _ in range(forks):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    write_some()
    os.waitpid(pid, 0)
print(json.dumps({{
    "fork_ms": (cpu(resource.RUSAGE_SELF) - own) * 1e3 / forks,
    "exit_ms": (cpu(resource.RUSAGE_CHILDREN) - children) * 1e3 / forks,
    "wall_ms": (time.perf_counter() - start) * 1e3 / forks,
    "collapsed_mib": collapsed >> 20,
    "huge_mib": huge_pages.anonymous_huge_bytes() >> 20,
    "torch": "torch" in sys.modules,
}}))
"""


def one(huge: bool, forks: int, torch: bool) -> dict[str, float]:
    code = CHILD.format(huge=huge, forks=forks, torch=torch)
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forks", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="do not import torch first")
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for number in range(args.rounds):
        for huge in (False, True):
            runs[huge].append(one(huge, args.forks, not args.no_torch))
        sys.stderr.write(f"\rround {number + 1}/{args.rounds}")
    sys.stderr.write("\n")
    keys = ("fork_ms", "exit_ms", "wall_ms", "huge_mib")
    medians = {huge: {key: statistics.median(run[key] for run in runs[huge]) for key in keys} for huge in runs}
    rows = [
        ["4 KiB pages" if not huge else "collapsed", *(medians[huge][key] for key in keys)] for huge in (False, True)
    ]
    rows.append(["collapsed / 4 KiB", *(medians[True][k] / medians[False][k] for k in keys[:3]), "-"])
    print_table(
        f"{machine()}, torch imported: {runs[True][0]['torch']}, {args.forks} forks x {args.rounds} rounds (medians)",
        ["zygote memory", "CPU ms per fork", "child CPU ms per exit", "wall ms per fork+wait", "MiB in huge pages"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
