"""What the broker's NVML reads cost: each call of a program's GPU conditions, timed on GPU 0.

    python benchmarks/nvml_cost.py [--calls 200]

The broker reads a GPU's conditions (``kcoral.broker.provenance``) as a program starts and again
for its result, on its event loop: whatever they take is on a short program's path. Printed: the
median and p90 of each NVML call and of one whole reading, in microseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, print_table
from kcoral.broker.provenance import GpuConditions
from kcoral.broker.target import describe_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    try:
        import pynvml  # the gpu extra (nvidia-ml-py)
    except ImportError:
        print("nvml_cost.py needs the gpu extra (nvidia-ml-py)", file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "nvmlDeviceGetPowerUsage": (),
        "nvmlDeviceGetCurrentClocksEventReasons": (),
        "nvmlDeviceGetUtilizationRates": (),
        "nvmlDeviceGetTemperature": (pynvml.NVML_TEMPERATURE_GPU,),
        "nvmlDeviceGetClockInfo": (pynvml.NVML_CLOCK_SM,),
    }
    rows = []
    for name, extra in calls.items():
        call = getattr(pynvml, name, None)
        if call is None:
            continue
        samples = []
        for _ in range(args.calls):
            start = time.perf_counter()
            call(handle, *extra)
            samples.append((time.perf_counter() - start) * 1e6)
        rows.append([name, float(np.median(samples)), float(np.percentile(samples, 90))])
    conditions = GpuConditions(describe_target("auto", None, 0))
    whole = []
    for _ in range(args.calls):
        start = time.perf_counter()
        conditions.read([0])
        whole.append((time.perf_counter() - start) * 1e6)
    rows.append(["one reading (GpuConditions.read)", float(np.median(whole)), float(np.percentile(whole, 90))])
    print_table(f"NVML calls on GPU 0 ({machine()}, {args.calls} each)", ["call", "p50 us", "p90 us"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
