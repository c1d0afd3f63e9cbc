"""What each call of ``benchmark`` gets as inputs, and which of the timed calls' outputs are kept
to be checked.

A candidate that caches its output across calls pays nothing when every call gets the same inputs
(``benchmark`` used to call ``fn(*args)`` with the very same tensors: a cache keyed on the inputs'
``data_ptr`` read 0.02 ms for a 0.18 ms matmul). So the timed calls get inputs that differ from
call to call:

- ``inputs=`` a factory, ``inputs(index) -> tuple``: fresh inputs for every call (index counts all
  calls of the run, warm-up included, so that a trusted harness can rebuild any of them). This is
  the way that defeats caching keyed on values as well as on addresses;
- positional tensor arguments without a factory: *rotated clones*: up to ``MAX_ROTATED_SETS``
  copies of the arguments, each at its own address, taken in turn (as many as fit in
  ``ROTATION_BYTES`` or a quarter of the free GPU memory), floating-point ones scaled by
  ``1 + k * ROTATION_SCALE_STEP`` for copy ``k`` so that no two sets hold the same values. After
  the measurement each kept timed output is compared with the candidate's own output for the same
  set, called again untimed: a call that returns another set's output when it is timed (having
  told timed calls from untimed ones) fails. A call that writes its own inputs (torch's version
  counters move) is not checked: its outputs change from call to call by design;
- no arguments (a closure, as in the seed example): nothing to vary.

The outputs of a random sample of the timed calls (reservoir sampling, ``OUTPUTS_KEPT``, chosen
after each call returned, so a call cannot know whether it will be checked) are snapshotted right
after the device is idle, so work deferred past the call's end shows as a wrong output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kcoral.errors import ExecutionError

MAX_ROTATED_SETS: Final = 64
ROTATION_BYTES: Final = 1 << 30
# 1/64: the largest scale stays below 2, and two sets differ by at least 1.5%, more than a bfloat16
# ulp, so their values differ after rounding.
ROTATION_SCALE_STEP: Final = 1.0 / 64
SCALED_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float64"})
OUTPUTS_KEPT: Final = 4
# Tolerance of the rotated-clone check: the same inputs at another address must give the same
# output, up to the nondeterminism of atomics and split reductions.
ROTATED_RTOL: Final = 1e-2
ROTATED_ATOL: Final = 1e-2

MODE_NONE = "none"
MODE_ROTATED = "rotated_clones"
MODE_SAME = "same_arguments"
MODE_FACTORY = "factory"

InputFactory = Callable[[int], Any]
OutputCheck = Callable[[Any, tuple[Any, ...]], Any]


def _is_cuda_tensor(torch: Any, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


@dataclass
class InputPlan:
    """Gives call ``index`` its inputs."""

    mode: str
    sets: list[tuple[Any, ...]]
    factory: InputFactory | None = None
    note: str = ""

    def inputs(self, index: int) -> tuple[Any, ...]:
        if self.factory is not None:
            made = self.factory(index)
            return tuple(made) if isinstance(made, (tuple, list)) else (made,)
        return self.sets[index % len(self.sets)]

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"mode": self.mode}
        if self.mode in (MODE_ROTATED, MODE_SAME):
            described["sets"] = len(self.sets)
        if self.note:
            described["note"] = self.note
        return described


def plan_inputs(torch: Any, args: tuple[Any, ...], factory: InputFactory | None) -> InputPlan:
    """The plan for ``benchmark(fn, *args, inputs=factory)``."""
    if factory is not None:
        if args:
            raise ExecutionError("parse", "benchmark takes either positional arguments or inputs=, not both")
        if not callable(factory):
            raise ExecutionError(
                "parse", f"inputs= must be a callable index -> arguments, not {type(factory).__name__}"
            )
        return InputPlan(MODE_FACTORY, [], factory)
    if not args:
        return InputPlan(MODE_NONE, [()])
    tensors = [value for value in args if _is_cuda_tensor(torch, value)]
    if not tensors:
        return InputPlan(MODE_SAME, [args], note="no CUDA tensor among the arguments")
    set_bytes = sum(int(t.numel()) * int(t.element_size()) for t in tensors)
    try:
        free_bytes = int(torch.cuda.mem_get_info()[0])
    except Exception:
        free_bytes = ROTATION_BYTES * 4
    budget = min(ROTATION_BYTES, free_bytes // 4)
    count = min(MAX_ROTATED_SETS, budget // max(1, set_bytes))
    if count < 2:
        return InputPlan(MODE_SAME, [args], note="the arguments are too large to clone")
    sets = [args]
    for k in range(1, count):
        sets.append(tuple(_scaled_clone(torch, value, 1.0 + k * ROTATION_SCALE_STEP) for value in args))
    return InputPlan(MODE_ROTATED, sets)


def _scaled_clone(torch: Any, value: Any, scale: float) -> Any:
    if not _is_cuda_tensor(torch, value):
        return value
    copy = value.clone()
    if str(copy.dtype).removeprefix("torch.") in SCALED_DTYPES:
        copy.mul_(scale)
    return copy


def versions(torch: Any, inputs: tuple[Any, ...]) -> tuple[int, ...]:
    """torch's version counters of the tensor inputs: they move when a call writes an input."""
    return tuple(int(value._version) for value in inputs if isinstance(value, torch.Tensor))


