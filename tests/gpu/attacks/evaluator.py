"""The evaluator of the benchmark() path: the inputs, then benchmark() of a candidate."""

import torch

from kcoral.builtins import benchmark

KEEP = (
    "latency_ms_median",
    "host_ms_median",
    "method",
    "cupti_error",
    "integrity",
    "inputs",
    "outputs_checked",
    "activities_per_call",
    "integrity_details",
)


def make_inputs(workload, seed):
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    if workload == "matmul":  # 4096^3 bf16: ~0.18 ms on an H200
        scale = 4096**-0.25
        a = (torch.randn(4096, 4096, device="cuda", generator=generator) * scale).to(torch.bfloat16)
        b = (torch.randn(4096, 4096, device="cuda", generator=generator) * scale).to(torch.bfloat16)
        return (a, b)
    if workload == "reduce":  # 16 MiB: fits the L2, so a skipped flush shows
        return (torch.randn(4 << 20, device="cuda", generator=generator),)
    raise ValueError(workload)


def timed(candidate, workload, config):
    inputs = make_inputs(workload, 1234)
    candidate(*inputs)
    torch.cuda.synchronize()
    report = benchmark(candidate, *inputs, config=config)
    return {key: report.get(key) for key in KEEP}
