"""What a worker's confinement to its GPUs costs: ``kcoral.worker.confinement.confine`` in forked
children of a process inside the production bubblewrap sandbox, with N stand-in GPU nodes.

    python benchmarks/confinement.py [--gpus 8] [--runs 50] [--pause-ms 20]

Each run forks a child (as the zygote forks a worker), which confines itself to one GPU (then to
half of them, on alternate runs) and exits; the parent reports the median and p90 of the time the
child spent in ``confine`` and of the whole fork-to-exit. ``--pause-ms`` between runs stands for a
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
confine_ms, fork_ms = {1: [], gpus // 2 or 1: []}, {1: [], gpus // 2 or 1: []}
for run in range(runs):
    time.sleep(pause)
    count = 1 if run % 2 == 0 else (gpus // 2 or 1)
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        confinement.configure(nodes)
        refusal = confinement.confine(list(range(count)))
        seen = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
        os.write(write, json.dumps([refusal, confinement.confinement_ms(), seen]).encode())
        os._exit(0)
    os.close(write)
    refusal, took, seen = json.loads(os.read(read, 65536))
    os.waitpid(pid, 0)
    os.close(read)
    assert refusal is None, refusal
    assert seen == [f"nvidia{i}" for i in range(count)], seen
    fork_ms[count].append((time.perf_counter() - start) * 1000)
    confine_ms[count].append(took)

def stats(samples):
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}

print(json.dumps({str(k): {"confine_ms": stats(confine_ms[k]), "fork_to_exit_ms": stats(fork_ms[k])}
                  for k in confine_ms}))
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
        [
            f"{count} of {args.gpus} GPUs",
            r["confine_ms"]["median"],
            r["confine_ms"]["p90"],
            r["fork_to_exit_ms"]["median"],
        ]
        for count, r in report.items()
    ]
    print_table(
        f"Worker confinement ({machine()}, {args.runs} forks, {args.pause_ms:g} ms apart)",
        ["kept", "confine median ms", "confine p90 ms", "fork to exit median ms"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
