"""GPU index -> device node, as the NVIDIA driver tells it.

The driver lists each GPU it drives in ``/proc/driver/nvidia/gpus/<PCI bus id>/information``, with
its ``Device Minor``: the N of ``/dev/nvidiaN``. The minor is the order in which the driver probed
the GPUs, which is not always their PCI order (nor, then, ``nvidia-smi``'s or CUDA's index). KCoral
numbers GPUs by PCI bus id, and runs programs with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so that an
index means the same GPU to the broker, NVML and CUDA; the minor says which node to bind for it.

Example::

    nodes = gpu_nodes(read_information_files())  # [GpuNode(index=0, bus_id="0000:19:00.0", minor=1, ...)]
    nodes[0].device  # Path("/dev/nvidia1")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["DRIVER_GPUS", "GpuNode", "gpu_nodes", "normalize_bus_id", "parse_information", "read_information_files"]

DRIVER_GPUS: Final = Path("/proc/driver/nvidia/gpus")
DEVICE_DIR: Final = Path("/dev")


@dataclass(frozen=True)
class GpuNode:
    """One GPU as the driver knows it: its KCoral index (PCI order) and its device node."""

    index: int
    bus_id: str  # normalized: "0000:19:00.0"
    minor: int
    uuid: str = ""
    model: str = ""

    @property
    def device(self) -> Path:
        return DEVICE_DIR / f"nvidia{self.minor}"


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:19:00.0`` (nvidia-smi), ``0000:19:00.0`` (the driver) -> ``0000:19:00.0``.

    The domain is kept to four hex digits, everything lower case; ValueError for other text.
    """
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    dom, bus, devfn = parts
    dev, _, fn = devfn.partition(".")
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def parse_information(text: str) -> dict[str, str]:
    """The ``Key: value`` lines of one ``information`` file (keys as written, values stripped)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields.setdefault(key.strip(), value.strip())
    return fields


def gpu_nodes(information: Mapping[str, str]) -> list[GpuNode]:
    """Every GPU of the driver's ``information`` files, indexed in PCI bus order.

    ``information`` maps each file's directory name (the bus id) to its text. The bus id is read
    from ``Bus Location`` when the file has one, else from the directory name. A file without a
    readable ``Device Minor`` is left out (the GPU cannot be bound), as is a GPU marked
    ``GPU Excluded: Yes``; ValueError when two GPUs claim one minor.
    """
    found: list[tuple[str, int, str, str]] = []
    for directory, text in information.items():
        fields = parse_information(text)
        try:
            bus_id = normalize_bus_id(fields.get("Bus Location") or directory)
            minor = int(fields["Device Minor"])
        except (KeyError, ValueError):
            continue
        if fields.get("GPU Excluded", "").lower() == "yes":
            continue
        found.append((bus_id, minor, fields.get("GPU UUID", ""), fields.get("Model", "")))
    found.sort()
    minors = [minor for _, minor, _, _ in found]
    if len(set(minors)) != len(minors):
        raise ValueError(f"two GPUs share a device minor: {found}")
    return [GpuNode(index, bus, minor, uuid, model) for index, (bus, minor, uuid, model) in enumerate(found)]


def read_information_files(root: Path = DRIVER_GPUS) -> dict[str, str]:
    """The texts of ``root/*/information`` by directory name; empty where the driver is absent."""
    texts: dict[str, str] = {}
    try:
        directories = sorted(root.iterdir())
    except OSError:
        return texts
    for directory in directories:
        try:
            texts[directory.name] = (directory / "information").read_text()
        except OSError:
            continue
    return texts
