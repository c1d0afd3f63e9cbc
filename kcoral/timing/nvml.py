"""The GPU's SM clock and clock-event ("throttle") reasons from NVML, and when the clock is steady.

pynvml is imported inside ``Nvml.open``: this module is imported with ``kcoral.builtins``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Final

# The clock is "steady" once this many NVML samples, at least this far apart, lie within this
# fraction of their maximum. NVML refreshes clocks every few ms; 10 ms apart avoids re-reading one.
CLOCK_STEADY_SAMPLES: Final = 5
CLOCK_SAMPLE_INTERVAL_S: Final = 0.010
CLOCK_STEADY_TOLERANCE: Final = 0.01

# NVML clock event ("throttle") reason bits, named as nvidia-smi names them. Kept here rather than
# read from pynvml because the constant names moved between nvidia-ml-py releases.
THROTTLE_REASONS: Final[tuple[tuple[int, str], ...]] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# Reasons that mean the clock was pulled below what the work asked for. Idle, application clocks and
# display settings are states, not slowdowns.
SLOWDOWN_MASK: Final = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
POWER_CAP: Final = 0x4
# Slowdowns that disturb a measurement whatever the clock reads: hardware slowdown, thermal and the
# power brake. The software power cap alone is not one of them: it is the normal state of a
# sustained GEMM on an H200 (NVML sets it on most readings while the clock holds), so a sample taken
# power capped is kept, counted, and the clock it ran at is compared between A and B instead
# (``clocks_apart``): a capped clock that A and B share is steady, one that differs is not.
DISTURBANCE_MASK: Final = SLOWDOWN_MASK & ~POWER_CAP


def clock_is_steady(
    samples_mhz: Sequence[float],
    *,
    window: int = CLOCK_STEADY_SAMPLES,
    tolerance: float = CLOCK_STEADY_TOLERANCE,
) -> bool:
    """True when the last ``window`` clock samples lie within ``tolerance`` of their maximum."""
    if len(samples_mhz) < window:
        return False
    recent = samples_mhz[-window:]
    top = max(recent)
    return top > 0 and (top - min(recent)) <= tolerance * top


def throttle_reason_names(mask: int | None) -> list[str] | None:
    """Names of the NVML clock event reasons set in ``mask`` (None when NVML gave none)."""
    if mask is None:
        return None
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"other_0x{mask & ~known:x}")
    return names


class Nvml:
    """SM clock and clock-event reasons of one GPU; every method returns None when NVML cannot answer."""

    def __init__(self, handle: Any, module: Any) -> None:
        self._handle = handle
        self._nvml = module

    @classmethod
    def open(cls, torch: Any, device: int) -> Nvml | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()  # reference-counted by NVML: repeated calls are cheap and harmless
        except pynvml.NVMLError:
            return None
        props = torch.cuda.get_device_properties(device)
        # CUDA_VISIBLE_DEVICES renumbers devices, so match NVML's device by UUID, then by PCI id.
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            text = str(uuid)  # torch prints the bare UUID; NVML wants the "GPU-" prefix
            candidate = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
            with contextlib.suppress(pynvml.NVMLError):
                return cls(pynvml.nvmlDeviceGetHandleByUUID(candidate), pynvml)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
            with contextlib.suppress(pynvml.NVMLError):
                return cls(pynvml.nvmlDeviceGetHandleByPciBusId(pci), pynvml)
        return None

    def sm_clock_mhz(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except self._nvml.NVMLError:
            return None

    def running_pids(self) -> set[int] | None:
        """PIDs (in NVML's, i.e. the host's, namespace) with a compute context on this GPU."""
        try:
            return {int(p.pid) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)}
        except (self._nvml.NVMLError, AttributeError):
            return None

    def busy_pids(self, since_us: int) -> dict[int, int] | None:
        """PID -> highest SM utilisation (%) NVML sampled for it since ``since_us`` (host clock, us).

        Empty when NVML took no sample with a busy process; None when it cannot tell at all.
        """
        getter = getattr(self._nvml, "nvmlDeviceGetProcessUtilization", None)
        if getter is None:
            return None
        try:
            samples = getter(self._handle, since_us)
        except self._nvml.NVMLError as exc:
            # NVML answers "not found" when no process was sampled since then.
            return {} if "not found" in str(exc).lower() else None
        busy: dict[int, int] = {}
        for sample in samples or ():
            sm = int(getattr(sample, "smUtil", 0) or 0)
            if sm > 0:
                pid = int(sample.pid)
                busy[pid] = max(busy.get(pid, 0), sm)
        return busy

    def _read_int(self, read: Callable[[Any, Any], Any]) -> int | None:
        """``read(pynvml, handle)`` as an int, or None where NVML cannot answer (an NVML error, or a
        function or field this pynvml lacks)."""
        try:
            return int(read(self._nvml, self._handle))
        except (self._nvml.NVMLError, AttributeError):
            return None

    def max_sm_clock_mhz(self) -> int | None:
        return self._read_int(lambda nvml, handle: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))

    def memory_clock_mhz(self) -> int | None:
        return self._read_int(lambda nvml, handle: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM))

    def temperature_c(self) -> int | None:
        return self._read_int(lambda nvml, handle: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))

    def utilization_pct(self) -> int | None:
        """The share of the last sample period (1/6 s to 1 s) in which a kernel ran, any process's."""
        return self._read_int(lambda nvml, handle: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def power_w(self) -> float | None:
        milliwatts = self._read_int(lambda nvml, handle: nvml.nvmlDeviceGetPowerUsage(handle))
        return round(milliwatts / 1000, 1) if milliwatts is not None else None

    def clock_event_reasons(self) -> int | None:
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            getter = getattr(self._nvml, name, None)
            if getter is None:
                continue
            with contextlib.suppress(self._nvml.NVMLError):
                return int(getter(self._handle))
        return None


def sample_left_out(sm_clock_mhz: int | None, reasons: int | None, floor_mhz: float | None) -> str | None:
    """Why a sample taken at this clock and clock-event mask is left out (``throttled``: a
    disturbance reason was set, ``DISTURBANCE_MASK``; ``below_clock_floor``), or None to keep it.
    A reading NVML could not give keeps the sample; so does the power cap alone above the floor."""
    if reasons is not None and reasons & DISTURBANCE_MASK:
        return "throttled"
    if sm_clock_mhz is not None and floor_mhz is not None and sm_clock_mhz < floor_mhz:
        return "below_clock_floor"
    return None


def power_capped(reasons: int | None) -> bool:
    """Whether NVML's clock-event mask has the software power cap set."""
    return reasons is not None and bool(reasons & POWER_CAP)


def clocks_apart(a_mhz: Sequence[float], b_mhz: Sequence[float], tolerance: float) -> bool:
    """True when the median SM clocks of two sets of samples differ by more than ``tolerance`` of the
    higher one (False where either set has no reading)."""
    if not a_mhz or not b_mhz:
        return False
    a, b = statistics.median(a_mhz), statistics.median(b_mhz)
    top = max(a, b)
    return top > 0 and abs(a - b) > tolerance * top


def clock_state(nvml: Nvml | None) -> dict[str, Any]:
    """The SM clock (``sm_clock_mhz``) and clock-event reason mask (``reasons``) now; None without NVML."""
    if nvml is None:
        return {"sm_clock_mhz": None, "reasons": None}
    return {"sm_clock_mhz": nvml.sm_clock_mhz(), "reasons": nvml.clock_event_reasons()}
