"""NCCL all-reduce bandwidth across every GPU of the host: inside a KCoral program, beside outside.

    python benchmarks/nccl_bandwidth.py [--sizes-mib 1,16,256,1024] [--iters 20] [--warmup 5]
                                        [--sandbox bubblewrap,none] [--json out.json]

One process drives all the host's GPUs with ``torch.cuda.nccl.all_reduce`` over one tensor per GPU
(single-process NCCL, as a ``gpu_count=N`` program does). The same measuring function runs:
- outside KCoral, in a plain ``python3`` subprocess that sees every GPU;
- inside KCoral, as a program with ``gpu_count`` = all GPUs, for each ``--sandbox`` setting (in
  bubblewrap the worker keeps the program's GPU nodes only; here that is all of them).

Bandwidths as nccl-tests reports them: algorithm bandwidth = bytes / time, bus bandwidth = algbw *
2 (n - 1) / n. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1) in this process, the broker, and the programs. The table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, machine, print_table, save_json
from kcoral import Client, Program

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # inherited by the outside run, the broker and (through it) programs
PROGRAM_TIMEOUT_S = 300
OUTSIDE_TIMEOUT_S = 300

MEASURE_SOURCE = """
import os
for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value

import time
import torch
import torch.cuda.nccl as nccl


def measure(sizes, iters, warmup):
    count = torch.cuda.device_count()
    rows = []
    for size in sizes:
        tensors = [torch.zeros(size // 4, dtype=torch.float32, device=f"cuda:{i}") for i in range(count)]
        for _ in range(warmup):
            nccl.all_reduce(tensors)
        for i in range(count):
            torch.cuda.synchronize(i)
        start = time.perf_counter()
        for _ in range(iters):
            nccl.all_reduce(tensors)
        for i in range(count):
            torch.cuda.synchronize(i)
        seconds = (time.perf_counter() - start) / iters
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "us": seconds * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (count - 1) / count})
        del tensors
        torch.cuda.empty_cache()
    return {"gpus": count, "rows": rows}
"""


def log(message: str) -> None:
    print(f"[nccl] {message}", file=sys.stderr, flush=True)


def outside(sizes: list[int], iters: int, warmup: int) -> dict[str, Any]:
    code = MEASURE_SOURCE + f"\nimport json\nprint(json.dumps(measure({sizes!r}, {iters}, {warmup})))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=OUTSIDE_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the outside run failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def inside(url: str, gpus: int, sizes: list[int], iters: int, warmup: int) -> dict[str, Any]:
    program = Program()
    module = program.upload(kind="module", source=MEASURE_SOURCE)
    measure = program.get_function(module=module, name="measure")
    program.return_(key="m", value=program.run(fn=measure, args=[sizes, iters, warmup]))
    with Client(url) as client:
        result = client.execute(program, gpu_count=gpus, timeout_seconds=PROGRAM_TIMEOUT_S)
    if not result.completed:
        raise RuntimeError(f"the program failed: {result.error} {result.stderr[-3000:]}")
    report = dict(result.results["m"])
    report["gpu_ids"] = result.gpu_ids
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,16,256,1024")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sandbox", default="bubblewrap,none", help="comma-separated broker sandbox settings")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]

    log(f"{machine()}; outside KCoral")
    runs: dict[str, dict[str, Any]] = {}
    try:
        runs["outside"] = outside(sizes, args.iters, args.warmup)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        log(str(exc))
    gpus = runs["outside"]["gpus"] if "outside" in runs else 2
    for sandbox in [s for s in args.sandbox.split(",") if s]:
        log(f"inside KCoral, sandbox {sandbox}, gpu_count={gpus}")
        try:
            with broker("--device", "gpu", "--sandbox", sandbox) as (url, _process):
                runs[f"kcoral_{sandbox}"] = inside(url, gpus, sizes, args.iters, args.warmup)
        except RuntimeError as exc:
            log(f"sandbox {sandbox}: {exc}")
    if not runs:
        return 1
    names = list(runs)
    rows = []
    for i, size in enumerate(sizes):
        row: list[Any] = [f"{size / (1 << 20):g} MiB"]
        for name in names:
            measured = runs[name]["rows"][i]
            row += [measured["us"], measured["busbw_gbs"]]
        rows.append(row)
    header = ["size"] + [f"{name} {unit}" for name in names for unit in ("us", "busbw GB/s")]
    print_table(f"NCCL all-reduce over {gpus} GPUs, one process ({machine()})", header, rows)
    save_json(args.json, {"machine": machine(), "sizes": sizes, "iters": args.iters, "runs": runs})
    return 0 if len(runs) == 1 + len([s for s in args.sandbox.split(",") if s]) else 1


if __name__ == "__main__":
    sys.exit(main())
