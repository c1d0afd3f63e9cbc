"""The upload cache: what a repeated program sends, and what a 1 GiB tensor costs the broker.

    python benchmarks/cache.py [--sum-mib 256] [--echo-mib 1024] [--sandbox none] [--json out.json]

Two measurements, each against a fresh ``kcoral broker`` on loopback with one worker:

1. A program that uploads a float32 tensor (256 MiB) and returns its sum, submitted twice; repeated
   for ``--rounds`` rounds, each with a tensor the broker has not seen. For each submission: the
   bytes the client sent (blob bytes from ``Client.blob_bytes_sent`` plus the EXECUTE body) and the
   time ``execute`` took. Goal: every second submission sends under 4 KiB, and the median second
   takes under a tenth of the median first (medians, because a shared 2-core machine is noisy).
   The program is built before it is submitted, so hashing the tensor is in neither time (it is
   printed on its own).
2. A program that uploads a float32 tensor (1 GiB) and returns the tensor itself. Goal: the
   broker's peak resident memory (``VmHWM`` in ``/proc/<broker pid>/status``) stays under three
   times the tensor's size.

The disk cache lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
# numpy sums float32 pairwise in float32: about 3x faster than accumulating in float64, and
# accurate to well within SUM_RELATIVE_TOLERANCE for these sizes.
SUM_SOURCE = "import numpy as np\n\ndef total(x):\n    return float(np.asarray(x).sum())\n"
SUM_RELATIVE_TOLERANCE = 1e-4


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


def sum_program(data: np.ndarray) -> Program:
    program = Program()
    module = program.upload(kind="module", source=SUM_SOURCE)
    fn = program.get_function(module=module, name="total")
    program.return_(key="sum", value=program.run(fn=fn, args=[program.upload(kind="tensor", value=data)]))
    return program


def submit(client: Client, program: Program, expected: float) -> tuple[float, int, float]:
    """(seconds, blob bytes sent, worker ms) of one submission, after checking its result."""
    sent_before = client.blob_bytes_sent
    started = time.perf_counter()
    result = client.execute(program, timeout_seconds=EXECUTE_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if not result.completed:
        raise RuntimeError(f"the sum program failed: {result.error}")
    if abs(result.results["sum"] - expected) > SUM_RELATIVE_TOLERANCE * abs(expected):
        raise RuntimeError(f"wrong sum {result.results['sum']} != {expected}")
    return elapsed, client.blob_bytes_sent - sent_before, result.elapsed_ms


def repeated_sum(url: str, nbytes: int, rounds: int) -> dict[str, Any]:
    """``rounds`` pairs of submissions, each pair with a tensor the broker has never seen."""
    pairs: list[dict[str, Any]] = []
    with Client(url) as client:
        for round_index in range(1, rounds + 1):
            data = tensor(nbytes)
            started = time.perf_counter()
            program = sum_program(data)  # hashes the tensor, once per program
            build_s = time.perf_counter() - started
            body_bytes = execute_body_bytes(program)
            expected = float(data.sum(dtype=np.float64))
            first_s, first_blob, first_worker = submit(client, program, expected)
            second_s, second_blob, second_worker = submit(client, program, expected)
            pairs.append(
                {
                    "round": round_index,
                    "build_and_hash_seconds": build_s,
                    "body_bytes": body_bytes,
                    "first_blob_bytes": first_blob,
                    "first_sent_bytes": first_blob + body_bytes,
                    "first_seconds": first_s,
                    "first_worker_ms": first_worker,
                    "second_blob_bytes": second_blob,
                    "second_sent_bytes": second_blob + body_bytes,
                    "second_seconds": second_s,
                    "second_worker_ms": second_worker,
                    "ratio": first_s / second_s,
                }
            )
            log(f"sum round {round_index}: {first_s:.3f} s then {second_s:.3f} s, {second_blob} blob bytes")
        cache = client.health()["cache"]
    median_first = statistics.median(p["first_seconds"] for p in pairs)
    median_second = statistics.median(p["second_seconds"] for p in pairs)
    return {
        "tensor_bytes": nbytes,
        "rounds": pairs,
        "median_first_seconds": median_first,
        "median_second_seconds": median_second,
        "median_ratio": median_first / median_second,
        "max_second_sent_bytes": max(p["second_sent_bytes"] for p in pairs),
        "cache": cache,
        "goal_second_sent_bytes": all(p["second_sent_bytes"] < SECOND_SEND_GOAL_BYTES for p in pairs),
        "goal_second_faster": median_second * SPEEDUP_GOAL < median_first,
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
    parser.add_argument("--rounds", type=int, default=3, help="pairs of submissions, each with a new tensor")
    parser.add_argument("--echo-mib", type=int, default=1024, help="size of the returned tensor")
    parser.add_argument("--sandbox", choices=("bubblewrap", "none"), default=None, help="default: the broker's")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args()

    flags = ["--workers", "1"] + (["--sandbox", args.sandbox] if args.sandbox else [])
    with tempfile.TemporaryDirectory(prefix="kcoral-cache-bench-") as scratch:
        with broker(*flags, "--cache-dir", str(Path(scratch, "sum"))) as (url, _):
            summed = repeated_sum(url, args.sum_mib * MIB, args.rounds)
        # A fresh broker, so its peak memory is this program's alone.
        with broker(*flags, "--cache-dir", str(Path(scratch, "echo"))) as (url, process):
            echoed = echo_peak_memory(url, process.pid, args.echo_mib * MIB)

    print(f"machine: {machine()}; load average at the end: {os.getloadavg()[0]:.2f}; flags: {' '.join(flags)}")
    print_table(
        f"{args.sum_mib} MiB float32 tensor, sum returned, submitted twice; a new tensor each round "
        "(seconds: Client.execute; the program is built and hashed before)",
        (
            "round",
            "hash s",
            "1st sent bytes",
            "1st s",
            "1st worker ms",
            "2nd sent bytes",
            "2nd s",
            "2nd worker ms",
            "1st / 2nd",
        ),
        [
            (
                p["round"],
                p["build_and_hash_seconds"],
                p["first_sent_bytes"],
                p["first_seconds"],
                p["first_worker_ms"],
                p["second_sent_bytes"],
                p["second_seconds"],
                p["second_worker_ms"],
                p["ratio"],
            )
            for p in summed["rounds"]
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
        ("second submission sends < 4 KiB", summed["goal_second_sent_bytes"], f"{summed['max_second_sent_bytes']} B"),
        (
            "second submission < 1/10 of the first's time (medians)",
            summed["goal_second_faster"],
            f"{summed['median_ratio']:.1f}x",
        ),
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
