"""The zygote's anonymous memory in huge pages (kcoral.worker.huge_pages)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kcoral.worker import huge_pages
from kcoral.worker.zygote import HUGE_PAGES_AFTER_FORKS
from tests.helpers import run_function, start_broker

MIB = 1 << 20


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


def kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def test_only_writable_private_anonymous_mappings_are_collapsed_on_huge_page_bounds() -> None:
    huge = huge_pages.HUGE_PAGE_BYTES
    heap = f"{huge - 4096:x}-{4 * huge + 8192:x} rw-p 00000000 00:00 0 [heap]"
    assert huge_pages._collapsible(heap) == (huge, 4 * huge)
    assert huge_pages._collapsible(f"0-{3 * huge:x} rw-p 00000000 00:00 0") == (0, 3 * huge)
    assert huge_pages._collapsible(f"0-{3 * huge:x} r--p 00000000 00:00 0") is None  # read-only
    assert huge_pages._collapsible(f"0-{3 * huge:x} rw-s 00000000 00:01 7 /dev/zero (deleted)") is None
    assert huge_pages._collapsible(f"0-{3 * huge:x} rw-p 00001000 08:01 12 /usr/lib/libx.so") is None
    assert huge_pages._collapsible(f"0-{3 * huge:x} rw-p 00000000 00:00 0 [stack]") is None
    assert huge_pages._collapsible(f"1000-{huge + 4096:x} rw-p 00000000 00:00 0") is None  # no whole huge page
    assert huge_pages._collapsible("garbage") is None


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off on this host")
def test_a_process_s_touched_anonymous_memory_ends_in_huge_pages() -> None:
    script = (
        "from kcoral.worker import huge_pages\n"
        "data = bytearray(b'x' * (64 << 20))\n"
        "collapsed = huge_pages.collapse_anonymous_memory()\n"
        "print(collapsed, huge_pages.anonymous_huge_bytes())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    collapsed, huge = (int(word) for word in out.stdout.split())
    if collapsed == 0:
        pytest.skip("the kernel collapsed nothing (no MADV_COLLAPSE before Linux 6.1, or no huge page free)")
    assert huge >= 32 * MIB, out.stdout


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off on this host")
def test_a_busy_slot_s_zygote_has_its_memory_in_huge_pages(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, "--workers", "1", "--device", "cpu")
    try:
        zygote = next(
            p for p in psutil.Process(broker.process.pid).children(recursive=True) if p.name() == "kcoral-zygote"
        )
        assert huge_pages.anonymous_huge_bytes(zygote.pid) == 0  # not for a slot that served nothing
        for _ in range(HUGE_PAGES_AFTER_FORKS + 1):
            result = run_function(broker.url, "def f():\n    return 1\n", "f")
            assert result.completed, result.error
        if huge_pages.anonymous_huge_bytes(zygote.pid) == 0 and kernel_version() < (6, 1):
            pytest.skip("no MADV_COLLAPSE before Linux 6.1")
        deadline = time.monotonic() + 20  # a piece at a time, while the zygote has nothing to do
        while huge_pages.anonymous_huge_bytes(zygote.pid) < 16 * MIB and time.monotonic() < deadline:
            time.sleep(0.1)
        assert huge_pages.anonymous_huge_bytes(zygote.pid) >= 16 * MIB
    finally:
        broker.stop()
