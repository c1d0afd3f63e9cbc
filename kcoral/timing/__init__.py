"""How ``kcoral.builtins.benchmark`` measures a call on the GPU.

The public face is ``kcoral.builtins`` (``benchmark``, ``compare`` and their configs); this package
holds the machinery, one role per module:

- ``timing.config``: the config keys, defaults and limits.
- ``timing.trust``: the trusted state, armed before uploaded code runs, and its checks.
- ``timing.cupti``: the CUPTI activity tracer, its clock and the timer's external ids.
- ``timing.windows``: which GPU work belongs to which timed call, by time window, and whether
  CUPTI's clock kept time with the host's over the windows (pure).
- ``timing.inputs``: each call's inputs (factory, rotated clones) and the sample of outputs checked.
- ``timing.nvml``: the SM clock, clock-event ("throttle") reasons, and which processes use the GPU.
- ``timing.calls``: the runner (inputs, L2 flush, launch hold, call, synchronisation) and the timed
  loop.
- ``timing.timers``: the two timers (CUPTI, CUDA events) that turn the timed loop into latencies.
- ``timing.findings``: the report's ``integrity`` section (verdict and reasons).
- ``timing.stats``: pure arithmetic on latencies and counts.
- ``timing.calibrate``: what runs before the counted calls (timer choice, trusted-state check, first
  call, probe, clock warm-up, hold fit, warm-up), shared by ``benchmark`` and ``compare``.
- ``timing.benchmark``: ``benchmark`` itself, which puts these together.
- ``timing.conditions``: the GPU's temperature, clocks, power and utilisation, and the wait for a
  cool, idle GPU.
- ``timing.ab_config``, ``timing.ab_stats``: ``compare``'s settings and its statistics (paired
  rounds, the bootstrap interval of B/A, the verdict, the adaptive stop; pure).
- ``timing.compare``: ``compare``, A against B in interleaved rounds with ``benchmark``'s defences.
- ``timing.ab_rounds``, ``timing.ab_report``: ``compare``'s sides and rounds (one block of calls, the
  samples left out by the clock, the adaptive stop), and its report of each side and of the clock.
- ``timing.seeds``: the seeds a program's measurements drew, for the result's ``provenance``.

Like ``kcoral.builtins``, nothing here imports torch, cupti-python or pynvml at module level: uploaded
code imports ``kcoral.builtins``, which must stay cheap and must not initialise CUDA.

How ``benchmark`` times a call and what it guards against, with the measurements behind each
choice (the hold, the flush, CUPTI against Nsight Compute, the CUDA-event fallback): docs/timing.md.
"""
