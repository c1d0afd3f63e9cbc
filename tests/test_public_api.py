"""The names the interface contract promises, and nothing private leaking through ``__all__``."""

from __future__ import annotations

import subprocess
import sys

import kcoral


def test_contract_names_import() -> None:
    from kcoral import (  # noqa: F401
        AsyncClient,
        Client,
        KCoralError,
        Program,
        ProgramResult,
        ProtocolError,
        TransportError,
    )
    from kcoral.builtins import benchmark  # noqa: F401
    from kcoral.errors import ExecutionError  # noqa: F401


def test_all_matches_public_names() -> None:
    assert isinstance(kcoral.__all__, tuple)
    public = {name for name in vars(kcoral) if not name.startswith("_") and name[0].isupper()}
    assert public <= set(kcoral.__all__)
    for name in kcoral.__all__:
        assert hasattr(kcoral, name), name


def test_error_hierarchy() -> None:
    assert issubclass(kcoral.TransportError, kcoral.KCoralError)
    assert issubclass(kcoral.ProtocolError, kcoral.KCoralError)
    error = kcoral.KCoralError("busy", "queue full", request_id="r1")
    assert (error.kind, error.message, error.request_id) == ("busy", "queue full", "r1")


def test_importing_builtins_initialises_no_gpu_library() -> None:
    code = "import sys, kcoral.builtins; print(sorted(m for m in ('torch', 'cupti', 'pynvml') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_instruction_error_kinds_are_the_contracts() -> None:
    from kcoral.errors import INSTRUCTION_ERROR_KINDS, ExecutionError

    contract = {"parse", "compile", "runtime", "gpu_access", "correctness", "serialization", "unavailable", "integrity"}
    assert contract == INSTRUCTION_ERROR_KINDS
    error = ExecutionError("integrity", "CuptiTimer.measure was replaced")
    assert (error.kind, error.message) == ("integrity", "CuptiTimer.measure was replaced")


def test_protocol_document_lists_every_instruction_error_kind() -> None:
    import re
    from pathlib import Path

    from kcoral.errors import INSTRUCTION_ERROR_KINDS

    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    section = text.split("### Instruction error kinds", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))
    assert documented == INSTRUCTION_ERROR_KINDS
