"""The honest candidate of the matmul workload, timed before each cheat."""

import torch


def custom_kernel(a, b):
    return torch.mm(a, b)
