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

How ``benchmark`` times a call
------------------------------
Each timed call runs in a *window*: the device is synchronised and CUPTI's clock read before the
call, and again after it, so the device is idle at both ends. Every kernel, memcpy and memset of
the process that starts inside the window is the call's, whatever thread, stream, correlation or
external id launched it; work still running when the call returned is inside the window too. The
timer marks its own work (flush, hold, input making, output snapshots, a sentinel) with CUPTI
*external correlation ids* from a fresh random block per measurement, so it can leave that out;
work between windows that is not the timer's is reported as foreign (``kcoral.timing.windows``
says why windows replaced attribution by external id). CUPTI writes the correlation records only
while API activity (``RUNTIME``/``DRIVER``) is enabled, so those kinds are enabled around the probe
and the counted calls only, not during warm-up; a callback subscription is not used (it runs
Python on every CUDA API call, and CUPTI takes one subscriber per process, which
``GpuAccessGuard`` wants), but a subscription made by someone else fails the measurement.

Before each counted call the L2 cache is flushed by *reading* a buffer twice the L2 size (a read
leaves clean lines, so the next call pays no write-back for the flush) and the device is
synchronised, so nothing of the call overlaps the flush. Then a one-thread spin kernel *holds* the
current stream (for 0.1 to 0.5 ms on the H200) while the host launches the call behind it.

Why the hold: after a host synchronisation the GPU waits for every launch, so a call that launches
several pieces of work is timed with the host's launch gaps between them. torch.mm on the H200
launches a workspace memset, then the GEMM about 10 us later; their span read 185-189 us where the
GEMM takes 175-176 us (Nsight Compute: 176-177 us), the +7% first seen. Queued behind the hold,
the same call reads 176-179 us (two sessions). The hold is sized from the call's host launch time
and lengthened while CUPTI's API records show launches still running when it ended. A call with
work on another stream gets no hold: that work is not held, starts beside the spin kernel, and a
kernel that wants every SM waits for the spin's SM (a side-stream GEMM read 211 us with a hold,
184-188 us without).

A call's latency is the span from the first start to the last end of its activities. For a single
kernel that is CUPTI's kernel duration (what Nsight Systems shows). Nsight Compute's
``gpu__time_duration`` reads about 1.1 us more per kernel (H200: 44.69 against 43.62 us for a
16M-float add, 5.31 against 4.13 us for a 1M-float add, 175.9 against 176.1 us for a 4096^3 bf16
GEMM whose memset and GEMM the span both covers): its timestamps are written by the GPU's front
end before the launch and after completion, so they include the launch processing that CUPTI's
kernel timestamps leave out. That is 2-3% for the add and under 1% for the GEMM, but 22% for a
4 us kernel. Nothing on this side of the GPU reproduces ncu's offset: CUDA events around the held
call read about 2.5 us more than CUPTI's duration (6.6 us for the 4 us kernel), the same whether
the stream was held by the spin kernel or by a wait on a host flag, and an event recorded right
after another costs 1.3 us; timing from the end of the hold (``ready_span``) reads the same 6.6
us. ``latency_ms_median_by`` in the result gives the median by each of these. Before counting, the
call runs until NVML reports a steady SM clock (bounded), then for the warm-up budget.

Where CUPTI never worked in the process (checked when the worker armed the timer, before any
uploaded code ran), or with ``method="cuda_event"``, a pair of CUDA events around each call on the
current stream times it, with the same flush and hold; ``method`` and ``cupti_error`` in the result
say which was used and why. Events see only work ordered on the current stream, and cannot tell a
call that launched nothing. Where CUPTI worked, a later failure of it fails the instruction with
``integrity``: a candidate that breaks CUPTI to force the fallback and then hides its work on a
side stream gets no number.
"""
