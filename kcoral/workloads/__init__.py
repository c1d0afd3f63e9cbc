"""Trusted workload evaluation for ``kcoral remote``: a workload defines its inputs, reference, check
and timing; the service runs the candidate in a process of its own and checks it from another.

- ``workloads.format``: what a workload folder holds (``workload.py``) and how it is loaded.
- ``workloads.channel``: the one-way message stream from the candidate's process to the harness
  (length-prefixed JSON headers, tensors as raw bytes; nothing is pickled).
- ``workloads.runner``: the candidate's process (``python -m kcoral.workloads.runner``): arms the
  timer, times the baseline, only then imports the candidate and times it.
- ``workloads.session``: the trusted side's link to the candidate's process, in the worker: fresh
  seeds every call, the shared buffers, the bracketed batches and the outputs it keeps.
- ``workloads.harness``: the trusted side's report: the reference, the checks of every output it
  kept, the timing sections and the verdict.

Shipped examples live in ``examples/workloads/`` (an elementwise add and a bf16 matmul).
"""
