"""A side-stream candidate timed by benchmark() (CUPTI) through a broker with CUDA contexts made
ahead and through one without (``--cuda-context lazy``), each twice: whether contexts made ahead
change what the timer sees in its own process. The source is tests/gpu/test_service_gpu.py's.

    python benchmarks/gpu_side_stream_ab.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import broker
from kcoral import Client, Program
from tests.gpu.test_service_gpu import SIDE_STREAM_SOURCE


def main() -> int:
    failed = 0
    for flags in (("--cuda-context", "lazy", "--workers-per-gpu", "1"), ()):
        with broker(*flags) as (url, _process), Client(url) as client:
            for _ in range(2):
                program = Program()
                module = program.upload(kind="module", source=SIDE_STREAM_SOURCE)
                fn = program.get_function(module=module, name="time_side_stream")
                program.return_(key="value", value=program.run(fn=fn, args=["cupti"]))
                result = client.execute(program, timeout_seconds=120)
                if result.completed:
                    report = result.results["value"]
                    print(flags or "(defaults)", "completed", report["latency_ms_median"], report["integrity"])
                else:
                    failed += 1
                    print(flags or "(defaults)", "FAILED", result.error)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
