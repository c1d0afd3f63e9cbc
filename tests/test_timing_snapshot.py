"""The trusted-state snapshot covers the whole timing package and what benchmark() calls after its
last check (CPU: no measurement, only what the snapshot is made of)."""

from __future__ import annotations

import ast
from pathlib import Path

import kcoral.timing
from kcoral.timing import benchmark, trust

TIMING = Path(kcoral.timing.__file__).resolve().parent


def test_every_module_of_the_timing_package_is_watched() -> None:
    on_disk = {f"kcoral.timing.{path.stem}" for path in TIMING.glob("*.py") if path.stem != "__init__"}
    assert on_disk, "no timing modules found"
    missing = on_disk - set(trust.WATCHED_MODULES)
    assert not missing, f"modules of kcoral.timing left out of the snapshot: {sorted(missing)}"
    assert {"kcoral.timing", "kcoral.builtins", "kcoral.errors"} <= set(trust.WATCHED_MODULES)


def test_the_module_list_is_derived_from_the_package() -> None:
    assert trust.timing_modules() == tuple(sorted(trust.timing_modules()))
    assert set(trust.timing_modules()) == {
        f"kcoral.timing.{path.stem}" for path in TIMING.glob("*.py") if path.stem != "__init__"
    }


def test_an_armed_snapshot_holds_every_watched_module() -> None:
    state = trust.arm(use_cupti=False)
    assert set(trust.WATCHED_MODULES) <= set(state.modules)
    names = set(state.snapshot.entries)
    assert "kcoral.timing.config.split_config" in names
    assert "kcoral.timing.config.BenchmarkConfig.from_mapping" in names


def _calls_after_last_check(source: str) -> list[str]:
    """Dotted names called in _run after its last _fail_on_changes."""
    tree = ast.parse(source)
    run = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "_run")
    calls = [node for node in ast.walk(run) if isinstance(node, ast.Call)]
    checks = [
        c.lineno for c in calls if isinstance(c.func, ast.Name) and c.func.id in ("fail_on_changes", "_fail_on_changes")
    ]
    last = max(checks)
    return [ast.unparse(c.func) for c in calls if c.lineno > last]


def test_nothing_of_torch_is_looked_up_after_the_last_check() -> None:
    after = _calls_after_last_check(Path(benchmark.__file__).read_text())
    assert after, "the report is made after the last check"
    assert not [name for name in after if name.startswith("torch.")], after


def test_the_last_check_follows_the_untimed_calls_of_the_output_check() -> None:
    source = Path(benchmark.__file__).read_text()
    run = source[source.index("def _run(") :]
    assert run.index("check_outputs(") < run.rindex("fail_on_changes(")


def test_the_device_name_is_a_reference_taken_at_arm() -> None:
    state = trust.arm(use_cupti=False)
    import torch

    assert state.trusted.device_name is torch.cuda.get_device_name
    assert "torch.cuda.get_device_name" in state.snapshot.entries
