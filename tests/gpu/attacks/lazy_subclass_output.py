"""The lazy_subclass_output cheat: deferred into the output; run through benchmark() in the evaluator
on the matmul workload."""

import torch


class Lazy(torch.Tensor):
    _pending = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for arg in args:
            if isinstance(arg, Lazy) and arg._pending is not None:
                a, b = arg._pending
                arg._pending = None
                with torch._C.DisableTorchFunctionSubclass():
                    torch.mm(a, b, out=arg)
        return super().__torch_function__(func, types, args, kwargs or {})


def custom_kernel(a, b):
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device).as_subclass(Lazy)
    out._pending = (a, b)
    with torch._C.DisableTorchFunctionSubclass():
        out.view(-1)[:1].zero_()
    return out
