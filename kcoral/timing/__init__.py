"""How ``kcoral.builtins.benchmark`` measures a call on the GPU.

The public face is ``kcoral.builtins`` (``benchmark`` and its config); this package holds the
machinery, one role per module:

- ``timing.config``: the config keys, defaults and limits.
- ``timing.trust``: the trusted state, armed before uploaded code runs, and its checks.
- ``timing.cupti``: the CUPTI activity tracer, its clock and the timer's external ids.
- ``timing.windows``: which GPU work belongs to which timed call, by time window (pure).
- ``timing.inputs``: each call's inputs (factory, rotated clones) and the sample of outputs checked.
- ``timing.nvml``: the SM clock, clock-event ("throttle") reasons, and which processes use the GPU.
- ``timing.calls``: the runner (inputs, L2 flush, launch hold, call, synchronisation) and the timed
  loop.
- ``timing.timers``: the two timers (CUPTI, CUDA events) that turn the timed loop into latencies.
- ``timing.findings``: the report's ``integrity`` section (verdict and reasons).
- ``timing.stats``: pure arithmetic on latencies and counts.
- ``timing.benchmark``: ``benchmark`` itself, which puts these together.

Like ``kcoral.builtins``, nothing here imports torch, cupti-python or pynvml at module level: uploaded
code imports ``kcoral.builtins``, which must stay cheap and must not initialise CUDA.

How ``benchmark`` times a call and what it guards against, with the measurements behind each
choice (the hold, the flush, CUPTI against Nsight Compute, the CUDA-event fallback): docs/timing.md.
"""
