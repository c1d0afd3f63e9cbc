"""What every command-line adapter shares: the common flags, sending and fetching, exit statuses.

An adapter turns its command line into one KCoral program::

    upload_file / upload_folder    each --send path (and the script named after --)
    upload(kind="module")          kcoral/tools/service_side.py, as source
    run(run_steps | evaluate_workload, not cpu_only: the GPU lease is held while the tool runs)
    return_("outcome"), return_folder("fetched")

then prints the program's stdout and stderr (to the local stdout and stderr), writes the fetched
files and folders at the same relative paths locally, and exits with the remote tool's status.

Paths. ``--send PATH`` places a relative path at the same relative path in the remote working
directory and an absolute one under its base name; a folder is sent as a folder (symlinks and special
files inside are refused). ``--fetch PATH`` names a path relative to the remote working directory;
it comes back to the same relative path here, a folder as a folder, replacing files of the same name
(other files already in a local folder stay). A fetch path that the tool did not produce is reported
on stderr; the exit status stays the tool's.

Exit statuses, besides the tool's own:

==== =====================================================================================
2    usage: bad flags, a --send path that does not exist, a --fetch path that is absolute
69   the service could not be reached or refused the request (EX_UNAVAILABLE)
70   the program failed on the service before the tool's status was known (EX_SOFTWARE)
124  the tool ran past --timeout (the service stops it a little before the program's own
     deadline, so its output still comes back)
126  the tool was found on the service but could not be executed
127  the tool is not installed on the service
130  interrupted here (Ctrl-C)
==== =====================================================================================
"""

from __future__ import annotations

import argparse
import importlib.resources
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kcoral import protocol
from kcoral.client.program import Program
from kcoral.client.result import ProgramResult, ReturnedFile, ReturnedFolder
from kcoral.errors import KCoralError
from kcoral.keys import ClientKeys, KeyFileError
from kcoral.protocol import check_relative_path
from kcoral.tools import service_side

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_PROGRAM_FAILED = 70
EXIT_TIMED_OUT = service_side.EXIT_TIMED_OUT
EXIT_NOT_FOUND = service_side.EXIT_NOT_FOUND
EXIT_INTERRUPTED = 130

# A profiler or a test suite can print far more than the service's 1 MiB default.
OUTPUT_LIMIT_BYTES = 16 << 20
CONNECT_TIMEOUT_SECONDS = 10.0
# The tool is stopped this long before the program's deadline (at most a tenth of it), so that its
# output and the fetched files still come back rather than a bare timeout error.
TOOL_DEADLINE_MARGIN_SECONDS = 10.0
OUTCOME_KEY = "outcome"
FETCHED_KEY = "fetched"
SAVED_KEY = "saved"  # added here to the outcome: the files written locally


class UsageError(Exception):
    """Raised when the command line asks for something an adapter cannot do."""


@dataclass(frozen=True)
class Send:
    """A local file or folder and where it goes in the remote working directory."""

    local: Path
    dest: str

    @property
    def is_folder(self) -> bool:
        return self.local.is_dir()


@dataclass(frozen=True)
class Fetch:
    """A path in the remote working directory to bring back to the same relative path here.
    ``automatic`` fetches (an adapter's own, such as ncu's report) are announced when they arrive
    and not complained about when the tool failed before writing them."""

    path: str
    automatic: bool = False


@dataclass
class AdapterOptions:
    """The flags that every adapter takes."""

    tool: str
    url: str | None
    sends: list[Send] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    timeout_seconds: float = protocol.DEFAULT_TIMEOUT_SECONDS
    connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS
    tool_args: list[str] = field(default_factory=list)
    keys: ClientKeys | None = None


def _timeout(text: str) -> float:
    value = float(text)
    if not 0 < value <= protocol.MAX_TIMEOUT_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, {protocol.MAX_TIMEOUT_SECONDS:g}], got {text}")
    return value


