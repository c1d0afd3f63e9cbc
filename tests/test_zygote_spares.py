"""The zygote's choice of its next worker, without forking: where workers make their CUDA context
ahead (eager), a spare is made with one while the slot's programs use the GPU, without one once a
program did not, and the broker's ``kill_worker`` with ``next: lazy`` gets a worker without a context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kcoral.protocol.zygote_link import ZygoteSettings
from kcoral.worker import zygote as zygote_module
from kcoral.worker.children import Child
from kcoral.worker.processes import ProgressBoard
from kcoral.worker.zygote import Zygote


class FakeZygote(Zygote):
    """A zygote whose forks, kills and checks are records."""

    def __init__(self, settings: ZygoteSettings, *, eager_cuda: bool) -> None:
        super().__init__(settings, eager_cuda=eager_cuda)
        self.forks: list[bool] = []
        self.discarded: list[Child] = []

    def fork_worker(self, eager: bool | None = None) -> Child:
        made = self.eager_cuda and self.programs_use_gpu if eager is None else eager
        self.forks.append(made)
        return Child(1000 + len(self.forks), f"w-{len(self.forks)}", None, 0.0, ProgressBoard(), eager=made)

    def discard(self, child: Child) -> None:
        self.discarded.append(child)

    def end_without_gpu(self, child: Child) -> None:
        child.kill_requested = True

    def kill(self, child: Child, reason: str) -> None:
        child.kill_requested = True

    def command(self, **fields: Any) -> None:
        self.on_command(fields)


@pytest.fixture
def slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeZygote:
    monkeypatch.setattr(zygote_module, "emit", lambda event, **fields: None)
    monkeypatch.setattr(zygote_module, "let_go", lambda child: None)
    monkeypatch.setattr(zygote_module, "fit_to_serve", lambda spare, expected: True)
    return FakeZygote(ZygoteSettings(connect="ipc://x", slot=0, gpu=0, workspace=tmp_path), eager_cuda=True)


def test_a_spare_is_forked_ahead_with_its_context_while_programs_use_the_gpu(slot: FakeZygote) -> None:
    slot.announce_next()
    assert slot.forks == [True, True]  # the worker and, ahead, its spare: both with a context
    assert slot.current is not None and slot.spare is not None and slot.spare.eager


def test_a_program_that_did_not_use_the_gpu_makes_the_next_spares_without_a_context(slot: FakeZygote) -> None:
    slot.announce_next()
    assert slot.current is not None
    slot.command(cmd="retire_worker", worker=slot.current.identity, gpu=False)
    slot.current, slot.spare = slot.spare, None  # the worker exited; its spare serves
    slot.fork_spare_ahead()
    assert slot.forks[-1] is False
    lazy = slot.spare
    assert lazy is not None and not lazy.eager
    slot.current = Child(1, "busy-one", None, 0.0, ProgressBoard(), eager=True)
    slot.command(cmd="retire_worker", worker="busy-one", gpu=True)  # this one used it: the lazy spare goes
    assert slot.discarded == [lazy] and slot.spare is not None and slot.spare.eager


def test_kill_with_next_lazy_gives_a_worker_without_a_context(slot: FakeZygote) -> None:
    slot.announce_next()
    assert slot.current is not None and slot.spare is not None
    eager_spare = slot.spare
    slot.command(cmd="kill_worker", worker=slot.current.identity, next="lazy")
    assert slot.lazy_next
    slot.current = None  # its exit was seen
    slot.announce_next()
    assert slot.discarded == [eager_spare]
    assert slot.current is not None and not slot.current.eager  # for the program on other GPUs
    assert slot.spare is not None and slot.spare.eager  # and the one after it has a context again
    assert not slot.lazy_next


def test_a_spare_that_dies_before_its_turn_is_said_gone(slot: FakeZygote, monkeypatch: pytest.MonkeyPatch) -> None:
    # The broker asks for a spare with a program only where it knows of none: a spare killed by the
    # program beside it (or over the memory limit) must be reported, or the slot's next worker is
    # forked on a program's path.
    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(zygote_module, "emit", lambda event, **fields: events.append((str(event), fields)))
    slot.announce_next()
    spare = slot.spare
    assert spare is not None
    slot.on_exit(spare)  # its pid is no child of this process: taken for gone
    assert slot.spare is None
    assert ("spare_gone", {"worker": spare.identity}) in events
    slot.command(cmd="fork_spare")
    assert slot.spare is not None and slot.spare is not spare
