"""A small workload of this suite's own: out = relu(x @ w).sum(dim=1), x 512x1024 and w 1024x1024 in
float32 (one fp32 GEMM of 1 GFLOP and a row sum: some 20-30 us on an H200), output 512 floats.

Why it is here: its output is 2 KiB, so a candidate that knew the seeds of every call (they were in
the runner's command line before the harness kept them) could precompute a table of outputs for
tens of thousands of calls in a few megabytes, which the 32 MiB outputs of the matmul example do
not allow (``attacks/argv_seed_precompute.py`` of the attack suite). Inputs are made on the GPU from the seed, as in the
examples; TF32 stays off (torch's default), so the candidate's GEMM and the reference's agree to
float32 rounding.

    kcoral remote -- workloads/small_mlp workloads/small_mlp/candidate.py
"""

import torch

NAME = "small_mlp_512x1024"
ROWS = 512
FEATURES = 1024
TIMING = {"warmup_ms": 25, "repeat_ms": 100}
TOLERANCE = {"rtol": 1e-4, "atol": 1e-3}


def make_inputs(seed: int):
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, device="cuda", generator=generator)
    w = torch.randn(FEATURES, FEATURES, device="cuda", generator=generator) * FEATURES**-0.5
    return x, w


def reference(x, w):
    return torch.relu(x @ w).sum(dim=1)
