"""Byte sizes as people write and read them: ``512M``, ``8GiB``, ``1.5 GiB``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
SIZE_EXAMPLES = "a byte count or a size like 512K, 64M, 8G, 1.5GiB"


def parse_size(text: str) -> int:
    """Bytes in ``text`` (binary units: ``1K`` is 1024); ValueError naming the expected form."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected {SIZE_EXAMPLES}, not {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole numbers without decimals (``"8 GiB"``)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(count) >= size:
            value = count / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{count:.0f} B"
