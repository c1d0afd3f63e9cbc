"""The GPU lease on a real GPU: held until the holder's process has exited (issue 14, attack 3).

Run on a GPU host: ``python3 -m pytest -q -m gpu tests/gpu/test_slot_gpu.py``. Two slots share
GPU 0; a program that sends RELEASE itself and keeps launching kernels must not share the GPU with
the next program, under either sandbox.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import pytest

from kcoral.sandbox.bubblewrap import SandboxUnavailable, check_bwrap
from tests.gpu.programs import GPU_BUSY, overlapped
from tests.helpers import RunningBroker, run_function, start_broker

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

try:
    check_bwrap()
    BWRAP_ERROR = ""
except SandboxUnavailable as exc:
    BWRAP_ERROR = str(exc)

KERNELS_S = 1.5

THIEF = (
    GPU_BUSY
    + """
import gc, os
import zmq
from kcoral import protocol

def give_back_and_keep_computing(seconds):
    request_id = os.environ["KCORAL_REQUEST_ID"]
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed:
            obj.send_multipart(protocol.message(protocol.RELEASE, {"request_id": request_id}))
    return busy(seconds)
"""
)

NEXT = (
    GPU_BUSY
    + """
torch.zeros(1, device="cuda")  # the context before the lease
"""
)


@pytest.fixture(scope="module", params=["none", "bubblewrap"])
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    if request.param == "bubblewrap" and BWRAP_ERROR:
        pytest.skip(BWRAP_ERROR)
    running = start_broker(
        tmp_path_factory.mktemp(f"slot-gpu-{request.param}"),
        "--sandbox", request.param, "--device", "gpu", "--gpus", "0", "--workers-per-gpu", "2",
    )  # fmt: skip
    yield running
    running.stop()


def test_a_program_that_gives_its_lease_back_keeps_the_gpu_until_it_exits(broker: RunningBroker) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        thief = pool.submit(run_function, broker.url, THIEF, "give_back_and_keep_computing", KERNELS_S)
        time.sleep(KERNELS_S / 3)
        after = pool.submit(run_function, broker.url, NEXT, "span")
        stolen, waited = thief.result(), after.result()
    assert stolen.completed, stolen.error
    assert waited.completed, waited.error
    assert not overlapped(stolen.results["out"], waited.results["out"]), "two programs used the GPU at once"