def keep_outputs_always(plan: InputPlan) -> bool:
    """Fresh inputs from a factory: keep outputs even unchecked here, for a harness to check."""
    return plan.mode == MODE_FACTORY


def snapshot(torch: Any, value: Any) -> Any:
    """A copy of a call's output as it is now: plain tensors cloned, containers walked.

    A tensor subclass is refused: its methods are the candidate's code, and a subclass can compute
    its values lazily when touched (after the timed window) or lie to a comparison.
    """
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor:
            raise ExecutionError(
                "correctness",
                f"the call returned a {type(value).__name__}, a tensor subclass: checked outputs must be plain tensors",
            )
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        items = [snapshot(torch, item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {key: snapshot(torch, item) for key, item in value.items()}
    return value


@dataclass
class KeptOutput:
    """One timed call's output, snapshotted when the device was idle after it."""

    call: int  # index among the timed calls
    input_index: int  # the index its inputs were made for
    output: Any
    inputs: tuple[Any, ...]


@dataclass
class OutputReservoir:
    """A uniform random sample of ``size`` timed calls' outputs (reservoir sampling)."""

    size: int
    randbelow: Callable[[int], int]
    kept: list[KeptOutput] = field(default_factory=list)
    seen: int = 0
    snapshot_ms: float = 0.0  # wall time spent snapshotting the kept outputs (a defence's cost)

    def slot_for_next(self) -> int | None:
        """Where the next call's output goes (None: not kept). Decided after the call returned."""
        self.seen += 1
        if self.size <= 0:
            return None
        if len(self.kept) < self.size:
            return len(self.kept)
        slot = self.randbelow(self.seen)
        return slot if slot < self.size else None

    def put(self, slot: int, item: KeptOutput) -> None:
        if slot == len(self.kept):
            self.kept.append(item)
        else:
            self.kept[slot] = item


def check_outputs(
    torch: Any,
    kept: Sequence[KeptOutput],
    *,
    check: OutputCheck | None,
    expected: Callable[[KeptOutput], Any] | None,
    assert_close: Callable[..., None],
) -> int:
    """Check the kept outputs; the number checked. A failure raises ``ExecutionError("correctness")``.

    With ``check`` each output is passed to ``check(output, inputs)``, which fails by raising or by
    returning False; otherwise each must equal ``expected(kept)`` (rotated clones: the candidate's
    own output for the same inputs, called again untimed).
    """
    checked = 0
    for item in sorted(kept, key=lambda k: k.call):
        try:
            if check is not None:
                verdict = check(item.output, item.inputs)
                if verdict is False:
                    raise AssertionError("the check returned False")
            elif expected is not None:
                _compare(torch, item.output, expected(item), assert_close)
        except ExecutionError:
            raise
        except Exception as exc:
            raise ExecutionError(
                "correctness",
                f"the output of timed call {item.call} (inputs {item.input_index}) failed its check: "
                f"{type(exc).__name__}: {str(exc)[:500]}",
            ) from exc
        checked += 1
    return checked


def _compare(torch: Any, output: Any, expected: Any, assert_close: Callable[..., None]) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(output, torch.Tensor):
            raise AssertionError(f"a tensor was expected, the call returned {type(output).__name__}")
        assert_close(output, expected, rtol=ROTATED_RTOL, atol=ROTATED_ATOL, equal_nan=True)
    elif isinstance(expected, (tuple, list)):
        if not isinstance(output, (tuple, list)) or len(output) != len(expected):
            raise AssertionError("the call returned a different structure from the first call")
        for got, want in zip(output, expected):
            _compare(torch, got, want, assert_close)
    elif isinstance(expected, dict):
        if not isinstance(output, dict) or output.keys() != expected.keys():
            raise AssertionError("the call returned a different structure from the first call")
        for key, want in expected.items():
            _compare(torch, output[key], want, assert_close)
