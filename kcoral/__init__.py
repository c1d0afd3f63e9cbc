"""KCoral: a GPU evaluation service for people and agents who write GPU kernels."""

from kcoral.client.blocking import Client
from kcoral.client.client import AsyncClient
from kcoral.client.program import Program, Ref
from kcoral.client.result import ProgramResult, ReturnedFile, ReturnedFolder
from kcoral.errors import ExecutionError, KCoralError, ProtocolError, TransportError

__version__ = "0.1.0"

__all__ = (
    "AsyncClient",
    "Client",
    "ExecutionError",
    "KCoralError",
    "Program",
    "ProgramResult",
    "ProtocolError",
    "Ref",
    "ReturnedFile",
    "ReturnedFolder",
    "TransportError",
    "__version__",
)
