"""Imports point one way: the contracts in pyproject.toml ([tool.importlinter]), checked by import-linter.

The worker and the broker never import the client; the worker never imports the broker; the client
never imports the broker or the worker; the protocol depends on nothing else of KCoral.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    pytest.importorskip("importlinter")
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
