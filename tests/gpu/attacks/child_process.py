"""The child_process cheat (after shared/integrity/cheat_child_process.py): another process; run
through benchmark() in the evaluator on the matmul workload."""

import ctypes
import subprocess
import sys

import torch

_flag = None


def _touch():
    global _flag
    if _flag is None:
        _flag = torch.zeros(1, device="cuda")
    _flag.add_(1.0)


_CHILD = r"""
import ctypes, sys
import torch

torch.zeros(1, device="cuda")
torch.cuda.synchronize()
cu = ctypes.CDLL("libcuda.so.1")


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


opener = getattr(cu, "cuIpcOpenMemHandle_v2", None) or cu.cuIpcOpenMemHandle
opener.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
opener.restype = ctypes.c_int
DTYPES = {"bfloat16": ("<i2", torch.bfloat16), "float16": ("<f2", None), "float32": ("<f4", None)}


class Cai:
    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 2, "strides": None,
        }


bases, tensors = {}, {}
print("ready", flush=True)
for line in sys.stdin:
    parts = line.split()
    try:
        if parts[0] == "map":
            name, hexhandle, offset, dtype, shape = parts[1], parts[2], int(parts[3]), parts[4], parts[5]
            base = bases.get(hexhandle)
            if base is None:
                ptr = ctypes.c_uint64()
                rc = opener(ctypes.byref(ptr), Handle.from_buffer_copy(bytes.fromhex(hexhandle)), 1)
                if rc != 0:
                    raise RuntimeError(f"cuIpcOpenMemHandle returned {rc}")
                base = bases[hexhandle] = ptr.value
            typestr, view = DTYPES[dtype]
            dims = [int(d) for d in shape.split(",")]
            t = torch.as_tensor(Cai(base + offset, dims, typestr), device="cuda")
            tensors[name] = t.view(view) if view is not None else t
            print("ok", flush=True)
        elif parts[0] == "mm":
            torch.mm(tensors[parts[1]], tensors[parts[2]], out=tensors[parts[3]])
            torch.cuda.synchronize()
            print("done", flush=True)
        else:
            break
    except Exception as exc:
        print("error " + repr(exc).replace(chr(10), " "), flush=True)
"""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_cu = None
_child = None
_names: dict[object, object] = {}
_handles: dict[object, object] = {}
_outputs: dict[object, object] = {}


def _driver():
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
        _cu.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        _cu.cuMemGetAddressRange_v2.restype = ctypes.c_int
        _cu.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        _cu.cuIpcGetMemHandle.restype = ctypes.c_int
    return _cu


def _export(t):
    """IPC handle (hex) of the cudaMalloc allocation holding t, and t's offset in it."""
    cu = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange_v2 returned {rc}")
    hexhandle = _handles.get(base.value)  # one handle per allocation, so the child opens it once
    if hexhandle is None:
        handle = _Handle()
        rc = cu.cuIpcGetMemHandle(ctypes.byref(handle), base)
        if rc != 0:
            raise RuntimeError(f"cuIpcGetMemHandle returned {rc} (expandable segments? IPC blocked?)")
        hexhandle = _handles[base.value] = bytes(handle.reserved).hex()
    return hexhandle, t.data_ptr() - base.value


def _ask(command, expect):
    _child.stdin.write(command + "\n")
    _child.stdin.flush()
    reply = _child.stdout.readline().strip()
    if reply != expect:
        raise RuntimeError(f"child answered {reply!r} to {command.split()[0]!r}")


def _start():
    global _child
    if _child is not None and _child.poll() is None:
        return
    _child = subprocess.Popen(
        [sys.executable, "-u", "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    line = _child.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"child did not start: {line!r}")


def _share(t):
    key = (t.data_ptr(), t.numel(), str(t.dtype))
    name = _names.get(key)
    if name is None:
        name = f"t{len(_names)}"
        hexhandle, offset = _export(t)
        dtype = str(t.dtype).removeprefix("torch.")
        shape = ",".join(str(d) for d in t.shape)
        _ask(f"map {name} {hexhandle} {offset} {dtype} {shape}", "ok")
        _names[key] = name
    return name


def custom_kernel(a, b):
    _start()
    key = (a.data_ptr(), b.data_ptr())
    out = _outputs.get(key)
    if out is None:
        out = _outputs[key] = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    _ask(f"mm {_share(a)} {_share(b)} {_share(out)}", "done")  # host wait: not GPU activity here
    _touch()
    return out
