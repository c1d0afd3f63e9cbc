"""The ``provenance`` map of every program result: where, on what and under which conditions it ran.

The broker writes it, from what it knows itself: the GPUs (UUID, name, bus id, from nvidia-smi at
start), the driver and its CUDA version and the GPUs' temperature and clocks at the start and end
of the program (NVML, where ``nvidia-ml-py`` is installed beside the broker), the versions of
KCoral, Python, torch and cupti-python installed, the sandbox mode, the node id it serves a router
under, the request id and options, and the digests of the program and of every blob it names.
Only two fields come from the program's own process, and are kept apart as its claims under
``program_claims``: the seeds it noted (``kcoral.builtins.note_seed``; ``compare`` notes its own)
and the CUDA version its torch was built with. docs/protocol.md, section 8, lists the fields and
says how to run the same program again from them.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from kcoral import protocol
from kcoral.broker.target import TargetInfo, nvidia_smi

log = structlog.get_logger("kcoral.broker")

# The fields a program's process may claim, and their bounds (its RESULT is untrusted input).
MAX_CLAIMED_SEEDS: Final = 32
_SEED_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_VERSION_TEXT: Final = re.compile(r"[0-9A-Za-z.+_-]{1,40}")


class GpuConditions:
    """Temperature, clocks, power and clock-event reasons of this host's GPUs, by index (NVML).

    NVML creates no CUDA context: reading it disturbs no measurement. Without ``pynvml``, or
    where NVML does not start, every reading is None.
    """

    def __init__(self, target: TargetInfo) -> None:
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self.driver_version: str | None = None
        self.cuda_driver_version: str | None = None
        if not target.gpus:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, or NVMLError where there is no driver
            log.info("provenance_without_nvml", reason=str(exc))
            return
        self._nvml = pynvml
        for gpu in target.gpus:
            with contextlib.suppress(Exception):
                self._handles[gpu.index] = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.pci_bus_id)
        with contextlib.suppress(Exception):
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())
            self.cuda_driver_version = f"{version // 1000}.{version % 1000 // 10}"

    def read(self, gpu_ids: Sequence[int]) -> dict[str, dict[str, Any]] | None:
        """GPU index (as a string) -> its conditions now; None without NVML."""
        if self._nvml is None:
            return None
        return {str(gpu): self._one(self._handles.get(gpu)) for gpu in gpu_ids}

    def _one(self, handle: Any) -> dict[str, Any]:
        nvml = self._nvml

        def ask(name: str, *args: Any) -> Any:
            if handle is None:
                return None
            try:
                return getattr(nvml, name)(handle, *args)
            except Exception:
                return None

        power = ask("nvmlDeviceGetPowerUsage")
        reasons = ask("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = ask("nvmlDeviceGetCurrentClocksThrottleReasons")
        utilization = ask("nvmlDeviceGetUtilizationRates")
        return {
            "temperature_c": ask("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
            "sm_clock_mhz": ask("nvmlDeviceGetClockInfo", getattr(nvml, "NVML_CLOCK_SM", 1)),
            "memory_clock_mhz": ask("nvmlDeviceGetClockInfo", getattr(nvml, "NVML_CLOCK_MEM", 2)),
            "power_w": round(int(power) / 1000, 1) if power is not None else None,
            "utilization_pct": int(utilization.gpu) if utilization is not None else None,
            "clock_event_reasons": int(reasons) if reasons is not None else None,
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_from_smi() -> str | None:
    """The driver's version from nvidia-smi, where NVML is not importable here."""
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    if out is None:
        return None
    lines = out.strip().splitlines()
    return lines[0].strip() if lines else None


