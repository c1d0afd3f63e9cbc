"""What a worker's confinement to its GPUs costs: ``kcoral.worker.confinement.confine`` in forked
children of a process inside the production bubblewrap sandbox, with N stand-in GPU nodes.

    python benchmarks/confinement.py [--gpus 8] [--runs 50] [--pause-ms 20]

Each run forks a child (as the zygote forks a worker), which confines itself and exits, in the
worker's cases: nothing prepared; prepared while idle (``prepare``, after READY) for the GPU the
program then leases (the slot's own: the broker prefers it); prepared for another GPU; and nothing
prepared with half the GPUs leased. It reports the time in ``confine`` (on the program's path) and
in ``prepare`` (while idle). ``--pause-ms`` between runs stands for a
program's own run time (0: back to back, when each child's unshare meets the teardown of the
previous child's mount namespace). Runs anywhere bubblewrap runs (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_table
from kcoral.sandbox.bubblewrap import GpuBind, SandboxSpec, check_bwrap, sandbox_argv

INSIDE = """
import json, os, statistics, sys, time
from kcoral.worker import confinement

gpus, runs, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000
nodes = {i: f"/dev/nvidia{i}" for i in range(gpus)}
# (what the idle worker prepared, what the program leased): the worker's three cases.
CASES = {
    "cold: nothing prepared, 1 GPU": (None, [0]),
    "prepared for the program's GPU": ([0], [0]),
    "prepared for another GPU": ([1 % gpus], [0]),
    f"cold: nothing prepared, {gpus // 2 or 1} of {gpus} GPUs": (None, list(range(gpus // 2 or 1))),
}
confine_ms = {case: [] for case in CASES}
prepare_ms = {case: [] for case in CASES}
for run in range(runs):
    for case, (prepared, leased) in CASES.items():
        time.sleep(pause)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            confinement.configure(nodes)
            start = time.perf_counter()
            if prepared is not None:
                confinement.prepare(prepared)
            took_prepare = (time.perf_counter() - start) * 1000
            refusal = confinement.confine(leased)
            seen = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
            os.write(write, json.dumps([refusal, took_prepare, confinement.confinement_ms(), seen]).encode())
            os._exit(0)
        os.close(write)
        refusal, took_prepare, took, seen = json.loads(os.read(read, 65536))
        os.waitpid(pid, 0)
        os.close(read)
        assert refusal is None, refusal
        assert seen == [f"nvidia{i}" for i in leased], (case, seen)
        confine_ms[case].append(took)
        prepare_ms[case].append(took_prepare)

def stats(samples):
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}

print(json.dumps({case: {"confine_ms": stats(confine_ms[case]), "prepare_ms": stats(prepare_ms[case])}
                  for case in CASES}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    args = parser.parse_args()
    bwrap = check_bwrap()
    with tempfile.TemporaryDirectory(prefix="kcoral-confinement-") as scratch:
        root = Path(scratch)
        (root / "workspace").mkdir()
        (root / "ipc").mkdir()
        (root / "dev").mkdir()
        binds = []
        for index in range(args.gpus):
            stand_in = root / "dev" / f"nvidia{index}"
            stand_in.write_text(f"fake GPU {index}\n")
            binds.append(GpuBind(stand_in, Path(f"/dev/nvidia{index}")))
        spec = SandboxSpec(workspace=root / "workspace", ipc_dir=root / "ipc", gpu_nodes=tuple(binds))
        argv = sandbox_argv(spec, bwrap, environ=os.environ)
        code = textwrap.dedent(INSIDE)
        done = subprocess.run(
            [*argv, "--", sys.executable, "-c", code, str(args.gpus), str(args.runs), str(args.pause_ms)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    report = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [
        [case, r["confine_ms"]["median"], r["confine_ms"]["p90"], r["prepare_ms"]["median"]]
        for case, r in report.items()
    ]
    print_table(
        f"Worker confinement, {args.gpus} stand-in GPUs ({machine()}, {args.runs} forks each, "
        f"{args.pause_ms:g} ms apart)",
        ["case", "confine() median ms", "p90 ms", "prepare() while idle, median ms"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
