"""Whether a service takes a program: the checks the broker and the router share, as pure functions.

Each check returns None when the program may go on, or the :class:`Refusal` to answer it with (a
request error kind of docs/protocol.md, section 9, and a message). :func:`admit_execute` runs those
that both services make on an EXECUTE, in their order, under the service's :class:`AdmissionPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kcoral import protocol


class Refusal(NamedTuple):
    kind: str
    message: str


@dataclass(frozen=True)
class AdmissionPolicy:
    """Which service refuses (named in the messages) and the bounds it holds an EXECUTE to."""

    service: str  # "broker" or "router"
    max_queued: int  # programs waiting, all clients together
    max_queued_per_client: int  # programs waiting of one client (owner)
    max_request_bytes: int  # the declared bytes of one program's uploads


@dataclass(frozen=True)
class Admitted:
    """An EXECUTE that passed the shared checks: what the service needs of its body."""

    program: dict[str, Any]
    options: protocol.ExecuteOptions
    digests: list[str]
    sizes: dict[str, int]  # the program's blobs as its instructions declare them (declared_sizes)


def admit_execute(
    body: dict[str, Any],
    policy: AdmissionPolicy,
    *,
    already_in_flight: bool,
    draining: bool,
    waiting: int,
    client_waiting: int,
    capacity: Callable[[protocol.ExecuteOptions], Refusal | None],
) -> Admitted | Refusal:
    """The checks of an EXECUTE that the broker and the router share, cheapest first: ``waiting``
    programs in all and ``client_waiting`` of this one's client; ``capacity`` is the service's own
    check of the GPUs the program asks for."""
    refusal = refuse_new_request(
        service=policy.service,
        already_in_flight=already_in_flight,
        draining=draining,
        waiting=waiting,
        max_queued=policy.max_queued,
        client_waiting=client_waiting,
        max_queued_per_client=policy.max_queued_per_client,
    )
    if refusal is not None:
        return refusal
    try:
        program, options, digests = protocol.parse_execute(body)
        sizes = declared_sizes(program)
    except protocol.WireError as exc:
        return Refusal("parse", str(exc))
    return (
        refuse_size(sum(sizes.values()), policy.max_request_bytes, service=policy.service)
        or capacity(options)
        or Admitted(program, options, digests, sizes)
    )


def refuse_new_request(
    *,
    service: str,
    already_in_flight: bool,
    draining: bool,
    waiting: int,
    max_queued: int,
    client_waiting: int = 0,
    max_queued_per_client: int | None = None,
) -> Refusal | None:
    """The checks made before an EXECUTE's body is even looked at; ``max_queued_per_client`` None:
    no bound on one client's share."""
    if already_in_flight:
        return Refusal("parse", "a request with this id is already in flight")
    if max_queued_per_client is not None and client_waiting >= max_queued_per_client:
        text = f"this client has {client_waiting} programs waiting; one client may have at most {max_queued_per_client}"
        return Refusal("busy", text)
    if draining:
        return Refusal("busy", f"the {service} is shutting down")
    if waiting >= max_queued:
        return Refusal("busy", f"the queue is full ({max_queued} programs)")
    return None


def refuse_size(declared: int, max_request_bytes: int, *, service: str) -> Refusal | None:
    """A program whose uploads, as declared, are over the limit: refused before any blob is sent."""
    if declared > max_request_bytes:
        return Refusal(
            "request_too_large",
            f"the program's uploads are {declared} bytes; this {service} takes at most {max_request_bytes}",
        )
    return None


def refuse_gpu_count(gpu_count: int, most: int, *, where: str) -> Refusal | None:
    """A program that asks for more GPUs than ``where`` ("this host", "the largest node") has."""
    if gpu_count > most:
        return Refusal("capacity", f"the program asks for {gpu_count} GPUs; {where} has {most}")
    return None


def declared_sizes(program: dict[str, Any]) -> dict[str, int]:
    """The size of each of a program's blobs as its instructions declare it.

    Counts tensors wherever they appear (uploads, run arguments, returned literals), so a program
    over the limit is refused before any of its bytes are sent.
    """
    sizes: dict[str, int] = {}

    def visit(obj: Any) -> Any:
        if isinstance(obj, protocol.TensorSpec) and isinstance(obj.source, str):
            sizes[obj.source] = obj.nbytes
        return obj

    for ins in program.get("instructions", []):
        if not isinstance(ins, dict):
            continue
        size, blob = ins.get("size"), ins.get("blob")
        if isinstance(blob, str) and isinstance(size, int) and size > 0:
            sizes[blob] = size
        for entry in ins.get("files") or []:
            if isinstance(entry, list) and len(entry) >= 4 and isinstance(entry[1], str):
                if isinstance(entry[3], int) and entry[3] > 0:
                    sizes[entry[1]] = entry[3]
        for key in ("tensor", "args", "value"):
            if key in ins:
                protocol.decode_value(ins[key], visit)
    return sizes


__all__ = [
    "AdmissionPolicy",
    "Admitted",
    "Refusal",
    "admit_execute",
    "declared_sizes",
    "refuse_gpu_count",
    "refuse_new_request",
    "refuse_size",
]
