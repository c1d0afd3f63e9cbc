"""How ``kcoral.builtins.benchmark`` measures a call on the GPU.

The public face is ``kcoral.builtins`` (``benchmark`` and its config); this package holds the
machinery, one role per module:

- ``timing.cupti``: the CUPTI activity tracer, the external correlation ids that bracket each
  call, and the grouping of activity records into per-call spans.
- ``timing.nvml``: the SM clock and clock-event ("throttle") reasons from NVML, and when the clock
  counts as steady.
- ``timing.timers``: the runner (L2 flush, launch hold, call, synchronisation), the timed loop and
  the two timers (CUPTI, CUDA events) that turn it into latencies.
- ``timing.stats``: pure arithmetic on latencies and counts.

Like ``kcoral.builtins``, nothing here imports torch, cupti-python or pynvml at module level: uploaded
code imports ``kcoral.builtins``, which must stay cheap and must not initialise CUDA.

How ``benchmark`` times a call
------------------------------
Each timed call is bracketed with a CUPTI *external correlation id* (``activity_push_external_
correlation_id`` before the call, ``activity_pop_external_correlation_id`` after it). CUPTI then
writes, for every CUDA runtime and driver API call made on this thread inside the bracket, an
``EXTERNAL_CORRELATION`` record that maps the API call's correlation id to our id; every kernel,
memcpy and memset record carries the correlation id of the API call that launched it, on whatever
stream.

Why external correlation rather than a callback subscription: a subscription runs a Python
function on *every* CUDA API call (torch makes several per op), which perturbs the host side of the
measurement, and CUPTI allows one subscriber per process, which ``GpuAccessGuard`` (and profilers)
also want. External correlation costs two C calls per timed call. CUPTI only writes the
correlation records while API activity (``RUNTIME``/``DRIVER``) is enabled, so those kinds are
enabled around the probe and the counted calls only, not during warm-up.

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

Without cupti-python (or when it fails to initialise) the fallback is a pair of CUDA events around
each call on the current stream, with the same flush and hold; ``method`` in the result says which
was used. Events see only work ordered on the current stream, and cannot tell a call that launched
nothing.
"""
