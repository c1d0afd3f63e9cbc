"""``GpuAccessGuard``: fail CUDA use inside a ``cpu_only`` function.

Uploaded code reaches it through ``kcoral.builtins``, the worker's interpreter directly; cupti-python is imported inside
the guard, and torch only looked up in ``sys.modules``, so importing this module stays cheap and
initialises nothing.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, Self

from kcoral.errors import ExecutionError

# CUDA calls that only ask what exists (version, device count, error state) and touch no device:
# torch.cuda.is_available() makes them, and CPU-only code may reasonably ask that.
_HARMLESS_CUDA_CALLS: Final = frozenset(
    {
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuDeviceGetName",
        "cuDeviceGetUuid",
        "cuDeviceTotalMem",
        "cuDeviceComputeCapability",
        "cuGetProcAddress",
        "cuGetExportTable",
        "cuGetErrorString",
        "cuGetErrorName",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        "cudaGetDeviceCount",
        "cudaGetDevice",
        "cudaDriverGetVersion",
        "cudaRuntimeGetVersion",
        "cudaGetLastError",
        "cudaPeekAtLastError",
        "cudaGetErrorString",
        "cudaGetErrorName",
    }
)
_VERSION_SUFFIX: Final = re.compile(r"_v\d+$")


def is_harmless_cuda_call(function_name: str) -> bool:
    """True for CUDA API calls that only query (``cuCtxGetDevice_v2`` counts as ``cuCtxGetDevice``)."""
    return _VERSION_SUFFIX.sub("", function_name) in _HARMLESS_CUDA_CALLS


_guard_lock = threading.Lock()
_cupti_guard_active = False


class GpuAccessGuard:
    """Fail CUDA use inside a ``cpu_only`` function.

    Two layers, because neither alone is enough:

    * Python: while active, ``torch.cuda._lazy_init`` (through which every torch CUDA entry point
      initialises CUDA in a process where it is not yet initialised) raises
      ``ExecutionError("gpu_access", ...)``. This needs no CUPTI, but only stops torch, and only
      before CUDA was initialised in the process (torch imported before the guard is entered).
    * CUPTI: a callback subscription on the runtime and driver API domains records the first CUDA
      call that is more than a query, from any thread and any library. A CUPTI callback cannot make
      the call fail, so it is recorded in ``violation``; after the function returns the worker calls
      ``check()`` (or reads ``violation``) and fails the instruction with ``gpu_access``.

    Example::

        with GpuAccessGuard() as guard:
            result = fn(*args)
        guard.check()   # raises ExecutionError("gpu_access", "... cudaMalloc ...") if CUDA was used
    """

    def __init__(self, *, use_cupti: bool = True) -> None:
        self.violation: str | None = None
        self.cupti_active = False
        self._use_cupti = use_cupti
        self._patched: list[tuple[Any, Any]] = []
        self._subscriber: int | None = None
        self._cupti: Any = None
        self._callback: Callable[..., None] | None = None
        self._active = False

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("GpuAccessGuard is not reentrant")
        self._active = True
        self.violation = None
        self._patch_torch()
        if self._use_cupti:
            self._subscribe()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self._unsubscribe()
        finally:
            self._restore_torch()
            self._active = False

    def check(self) -> None:
        """Raise ``ExecutionError("gpu_access", ...)`` when CUDA was used while the guard was active."""
        if self.violation is not None:
            raise ExecutionError("gpu_access", f"a cpu_only function used the GPU: {self.violation}")

    def _record(self, what: str) -> None:
        if self.violation is None:
            self.violation = what

    def _patch_torch(self) -> None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        original = getattr(cuda, "_lazy_init", None) if cuda is not None else None
        if original is None:
            return

        def refuse_cuda_init() -> None:
            self._record("CUDA initialisation (torch.cuda._lazy_init)")
            raise ExecutionError("gpu_access", "a cpu_only function tried to initialise CUDA (torch.cuda._lazy_init)")

        # Submodules such as torch.cuda.random bind _lazy_init by name at import time.
        for name, module in list(sys.modules.items()):
            if (name == "torch.cuda" or name.startswith("torch.cuda.")) and getattr(
                module, "_lazy_init", None
            ) is original:
                self._patched.append((module, original))
                setattr(module, "_lazy_init", refuse_cuda_init)  # noqa: B010

    def _restore_torch(self) -> None:
        while self._patched:
            module, original = self._patched.pop()
            setattr(module, "_lazy_init", original)  # noqa: B010

    def _subscribe(self) -> None:
        global _cupti_guard_active
        with _guard_lock:
            if _cupti_guard_active:
                return  # CUPTI takes one subscriber per process; an outer guard already watches
            try:
                from cupti import cupti
            except (ImportError, OSError, RuntimeError):
                return  # the Python layer still guards torch

            def on_api_call(userdata: Any, domain: Any, callback_id: Any, cbdata: Any) -> None:
                try:
                    if self.violation is not None:
                        return
                    if cbdata.callback_site != cupti.ApiCallbackSite.API_ENTER:
                        return
                    name = str(cbdata.function_name)
                    if not is_harmless_cuda_call(name):
                        self._record(f"CUDA API call {name}")
                except Exception:
                    pass

            try:
                subscriber = cupti.subscribe(on_api_call, None)
            except cupti.cuptiError:
                return  # e.g. a profiler already subscribed: the Python layer remains
            try:
                cupti.enable_domain(1, subscriber, cupti.CallbackDomain.DRIVER_API)
                cupti.enable_domain(1, subscriber, cupti.CallbackDomain.RUNTIME_API)
            except cupti.cuptiError:
                cupti.unsubscribe(subscriber)
                return
            self._cupti = cupti
            self._callback = on_api_call  # CUPTI holds a raw pointer; keep the function alive
            self._subscriber = subscriber
            self.cupti_active = True
            _cupti_guard_active = True

    def _unsubscribe(self) -> None:
        global _cupti_guard_active
        if self._subscriber is None:
            return
        with _guard_lock:
            try:
                self._cupti.unsubscribe(self._subscriber)
            finally:
                self._subscriber = None
                self._callback = None
                self.cupti_active = False
                _cupti_guard_active = False


def gpu_access_guard(*, use_cupti: bool = True) -> GpuAccessGuard:
    """A new ``GpuAccessGuard``: ``with gpu_access_guard() as guard: ...; guard.check()``."""
    return GpuAccessGuard(use_cupti=use_cupti)
