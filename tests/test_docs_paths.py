"""What the README and docs/*.md name exists: every repository path, module and file name they give in
backticks, and every flag; and every flag the CLI takes is documented in docs/operations.md.

A path is a backticked word whose first part is a top-level entry of the repository
(``kcoral/worker/zygote.py``, ``benchmarks/``, ``pyproject.toml``); a bare file name
(``children.py``) must name some file of the repository; a dotted ``kcoral.x.y`` must be a module or
a name in one. Words that are not of the repository (``keys/server/broker.key``, ``/dev/nvidiaN``,
``RUN_DIR/cache``) start with no top-level entry and are left alone.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

from kcoral.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = {entry.name for entry in ROOT.iterdir() if not entry.name.startswith(".git")}
SEARCHED = ("kcoral", "tests", "benchmarks", "examples", "docs", ".ci")

FENCE = re.compile(r"```.*?```", re.S)
SPAN = re.compile(r"`([^`\n]+)`")
BARE_FILE = re.compile(r"[\w-]+\.(?:py|md|toml|sh|json|png)")
DOTTED = re.compile(r"kcoral(?:\.\w+)+")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
HELP_OPTION = re.compile(r"^ {2}(?:-\w, )?(--[a-z][a-z0-9-]*)", re.M)

# The subcommands whose flags docs/operations.md documents, and flags the docs name that are other
# programs' (pip's; ncu's and run-iket's, passed through; in docs/deploy.md docker's, kubectl's,
# systemctl's and Slurm's).
SUBCOMMANDS = (
    ["broker"],
    ["router"],
    ["status"],
    ["keys", "generate"],
    *([adapter] for adapter in ("python", "ncu", "sanitizer", "iket", "remote")),
)
OTHER_PROGRAMS_FLAGS = {"--index-url", "--set", "--postprocess", "--enabled-cluster"} | {
    "--security-opt",
    "--privileged",
    "--from-file",
    "--now",
    "--batch",
    "--signal",
    "--exclusive",
    "--gres",
    "--time",
}
# Files of the reader's own that the docs name (the README's example is saved as first.py).
READERS_FILES = {"first.py"}


def doc_spans() -> list[tuple[str, str]]:
    """(doc name, text) for every backticked span of the docs, outside fenced blocks."""
    return [(doc.name, span) for doc in DOCS for span in SPAN.findall(FENCE.sub("", doc.read_text()))]


def doc_words() -> list[tuple[str, str]]:
    """(doc name, word) for every whitespace-separated word inside a backticked span of the docs."""
    return [(doc, word.strip("()[],;:")) for doc, span in doc_spans() for word in span.split()]


def repo_paths() -> list[tuple[str, str]]:
    return [(doc, word) for doc, word in doc_words() if word.split("/")[0] in TOP_LEVEL and word != "kcoral"]


def test_the_docs_name_repository_paths() -> None:
    """The extraction finds what it is meant to find (a change of the docs' style would make it vacuous)."""
    named = {word for _, word in repo_paths()}
    assert {"kcoral/worker/zygote.py", "benchmarks/RESULTS.md", "docs/protocol.md"} <= named
    assert len(named) > 60


@pytest.mark.parametrize(("doc", "path"), sorted(set(repo_paths())))
def test_every_path_the_docs_name_exists(doc: str, path: str) -> None:
    target = ROOT / path
    assert target.exists(), f"{doc} names `{path}`, which is not in the repository"
    if path.endswith("/"):
        assert target.is_dir(), f"{doc} names `{path}` as a folder"


def test_every_file_name_the_docs_give_is_a_file_of_the_repository() -> None:
    names = {path.name for top in SEARCHED for path in (ROOT / top).rglob("*") if path.is_file()}
    names |= {path.name for path in ROOT.iterdir() if path.is_file()}
    # A span that is one file name names a file; in a command (`kcoral ncu -- kernel.py`) it is the reader's.
    missing = sorted(
        {
            f"{doc}: `{span}`"
            for doc, span in doc_spans()
            if BARE_FILE.fullmatch(span) and span not in names and span not in READERS_FILES
        }
    )
    assert not missing, f"file names in the docs that no file of the repository has: {missing}"


def test_every_kcoral_module_the_docs_name_exists() -> None:
    missing = []
    for doc, word in doc_words():
        for name in DOTTED.findall(word):
            if not _resolves(name):
                missing.append(f"{doc}: `{name}`")
    assert not missing, f"modules in the docs that do not exist: {sorted(set(missing))}"


def _resolves(dotted: str) -> bool:
    """``kcoral.a.b`` is a module, or ``b`` is a name in module ``kcoral.a``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:  # a part before it is a module, not a package
            continue
        value: object = importlib.import_module(module_name)
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def cli_flags(argv: list[str]) -> set[str]:
    """The flags ``kcoral ARGV --help`` lists."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return set(HELP_OPTION.findall(out.getvalue()))


def test_every_flag_of_the_cli_is_documented_in_operations() -> None:
    assert {"--fake-gpus", "--node-wait", "--watch", "--send", "--ncu-args"} <= set().union(
        *map(cli_flags, SUBCOMMANDS)
    )
    operations = (ROOT / "docs" / "operations.md").read_text()
    documented = set(FLAG.findall(operations))
    missing = {
        f"kcoral {' '.join(argv)} {flag}" for argv in SUBCOMMANDS for flag in cli_flags(argv) - documented - {"--help"}
    }
    assert not missing, f"flags that docs/operations.md does not name: {sorted(missing)}"


def test_every_flag_the_docs_name_is_taken_by_the_cli() -> None:
    taken = {"--version", "--help"} | OTHER_PROGRAMS_FLAGS
    for argv in SUBCOMMANDS:
        taken |= cli_flags(argv)
    named = {(doc.name, flag) for doc in DOCS if doc.name != "protocol.md" for flag in FLAG.findall(doc.read_text())}
    unknown = sorted(f"{doc}: {flag}" for doc, flag in named if flag not in taken)
    assert not unknown, f"flags in the docs that no subcommand takes: {unknown}"