def _connect_timeout(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def add_common_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_url: str | None,
    default_keys: tuple[str | None, str | None] = (None, None),
) -> None:
    """The flags of section 2 of the design, the same on every adapter. ``default_keys`` is the
    caller's reading of KCORAL_SERVER_KEY and KCORAL_CLIENT_KEY."""
    parser.add_argument(
        "--remote",
        metavar="URL",
        default=default_url,
        help="the service, e.g. tcp://host:5555 (default: $KCORAL_URL)",
    )
    add_key_arguments(parser, default_keys)
    parser.add_argument(
        "--send",
        metavar="PATH",
        action="append",
        default=[],
        help="a file or folder to place in the remote working directory, at the same relative path "
        "(an absolute path: under its base name); repeatable",
    )
    parser.add_argument(
        "--fetch",
        metavar="PATH",
        action="append",
        default=[],
        help="a file or folder to bring back from the remote working directory to the same relative "
        "path here; repeatable",
    )
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=_timeout,
        default=protocol.DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds the remote run may take (default {protocol.DEFAULT_TIMEOUT_SECONDS:g}, "
        f"at most {protocol.MAX_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--connect-timeout",
        metavar="S",
        type=_connect_timeout,
        default=CONNECT_TIMEOUT_SECONDS,
        help=f"seconds to wait for the service to answer at all (default {CONNECT_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument("tool_args", nargs=argparse.REMAINDER, help="the tool's own arguments, after --")


def add_key_arguments(parser: argparse.ArgumentParser, defaults: tuple[str | None, str | None]) -> None:
    """``--server-key`` and ``--client-key``, for a service that runs CurveZMQ."""
    parser.add_argument(
        "--server-key",
        metavar="FILE",
        default=defaults[0],
        help="the service's public key file (NAME.key), for CurveZMQ (default: $KCORAL_SERVER_KEY)",
    )
    parser.add_argument(
        "--client-key",
        metavar="FILE",
        default=defaults[1],
        help="this client's secret key file (NAME.key_secret) (default: $KCORAL_CLIENT_KEY)",
    )


def keys_from_args(args: argparse.Namespace) -> ClientKeys | None:
    """The client keys named by ``--server-key`` and ``--client-key``; UsageError when only one is
    given or a file is not a key."""
    server, client = getattr(args, "server_key", None), getattr(args, "client_key", None)
    if not server and not client:
        return None
    if not server or not client:
        raise UsageError(
            "CurveZMQ needs both --server-key and --client-key (or KCORAL_SERVER_KEY and KCORAL_CLIENT_KEY)"
        )
    try:
        return ClientKeys.from_files(Path(server), Path(client))
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None


def plan_send(path: str) -> Send:
    """Where ``--send path`` goes remotely; UsageError when it cannot be sent."""
    local = Path(path)
    if not local.exists():
        raise UsageError(f"--send {path}: no such file or folder")
    if local.is_absolute():
        dest = local.resolve().name if local.name in ("", "..") else local.name
        if not dest:
            raise UsageError(f"--send {path}: cannot send the root folder")
    else:
        try:
            dest = check_relative_path(path, "--send")
        except ValueError as exc:
            raise UsageError(f"{exc}; give a path below the current folder, or an absolute path") from None
    # Read through a symlink given on the command line; Program refuses symlinks inside folders.
    return Send(local.resolve(), dest)


def plan_fetch(path: str) -> Fetch:
    try:
        return Fetch(check_relative_path(path, "--fetch"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def fetch_automatically(options: AdapterOptions, *paths: str) -> None:
    """Fetch an adapter's own products (a report, a trace folder) before the user's --fetch paths."""
    automatic = [Fetch(plan_fetch(path).path, automatic=True) for path in paths]
    options.fetches[:0] = automatic


def options_from_args(tool: str, args: argparse.Namespace) -> AdapterOptions:
    """The common flags, checked; UsageError for what argparse cannot check."""
    tool_args = list(args.tool_args)
    # Python 3.11's REMAINDER keeps the "--" that separates the tool's arguments; newer ones drop it.
    if tool_args and tool_args[0] == "--":
        tool_args = tool_args[1:]
    return AdapterOptions(
        tool=tool,
        url=args.remote,
        sends=[plan_send(p) for p in args.send],
        fetches=[plan_fetch(p) for p in args.fetch],
        timeout_seconds=args.timeout,
        connect_timeout_seconds=args.connect_timeout,
        tool_args=tool_args,
        keys=keys_from_args(args),
    )


def script_options(tool: str, args: argparse.Namespace, doing: str) -> AdapterOptions:
    """The common flags of an adapter that runs a Python script under ``tool``: the script (first
    after ``--``) is required, and sent along when it is a local file."""
    options = options_from_args(tool, args)
    if not options.tool_args:
        raise UsageError(f"give the Python script to {doing} (and its arguments) after --")
    send_script(options)
    return options


def send_script(options: AdapterOptions) -> None:
    """Send the script named first after ``--`` when it is a local file, so ``kcoral ncu --
    bench.py`` needs no ``--send bench.py``. A script outside the current folder goes under its base
    name, and the argument is rewritten to match."""
    if not options.tool_args or options.tool_args[0].startswith("-"):
        return
    script = options.tool_args[0]
    local = Path(script)
    if not local.is_file():
        return  # perhaps a file inside a sent folder, or one already on the service
    try:
        dest = check_relative_path(script)
    except ValueError:
        dest = local.name
        options.tool_args[0] = dest
    if not any(send.dest == dest for send in options.sends):
        options.sends.append(Send(local.resolve(), dest))


def split_extra(text: str | None) -> list[str]:
    """A tool's own options given as one string (``--ncu-args "--set full"``)."""
    return shlex.split(text) if text else []


def tool_deadline(timeout_seconds: float) -> float:
    """How long the tool itself may run inside a program that may take ``timeout_seconds``."""
    return timeout_seconds - min(TOOL_DEADLINE_MARGIN_SECONDS, timeout_seconds / 10)


def service_source() -> str:
    """The source text of kcoral/tools/service_side.py, uploaded with every adapter program."""
    return importlib.resources.files("kcoral.tools").joinpath("service_side.py").read_text(encoding="utf-8")


def build_program(options: AdapterOptions, function: str, args: list[Any]) -> Program:
    """The program that places the sends, calls ``function(*args, fetch_paths)`` and returns the
    outcome and the staged fetches."""
    program = Program()
    try:
        for send in options.sends:
            if send.is_folder:
                program.upload_folder(send.local, path=send.dest)
            else:
                program.upload_file(blob=send.local, path=send.dest)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--send: {exc}") from None
    module = program.upload(kind="module", source=service_source())
    # Not cpu_only: the tool holds the GPU lease for as long as it runs, so timings, profiles and
    # traces are not disturbed by other programs on the same GPU.
    fn = program.get_function(module=module, name=function)
    outcome = program.run(fn=fn, args=[*args, [fetch.path for fetch in options.fetches]])
    program.return_(key=OUTCOME_KEY, value=outcome)
    program.return_folder(key=FETCHED_KEY, path=service_side.FETCH_STAGE)
    return program


def execute(
    options: AdapterOptions, function: str, args: list[Any], *, report_only_on_stdout: bool = False
) -> tuple[int, dict[str, Any] | None]:
    """Run the adapter program and show its output. Returns (exit status, outcome); the outcome is
    None when there is none (the status then says why), and its ``saved`` lists the files written
    here from the fetches (relative paths, a fetched folder's files one by one).
    ``report_only_on_stdout``: the program's stdout is written to the local stderr with its stderr,
    after it ended, so that the local stdout carries only what the adapter prints itself (``kcoral
    remote``'s report)."""
    from kcoral.client.blocking import Client

    if not options.url:
        return usage_error(options.tool, "no service: give --remote URL or set KCORAL_URL"), None
    try:
        program = build_program(options, function, args)
    except UsageError as exc:
        return usage_error(options.tool, str(exc)), None
    try:
        # The remote output is shown as it comes; a status line on a terminal says what the program
        # waits for (upload, queue, GPU).
        with Client(
            options.url,
            connect_timeout_seconds=options.connect_timeout_seconds,
            show_output=not report_only_on_stdout,
            keys=options.keys,
        ) as client:
            try:
                result = client.execute(
                    program, timeout_seconds=options.timeout_seconds, output_limit_bytes=OUTPUT_LIMIT_BYTES
                )
            finally:
                shown = client.output_shown
    except ValueError as exc:  # a malformed URL, or none at all
        return usage_error(options.tool, str(exc)), None
    except KCoralError as exc:
        _say(options.tool, f"{exc} (service {options.url})")
        return (EXIT_TIMED_OUT if exc.kind == "timeout" else EXIT_UNAVAILABLE), None
    except KeyboardInterrupt:
        # Leaving the `with` block closed the client, which sent CANCEL for the program in flight.
        _say(options.tool, "interrupted; the program was cancelled on the service")
        return EXIT_INTERRUPTED, None
    show_output(options.tool, result, shown, stdout=sys.stderr if report_only_on_stdout else None)
    if not result.completed:
        _show_error(options.tool, result)
        return EXIT_PROGRAM_FAILED, None
    outcome = result.results.get(OUTCOME_KEY)
    if not isinstance(outcome, dict):
        _say(options.tool, f"the service returned no outcome (got {type(outcome).__name__})")
        return EXIT_PROGRAM_FAILED, None
    status = outcome.get("exit_code", EXIT_OK)
    outcome[SAVED_KEY] = save_fetches(
        options, outcome.get("fetched") or [], result.results.get(FETCHED_KEY), tool_failed=status != 0
    )
    return (int(status) if isinstance(status, int) else EXIT_OK), outcome


def run_steps(options: AdapterOptions, steps: list[dict[str, Any]]) -> int:
    """Run ``steps`` (see kcoral.tools.service_side.run_steps) and return the tool's exit status."""
    status, _ = execute(options, "run_steps", [steps, tool_deadline(options.timeout_seconds)])
    return status


def show_output(
    tool: str, result: ProgramResult, shown: dict[str, int] | None = None, *, stdout: TextIO | None = None
) -> None:
    """Write the program's output, less what was written live (``shown``: characters per stream);
    its stdout to ``stdout`` (default: the local stdout)."""
    shown = shown or {}
    out = stdout if stdout is not None else sys.stdout
    out.write(_rest(result.stdout, shown.get("stdout", 0)))
    out.flush()
    sys.stderr.write(_rest(result.stderr, shown.get("stderr", 0)))
    for stream, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
        if cut:
            _say(tool, f"the remote {stream} was cut at {OUTPUT_LIMIT_BYTES} bytes")
    sys.stderr.flush()


def _rest(text: str, shown: int) -> str:
    return text[shown:] if shown <= len(text) else ""


def _show_error(tool: str, result: ProgramResult) -> None:
    error = result.error or {}
    _say(tool, f"the program failed on the service: {error.get('kind')}: {error.get('message')}")
    if error.get("traceback"):
        sys.stderr.write(str(error["traceback"]).rstrip() + "\n")


def save_fetches(options: AdapterOptions, kinds: Sequence[Any], staged: Any, *, tool_failed: bool) -> list[str]:
    """Write each fetched file or folder at its relative path under the current folder; the relative
    paths of the files written (those of a folder one by one)."""
    files: dict[str, ReturnedFile] = staged.files if isinstance(staged, ReturnedFolder) else {}
    saved: list[str] = []
    for index, fetch in enumerate(options.fetches):
        kind = kinds[index] if index < len(kinds) else "missing"
        prefix = f"{index}/"
        try:
            if kind == "file" and str(index) in files:
                files[str(index)].save(fetch.path, overwrite=True)
                saved.append(fetch.path)
            elif kind == "folder":
                inside = {rel[len(prefix) :]: f for rel, f in files.items() if rel.startswith(prefix)}
                ReturnedFolder(inside).save(fetch.path, overwrite=True)
                saved.extend(f"{fetch.path.rstrip('/')}/{rel}" for rel in sorted(inside))
            elif kind == "outside":
                _say(options.tool, f"--fetch {fetch.path}: it leads outside the remote working directory; not fetched")
                continue
            else:
                if not (fetch.automatic and tool_failed):
                    _say(options.tool, f"--fetch {fetch.path}: no such file or folder on the service; not fetched")
                continue
        except OSError as exc:
            _say(options.tool, f"--fetch {fetch.path}: cannot write it here: {exc}")
            continue
        if fetch.automatic:
            _say(options.tool, f"saved {fetch.path}")
    return saved


def usage_error(tool: str, message: str) -> int:
    _say(tool, message)
    return EXIT_USAGE


def _say(tool: str, message: str) -> None:
    print(f"kcoral {tool}: {message}", file=sys.stderr, flush=True)
