"""The GPU's conditions around a measurement (temperature, clocks, power, utilisation, clock-event
reasons, from NVML) and the wait for a cool, idle GPU before measuring.

KCoral never locks clocks: the GPU hosts' settings stay as they are. What it can do is say what the
GPU was doing before and after, leave out samples taken while throttled (``kcoral.timing.compare``)
and, when asked, wait until the GPU has cooled down and nobody else keeps it busy. "Idle" is NVML's
device-wide utilisation: while the wait runs this process launches nothing, so what it sees is
other processes' work (a tenant outside KCoral, say). A wait that ends on its bound says so; the
run goes on, and what the report says of the clocks decides whether the numbers are trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from kcoral.timing.nvml import Nvml, throttle_reason_names

COOL_POLL_S: Final = 0.05
# Below this the GPU counts as cool; an H200 idles at about 30 C and runs near 50-60 C under load.
DEFAULT_COOL_TEMP_C: Final = 50
# At or below this device-wide utilisation (%) the GPU counts as idle.
DEFAULT_IDLE_UTIL_PCT: Final = 5
MAX_COOL_WAIT_MS: Final = 120_000.0


def gpu_conditions(nvml: Nvml | None) -> dict[str, Any] | None:
    """What the GPU reports now: ``temperature_c``, ``sm_clock_mhz``, ``max_sm_clock_mhz``,
    ``memory_clock_mhz``, ``power_w``, ``utilization_pct`` and ``throttle_reasons`` (names);
    None without NVML. Each is None where NVML cannot give it."""
    if nvml is None:
        return None
    return {
        "temperature_c": nvml.temperature_c(),
        "sm_clock_mhz": nvml.sm_clock_mhz(),
        "max_sm_clock_mhz": nvml.max_sm_clock_mhz(),
        "memory_clock_mhz": nvml.memory_clock_mhz(),
        "power_w": nvml.power_w(),
        "utilization_pct": nvml.utilization_pct(),
        "throttle_reasons": throttle_reason_names(nvml.clock_event_reasons()),
    }


@dataclass(frozen=True)
class CoolWait:
    """What the wait for a cool, idle GPU saw: how long it took and whether the bounds were met."""

    asked: bool
    reached: bool | None  # None: not asked, or NVML cannot tell
    waited_ms: float
    temperature_c: int | None
    utilization_pct: int | None
    reason: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "asked": self.asked,
            "reached": self.reached,
            "waited_ms": round(self.waited_ms, 1),
            "temperature_c": self.temperature_c,
            "utilization_pct": self.utilization_pct,
            "reason": self.reason,
        }


def wait_cool_idle(
    nvml: Nvml | None,
    *,
    max_wait_ms: float,
    cool_temp_c: float = DEFAULT_COOL_TEMP_C,
    idle_util_pct: float = DEFAULT_IDLE_UTIL_PCT,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> CoolWait:
    """Poll until the GPU is at most ``cool_temp_c`` and at most ``idle_util_pct`` busy, or
    ``max_wait_ms`` has passed. ``max_wait_ms`` 0: no wait, nothing read."""
    if max_wait_ms <= 0:
        return CoolWait(False, None, 0.0, None, None)
    if nvml is None:
        return CoolWait(True, None, 0.0, None, None, "NVML is unavailable: the GPU's temperature cannot be read")
    began = clock()
    while True:
        temperature, utilization = nvml.temperature_c(), nvml.utilization_pct()
        waited = (clock() - began) * 1e3
        if temperature is None and utilization is None:
            return CoolWait(True, None, waited, None, None, "NVML gives neither temperature nor utilisation")
        cool = temperature is None or temperature <= cool_temp_c
        idle = utilization is None or utilization <= idle_util_pct
        if cool and idle:
            return CoolWait(True, True, waited, temperature, utilization)
        if waited >= max_wait_ms:
            missed = []
            if not cool:
                missed.append(f"still {temperature} C (bound {cool_temp_c:g} C)")
            if not idle:
                missed.append(f"still {utilization}% busy (bound {idle_util_pct:g}%)")
            reason = f"the GPU was {' and '.join(missed)} after {waited:.0f} ms"
            return CoolWait(True, False, waited, temperature, utilization, reason)
        sleep(COOL_POLL_S)
