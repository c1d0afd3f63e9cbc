"""What this host's programs run on: its GPUs (real or fake), found without initialising CUDA.

The broker never creates a CUDA context itself (it would hold GPU memory and could disturb
measurements), so GPUs are listed with ``nvidia-smi``. They are numbered in PCI bus order (programs
run with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA numbers them alike), and each one's device node
comes from the driver (:mod:`kcoral.broker.devices`): its minor is not always its index.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kcoral.broker.devices import GpuNode, gpu_nodes, normalize_bus_id, read_information_files

NVIDIA_SMI_TIMEOUT_SECONDS = 20.0


class TargetError(RuntimeError):
    """Raised when the requested device cannot be served here (say, --device gpu with no GPU)."""


@dataclass(frozen=True)
class GpuInfo:
    index: int  # in PCI bus order: the broker's, NVML's and (with CUDA_DEVICE_ORDER=PCI_BUS_ID) CUDA's
    name: str
    compute_capability: str
    memory_mib: int
    pci_bus_id: str = ""
    uuid: str = ""
    minor: int | None = None  # N of /dev/nvidiaN, from the driver; None when it could not be read


@dataclass(frozen=True)
class TargetInfo:
    device: str  # "gpu" or "cpu"
    gpus: tuple[GpuInfo, ...] = ()
    fake: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def lease_gpus(self) -> tuple[int, ...]:
        if self.fake:
            return tuple(range(self.fake))
        return tuple(g.index for g in self.gpus)

    def to_wire(self) -> dict[str, Any]:
        arch = sorted({g.compute_capability for g in self.gpus})
        return {
            "device": self.device,
            "fake_gpus": self.fake,
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "compute_capability": g.compute_capability,
                    "memory_mib": g.memory_mib,
                    "pci_bus_id": g.pci_bus_id,
                    "uuid": g.uuid,
                    "device_node": None if g.minor is None else f"/dev/nvidia{g.minor}",
                }
                for g in self.gpus
            ],
            "arch": [f"sm_{a.replace('.', '')}" for a in arch],
            "platform": platform.platform(),
            "python": platform.python_version(),
            **self.extra,
        }


NVIDIA_SMI_QUERY = "index,pci.bus_id,uuid,name,compute_cap,memory.total"


def nvidia_smi(*arguments: str) -> str | None:
    """What ``nvidia-smi ARGUMENTS`` prints, or None where it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run(
            [smi, *arguments], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_SECONDS, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def list_gpus() -> list[GpuInfo]:
    out = nvidia_smi(f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits")
    if out is None:
        return []
    return number_gpus(out, gpu_nodes(read_information_files()))


def number_gpus(smi_csv: str, nodes: list[GpuNode]) -> list[GpuInfo]:
    """GPUs from ``nvidia-smi --query-gpu=...`` output (the fields of NVIDIA_SMI_QUERY), indexed in PCI bus order,
    each with its device minor from the driver's ``nodes`` (matched by bus id).

    Without the driver's files (``nodes`` empty) the minor is taken to be nvidia-smi's index, as on
    most hosts; a GPU that the driver's files lack otherwise gets no minor (and no node to bind).
    """
    rows = []
    for line in smi_csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or not parts[0].isdigit():
            continue
        try:
            bus_id = normalize_bus_id(parts[1])
        except ValueError:
            continue
        rows.append((bus_id, int(parts[0]), parts))
    rows.sort()
    minors = {node.bus_id: node.minor for node in nodes}
    gpus = []
    for index, (bus_id, smi_index, parts) in enumerate(rows):
        minor = minors.get(bus_id) if nodes else smi_index
        memory = int(parts[5]) if parts[5].isdigit() else 0
        gpus.append(GpuInfo(index, parts[3], parts[4], memory, bus_id, parts[2], minor))
    return gpus


def describe_target(device: str, gpus: tuple[int, ...] | None, fake_gpus: int) -> TargetInfo:
    """Decide what the broker serves: fake GPUs, the chosen real GPUs, or CPU workers."""
    extra = {}
    for package in ("torch", "triton", "cupti-python"):
        try:
            extra[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if fake_gpus:
        if device == "gpu":
            raise TargetError("--fake-gpus is for hosts without GPUs; leave out --device gpu")
        return TargetInfo("cpu", (), fake_gpus, extra)
    if device == "cpu":
        return TargetInfo("cpu", (), 0, extra)
    found = list_gpus()
    if gpus is not None:
        known = {g.index for g in found}
        missing = [g for g in gpus if g not in known]
        if missing:
            raise TargetError(f"--gpus names GPUs this host lacks: {missing}; it has {sorted(known)}")
        found = [g for g in found if g.index in gpus]
    if not found:
        if device == "gpu":
            raise TargetError("--device gpu, but nvidia-smi lists no GPU on this host")
        return TargetInfo("cpu", (), 0, extra)
    return TargetInfo("gpu", tuple(found), 0, extra)
