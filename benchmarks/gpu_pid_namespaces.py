"""Which pids NVML gives, seen from a program in the sandbox and from the broker's namespace (GPU host).

    python3 benchmarks/gpu_pid_namespaces.py --url tcp://127.0.0.1:5611 [--programs 3] [--json out.json]

NVML names a GPU's processes in two calls, ``nvmlDeviceGetComputeRunningProcesses`` (the contexts)
and ``nvmlDeviceGetProcessUtilization`` (SM samples), and the driver may translate their pids into
the caller's pid namespace, or not, and not alike for the two. ``benchmark()`` runs in a bubblewrap
sandbox with a pid namespace of its own and is told pids by the broker, so which numbers it sees
decides whether it recognises itself and the service's spares. Each program here keeps the GPU busy
for about a second while it and this process (outside the sandbox) sample both calls; this process
also lists every process holding ``/dev/nvidia*`` with its ``NSpid`` chain (its pid in each
namespace, outermost first). One JSON document on stdout (or ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kcoral import Client, Program  # noqa: E402

PROGRAM = r"""
import os, time

def nspid():
    for line in open("/proc/self/status"):
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]

def sample(nvml, handle, since):
    running = sorted(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    try:
        util = sorted({(int(s.pid), int(s.smUtil)) for s in nvml.nvmlDeviceGetProcessUtilization(handle, since)})
    except nvml.NVMLError as exc:
        util = str(exc)
    return {"running": running, "util": util}

def probe(seconds):
    import pynvml as nvml
    import torch
    from kcoral.timing import trust
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    known = getattr(trust._ARMED, "known_pids", None)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    since = int(time.time() * 1e6)
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        samples.append(sample(nvml, handle, since))
        time.sleep(0.05)
    return {
        "getpid": os.getpid(),
        "nspid": nspid(),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "known_pids": None if known is None else known.to_wire(),
        "samples": samples,
    }
"""


def holders() -> list[dict[str, Any]]:
    """Every process (of this namespace) with /dev/nvidia* open: pid, NSpid chain, namespace, name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if not any(os.readlink(fd).startswith("/dev/nvidia") for fd in (entry / "fd").iterdir()):
                continue
            status = (entry / "status").read_text().splitlines()
            nspid = next((line.split()[1:] for line in status if line.startswith("NSpid:")), [])
            found.append(
                {
                    "pid": int(entry.name),
                    "nspid": [int(x) for x in nspid],
                    "pid_ns": os.readlink(entry / "ns" / "pid"),
                    "name": (entry / "comm").read_text().strip(),
                }
            )
    return sorted(found, key=lambda item: item["pid"])


def outside(nvml: Any, stop: threading.Event, into: list[dict[str, Any]]) -> None:
    """The program's own NVML sample (PROGRAM's ``sample``), taken here, beside the GPU's holders."""
    program: dict[str, Any] = {}
    exec(PROGRAM, program)  # the same two NVML calls as inside the sandbox, not a copy of them
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    since = int(time.time() * 1e6)
    while not stop.is_set():
        into.append({**program["sample"](nvml, handle, since), "holders": holders()})
        stop.wait(0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--programs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import pynvml
    except ImportError:
        print("gpu_pid_namespaces: needs nvidia-ml-py (pip install 'kcoral[gpu]')", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "self": {"pid": os.getpid(), "pid_ns": os.readlink("/proc/self/ns/pid")},
        "init_pid_ns": None,
        "programs": [],
    }
    with contextlib.suppress(OSError):
        report["init_pid_ns"] = os.readlink("/proc/1/ns/pid")
    with Client(args.url, connect_timeout_seconds=30.0) as client:
        for index in range(args.programs):
            program = Program()
            module = program.upload(kind="module", source=PROGRAM)
            fn = program.get_function(module=module, name="probe")
            program.return_(key="probe", value=program.run(fn=fn, args=[args.seconds]))
            stop = threading.Event()
            seen: list[dict[str, Any]] = []
            watcher = threading.Thread(target=outside, args=(pynvml, stop, seen), daemon=True)
            watcher.start()
            result = client.execute(program, timeout_seconds=120)
            stop.set()
            watcher.join(5)
            entry = {"index": index, "outside": seen}
            entry.update({"inside": result.results["probe"]} if result.completed else {"error": result.error})
            report["programs"].append(entry)
            print(
                f"[pid-namespaces] program {index + 1}/{args.programs}: {'ok' if result.completed else result.error}",
                file=sys.stderr,
                flush=True,
            )
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
