"""GPU tests through a real broker: the seed's program, cpu_only enforcement, a poisoned CUDA context,
and a side-stream candidate (skipped without a CUDA GPU).

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_service_gpu.py``. The broker serves
the host's GPUs with one worker each, in bubblewrap where bwrap runs (as the broker's defaults do).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from kcoral import Client, Program, ProgramResult
from tests.helpers import RunningBroker, start_broker

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_cupti = pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python")

PROGRAM_TIMEOUT_S = 120

# The seed's uploaded module, unchanged.
SEED_SOURCE = """
import torch
from kcoral.builtins import benchmark

def evaluate(n):
    x = torch.arange(n, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)

    def candidate():
        torch.add(x, 1.0, out=y)

    candidate()
    torch.testing.assert_close(y, x + 1.0)
    return {"correct": True, "timing": benchmark(candidate)}
"""

CPU_ONLY_SOURCE = """
import torch

def touch_the_gpu():
    return float(torch.zeros(1, device="cuda").sum())

def count_on_the_cpu(n):
    return int(torch.arange(n).sum())
"""

# Reads 4 TiB past a one-float allocation: an unmapped address, so the kernel faults with an illegal
# address and the context is unusable afterwards. CuPy compiles it with NVRTC; Triton is the fallback.
ILLEGAL_ADDRESS_SOURCE = '''
import torch

FAR = 1 << 40


def _launch_cupy(base, out):
    import cupy

    kernel = cupy.RawKernel(
        r"""
        extern "C" __global__ void read_far(const float* base, float* out) {
            out[0] = base[1ull << 40];
        }
        """,
        "read_far",
    )
    kernel((1,), (1,), (cupy.asarray(base), cupy.asarray(out)))


def _launch_triton(base, out):
    import triton
    import triton.language as tl

    @triton.jit
    def read_far(base_ptr, out_ptr, far):
        tl.store(out_ptr, tl.load(base_ptr + far))

    read_far[(1,)](base, out, FAR)


def read_out_of_bounds():
    base = torch.zeros(1, device="cuda")
    out = torch.zeros(1, device="cuda")
    try:
        _launch_cupy(base, out)
    except ImportError:
        _launch_triton(base, out)
    torch.cuda.synchronize()
    return float(out.item())
'''

ADD_SOURCE = """
import torch

def add_on_the_gpu(n):
    x = torch.arange(n, device="cuda", dtype=torch.float32)
    return float((x + 1.0).sum())
"""

SIDE_STREAM_SOURCE = """
import torch
from kcoral.builtins import benchmark

def time_side_stream(method):
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    product = torch.empty_like(x)
    side = torch.cuda.Stream()

    def candidate():
        with torch.cuda.stream(side):
            torch.mm(x, y, out=product)

    return benchmark(candidate, config={"method": method, "repeat": 50})
"""


def _sandbox_flag() -> str:
    from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap

    try:
        check_bwrap()
    except SandboxUnavailable:
        return "none"
    return "bubblewrap"


@pytest.fixture(scope="module")
def gpu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    broker = start_broker(tmp_path_factory.mktemp("gpu-broker"), "--sandbox", _sandbox_flag())
    yield broker
    broker.stop()


@pytest.fixture
def gpu_client(gpu_broker: RunningBroker) -> Iterator[Client]:
    with Client(gpu_broker.url) as client:
        yield client


def _run(client: Client, source: str, name: str, args: list[Any], *, cpu_only: bool = False) -> ProgramResult:
    program = Program()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name, cpu_only=cpu_only)
    program.return_(key="value", value=program.run(fn=fn, args=args))
    return client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)


def test_seed_example_reports_correct_and_a_timing(gpu_client: Client) -> None:
    program = Program()
    module = program.upload(kind="module", source=SEED_SOURCE)
    evaluate = program.get_function(module=module, name="evaluate")
    report = program.run(fn=evaluate, args=[4096])
    program.return_(key="report", value=report)
    result = gpu_client.execute(program, timeout_seconds=PROGRAM_TIMEOUT_S)
    assert result.completed, result.error
    report_value = result.results["report"]
    assert report_value["correct"] is True
    timing = report_value["timing"]
    print(f"\nseed: median {timing['latency_ms_median'] * 1e3:.2f} us by {timing['method']}")
    assert timing["method"] in ("cupti", "cuda_event")
    assert 0 < timing["latency_ms_median"] < 1.0
    assert result.gpu_ids and result.lease_held_ms > 0


def test_cpu_only_function_that_uses_cuda_fails_with_gpu_access(gpu_client: Client) -> None:
    refused = _run(gpu_client, CPU_ONLY_SOURCE, "touch_the_gpu", [], cpu_only=True)
    assert refused.status == "FAILED"
    assert refused.error is not None
    print(f"\ncpu_only: {refused.error['kind']}: {refused.error['message']}")
    assert refused.error["kind"] == "gpu_access", refused.error
    assert "touch_the_gpu" in refused.error["message"]
    assert refused.lease_held_ms == 0
    allowed = _run(gpu_client, CPU_ONLY_SOURCE, "count_on_the_cpu", [10], cpu_only=True)
    assert allowed.completed, allowed.error
    assert allowed.results["value"] == 45


def test_illegal_address_fails_its_program_and_the_next_program_completes(
    gpu_client: Client, gpu_broker: RunningBroker
) -> None:
    if importlib.util.find_spec("cupy") is None and importlib.util.find_spec("triton") is None:
        pytest.skip("needs cupy or triton to launch a faulting kernel")
    crashed = _run(gpu_client, ILLEGAL_ADDRESS_SOURCE, "read_out_of_bounds", [])
    # The next programs land on a fresh worker with a fresh context.
    after = [_run(gpu_client, ADD_SOURCE, "add_on_the_gpu", [1000]) for _ in range(2)]
    assert crashed.status == "FAILED"
    assert crashed.error is not None
    print(f"\nillegal address: {crashed.error['kind']}: {crashed.error['message'][:200]}")
    for result in after:
        assert result.completed, result.error
        assert result.results["value"] == pytest.approx(500500.0)
    assert "illegal" in crashed.error["message"].lower(), (crashed.error, crashed.stderr, gpu_broker.log()[-4000:])


@needs_cupti
def test_side_stream_candidate_is_timed_at_its_real_cost(gpu_client: Client) -> None:
    by_cupti = _run(gpu_client, SIDE_STREAM_SOURCE, "time_side_stream", ["cupti"])
    by_events = _run(gpu_client, SIDE_STREAM_SOURCE, "time_side_stream", ["cuda_event"])
    assert by_cupti.completed, by_cupti.error
    assert by_events.completed, by_events.error
    cupti_ms = by_cupti.results["value"]["latency_ms_median"]
    events_ms = by_events.results["value"]["latency_ms_median"]
    print(f"\nside stream: cupti {cupti_ms * 1e3:.1f} us, cuda events {events_ms * 1e3:.1f} us")
    assert cupti_ms > 0.1  # a 4096^3 bf16 matmul: ~0.18 ms on an H200
    assert events_ms < 0.5 * cupti_ms  # what events see of work on a stream they do not wait for
