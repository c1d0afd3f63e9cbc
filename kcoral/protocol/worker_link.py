"""The worker link: commands between the broker and its workers (``ipc://``, inside one host).

A worker says READY once; the broker sends one PROGRAM at a time; the worker asks for its GPU tokens
with LEASE and gets GRANT, reports the instruction it is on with PROGRESS, and ends with RESULT (its
body built by ``kcoral.protocol.results``). The tokens go back on the zygote's word alone (a
worker's exit, or ``gpu_free``; see :mod:`kcoral.protocol.zygote_link`), and a worker is ended
through its zygote: RELEASE and DISCONNECT are reserved, their bytes kept so that no other command
takes them.

A worker is known by one :data:`WorkerId`: its routing identity on the workers' socket, bytes, as
ZeroMQ carries it and as the broker's tables key it. The zygote link and a worker's command line
carry the same identity as text (its zygote names it); :func:`worker_id` and :func:`worker_name`
are the two conversions, used where text meets the socket's identity and nowhere else.
"""

from __future__ import annotations

from typing import Final, NewType

from kcoral.protocol.frames import command_names

# worker <-> broker (ipc://, inside one host)
READY: Final = b"\x20"  # worker -> broker: body: slot, pid, gpu
PROGRAM: Final = b"\x21"  # broker -> worker: the program to run, with its blob frames
LEASE: Final = b"\x22"  # worker -> broker: ask for the program's GPU tokens
GRANT: Final = b"\x23"  # broker -> worker: the tokens are held
RELEASE: Final = b"\x24"  # reserved: no worker sends it; the broker reads one and ignores it
PROGRESS: Final = b"\x25"  # worker -> broker: body: index of the instruction now running
RESULT: Final = b"\x26"  # worker -> broker: the outcome, with its data frames
DISCONNECT: Final = b"\x27"  # reserved: the broker never sends it (it ends a worker through the zygote)

# A worker sends each RESULT on a socket of its own (a fresh connection per program), whose identity
# is the worker's, this separator and the program's number: output and PROGRESS, which a program
# can flood through the worker's own socket (it runs in the worker's process), neither delay the
# RESULT behind them nor interleave with its frames. The broker takes only RESULT from it.
RESULT_IDENTITY_SEPARATOR: Final = b"|result-"

WorkerId = NewType("WorkerId", bytes)


def worker_id(name: str) -> WorkerId:
    """The identity of the worker its zygote named ``name`` (a zygote event, a worker's settings)."""
    return WorkerId(name.encode("utf-8", "surrogatepass"))


def worker_name(worker: bytes) -> str:
    """A worker's identity as text: for the zygote link, health and logs (bytes that are not UTF-8,
    from a peer that is no worker, read with U+FFFD)."""
    return worker.decode("utf-8", "replace")


WORKER_COMMANDS: Final = frozenset({READY, LEASE, RELEASE, PROGRESS, RESULT})

WORKER_COMMAND_NAMES: Final = command_names(
    globals(), "READY", "PROGRAM", "LEASE", "GRANT", "RELEASE", "PROGRESS", "RESULT", "DISCONNECT"
)
