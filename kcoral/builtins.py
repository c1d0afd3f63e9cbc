"""What uploaded code imports from KCoral: ``benchmark`` (GPU timing), ``compare`` (is B faster
than A: a paired comparison with a confidence interval and a verdict), ``note_seed`` (a seed the
program drew, for the result's ``provenance``) and ``GpuAccessGuard``.

Uploaded code imports this module (``from kcoral.builtins import benchmark``), so its top level
imports nothing heavy: torch, cupti-python and pynvml are imported inside the functions that need
them. How a call is timed, and why, is told in ``kcoral.timing``; ``GpuAccessGuard`` lives in
``kcoral.gpu_guard``.
"""

from __future__ import annotations

from kcoral.gpu_guard import GpuAccessGuard, gpu_access_guard
from kcoral.timing.ab_config import COMPARE_KEYS, CompareConfig
from kcoral.timing.benchmark import benchmark
from kcoral.timing.compare import compare
from kcoral.timing.config import CONFIG_KEYS, BenchmarkConfig
from kcoral.timing.seeds import note_seed

__all__ = [
    "COMPARE_KEYS",
    "CONFIG_KEYS",
    "BenchmarkConfig",
    "CompareConfig",
    "GpuAccessGuard",
    "benchmark",
    "compare",
    "gpu_access_guard",
    "note_seed",
]
