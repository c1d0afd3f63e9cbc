"""The reward hacks against KCoral's numbers: one candidate module a cheat, as an agent would submit it.

Each ``<name>.py`` here is the candidate of one attack, uploaded as it stands (read as text, never
imported here): it tries to make a timing read less than its work costs or to pass a check it
should fail. Many launch a one-element GPU op (``_touch``) on the timed path, so that benchmark()
sees some GPU work. :data:`CATALOGUE` names each attack's class, path and workload;
``evaluator.py`` and ``honest_<workload>.py`` are the benchmark path's evaluator and honest
candidates. :mod:`tests.gpu.attacks.outcomes` runs an attack and judges it; the GPU test
(``tests/gpu/test_integrity_gpu.py``) and ``benchmarks/integrity_attacks.py`` both run them.

The classes are those of ``shared/integrity/README.md`` (work from another thread, stream or
process; work that finishes after the call or is deferred into the output; outputs cached across
calls; telling timed calls from untimed ones; changing the timer's own state; defeating the L2
flush; work on the host; tampering with the reference or the check), the first eight after the
examples there, the rest new ones of the same classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent


def candidate_source(module: str) -> str:
    """The text of ``tests/gpu/attacks/<module>.py``, as it is uploaded."""
    return (HERE / f"{module}.py").read_text()


@dataclass(frozen=True)
class Attack:
    name: str
    klass: str
    path: str  # benchmark | remote
    module: str = ""  # the candidate's module here; "": the attack's name
    workload: str = "matmul"
    origin: str = "new"  # shared: after shared/integrity/cheat_<name>.py

    @property
    def source(self) -> str:
        return candidate_source(self.module or self.name)


CATALOGUE: Final[tuple[Attack, ...]] = (
    # after shared/integrity/cheat_<name>.py
    Attack("side_stream", "another stream", "benchmark", origin="shared"),
    Attack("bg_thread_async", "another thread", "benchmark", origin="shared"),
    Attack("memo_data_ptr", "cached outputs", "benchmark", origin="shared"),
    Attack("cuda_graph", "replay", "benchmark", origin="shared"),
    Attack("patch_measure", "timer functions", "benchmark", origin="shared"),
    Attack("force_event_fallback", "timer fallback", "benchmark", origin="shared"),
    Attack("child_process", "another process", "benchmark", origin="shared"),
    Attack("corrupt_reference", "reference tampering", "remote", origin="shared"),
    # new ones, of the same classes
    Attack("bg_thread_after_return", "another thread, after the call", "benchmark"),
    Attack("lazy_subclass_output", "deferred into the output", "benchmark"),
    Attack("kinds_off_inside_call", "timer state: activity kinds", "benchmark"),
    Attack("kinds_off_for_good", "timer state: activity kinds", "benchmark"),
    Attack("hijack_callbacks", "timer state: CUPTI callbacks", "benchmark"),
    Attack("pop_external_id", "timer state: correlation stack", "benchmark"),
    Attack("forge_hold_id", "timer state: correlation ids", "benchmark"),
    Attack("replace_cupti_clock", "timer state: CUPTI's clock", "benchmark"),
    Attack("patch_summary", "timer functions", "benchmark"),
    Attack("patch_torch_sync", "timer functions", "benchmark"),
    Attack("shrink_flush_buffer", "L2 flush", "benchmark", workload="reduce"),
    Attack("work_on_host", "work on the host", "benchmark", workload="reduce"),
    Attack("lying_subclass", "check tampering", "remote"),
    Attack("patch_assert_close", "check tampering", "remote"),
    Attack("memo_many_pointers", "cached outputs", "remote"),
    Attack("memo_by_value", "cached outputs", "remote"),
    Attack("stale_when_timed", "telling timed calls from untimed", "remote"),
    Attack("stale_when_timed_local", "telling timed calls from untimed", "benchmark", module="stale_when_timed"),
    Attack("forge_report", "report forgery", "remote"),
    Attack("exit_at_import", "harness tampering", "remote"),
)

__all__ = ["CATALOGUE", "HERE", "Attack", "candidate_source"]
