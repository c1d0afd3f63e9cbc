"""The tasks a service runs beside its main loop, and the one way to stop them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

import structlog

log = structlog.get_logger("kcoral.tasks")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended. What they raise is not raised here
    (a :class:`TaskSet` logs it as each task ends)."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


class TaskSet:
    """Tasks started by one owner (a service, a relay, a supervisor), stopped together.

    A task that ends by an exception is logged when it ends, not when the owner stops: a receive
    loop that died would otherwise go unnoticed until then.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coroutine: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", task=task.get_name(), error=repr(task.exception()))

    async def cancel_all(self) -> None:
        """Cancel every task and wait for them to end; idempotent."""
        await cancel_and_wait(list(self._tasks))


__all__ = ["TaskSet", "cancel_and_wait"]
