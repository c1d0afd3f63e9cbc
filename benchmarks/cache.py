"""The upload cache: what a repeated program sends, and what a 1 GiB tensor costs the broker.

    python benchmarks/cache.py [--sum-mib 256] [--echo-mib 1024] [--sandbox none] [--json out.json]

Two measurements, each against a fresh ``kcoral broker`` on loopback with one worker:

1. A program that uploads a float32 tensor (256 MiB) and returns its sum, submitted twice. For each
   submission: the blob bytes the client sent (``Client.blob_bytes_sent``), the bytes of its
   EXECUTE body, and the time ``execute`` took. Goal: the second sends under 4 KiB in all and takes
   under a tenth of the first's time. The program is built once, so hashing it is not in either
   time (it is printed on its own).
2. A program that uploads a float32 tensor (1 GiB) and returns the tensor itself. Goal: the
   broker's peak resident memory (``VmHWM`` in ``/proc/<broker pid>/status``) stays under three
   times the tensor's size.

The disk cache lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, machine, print_table, save_json
from kcoral import Client, Program, protocol

MIB = 1 << 20
SECOND_SEND_GOAL_BYTES = 4 << 10
SPEEDUP_GOAL = 10.0
PEAK_MEMORY_GOAL_RATIO = 3.0
EXECUTE_TIMEOUT_S = 600.0
SUM_SOURCE = "import numpy as np\n\ndef total(x):\n    return float(np.asarray(x).sum(dtype=np.float64))\n"


def log(message: str) -> None:
    print(f"[cache] {message}", file=sys.stderr, flush=True)


def tensor(nbytes: int) -> np.ndarray:
    """A float32 array of ``nbytes``, cheap to make and different from run to run."""
    values = np.arange(nbytes // 4, dtype=np.float32)
    values *= np.float32(np.random.default_rng().uniform(0.5, 1.5) / max(1, len(values)))
    return values


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory field (``VmHWM``, ``VmRSS``) of /proc/<pid>/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def execute_body_bytes(program: Program) -> int:
    """Size of the EXECUTE message's body for ``program``, as the client packs it."""
    body, _ = program.to_wire()
    request = {"request_id": "0" * 32, "program": body, "options": {"timeout_seconds": 300.0}, "blobs": []}
    return len(protocol.pack(request))


def repeated_sum(url: str, nbytes: int) -> dict[str, Any]:
    data = tensor(nbytes)
    started = time.perf_counter()
    program = Program()
    module = program.upload(kind="module", source=SUM_SOURCE)
    fn = program.get_function(module=module, name="total")
    program.return_(key="sum", value=program.run(fn=fn, args=[program.upload(kind="tensor", value=data)]))
    build_s = time.perf_counter() - started
    body_bytes = execute_body_bytes(program)
    expected = float(data.sum(dtype=np.float64))
    runs: list[dict[str, Any]] = []
    with Client(url) as client:
        for attempt in (1, 2):
            sent_before = client.blob_bytes_sent
            started = time.perf_counter()
            result = client.execute(program, timeout_seconds=EXECUTE_TIMEOUT_S)
            elapsed = time.perf_counter() - started
            if not result.completed:
                raise RuntimeError(f"submission {attempt} failed: {result.error}")
            if abs(result.results["sum"] - expected) > 1e-6 * abs(expected):
                raise RuntimeError(f"wrong sum {result.results['sum']} != {expected}")
            blob_bytes = client.blob_bytes_sent - sent_before
            runs.append(
                {
                    "submission": attempt,
                    "blob_bytes": blob_bytes,
                    "body_bytes": body_bytes,
                    "sent_bytes": blob_bytes + body_bytes,
                    "seconds": elapsed,
                    "worker_ms": result.elapsed_ms,
                }
            )
            log(f"sum submission {attempt}: {elapsed:.3f} s, {blob_bytes} blob bytes")
        cache = client.health()["cache"]
    first, second = runs
    return {
        "tensor_bytes": nbytes,
        "build_and_hash_seconds": build_s,
        "runs": runs,
        "speedup": first["seconds"] / second["seconds"],
        "cache": cache,
        "goal_second_sent_bytes": second["sent_bytes"] < SECOND_SEND_GOAL_BYTES,
        "goal_second_faster": second["seconds"] * SPEEDUP_GOAL < first["seconds"],
    }


