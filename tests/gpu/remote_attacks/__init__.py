"""Candidates that attack ``kcoral remote`` (the trusted path), one module per attack, grouped by the
class of attack they belong to (``ATTACK["klass"]``). Each is a candidate file as an optimising agent
could submit it; its ``ATTACK`` dict (read with ``ast``, never imported by the runner) has the keys of
the suite in ``run_remote_cheats.py`` (``klass``, ``workload``, ``expect``, ``should``, ``wrong``,
``summary``). They print what they could read or do as ``KCPROBE {...}`` lines on stderr.

Classes: 1 forged result channel, 2 seeds readable / precompute, 3 timer functions replaced,
4 work hidden in untimed gaps, 5 kept outputs recomputed at serialisation, 6 stale or cached
outputs, 7 forged report on stdout (8, the in-process snapshot gaps, are in
``tests/gpu/test_snapshot_gaps_gpu.py``: they attack ``benchmark()`` in its own process).

``tests/gpu/test_remote_attacks_gpu.py`` runs them through ``kcoral remote``.
"""
