"""The seeds a program's measurements drew, named, for the result's ``provenance``.

``compare`` notes the seed of its bootstrap here, and uploaded code may note its own
(``kcoral.builtins.note_seed("inputs", 1234)``) so that a re-run can pass them again. The worker
reads what was noted after the program ends and sends it in its RESULT; the broker puts it in the
result's ``provenance.seeds`` as the program's claim (it runs in the program's process).
"""

from __future__ import annotations

import re
from typing import Final

from kcoral.errors import ExecutionError

MAX_SEEDS: Final = 32
_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_SEEDS: dict[str, int] = {}


def note_seed(name: str, seed: int) -> None:
    """Record that this program drew ``seed`` for ``name`` (a later note of the same name replaces it).

    Raises ``ExecutionError("parse")`` for a name outside ``A-Z a-z 0-9 _ . : -`` (1 to 100), a seed
    that is not an integer of 64 bits, or more than 32 names.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ExecutionError("parse", f"a seed's name is 1 to 100 of A-Z a-z 0-9 _ . : -, not {name!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ExecutionError("parse", f"a seed is an integer of 64 bits, not {seed!r}")
    if name not in _SEEDS and len(_SEEDS) >= MAX_SEEDS:
        raise ExecutionError("parse", f"at most {MAX_SEEDS} seeds are noted per program")
    _SEEDS[name] = seed


def noted() -> dict[str, int]:
    """The seeds noted since the last ``forget``."""
    return dict(_SEEDS)


def forget() -> None:
    """Start a program with no seeds noted."""
    _SEEDS.clear()
