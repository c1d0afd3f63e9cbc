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


def _function(source: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    return next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name)


def _calls(function: ast.FunctionDef) -> list[ast.Call]:
    return [node for node in ast.walk(function) if isinstance(node, ast.Call)]


def test_nothing_of_torch_is_looked_up_while_the_report_is_made() -> None:
    """_run measures (_measure, whose last step is the last check), then makes the report."""
    source = Path(benchmark.__file__).read_text()
    run = [ast.unparse(c.func) for c in _calls(_function(source, "_run"))]
    assert run.index("_measure") < run.index("_report")
    report = [ast.unparse(c.func) for c in _calls(_function(source, "_report"))]
    assert not [name for name in report if name.startswith("torch.")], report
    assert "fail_on_changes" not in run[run.index("_measure") + 1 :]


def test_the_last_check_follows_the_untimed_calls_of_the_output_check() -> None:
    calls = _calls(_function(Path(benchmark.__file__).read_text(), "_measure"))
    names = [(c.lineno, ast.unparse(c.func)) for c in calls]
    last_check = max(line for line, name in names if name == "fail_on_changes")
    assert max(line for line, name in names if name == "check_kept") < last_check


def test_the_device_name_is_a_reference_taken_at_arm() -> None:
    state = trust.arm(use_cupti=False)
    import torch

    assert state.trusted.device_name is torch.cuda.get_device_name
    assert "torch.cuda.get_device_name" in state.snapshot.entries


def test_compare_checks_again_after_its_untimed_calls_and_looks_nothing_up_after() -> None:
    from kcoral.timing import compare

    source = Path(compare.__file__).read_text()
    assert "torch.cuda.get_device_name" not in source
    tree = ast.parse(source)
    holder = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(c, ast.Call) and ast.unparse(c.func) == "check_side" for c in ast.walk(node))
    )
    names = [(c.lineno, ast.unparse(c.func)) for c in _calls(holder)]
    last_check = max(line for line, name in names if name == "fail_on_changes")
    assert max(line for line, name in names if name == "check_side") < last_check
