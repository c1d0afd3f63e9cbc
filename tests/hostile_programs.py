"""Hostile programs that more than one place uploads: ``tests/test_hostile.py`` and the campaign
(``benchmarks/campaign.py``). Each is a module's source, with its own imports.
"""

from __future__ import annotations

# flood(seconds, how): PROGRESS from a thread of the program's own, on the worker's socket. how:
# "thread" (a threading.Thread, which goes on after the function returns), "unseen" (started with
# _thread, which threading never lists, and goes on too), "joined" (stopped and joined before the
# function returns: what it queued is still in the socket when the worker sends its RESULT).
FLOOD = """
import _thread, gc, os, threading, time
import zmq
from kcoral import protocol

def flood(seconds, how="thread"):
    # The worker's own socket, found the way any code in its process can find it.
    sockets = [o for o in gc.get_objects() if isinstance(o, zmq.Socket) and not o.closed]
    body = protocol.message(protocol.PROGRESS, {"request_id": os.environ["KCORAL_REQUEST_ID"], "index": 0})

    stop = threading.Event()

    def run():
        while not stop.is_set():
            for sock in sockets:
                try:
                    sock.send_multipart(body, zmq.NOBLOCK)
                except Exception:
                    pass

    # One thread (two on one zmq socket crash libzmq: the program's own doing), which goes on
    # after the function returns, while the worker sends its RESULT (but "joined").
    if how == "unseen":
        _thread.start_new_thread(run, ())
    else:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
    time.sleep(seconds)
    if how == "joined":
        stop.set()
        thread.join()
    return "done"
"""

# populated(mib): memory written in one C call, for the children of a raw clone() of the threaded
# worker, which must not call malloc: another thread of the worker may have held its lock at the
# clone (a child that made a bytes object of its block hung in futex_do_wait, 1 run in 4 here).
POPULATED = """
def populated(mib):
    # Populated by the kernel in one call, written in one C call (the pages the kernel could not
    # charge were left out of the mapping without a word: they fault in now).
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    mapping = mmap.mmap(-1, mib << 20, flags=flags)
    start = ctypes.c_char.from_buffer(mapping)
    ctypes.memset(ctypes.addressof(start), 1, mib << 20)
    del start
    return mapping
"""

# spread(children, mib, hold_s): CLONE_PARENT children, each under the per-process memory limit,
# together over the slot's; returns how many held their block.
SPREAD = (
    """
import ctypes, mmap, os, time
CLONE_PARENT, SIGCHLD, SYS_CLONE = 0x00008000, 17, 56  # x86_64
"""
    + POPULATED
    + """
def spread(children, mib, hold_s):
    # Children of the worker's parent, each under the per-process limit, together over the slot's.
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    for _ in range(children):
        if libc.syscall(SYS_CLONE, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0) == 0:
            try:
                block = populated(mib)
                os.write(w, b"1")
                time.sleep(hold_s)
            finally:
                os._exit(0)
    os.close(w)
    deadline, held = time.monotonic() + hold_s, b""
    while len(held) < children and time.monotonic() < deadline:
        held += os.read(r, children)
    time.sleep(hold_s)
    return len(held)  # how many children held their block
"""
)
