"""The bounds of one RESULT: what a worker sends stays within one message the broker can read.

The returned values were bounded as they were returned (see the interpreter); here an error's
text is cut, and stdout and stderr are cut further where the body has no room for them.
"""

from __future__ import annotations

from typing import Any

from kcoral import protocol

# Bounds on the text of an error in a RESULT: an exception's message can be any size.
MAX_ERROR_MESSAGE_BYTES = 64 << 10
MAX_TRACEBACK_BYTES = 1 << 20
# The RESULT body stays this far under protocol.MAX_BODY_BYTES: the broker adds a few fields when
# it turns the body into the client's FINAL.
RESULT_BODY_MARGIN_BYTES = 64 << 10
OUTPUT_ALWAYS_FITS_BYTES = 4 << 20
STRING_HEADERS_BYTES = 16


def failed_body(request_id: str, kind: str, message: str) -> dict[str, Any]:
    """The RESULT of a program that failed before any instruction ran, or outside all of them."""
    return protocol.program_result(request_id, error=protocol.error_map(kind, message))


def _cut_text(text: str, most_bytes: int, encoded: bytes | None = None) -> tuple[str, bool]:
    """``text`` cut to ``most_bytes`` of UTF-8 at a character boundary; whether it was cut.
    ``encoded``: its UTF-8, when the caller has it already (output can be 64 MiB and more)."""
    data = text.encode("utf-8", errors="replace") if encoded is None else encoded
    if len(data) <= most_bytes:
        return text, False
    return data[:most_bytes].decode("utf-8", errors="ignore"), True


def bounded_result(body: dict[str, Any], frames: list[Any]) -> tuple[bytes, list[Any]]:
    """The packed RESULT body and its frames, within the limits of one message.

    The returned values were bounded as they were returned (see the interpreter); here the error's
    text is cut, and stdout and stderr are cut further when the body has no room for all of them
    (``output_limit_bytes`` allows 64 MiB each, as much as a whole body): they are marked
    truncated, as at their own limit. What still does not fit (it should not happen) becomes a
    ``serialization`` failure, never a message the broker cannot read.
    """
    error = body.get("error")
    if isinstance(error, dict):
        for name, most in (("message", MAX_ERROR_MESSAGE_BYTES), ("traceback", MAX_TRACEBACK_BYTES)):
            text = error.get(name)
            if isinstance(text, str):
                cut, was_cut = _cut_text(text, most)
                error[name] = cut + (" [cut]" if was_cut else "")
    budget = protocol.MAX_BODY_BYTES - RESULT_BODY_MARGIN_BYTES
    output = {name: str(body.get(name) or "") for name in ("stdout", "stderr")}
    encoded = {name: text.encode("utf-8", errors="replace") for name, text in output.items()}
    sizes = {name: len(data) for name, data in encoded.items()}
    # Output up to this much always fits beside values within the interpreter's bound.
    room = OUTPUT_ALWAYS_FITS_BYTES
    if sum(sizes.values()) > room:
        # Less what the two strings' msgpack headers grow by (5 bytes each, at most).
        room = max(0, budget - len(protocol.pack({**body, "stdout": "", "stderr": ""})) - STRING_HEADERS_BYTES)
    if sum(sizes.values()) > room:
        shares = {"stderr": min(sizes["stderr"], room // 2)}
        shares["stdout"] = min(sizes["stdout"], room - shares["stderr"])
        shares["stderr"] = min(sizes["stderr"], room - shares["stdout"])
        for name, text in output.items():
            body[name], was_cut = _cut_text(text, shares[name], encoded[name])
            body[f"{name}_truncated"] = bool(body.get(f"{name}_truncated")) or was_cut
    del encoded
    packed = protocol.pack(body)
    if len(packed) <= budget and len(frames) <= protocol.MAX_FRAMES - 3:
        return packed, frames
    failed = failed_body(
        str(body.get("request_id", "")),
        "serialization",
        f"the result does not fit in one message ({len(packed)} bytes of body, {len(frames)} data frames; "
        f"at most {budget} and {protocol.MAX_FRAMES - 3})",
    )
    failed["worker"] = body.get("worker", {})
    return protocol.pack(failed), []
