"""The cuda_graph cheat (after shared/integrity/cheat_cuda_graph.py): replay; run through benchmark()
in the evaluator on the matmul workload."""

import torch

_graphs: dict[object, object] = {}


def custom_kernel(a, b):
    key = (a.data_ptr(), b.data_ptr())
    entry = _graphs.get(key)
    if entry is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            torch.mm(a, b, out=out)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mm(a, b, out=out)
        _graphs.clear()
        entry = _graphs[key] = (graph, out)
    entry[0].replay()
    return entry[1]
