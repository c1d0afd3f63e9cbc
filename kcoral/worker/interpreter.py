"""The program interpreter: executes a program's instructions in order, as data in, data out.

Each instruction (upload, get_function, run, the returns) runs against the values earlier ones
created; a failure becomes an error dict with the contract's kind, the instruction's index, op and
id, and the user's traceback. ``run`` of a function that is not ``cpu_only`` holds the GPU lease,
asked of the broker through :class:`LeaseChannel`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kcoral import protocol
from kcoral.errors import ExecutionError
from kcoral.gpu_guard import GpuAccessGuard
from kcoral.worker.lease import LeaseChannel

# What one RESULT may hold (protocol.MAX_FRAMES and MAX_BODY_BYTES bound every message): the data
# frames after its three header frames, and the returned values' share of its body, leaving the
# rest of the body for the error, stdout and stderr (see kcoral.worker.result_bounds.bounded_result).
MAX_RESULT_FRAMES = protocol.MAX_FRAMES - 3
MAX_INLINE_RESULT_BYTES = protocol.MAX_BODY_BYTES - (8 << 20)
NO_CUDA_MARKERS = ("torch not compiled with cuda enabled", "no cuda gpus are available", "found no nvidia driver")
CUDA_POISON_MARKERS = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "an illegal instruction",
)

T = TypeVar("T")


class InstructionFailure(Exception):
    """Raised inside the interpreter to fail the current instruction with a kind."""

    def __init__(self, kind: str, message: str, tb: str = "", index: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.tb = tb
        self.index = index


@dataclass
class FunctionValue:
    """What get_function created: the callable and whether it may touch the GPU."""

    fn: Callable[..., Any]
    cpu_only: bool
    name: str


def _look_up(table: Mapping[str, T], key: str, missing: Callable[[], str]) -> T:
    """``table[key]``; a ``parse`` failure of the instruction, saying ``missing()``, where absent."""
    try:
        return table[key]
    except KeyError:
        raise InstructionFailure("parse", missing()) from None


@dataclass
class Interpreter:
    """Executes one program's instructions in order inside ``run_dir``."""

    request: dict[str, Any]
    blobs: Mapping[str, memoryview]
    run_dir: Path
    lease: LeaseChannel
    progress: Callable[[int], None] = lambda index: None
    values: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    frames: list[Any] = field(default_factory=list)
    response_bytes: int = 0
    inline_bytes: int = 0  # packed size of the returned values in the result's body
    max_response_bytes: int = protocol.DEFAULT_MAX_RESPONSE_BYTES
    retire_reason: str = ""
    modules: list[str] = field(default_factory=list)

    @property
    def workdir(self) -> Path:
        return self.run_dir / "work"

    def execute(self) -> dict[str, Any] | None:
        """Run every instruction; return the error dict of the first failure, or None."""
        program = self.request.get("program")
        instructions = program.get("instructions") if isinstance(program, dict) else None
        try:
            checked = protocol.check_instructions(instructions)
        except protocol.ProgramError as failure:
            bad = instructions[failure.index] if failure.index is not None and isinstance(instructions, list) else None
            return protocol.instruction_error("parse", str(failure), failure.index, bad)
        for index, instruction in enumerate(checked):
            self.progress(index)
            try:
                self._step(instruction)
            except InstructionFailure as failure:
                return protocol.instruction_error(failure.kind, failure.message, index, instruction, failure.tb)
        return None

    # --- instructions ---

    def _step(self, ins: dict[str, Any]) -> None:
        op = ins["op"]
        if op == "upload":
            self.values[ins["id"]] = self._upload(ins)
        elif op == "upload_file":
            self._place_file(ins["path"], self._blob(ins["blob"]), int(ins.get("mode", 0o644)))
            self.values[ins["id"]] = ins["path"]
        elif op == "upload_folder":
            base = ins["path"]
            (self.workdir / base).mkdir(parents=True, exist_ok=True)
            for rel, digest, mode, *_ in ins["files"]:
                self._place_file(f"{base}/{protocol.check_relative_path(rel)}", self._blob(digest), int(mode))
            self.values[ins["id"]] = base
        elif op == "get_function":
            self.values[ins["id"]] = self._get_function(ins)
        elif op == "run":
            self.values[ins["id"]] = self._run(ins)
        elif op == "return":
            self._return_value(ins["key"], self._resolve(ins.get("value")))
        elif op == "return_file":
            self._return_file(ins["key"], ins["path"])
        elif op == "return_folder":
            self._return_folder(ins["key"], ins["path"])

    def _upload(self, ins: dict[str, Any]) -> Any:
        kind = ins.get("kind")
        if kind == "module":
            source = ins.get("source")
            if source is None:
                try:
                    source = bytes(self._blob(ins["blob"])).decode("utf-8", errors="strict")
                except UnicodeDecodeError as exc:
                    raise InstructionFailure("parse", f"module source is not UTF-8: {exc}") from exc
            return self._load_module(ins["id"], source)
        if kind == "tensor":
            spec = ins.get("tensor")
            if not isinstance(spec, protocol.TensorSpec) or not isinstance(spec.source, str):
                raise InstructionFailure("parse", "upload(kind='tensor') without a tensor spec")
            return self._tensor(spec)
        if kind == "bytes":
            return bytes(self._blob(ins["blob"]))
        if kind == "library":
            path = self.run_dir / "libs" / f"{ins['id']}.so"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self._blob(ins["blob"]))
            try:
                return ctypes.CDLL(str(path))
            except OSError as exc:
                raise InstructionFailure("compile", f"cannot load the library: {exc}") from exc
        raise InstructionFailure("parse", f"unknown upload kind {kind!r}")

    def _load_module(self, id: str, source: str) -> types.ModuleType:
        name = f"kcoral_upload_{id.replace('.', '_').replace(':', '_').replace('-', '_')}"
        path = self.run_dir / "modules" / f"{id}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)  # a real file, so tracebacks, inspect and JIT compilers find the source
        try:
            code = compile(source, str(path), "exec")
        except SyntaxError as exc:
            # The source itself is malformed, like a bad instruction: parse, at this upload. A
            # module that is valid Python but raises while it is imported fails as compile below.
            raise InstructionFailure(
                "parse", f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})", _user_traceback(exc)
            ) from exc
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        self.modules.append(name)
        try:
            exec(code, module.__dict__)
        except ExecutionError as exc:
            raise InstructionFailure(exc.kind, exc.message, _user_traceback(exc)) from exc
        except BaseException as exc:
            raise InstructionFailure(
                "compile", f"importing the module raised {describe_exception(exc)}", _user_traceback(exc)
            ) from exc
        return module

    def _get_function(self, ins: dict[str, Any]) -> FunctionValue:
        target = self._value(ins["module"])
        if isinstance(target, FunctionValue):
            target = target.fn
        name = ins.get("name")
        if not isinstance(name, str) or not name:
            raise InstructionFailure("parse", "get_function needs a name")
        obj = target
        for part in name.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise InstructionFailure("compile", f"{ins['module']!r} has no attribute {name!r}") from None
        if not callable(obj):
            raise InstructionFailure("compile", f"{name!r} in {ins['module']!r} is not callable")
        return FunctionValue(obj, bool(ins.get("cpu_only", False)), name)

    def _run(self, ins: dict[str, Any]) -> Any:
        target = self._value(ins["fn"])
        if isinstance(target, FunctionValue):
            fn, cpu_only, name = target.fn, target.cpu_only, target.name
        elif callable(target):
            fn, cpu_only, name = target, False, ins["fn"]
        else:
            raise InstructionFailure("runtime", f"{ins['fn']!r} is a {type(target).__name__}, not callable")
        args = [self._resolve(a) for a in ins.get("args", [])]
        args = [a.fn if isinstance(a, FunctionValue) else a for a in args]
        if cpu_only or not self.lease.needed():
            return self._call_cpu_only(fn, args, name) if cpu_only else self._call(fn, args)
        self.lease.acquire()
        try:
            return self._call(fn, args)
        finally:
            self._synchronize_gpu()

    def _call(self, fn: Callable[..., Any], args: list[Any]) -> Any:
        try:
            return fn(*args)
        except ExecutionError as exc:
            raise InstructionFailure(exc.kind, exc.message, _user_traceback(exc)) from exc
        except BaseException as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: BaseException) -> InstructionFailure:
        """The kind a call's exception fails its instruction with."""
        if isinstance(exc, AssertionError | RuntimeError) and _is_no_cuda_here(exc):
            # torch says so with an AssertionError ("Torch not compiled with CUDA enabled"), which
            # is not a failed check of the program's own.
            message = f"no CUDA GPU is usable in this worker (CPU workers have none): {describe_exception(exc)}"
            return InstructionFailure("unavailable", message, _user_traceback(exc))
        if isinstance(exc, AssertionError):
            return InstructionFailure("correctness", describe_exception(exc), _user_traceback(exc))
        if _is_cuda_poison(exc):
            self.retire_reason = f"CUDA context unusable: {exc}"
        return InstructionFailure("runtime", describe_exception(exc), _user_traceback(exc))

    def _call_cpu_only(self, fn: Callable[..., Any], args: list[Any], name: str) -> Any:
        guard = GpuAccessGuard()
        with guard:
            try:
                value = self._call(fn, args)
            except InstructionFailure as failure:
                if guard.violation:
                    raise InstructionFailure(
                        "gpu_access", f"cpu_only function {name!r} called {guard.violation}", failure.tb
                    ) from failure
                raise
        if guard.violation:
            raise InstructionFailure("gpu_access", f"cpu_only function {name!r} called {guard.violation}")
        return value

    def _synchronize_gpu(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None:
            return
        try:
            if torch.cuda.is_initialized():
                # Every GPU of the program that has a context, not only the current one: a
                # multi-GPU program's lease covers them all, and work still queued on one would
                # outlive the lease. (Synchronizing a GPU without a context would create one.)
                has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
                for device in range(torch.cuda.device_count()):
                    if has_context is None or has_context(device):
                        torch.cuda.synchronize(device)
        except Exception as exc:
            if _is_cuda_poison(exc):
                self.retire_reason = f"CUDA context unusable: {exc}"

    def _return_value(self, key: str, value: Any) -> None:
        if isinstance(value, FunctionValue):
            raise InstructionFailure("serialization", f"cannot return {key!r}: it is a function")
        frames, response_bytes = len(self.frames), self.response_bytes
        try:
            encoded = protocol.encode_value(value, self._add_frame, bytes_to_frames=True)
            size = len(protocol.pack(encoded))
        except BaseException as exc:
            # The value's own methods run here (a dict subclass's items(), a float subclass's
            # __float__, a meta tensor's copy): whatever they raise fails this instruction only.
            del self.frames[frames:]
            self.response_bytes = response_bytes
            if isinstance(exc, InstructionFailure):
                raise
            why = str(exc) if isinstance(exc, protocol.WireError) else f"encoding it raised {describe_exception(exc)}"
            raise InstructionFailure("serialization", f"cannot return {key!r}: {why}") from None
        if self.inline_bytes + size > MAX_INLINE_RESULT_BYTES:
            del self.frames[frames:]
            self.response_bytes = response_bytes
            raise InstructionFailure(
                "serialization",
                f"cannot return {key!r}: it takes {size} bytes of the result's body, and the values of one result "
                f"may take at most {MAX_INLINE_RESULT_BYTES} there (tensors and byte strings travel apart, "
                f"without this bound: return large data as a tensor or bytes)",
            )
        self.inline_bytes += size
        self.results[key] = encoded

    def _return_file(self, key: str, path: str) -> None:
        target = self._inside_workdir(path)
        if not target.is_file():
            raise InstructionFailure("runtime", f"return_file {key!r}: no regular file at {path!r}")
        data = target.read_bytes()
        self.results[key] = protocol.FileSpec(target.name, self._add_frame(data), stat.S_IMODE(target.stat().st_mode))

    def _return_folder(self, key: str, path: str) -> None:
        root = self._inside_workdir(path)
        if not root.is_dir():
            raise InstructionFailure("runtime", f"return_folder {key!r}: no folder at {path!r}")
        files: list[tuple[str, int, int]] = []
        for current, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not (Path(current) / d).is_symlink())
            for name in sorted(filenames):
                local = Path(current) / name
                st = local.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # symlinks and special files stay behind: they could point anywhere
                rel = local.relative_to(root).as_posix()
                files.append((rel, self._add_frame(local.read_bytes()), stat.S_IMODE(st.st_mode)))
        self.results[key] = protocol.FolderSpec(tuple(files))

    # --- helpers ---

    def _add_frame(self, data: memoryview | bytes) -> int:
        if len(self.frames) >= MAX_RESULT_FRAMES:
            raise InstructionFailure(
                "serialization",
                f"the results need more than {MAX_RESULT_FRAMES} data frames (one per tensor, file and byte "
                f"string over {protocol.INLINE_BYTES_LIMIT} bytes): return fewer, larger values",
            )
        self.response_bytes += len(data)
        if self.response_bytes > self.max_response_bytes:
            # Not an instruction error kind: the broker answers the request with the request error
            # response_too_large, since results this large cannot come back at all.
            raise InstructionFailure(
                "response_too_large",
                f"the results are over {self.max_response_bytes} bytes, the most this service returns",
            )
        self.frames.append(data)
        return len(self.frames) - 1

    def _value(self, id: str) -> Any:
        return _look_up(self.values, id, lambda: f"reference {id!r} has no value")

    def _resolve(self, tree: Any) -> Any:
        def convert(obj: Any) -> Any:
            if isinstance(obj, protocol.RefValue):
                return self._value(obj.id)
            if isinstance(obj, protocol.TensorSpec) and isinstance(obj.source, str):
                return self._tensor(obj)
            raise InstructionFailure("parse", f"unexpected {type(obj).__name__} in arguments")

        return protocol.decode_value(tree, convert)

    def _tensor(self, spec: protocol.TensorSpec) -> Any:
        assert isinstance(spec.source, str)
        data = self._blob(spec.source)
        # A private copy-on-write mapping (a large blob from the disk cache, mapped anew for each
        # use) is already this tensor's own memory: build the tensor over it instead of copying.
        private = isinstance(data.obj, mmap.mmap) and not data.readonly
        try:
            return protocol.tensor_from_wire(spec, data, prefer_torch=True, copy=not private)
        except protocol.WireError as exc:
            raise InstructionFailure("parse", str(exc)) from exc

    def _blob(self, digest: str) -> memoryview:
        return _look_up(self.blobs, digest, lambda: f"blob {digest[:12]}... was not delivered")

    def _inside_workdir(self, path: str) -> Path:
        rel = protocol.check_relative_path(path)
        target = (self.workdir / rel).resolve()
        root = self.workdir.resolve()
        if target != root and root not in target.parents:
            raise InstructionFailure("runtime", f"{path!r} resolves outside the working directory")
        return target

    def _place_file(self, path: str, data: memoryview, mode: int) -> None:
        target = self.workdir / protocol.check_relative_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        parent = target.parent.resolve()
        root = self.workdir.resolve()
        if parent != root and root not in parent.parents:
            raise InstructionFailure("runtime", f"{path!r} resolves outside the working directory")
        if target.is_symlink():
            target.unlink()
        target.write_bytes(data)
        os.chmod(target, (mode & 0o755) | 0o600)


def describe_exception(exc: BaseException) -> str:
    """``"Type: message"``; an exception whose own ``__str__`` raises still gets described."""
    try:
        text = str(exc)
    except BaseException:
        text = "(its message could not be read: str() raised)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the interpreter's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    try:
        return "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:  # the exception's own methods raised while being formatted
        return "".join(traceback.format_tb(tb)) + describe_exception(exc) + "\n"


def _is_no_cuda_here(exc: BaseException) -> bool:
    """torch's own words for a process that has no CUDA GPU to use."""
    text = describe_exception(exc).lower()
    return any(marker in text for marker in NO_CUDA_MARKERS)


def _is_cuda_poison(exc: BaseException) -> bool:
    text = describe_exception(exc).lower()
    return any(marker in text for marker in CUDA_POISON_MARKERS)
