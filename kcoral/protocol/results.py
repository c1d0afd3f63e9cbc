"""Results and errors as data: the bodies a program's outcome travels in."""

from __future__ import annotations

from typing import Any

from kcoral.protocol.codec import message
from kcoral.protocol.frames import FINAL


def error_body(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "message": message, **extra}


def final_error(request_id: str, kind: str, text: str) -> list[Any]:
    """A FINAL reply for a request that could not run."""
    return message(FINAL, {"request_id": request_id, "ok": False, "error": error_body(kind, text)})