def echo_peak_memory(url: str, broker_pid: int, nbytes: int) -> dict[str, Any]:
    data = tensor(nbytes)
    program = Program()
    program.return_(key="same", value=program.upload(kind="tensor", value=data))
    rss_before = proc_status_bytes(broker_pid, "VmRSS")
    hwm_before = proc_status_bytes(broker_pid, "VmHWM")
    with Client(url) as client:
        started = time.perf_counter()
        result = client.execute(program, timeout_seconds=EXECUTE_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        sent = client.blob_bytes_sent
    if not result.completed:
        raise RuntimeError(f"the echo program failed: {result.error}")
    if not np.array_equal(result.results["same"], data):
        raise RuntimeError("the returned tensor differs from the uploaded one")
    peak = proc_status_bytes(broker_pid, "VmHWM")
    log(f"echo: {elapsed:.3f} s, broker peak {peak / MIB:.0f} MiB")
    return {
        "tensor_bytes": nbytes,
        "blob_bytes": sent,
        "seconds": elapsed,
        "broker_rss_before_bytes": rss_before,
        "broker_hwm_before_bytes": hwm_before,
        "broker_peak_bytes": peak,
        "peak_over_tensor": peak / nbytes,
        "goal_peak_memory": peak < PEAK_MEMORY_GOAL_RATIO * nbytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sum-mib", type=int, default=256, help="size of the summed tensor")
    parser.add_argument("--echo-mib", type=int, default=1024, help="size of the returned tensor")
    parser.add_argument("--sandbox", choices=("bubblewrap", "none"), default=None, help="default: the broker's")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args()

    flags = ["--workers", "1"] + (["--sandbox", args.sandbox] if args.sandbox else [])
    with tempfile.TemporaryDirectory(prefix="kcoral-cache-bench-") as scratch:
        with broker(*flags, "--cache-dir", str(Path(scratch, "sum"))) as (url, _):
            summed = repeated_sum(url, args.sum_mib * MIB)
        # A fresh broker, so its peak memory is this program's alone.
        with broker(*flags, "--cache-dir", str(Path(scratch, "echo"))) as (url, process):
            echoed = echo_peak_memory(url, process.pid, args.echo_mib * MIB)

    first, second = summed["runs"]
    print(f"machine: {machine()}; flags: {' '.join(flags)}")
    print_table(
        f"{args.sum_mib} MiB float32 tensor, sum returned, submitted twice "
        f"(program built and hashed once in {summed['build_and_hash_seconds']:.3f} s)",
        ("submission", "blob bytes", "body bytes", "sent bytes", "seconds", "worker ms"),
        [
            (r["submission"], r["blob_bytes"], r["body_bytes"], r["sent_bytes"], r["seconds"], r["worker_ms"])
            for r in (first, second)
        ],
    )
    print_table(
        f"{args.echo_mib} MiB float32 tensor uploaded and returned",
        ("tensor MiB", "seconds", "broker RSS before MiB", "broker peak MiB", "peak / tensor"),
        [
            (
                args.echo_mib,
                echoed["seconds"],
                echoed["broker_rss_before_bytes"] / MIB,
                echoed["broker_peak_bytes"] / MIB,
                echoed["peak_over_tensor"],
            )
        ],
    )
    goals = [
        ("second submission sends < 4 KiB", summed["goal_second_sent_bytes"], f"{second['sent_bytes']} B"),
        ("second submission < 1/10 of the first's time", summed["goal_second_faster"], f"{summed['speedup']:.1f}x"),
        (
            "broker peak memory < 3x the returned tensor",
            echoed["goal_peak_memory"],
            f"{echoed['peak_over_tensor']:.2f}x",
        ),
    ]
    print_table("goals", ("goal", "met", "measured"), [(g, "yes" if ok else "NO", m) for g, ok, m in goals])
    save_json(args.json, {"machine": machine(), "flags": flags, "sum": summed, "echo": echoed})
    return 0 if all(ok for _, ok, _ in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
