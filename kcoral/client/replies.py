"""What the service's replies become on the client's side: a FINAL's result map and data frames as a
:class:`~kcoral.client.result.ProgramResult`, a PARTIAL as a
:class:`~kcoral.client.progress.ProgressEvent`, an error reply as a :class:`~kcoral.errors.KCoralError`.
"""

from __future__ import annotations

from typing import Any

from kcoral import protocol
from kcoral.client.progress import ProgressEvent
from kcoral.client.result import ProgramResult, ReturnedFile, ReturnedFolder
from kcoral.errors import KCoralError, ProtocolError


def result_map(request_id: str, reply: dict[str, Any], what: str = "reply") -> dict[str, Any]:
    """The ``result`` map of a reply (a FINAL, or the answer to HEALTH or TARGET); the request's
    KCoralError when the reply is an error."""
    if not reply.get("ok"):
        raise request_error(request_id, reply)
    result = reply.get("result")
    if not isinstance(result, dict):
        raise ProtocolError(f"{what} without a result map", request_id=request_id)
    return result


def final_result(request_id: str, reply: dict[str, Any], frames: list[Any]) -> ProgramResult:
    """The ProgramResult of a FINAL; ProtocolError when it cannot be read."""
    result = result_map(request_id, reply, "FINAL")
    try:
        return build_result(result, frames)
    except (protocol.WireError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ProtocolError(f"unreadable result: {exc}", request_id=request_id) from exc


def build_result(result: dict[str, Any], frames: list[Any]) -> ProgramResult:
    """A ProgramResult from a FINAL reply's result map and its data frames."""

    def frame(index: int) -> memoryview:
        return memoryview(frames[index])

    def convert(obj: Any) -> Any:
        if isinstance(obj, protocol.TensorSpec):
            if not isinstance(obj.source, int):
                raise protocol.WireError("a returned tensor must name a frame")
            return protocol.tensor_from_wire(obj, frame(obj.source), prefer_torch=False)
        if isinstance(obj, protocol.BytesFrame):
            return bytes(frame(obj.index))
        if isinstance(obj, protocol.FileSpec):
            return ReturnedFile(obj.name, bytes(frame(obj.frame)), obj.mode)
        if isinstance(obj, protocol.FolderSpec):
            return ReturnedFolder(
                {rel: ReturnedFile(rel.rsplit("/", 1)[-1], bytes(frame(i)), mode) for rel, i, mode in obj.files}
            )
        raise protocol.WireError(f"unexpected {type(obj).__name__} in a result")

    results = protocol.decode_value(result.get("results") or {}, convert)
    return ProgramResult(
        status=str(result["status"]),
        results=dict(results),
        error=result.get("error"),
        stdout=str(result.get("stdout", "")),
        stderr=str(result.get("stderr", "")),
        stdout_truncated=bool(result.get("stdout_truncated", False)),
        stderr_truncated=bool(result.get("stderr_truncated", False)),
        request_id=str(result.get("request_id", "")),
        queue_ms=float(result.get("queue_ms", 0.0)),
        elapsed_ms=float(result.get("elapsed_ms", 0.0)),
        lease_wait_ms=float(result.get("lease_wait_ms", 0.0)),
        lease_held_ms=float(result.get("lease_held_ms", 0.0)),
        gpu_ids=[int(g) for g in result.get("gpu_ids", [])],
        worker=dict(result.get("worker") or {}),
        node_id=str(result["node_id"]) if result.get("node_id") is not None else None,
        provenance=dict(result["provenance"]) if isinstance(result.get("provenance"), dict) else {},
        timeline=_times(result.get("timeline")),
    )


def _times(value: Any) -> dict[str, float]:
    """A map of names to times, leaving out what is not one (the timeline is informative)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def progress_event(request_id: str, reply: dict[str, Any]) -> ProgressEvent:
    """A PARTIAL as a ProgressEvent; fields of the wrong type are left out (PARTIAL is informative)."""
    state = str(reply.get("state"))
    gpu_ids = reply.get("gpu_ids")
    position = reply.get("position")
    index = reply.get("instruction_index")
    node = reply.get("node")
    stream = reply.get("stream")
    offset = reply.get("offset")
    text = reply.get("text")
    return ProgressEvent(
        state,
        request_id,
        position=position if isinstance(position, int) else None,
        gpu_ids=tuple(g for g in gpu_ids if isinstance(g, int)) if isinstance(gpu_ids, list) else (),
        instruction_index=index if isinstance(index, int) else None,
        node=node if isinstance(node, str) else None,
        stream=stream if stream in ("stdout", "stderr") else "",
        offset=offset if isinstance(offset, int) else -1,
        text=text if isinstance(text, str) else "",
    )


def request_error(request_id: str, reply: dict[str, Any]) -> KCoralError:
    """The KCoralError that an error reply (``ok`` false) stands for."""
    error = reply.get("error")
    if not isinstance(error, dict):
        return ProtocolError("error reply without an error map", request_id=request_id)
    return KCoralError(str(error.get("kind", "engine")), str(error.get("message", "")), request_id=request_id)


__all__ = ["build_result", "final_result", "progress_event", "request_error", "result_map"]
