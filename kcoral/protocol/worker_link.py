"""The worker link: commands between the broker and its workers (``ipc://``, inside one host).

A worker says READY once; the broker sends one PROGRAM at a time; the worker asks for its GPU tokens
with LEASE and gets GRANT, reports the instruction it is on with PROGRESS, and ends with RESULT (its
body built by ``kcoral.protocol.results``). The tokens go back on the zygote's word alone (a
worker's exit, or ``gpu_free``; see :mod:`kcoral.protocol.zygote_link`), and a worker is ended
through its zygote: RELEASE and DISCONNECT are reserved, their bytes kept so that no other command
takes them.
"""

from __future__ import annotations

from typing import Final

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

WORKER_COMMANDS: Final = frozenset({READY, LEASE, RELEASE, PROGRESS, RESULT})

WORKER_COMMAND_NAMES: Final = command_names(
    globals(), "READY", "PROGRAM", "LEASE", "GRANT", "RELEASE", "PROGRESS", "RESULT", "DISCONNECT"
)
