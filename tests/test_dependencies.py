"""Every third-party import is declared in pyproject.toml, for the part of the tree that makes it.

The code of ``kcoral/`` needs its imports in ``dependencies``; ``tests/`` and ``benchmarks/`` may
also use the ``test`` extra. An import guarded against its module's absence (inside ``try`` with an
``except ImportError``, or through ``pytest.importorskip``) may name the ``gpu`` extra as well: the
code runs without it. Modules are mapped to distributions by
``importlib.metadata.packages_distributions()``; a module that is not installed here (the GPU-only
ones) is looked up in ``NOT_INSTALLED_HERE``, and one found in neither is reported too.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Distributions of modules that a CPU machine does not install (the `gpu` extra's).
NOT_INSTALLED_HERE = {"cupti": "cupti-python", "pynvml": "nvidia-ml-py"}
LOCAL_PACKAGES = {"kcoral", "tests", "benchmarks"}
# Which declarations each part of the tree may use: (for any import, for guarded imports only).
PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kcoral": (("dependencies",), ("gpu",)),
    "tests": (("dependencies", "test"), ("gpu",)),
    "benchmarks": (("dependencies", "test"), ("gpu",)),
    # The attack candidates are uploaded and run by a GPU host's workers, which have the gpu extra.
    "tests/gpu/attacks": (("dependencies", "test", "gpu"), ()),
}
GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # top-level module name
    guarded: bool


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"unreadable requirement {requirement!r}"
    return normalise(match.group(1))


def declared(pyproject: dict[str, object]) -> dict[str, set[str]]:
    """Declared distributions by section: ``dependencies`` and each extra."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    sections = {"dependencies": {requirement_name(r) for r in project.get("dependencies", [])}}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        sections[extra] = {requirement_name(r) for r in requirements}
    return sections


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in GUARD_EXCEPTIONS for n in names)


def _suppresses_import_error(item: ast.withitem) -> bool:
    """``with contextlib.suppress(ImportError):`` (or a broader exception)."""
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name == "suppress" and any(isinstance(a, ast.Name) and a.id in GUARD_EXCEPTIONS for a in call.args)


def _guarded_lines(tree: ast.AST) -> set[int]:
    """Lines inside a ``try`` that catches ImportError (or broader), or a ``with suppress(ImportError)``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        guards = (isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers)) or (
            isinstance(node, ast.With) and any(_suppresses_import_error(i) for i in node.items)
        )
        if guards:
            for statement in node.body:  # type: ignore[attr-defined]
                lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def imports_of(path: Path) -> Iterator[Import]:
    """The absolute imports of one file, with ``pytest.importorskip("x")`` counted as a guarded one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _guarded_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name.split(".")[0], node.lineno in guarded)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield Import(path, node.lineno, node.module.split(".")[0], node.lineno in guarded)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(path, node.lineno, node.args[0].value.split(".")[0], True)


def is_local(module: str, path: Path, root: Path) -> bool:
    """A module of the project itself, or a sibling file or package of the importing file."""
    if module in LOCAL_PACKAGES:
        return True
    here = path.parent
    return (here / f"{module}.py").exists() or (here / module / "__init__.py").exists()


def distributions_of(module: str, installed: Mapping[str, list[str]]) -> set[str]:
    found = {normalise(d) for d in installed.get(module, [])}
    if not found and module in NOT_INSTALLED_HERE:
        found = {normalise(NOT_INSTALLED_HERE[module])}
    return found


def undeclared(root: Path, pyproject: dict[str, object]) -> list[str]:
    """One line per third-party import whose distribution is not declared for its part of the tree."""
    sections = declared(pyproject)
    installed = packages_distributions()
    problems: list[str] = []
    for part, (always, guarded_only) in PARTS.items():
        for path in sorted((root / part).rglob("*.py")):
            if any(
                other != part and other.startswith(f"{part}/") and path.is_relative_to(root / other) for other in PARTS
            ):
                continue  # a part of its own
            for found in imports_of(path):
                if found.module in sys.stdlib_module_names or is_local(found.module, path, root):
                    continue
                allowed = set().union(*(sections.get(s, set()) for s in always))
                if found.guarded:
                    allowed |= set().union(*(sections.get(s, set()) for s in guarded_only))
                distributions = distributions_of(found.module, installed)
                where = f"{path.relative_to(root)}:{found.line}"
                if not distributions:
                    problems.append(f"{where}: `{found.module}` belongs to no installed or known distribution")
                elif not distributions & allowed:
                    names = ", ".join(sorted(distributions))
                    problems.append(
                        f"{where}: `{found.module}` ({names}) is not declared for {part}/ "
                        f"(in {' or '.join(always + (guarded_only if found.guarded else ()))})"
                    )
    return problems


def load_pyproject(root: Path) -> dict[str, object]:
    return tomllib.loads((root / "pyproject.toml").read_text())


def test_every_import_is_declared() -> None:
    problems = undeclared(ROOT, load_pyproject(ROOT))
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_a_removed_declaration_is_named(tmp_path: Path) -> None:
    """The check itself: take psutil out of the runtime dependencies and it names psutil's imports."""
    pyproject = load_pyproject(ROOT)
    project = pyproject["project"]
    assert isinstance(project, dict)
    project["dependencies"] = [r for r in project["dependencies"] if requirement_name(r) != "psutil"]
    problems = undeclared(ROOT, pyproject)
    assert any("kcoral/worker/processes.py" in p and "`psutil`" in p for p in problems), problems


def test_a_gpu_import_must_be_guarded(tmp_path: Path) -> None:
    """An unguarded import of a `gpu`-extra module in kcoral/ is reported; the same import in a
    ``try ... except ImportError`` is not."""
    (tmp_path / "kcoral").mkdir()
    (tmp_path / "kcoral" / "bare.py").write_text("import pynvml\n")
    (tmp_path / "kcoral" / "guarded.py").write_text("try:\n    import pynvml\nexcept ImportError:\n    pynvml = None\n")
    (tmp_path / "kcoral" / "suppressed.py").write_text(
        "import contextlib\nwith contextlib.suppress(ImportError):\n    import pynvml\n"
    )
    problems = undeclared(tmp_path, load_pyproject(ROOT))
    assert [p.split(":")[0] for p in problems] == ["kcoral/bare.py"], problems