def program_digests(program: Mapping[str, Any], digests: Sequence[str]) -> dict[str, Any]:
    """The program's fingerprint: the SHA-256 of its map as the broker packs it, of each module's
    source (by instruction id: inline, or the digest of the blob a source over
    ``INLINE_SOURCE_BYTES`` travels as, which is the SHA-256 of the same bytes), and the digests of
    every blob it names."""
    modules: dict[str, str] = {}
    for instruction in program.get("instructions") or ():
        if not isinstance(instruction, Mapping) or instruction.get("op") != "upload":
            continue
        if instruction.get("kind") != "module":
            continue
        source, blob = instruction.get("source"), instruction.get("blob")
        if isinstance(source, str):
            modules[str(instruction.get("id"))] = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        elif isinstance(blob, str):
            modules[str(instruction.get("id"))] = blob
    return {
        "digest": hashlib.sha256(protocol.pack(dict(program))).hexdigest(),
        "modules": modules,
        "blobs": sorted(set(digests)),
    }


def program_claims(value: Any) -> dict[str, Any]:
    """The worker's ``provenance`` claims, kept only where they have the shape they should."""
    claims: dict[str, Any] = {"seeds": {}, "torch_cuda": None}
    if not isinstance(value, Mapping):
        return claims
    seeds = value.get("seeds")
    if isinstance(seeds, Mapping):
        for name, seed in list(seeds.items())[:MAX_CLAIMED_SEEDS]:
            if isinstance(name, str) and _SEED_NAME.fullmatch(name) and type(seed) is int:
                claims["seeds"][name] = seed
    cuda = value.get("torch_cuda")
    if isinstance(cuda, str) and _VERSION_TEXT.fullmatch(cuda):
        claims["torch_cuda"] = cuda
    return claims


@dataclass
class Provenance:
    """What the broker puts in every result's ``provenance``; the host's part found once at start."""

    target: TargetInfo
    versions: dict[str, str]
    sandbox: str
    hostname: str
    instance_id: str
    conditions: GpuConditions | None = None
    host: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.conditions is None:
            self.conditions = GpuConditions(self.target)
        driver = self.conditions.driver_version
        if driver is None and self.target.gpus:
            driver = driver_from_smi()
        self.host = {
            "hostname": self.hostname,
            "broker_instance_id": self.instance_id,
            "versions": {
                "kcoral": self.versions.get("kcoral"),
                "python": self.versions.get("python"),
                "protocol": self.versions.get("protocol"),
                "torch": self.target.extra.get("torch"),
                "cupti-python": self.target.extra.get("cupti-python"),
                "numpy": self.versions.get("numpy"),
                "driver": driver,
                "cuda_driver": self.conditions.cuda_driver_version,
            },
        }

    def at_start(
        self,
        *,
        request_id: str,
        program: Mapping[str, Any],
        digests: Sequence[str],
        options: Mapping[str, Any],
        gpu_ids: Sequence[int],
        node_id: str | None,
    ) -> dict[str, Any]:
        """All of a program's ``provenance`` that is known as it starts (kept on its request), the
        GPUs' conditions then included; :meth:`for_result` adds the rest. Made while the worker
        starts on the program, not between its RESULT and its FINAL (the program's fingerprint, a
        SHA-256 of it packed, was about 70 us of the 2-core VM's 360 there)."""
        assert self.conditions is not None
        by_index = {gpu.index: gpu for gpu in self.target.gpus}
        gpus = [
            {"index": g, "uuid": by_index[g].uuid, "name": by_index[g].name, "pci_bus_id": by_index[g].pci_bus_id}
            if g in by_index
            else {"index": g, "uuid": None, "name": None, "pci_bus_id": None}
            for g in gpu_ids
        ]
        return {
            "request_id": request_id,
            "node_id": node_id,
            **self.host,
            "sandbox": self.sandbox,
            "device": self.target.device,
            "fake_gpus": self.target.fake,
            "gpus": gpus,
            "gpu_conditions": {"start": self.conditions.read(gpu_ids)},
            "program": program_digests(program, digests),
            "options": dict(options),
        }

    def for_result(self, started: Mapping[str, Any], gpu_ids: Sequence[int], claims: Any) -> dict[str, Any]:
        """The ``provenance`` map of one program's result: what :meth:`at_start` made, with the
        GPUs' conditions now and the worker's ``claims``."""
        assert self.conditions is not None
        start = (started.get("gpu_conditions") or {}).get("start")
        return {
            **started,
            "gpu_conditions": {"start": start, "end": self.conditions.read(gpu_ids)},
            "program_claims": program_claims(claims),
        }
