"""What holds a broker's memory between programs: its RSS against its blob cache's memory tier.

    python3 benchmarks/broker_memory.py --programs 400 --size 512K --cache-bytes 1G 64M

For each ``--cache-bytes`` value, a fresh broker (``--fake-gpus 1 --workers-per-gpu 2``, no
sandbox) runs ``--programs`` programs, each uploading a tensor of fresh random bytes of ``--size``
(as the campaign's honest programs do), four at a time. The table gives the broker's RSS before,
after, and the growth, beside the bytes in its blob cache's memory tier (HEALTH ``cache.bytes``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, save_json, work_directory
from kcoral import AsyncClient, Program
from kcoral.testing import start_broker
from kcoral.units import parse_size

SOURCE = "def total(x):\n    return float(x.sum())\n"


async def upload_all(url: str, programs: int, size: int) -> None:
    rng = np.random.default_rng(7)
    async with AsyncClient(url) as client:

        async def one() -> None:
            program = Program()
            module = program.upload(kind="module", source=SOURCE)
            tensor = program.upload(kind="tensor", value=rng.integers(0, 255, size, dtype=np.uint8))
            fn = program.get_function(module=module, name="total", cpu_only=True)
            program.return_(key="out", value=program.run(fn=fn, args=[tensor]))
            result = await client.execute(program, timeout_seconds=60)
            assert result.completed, result.error

        for start in range(0, programs, 4):
            await asyncio.gather(*(one() for _ in range(min(4, programs - start))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=400)
    parser.add_argument("--size", default="512K")
    parser.add_argument("--cache-bytes", nargs="+", default=["1G", "64M"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows, data = [], {}
    for cache in args.cache_bytes:
        flags = ("--fake-gpus", "1", "--workers-per-gpu", "2", "--sandbox", "none", "--cache-bytes", cache)
        with work_directory("kcoral-memory-") as work:
            service = start_broker(work, *flags, log_level="warning", timeout_seconds=120)
            try:
                process = psutil.Process(service.process.pid)
                before = process.memory_info().rss
                started = time.monotonic()
                asyncio.run(upload_all(service.url, args.programs, parse_size(args.size)))
                wall = time.monotonic() - started
                after = process.memory_info().rss
                tier = service.health()["cache"]
            finally:
                service.stop()
        row = {
            "cache_bytes": cache,
            "rss_before_mib": round(before / 2**20, 1),
            "rss_after_mib": round(after / 2**20, 1),
            "growth_mib": round((after - before) / 2**20, 1),
            "memory_tier_mib": round(tier["bytes"] / 2**20, 1),
            "memory_tier_entries": tier["entries"],
            "wall_s": round(wall, 1),
        }
        data[cache] = row
        rows.append(list(row.values()))
    print_table(
        f"{args.programs} programs of {args.size} fresh tensors",
        ["--cache-bytes", "RSS before MiB", "after", "growth", "memory tier MiB", "entries", "wall s"],
        rows,
    )
    save_json(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
