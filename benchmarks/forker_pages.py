"""The forker's page tables as programs go by, and the pages its loop writes (as root).

    python benchmarks/forker_pages.py [--programs 640] [--broker-flags "--sandbox none"]
    python benchmarks/forker_pages.py --writes 3

Starts one broker with one CPU slot (``--device cpu --workers 1``) and runs constant programs one
at a time. Without ``--writes``: after 0, 5, 10, 20, 40, ... programs, the small (4 KiB) page-table
entries and the huge pages of the zygote and of its forker (``kcoral.worker.forker``), counted over
their mappings that hold anonymous pages (``/proc/PID/smaps``): what each fork copies and each
worker's exit tears down. A forker whose count grows after its collapse has split huge pages by
its own writes (``benchmarks/RESULTS.md``, "The forker's page-table entries on the H200").

``--writes N``: once the forker is ready and has forked a few workers, the pages whose frame
changed while N more programs ran (each write after a fork copies the page), by mapping and by
2 MiB region, each with the 8-byte words that differ (``/proc/PID/pagemap`` and ``/proc/PID/mem``,
read from outside: the forker is not dumpable, so this needs root). A page copied with no word
changed was written back as it was: a reference count raised and lowered again. The forker's
writable pages are held in memory meanwhile, to compare: as much as it has resident (hundreds of
MiB where torch is preloaded).
"""

from __future__ import annotations

import argparse
import collections
import os
import struct
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker, constant_program, machine
from kcoral import Client

PAGE = 4096
HUGE_SHIFT = 21  # a 2 MiB region
CHECKPOINTS = (0, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
NAMES = ("kcoral-zygote", "kcoral-forker")


def page_tables(pid: int) -> tuple[int, int]:
    """(small entries, huge pages) of ``pid``'s mappings that hold anonymous pages."""
    small = huge = 0
    fields: dict[str, int] = {}

    def add() -> None:
        nonlocal small, huge
        if fields.get("Anonymous", 0) > 0:
            small += (fields.get("Rss", 0) - fields.get("AnonHugePages", 0) - fields.get("FilePmdMapped", 0)) // 4
            huge += fields.get("AnonHugePages", 0) // 2048

    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":") and parts[-1] == "kB":
                fields[parts[0][:-1]] = int(parts[1])
            elif parts and "-" in parts[0]:
                add()
                fields = {}
    add()
    return small, huge


def slot_processes(broker: int) -> dict[str, int]:
    """The slot's zygote and forker by name (their pids on this host)."""
    found: dict[str, int] = {}
    for process in psutil.Process(broker).children(recursive=True):
        try:
            name = process.name()
        except psutil.Error:
            continue
        if name in NAMES:
            found[name] = process.pid
    return found


def writable_mappings(pid: int) -> list[tuple[int, int, str]]:
    mappings = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split()
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if "w" in parts[1]:
                mappings.append((low, high, parts[5] if len(parts) > 5 else "[anonymous]"))
    return mappings


def frames(pid: int, mappings: list[tuple[int, int, str]]) -> dict[int, int]:
    """Each present page's frame number, by address."""
    found: dict[int, int] = {}
    descriptor = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        for low, high, _ in mappings:
            entries = os.pread(descriptor, (high - low) // PAGE * 8, low // PAGE * 8)
            for index, (entry,) in enumerate(struct.iter_unpack("Q", entries)):
                if entry >> 63:
                    found[low + index * PAGE] = entry & ((1 << 55) - 1)
    finally:
        os.close(descriptor)
    return found


def writes(url: str, forker: int, programs: int) -> None:
    """Print the pages the forker copied while ``programs`` constant programs ran."""
    mappings = writable_mappings(forker)
    memory = os.open(f"/proc/{forker}/mem", os.O_RDONLY)
    before = frames(forker, mappings)
    content = {address: os.pread(memory, PAGE, address) for address in before}
    with Client(url) as client:
        for _ in range(programs):
            result = client.execute(constant_program())
            assert result.completed, result.error
    time.sleep(0.3)
    after = frames(forker, mappings)
    changed = sorted(address for address, frame in after.items() if before.get(address) != frame)
    pages: collections.Counter[str] = collections.Counter()
    regions: dict[str, set[int]] = collections.defaultdict(set)
    print(f"\nPages the forker copied over {programs} programs ({machine()}): {len(changed)}")
    for address in changed:
        name = next(n for low, high, n in mappings if low <= address < high)
        pages[name] += 1
        regions[name].add(address >> HUGE_SHIFT)
        old, new = content.get(address, b""), os.pread(memory, PAGE, address)
        words = [offset for offset in range(0, PAGE, 8) if old[offset : offset + 8] != new[offset : offset + 8]]
        shown = " ".join(
            f"+{o}:{int.from_bytes(old[o : o + 8], 'little'):#x}->{int.from_bytes(new[o : o + 8], 'little'):#x}"
            for o in words[:4]
        )
        print(f"  {address:#x} {name[-32:]:32s} {len(words):3d} words changed {shown}")
    os.close(memory)
    for name, count in pages.most_common():
        print(f"{count:5d} pages in {len(regions[name]):3d} 2 MiB regions: {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=640)
    parser.add_argument("--writes", type=int, default=0, metavar="N")
    parser.add_argument("--broker-flags", default="", help="more flags for kcoral broker (quoted)")
    args = parser.parse_args()
    with broker("--device", "cpu", "--workers", "1", *args.broker_flags.split()) as (url, process):
        done = 0
        with Client(url) as client:
            for checkpoint in [c for c in CHECKPOINTS if c <= args.programs] if not args.writes else [20]:
                while done < checkpoint:
                    result = client.execute(constant_program())
                    assert result.completed, result.error
                    done += 1
                time.sleep(0.3)  # the spare forked after the last program
                counts = {name: page_tables(pid) for name, pid in slot_processes(process.pid).items()}
                shown = "  ".join(f"{name} small {small} huge {huge}" for name, (small, huge) in counts.items())
                print(f"after {done:5d} programs: {shown}", flush=True)
        if args.writes:
            forker = slot_processes(process.pid).get("kcoral-forker")
            if forker is None:
                sys.exit("the slot has no forker (yet): nothing to watch")
            writes(url, forker, args.writes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
