"""When a finished worker's GPU lease can go back before its exit is through (``gpu_free``).

A process's exit releases its memory before the kernel reports it: 2 to 7 ms for a process with
torch mapped, which, with the lease held until the exit, took fresh workers with 8 in flight from
623 to 290 a second on the two-GPU H200 (a program that never touches its GPU). So once the broker
has a worker's last result, the zygote kills it and all it started and asks here whether the GPU
is already free of them:
- :func:`holds_no_gpu`: none of them has a GPU device open or mapped (a worker with a CUDA context
  still holds the lease until it has exited: its context goes only then). Processes that cannot
  be read count as holding a GPU.
- :func:`past_user_code`, with ``--gpu-handover quiet``: none of them can run code any more: each
  of their threads has left its address space (the kernel drops it on the way out, before it
  closes the process's descriptors, where the driver tears the CUDA context down). A process
  without an address space can push no more work to the GPU; work it pushed before may still be
  on the GPU until the teardown is through, and its GPU memory is freed only then.

Both walk every process below the zygote but the spare, bounded: a walk that stops at its bound
leaves some unread, and then the worker's exit decides.
"""

from __future__ import annotations

import os

from kcoral.worker import confinement, processes


def _worker_tree(worker_pid: int, spare: set[int]) -> list[int] | None:
    """The worker and every process below the zygote but the spare; None where the walk stopped at
    its bound."""
    below = processes.descendants(os.getpid(), processes.WALK_MOST, spare=spare)
    if len(below) > processes.WALK_MOST:
        return None
    return [worker_pid, *below]


def holds_no_gpu(worker_pid: int, spare: set[int]) -> bool | None:
    """Whether none of the finished worker's processes has a GPU device open or mapped; None where
    the walk stopped at its bound (the exit decides then)."""
    tree = _worker_tree(worker_pid, spare)
    if tree is None:
        return None
    return not any(confinement.holds_gpu_device(pid) is not False for pid in tree)


def past_user_code(worker_pid: int, spare: set[int]) -> bool:
    """Whether none of the finished worker's processes can run code any more."""
    tree = _worker_tree(worker_pid, spare)
    return tree is not None and all(processes.past_user_code(pid) for pid in tree)


__all__ = ["holds_no_gpu", "past_user_code"]
